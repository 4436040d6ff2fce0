"""One JSON error shape for every route (OpenAI's): {"error": {message, type, param, code}}."""

from __future__ import annotations

from typing import Optional

import orjson
from aiohttp import web

from srt.utils.bounded_repr import bound_message

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 499: "client_closed_request", 503: "service_unavailable"}


def error_body(status: int, message: str, code: Optional[str] = None, param: Optional[str] = None,
               err_type: Optional[str] = None) -> dict:
    return {"error": {"message": bound_message(message), "type": err_type or _TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def json_error(status: int, message: str, code: Optional[str] = None, param: Optional[str] = None,
               err_type: Optional[str] = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(error_body(status, message, code, param, err_type)),
                        content_type="application/json")
