"""FlashInfer paged attention on CUDA; `flashinfer` is imported lazily so this module loads anywhere.

The KV pool is handed to FlashInfer as it is stored: each layer's `[T + P, kv_heads, D]` buffer
viewed as NHD pages `[num_pages, P, kv_heads, D]` (page 0 is the pool's dummy page).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Dict, Optional

import torch

from kernels.attention.base_attn_backend import AttentionBackend
from kernels.attention.flashinfer_metadata import FlashInferMetadata, build_forward_metadata

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

if TYPE_CHECKING:
    from srt.layers.radix_attention import RadixAttention
    from srt.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger(__name__)

WORKSPACE_BYTES = 128 * 1024 * 1024
# Decode with tensor cores (the prefill kernel) pays off once a KV head serves this many q heads.
TENSOR_CORE_GQA_GROUP = 4


class FlashInferAttnBackend(AttentionBackend):
    """Plans one FlashInfer wrapper per step and runs it for every layer.

    `init_forward_metadata` builds the page table on the device (`flashinfer_metadata`) and calls
    `plan` once; every layer then only calls `run`. An extend step in which no request has a
    cached prefix runs the ragged prefill kernel on this step's own K/V (no page-table reads);
    otherwise the paged prefill kernel reads prefix and new tokens from the pool. The softmax
    scale is part of the plan in FlashInfer: a step is planned with the scale the layers used
    last (at first `head_dim ** -0.5`), and re-planned only when a layer's `scaling` differs.

    KV storage: the model dtype (bf16/fp16), or fp8 passed to FlashInfer as fp8 with
    `kv_data_type` set (the kernel upcasts on load, as in SGLang). Our pool stores unscaled values,
    so k/v scales stay 1 and nothing is rescaled. fp32 storage under a half model is refused
    (FlashInfer's kernels take KV in the query dtype or fp8).

    CUDA graphs: one decode wrapper per captured batch size, built with `use_cuda_graph=True`
    over slices of static index buffers that `plan` refills before each replay.
    """

    def __init__(self, model_runner, workspace_bytes: int = WORKSPACE_BYTES):
        import flashinfer  # lazy: only CUDA deployments install it

        self._flashinfer = flashinfer
        cfg = model_runner.model_config
        pool = model_runner.token_to_kv_pool
        self.device = torch.device(model_runner.device)
        self.page_size = int(model_runner.page_size)
        self.num_qo_heads = int(getattr(model_runner, "num_qo_heads_per_rank", cfg.num_attention_heads))
        self.num_kv_heads = int(getattr(model_runner, "num_kv_heads_per_rank", cfg.num_key_value_heads))
        self.head_dim = int(cfg.head_dim)
        self.q_data_type = model_runner.dtype
        self.kv_data_type = getattr(pool, "store_dtype", model_runner.dtype)
        self.sm_scale = 1.0 / math.sqrt(self.head_dim)
        if self.q_data_type not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"--attention-backend flashinfer needs a float16 or bfloat16 model, got "
                f"{self.q_data_type}. Use --dtype bfloat16, or --attention-backend torch_native."
            )
        if self.kv_data_type not in (self.q_data_type, *FP8_DTYPES):
            raise ValueError(
                f"--attention-backend flashinfer cannot read a {_name(self.kv_data_type)} KV cache under a "
                f"{_name(self.q_data_type)} model: its kernels take KV in the model dtype or fp8. Use "
                f"--kv-cache-dtype auto (the model dtype) or fp8_e4m3, or --attention-backend torch_native."
            )
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_qo_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        self.use_tensor_cores = self.num_qo_heads // self.num_kv_heads >= TENSOR_CORE_GQA_GROUP

        # One float workspace serves every wrapper: a step runs exactly one of them.
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.ragged_wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD")
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores
        )
        self.active_decode_wrapper = self.decode_wrapper
        self.graph_decode_wrappers: Dict[int, object] = {}
        self.metadata: Optional[FlashInferMetadata] = None
        self.mode = "decode"  # "decode", "paged" (extend over the pool) or "ragged" (no prefix)
        logger.info(
            "FlashInfer attention: %d q heads, %d kv heads, head_dim %d, page_size %d, kv %s%s",
            self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size,
            self.kv_data_type, ", decode on tensor cores" if self.use_tensor_cores else "",
        )

    @property
    def is_decode(self) -> bool:
        return self.mode == "decode"

    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        self.metadata = build_forward_metadata(fb, self.page_size)
        if fb.forward_mode.is_decode():
            self.mode = "decode"
            self.active_decode_wrapper = self.decode_wrapper
        else:
            self.mode = "ragged" if not any(fb.extend_prefix_lens_cpu) else "paged"
        self._plan()

    def _plan(self) -> None:
        """Plan this step's kernel (host-side work split over the page table) at `sm_scale`."""
        m = self.metadata
        assert m is not None, "init_forward_metadata must run before attention"
        heads = (self.num_qo_heads, self.num_kv_heads, self.head_dim)
        types = dict(q_data_type=self.q_data_type, kv_data_type=self.kv_data_type, sm_scale=self.sm_scale)
        if self.mode == "decode":
            self.active_decode_wrapper.plan(
                m.kv_indptr, m.kv_indices, m.kv_last_page_len, *heads, self.page_size,
                pos_encoding_mode="NONE", **types,
            )
        elif self.mode == "ragged":  # this step's K/V are fresh activations in the model dtype
            self.ragged_wrapper.plan(
                m.qo_indptr, m.qo_indptr, *heads, causal=True, q_data_type=self.q_data_type,
                kv_data_type=self.q_data_type, sm_scale=self.sm_scale,
            )
        else:
            self.prefill_wrapper.plan(
                m.qo_indptr, m.kv_indptr, m.kv_indices, m.kv_last_page_len, *heads, self.page_size,
                causal=True, pos_encoding_mode="NONE", **types,
            )

    def _check_layer(self, layer: "RadixAttention") -> None:
        assert (layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim) == (
            self.num_qo_heads, self.num_kv_heads, self.head_dim
        ), "layer heads differ from the model config the backend was planned with"
        if not math.isclose(layer.scaling, self.sm_scale, rel_tol=1e-6):
            self.sm_scale = float(layer.scaling)
            self._plan()

    def _paged_kv(self, layer: "RadixAttention", fb: "ForwardBatch"):
        pool = fb.token_to_kv_pool
        shape = (-1, self.page_size, self.num_kv_heads, self.head_dim)
        return pool.get_key_buffer(layer.layer_id).view(shape), pool.get_value_buffer(layer.layer_id).view(shape)

    def forward(self, q, k, v, layer: "RadixAttention", fb: "ForwardBatch", save_kv_cache: bool = True):
        if save_kv_cache:
            fb.token_to_kv_pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        self._check_layer(layer)
        q = q.contiguous().view(-1, self.num_qo_heads, self.head_dim)
        if self.mode == "ragged":
            o = self.ragged_wrapper.run(q, k.contiguous().to(q.dtype), v.contiguous().to(q.dtype))
        elif self.mode == "decode":
            o = self.active_decode_wrapper.run(q, self._paged_kv(layer, fb))
        else:
            o = self.prefill_wrapper.run(q, self._paged_kv(layer, fb))
        return o.view(-1, self.num_qo_heads * self.head_dim)

    def forward_extend(self, q: torch.Tensor, layer: "RadixAttention", fb: "ForwardBatch"):
        raise AssertionError("FlashInferAttnBackend.forward dispatches itself")

    def forward_decode(self, q: torch.Tensor, layer: "RadixAttention", fb: "ForwardBatch"):
        raise AssertionError("FlashInferAttnBackend.forward dispatches itself")

    # ------------------------------------------------------------------ CUDA graphs
    def init_cuda_graph_state(self, max_bs: int, max_kv_len: int) -> None:
        max_pages = max_bs * -(-max_kv_len // self.page_size)
        self.graph_kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        self.graph_kv_indices = torch.zeros(max_pages, dtype=torch.int32, device=self.device)
        self.graph_kv_last_page_len = torch.ones(max_bs, dtype=torch.int32, device=self.device)

    def init_forward_metadata_capture_cuda_graph(self, bs: int, fb: "ForwardBatch") -> None:
        wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
            paged_kv_indptr_buffer=self.graph_kv_indptr[: bs + 1],
            paged_kv_indices_buffer=self.graph_kv_indices,
            paged_kv_last_page_len_buffer=self.graph_kv_last_page_len[:bs],
        )
        self.graph_decode_wrappers[bs] = wrapper
        self._use_graph_wrapper(bs, fb)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, fb: "ForwardBatch") -> None:
        self._use_graph_wrapper(bs, fb)

    def _use_graph_wrapper(self, bs: int, fb: "ForwardBatch") -> None:
        """Plan the graph's own wrapper: `plan` copies the page table into its static buffers."""
        self.metadata = build_forward_metadata(fb, self.page_size)
        self.mode = "decode"
        self.active_decode_wrapper = self.graph_decode_wrappers[bs]
        self._plan()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
