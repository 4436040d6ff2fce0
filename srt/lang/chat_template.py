"""Role boundaries (`with s.user(): ...`) rendered through the model's own chat template.

A frontend program writes a conversation one piece at a time, so it needs each role's text
before and after the content. `RoleTemplate` gets them from the Jinja template the server uses
(`managers.template_manager.TemplateManager`): it renders the conversation so far with and
without one more message whose content is a sentinel, and splits the difference around it.
A template that adds a default system message, a BOS token or trims content is handled the
same way, so the program's text is what `/v1/chat/completions` would have rendered.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Tuple

_SENTINEL = "\u2063sgl-content\u2063"


class RoleTemplate:
    def __init__(self, manager: Any):  # a managers.template_manager.TemplateManager
        self.manager = manager
        self.source = manager.source
        self._cache: Dict[Tuple[Tuple[str, ...], str], Tuple[str, str]] = {}
        self._lock = threading.Lock()
        bos = getattr(manager.tokenizer, "bos_token", None)
        self._bos = bos if isinstance(bos, str) and bos else None
        self.stop_str: List[str] = []  # the end of an assistant turn: a stop for gens inside one
        for history in ((), ("user",)):
            try:
                end = self.affixes(history, "assistant")[1].strip()
            except ValueError:
                continue
            self.stop_str = [end] if end else []
            break

    def affixes(self, history: Tuple[str, ...], role: str) -> Tuple[str, str]:
        """(text before, text after) one message of `role` that follows messages of `history` roles."""
        key = (tuple(history), role)
        with self._lock:
            if key not in self._cache:
                self._cache[key] = self._render_affixes(*key)
            return self._cache[key]

    def _render_affixes(self, history: Tuple[str, ...], role: str) -> Tuple[str, str]:
        msgs = [{"role": r, "content": "x"} for r in history]
        try:
            before = self.manager.apply(msgs, add_generation_prompt=False) if msgs else ""
            after = self.manager.apply(msgs + [{"role": role, "content": _SENTINEL}], add_generation_prompt=False)
        except Exception as exc:
            raise ValueError(f"The chat template ({self.source}) cannot render a {role!r} message after "
                             f"{list(history) or 'no messages'}: {exc}") from exc
        if not after.startswith(before) or after.count(_SENTINEL) != 1:
            raise ValueError(f"The chat template ({self.source}) rewrites earlier messages when a {role!r} "
                             "message is added, so it cannot be rendered one message at a time.")
        prefix, suffix = after[len(before):].split(_SENTINEL)
        if not history and self._bos and prefix.startswith(self._bos):
            prefix = prefix[len(self._bos):]  # the server's tokenizer adds BOS itself
        return prefix, suffix


def load_role_template(tokenizer: Any, chat_template: Optional[str], model_path: Optional[str]) -> Optional[RoleTemplate]:
    """The role template for a tokenizer, `--chat-template`-style override, or None without one."""
    from managers.template_manager import TemplateManager  # imported late: it pulls in torch
    manager = TemplateManager.load(tokenizer, chat_template, model_path)
    return RoleTemplate(manager) if manager.chat_template is not None else None
