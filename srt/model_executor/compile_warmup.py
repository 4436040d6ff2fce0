"""torch.compile of the decode forward: inductor freezing on CPU, and the compile done at start-up
so that no request waits for inductor.

Freezing turns the weights into constants of the graph, so inductor packs each linear weight into
oneDNN's blocked layout itself (`mkldnn._linear_pointwise`) and folds what it can around them; the
weights never change after loading, which is what makes that safe. Dynamo decides whether the
parameters are graph inputs or constants from inductor's global `freezing` flag while it traces,
which `torch.compile(options=...)` does not reach, so every call runs under `config.patch`
(~15 us against a decode step of tens of ms).

`torch.compile(..., dynamic=True)` still specialises a size of 1, so decode at batch 1 and at
batch 2 give the two graphs every later batch size and KV length reuses. The warm-up drives a
dummy batch through `StaticBatch` (rows and KV slots taken and given back as the scheduler does)
before the scheduler exists; the pools are empty again when it returns.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

import torch
import torch._inductor.config as inductor_config

from srt.model_executor.static_batch import StaticBatch

if TYPE_CHECKING:
    from srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

WARMUP_PROMPT_LEN = 4
WARMUP_DECODE_STEPS = 2


def compile_decode_forward(forward: Callable, device: str) -> Callable:
    """`forward` compiled with dynamic shapes; on CPU with inductor freezing its weights."""
    compiled = torch.compile(forward, dynamic=True)
    if device != "cpu":
        return compiled

    def frozen_forward(*args):
        with inductor_config.patch(freezing=True):
            return compiled(*args)

    return frozen_forward


def warmup_batch_sizes(max_bs: int, max_running_requests: int) -> list:
    """Batch 1 and batch 2 (the smallest non-specialised size), within the limits."""
    return [bs for bs in (1, 2) if bs <= min(max_bs, max_running_requests)]


def warmup_compiled_decode(runner: ModelRunner) -> float:
    """Run each warm-up batch size through prefill (eager) and decode (compiled); seconds taken."""
    t0 = time.perf_counter()
    sizes = warmup_batch_sizes(runner.server_args.torch_compile_max_bs, runner.max_running_requests)
    for bs in sizes:
        batch = StaticBatch(runner, bs)
        try:
            batch.extend([[(i + j) % runner.model_config.vocab_size for j in range(WARMUP_PROMPT_LEN)]
                          for i in range(bs)])
            ids = torch.zeros(bs, dtype=torch.int64, device=runner.device)
            for _ in range(WARMUP_DECODE_STEPS):
                batch.decode(ids)
        finally:
            batch.release()
    took = time.perf_counter() - t0
    logger.info("torch.compile: compiled the decode forward for batch sizes %s in %.1f s at start-up; every "
                "decode batch up to --torch-compile-max-bs=%d reuses it.", sizes, took,
                runner.server_args.torch_compile_max_bs)
    return took
