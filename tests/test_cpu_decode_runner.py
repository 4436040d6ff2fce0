"""The CPU decode runner (srt/model_executor/cpu_decode_runner.py) against the module forward it
stands in for: bit-identical logits step by step, used for every decode step, off where it
cannot serve."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model_utils import assert_pool_conserved, greedy_run, make_runner, random_prompts
from srt.model_executor.cpu_decode_runner import CpuDecodeRunner, _unsupported
from srt.model_executor.static_batch import StaticBatch
from srt.models.llama import LlamaDecoderLayer


def _module_and_runner_logits(runner, prompts, steps):
    """Each decode step through the module forward and through the runner, on the same batch
    (the step's K/V are written twice, with the same values, at the same slots)."""
    batch = StaticBatch(runner, len(prompts))
    pairs = []
    try:
        nxt = batch.extend(prompts).next_token_logits.argmax(-1)
        for _ in range(steps):
            fb = batch.prepare_decode(nxt)
            runner.attn_backend.init_forward_metadata(fb)
            with torch.inference_mode():
                modules = runner.model.forward(fb.input_ids, fb.positions, fb).next_token_logits
                flat = runner.cpu_decode_runner.forward(fb).next_token_logits
            pairs.append((modules, flat))
            nxt = modules.argmax(-1)
    finally:
        batch.release()
    return pairs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runner_logits_equal_the_module_forward(request, arch, dtype):
    path = request.getfixturevalue(f"{arch}_model")
    runner = make_runner(path, dtype=dtype)
    assert runner.cpu_decode_runner is not None, CpuDecodeRunner.why_not(runner)
    prompts = random_prompts(runner.model_config.vocab_size, [5, 33, 1, 70], seed=3)
    pairs = _module_and_runner_logits(runner, prompts, steps=6)
    assert len(pairs) == 6
    for modules, flat in pairs:
        assert modules.shape == flat.shape == (4, runner.model_config.vocab_size)
        assert torch.equal(modules, flat)
    assert_pool_conserved(runner)


def test_runner_logits_equal_with_pages_of_16(llama_model):
    runner = make_runner(llama_model, page_size=16)
    assert runner.cpu_decode_runner is not None
    prompts = random_prompts(runner.model_config.vocab_size, [17, 3, 40], seed=5)
    for modules, flat in _module_and_runner_logits(runner, prompts, steps=5):
        assert torch.equal(modules, flat)
    assert_pool_conserved(runner)


@pytest.mark.parametrize("arch,dtype,kv,store", [("llama", "float32", "bf16", torch.bfloat16),
                                                 ("qwen3", "float32", "bf16", torch.bfloat16),
                                                 ("llama", "bfloat16", "fp32", torch.float32)])
def test_runner_serves_a_pool_of_another_dtype(request, arch, dtype, kv, store):
    """--kv-cache-dtype bf16 under an fp32 model (or fp32 under bf16): the runner casts each step's
    K/V rows on store as the pool's set_kv_buffer does, so its logits still equal the module forward's."""
    runner = make_runner(request.getfixturevalue(f"{arch}_model"), dtype=dtype, kv_cache_dtype=kv)
    assert runner.dtype == getattr(torch, dtype) and runner.token_to_kv_pool.store_dtype == store
    assert runner.cpu_decode_runner is not None, CpuDecodeRunner.why_not(runner)
    prompts = random_prompts(runner.model_config.vocab_size, [6, 29, 2], seed=11)
    pairs = _module_and_runner_logits(runner, prompts, steps=5)
    assert len(pairs) == 5
    for modules, flat in pairs:
        assert modules.dtype == flat.dtype
        assert torch.equal(modules, flat)
    assert_pool_conserved(runner)


def test_every_decode_step_goes_through_the_runner(llama_model, monkeypatch):
    runner = make_runner(llama_model)
    off = make_runner(llama_model)
    off.cpu_decode_runner = None
    calls = []
    real = runner.cpu_decode_runner.forward
    monkeypatch.setattr(runner.cpu_decode_runner, "forward", lambda fb: (calls.append(fb.batch_size), real(fb))[1])
    prompts = random_prompts(runner.model_config.vocab_size, [4, 9, 21])
    toks, first = greedy_run(runner, prompts, steps=7)
    ref_toks, ref_first = greedy_run(off, prompts, steps=7)
    assert calls == [3] * 7  # decode only: the extend ran the module forward
    assert toks == ref_toks and torch.equal(first, ref_first)
    assert_pool_conserved(runner)
    assert_pool_conserved(off)


def test_off_where_it_cannot_serve(llama_model, monkeypatch):
    fp8 = make_runner(llama_model, kv_cache_dtype="fp8_e4m3")
    assert fp8.cpu_decode_runner is None
    assert "paged decode op" in CpuDecodeRunner.why_not(fp8)  # it serves fp32 and bf16 pools only

    runner = make_runner(llama_model)
    runner.server_args = dataclasses.replace(runner.server_args, enable_torch_compile=True)
    assert "--enable-torch-compile" in CpuDecodeRunner.why_not(runner)

    monkeypatch.setenv("SRT_CPU_DECODE_RUNNER", "0")
    assert make_runner(llama_model).cpu_decode_runner is None


def test_a_layer_with_its_own_forward_is_not_bound(llama_model):
    runner = make_runner(llama_model)
    assert _unsupported(runner.model) is None
    layer = runner.model.model.layers[1]
    layer.__class__ = type("PatchedLayer", (LlamaDecoderLayer,), {"forward": lambda self, *args: args[1]})
    assert "PatchedLayer" in _unsupported(runner.model)


def test_a_step_on_another_backend_runs_the_module_forward(llama_model):
    """A benchmark swaps the attention backend (bench_one_batch --decode-attention): that step must
    run the swapped backend's decode, not the op the runner bound."""
    from kernels.attention.torch_native_backend import TorchNativeAttnBackend

    runner = make_runner(llama_model)
    bound = runner.attn_backend
    runner.attn_backend = TorchNativeAttnBackend("cpu")  # the torch path: no paged op
    calls = []
    real = runner.cpu_decode_runner.forward
    runner.cpu_decode_runner.forward = lambda fb: (calls.append(fb), real(fb))[1]
    prompts = random_prompts(runner.model_config.vocab_size, [6, 12])
    toks, _ = greedy_run(runner, prompts, steps=3)
    assert calls == [] and runner.attn_backend.decode_indices is not None  # the torch path gathered
    runner.attn_backend = bound
    assert greedy_run(runner, prompts, steps=3)[0] == toks
    assert len(calls) == 3
    assert_pool_conserved(runner)


def test_runner_follows_the_kv_buffers_a_cache_flush_replaces(llama_model):
    """`/flush_cache` gives an empty CPU pool's pages back by replacing its buffers
    (`release_host_pages`): the runner must write and read the new ones, not the old."""
    runner = make_runner(llama_model)
    off = make_runner(llama_model)
    off.cpu_decode_runner = None
    prompts = random_prompts(runner.model_config.vocab_size, [8, 19])
    before = greedy_run(runner, prompts, steps=5)[0]
    old = runner.token_to_kv_pool.k_buffer[0]
    assert runner.token_to_kv_pool.release_host_pages()
    assert runner.token_to_kv_pool.k_buffer[0] is not old
    assert greedy_run(runner, prompts, steps=5)[0] == before == greedy_run(off, prompts, steps=5)[0]
    assert_pool_conserved(runner)
