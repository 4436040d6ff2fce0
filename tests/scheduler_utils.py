"""Drive the scheduler loop in-process: submit tokenized requests, collect final outputs."""

from __future__ import annotations

from typing import Dict, List, Optional

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
        """Each finished rid's whole output, rebuilt from its incremental updates."""
        out: Dict[str, dict] = {}
        ids: Dict[tuple, List[int]] = {}
        metas: Dict[tuple, dict] = {}
        for msg in self.outbox:
            if not isinstance(msg, BatchTokenIDOut):
                continue
            offsets = msg.output_offsets or [0] * len(msg.rids)
            for rid, piece, offset, fin, meta in zip(msg.rids, msg.output_ids, offsets, msg.finished_reasons,
                                                     msg.meta_info):
                key = (meta.get("parent_rid"), rid)
                so_far = ids.setdefault(key, [])
                assert offset == len(so_far), f"{rid}: an update from {offset} after {len(so_far)} ids"
                so_far.extend(piece)
                metas[key] = _merge_meta(metas.get(key), meta)
                if fin is not None:
                    assert rid not in out, f"{rid} finished twice"
                    out[rid] = {"output_ids": so_far, "finish": fin, "meta": metas[key]}
        return out

    def assert_conserved(self) -> None:
        assert self.sched.is_idle()
        self.sched.check_memory_conservation()
        self.sched.tree_cache.check_invariants()


def _merge_meta(before: Optional[dict], meta: dict) -> dict:
    """Totals from the newest update, output logprob pieces appended, input logprobs from the first."""
    merged = dict(meta)
    for key in ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs"):
        if before is not None and key in meta:
            merged[key] = before.get(key, []) + meta[key]
    for key in ("input_token_logprobs", "input_top_logprobs"):
        if meta.get(key) is None and before is not None and key in before:
            merged[key] = before[key]
    return merged
