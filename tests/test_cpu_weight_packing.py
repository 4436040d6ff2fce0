"""Packed CPU linear weights (oneDNN's layout, and kernels/cpu/gemm.py's panels): same numbers as
the dense F.linear path (the oracle), the dense copies freed, the packed bytes counted, which
layout `SRT_CPU_GEMM` picks, and the switches that turn packing off."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from model_utils import assert_bf16_close_to_dense, assert_pool_conserved, greedy_run, make_runner, random_prompts
from srt.layers.linear import LinearBase
from srt.check_config_weights import loaded_model_nbytes
from srt.configs.model_config import ModelConfig
from srt.layers import cpu_weight_packing
from srt.layers.cpu_weight_packing import pack_weight, packed_linear, packing_supported
from kernels.cpu.gemm import load_dense_ops, load_gemm_ops, panel_width
from srt.model_executor.memory_sizing import module_nbytes

pytestmark = pytest.mark.skipif(not packing_supported("cpu", torch.float32),
                                reason="this torch build has no oneDNN (CPU weight packing is off)")


BF16_PACKS = packing_supported("cpu", torch.bfloat16)  # oneDNN needs AVX-512 or AVX-NE-CONVERT for it
GEMMS = ["onednn", pytest.param("srt", marks=pytest.mark.skipif(not load_gemm_ops(), reason="no C++ kernels here")),
         pytest.param("dense", marks=pytest.mark.skipif(not load_dense_ops(), reason="no AVX-512 C++ kernels here"))]


@pytest.fixture(params=GEMMS)
def gemm(request, monkeypatch):
    """Every model test below runs once per packed layout."""
    monkeypatch.setenv("SRT_CPU_GEMM", request.param)
    return request.param


def _padded_rows(rows: int, gemm: str) -> int:
    return -(-rows // panel_width()) * panel_width() if gemm == "srt" else rows


@pytest.mark.parametrize("dtype,tol", [
    (torch.float32, 1e-5),
    pytest.param(torch.bfloat16, 1e-2, marks=pytest.mark.skipif(not BF16_PACKS, reason="no bf16 packing on this CPU")),
], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [0, 1, 7, 16, 300])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_packed_linear_equals_dense(dtype, tol, rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(96, 80, generator=g) * 0.1).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, 80, generator=g).to(dtype)
    got = packed_linear(x, pack_weight(w), b)
    assert got.shape == (rows, 96) and got.dtype == dtype
    torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), rtol=tol, atol=tol)


def test_packed_linear_takes_a_non_contiguous_input():
    w = torch.randn(32, 16)
    x = torch.randn(16, 10).t()  # [10, 16], column-major
    torch.testing.assert_close(packed_linear(x, pack_weight(w)), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_a_bf16_model_keeps_dense_weights_where_the_cpu_cannot_pack_them(tiny_model_factory, monkeypatch):
    monkeypatch.setattr(cpu_weight_packing, "_packs_on_this_cpu", lambda dtype: dtype == torch.float32)
    monkeypatch.setenv("SRT_CPU_GEMM", "onednn")
    monkeypatch.setenv("SRT_CPU_WIDEN_BF16", "0")
    runner = make_runner(tiny_model_factory("llama"), dtype="bfloat16")
    assert all(m.packed_weight is None and m.weight.numel() > 0 for m in _linears(runner.model))
    toks, _ = greedy_run(runner, random_prompts(500, (5, 9), seed=1), steps=3)
    assert len(toks) == 2 and all(len(t) == 4 for t in toks)
    assert_pool_conserved(runner)


def _linears(model):
    return [m for m in model.modules() if isinstance(m, LinearBase)]


def test_runner_packs_every_linear_and_frees_the_dense_weights(tiny_model_factory, monkeypatch, gemm):
    path = tiny_model_factory("qwen2", tie_word_embeddings=True)
    packed = make_runner(path)
    monkeypatch.setenv("SRT_CPU_WEIGHT_PACKING", "0")
    dense = make_runner(path)
    layers = _linears(packed.model)
    onednn = gemm == "onednn"
    assert layers and all(m.packed_weight is not None and m.packed_weight.is_mkldnn == onednn for m in layers)
    assert all(m.weight.numel() == 0 for m in layers)
    assert all(m.packed_weight is None and m.weight.numel() > 0 for m in _linears(dense.model))
    # Tied head: the embedding keeps its dense rows, the head holds a packed copy of them (dense:
    # the embedding's rows themselves).
    embed = packed.model.model.embed_tokens
    assert packed.model.lm_head is embed and embed.weight.numel() > 0 and embed.packed_weight.is_mkldnn == onednn
    if gemm == "dense":
        assert embed.packed_weight.data_ptr() == embed.weight.data_ptr()
    # The packed bytes are counted (KV sizing subtracts them): the same total plus the head's copy
    # (and with panels the zero rows padding each weight to whole panels).
    size = embed.weight.element_size()
    extra = _padded_rows(embed.weight.shape[0], gemm) * embed.weight.shape[1] * size if gemm != "dense" else 0
    extra += sum((_padded_rows(m.packed_out_features, gemm) - m.packed_out_features) * m.input_size * size
                 for m in layers)
    assert module_nbytes(packed.model) == module_nbytes(dense.model) + extra
    assert "packed_weight" not in "".join(packed.model.state_dict())


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_packed_model_matches_the_dense_one(tiny_model_factory, monkeypatch, arch, gemm):
    path = tiny_model_factory(arch)
    prompts = random_prompts(500, (5, 33, 17), seed=3)
    packed = make_runner(path)
    toks, logits = greedy_run(packed, prompts, steps=12)
    monkeypatch.setenv("SRT_CPU_WEIGHT_PACKING", "0")
    dense = make_runner(path)
    ref_toks, ref_logits = greedy_run(dense, prompts, steps=12)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert toks == ref_toks
    assert_pool_conserved(packed)
    assert_pool_conserved(dense)


def test_untied_head_is_packed_and_its_dense_copy_freed(llama_model, gemm):
    runner = make_runner(llama_model)
    head = runner.model.lm_head
    assert head is not runner.model.model.embed_tokens
    assert head.packed_weight.is_mkldnn == (gemm == "onednn") and head.weight.numel() == 0


def test_torch_compile_keeps_dense_weights(llama_model, caplog):
    """inductor cannot trace an opaque oneDNN tensor, so --enable-torch-compile skips packing and
    says so where packing would otherwise have run, with the memory inductor's frozen copies take."""
    with caplog.at_level("WARNING", logger="srt.layers.cpu_weight_packing"):
        runner = make_runner(llama_model, enable_torch_compile=True)
    assert all(m.packed_weight is None and m.weight.numel() > 0 for m in _linears(runner.model))
    warned = [r.getMessage() for r in caplog.records if "--enable-torch-compile leaves" in r.getMessage()]
    would_pack = cpu_weight_packing.will_pack("cpu", runner.dtype, False)
    assert len(warned) == (1 if would_pack else 0), warned
    if would_pack:
        assert "scripts/bench_one_batch.py" in warned[0] and "packs its own copy in each of its 2 graphs" in warned[0]
        assert re.search(r"\(\+\d+\.\d\d GiB\)", warned[0]), warned[0]


def test_no_compile_warning_when_packing_is_switched_off(llama_model, caplog, monkeypatch):
    monkeypatch.setenv("SRT_CPU_WEIGHT_PACKING", "0")
    with caplog.at_level("WARNING", logger="srt.layers.cpu_weight_packing"):
        make_runner(llama_model, enable_torch_compile=True)
    assert not [r for r in caplog.records if "--enable-torch-compile leaves" in r.getMessage()]


# ---------------------------------------------------------------------- bf16 widened to fp32
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_widened_bf16_linear_is_the_fp32_product_rounded_to_bf16(bias):
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(96, 80, generator=g) * 0.1).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    x = torch.randn(7, 80, generator=g).bfloat16()
    packed = pack_weight(w, widen=True)
    assert packed.dtype == torch.float32
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    got = packed_linear(x, packed, b)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.bfloat16().float(), rtol=0, atol=0)
    wide = packed_linear(x, packed, b, out_dtype=torch.float32)
    assert wide.dtype == torch.float32
    torch.testing.assert_close(wide, want, rtol=1e-5, atol=1e-5)
    assert packed_linear(x[:0], packed, b).dtype == torch.bfloat16


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_bf16_model_without_bf16_matmuls_runs_on_widened_weights(tiny_model_factory, monkeypatch, tied):
    """On a CPU without bf16 matrix instructions (forced here): fp32 packed weights, bf16 everywhere
    else, the same greedy tokens as the bf16 model on torch's bf16 matmuls, and the fp32 bytes
    counted in the load and in check_config's meta-device estimate alike."""
    monkeypatch.setattr(cpu_weight_packing, "cpu_has_fast_bf16", lambda: False)
    monkeypatch.setenv("SRT_CPU_GEMM", "onednn")  # panels keep bf16 weights (tested below)
    path = tiny_model_factory("llama", tie_word_embeddings=tied)
    prompts = random_prompts(500, (5, 33, 17), seed=4)
    wide = make_runner(path, dtype="bfloat16")
    layers = _linears(wide.model)
    assert layers and all(m.packed_weight.dtype == torch.float32 and m.weight.numel() == 0 for m in layers)
    assert wide.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert wide.token_to_kv_pool.k_buffer[0].dtype == torch.bfloat16
    monkeypatch.setenv("SRT_CPU_WIDEN_BF16", "0")
    dense = assert_bf16_close_to_dense(wide, path, prompts, monkeypatch)
    # Every linear weight (and a tied head's copy) now takes 4 bytes a value instead of 2.
    extra = sum(m.weight.numel() * 2 for m in _linears(dense.model))
    head = dense.model.lm_head.weight.numel()
    extra += head * 4 if tied else head * 2
    assert module_nbytes(wide.model) == module_nbytes(dense.model) + extra
    monkeypatch.delenv("SRT_CPU_WIDEN_BF16")
    monkeypatch.delenv("SRT_CPU_WEIGHT_PACKING")
    config = ModelConfig.load(str(path), "bfloat16")
    assert loaded_model_nbytes(config, device="cpu") == module_nbytes(wide.model)
    assert_pool_conserved(wide)
    assert_pool_conserved(dense)


# ---------------------------------------------------------------------- panels (kernels/cpu/gemm.py)
@pytest.mark.skipif(not load_gemm_ops(), reason="the C++ CPU kernels cannot build here")
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_bf16_model_on_panels_keeps_bf16_weights(tiny_model_factory, monkeypatch, tied):
    """Panels hold bf16 weights as bf16 (the kernel widens them in registers): the same greedy
    tokens as the dense bf16 model, no fp32 copy, and the bytes (padding and a tied head's copy)
    counted in the load and in check_config's meta-device estimate alike."""
    monkeypatch.setenv("SRT_CPU_GEMM", "srt")
    path = tiny_model_factory("llama", tie_word_embeddings=tied)
    prompts = random_prompts(500, (5, 33, 17), seed=4)
    panels = make_runner(path, dtype="bfloat16")
    layers = _linears(panels.model)
    assert layers and all(m.packed_weight.dtype == torch.bfloat16 and not m.packed_weight.is_mkldnn
                          and m.weight.numel() == 0 for m in layers)
    dense = assert_bf16_close_to_dense(panels, path, prompts, monkeypatch)
    head = panels.model.lm_head
    extra = _padded_rows(head.packed_out_features, "srt") * head.packed_weight.shape[1] * 2 if tied else 0
    extra += sum((_padded_rows(m.packed_out_features, "srt") - m.packed_out_features) * m.packed_weight.shape[1] * 2
                 for m in layers + ([] if tied else [head]))
    assert module_nbytes(panels.model) == module_nbytes(dense.model) + extra
    monkeypatch.delenv("SRT_CPU_WEIGHT_PACKING")
    config = ModelConfig.load(str(path), "bfloat16")
    assert loaded_model_nbytes(config, device="cpu") == module_nbytes(panels.model)
    assert_pool_conserved(panels)
    assert_pool_conserved(dense)


@pytest.mark.skipif(not load_gemm_ops(), reason="the C++ CPU kernels cannot build here")
def test_gemm_choice_follows_the_cpu_and_the_switch(monkeypatch):
    monkeypatch.setattr(cpu_weight_packing, "cpu_has_avx512", lambda: False)
    assert cpu_weight_packing.uses_panel_gemm("cpu", torch.float32)  # auto, AVX2-only: panels
    assert cpu_weight_packing.uses_panel_gemm("cpu", torch.bfloat16)
    assert not cpu_weight_packing.widens_bf16("cpu", torch.bfloat16)  # panels keep bf16 weights
    assert not cpu_weight_packing.uses_panel_gemm("cpu", torch.float16)
    assert not cpu_weight_packing.uses_panel_gemm("cuda:0", torch.float32)
    assert not cpu_weight_packing.uses_dense_gemm("cpu", torch.float32)  # the dot kernel needs AVX-512
    monkeypatch.setattr(cpu_weight_packing, "cpu_has_avx512", lambda: True)
    assert not cpu_weight_packing.uses_panel_gemm("cpu", torch.float32)  # auto, AVX-512: dense fp32
    assert cpu_weight_packing.uses_dense_gemm("cpu", torch.float32) == load_dense_ops()
    assert not cpu_weight_packing.uses_dense_gemm("cpu", torch.bfloat16)  # bf16: oneDNN or AMX tiles
    assert not cpu_weight_packing.uses_dense_gemm("cuda:0", torch.float32)
    monkeypatch.setenv("SRT_CPU_GEMM", "srt")
    assert cpu_weight_packing.uses_panel_gemm("cpu", torch.float32)
    assert not cpu_weight_packing.uses_dense_gemm("cpu", torch.float32)
    monkeypatch.setenv("SRT_CPU_GEMM", "onednn")
    assert not cpu_weight_packing.uses_panel_gemm("cpu", torch.float32)
    assert not cpu_weight_packing.uses_dense_gemm("cpu", torch.float32)
    monkeypatch.setenv("SRT_CPU_GEMM", "mkl")
    with pytest.raises(ValueError, match=r"\$SRT_CPU_GEMM must be one of auto, srt, onednn, amx, dense, got 'mkl'"):
        cpu_weight_packing.uses_panel_gemm("cpu", torch.float32)
