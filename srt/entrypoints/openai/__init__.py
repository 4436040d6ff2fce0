"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

Handlers read `app["state"]` (a `ServerState`) at request time, so the routes can be registered
before the runtime finished starting.
"""

from __future__ import annotations

from aiohttp import web

from srt.entrypoints.openai.serving_chat import handle_chat
from srt.entrypoints.openai.serving_completions import handle_completions
from srt.entrypoints.openai.serving_models import handle_get_model, handle_list_models

__all__ = ["register_openai_routes"]


def register_openai_routes(app: web.Application) -> None:
    """Add the OpenAI routes to `app` (model ids may contain slashes: they are model paths)."""
    app.router.add_post("/v1/completions", handle_completions)
    app.router.add_post("/v1/chat/completions", handle_chat)
    app.router.add_get("/v1/models", handle_list_models)
    app.router.add_get("/v1/models/{model_id:.+}", handle_get_model)
