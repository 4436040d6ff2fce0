"""`GET /v1/models` and `GET /v1/models/{id}`: the served model's card, with its length limits."""

from __future__ import annotations

from typing import Any, Dict

from aiohttp import web

from managers.generate_input import RequestLimits
from srt.entrypoints.http_errors import json_error
from srt.entrypoints.openai.common import json_response
from srt.entrypoints.openai.protocol import model_matches

OWNED_BY = "radix-serve"


def model_card(state: Any) -> Dict[str, Any]:
    """`max_model_len` is the longest request (prompt + completion) served exactly as asked
    (`RequestLimits`, the numbers admission applies); the context length and the scheduler's input
    cap (bounded by the KV pool) are reported beside it."""
    info = state.scheduler_info
    limits = RequestLimits.from_scheduler_info(info)
    return {"id": state.model_name, "object": "model", "created": int(state.started_time), "owned_by": OWNED_BY,
            "root": getattr(state.server_args, "model_path", None) or state.model_name, "parent": None,
            "max_model_len": limits.max_model_len, "context_length": info.context_len,
            "max_req_input_len": info.max_req_input_len}


async def handle_list_models(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": [model_card(request.app["state"])]})


async def handle_get_model(request: web.Request) -> web.Response:
    state = request.app["state"]
    model_id = request.match_info["model_id"]
    if model_matches(model_id, state.model_name, getattr(state.server_args, "model_path", None)):
        return json_response(model_card(state))
    return json_error(404, f"The model '{model_id}' does not exist. This server serves '{state.model_name}'.",
                      code="model_not_found", param="model", err_type="invalid_request_error")
