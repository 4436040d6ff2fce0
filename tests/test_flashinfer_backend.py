"""`FlashInferAttnBackend` computes what `TorchNativeAttnBackend` computes.

On CPU, a stand-in `flashinfer` module (same plan/run signatures, FlashInfer's semantics in torch)
checks the backend's wiring: metadata order, NHD page views, scale, causal flag, one plan per step.
On CUDA (`gpu` tests), the real kernels run against the torch oracle on the same pool: the oracle
writes each step's K/V, then FlashInfer reads it (`save_kv_cache=False`). The torch-native-on-CUDA
tests need no flashinfer, so a GPU box without it still checks the oracle and page table on CUDA.
"""

from __future__ import annotations

import importlib
import random
import sys
import types
from types import SimpleNamespace

import pytest
import torch

try:  # `tests` is a namespace package when the repo root is on sys.path
    from tests import test_flashinfer_metadata as layouts
except ImportError:  # pytest's rootdir insertion puts tests/ itself on sys.path
    import test_flashinfer_metadata as layouts

from kernels.attention.base_attn_backend import AttentionBackend
from kernels.attention.flashinfer_metadata import build_forward_metadata
from kernels.attention.torch_native_backend import TorchNativeAttnBackend

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

HEAD_DIM = 128
DECODE_STEPS = 3
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}


@pytest.fixture(scope="module")
def flashinfer():
    return pytest.importorskip("flashinfer")


class FakePagedWrapper:
    """Stand-in for FlashInfer's paged wrappers: checks what FlashInfer requires of the plan
    and the caches, then runs `layouts.paged_attention` on what was planned."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_tensor_cores=False, use_cuda_graph=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None):
        assert float_workspace_buffer.dtype == torch.uint8 and kv_layout == "NHD"
        self.use_tensor_cores = use_tensor_cores
        self.use_cuda_graph = use_cuda_graph
        self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        if use_cuda_graph:
            assert all(b is not None and b.dtype == torch.int32 for b in self.buffers)
            assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1
        self.num_plans = 0

    def _plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, dims, sm_scale, q_data_type,
              kv_data_type, pos_encoding_mode):
        H, KH, D, P = dims
        for t in (qo_indptr, kv_indptr, kv_indices, last_page_len):
            assert t.dtype == torch.int32 and t.dim() == 1
        assert len(qo_indptr) == len(kv_indptr) == len(last_page_len) + 1
        assert int(kv_indptr[-1]) == len(kv_indices)
        assert bool(((last_page_len >= 1) & (last_page_len <= P)).all())
        assert pos_encoding_mode == "NONE", "RoPE is applied by the model, not the kernel"
        self.plan_args = (qo_indptr, kv_indptr, kv_indices, last_page_len, dims,
                          sm_scale or D**-0.5, q_data_type, kv_data_type or q_data_type)
        self.num_plans += 1

    def run(self, q, paged_kv_cache):
        qo_indptr, kv_indptr, kv_indices, last_page_len, (H, KH, D, P), scale, qt, kvt = self.plan_args
        k_cache, v_cache = paged_kv_cache
        assert q.shape == (int(qo_indptr[-1]), H, D) and q.dtype == qt
        assert k_cache.shape[1:] == v_cache.shape[1:] == (P, KH, D) and k_cache.dtype == kvt
        return layouts.paged_attention(q, qo_indptr, kv_indptr, kv_indices, last_page_len,
                                       k_cache, v_cache, scale)


class FakePrefillWrapper(FakePagedWrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, *, causal=False,
             pos_encoding_mode="NONE", sm_scale=None, q_data_type=torch.float16, kv_data_type=None):
        assert causal, "extend attention is causal"
        self._plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                   (num_qo_heads, num_kv_heads, head_dim_qk, page_size), sm_scale, q_data_type,
                   kv_data_type, pos_encoding_mode)


class FakeDecodeWrapper(FakePagedWrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, *, pos_encoding_mode="NONE", sm_scale=None, q_data_type=torch.float16,
             kv_data_type=None):
        if self.use_cuda_graph:  # FlashInfer: fixed batch size; plan copies into the static buffers
            indptr_buf, indices_buf, last_buf = self.buffers
            assert len(indptr) == len(indptr_buf), f"graph wrapper of bs {len(last_buf)} planned for {len(indptr) - 1}"
            assert len(indices) <= len(indices_buf), "page table larger than the static buffer"
            indptr_buf.copy_(indptr)
            indices_buf[: len(indices)].copy_(indices)
            last_buf.copy_(last_page_len)
            indptr, indices, last_page_len = indptr_buf, indices_buf[: len(indices)], last_buf
        qo_indptr = torch.arange(len(indptr), dtype=torch.int32, device=indptr.device)
        self._plan(qo_indptr, indptr, indices, last_page_len,
                   (num_qo_heads, num_kv_heads, head_dim, page_size), sm_scale, q_data_type,
                   kv_data_type, pos_encoding_mode)


class FakeRaggedWrapper:
    """Stand-in for the ragged prefill wrapper: causal attention of each request's new tokens
    over its own new K/V (passed to `run`, never read from the pool)."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD"):
        assert kv_layout == "NHD"
        self.num_plans = 0

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, *, causal=False,
             sm_scale=None, q_data_type=torch.float16, kv_data_type=None):
        assert causal and torch.equal(qo_indptr, kv_indptr), "no prefix: queries and keys coincide"
        assert qo_indptr.dtype == torch.int32
        self.plan_args = (qo_indptr.tolist(), num_qo_heads, num_kv_heads, sm_scale or head_dim_qk**-0.5,
                          q_data_type, kv_data_type or q_data_type)
        self.num_plans += 1

    def run(self, q, k, v):
        indptr, H, KH, scale, qt, kvt = self.plan_args
        assert q.dtype == qt and k.dtype == v.dtype == kvt and k.shape[1] == KH and q.shape[1] == H
        out = torch.empty_like(q)
        for a, b in zip(indptr, indptr[1:]):
            qi, ki, vi = (t[a:b].transpose(0, 1).float() for t in (q, k, v))
            oi = torch.nn.functional.scaled_dot_product_attention(qi[None], ki[None], vi[None], is_causal=True,
                                                                  scale=scale, enable_gqa=H != KH)
            out[a:b] = oi[0].transpose(0, 1).to(q.dtype)
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch):
    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithRaggedKVCacheWrapper = FakeRaggedWrapper
    module.BatchPrefillWithPagedKVCacheWrapper = FakePrefillWrapper
    module.BatchDecodeWithPagedKVCacheWrapper = FakeDecodeWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


def make_case(device, page_size, q_heads, kv_heads, dtype, seed, store_dtype=None, scaling=None,
              no_prefix=False):
    prefix, extend = layouts.random_scenario(page_size, seed)
    if no_prefix:
        prefix = [0] * len(prefix)
    layout = layouts.build_layout(page_size, prefix, extend, seed, num_kv_heads=kv_heads,
                                  head_dim=HEAD_DIM, dtype=dtype, device=device,
                                  store_dtype=store_dtype)
    layer = layouts.FakeLayer(0, q_heads, kv_heads, HEAD_DIM, scaling or HEAD_DIM**-0.5)
    gen = torch.Generator().manual_seed(seed)
    layouts.fill_prefix_kv(layout, gen)
    return layout, layer, gen


def steps(layout, backend):
    """Yield the extend batch, then `DECODE_STEPS` decode batches, allocating as they go."""
    yield layouts.extend_batch(layout, backend)
    seq_lens = layout.seq_lens
    for _ in range(DECODE_STEPS):
        fb = layouts.decode_batch(layout, backend, seq_lens)
        yield fb
        seq_lens = fb.seq_lens_cpu


def flashinfer_backend(layout, layer, dtype, workspace_bytes=128 * 1024 * 1024):
    from kernels.attention.flashinfer_backend import FlashInferAttnBackend

    runner = SimpleNamespace(
        device=layout.req_pool.device, page_size=layout.page_size, dtype=dtype,
        req_to_token_pool=layout.req_pool, token_to_kv_pool=layout.kv_pool,
        model_config=SimpleNamespace(num_attention_heads=layer.tp_q_head_num,
                                     num_key_value_heads=layer.tp_k_head_num, head_dim=HEAD_DIM),
    )
    return FlashInferAttnBackend(runner, workspace_bytes=workspace_bytes)


def assert_close_to_torch_native(page_size, q_heads, kv_heads, dtype, store_dtype=None, scaling=None,
                              atol=None, device="cuda", workspace_bytes=128 * 1024 * 1024, no_prefix=False):
    """Run an extend and a few decodes through both backends; return the FlashInfer backend."""
    seed = random.Random(f"{page_size}-{q_heads}-{kv_heads}-{dtype}").randint(0, 1 << 16)
    layout, layer, gen = make_case(device, page_size, q_heads, kv_heads, dtype, seed,
                                   store_dtype=store_dtype, scaling=scaling, no_prefix=no_prefix)
    oracle = TorchNativeAttnBackend()
    candidate = flashinfer_backend(layout, layer, dtype, workspace_bytes)
    for fb in steps(layout, candidate):
        oracle.init_forward_metadata(fb)
        candidate.init_forward_metadata(fb)
        q, k, v = layouts.random_qkv(len(fb.out_cache_loc), layer, gen, dtype, device)
        want = oracle.forward(q, k, v, layer, fb)
        got = candidate.forward(q, k, v, layer, fb, save_kv_cache=False)
        assert got.shape == want.shape and got.dtype == dtype
        tol = atol or TOLERANCE[dtype]
        torch.testing.assert_close(got, want, atol=tol, rtol=tol,
                                   msg=lambda m, mode=fb.forward_mode.name: f"{mode}: {m}")
    return candidate


# --- CPU: module import and wiring ----------------------------------------------------------


def test_module_imports_without_flashinfer_and_construction_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` now fails
    monkeypatch.delitem(sys.modules, "kernels.attention.flashinfer_backend", raising=False)
    module = importlib.import_module("kernels.attention.flashinfer_backend")
    layout, layer, _ = make_case("cpu", 1, 4, 4, torch.bfloat16, seed=0)
    with pytest.raises(ImportError):
        flashinfer_backend(layout, layer, torch.bfloat16)
    assert issubclass(module.FlashInferAttnBackend, AttentionBackend)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2)])
def test_wiring_matches_torch_native_with_stand_in_flashinfer(fake_flashinfer, page_size,
                                                               q_heads, kv_heads):
    backend = assert_close_to_torch_native(page_size, q_heads, kv_heads, torch.bfloat16, device="cpu",
                                        workspace_bytes=1024)
    assert backend.prefill_wrapper.num_plans == 1, "one plan per extend step"
    assert backend.decode_wrapper.num_plans == DECODE_STEPS, "one plan per decode step"
    assert backend.decode_wrapper.use_tensor_cores == (q_heads // kv_heads >= 4)


def test_custom_layer_scaling_replans_once_then_sticks(fake_flashinfer):
    backend = assert_close_to_torch_native(4, 8, 2, torch.bfloat16, scaling=0.02, device="cpu",
                                        workspace_bytes=1024)
    assert backend.sm_scale == 0.02
    assert backend.prefill_wrapper.num_plans == 2  # default scale, then the layer's
    assert backend.decode_wrapper.num_plans == DECODE_STEPS  # later steps plan 0.02 directly


def test_fp8_kv_is_passed_as_fp8_with_kv_data_type(fake_flashinfer):
    backend = assert_close_to_torch_native(4, 8, 2, torch.bfloat16, store_dtype=torch.float8_e4m3fn,
                                        device="cpu", workspace_bytes=1024, atol=3e-2)
    assert backend.kv_data_type == torch.float8_e4m3fn


@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_without_prefix_takes_the_ragged_kernel(fake_flashinfer, page_size):
    backend = assert_close_to_torch_native(page_size, 8, 2, torch.bfloat16, device="cpu", workspace_bytes=1024,
                                           no_prefix=True)
    assert backend.ragged_wrapper.num_plans == 1 and backend.prefill_wrapper.num_plans == 0
    assert backend.decode_wrapper.num_plans == DECODE_STEPS


def test_extend_with_a_prefix_takes_the_paged_kernel(fake_flashinfer):
    backend = assert_close_to_torch_native(4, 8, 2, torch.bfloat16, device="cpu", workspace_bytes=1024)
    assert backend.prefill_wrapper.num_plans == 1 and backend.ragged_wrapper.num_plans == 0


def test_float32_kv_under_a_half_model_is_refused_naming_the_flags(fake_flashinfer):
    layout, layer, _ = make_case("cpu", 1, 4, 4, torch.bfloat16, seed=0, store_dtype=torch.float32)
    with pytest.raises(ValueError) as err:
        flashinfer_backend(layout, layer, torch.bfloat16)
    message = str(err.value)
    assert "float32 KV cache under a bfloat16 model" in message
    for flag in ("--kv-cache-dtype auto", "fp8_e4m3", "--attention-backend torch_native"):
        assert flag in message, message


def test_float32_model_is_refused_with_the_flags_that_fix_it(fake_flashinfer):
    layout, layer, _ = make_case("cpu", 1, 4, 4, torch.float32, seed=0)
    with pytest.raises(ValueError, match="--dtype bfloat16"):
        flashinfer_backend(layout, layer, torch.float32)


# --- CUDA -----------------------------------------------------------------------------------


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashinfer_matches_torch_native(flashinfer, page_size, q_heads, kv_heads, dtype):
    assert_close_to_torch_native(page_size, q_heads, kv_heads, dtype)


@pytest.mark.gpu
@requires_cuda
def test_flashinfer_reads_fp8_kv_like_torch_native(flashinfer):
    assert_close_to_torch_native(16, 8, 2, torch.bfloat16, store_dtype=torch.float8_e4m3fn, atol=3e-2)


@pytest.mark.gpu
@requires_cuda
def test_flashinfer_replans_for_a_layer_scaling_other_than_head_dim(flashinfer):
    assert_close_to_torch_native(4, 8, 2, torch.bfloat16, scaling=0.02)


@pytest.mark.gpu
@requires_cuda
def test_page_table_built_on_cuda_equals_cpu():
    for page_size in (1, 4, 16):
        metas = []
        for device in ("cpu", "cuda"):
            layout, _, gen = make_case(device, page_size, 4, 2, torch.float32, seed=page_size)
            metas.append([build_forward_metadata(fb, page_size) for fb in steps(layout, None)])
        for cpu, cuda in zip(*metas):
            for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len"):
                assert torch.equal(getattr(cpu, name), getattr(cuda, name).cpu()), name


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_native_on_cuda_matches_cpu(page_size, dtype):
    outs = {}
    for device in ("cpu", "cuda"):
        layout, layer, gen = make_case(device, page_size, 8, 2, dtype, seed=7)
        backend, outs[device] = TorchNativeAttnBackend(), []
        for fb in steps(layout, backend):
            backend.init_forward_metadata(fb)
            q, k, v = layouts.random_qkv(len(fb.out_cache_loc), layer, gen, dtype, device)
            outs[device].append(backend.forward(q, k, v, layer, fb).float().cpu())
    tol = TOLERANCE[dtype]
    for cpu, cuda in zip(outs["cpu"], outs["cuda"]):
        torch.testing.assert_close(cuda, cpu, atol=tol, rtol=tol)
