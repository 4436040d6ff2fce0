"""The output text a request's stop strings are looked for in, decoded incrementally.

Each step decodes only the tokens since the last complete character (with the token before them
for context, as incremental detokenizers do), so a 3,000-character stop string costs a search of
3,000 characters a step, not a decode of 3,000 tokens. The window keeps the last
`longest stop - 1` characters before the newest text: every occurrence that ends in the newest
token fits in it.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

REPLACEMENT_CHAR = "\ufffd"  # what decode yields for a trailing incomplete UTF-8 sequence


class StopTextWindow:
    def __init__(self, stops: Sequence[str]):
        self.stops = list(stops)
        self.keep = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.prefix_offset = 0  # tokens before read_offset decoded again as context
        self.read_offset = 0  # output tokens whose text is in `text`

    def _advance(self, tokenizer: Any, ids: List[int], upto: int) -> int:
        """Append the text of `ids[read_offset:upto]`; returns how many characters came. Nothing
        comes while that text ends in an incomplete character (a later token completes it)."""
        if upto <= self.read_offset:
            return 0
        prefix = tokenizer.decode(ids[self.prefix_offset:self.read_offset], skip_special_tokens=False)
        full = tokenizer.decode(ids[self.prefix_offset:upto], skip_special_tokens=False)
        if full.endswith(REPLACEMENT_CHAR) or len(full) < len(prefix):
            return 0
        delta = full[len(prefix):]
        self.text = (self.text[-self.keep:] if self.keep else "") + delta
        self.prefix_offset, self.read_offset = self.read_offset, upto
        return len(delta)

    def match(self, tokenizer: Any, ids: List[int]) -> Optional[Tuple[int, str, int]]:
        """The earliest stop string that ends in the newest token's text, as (start, stop,
        characters from its start to the end of the output text); None when none does."""
        self._advance(tokenizer, ids, len(ids) - 1)  # catch up silently (steps before min_new_tokens)
        new = self._advance(tokenizer, ids, len(ids))
        if not new:
            return None
        before = len(self.text) - new
        best = None
        for stop in self.stops:
            pos = self.text.find(stop, max(0, before - len(stop) + 1))
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        return None if best is None else (best[0], best[1], len(self.text) - best[0])
