"""FlashInfer's CUDA-graph decode wiring, on CPU through the stand-in `flashinfer` (same plan/run
signatures; a `use_cuda_graph` wrapper copies each plan into its static buffers and runs from
them). The graph runner's eager replay over those buffers must equal the plain FlashInfer path."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from model_utils import make_runner, random_prompts
from srt.model_executor.cuda_graph_runner import CudaGraphRunner
from srt.model_executor.static_batch import StaticBatch

try:
    from tests import test_flashinfer_backend as fakes
except ImportError:
    import test_flashinfer_backend as fakes

CAPTURE = [1, 2, 4]


@pytest.fixture
def runner(monkeypatch, llama_model):
    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithRaggedKVCacheWrapper = fakes.FakeRaggedWrapper
    module.BatchPrefillWithPagedKVCacheWrapper = fakes.FakePrefillWrapper
    module.BatchDecodeWithPagedKVCacheWrapper = fakes.FakeDecodeWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    from kernels.attention.flashinfer_backend import FlashInferAttnBackend

    runner = make_runner(llama_model, max_total_tokens=2048, max_running_requests=8, page_size=4,
                         dtype="bfloat16")
    runner.torch_native = runner.attn_backend
    runner.attn_backend = FlashInferAttnBackend(runner, workspace_bytes=1024)
    return runner


def _decode(runner, prompts, steps=4):
    batch = StaticBatch(runner, len(prompts))
    try:
        out = batch.extend(prompts)
        toks, logits = [[t] for t in out.next_token_logits.argmax(-1).tolist()], []
        for _ in range(steps):
            out = batch.decode(torch.tensor([t[-1] for t in toks]))
            logits.append(out.next_token_logits.float().clone())
            for t, nxt in zip(toks, out.next_token_logits.argmax(-1).tolist()):
                t.append(nxt)
    finally:
        batch.release()
    return toks, torch.stack(logits)


def test_graph_decode_wrappers_replay_like_the_plain_flashinfer_path(runner):
    graphs = CudaGraphRunner(runner, capture_bs=CAPTURE, use_cuda_graph=False)
    backend = runner.attn_backend
    assert sorted(backend.graph_decode_wrappers) == CAPTURE
    assert all(w.use_cuda_graph for w in backend.graph_decode_wrappers.values())
    vocab = runner.model_config.vocab_size
    for bs in range(1, max(CAPTURE) + 4):
        prompts = random_prompts(vocab, [2 + (5 * i) % 13 for i in range(bs)], seed=bs)
        runner.graph_runner = None
        plain_toks, plain_logits = _decode(runner, prompts)
        runner.graph_runner = graphs
        toks, logits = _decode(runner, prompts)
        assert toks == plain_toks, f"bs={bs}"
        torch.testing.assert_close(logits, plain_logits, atol=2e-2, rtol=2e-2)
        if bs <= max(CAPTURE):
            wrapper = backend.graph_decode_wrappers[graphs.bucket(bs)]
            assert wrapper.num_plans > 0 and backend.active_decode_wrapper is wrapper
    runner.graph_runner = None


def test_stand_in_flashinfer_model_matches_torch_native(runner):
    prompts = random_prompts(runner.model_config.vocab_size, [6, 11, 3], seed=5)
    _, fi_logits = _decode(runner, prompts)
    runner.attn_backend = runner.torch_native
    _, native_logits = _decode(runner, prompts)
    torch.testing.assert_close(fi_logits, native_logits, atol=5e-2, rtol=5e-2)
