"""Run programs on an in-process `srt.entrypoints.engine.Engine` (no HTTP, same requests)."""

from __future__ import annotations

from typing import Any, Dict, Iterator

from srt.lang.backend.base_backend import BackendError, BaseBackend
from srt.lang.chat_template import RoleTemplate


class EngineBackend(BaseBackend):
    def __init__(self, engine: Any):
        self.engine = engine
        template = engine.frontend.template
        self.chat_template = RoleTemplate(template) if template.chat_template is not None else None

    def _call(self, body: Dict[str, Any], stream: bool):
        body = dict(body)
        body.pop("stream", None)
        text, input_ids, params = body.pop("text", None), body.pop("input_ids", None), body.pop("sampling_params")
        return self.engine.generate(prompt=text, input_ids=input_ids, sampling_params=params, stream=stream, **body)

    def _generate(self, body: Dict[str, Any]) -> Any:
        from managers.generate_input import RequestError

        try:
            return self._call(body, stream=False)
        except RequestError as exc:
            raise BackendError(exc.message, exc.status_code) from None

    def _generate_stream(self, body: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
        from managers.generate_input import RequestError

        try:
            yield from self._call(body, stream=True)
        except RequestError as exc:
            raise BackendError(exc.message, exc.status_code) from None

    def flush_cache(self) -> Any:
        return self.engine.flush_cache()

    def get_server_info(self) -> Dict[str, Any]:
        return self.engine.get_server_info()

    def get_model_name(self) -> str:
        return str(self.engine.server_args.model_path)
