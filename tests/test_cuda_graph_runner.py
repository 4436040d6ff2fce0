"""`CudaGraphRunner` on CPU: the same bucketing, padding and static buffers as on CUDA, replayed
eagerly. Outputs must match the plain decode path for every batch size 1 .. max_bs + 3."""

from __future__ import annotations

import pytest
import torch

from hot_path_utils import run_workload
from model_utils import make_runner, random_prompts
from scheduler_utils import Harness
from srt.model_executor.cuda_graph_runner import CudaGraphRunner, get_batch_sizes_to_capture
from srt.model_executor.static_batch import StaticBatch
from srt.server_args import ServerArgs

CAPTURE = [1, 2, 4, 8]
STEPS = 5


def _args(model, **kw):
    return ServerArgs(model_path=str(model), device="cpu", dtype="float32", **kw)


def test_default_buckets_follow_sglang(llama_model):
    assert get_batch_sizes_to_capture(_args(llama_model), 256) == [1, 2, 4, 8] + list(range(16, 161, 8))
    assert get_batch_sizes_to_capture(_args(llama_model, cuda_graph_max_bs=20), 256) == [1, 2, 4, 8, 16, 20]
    assert get_batch_sizes_to_capture(_args(llama_model, cuda_graph_max_bs=48), 40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert get_batch_sizes_to_capture(_args(llama_model, cuda_graph_bs=[12, 3, 3]), 256) == [3, 12]
    assert get_batch_sizes_to_capture(_args(llama_model), 6) == [1, 2, 4, 6]


def _decode(runner, prompts, steps):
    """Greedy extend + `steps` decodes; returns tokens and every step's logits."""
    batch = StaticBatch(runner, len(prompts))
    try:
        out = batch.extend(prompts)
        logits = [out.next_token_logits.clone()]
        toks = [[t] for t in out.next_token_logits.argmax(-1).tolist()]
        for _ in range(steps):
            out = batch.decode(torch.tensor([t[-1] for t in toks]))
            logits.append(out.next_token_logits.clone())
            for t, nxt in zip(toks, out.next_token_logits.argmax(-1).tolist()):
                t.append(nxt)
    finally:
        batch.release()
    return toks, torch.stack([x for x in logits[1:]]) if steps else None


@pytest.mark.parametrize("page_size", [1, 16])
def test_eager_replay_matches_plain_decode_for_every_batch_size(llama_model, page_size):
    runner = make_runner(llama_model, max_total_tokens=4096, max_running_requests=16, page_size=page_size)
    graphs = CudaGraphRunner(runner, capture_bs=CAPTURE, use_cuda_graph=False)
    vocab = runner.model_config.vocab_size
    free = runner.token_to_kv_pool_allocator.available_size()
    for bs in range(1, max(CAPTURE) + 4):
        prompts = random_prompts(vocab, [3 + (7 * i) % 23 for i in range(bs)], seed=bs)
        runner.graph_runner = None
        plain_toks, plain_logits = _decode(runner, prompts, STEPS)
        runner.graph_runner = graphs
        used = []
        real_replay = graphs.replay
        graphs.replay = lambda fb: (used.append(graphs.bucket(fb.batch_size)), real_replay(fb))[1]
        try:
            toks, logits = _decode(runner, prompts, STEPS)
        finally:
            graphs.replay = real_replay
        assert toks == plain_toks, f"bs={bs}"
        torch.testing.assert_close(logits, plain_logits, rtol=1e-5, atol=1e-5)
        if bs <= max(CAPTURE):
            assert used == [min(b for b in CAPTURE if b >= bs)] * STEPS, f"bs={bs} replayed {used}"
        else:
            assert used == [], f"bs={bs} above max_bs must run eagerly"
        assert runner.token_to_kv_pool_allocator.available_size() == free
    runner.graph_runner = None


def test_padded_rows_write_only_the_dummy_slot(llama_model):
    runner = make_runner(llama_model, max_total_tokens=1024, max_running_requests=8)
    runner.graph_runner = CudaGraphRunner(runner, capture_bs=[8], use_cuda_graph=False)
    batch = StaticBatch(runner, 3)
    try:
        out = batch.extend(random_prompts(runner.model_config.vocab_size, [5, 9, 4], seed=1))
        pool = runner.token_to_kv_pool
        for buf in pool.k_buffer:  # the pool is torch.empty: unwritten rows may hold NaN (NaN != NaN)
            buf.zero_()
        before = [b.clone() for b in pool.k_buffer]
        fb = batch.prepare_decode(out.next_token_logits.argmax(-1))
        runner.forward(fb)
        allowed = set(fb.out_cache_loc.tolist()) | {0}
        for layer, (old, new) in enumerate(zip(before, pool.k_buffer)):
            changed = set((old != new).flatten(1).any(1).nonzero().flatten().tolist())
            assert changed <= allowed, f"layer {layer} wrote slots {sorted(changed - allowed)}"
            assert changed >= set(fb.out_cache_loc.tolist())
    finally:
        batch.release()


@pytest.mark.parametrize("config", [dict(), dict(page_size=16, chunked_prefill_size=32)],
                         ids=["page1", "page16"])
def test_scheduler_with_graph_runner_matches_plain(llama_model, monkeypatch, config):
    monkeypatch.setenv("SRT_TEST_RETRACT_INTERVAL", "5")
    plain = Harness(llama_model, **config)
    expected = run_workload(plain)
    graphs = Harness(llama_model, **config)
    graphs.runner.graph_runner = CudaGraphRunner(graphs.runner, capture_bs=[1, 2, 4, 8], use_cuda_graph=False)
    got = run_workload(graphs)
    graphs.assert_conserved()
    assert {k: v["output_ids"] for k, v in got.items()} == {k: v["output_ids"] for k, v in expected.items()}
    assert {k: v["finish"] for k, v in got.items()} == {k: v["finish"] for k, v in expected.items()}
    lp, lp_plain = got["logprobs"]["meta"], expected["logprobs"]["meta"]
    for (a, ta), (b, tb) in zip(lp["output_token_logprobs"], lp_plain["output_token_logprobs"]):
        assert ta == tb and a == pytest.approx(b, abs=1e-5)


def test_torch_compile_decode_on_cpu_matches_eager(llama_model):
    """--enable-torch-compile on CPU: decode batches up to --torch-compile-max-bs run the compiled
    forward (dynamic shapes); greedy outputs equal the eager ones, larger batches stay eager."""
    plain = Harness(llama_model)
    compiled = Harness(llama_model, enable_torch_compile=True, torch_compile_max_bs=2)
    assert compiled.runner.compiled_forward is not None and compiled.runner.graph_runner is None
    calls = []
    real = compiled.runner.compiled_forward
    compiled.runner.compiled_forward = lambda *a: (calls.append(a[2].batch_size), real(*a))[1]
    vocab = plain.runner.model_config.vocab_size
    prompts = random_prompts(vocab, [7, 12, 5], seed=9)
    for h in (plain, compiled):
        for i, p in enumerate(prompts[:2]):  # two requests: compiled decode
            h.submit(f"a{i}", p, max_new_tokens=6, temperature=0, ignore_eos=True)
        h.run()
        for i, p in enumerate(prompts):  # three: above the max bs, eager
            h.submit(f"b{i}", p, max_new_tokens=4, temperature=0, ignore_eos=True)
        h.run()
        h.assert_conserved()
    assert {k: v["output_ids"] for k, v in compiled.finals().items()} == \
        {k: v["output_ids"] for k, v in plain.finals().items()}
    assert calls and max(calls) <= 2


def test_failed_capture_names_the_batch_size_and_the_flags_that_skip_it(llama_model, monkeypatch):
    runner = make_runner(llama_model, max_total_tokens=1024, max_running_requests=8)
    for name in ("synchronize", "graph_pool_handle", "Stream"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (1 << 30, 1 << 31))

    def fail(self, bs):
        if bs == 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(CudaGraphRunner, "_capture_one", fail)
    with pytest.raises(RuntimeError) as err:
        CudaGraphRunner(runner, capture_bs=[1, 2, 4, 8], use_cuda_graph=True)
    message = str(err.value)
    assert message.startswith("CUDA graph capture failed at batch size 4: OutOfMemoryError: CUDA out of memory")
    for flag in ("--disable-cuda-graph", "--cuda-graph-max-bs", "--cuda-graph-bs"):
        assert flag in message
