"""The scheduler's side of constrained decoding: each request with regex / json_schema / ebnf
waits in the queue until its grammar has compiled (in the backend's thread, so a slow compile
never stalls the running batch), then gets its own matcher. A grammar that fails to compile
aborts its request with 400 and the compiler's message."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from managers.finish_reason import FINISH_ABORT
from srt.constrained.base_grammar_backend import BaseGrammarBackend, GrammarError, create_grammar_backend, grammar_key

if TYPE_CHECKING:
    from managers.req import Req
    from managers.scheduler import Scheduler

logger = logging.getLogger(__name__)


class GrammarManager:
    def __init__(self, scheduler: "Scheduler"):
        self.s = scheduler
        self._backend: Optional[BaseGrammarBackend] = None

    @property
    def backend(self) -> BaseGrammarBackend:
        if self._backend is None:  # built on the first constrained request (the tokenizer scan takes ~1 s)
            name = getattr(self.s.server_args, "grammar_backend", "llguidance")
            self._backend = create_grammar_backend(name, self.s.tokenizer, self.s.runner.model_config.vocab_size)
        return self._backend

    def ready(self, req: "Req") -> bool:
        """True when `req` can be scheduled: unconstrained, or its matcher is attached."""
        if req.grammar is not None or getattr(req, "internal", False):
            return True
        key = grammar_key(req.sampling_params)
        if key is None or req.sampling_params.max_new_tokens == 0:
            return True
        future = self.backend.get_future(key)
        if not future.done():
            return False
        try:
            req.grammar = future.result().copy()
        except GrammarError as exc:
            self.s.waiting_queue.remove(req)
            req.finished_reason = FINISH_ABORT(str(exc), 400)
            self.s._stream([req])
            return False
        # A request retracted before its grammar arrived has generated nothing; one retracted
        # after keeps its matcher, which has consumed exactly its output ids.
        for token in req.output_ids:
            req.grammar.accept_token(token)
        return True
