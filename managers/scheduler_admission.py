"""Admission of new requests: length limits from the KV pool, auto-truncation, max_new_tokens
clamping, the bounded queue, and `n > 1` fan-out. Refused requests never enter the queue."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from managers.finish_reason import FINISH_ABORT
from managers.io_struct import TokenizedGenerateReqInput
from managers.req import Req
from srt.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from managers.scheduler import Scheduler

logger = logging.getLogger(__name__)

MAX_NEW_TOKENS_DEFAULT_CAP = 1 << 30


class AdmissionControl:
    def __init__(self, scheduler: "Scheduler"):
        self.s = scheduler
        runner = scheduler.runner
        self.T = runner.max_total_num_tokens
        self.C = runner.model_config.context_len
        self.max_req_len = getattr(runner, "max_req_len", min(self.C - 1, self.T - 1))
        self.max_req_input_len = getattr(runner, "max_req_input_len", self.max_req_len - 5)
        self.eos_token_ids = set(runner.model_config.eos_token_ids)
        tok = scheduler.tokenizer
        if tok is not None and getattr(tok, "eos_token_id", None) is not None:
            self.eos_token_ids.add(int(tok.eos_token_id))

    def limit_source(self) -> str:
        if self.T - 1 < self.C - 1:
            return (f"The limit comes from the KV cache pool ({self.T} tokens), not the model's context length "
                    f"({self.C} tokens): raise --mem-fraction-static or --max-total-tokens, or use "
                    f"--kv-cache-dtype fp8_e4m3, to accept longer inputs.")
        return f"The limit comes from the model's context length ({self.C} tokens, --context-length)."

    def handle_generate_request(self, msg: TokenizedGenerateReqInput) -> None:
        vocab = self.s.runner.model_config.vocab_size
        req = Req(msg.rid, msg.input_ids, msg.sampling_params, return_logprob=msg.return_logprob,
                  logprob_start_len=msg.logprob_start_len, top_logprobs_num=msg.top_logprobs_num,
                  token_ids_logprob=msg.token_ids_logprob, stream=msg.stream, extra_key=msg.extra_key,
                  eos_token_ids=self.eos_token_ids, vocab_size=vocab)
        try:
            msg.sampling_params.verify(vocab)
            msg.sampling_params.normalize(self.s.tokenizer)
        except ValueError as e:
            self.refuse(req, str(e), 400)
            return
        error = self._validate(req)
        if error is not None:
            self.refuse(req, *error)
            return
        queued = len(self.s.waiting_queue)
        limit = self.s.server_args.max_queued_requests
        if limit is not None and queued >= limit:
            self.refuse(req, f"The request queue is full. {queued} requests are waiting (--max-queued-requests="
                             f"{limit}); retry later.", 503)
            return
        if req.sampling_params.n > 1:
            self._fan_out(req)
        else:
            self.s.waiting_queue.append(req)

    def _validate(self, req: Req):
        L, M = len(req.origin_input_ids), self.max_req_input_len
        if L == 0:
            return "The input is empty: send at least one token.", 400
        bad = [t for t in req.origin_input_ids if not 0 <= t < req.vocab_size]
        if bad:
            return f"input_ids contains token id {bad[0]} outside the vocabulary [0, {req.vocab_size}).", 400
        if L >= M:
            if not self.s.server_args.allow_auto_truncate:
                return (f"Input length ({L} tokens) exceeds the maximum allowed length ({M} tokens). Use a "
                        f"shorter input or enable --allow-auto-truncate. {self.limit_source()}", 400)
            logger.warning("Request %s: input of %d tokens truncated to %d (--allow-auto-truncate).", req.rid, L, M)
            req.truncate_input(M)
            L = M
        P = self.s.page_size
        pages = -(-(L + 1) // P)
        if pages * P > self.T:  # a guard: max_req_input_len <= T - 6 keeps it from firing today
            return (f"Request prompt exceeds the KV memory budget: {L} tokens plus one to decode need {pages} pages "
                    f"of {P} tokens, but the KV pool holds {self.T} tokens ({self.T // P} pages). Raise "
                    f"--mem-fraction-static or --max-total-tokens, or use a shorter input.", 400)
        sp = req.sampling_params
        sp.max_new_tokens = max(0, min(sp.max_new_tokens, self.max_req_len - L - 1))
        sp.min_new_tokens = min(sp.min_new_tokens, sp.max_new_tokens)
        if req.return_logprob and req.logprob_start_len >= L:
            req.logprob_start_len = L - 1
        return None

    def refuse(self, req: Req, message: str, status: int) -> None:
        req.finished_reason = FINISH_ABORT(message, status)
        self.s.stats["num_aborts"] += 1
        self.s._stream([req])

    def _fan_out(self, req: Req) -> None:
        """n > 1: prefill the prompt once (an internal prefill-only request), then run n children
        that find it in the cache. Children with a seed get seed + i so their samples differ."""
        sp = req.sampling_params
        prefix = Req(req.rid + "::prefix", req.origin_input_ids, SamplingParams(max_new_tokens=0),
                     extra_key=req.extra_key, vocab_size=req.vocab_size)
        prefix.internal = True
        children = []
        for i in range(sp.n):
            child_sp = SamplingParams(**{**sp.to_dict(), "n": 1})
            child_sp.normalize()
            if sp.sampling_seed is not None:
                child_sp.sampling_seed = sp.sampling_seed + i
            child = Req(f"{req.rid}-{i}", req.origin_input_ids, child_sp, return_logprob=req.return_logprob,
                        logprob_start_len=req.logprob_start_len, top_logprobs_num=req.top_logprobs_num,
                        stream=req.stream, extra_key=req.extra_key, eos_token_ids=req.eos_token_ids,
                        vocab_size=req.vocab_size)
            child.parent_rid, child.child_index = req.rid, i
            child.truncated_input_len = req.truncated_input_len
            children.append(child)
        self.s.parked[prefix.rid] = children
        self.s.waiting_queue.append(prefix)
