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


def _paired_logits(runner, prompts, steps, first, second):
    """Each decode step's logits through `first(fb)` and `second(fb)` on the same batch (the step's
    K/V are written twice, with the same values, at the same slots); the next token is first's."""
    batch = StaticBatch(runner, len(prompts))
    pairs = []
    try:
        nxt = batch.extend(prompts).next_token_logits.argmax(-1)
        for _ in range(steps):
            fb = batch.prepare_decode(nxt)
            runner.attn_backend.init_forward_metadata(fb)
            with torch.inference_mode():
                pairs.append((first(fb), second(fb)))
            nxt = pairs[-1][0].argmax(-1)
    finally:
        batch.release()
    return pairs


def _module_and_runner_logits(runner, prompts, steps):
    """Each decode step through the module forward and through the runner."""
    return _paired_logits(runner, prompts, steps,
                          lambda fb: runner.model.forward(fb.input_ids, fb.positions, fb).next_token_logits,
                          lambda fb: runner.cpu_decode_runner.forward(fb).next_token_logits)


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


def _python_and_op_logits(runner, prompts, steps):
    """Each decode step through the runner's Python layer loop and through decode_layers (the C++
    loop)."""
    dr = runner.cpu_decode_runner

    def step(fb, use_layer_op):
        dr.use_layer_op = use_layer_op
        return dr.forward(fb).next_token_logits

    try:
        return _paired_logits(runner, prompts, steps, lambda fb: step(fb, False), lambda fb: step(fb, True))
    finally:
        dr.use_layer_op = dr.why_no_layer_op is None


@pytest.mark.parametrize("arch,dtype,kv", [("llama", "float32", "auto"), ("llama", "bfloat16", "auto"),
                                           ("qwen2", "float32", "auto"), ("mistral", "bfloat16", "auto"),
                                           ("llama", "float32", "bf16")])
def test_layer_op_equals_the_python_loop(request, arch, dtype, kv):
    """decode_layers runs the Python loop's ops in its order with its arguments: bit-identical logits
    (Qwen2's qkv bias, bf16 weights, a bf16 pool under fp32 weights)."""
    runner = make_runner(request.getfixturevalue(f"{arch}_model"), dtype=dtype, kv_cache_dtype=kv)
    dr = runner.cpu_decode_runner
    assert dr is not None and dr.why_no_layer_op is None and dr.use_layer_op
    assert dr.layer_op_rows >= 4
    calls = []
    real_op = torch.ops.srt_cpu.decode_layers

    class Ops:  # the real ops, counting decode_layers calls
        def __getattr__(self, name):
            return getattr(torch.ops.srt_cpu, name)

        def decode_layers(self, *args):
            calls.append(args[0].shape[0])
            return real_op(*args)

    dr.ops = Ops()
    prompts = random_prompts(runner.model_config.vocab_size, [5, 33, 1, 70], seed=7)
    pairs = _python_and_op_logits(runner, prompts, steps=5)
    assert calls == [4] * 5  # the op ran every step, the Python loop did not call it
    for python, op in pairs:
        assert python.shape == op.shape == (4, runner.model_config.vocab_size)
        assert torch.equal(python, op)
    assert_pool_conserved(runner)


def test_layer_op_off_where_it_cannot_serve(qwen3_model, llama_model, monkeypatch):
    """Qwen3's q/k norms run in Python: its layers keep the Python loop (still bit-identical to
    the module forward, test above); SRT_CPU_DECODE_LAYER_OP=0 turns the op off; a step with more
    rows than the bound linears serve runs the Python loop."""
    qwen3 = make_runner(qwen3_model).cpu_decode_runner
    assert qwen3.layer_args is None and not qwen3.use_layer_op
    assert "q/k norms" in qwen3.why_no_layer_op

    monkeypatch.setenv("SRT_CPU_DECODE_LAYER_OP", "0")
    off = make_runner(llama_model).cpu_decode_runner
    assert off is not None and off.why_no_layer_op == "SRT_CPU_DECODE_LAYER_OP=0" and not off.use_layer_op
    monkeypatch.delenv("SRT_CPU_DECODE_LAYER_OP")

    runner = make_runner(llama_model)
    dr = runner.cpu_decode_runner
    dr.layer_op_rows = 2  # as if the linears served 2 rows at most
    ran = []
    python_loop = dr._layers
    dr._layers = lambda fb, hidden: (ran.append(hidden.shape[0]), python_loop(fb, hidden))[1]
    prompts = random_prompts(runner.model_config.vocab_size, [4, 9, 21], seed=2)
    toks = greedy_run(runner, prompts, steps=3)[0]
    assert ran == [3, 3, 3]
    dr._layers = python_loop
    dr.layer_op_rows = 1 << 20
    assert greedy_run(runner, prompts, steps=3)[0] == toks
    assert_pool_conserved(runner)


@pytest.mark.parametrize("gemm", ["srt", "onednn", "dense", "amx"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_op_runs_every_linear_kind(llama_model, monkeypatch, gemm, dtype):
    """Each way a linear can be bound (SRT_CPU_GEMM: panels, oneDNN's packed layout, dense fp32, AMX
    tiles; unpacked where none applies) runs the same call inside decode_layers as in the Python
    loop. A choice this CPU cannot pack for falls back to another kind."""
    monkeypatch.setenv("SRT_CPU_GEMM", gemm)
    runner = make_runner(llama_model, dtype=dtype)
    dr = runner.cpu_decode_runner
    assert dr is not None and dr.why_no_layer_op is None, dr and dr.why_no_layer_op
    kinds = {lin.kind for layer in dr.layers for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)}
    assert kinds and kinds <= set(range(6))
    prompts = random_prompts(runner.model_config.vocab_size, [3, 17, 40], seed=13)
    for python, op in _python_and_op_logits(runner, prompts, steps=3):
        assert torch.equal(python, op)
    assert_pool_conserved(runner)


def test_layer_op_runs_unpacked_weights(llama_model, monkeypatch):
    """Weights left dense (no packing: F.linear in the Python loop, at::linear in the op): the
    panels (forced, on any CPU) laid back out as [out, in] weights."""
    monkeypatch.setenv("SRT_CPU_GEMM", "srt")
    runner = make_runner(llama_model)
    for layer in runner.model.model.layers:
        for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            packed = module.packed_weight
            assert packed is not None and packed.dim() == 3  # panels [P, K, width]
            dense = packed.permute(0, 2, 1).reshape(-1, packed.shape[1])[:module.output_size]
            module.weight = torch.nn.Parameter(dense.contiguous(), requires_grad=False)
            module.packed_weight = None
    runner.cpu_decode_runner = dr = CpuDecodeRunner(runner)
    kinds = {lin.kind for layer in dr.layers for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)}
    assert kinds == {4} and dr.why_no_layer_op is None
    prompts = random_prompts(runner.model_config.vocab_size, [7, 2, 30], seed=17)
    for python, op in _python_and_op_logits(runner, prompts, steps=3):
        assert torch.equal(python, op)
    assert_pool_conserved(runner)


def test_layer_op_refuses_arguments_that_do_not_fit(llama_model):
    """decode_layers checks its per-layer lists before it runs anything: a clear error, no write."""
    runner = make_runner(llama_model)
    dr = runner.cpu_decode_runner
    a = dr.layer_args
    pool = runner.token_to_kv_pool
    k0 = pool.k_buffer[0].clone()
    hidden = torch.zeros(1, runner.model_config.hidden_size, device="cpu")
    one = torch.ones(1, dtype=torch.int64, device="cpu")
    rows = runner.req_to_token_pool.req_to_token
    n = len(a.layer_ids)
    assert len(pool.k_buffer) == len(pool.v_buffer) == n

    def call(**changes):
        args = a._replace(**changes)
        return torch.ops.srt_cpu.decode_layers(
            hidden, one, one, rows, one * 0, one, pool.k_buffer, pool.v_buffer, args.layer_ids, args.norms,
            args.eps, args.weights, args.biases, args.kinds, args.out_features, args.cos, args.sin, args.num_heads,
            args.num_kv_heads, args.head_dim, args.scaling, args.kv_dtype)

    norms = f"two norms and two eps per layer: {n} layers need {2 * n}, got {2 * n} norms and {2 * n - 1} eps"
    with pytest.raises(RuntimeError, match=norms):
        call(eps=a.eps[:-1])
    linears = rf"four linears .* {n} layers need {4 * n} of each, got {4 * n}, {4 * n}, {4 * n - 1}, {4 * n}"
    with pytest.raises(RuntimeError, match=linears):
        call(kinds=a.kinds[:-1])
    with pytest.raises(RuntimeError, match=r"unknown linear kind 9 \(kinds are 0 to 5\)"):
        call(kinds=a.kinds[:-1] + [9])
    with pytest.raises(RuntimeError, match=f"one cos and one sin table per layer: {n} layers, got {n} and {n - 1}"):
        call(sin=a.sin[:-1])
    with pytest.raises(RuntimeError, match=rf"layer id {n} has no KV buffer \({n} K and {n} V buffers\)"):
        call(layer_ids=a.layer_ids[:-1] + [n])
    assert torch.equal(pool.k_buffer[0], k0)
    assert_pool_conserved(runner)
