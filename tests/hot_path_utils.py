"""Device-discipline helpers: a scheduler workload that touches every hot-path feature, and a
`TorchFunctionMode` that counts device-to-host syncs."""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List

import torch
from torch.overrides import TorchFunctionMode

from managers.io_struct import AbortReq, TokenizedGenerateReqInput
from model_utils import random_prompts
from srt.sampling.sampling_params import SamplingParams

# Calls that read a tensor's values on the host (a sync on CUDA), explicit or hidden.
SYNC_METHODS = {"item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__",
                "nonzero", "unique", "masked_select", "argwhere"}


class SyncCounter(TorchFunctionMode):
    """Counts host reads of tensor values: `.item()`, `.tolist()`, `.cpu()`, `int(t)`, ... plus
    the implicit ones (boolean-mask indexing, `nonzero`, `unique`, `repeat_interleave` without
    `output_size`)."""

    def __init__(self):
        super().__init__()
        self.calls: List[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in SYNC_METHODS:
            self.calls.append(name)
        elif name in ("__getitem__", "__setitem__") and _has_bool_index(args[1] if len(args) > 1 else None):
            self.calls.append(name + "[bool mask]")
        elif name == "repeat_interleave" and "output_size" not in kwargs and len(args) < 4:
            if len(args) > 1 and isinstance(args[1], torch.Tensor):
                self.calls.append("repeat_interleave without output_size")
        return func(*args, **kwargs)


def _has_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


@contextlib.contextmanager
def default_device(device: str) -> Iterator[None]:
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(None)


def submit_workload(harness) -> None:
    """Requests covering extend, prefix hits, chunking, n > 1, logprobs with top-k and token ids,
    penalties, seeds, min_new_tokens and logit_bias. Sampled requests are seeded, so two runs of
    the same harness settings give the same outputs."""
    vocab = harness.runner.model_config.vocab_size
    base = random_prompts(vocab, (40,), seed=3)[0]
    tails = random_prompts(vocab, (5, 30, 9, 70, 12, 3, 17, 26), seed=4)
    greedy = dict(temperature=0, ignore_eos=True)
    sampled = dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, ignore_eos=True)
    specs = [
        ("greedy-a", base + tails[0], dict(max_new_tokens=12, **greedy), {}),
        ("greedy-b", base + tails[1], dict(max_new_tokens=9, **greedy), {}),
        ("long", tails[3] + base, dict(max_new_tokens=6, **greedy), {}),
        ("seeded", base + tails[2], dict(max_new_tokens=10, sampling_seed=7, **sampled), {}),
        ("penal", tails[4], dict(max_new_tokens=14, frequency_penalty=0.5, presence_penalty=0.3,
                                 repetition_penalty=1.2, **greedy), {}),
        ("logprobs", base[:20] + tails[5],
         dict(max_new_tokens=8, **greedy),
         dict(return_logprob=True, logprob_start_len=2, top_logprobs_num=3, token_ids_logprob=[5, 9])),
        ("fanout", tails[6], dict(max_new_tokens=7, n=2, sampling_seed=11, **sampled), {}),
        ("bias", tails[7], dict(max_new_tokens=6, min_new_tokens=4, logit_bias={"7": 2.0}, temperature=0), {}),
        ("aborted", base + tails[6], dict(max_new_tokens=40, **greedy), {}),
    ]
    for rid, ids, params, extra in specs:
        harness.sched.process_input(TokenizedGenerateReqInput(rid, list(ids), SamplingParams(**params), **extra))


def run_workload(harness) -> Dict[str, dict]:
    """Submit the workload, abort one request after a few steps, run to idle."""
    submit_workload(harness)
    for _ in range(6):
        harness.sched.step()
    harness.sched.process_input(AbortReq(rid="aborted"))
    harness.sched.run_until_idle()
    return harness.finals()
