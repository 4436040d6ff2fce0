"""The grammar interface the scheduler uses (SGLang's shape).

A backend compiles a grammar once per distinct key (`("regex", pattern)`, `("json", schema)`,
`("ebnf", grammar)`), off the scheduler loop in a worker thread, and caches it. Each request gets
its own matcher from the compiled grammar: it fills the disallowed-token mask of its row, accepts
each sampled token, can roll back, and says when the grammar has terminated.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

import torch

logger = logging.getLogger(__name__)

GrammarKey = Tuple[str, str]
GRAMMAR_FIELDS = {"regex": "regex", "json": "json_schema", "ebnf": "ebnf", "structural_tag": "structural_tag"}


class GrammarError(ValueError):
    """A grammar that does not compile: `field` is the request field, the text the compiler's."""

    def __init__(self, field: str, message: str):
        super().__init__(f"sampling_params.{field} does not compile: {message}")
        self.field = field


class BaseGrammarObject:
    """One request's matcher."""

    def fill_vocab_mask(self, mask_row: torch.Tensor) -> None:
        """Set True at every token id the grammar forbids next (`mask_row` is [vocab] bool, CPU)."""
        raise NotImplementedError

    def accept_token(self, token: int) -> bool:
        raise NotImplementedError

    def rollback(self, num_tokens: int) -> None:
        raise NotImplementedError

    def is_terminated(self) -> bool:
        raise NotImplementedError

    def copy(self) -> "BaseGrammarObject":
        raise NotImplementedError


def fill_vocab_masks(grammars: List[BaseGrammarObject], mask: torch.Tensor) -> None:
    """Rows of `mask` [len(grammars), vocab] (bool, CPU): True where each matcher forbids the token.
    Matchers that expose their packed bitmask (`bitmask_bytes`) are unpacked together in one op."""
    packed = [g.bitmask_bytes() if hasattr(g, "bitmask_bytes") else None for g in grammars]
    batched = [i for i, b in enumerate(packed) if b is not None]
    for i, g in enumerate(grammars):
        if packed[i] is None:
            g.fill_vocab_mask(mask[i])
    if not batched:
        return
    words = torch.frombuffer(bytearray(b"".join(packed[i] for i in batched)), dtype=torch.int32)
    words = words.view(len(batched), -1)
    allowed = ((words[:, :, None] >> _BITS) & 1).view(len(batched), -1)
    vocab = mask.shape[1]
    width = min(vocab, allowed.shape[1])
    rows = torch.tensor(batched, dtype=torch.int64, device="cpu")
    mask[rows, :width] = allowed[:, :width] == 0
    if width < vocab:
        mask[rows, width:] = True


_BITS = torch.arange(32, dtype=torch.int32, device="cpu")


class BaseGrammarBackend:
    """Compile-once cache in front of `_compile`; compiles run in a thread (never on the loop)."""

    def __init__(self, workers: int = 1):
        self._cache: Dict[GrammarKey, Future] = {}
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="srt-grammar")

    def get_future(self, key: GrammarKey) -> Future:
        """The (possibly running) compile of `key`; its result is a template matcher to `copy()`."""
        future = self._cache.get(key)
        if future is None:
            future = self._pool.submit(self._compile, key)
            self._cache[key] = future
        return future

    def compile_now(self, key: GrammarKey) -> BaseGrammarObject:
        return self.get_future(key).result()

    def _compile(self, key: GrammarKey) -> BaseGrammarObject:
        """The template matcher of `key`. Raises `GrammarError` only when the client's text does not
        compile (a 400); any other exception is the backend's own fault and must surface as one."""
        raise NotImplementedError

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def grammar_key(sampling_params) -> Optional[GrammarKey]:
    """The grammar a request asks for (at most one of regex / json_schema / ebnf), or None."""
    if sampling_params.regex is not None:
        return ("regex", sampling_params.regex)
    if sampling_params.json_schema is not None:
        return ("json", sampling_params.json_schema)
    if sampling_params.ebnf is not None:
        return ("ebnf", sampling_params.ebnf)
    if getattr(sampling_params, "structural_tag", None) is not None:
        return ("structural_tag", sampling_params.structural_tag)
    return None


def create_grammar_backend(name: str, tokenizer, vocab_size: int) -> BaseGrammarBackend:
    if name in ("llguidance", "auto"):
        from srt.constrained.llguidance_backend import GuidanceBackend

        return GuidanceBackend(tokenizer, vocab_size)
    raise ValueError(f"Invalid --grammar-backend {name!r}. Accepted values: llguidance.")
