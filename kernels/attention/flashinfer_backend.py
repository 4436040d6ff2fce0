"""FlashInfer paged attention on CUDA; `flashinfer` is imported lazily so this module loads anywhere.

The KV pool is handed to FlashInfer as it is stored: each layer's `[T + P, kv_heads, D]` buffer
viewed as NHD pages `[num_pages, P, kv_heads, D]` (page 0 is the pool's dummy page).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Optional

import torch

from kernels.attention.base_attn_backend import AttentionBackend
from kernels.attention.flashinfer_metadata import FlashInferMetadata, build_forward_metadata

if TYPE_CHECKING:
    from srt.layers.radix_attention import RadixAttention
    from srt.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger(__name__)

WORKSPACE_BYTES = 128 * 1024 * 1024
# Decode with tensor cores (the prefill kernel) pays off once a KV head serves this many q heads.
TENSOR_CORE_GQA_GROUP = 4


class FlashInferAttnBackend(AttentionBackend):
    """Plans one FlashInfer wrapper per step and runs it for every layer.

    `init_forward_metadata` builds the page table (`flashinfer_metadata`) and calls `plan` once;
    every layer then only calls `run`. The softmax scale is part of the plan in FlashInfer: a step
    is planned with the scale the layers used last (at first `head_dim ** -0.5`), and re-planned
    only when a layer's `scaling` differs, so a model with a custom scale re-plans once in total.

    fp8 KV storage is passed to FlashInfer as fp8 with `kv_data_type` set (the kernel upcasts on
    load, as in SGLang); our pool stores unscaled values, so no k/v scale is needed. Upcasting a
    whole layer's buffer per call instead would cost a pool-sized copy.
    """

    def __init__(self, model_runner, workspace_bytes: int = WORKSPACE_BYTES):
        import flashinfer  # lazy: only CUDA deployments install it

        cfg = model_runner.model_config
        pool = model_runner.token_to_kv_pool
        self.device = torch.device(model_runner.device)
        self.page_size = int(model_runner.page_size)
        self.num_qo_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(cfg.head_dim)
        self.q_data_type = model_runner.dtype
        self.kv_data_type = getattr(pool, "store_dtype", model_runner.dtype)
        self.sm_scale = 1.0 / math.sqrt(self.head_dim)
        if self.q_data_type not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"--attention-backend flashinfer needs a float16 or bfloat16 model, got "
                f"{self.q_data_type}. Use --dtype bfloat16, or --attention-backend torch_native."
            )
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_qo_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        group = self.num_qo_heads // self.num_kv_heads

        # One float workspace serves both wrappers: a step runs either prefill or decode.
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=group >= TENSOR_CORE_GQA_GROUP
        )
        self.metadata: Optional[FlashInferMetadata] = None
        self.is_decode = False
        logger.info(
            "FlashInfer attention: %d q heads, %d kv heads, head_dim %d, page_size %d, kv %s%s",
            self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size,
            self.kv_data_type, ", decode on tensor cores" if group >= TENSOR_CORE_GQA_GROUP else "",
        )

    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        self.metadata = build_forward_metadata(fb, self.page_size)
        self.is_decode = fb.forward_mode.is_decode()
        self._plan()

    def _plan(self) -> None:
        """Plan this step's kernel (host-side work split over the page table) at `sm_scale`."""
        m = self.metadata
        assert m is not None, "init_forward_metadata must run before attention"
        dims = (self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size)
        types = dict(q_data_type=self.q_data_type, kv_data_type=self.kv_data_type,
                     sm_scale=self.sm_scale)
        if self.is_decode:
            self.decode_wrapper.plan(
                m.kv_indptr, m.kv_indices, m.kv_last_page_len, *dims,
                pos_encoding_mode="NONE", **types,
            )
        else:
            self.prefill_wrapper.plan(
                m.qo_indptr, m.kv_indptr, m.kv_indices, m.kv_last_page_len, *dims,
                causal=True, pos_encoding_mode="NONE", **types,
            )

    def _prepare(self, q: torch.Tensor, layer: "RadixAttention", fb: "ForwardBatch"):
        """Check the layer against the plan; return q as `[n, H, D]` and the paged (K, V) views."""
        assert (layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim) == (
            self.num_qo_heads, self.num_kv_heads, self.head_dim
        ), "layer heads differ from the model config the backend was planned with"
        if not math.isclose(layer.scaling, self.sm_scale, rel_tol=1e-6):
            self.sm_scale = float(layer.scaling)
            self._plan()
        pool = fb.token_to_kv_pool
        shape = (-1, self.page_size, self.num_kv_heads, self.head_dim)
        k_cache = pool.get_key_buffer(layer.layer_id).view(shape)
        v_cache = pool.get_value_buffer(layer.layer_id).view(shape)
        q = q.contiguous().view(-1, self.num_qo_heads, self.head_dim)
        return q, (k_cache, v_cache)

    def forward_extend(self, q: torch.Tensor, layer: "RadixAttention", fb: "ForwardBatch"):
        q, kv = self._prepare(q, layer, fb)
        o = self.prefill_wrapper.run(q, kv)
        return o.view(-1, self.num_qo_heads * self.head_dim)

    def forward_decode(self, q: torch.Tensor, layer: "RadixAttention", fb: "ForwardBatch"):
        q, kv = self._prepare(q, layer, fb)
        o = self.decode_wrapper.run(q, kv)
        return o.view(-1, self.num_qo_heads * self.head_dim)
