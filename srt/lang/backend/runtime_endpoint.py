"""`RuntimeEndpoint`: run programs against a server's native API over HTTP.

The server's chat template is loaded, on a program's first role, from its tokenizer directory
(named by `/get_model_info`) when this machine can read it, with the server's own `--chat-template` if it has one;
`chat_template_name` (a built-in name such as `chatml`, or a Jinja file) overrides both.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import urllib.error
import urllib.request
from typing import Any, Dict, Iterator, Optional

from srt.lang.backend.base_backend import BackendError, BaseBackend
from srt.lang.chat_template import load_role_template

logger = logging.getLogger(__name__)


class RuntimeEndpoint(BaseBackend):
    def __init__(self, base_url: str, api_key: Optional[str] = None, chat_template_name: Optional[str] = None,
                 timeout: Optional[float] = 600.0):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.model_info = self._request("GET", "/get_model_info")
        self.chat_template_name = chat_template_name
        self._template_lock = threading.Lock()
        self._template_loaded = False

    def get_chat_template(self):
        """Loaded on first use (a role, or a gen inside one): loading a tokenizer takes seconds."""
        with self._template_lock:
            if not self._template_loaded:
                self.chat_template = self._load_template(self.chat_template_name)
                self._template_loaded = True
        return self.chat_template

    def _load_template(self, chat_template_name: Optional[str]):
        from srt.utils.hf_transformers_utils import get_tokenizer

        path = self.model_info.get("tokenizer_path") or self.model_info.get("model_path")
        try:
            server_template = self.get_server_info().get("chat_template")
            tokenizer = get_tokenizer(path)
        except Exception as exc:  # a remote server whose files this machine cannot read
            if chat_template_name:
                raise ValueError(f"chat_template_name={chat_template_name!r} needs the server's tokenizer "
                                 f"({path!r}) on this machine: {exc}") from exc
            logger.warning("No chat template for %s (cannot load its tokenizer %r here: %s); programs that use "
                           "roles will fail.", self.base_url, path, exc)
            return None
        return load_role_template(tokenizer, chat_template_name or server_template,
                                  self.model_info.get("model_path") if os.path.isdir(str(path)) else None)

    # --------------------------------------------------------------- HTTP
    def _open(self, method: str, route: str, body: Optional[Dict[str, Any]]):
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + route, data=data, headers=headers, method=method)
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            raise BackendError(_error_message(exc.read()), exc.code) from None
        except (urllib.error.URLError, OSError) as exc:
            raise BackendError(f"cannot reach {self.base_url}{route}: {exc}", 503) from None

    def _request(self, method: str, route: str, body: Optional[Dict[str, Any]] = None) -> Any:
        with self._open(method, route, body) as resp:
            return json.loads(resp.read())

    def _generate(self, body: Dict[str, Any]) -> Any:
        return self._request("POST", "/generate", body)

    def _generate_stream(self, body: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
        with self._open("POST", "/generate", body) as resp:
            for raw in resp:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    return
                event = json.loads(payload)
                if "error" in event and "text" not in event:
                    err = event["error"]
                    raise BackendError(err.get("message", str(err)), int(err.get("status_code") or 500))
                yield event

    def flush_cache(self) -> Any:
        return self._request("POST", "/flush_cache")

    def get_server_info(self) -> Dict[str, Any]:
        return self._request("GET", "/get_server_info")

    def get_model_name(self) -> str:
        return self.model_info.get("model_path", "")


def _error_message(raw: bytes) -> str:
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return err["message"]
        if "message" in body:
            return str(body["message"])
    return json.dumps(body)
