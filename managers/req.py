"""`Req`: one generation request's state inside the scheduler.

Row index map of `req_to_token[req_pool_idx]` (see `mem_cache/req_protocol.py`):
`[0, cache_protected_len)` tree-owned and locked through `last_node`,
`[cache_protected_len, kv_allocated_len)` private, `[0, kv_committed_len)` has KV.
"""

from __future__ import annotations

import time
from typing import Any, Hashable, List, Optional, Sequence, Set

import torch

from managers.finish_reason import (
    FINISH_ABORT, FINISH_LENGTH, FINISH_MATCHED_STR, FINISH_MATCHED_TOKEN, BaseFinishReason,
)
from mem_cache.radix_tree_node import RadixKey
from managers.stop_text import REPLACEMENT_CHAR, StopTextWindow
from srt.sampling.sampling_params import SamplingParams
from srt.sampling.stop_regex import compile_stop_regex, tail_tokens

_EMPTY = torch.empty(0, dtype=torch.int64, device="cpu")  # replaced by a device tensor on admission
STOP_TAIL_MARGIN = 2  # tokens decoded beyond the stop bound (left context for the first character)


class Req:
    def __init__(
        self,
        rid: str,
        origin_input_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        token_ids_logprob: Optional[List[int]] = None,
        stream: bool = False,
        extra_key: Optional[Hashable] = None,
        eos_token_ids: Optional[Set[int]] = None,
        vocab_size: Optional[int] = None,
    ):
        self.rid = rid
        # n > 1: the children (and the internal prefix request) belong to `parent_rid`, the rid the
        # client sent; aborts and the queue bound go through it, never through a child's own name.
        self.parent_rid: Optional[str] = None
        self.child_index = 0
        self.internal = False  # the prefill-only prefix request of an n > 1 request: never reported
        self.origin_input_ids: List[int] = list(origin_input_ids)
        self.sampling_params = sampling_params
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        self.token_ids_logprob = token_ids_logprob
        self.stream = stream
        self.extra_key = extra_key
        self.eos_token_ids: Set[int] = set(eos_token_ids or ())
        self.vocab_size = vocab_size
        self.created_time = time.perf_counter()

        self.output_ids: List[int] = []
        # Output ids (and output logprob entries) already sent to the detokenizer: each update
        # carries only those after it. Kept through retraction, so nothing is sent twice.
        self.send_token_offset = 0
        self.fill_ids: List[int] = []
        # Prompt + outputs as one append-only list behind one RadixKey: its int32 packing is
        # done once per token, so re-matching a waiting request (every scheduling round, lpm
        # re-scoring, after a retraction) compares bytes only.
        self._key_ids: List[int] = list(self.origin_input_ids)
        self._radix_key = RadixKey(self._key_ids, extra_key)
        # Prefix-cache state (PrefixCacheReq protocol).
        self.req_pool_idx: Optional[int] = None
        self.prefix_indices: torch.Tensor = _EMPTY
        self.last_node: Any = None
        self.cache_protected_len = 0
        self.kv_committed_len = 0
        self.kv_allocated_len = 0
        # This round's prefill: tokens to compute, and > 0 while a chunked prefill is unfinished.
        self.extend_input_len = 0
        self.is_chunked = 0

        self._stop_window: Optional[StopTextWindow] = None  # the stop strings' text, built on the first check
        self.grammar: Any = None  # a BaseGrammarObject matcher (regex / json_schema / ebnf requests)
        self.finished_reason: Optional[BaseFinishReason] = None
        self.to_abort: Optional[FINISH_ABORT] = None
        self.cached_tokens = 0  # prompt tokens served from the cache on first admission
        self.cached_tokens_set = False
        self.total_retractions = 0
        self.truncated_input_len: Optional[int] = None  # set when --allow-auto-truncate cut the prompt

        # Logprob accumulators: exactly one output entry per token in output_ids.
        self.output_token_logprobs_val: List[float] = []
        self.output_token_logprobs_idx: List[int] = []
        self.output_top_logprobs_val: List[List[float]] = []
        self.output_top_logprobs_idx: List[List[int]] = []
        self.output_token_ids_logprobs: List[List[float]] = []  # per output token, for token_ids_logprob
        self.input_token_logprobs_val: Optional[List[Optional[float]]] = None
        self.input_token_logprobs_idx: Optional[List[int]] = None
        self.input_top_logprobs_val: Optional[List[List[float]]] = None
        self.input_top_logprobs_idx: Optional[List[List[int]]] = None
        # Input logprobs are computed once, on the first prefill; a re-prefill after retraction
        # (which also covers output tokens) must not recompute or re-report them.
        self.input_logprobs_done = False

    def truncate_input(self, n: int) -> None:
        """Keep the first `n` prompt tokens (--allow-auto-truncate), before any output exists."""
        self.truncated_input_len = len(self.origin_input_ids)
        self.origin_input_ids = self.origin_input_ids[:n]
        self._key_ids = list(self.origin_input_ids)
        self._radix_key = RadixKey(self._key_ids, self.extra_key)

    @property
    def client_rid(self) -> str:
        """The rid the client knows this request by (what `AbortReq.rid` matches exactly)."""
        return self.rid if self.parent_rid is None else self.parent_rid

    # ------------------------------------------------------------------ prefix matching
    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def max_prefix_len(self) -> int:
        """One token is always recomputed (it gives the logits); with input logprobs the match
        stops at `logprob_start_len` so those positions get logits too."""
        cap = self.seqlen - 1
        if self.return_logprob and self.logprob_start_len >= 0 and not self.input_logprobs_done:
            cap = min(cap, self.logprob_start_len)
        return max(cap, 0)

    def init_next_round_input(self, tree_cache) -> None:
        """Match the longest cached prefix of prompt + outputs (not locked yet)."""
        self.fill_ids = self.origin_input_ids + self.output_ids
        have = len(self._key_ids) - len(self.origin_input_ids)
        self._key_ids.extend(self.output_ids[have:])
        cap = self.max_prefix_len()
        packed = self._radix_key.packed_upto(cap)
        match = tree_cache.match_prefix(RadixKey.from_packed(packed[: cap * 4], self.extra_key))
        self.prefix_indices, self.last_node = match.device_indices, match.last_node
        self.extend_input_len = len(self.fill_ids) - len(self.prefix_indices)

    # ------------------------------------------------------------------ finishing
    def finished(self) -> bool:
        return self.finished_reason is not None

    def abort(self, message: str, status_code: Optional[int] = None) -> None:
        """Mark for abort; the finish check applies it first on the next pass."""
        self.to_abort = FINISH_ABORT(message, status_code)

    def check_finished(self, tokenizer: Any = None) -> None:
        """Order: pending abort, max_new_tokens, stop token ids (unless ignore_eos), invalid token,
        stop strings / stop_regex on a token-bounded tail."""
        if self.finished():
            return
        if self.to_abort is not None:
            self.finished_reason = self.to_abort
            return
        sp = self.sampling_params
        if len(self.output_ids) >= sp.max_new_tokens:
            self.finished_reason = FINISH_LENGTH(sp.max_new_tokens)
            return
        if not self.output_ids:
            return
        last = self.output_ids[-1]
        if self.grammar is not None and self.grammar.is_terminated():  # the grammar's end was matched
            self.finished_reason = FINISH_MATCHED_TOKEN(last)
            return
        if len(self.output_ids) >= sp.min_new_tokens:
            if last in (sp.stop_token_ids or ()) or (not sp.ignore_eos and last in self.eos_token_ids):
                self.finished_reason = FINISH_MATCHED_TOKEN(last)
                return
        if self.vocab_size is not None and not 0 <= last < self.vocab_size:
            self.finished_reason = FINISH_ABORT(f"Generated an invalid token id {last} (vocab size {self.vocab_size}).")
            return
        if tokenizer is not None and (sp.stop or sp.stop_regex) and len(self.output_ids) >= sp.min_new_tokens:
            self._check_stop_strings(tokenizer)

    def stop_regex_tail_tokens(self) -> int:
        """Output tokens decoded for the stop regexes: each pattern's own bound (srt/sampling/
        stop_regex.py), never the stop strings' (a long stop string must not widen a regex's text)."""
        longest = max((tail_tokens(p) for p in self.sampling_params.stop_regex or ()), default=0)
        return longest + STOP_TAIL_MARGIN if longest else 0

    def _check_stop_strings(self, tokenizer: Any) -> None:
        """Only an occurrence that ends in the newest token stops the request: an earlier one was
        either seen on its own step or came before `min_new_tokens` (ignored for good). The match
        records how far from the end of the output text it starts, so the detokenizer trims there.
        Stop strings win over stop regexes when both match in the same step."""
        sp = self.sampling_params
        if sp.stop:
            if self._stop_window is None:
                self._stop_window = StopTextWindow(sp.stop)
            found = self._stop_window.match(tokenizer, self.output_ids)
            if found is not None:
                self.finished_reason = FINISH_MATCHED_STR(found[1], from_end=found[2])
                return
        if sp.stop_regex:
            tail, before = self._decode_tail(tokenizer, self.stop_regex_tail_tokens())
            for pattern in sp.stop_regex:
                m = next((m for m in compile_stop_regex(pattern).finditer(tail) if m.end() > before), None)
                if m is not None:
                    self.finished_reason = FINISH_MATCHED_STR(m.group(0), from_end=len(tail) - m.start())
                    return

    def _decode_tail(self, tokenizer: Any, n: int):
        """The text of the last `n` output tokens, and how much of it came before the newest token
        (a trailing incomplete character of that text may be completed by the newest token)."""
        ids = self.output_ids[-n:]
        tail = tokenizer.decode(ids, skip_special_tokens=False)
        before = len(tokenizer.decode(ids[:-1], skip_special_tokens=False).rstrip(REPLACEMENT_CHAR))
        return tail, before

    # ------------------------------------------------------------------ retraction
    def reset_for_retract(self) -> None:
        """Back to a waiting request that keeps its `output_ids` (its KV is already released)."""
        self.prefix_indices = _EMPTY
        self.last_node = None
        self.cache_protected_len = 0
        self.kv_committed_len = 0
        self.kv_allocated_len = 0
        self.extend_input_len = 0
        self.is_chunked = 0
        self.req_pool_idx = None
        self.total_retractions += 1
        self.input_logprobs_done = True

    def __repr__(self) -> str:
        return f"Req(rid={self.rid!r}, input={len(self.origin_input_ids)}, output={len(self.output_ids)})"
