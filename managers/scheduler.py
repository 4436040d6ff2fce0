"""The scheduler loop: receive, admit under a KV budget, run prefill first then decode, retract
under memory pressure, finish and stream. `recv`/`send` are injected so tests, the in-process
engine and the scheduler process drive the same loop."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional

from managers.finish_reason import FINISH_ABORT, FINISH_LENGTH
from managers.io_struct import (
    AbortReq, FlushCacheReqInput, FlushCacheReqOutput, GetLoadReqInput, GetLoadReqOutput, StopSchedulerReq,
    TokenizedGenerateReqInput,
)
from managers.req import Req
from managers.schedule_batch import RETRACT_DECODE_STEPS, KVAllocError, ScheduleBatch
from managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy
from managers.scheduler_admission import AdmissionControl
from managers.scheduler_grammar import GrammarManager
from managers.scheduler_output import accumulate_input_logprobs, build_output, take_token
from mem_cache.chunk_cache import ChunkCache
from mem_cache.radix_cache import RadixCache
from srt.environ import envs
from srt.server_args import flag_default
from srt.utils.host_allocator import trim_host_heap

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, server_args, model_runner, tokenizer: Any = None,
                 recv: Optional[Callable[[], List[Any]]] = None, send: Optional[Callable[[Any], None]] = None):
        self.server_args = server_args
        # --request-step-budget-ms: one request's own work in a step (stop matching, grammar).
        budget_ms = getattr(server_args, "request_step_budget_ms", None)
        self.step_budget_s = float(flag_default("request_step_budget_ms") if budget_ms is None else budget_ms) / 1000.0
        self.runner = model_runner
        self.tokenizer = tokenizer
        self.recv = recv or (lambda: [])
        self.send = send or (lambda msg: None)
        self.page_size = model_runner.page_size
        pools = (model_runner.req_to_token_pool, model_runner.token_to_kv_pool_allocator)
        if server_args.disable_radix_cache:
            self.tree_cache = ChunkCache(*pools, page_size=self.page_size)
        else:
            self.tree_cache = RadixCache(*pools, page_size=self.page_size,
                                         eviction_policy=server_args.radix_eviction_policy)
        self.policy = SchedulePolicy(server_args.schedule_policy, self.tree_cache)
        self.admission = AdmissionControl(model_runner, server_args, tokenizer)
        self.grammars = GrammarManager(self)
        self.waiting_queue: List[Req] = []
        # n > 1: internal prefix request -> its children, queued once it is cached (failed with it)
        self.parked: Dict[Req, List[Req]] = {}
        self.running_batch = ScheduleBatch([], model_runner, self.tree_cache)
        self.chunked_req: Optional[Req] = None
        chunk = server_args.chunked_prefill_size
        self.chunked_prefill_size = None if chunk is None or chunk <= 0 else chunk
        self.init_new_token_ratio = min(0.7 * server_args.schedule_conservativeness, 1.0)
        self.min_new_token_ratio = 0.14 * self.init_new_token_ratio
        self.new_token_ratio_decay = (self.init_new_token_ratio - self.min_new_token_ratio) / 600
        self.new_token_ratio = self.init_new_token_ratio
        self.forward_ct = 0
        self.decode_ct = 0
        self.stopped = False  # set by StopSchedulerReq (TP: rank 0 tells the other ranks)
        self.dp_rank = 0  # which data-parallel replica this is (set by the scheduler process)
        self.stats = dict(prefix_queried_tokens=0, prefix_hit_tokens=0, num_retractions=0, num_aborts=0,
                          num_queue_full=0,
                          generated_tokens=0, num_requests=0)
        self._last_decode_log = (time.perf_counter(), 0)

    # ------------------------------------------------------------------ limits
    @property
    def max_total_num_tokens(self) -> int:
        return self.runner.max_total_num_tokens

    @property
    def max_running_requests(self) -> int:
        return self.runner.max_running_requests

    # ------------------------------------------------------------------ loop
    def step(self) -> bool:
        """One iteration; returns False when there was nothing to run."""
        for msg in self.recv():
            self.process_input(msg)
        batch = self.get_next_batch_to_run()
        if batch is None:
            self.on_idle()
            return False
        self.run_batch(batch)
        return True

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if not self.step() and not self.waiting_queue and not self.parked:
                return
        raise RuntimeError(f"scheduler still busy after {max_steps} steps")

    def process_input(self, msg: Any) -> None:
        if isinstance(msg, TokenizedGenerateReqInput):
            self.stats["num_requests"] += 1
            self.handle_generate_request(msg)
        elif isinstance(msg, AbortReq):
            self.abort_request(msg)
        elif isinstance(msg, FlushCacheReqInput):
            self.send(self.flush_cache())
        elif isinstance(msg, GetLoadReqInput):
            self.send(self.get_load())
        elif isinstance(msg, StopSchedulerReq):
            self.stopped = True
        else:
            raise TypeError(f"scheduler got an unknown message {type(msg).__name__}")

    def handle_generate_request(self, msg: TokenizedGenerateReqInput) -> None:
        decision = self.admission.admit(msg, self.num_queued)
        if decision.refused is not None:
            overload = getattr(decision.refused.finished_reason, "status_code", None) == 503
            self.stats["num_queue_full" if overload else "num_aborts"] += 1  # a full queue is load, not an abort
            self._stream([decision.refused])
            return
        self.waiting_queue.extend(decision.queue)
        if decision.parked:
            self.parked[decision.queue[0]] = decision.parked

    def num_queued(self) -> int:
        """Requests waiting as the client counts them: each parked n > 1 child is one, the
        internal prefix request none (a waiting one has no request slot yet)."""
        parked = sum(len(children) - (prefix.req_pool_idx is None) for prefix, children in self.parked.items())
        return len(self.waiting_queue) + parked

    def is_idle(self) -> bool:
        return (self.running_batch.is_empty() and not self.waiting_queue and self.chunked_req is None
                and not self.parked)

    # ------------------------------------------------------------------ batch choice
    def get_next_batch_to_run(self) -> Optional[ScheduleBatch]:
        batch = self.get_new_batch_prefill()
        if batch is not None:
            if self.server_args.enable_mixed_chunk:
                self.mix_with_running(batch)
            return batch
        if self.running_batch.is_empty():
            return None
        self.update_running_batch()
        return None if self.running_batch.is_empty() else self.running_batch

    def get_new_batch_prefill(self) -> Optional[ScheduleBatch]:
        if not self.waiting_queue and self.chunked_req is None:
            return None
        running = len(self.running_batch.reqs)
        slots = self.max_running_requests - running - (1 if self.chunked_req else 0)
        if slots <= 0 and self.chunked_req is None:
            return None
        self.policy.calc_priority(self.waiting_queue)
        adder = PrefillAdder(self.page_size, self.tree_cache, self.runner.token_to_kv_pool_allocator,
                             self.running_batch.reqs, self.new_token_ratio, self.server_args.max_prefill_tokens,
                             self.chunked_prefill_size, slots)
        if self.chunked_req is not None:
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        for req in list(self.waiting_queue):
            if not self.grammars.ready(req):  # its grammar is still compiling (or failed: aborted)
                continue
            req.init_next_round_input(self.tree_cache)  # fresh match (cheap; lpm already matched)
            if adder.add_one_req(req, has_chunked_req=self.chunked_req is not None) != AddReqResult.CONTINUE:
                break
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        ids = {id(r) for r in adder.can_run_list}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in ids]
        for req in adder.can_run_list:
            if not req.cached_tokens_set:  # first admission (not a chunk or a re-prefill)
                req.cached_tokens, req.cached_tokens_set = len(req.prefix_indices), True
                self.stats["prefix_queried_tokens"] += len(req.origin_input_ids)
                self.stats["prefix_hit_tokens"] += len(req.prefix_indices)
        if not adder.can_run_list:
            return None
        self._log_prefill(adder)
        return ScheduleBatch(list(adder.can_run_list), self.runner, self.tree_cache)

    def mix_with_running(self, batch: ScheduleBatch) -> None:
        """--enable-mixed-chunk: the running requests take their decode step inside `batch` (SGLang's
        mixed chunk), unless a request of either wants logprobs (their rows would need the extend's
        input-logprob bookkeeping) or the pool cannot give them a slot each (then they wait, as
        without the flag, and the next decode step evicts or retracts)."""
        running = self.running_batch.reqs
        if not running or any(r.return_logprob for r in running + batch.reqs):
            return
        batch.decode_reqs = list(running)

    def update_running_batch(self) -> None:
        """Make room for one decode step: evict, then retract (with headroom for
        RETRACT_DECODE_STEPS more); abort a lone request that cannot fit."""
        batch = self.running_batch
        interval = envs.TEST_RETRACT_INTERVAL.get()
        forced = interval > 0 and self.decode_ct > 0 and self.decode_ct % interval == 0 and len(batch.reqs) > 1
        if not forced and batch.check_decode_mem():
            self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio)
            return
        retracted: List[Req] = []
        if forced:  # the test hook: one victim, then the normal path if memory is short anyway
            victim = min(batch.reqs, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
            batch.retract_req(victim)
            retracted.append(victim)
        if not batch.check_decode_mem():
            retracted += batch.retract_decode()
        self._after_retract(retracted)
        if not batch.check_decode_mem():  # a single request that cannot get a slot even alone
            assert len(batch.reqs) == 1, f"retraction left {len(batch.reqs)} requests that do not fit"
            req = batch.reqs[0]
            self._abort_running(req, "Decode out of memory. Try to lower your batch size: " + self._kv_numbers(req))
            batch.reqs = []

    def _after_retract(self, retracted: List[Req]) -> None:
        if not retracted:
            return
        self.stats["num_retractions"] += len(retracted)
        self.waiting_queue = retracted + self.waiting_queue
        reqs = self.running_batch.reqs
        generated = sum(len(r.output_ids) for r in reqs)
        wanted = sum(r.sampling_params.max_new_tokens for r in reqs)
        self.new_token_ratio = min(1.0, (generated + RETRACT_DECODE_STEPS * len(reqs)) / (wanted + 1))
        logger.warning("KV cache is full: retracted %d request(s); #running=%d, new_token_ratio=%.3f.",
                       len(retracted), len(reqs), self.new_token_ratio)

    def _kv_numbers(self, req: Req) -> str:
        alloc = self.runner.token_to_kv_pool_allocator
        return (f"request {req.rid} holds {req.kv_allocated_len} tokens and needs one more; the KV pool has "
                f"{self.max_total_num_tokens} tokens ({alloc.available_size()} free, "
                f"{self.tree_cache.evictable_size()} evictable). Lower --max-running-requests, raise "
                f"--schedule-conservativeness, or give the pool more room (--mem-fraction-static, "
                f"--max-total-tokens, --kv-cache-dtype fp8_e4m3).")

    # ------------------------------------------------------------------ forward + results
    def run_batch(self, batch: ScheduleBatch) -> None:
        is_decode = batch is self.running_batch
        try:
            fb = batch.prepare_for_decode() if is_decode else batch.prepare_for_extend()
        except KVAllocError as e:
            self._fail_batch(batch, is_decode, str(e))
            return
        logits = self.runner.forward(fb)
        want_lp = any(r.return_logprob for r in batch.reqs)
        want_ids = want_lp and any(r.token_ids_logprob for r in batch.reqs)
        sample = self.runner.sample(
            logits, fb, return_logprob=want_lp,
            top_logprobs_nums=[r.top_logprobs_num if r.return_logprob else 0 for r in batch.reqs] if want_lp else None,
            token_ids_logprob=[r.token_ids_logprob if r.return_logprob else None for r in batch.reqs] if want_ids else None)
        self.forward_ct += 1
        if is_decode:
            self.decode_ct += 1
            self.process_batch_result_decode(batch, sample)
        else:
            accumulate_input_logprobs(batch.reqs, logits, batch.prefix_lens, batch.seq_lens_cpu)
            self.process_batch_result_prefill(batch, sample)

    def process_batch_result_prefill(self, batch: ScheduleBatch, sample) -> None:
        sample = sample.to_host()  # the step's one device-to-host transfer
        tokens = sample.next_token_ids
        sampled = 0
        for i, req in enumerate(batch.reqs[batch.num_extend:], start=batch.num_extend):  # mixed: decode rows
            take_token(req, i, tokens[i], sample, self.tokenizer, self.step_budget_s)
            sampled += 1
            if req.finished():
                self._finish(req)
        if batch.decode_reqs:
            self.decode_ct += 1
            self.running_batch.filter_batch()
            self._log_decode()
        for i, req in enumerate(batch.reqs[:batch.num_extend]):
            if req is self.chunked_req:  # partial prompt: no token, keep prefilling next round
                req.is_chunked += 1
                self.tree_cache.cache_unfinished_req(req)
                req.check_finished()  # applies a pending abort
                if req.finished():
                    self.chunked_req = None
                    self._finish(req)
                continue
            req.is_chunked = 0
            if req.sampling_params.max_new_tokens == 0:
                req.finished_reason = FINISH_LENGTH(0)
            else:
                take_token(req, i, tokens[i], sample, self.tokenizer, self.step_budget_s)
                sampled += 1
            if req.finished():
                self._finish(req)
            else:
                self.tree_cache.cache_unfinished_req(req)
                self.running_batch.reqs.append(req)
        self.stats["generated_tokens"] += sampled  # not chunk steps nor prefill-only requests
        self._stream(batch.reqs)

    def process_batch_result_decode(self, batch: ScheduleBatch, sample) -> None:
        sample = sample.to_host()  # the step's one device-to-host transfer
        tokens = sample.next_token_ids
        for i, req in enumerate(batch.reqs):
            take_token(req, i, tokens[i], sample, self.tokenizer, self.step_budget_s)
            if req.finished():
                self._finish(req)
        self.stats["generated_tokens"] += len(batch.reqs)
        self._stream(batch.reqs)
        batch.filter_batch()
        self._log_decode()

    def _finish(self, req: Req) -> None:
        self.tree_cache.cache_finished_req(req)
        if isinstance(req.finished_reason, FINISH_ABORT) and not req.internal:
            self.stats["num_aborts"] += 1
        self._release_children(req)

    def _release_children(self, req: Req) -> None:
        """`req` finished: if it is an n > 1 prefix request, queue its children, or, when it
        failed, finish them with its error (they would otherwise wait for it forever)."""
        children = self.parked.pop(req, None)
        if not children:
            return
        if not isinstance(req.finished_reason, FINISH_ABORT):
            self.waiting_queue.extend(children)
            return
        for child in children:
            child.finished_reason = req.finished_reason
        self.stats["num_aborts"] += len(children)
        self._stream(children)

    def _fail_batch(self, batch: ScheduleBatch, is_decode: bool, detail: str) -> None:
        """Out of KV despite the budget: abort the batch's requests, keep serving."""
        kind = "Decode" if is_decode else "Prefill"
        if "alloc_req_slots" in detail:
            message = f"{detail}. Try to lower --max-running-requests."
        else:
            message = (f"{kind} out of memory. Try to lower your batch size: {detail}; the KV pool has "
                       f"{self.max_total_num_tokens} tokens. Lower --max-running-requests, raise "
                       f"--schedule-conservativeness, or give the pool more room (--mem-fraction-static, "
                       f"--max-total-tokens).")
        logger.error("%s", message)
        for req in batch.reqs:
            if req is self.chunked_req:
                self.chunked_req = None
            if req.req_pool_idx is None:  # admitted (its prefix locked) but it never got a row
                self.tree_cache.dec_lock_ref(req.last_node)
            self._abort_running(req, message)
        if is_decode:
            batch.reqs = []

    def _abort_running(self, req: Req, message: str) -> None:
        self.running_batch.release_req(req)
        req.finished_reason = FINISH_ABORT(message, 503)
        self.stats["num_aborts"] += not req.internal
        self._stream([req])
        self._release_children(req)

    def _stream(self, reqs: List[Req]) -> None:
        out = build_output(reqs, self.server_args.stream_interval)
        if out is not None:
            self.send(out)

    # ------------------------------------------------------------------ abort / flush / idle
    def abort_request(self, msg: AbortReq) -> None:
        """Abort the request whose client rid is exactly `msg.rid` (all of its n > 1 children
        and its prefix request with it), or everything with `abort_all`."""
        def hit(r: Req) -> bool:
            return msg.abort_all or r.client_rid == msg.rid

        for prefix in [p for p in self.parked if hit(p)]:
            for child in self.parked.pop(prefix):
                child.finished_reason = FINISH_ABORT("Aborted by request.", 499)
                self.stats["num_aborts"] += 1
                self._stream([child])
        for req in [r for r in self.waiting_queue if hit(r)]:
            self.waiting_queue.remove(req)
            if req.req_pool_idx is not None:
                self.running_batch.release_req(req)
            req.finished_reason = FINISH_ABORT("Aborted by request.", 499)
            self.stats["num_aborts"] += not req.internal
            self._stream([req])
        running = self.running_batch.reqs + ([self.chunked_req] if self.chunked_req else [])
        for req in running:
            if hit(req):
                req.abort("Aborted by request.", 499)

    def flush_cache(self) -> FlushCacheReqOutput:
        if not self.is_idle():
            return FlushCacheReqOutput(False, f"Cache not flushed: {len(self.running_batch.reqs)} running and "
                                              f"{self.num_queued()} waiting requests.")
        self.tree_cache.reset()
        self.runner.req_to_token_pool.clear()
        self.runner.token_to_kv_pool_allocator.clear()
        self.runner.token_to_kv_pool.release_host_pages()  # CPU: the pool's touched pages go back
        trim_host_heap()  # and, on any device, the free blocks the host heap and torch's caches keep
        return FlushCacheReqOutput(True, "Cache flushed.")

    def token_usage(self) -> float:
        alloc = self.runner.token_to_kv_pool_allocator
        used = self.max_total_num_tokens - alloc.available_size() - self.tree_cache.evictable_size()
        return used / self.max_total_num_tokens

    def get_load(self) -> GetLoadReqOutput:
        return GetLoadReqOutput(len(self.running_batch.reqs), self.num_queued(), self.token_usage(),
                                self.max_total_num_tokens, dict(self.stats), dp_rank=self.dp_rank,
                                memory=self.memory_accounting())

    def memory_accounting(self) -> Dict[str, int]:
        """The conservation terms: every KV slot is free, evictable or protected, exactly once."""
        rows = self.runner.req_to_token_pool
        return dict(available_size=self.runner.token_to_kv_pool_allocator.available_size(),
                    evictable_size=self.tree_cache.evictable_size(), protected_size=self.tree_cache.protected_size(),
                    num_free_req_slots=rows.available_size(), num_req_slots=rows.size)

    def on_idle(self) -> None:
        if self.is_idle():
            self.new_token_ratio = self.init_new_token_ratio
            self.check_memory_conservation()

    def check_memory_conservation(self) -> None:
        """When idle every KV slot is free or in the tree, and every request row is free."""
        alloc = self.runner.token_to_kv_pool_allocator
        total = alloc.available_size() + self.tree_cache.evictable_size() + self.tree_cache.protected_size()
        rows = self.runner.req_to_token_pool
        if total != self.max_total_num_tokens or rows.available_size() != rows.size or self.tree_cache.protected_size():
            raise AssertionError(
                f"KV leak: free {alloc.available_size()} + evictable {self.tree_cache.evictable_size()} + protected "
                f"{self.tree_cache.protected_size()} != {self.max_total_num_tokens}; request rows free "
                f"{rows.available_size()}/{rows.size}")

    # ------------------------------------------------------------------ logs
    def _log_prefill(self, adder: PrefillAdder) -> None:
        alloc = self.runner.token_to_kv_pool_allocator
        used = self.max_total_num_tokens - alloc.available_size() - self.tree_cache.evictable_size()
        logger.info("Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
                    "#running-req: %d, #queue-req: %d", len(adder.can_run_list), adder.log_input_tokens,
                    adder.log_hit_tokens, used / self.max_total_num_tokens, len(self.running_batch.reqs),
                    len(self.waiting_queue))

    def _log_decode(self, every: int = 40) -> None:
        if self.decode_ct % every:
            return
        now, t0, n0 = time.perf_counter(), *self._last_decode_log
        tokens = self.stats["generated_tokens"]
        alloc = self.runner.token_to_kv_pool_allocator
        used = self.max_total_num_tokens - alloc.available_size() - self.tree_cache.evictable_size()
        logger.info("Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): "
                    "%.2f, #queue-req: %d", len(self.running_batch.reqs), used, used / self.max_total_num_tokens,
                    (tokens - n0) / max(now - t0, 1e-9), len(self.waiting_queue))
        self._last_decode_log = (now, tokens)
