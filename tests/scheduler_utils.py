"""Drive the scheduler loop in-process: submit tokenized requests, collect final outputs."""

from __future__ import annotations

from typing import Dict, List

from managers.io_struct import BatchTokenIDOut, TokenizedGenerateReqInput
from managers.scheduler import Scheduler
from srt.model_executor.model_runner import ModelRunner
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs


class Harness:
    def __init__(self, model_path, max_total_tokens=4096, max_running_requests=32, **kw):
        kw.setdefault("dtype", "float32")
        kw.setdefault("device", "cpu")
        self.args = ServerArgs(model_path=str(model_path), **kw)
        self.runner = ModelRunner(self.args, max_total_tokens=max_total_tokens,
                                  max_running_requests=max_running_requests)
        self.outbox: List[object] = []
        self.sched = Scheduler(self.args, self.runner, send=self.outbox.append)

    def submit(self, rid: str, input_ids, **sampling) -> None:
        extra = {k: sampling.pop(k) for k in ("return_logprob", "logprob_start_len", "top_logprobs_num",
                                              "stream", "extra_key") if k in sampling}
        self.sched.process_input(TokenizedGenerateReqInput(rid, list(input_ids), SamplingParams(**sampling), **extra))

    def run(self) -> Dict[str, dict]:
        self.sched.run_until_idle()
        return self.finals()

    def finals(self) -> Dict[str, dict]:
        out = {}
        for msg in self.outbox:
            if not isinstance(msg, BatchTokenIDOut):
                continue
            for rid, ids, fin, meta in zip(msg.rids, msg.output_ids, msg.finished_reasons, msg.meta_info):
                if fin is not None:
                    assert rid not in out, f"{rid} finished twice"
                    out[rid] = {"output_ids": ids, "finish": fin, "meta": meta}
        return out

    def assert_conserved(self) -> None:
        assert self.sched.is_idle()
        self.sched.check_memory_conservation()
        self.sched.tree_cache.check_invariants()
