"""`ScheduleBatch`: the requests of one forward step and the KV bookkeeping around it.

It turns scheduler state (`Req` objects) into a `ForwardBatch`: request rows, KV slots
(`alloc_extend` / `alloc_decode`, evicting from the tree when short), `req_to_token` writes,
and the sampling tensors. Retraction releases KV without inserting it into the tree.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Tuple

import torch

from managers.req import Req
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from srt.constrained.base_grammar_backend import fill_vocab_masks
from srt.sampling.sampling_batch_info import SamplingBatchInfo
from kernels.device_utils import host_to_device, is_cuda

logger = logging.getLogger(__name__)

# A retraction frees enough KV for the remaining requests to decode this many more tokens each
# (SGLang's retract_decode_steps): stopping once one step fits would retract again next step.
RETRACT_DECODE_STEPS = 20


class KVAllocError(RuntimeError):
    """No KV slots (or request rows) even after evicting every unlocked tree node."""


class ScheduleBatch:
    def __init__(self, reqs: List[Req], runner, tree_cache, forward_mode: ForwardMode = ForwardMode.EXTEND):
        self.reqs = reqs
        self.runner = runner
        self.tree_cache = tree_cache
        self.forward_mode = forward_mode
        self.req_to_token_pool = runner.req_to_token_pool
        self.allocator = runner.token_to_kv_pool_allocator
        self.page_size = runner.page_size
        self.device = runner.device
        # Decode keeps its sampling tensors across steps (see _decode_sampling_info): the requests
        # they were built for, each one's len(output_ids) then, and the tensors.
        self._sampling_cache: Optional[Tuple[List[Req], List[int], SamplingBatchInfo]] = None
        # --enable-mixed-chunk: running requests whose decode step rides in this extend batch
        # (`mix_with_running`); after prepare_for_extend they are `reqs[num_extend:]`.
        self.decode_reqs: List[Req] = []
        self.num_extend = len(reqs)

    def batch_size(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return not self.reqs

    # ------------------------------------------------------------------ allocation
    def _alloc(self, fn, need_tokens: int, *args) -> torch.Tensor:
        if self.allocator.available_size() < need_tokens:
            self.tree_cache.evict(need_tokens - self.allocator.available_size())
        out = fn(*args)
        if out is None:
            raise KVAllocError(
                f"need {need_tokens} KV slots, {self.allocator.available_size()} free after evicting; "
                f"tree holds {self.tree_cache.evictable_size()} evictable + "
                f"{self.tree_cache.protected_size()} protected tokens"
            )
        return out

    def _pages(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    # ------------------------------------------------------------------ extend
    def prepare_for_extend(self) -> ForwardBatch:
        """Rows for new requests, KV for each request's `fill_ids[len(prefix_indices):]`."""
        self.forward_mode = ForwardMode.EXTEND
        new = [r for r in self.reqs if r.req_pool_idx is None]
        if new:
            rows = self.req_to_token_pool.alloc(len(new))
            if rows is None:
                raise KVAllocError(f"alloc_req_slots runs out of memory: {len(new)} request slots needed, "
                                   f"{self.req_to_token_pool.available_size()} of {self.req_to_token_pool.size} free")
            for req, row in zip(new, rows):
                req.req_pool_idx = row
                self.req_to_token_pool.write(row, 0, req.prefix_indices)
        prefix_lens = [len(r.prefix_indices) for r in self.reqs]
        seq_lens = [len(r.fill_ids) for r in self.reqs]
        last_loc = self._last_loc([r.req_pool_idx for r in self.reqs], prefix_lens)
        need = sum(self._pages(s) - self._pages(p) for p, s in zip(prefix_lens, seq_lens))
        out_loc = self._alloc(self.allocator.alloc_extend, need, prefix_lens, seq_lens, last_loc)
        off = 0
        logprob_starts = []
        for req, p, s in zip(self.reqs, prefix_lens, seq_lens):
            self.req_to_token_pool.write(req.req_pool_idx, p, out_loc[off : off + s - p])
            off += s - p
            req.kv_allocated_len = req.kv_committed_len = s
            logprob_starts.append(self._input_logprob_start(req, p, s))
        input_ids = [r.fill_ids[p:] for r, p in zip(self.reqs, prefix_lens)]
        self.num_extend = len(self.reqs)
        if self.decode_reqs:
            out_loc = self._add_decode_rows(input_ids, prefix_lens, seq_lens, logprob_starts, out_loc)
        want_input = any(x < s - p for x, p, s in zip(logprob_starts, prefix_lens, seq_lens))
        fb = ForwardBatch.create_extend(
            self.runner, input_ids, prefix_lens,
            [r.req_pool_idx for r in self.reqs], out_loc, logprob_starts if want_input else None,
        )
        self.prefix_lens, self.seq_lens_cpu = prefix_lens, seq_lens
        fb.sampling_info = self._with_grammar_mask(self._sampling_info())
        return fb

    def _add_decode_rows(self, input_ids: List[List[int]], prefix_lens: List[int], seq_lens: List[int],
                         logprob_starts: List[int], out_loc: torch.Tensor) -> torch.Tensor:
        """Mixed chunk: each running request in `decode_reqs` joins this extend as one more row, its
        last output token over its whole KV as prefix: exactly its decode step. Where the pool has no
        room for their slots after the prompts' (evicting first) they are left out of this step, and
        the next decode step retracts as usual."""
        reqs = self.decode_reqs
        if not self._has_room(self.new_page_count(reqs) * self.page_size):
            self.decode_reqs = []
            return out_loc
        prefix_lens.extend(r.kv_committed_len for r in reqs)
        slots = self._decode_slots(reqs)
        for r in reqs:
            input_ids.append([r.output_ids[-1]])
            logprob_starts.append(1)  # no input logprobs
            seq_lens.append(r.kv_committed_len)
        self.reqs = self.reqs + reqs
        return torch.cat([out_loc, slots.to(out_loc.device, out_loc.dtype)])

    @staticmethod
    def _input_logprob_start(req: Req, prefix: int, seq: int) -> int:
        """First extend row (relative) whose logits feed input logprobs; `seq - prefix` = none."""
        if not req.return_logprob or req.logprob_start_len < 0 or req.input_logprobs_done:
            return seq - prefix
        return min(max(req.logprob_start_len - prefix, 0), seq - prefix)

    # ------------------------------------------------------------------ decode
    def new_page_count(self, reqs: Optional[List[Req]] = None) -> int:
        """Requests (default: the batch's) whose next token starts a new page (all of them when
        page_size is 1)."""
        reqs = self.reqs if reqs is None else reqs
        if self.page_size == 1:
            return len(reqs)
        return sum(1 for r in reqs if r.kv_committed_len % self.page_size == 0)

    def check_decode_mem(self) -> bool:
        """Enough free slots for one more token per request, evicting the tree if needed."""
        return self._has_room(self.new_page_count() * self.page_size)

    def decode_tokens_needed(self, steps: int) -> int:
        """KV slots for the next `steps` tokens of every request (fewer for one that finishes
        sooner), in whole pages: a request's tokens fill its last partial page first."""
        need = 0
        for r in self.reqs:
            k = max(1, min(steps, r.sampling_params.max_new_tokens - len(r.output_ids)))
            need += self._pages(r.kv_committed_len + k) - self._pages(r.kv_committed_len)
        return need

    def _has_room(self, need: int) -> bool:
        if self.allocator.available_size() < need:
            self.tree_cache.evict(need - self.allocator.available_size())
        return self.allocator.available_size() >= need

    def prepare_for_decode(self) -> ForwardBatch:
        """One new KV slot per request. Rows, lengths and input ids come from host state (the
        scheduler's lists), so building the step reads nothing back from the device."""
        self.forward_mode = ForwardMode.DECODE
        bs = len(self.reqs)
        out_loc = self._decode_slots(self.reqs)
        new_lens = [r.kv_committed_len for r in self.reqs]
        input_ids = host_to_device([r.output_ids[-1] for r in self.reqs], torch.int64, self.device)
        fb = ForwardBatch.create_decode(self.runner, input_ids, new_lens, [r.req_pool_idx for r in self.reqs],
                                        out_loc)
        fb.sampling_info = self._with_grammar_mask(self._decode_sampling_info(input_ids))
        assert fb.batch_size == bs
        return fb

    def _decode_slots(self, reqs: List[Req]) -> torch.Tensor:
        """One new KV slot per request of `reqs` (a decode step, or mixed chunk's decode rows) at
        position kv_committed_len, written into `req_to_token`; the lengths grow by one."""
        rows = [r.req_pool_idx for r in reqs]
        old = [r.kv_committed_len for r in reqs]
        slots = self._alloc(self.allocator.alloc_decode, self.new_page_count(reqs) * self.page_size,
                            [n + 1 for n in old], self._last_loc(rows, old))
        width = self.req_to_token_pool.req_to_token.shape[1]
        flat_pos = host_to_device([r * width + n for r, n in zip(rows, old)], torch.int64, self.device)
        self.req_to_token_pool.req_to_token.view(-1).index_copy_(0, flat_pos, slots.to(torch.int32))
        for r in reqs:
            r.kv_allocated_len = r.kv_committed_len = r.kv_committed_len + 1
        return slots

    def _last_loc(self, rows: List[int], lens: List[int]) -> torch.Tensor:
        """KV slot of position `lens[i] - 1` of each row, gathered on the device (the paged
        allocator continues a partial page from it; where a length is 0 the value is unused)."""
        width = self.req_to_token_pool.req_to_token.shape[1]
        flat = host_to_device([r * width + max(n - 1, 0) for r, n in zip(rows, lens)], torch.int64, self.device)
        return self.req_to_token_pool.req_to_token.view(-1).index_select(0, flat).to(torch.int64)

    def _decode_sampling_info(self, last_tokens: torch.Tensor) -> SamplingBatchInfo:
        """Last step's tensors brought up to date rather than rebuilt: requests that left are
        filtered out, each survivor gained exactly its input token (`cumulate_output_tokens`),
        and requests that joined (prefilled, re-admitted) are built alone and merged in. So the
        per-request Python work (output_ids, logit_bias, stop masks) is done once per request."""
        info = self._advance_sampling_info(last_tokens) if self._sampling_cache is not None else None
        if info is None:
            info = self._sampling_info()
        self._sampling_cache = (list(self.reqs), [len(r.output_ids) for r in self.reqs], info)
        return info

    def _advance_sampling_info(self, last_tokens: torch.Tensor) -> Optional[SamplingBatchInfo]:
        """The cached info updated to `self.reqs`, or None when no row can be reused. A cached row
        is reused only if its request gained exactly one token since (else it is rebuilt)."""
        old_reqs, old_lens, info = self._sampling_cache
        row_of = {id(r): i for i, r in enumerate(old_reqs)}
        kept: List[Tuple[int, int]] = []  # (position in self.reqs, row in the cached info)
        fresh: List[int] = []
        for pos, req in enumerate(self.reqs):
            row = row_of.get(id(req))
            if row is not None and len(req.output_ids) == old_lens[row] + 1:
                kept.append((pos, row))
            else:
                fresh.append(pos)
        if not kept:
            return None
        if not fresh and len(kept) == len(old_reqs) and all(p == r for p, r in kept):
            info.cumulate_output_tokens(last_tokens)  # the common step: same requests, same order
            return info
        rows = [r for _, r in kept]
        if rows != list(range(len(old_reqs))):
            info.filter_batch(rows)
        tokens = [self.reqs[p].output_ids[-1] for p, _ in kept]
        info.cumulate_output_tokens(host_to_device(tokens, torch.int64, self.device))
        if fresh:
            info.merge_batch(self._sampling_info([self.reqs[p] for p in fresh]))
        order = [p for p, _ in kept] + fresh  # info row j now belongs to self.reqs[order[j]]
        if order != list(range(len(order))):
            info.filter_batch(sorted(range(len(order)), key=order.__getitem__))
        return info

    def _with_grammar_mask(self, info: SamplingBatchInfo) -> SamplingBatchInfo:
        """This step's disallowed tokens for the constrained rows (filled on the host by each
        request's matcher, then one copy); None when no request is constrained."""
        rows = [i for i, r in enumerate(self.reqs) if r.grammar is not None]
        if not rows:
            info.vocab_mask = None
            return info
        sub = torch.zeros((len(rows), info.vocab_size), dtype=torch.bool, device="cpu")
        fill_vocab_masks([self.reqs[i].grammar for i in rows], sub)
        mask = torch.zeros((len(self.reqs), info.vocab_size), dtype=torch.bool, device="cpu")
        mask[torch.tensor(rows, dtype=torch.int64, device="cpu")] = sub
        info.vocab_mask = mask.pin_memory().to(self.device, non_blocking=True) if is_cuda(self.device) else mask
        return info

    def _sampling_info(self, reqs: Optional[List[Req]] = None) -> SamplingBatchInfo:
        """Sampling tensors built from scratch for `reqs` (default: the whole batch)."""
        reqs = self.reqs if reqs is None else reqs
        vocab = self.runner.model_config.vocab_size
        return SamplingBatchInfo.from_params(
            [r.sampling_params for r in reqs], vocab, self.device,
            output_ids=[r.output_ids for r in reqs], stop_token_ids=[r.eos_token_ids for r in reqs],
        )

    # ------------------------------------------------------------------ retraction
    def release_req(self, req: Req) -> None:
        """Give back a request's private slots, its lock and its row, inserting nothing."""
        if req.req_pool_idx is None:
            return
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        private = row[req.cache_protected_len : req.kv_allocated_len].to(torch.int64)
        self.allocator.free_aligned(private)  # cache_protected_len is page-aligned
        if req.last_node is not None:
            self.tree_cache.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None

    def retract_req(self, req: Req) -> None:
        """Take `req` out of the batch, back to a waiting request (KV released, outputs kept)."""
        self.release_req(req)
        req.reset_for_retract()
        self.reqs = [r for r in self.reqs if r is not req]

    def retract_decode(self, steps: int = RETRACT_DECODE_STEPS) -> List[Req]:
        """Retract at least one request, and go on until the rest can decode `steps` more
        tokens each (or one is left). Victims: fewest generated tokens first, ties to the
        longest prompt. Whether the rest fits one step is `check_decode_mem()`."""
        order = sorted(self.reqs, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        retracted: List[Req] = []
        while len(self.reqs) > 1 and (not retracted or not self._has_room(self.decode_tokens_needed(steps))):
            victim = order.pop(0)
            self.retract_req(victim)
            retracted.append(victim)
        return retracted

    # ------------------------------------------------------------------ membership
    def filter_batch(self, keep: Optional[List[Req]] = None) -> None:
        self.reqs = [r for r in self.reqs if not r.finished()] if keep is None else keep
