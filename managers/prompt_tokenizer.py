"""Prompt tokenization for the tokenizer manager: bounded (a prompt that is certainly longer than
the context length is tokenized only as far as needed to prove it) and kept off the event loop for
long texts and big batches, in one worker thread that owns a copy of the tokenizer."""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, List, Optional

# Tokenizing a prefix of a text cut at whitespace gives the text's own first tokens except for the
# last few before the cut: a prefix this many tokens over the limit proves the text is over it.
CUT_SLACK_TOKENS = 8
# Texts up to this many characters are always tokenized whole (cheap), so their length is exact.
WHOLE_TEXT_CHARS = 1 << 16


@dataclass
class Encoded:
    """A prompt's token ids. `complete` is False when tokenizing stopped early because the prompt
    is certainly longer than the limit: `ids` are then its first tokens (more than the limit of
    them) and `at_least` a lower bound of its full length."""

    ids: List[int]
    complete: bool = True
    at_least: int = 0

    @property
    def length(self) -> int:
        return len(self.ids) if self.complete else self.at_least


def encode_bounded(tokenizer: Any, text: str, limit: int, add_special_tokens: bool = True) -> Encoded:
    """`text`'s token ids, or, when it certainly has `limit` tokens or more, those of a prefix.

    Every token covers at least one UTF-8 byte, so a text with fewer bytes (plus special tokens)
    than `limit` is tokenized whole at once, and so is any text of up to WHOLE_TEXT_CHARS or
    4 x `limit` characters. A longer one is tokenized by growing prefixes, cut at whitespace, until a
    prefix alone has `limit + CUT_SLACK_TOKENS` tokens or is the whole text: refusing a 10 MB
    prompt costs a few times `limit` tokens of work, not 10 MB of it.
    """
    try:
        specials = tokenizer.num_special_tokens_to_add() if add_special_tokens else 0
    except (AttributeError, TypeError):
        specials = 2
    utf8_len = len(text) if text.isascii() else len(text.encode("utf-8"))
    end = len(text) if utf8_len + specials < limit else min(len(text), max(4 * limit, WHOLE_TEXT_CHARS))
    while True:
        end = _cut_at_whitespace(text, end)
        ids = encode(tokenizer, text if end >= len(text) else text[:end], add_special_tokens)
        if end >= len(text):
            return Encoded(ids)
        if len(ids) >= limit + CUT_SLACK_TOKENS:
            return Encoded(ids, complete=False, at_least=len(ids) - CUT_SLACK_TOKENS)
        guess = int(end * (limit + CUT_SLACK_TOKENS) / max(len(ids), 1) * 1.25)  # characters per token so far
        end = min(len(text), max(2 * end, guess))


def _cut_at_whitespace(text: str, end: int) -> int:
    """`end`, moved back to just before a space or newline within its last quarter (at most 256
    characters back) so that the cut falls between words; `end` itself when there is none."""
    if end >= len(text):
        return len(text)
    lo = max(end - 256, (3 * end) // 4)
    cut = max(text.rfind(" ", lo, end), text.rfind("\n", lo, end))
    return cut if cut > lo else end


def encode(tokenizer: Any, text: str, add_special_tokens: bool = True) -> List[int]:
    # verbose=False: over-long inputs get our own context-length error, not transformers' warning.
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens, verbose=False))


class PromptTokenizer:
    """Bounded tokenization of the texts of one call: on the event loop when they add up to at
    most `threshold` characters, else in the worker thread, about `threshold` characters per
    hand-off, so that other requests' updates flow between the pieces of a big batch."""

    def __init__(self, tokenizer: Any, limit: int, threshold: int):
        self.tokenizer = tokenizer
        self.limit = limit
        self.threshold = threshold
        self.executor: Optional[ThreadPoolExecutor] = None
        self.worker_tokenizer: Any = None  # the worker's own copy

    async def encode(self, text: str, add_special_tokens: bool = True) -> Encoded:
        [enc] = await self.encode_many([text], add_special_tokens)
        return enc

    async def encode_many(self, texts: List[str], add_special_tokens: bool = True) -> List[Encoded]:
        if sum(len(text) for text in texts) <= self.threshold:
            return [encode_bounded(self.tokenizer, text, self.limit, add_special_tokens) for text in texts]
        out: List[Encoded] = []
        group: List[str] = []
        size = 0
        for k, text in enumerate(texts):
            group.append(text)
            size += len(text)
            if size >= self.threshold or k == len(texts) - 1:
                out += await self._in_worker(group, add_special_tokens)
                group, size = [], 0
        return out

    async def _in_worker(self, texts: List[str], add_special_tokens: bool) -> List[Encoded]:
        if self.executor is None:
            self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        return await asyncio.get_running_loop().run_in_executor(self.executor, self._encode_in_worker, texts,
                                                                 add_special_tokens)

    def _encode_in_worker(self, texts: List[str], add_special_tokens: bool) -> List[Encoded]:
        # A Rust tokenizer used from two threads at once can fail with "Already borrowed".
        if self.worker_tokenizer is None:
            self.worker_tokenizer = copy.deepcopy(self.tokenizer)
        return [encode_bounded(self.worker_tokenizer, text, self.limit, add_special_tokens) for text in texts]

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
            self.executor = None
