"""`ReqOutput`: one output's cumulative text, ids and logprobs in the tokenizer manager, rebuilt
from the detokenizer's incremental updates (each piece is written at the offset it carries)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List

logger = logging.getLogger(__name__)

# Pieces aligned with the output ids (they start at the update's output offset).
OUTPUT_LOGPROB_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")
# Whole lists in a rid's first update, None after it ("unchanged").
INPUT_LOGPROB_KEYS = ("input_token_logprobs", "input_top_logprobs")
_CONVERTED = ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs", "input_top_logprobs")

Entry = List[Any]


@dataclass
class ReqOutput:
    """What the client has been shown of one output (a request, or one n > 1 child) so far.

    `logprobs` holds the converted entries (`[logprob, token_id, text|None]`) per meta key, so
    each entry is converted once however many updates repeat it in the responses.
    """

    text: str = ""
    output_ids: List[int] = field(default_factory=list)
    logprobs: Dict[str, list] = field(default_factory=dict)

    def add(self, text: str, text_offset: int, ids: List[int], ids_offset: int, meta: Dict[str, Any],
            convert: Callable[[Entry], Entry]) -> None:
        """Write one update: its text and ids at their offsets, its logprob pieces into the
        lists; `meta`'s logprob values become the cumulative lists (copies), in place."""
        self.text = _write_text(self.text, text, text_offset)
        _write_list(self.output_ids, ids, ids_offset, "output_ids")
        for key in OUTPUT_LOGPROB_KEYS:
            piece = meta.get(key)
            if piece is None:
                continue
            stored = self.logprobs.setdefault(key, [])
            _write_list(stored, _convert_all(key, piece, convert), ids_offset, key)
            meta[key] = list(stored)
        for key in INPUT_LOGPROB_KEYS:
            if key not in meta:
                continue
            if meta[key] is not None:
                self.logprobs[key] = _convert_all(key, meta[key], convert)
            whole = self.logprobs.get(key)
            if whole is None:  # None before any list arrived: the key is left out, as before
                del meta[key]
            else:
                meta[key] = list(whole)


def _convert_all(key: str, entries: List[Any], convert: Callable[[Entry], Entry]) -> list:
    if key not in _CONVERTED:
        return list(entries)
    if key.endswith("top_logprobs"):
        return [None if entry is None else [convert(e) for e in entry] for entry in entries]
    return [convert(entry) for entry in entries]


def _write_text(text: str, piece: str, offset: int) -> str:
    if offset == len(text):
        return text + piece
    if offset > len(text):
        logger.error("A text update starts at character %d but only %d arrived before; appending it.",
                     offset, len(text))
        return text + piece
    return text[:offset] + piece


def _write_list(values: list, piece: List[Any], offset: int, what: str) -> None:
    if offset > len(values):
        logger.error("An update of %s starts at %d but only %d arrived before; appending it.",
                     what, offset, len(values))
        offset = len(values)
    del values[offset:]
    values.extend(piece)
