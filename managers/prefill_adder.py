"""`PrefillAdder`: decides which waiting requests join this round's prefill batch, under the KV
budget, the `--max-prefill-tokens` cap, the running-request slots and chunked prefill.

It only decides and locks admitted prefixes; the scheduler allocates KV afterwards (evicting
unlocked tree nodes as needed, which is why evictable tokens count in the budget). Under every
schedule policy it also defers requests that would compute a prefix another request of the same
batch is computing (`InBatchPrefixIndex`).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, List, Optional, Sequence

from mem_cache.radix_cache import RadixCache, RadixKey

if TYPE_CHECKING:
    from managers.req import Req

# A request's decode reservation is clipped here: a huge max_new_tokens (the default is 2^30
# clamped to the context) would otherwise make admission absurdly conservative. It only affects
# the estimate, never the request's real stop condition.
CLIP_MAX_NEW_TOKENS = 4096

# In-batch prefix sharing: a request that would compute at least this many prompt tokens that a
# request already admitted this round is computing waits for the next round and takes them from
# the cache. Waiting costs it one prefill step; below this, recomputing is cheaper than the wait.
# (Higher than SGLang's lpm threshold of 32, which only reorders the queue and never holds a
# request out of a batch.)
IN_BATCH_PREFIX_MIN_TOKENS = 64


class AddReqResult(enum.Enum):
    """What the scheduler should do after `add_one_req`. Which requests were admitted is
    `can_run_list`, never the return value: an admission that exhausts a budget returns OTHER."""

    CONTINUE = enum.auto()  # admitted; try the next waiting request
    NO_TOKEN = enum.auto()  # refused: its KV does not fit the budget
    OTHER = enum.auto()  # stop this round (slots, prefill cap or chunk budget used up)


def reserved_decode_tokens(req: Req) -> int:
    """Tokens a request may still generate, clipped to `CLIP_MAX_NEW_TOKENS`."""
    left = req.sampling_params.max_new_tokens - len(req.output_ids)
    return min(max(left, 0), CLIP_MAX_NEW_TOKENS)


class InBatchPrefixIndex:
    """The prompts that requests admitted this round are computing, as a scratch radix tree of
    token ids (no KV), so that a later candidate can ask how much of its *uncached* prompt would
    be computed twice. Built on first use: a round without admissions costs nothing."""

    def __init__(self) -> None:
        self._tree: Optional[RadixCache] = None

    def add(self, req: Req) -> None:
        """Record `req`'s whole prompt and outputs (all of a chunked request's later chunks too)."""
        if self._tree is None:
            self._tree = RadixCache(None, None)  # tree-only: the values are the token ids
        self._tree.insert(RadixKey(req.origin_input_ids + req.output_ids, req.extra_key, fixed=True))

    def shared_uncached_len(self, req: Req) -> int:
        """Tokens beyond `req`'s cached prefix (after `init_next_round_input`) that a recorded
        request computes, counted only as far as `req` may take them from the cache
        (`max_prefix_len`): tokens it must recompute anyway are no reason to wait."""
        if self._tree is None:
            return 0
        match = self._tree.match_prefix(RadixKey(req.origin_input_ids + req.output_ids, req.extra_key, fixed=True))
        return min(len(match.device_indices), req.max_prefix_len()) - len(req.prefix_indices)


class PrefillAdder:
    """One round of prefill admission.

    KV budget (ARCHITECTURE 5), read live so that locks keep it exact:
        rem_total_tokens = allocator.available_size() + tree_cache.evictable_size()
                           - new_token_ratio * sum(reserved_decode_tokens(r) for r in running_reqs)
                           - what this round admitted
    An admitted request costs `ceil_page(extend_input_len + reserved_decode_tokens(req))`. Its
    cached prefix is locked on admission, which moves those tokens from evictable to protected;
    since the budget re-reads `evictable_size()`, that drop is accounted for automatically (the fit
    is re-checked after locking, and the lock is undone when it no longer fits).

    Chunked requests: a request split into chunks reserves its whole remaining prompt plus its
    decode tokens every round (not just this round's chunk), so requests admitted behind it cannot
    take the KV its later chunks need. Only the chunk counts against `--max-prefill-tokens`,
    `--chunked-prefill-size` and the logged input tokens.

    `rem_running_slots`: how many *new* requests may still start running; the continued chunked
    request (`add_chunked_req`) does not take one (the scheduler already counted it).
    `chunked_prefill_size` None or <= 0 (-1) disables chunking.

    In-batch prefix sharing (any policy): a candidate that shares at least
    `in_batch_prefix_min_tokens` uncached tokens with a request admitted this round (the continued
    chunked one included, with all its remaining chunks) is deferred: `add_one_req` returns
    CONTINUE without admitting it (it is in `deferred_reqs`), so the requests behind it are still
    tried. It cannot empty the batch (it only waits behind a request in it; the first request of
    a group always goes) nor wait forever: that request puts the shared tokens into the tree,
    locked while it runs, so unless they are evicted meanwhile each deferral grows the waiting
    request's cached prefix by at least the threshold. With the cache disabled
    (`tree_cache.disable`) nothing is shared and nothing is deferred.
    """

    def __init__(
        self,
        page_size: int,
        tree_cache,
        token_to_kv_pool_allocator,
        running_reqs: Sequence[Req],
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunked_prefill_size: Optional[int],
        rem_running_slots: int,
        in_batch_prefix_min_tokens: int = IN_BATCH_PREFIX_MIN_TOKENS,
    ):
        self.page_size = page_size
        self.tree_cache = tree_cache
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.new_token_ratio = new_token_ratio
        self.rem_input_tokens = max_prefill_tokens
        chunking = chunked_prefill_size is not None and chunked_prefill_size > 0
        self._rem_chunk = chunked_prefill_size if chunking else None
        self.rem_running_slots = rem_running_slots
        self.running_reserved = sum(reserved_decode_tokens(r) for r in running_reqs) * new_token_ratio
        self.admitted_tokens = 0  # KV tokens reserved by this round's admissions

        self.can_run_list: List[Req] = []
        self.new_chunked_req: Optional[Req] = None
        self.log_input_tokens = 0  # sum of extend_input_len admitted this round
        self.log_hit_tokens = 0  # sum of cached prefix lengths of newly admitted requests
        sharing = not getattr(tree_cache, "disable", False) and in_batch_prefix_min_tokens > 0
        self.in_batch_prefix: Optional[InBatchPrefixIndex] = InBatchPrefixIndex() if sharing else None
        self.in_batch_prefix_min_tokens = in_batch_prefix_min_tokens
        self.deferred_reqs: List[Req] = []  # waiting for a prefix a request of this batch computes

    # ------------------------------------------------------------------ budgets
    @property
    def rem_total_tokens(self) -> float:
        available = self.token_to_kv_pool_allocator.available_size() + self.tree_cache.evictable_size()
        return available - self.running_reserved - self.admitted_tokens

    @property
    def rem_chunk_tokens(self) -> Optional[int]:
        """Tokens left under `--chunked-prefill-size` this round; None when chunking is off."""
        return self._rem_chunk

    def ceil_page(self, tokens: int) -> int:
        return -(-tokens // self.page_size) * self.page_size

    def _chunk_len(self, extend_len: int) -> int:
        """This round's share of `extend_len`: all of it when it fits the chunk budget, else the
        budget rounded down to whole pages, but at least one page (so a chunk always progresses
        and every chunk boundary stays page-aligned)."""
        if self._rem_chunk is None or extend_len <= self._rem_chunk:
            return extend_len
        aligned = max(self._rem_chunk // self.page_size * self.page_size, self.page_size)
        return min(aligned, extend_len)

    def _budget_state(self) -> AddReqResult:
        exhausted = (
            self.rem_running_slots <= 0
            or self.rem_total_tokens <= 0
            or self.rem_input_tokens <= 0
            or (self._rem_chunk is not None and self._rem_chunk <= 0)
        )
        return AddReqResult.OTHER if exhausted else AddReqResult.CONTINUE

    def _should_defer(self, req: Req) -> bool:
        """Whether `req` would compute enough of what an admitted request computes to wait."""
        if self.in_batch_prefix is None:
            return False
        if self.in_batch_prefix.shared_uncached_len(req) < self.in_batch_prefix_min_tokens:
            return False
        assert self.can_run_list, f"{req.rid} deferred behind a request that is not in the batch"
        return True

    def _take(self, req: Req, prefix_len: int, chunk: int, extend_len: int) -> None:
        """Append `req` with `chunk` of its `extend_len` remaining tokens and charge the budgets."""
        if self.in_batch_prefix is not None:
            self.in_batch_prefix.add(req)
        req.extend_input_len = chunk
        req.fill_ids = req.fill_ids[: prefix_len + chunk]
        self.can_run_list.append(req)
        self.admitted_tokens += self.ceil_page(extend_len + reserved_decode_tokens(req))
        self.rem_input_tokens -= chunk
        if self._rem_chunk is not None:
            self._rem_chunk -= chunk
        self.log_input_tokens += chunk

    # ------------------------------------------------------------------ admission
    def add_chunked_req(self, req: Req) -> Optional[Req]:
        """Continue the in-flight chunked request (call first each round; always admitted).

        It is already locked, and `cache_unfinished_req` set its `prefix_indices` to everything
        computed so far. Returns `req` while its prompt is still unfinished after this chunk (it
        is then also `new_chunked_req`), else None.
        """
        req.fill_ids = req.origin_input_ids + req.output_ids
        prefix_len = len(req.prefix_indices)
        remaining = len(req.fill_ids) - prefix_len
        assert remaining > 0, f"chunked request {req.rid} has no tokens left to prefill ({prefix_len} computed)"
        chunk = self._chunk_len(remaining)
        self._take(req, prefix_len, chunk, remaining)
        if chunk < remaining:
            self.new_chunked_req = req
            return req
        return None

    def add_one_req(self, req: Req, has_chunked_req: bool) -> AddReqResult:
        """Admit `req` (after `init_next_round_input`) if it fits; see the class docstring.

        The first request of a round is never blocked by `--max-prefill-tokens`. A request longer
        than the chunk budget is admitted as a page-aligned partial chunk (`new_chunked_req`,
        result OTHER) unless another chunked request is in flight. On admission its `last_node`
        is locked and `cache_protected_len = len(prefix_indices)`. A request deferred for
        in-batch prefix sharing (class docstring) gets CONTINUE, before any budget is checked:
        it does not run this round whatever they say, and its cost will be lower next round.
        """
        if self.rem_running_slots <= 0:
            return AddReqResult.OTHER
        if self._should_defer(req):
            self.deferred_reqs.append(req)
            return AddReqResult.CONTINUE
        prefix_len = len(req.prefix_indices)
        extend_len = req.extend_input_len
        # Decode tokens fill the prompt's last page first (prefixes are whole pages), so the exact
        # need is ceil_page(extend + decode); a lone request clamped to max_req_len always fits T.
        cost = self.ceil_page(extend_len + reserved_decode_tokens(req))
        if cost > self.rem_total_tokens:  # locking can only lower the budget: reject early
            return AddReqResult.NO_TOKEN
        if self.can_run_list and extend_len > self.rem_input_tokens:
            return AddReqResult.OTHER

        chunk = self._chunk_len(extend_len)
        if self.can_run_list and self._rem_chunk is not None and chunk > self._rem_chunk:
            return AddReqResult.OTHER  # under a page of chunk budget left this round
        if chunk < extend_len and (has_chunked_req or self.new_chunked_req is not None):
            return AddReqResult.OTHER  # one chunked request at a time

        self.tree_cache.inc_lock_ref(req.last_node)
        if cost > self.rem_total_tokens:  # the lock removed its prefix from the evictable pool
            self.tree_cache.dec_lock_ref(req.last_node)
            return AddReqResult.NO_TOKEN
        req.cache_protected_len = prefix_len
        self.log_hit_tokens += prefix_len
        self.rem_running_slots -= 1
        self._take(req, prefix_len, chunk, extend_len)
        if chunk < extend_len:
            self.new_chunked_req = req
            return AddReqResult.OTHER
        return self._budget_state()
