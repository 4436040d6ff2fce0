"""Admission of new requests: length limits from the KV pool, auto-truncation, max_new_tokens
clamping, the bounded queue, and `n > 1` fan-out. Refused requests never enter the queue."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

from managers.finish_reason import FINISH_ABORT
from managers.generate_input import RequestLimits
from managers.io_struct import TokenizedGenerateReqInput
from managers.req import Req
from srt.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class Admission:
    """What admission decided for one request. Either `refused` (finished with its abort reason:
    answer it), or `queue` to append to the waiting queue; for n > 1, `queue` is the internal
    prefix request and `parked` its children, queued once the prefix is cached."""

    queue: List[Req] = field(default_factory=list)
    parked: List[Req] = field(default_factory=list)
    refused: Optional[Req] = None


class AdmissionControl:
    """Decides on each incoming request from the limits alone; it holds no scheduler state
    (the caller says how many requests wait and acts on the `Admission`)."""

    def __init__(self, runner: Any, server_args: Any, tokenizer: Any = None):
        self.server_args = server_args
        self.tokenizer = tokenizer
        self.page_size = runner.page_size
        self.vocab_size = runner.model_config.vocab_size
        self.T = runner.max_total_num_tokens
        self.C = runner.model_config.context_len
        self.max_req_len = getattr(runner, "max_req_len", min(self.C - 1, self.T - 1))
        self.max_req_input_len = getattr(runner, "max_req_input_len", self.max_req_len - 5)
        # The same arithmetic the front door reports (/v1/models, meta_info clamps): one formula.
        self.limits = RequestLimits(self.C, self.max_req_len, self.max_req_input_len, self.T)
        self.eos_token_ids = set(runner.model_config.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(int(tokenizer.eos_token_id))

    def limit_source(self) -> str:
        if self.T - 1 < self.C - 1:
            return (f"The limit comes from the KV cache pool ({self.T} tokens), not the model's context length "
                    f"({self.C} tokens): raise --mem-fraction-static or --max-total-tokens, or use "
                    f"--kv-cache-dtype fp8_e4m3, to accept longer inputs.")
        return f"The limit comes from the model's context length ({self.C} tokens, --context-length)."

    def admit(self, msg: TokenizedGenerateReqInput, num_queued: Callable[[], int]) -> Admission:
        """`num_queued()`: requests waiting now, each n > 1 child counted (read only when
        --max-queued-requests is set)."""
        vocab = self.vocab_size
        req = Req(msg.rid, msg.input_ids, msg.sampling_params, return_logprob=msg.return_logprob,
                  logprob_start_len=msg.logprob_start_len, top_logprobs_num=msg.top_logprobs_num,
                  token_ids_logprob=msg.token_ids_logprob, stream=msg.stream, extra_key=msg.extra_key,
                  eos_token_ids=self.eos_token_ids, vocab_size=vocab)
        try:
            msg.sampling_params.verify(vocab)
            msg.sampling_params.normalize(self.tokenizer)
        except ValueError as e:
            return self._refuse(req, str(e), 400)
        error = self._validate(req) or self._check_queue(req, num_queued)
        if error is not None:
            return self._refuse(req, *error)
        if req.sampling_params.n > 1:
            return self._fan_out(req)
        return Admission(queue=[req])

    def _check_queue(self, req: Req, num_queued: Callable[[], int]):
        """Every n > 1 child is one queued request: all n must fit under the bound."""
        limit = self.server_args.max_queued_requests
        if limit is None:
            return None
        n = req.sampling_params.n
        if n > limit:
            return (f"The request asks for n={n} samples, more than the request queue holds "
                    f"(--max-queued-requests={limit}); each sample is queued as one request. Lower n "
                    f"or raise --max-queued-requests.", 400)
        queued = num_queued()
        if queued + n > limit:
            needs = f" and this one needs {n} places" if n > 1 else ""
            return (f"The request queue is full. {queued} requests are waiting (--max-queued-requests="
                    f"{limit}){needs}; retry later.", 503)
        return None

    def _validate(self, req: Req):
        L, M = len(req.origin_input_ids), self.max_req_input_len
        if L == 0:
            return "The input is empty: send at least one token.", 400
        bad = [t for t in req.origin_input_ids if not 0 <= t < req.vocab_size]
        if bad:
            return f"input_ids contains token id {bad[0]} outside the vocabulary [0, {req.vocab_size}).", 400
        if L >= M:
            if not self.server_args.allow_auto_truncate:
                return (f"Input length ({L} tokens) exceeds the maximum allowed length ({M} tokens). Use a "
                        f"shorter input or enable --allow-auto-truncate. {self.limit_source()}", 400)
            logger.warning("Request %s: input of %d tokens truncated to %d (--allow-auto-truncate).", req.rid, L, M)
            req.truncate_input(M)
            L = M
        P = self.page_size
        pages = -(-(L + 1) // P)
        if pages * P > self.T:  # a guard: max_req_input_len <= T - 6 keeps it from firing today
            return (f"Request prompt exceeds the KV memory budget: {L} tokens plus one to decode need {pages} pages "
                    f"of {P} tokens, but the KV pool holds {self.T} tokens ({self.T // P} pages). Raise "
                    f"--mem-fraction-static or --max-total-tokens, or use a shorter input.", 400)
        sp = req.sampling_params
        sp.max_new_tokens = min(sp.max_new_tokens, self.limits.max_new_tokens_for(L))
        sp.min_new_tokens = min(sp.min_new_tokens, sp.max_new_tokens)
        if req.return_logprob and req.logprob_start_len >= L:
            req.logprob_start_len = L - 1
        return None

    @staticmethod
    def _refuse(req: Req, message: str, status: int) -> Admission:
        req.finished_reason = FINISH_ABORT(message, status)
        return Admission(refused=req)

    def _fan_out(self, req: Req) -> Admission:
        """n > 1: prefill the prompt once (an internal prefill-only request), then run n children
        that find it in the cache. Children with a seed get seed + i so their samples differ.
        The prefix and the children carry `parent_rid` (the client's rid): their own names
        (`rid::prefix`, `rid-i`) are labels only and may equal another client's rid."""
        sp = req.sampling_params
        prefix = Req(req.rid + "::prefix", req.origin_input_ids, SamplingParams(max_new_tokens=0),
                     extra_key=req.extra_key, vocab_size=req.vocab_size)
        prefix.internal, prefix.parent_rid = True, req.rid
        children = []
        for i in range(sp.n):
            child_sp = SamplingParams(**{**sp.to_dict(), "n": 1})
            child_sp.normalize()
            if sp.sampling_seed is not None:
                child_sp.sampling_seed = sp.sampling_seed + i
            child = Req(f"{req.rid}-{i}", req.origin_input_ids, child_sp, return_logprob=req.return_logprob,
                        logprob_start_len=req.logprob_start_len, top_logprobs_num=req.top_logprobs_num,
                        token_ids_logprob=req.token_ids_logprob, stream=req.stream, extra_key=req.extra_key,
                        eos_token_ids=req.eos_token_ids, vocab_size=req.vocab_size)
            child.parent_rid, child.child_index = req.rid, i
            child.truncated_input_len = req.truncated_input_len
            children.append(child)
        return Admission(queue=[prefix], parked=children)
