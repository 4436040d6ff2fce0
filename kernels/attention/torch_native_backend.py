"""Pure-torch paged attention: the CPU path and the oracle for FlashInfer."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

from kernels.attention.base_attn_backend import AttentionBackend
from kernels.cpu.paged_attention import paged_decode_op, paged_extend_op

if TYPE_CHECKING:
    from srt.layers.radix_attention import RadixAttention
    from srt.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger(__name__)

# CPU extend through SDPA: each request's queries and keys are padded at the end to a multiple of
# this. The flash kernel builds (JITs) its tile kernels for every new length, and prompt lengths are
# new all the time: on the Xeon with AMX a 64-1024-token causal SDPA took 2.2 ms at an unseen length
# against 1.2 ms at a seen one (bf16). Causality keeps the padded keys away from the real queries.
SDPA_LEN_MULTIPLE = 32


def disable_cudnn_sdpa() -> None:
    """Keep SDPA on CUDA off its cuDNN kernels, for this process. cuDNN builds an execution plan
    for every new sequence length, and serving sees a new one at every decode step and nearly
    every prefill: on an H200 (torch 2.11) an eager decode step of a 1B Llama took 62-65 ms at
    batch 1 to 64, all of it host time (the captured graph of the same step: 2.8 ms). Flash and
    memory-efficient attention need no plan."""
    if torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        logger.info("torch_native attention on CUDA: SDPA's cuDNN backend disabled (it re-plans for "
                    "every new sequence length).")


class TorchNativeAttnBackend(AttentionBackend):
    """SDPA over each request's K/V gathered through `req_to_token`, or the CPU's in-place ops.

    On the CPU, extend and decode read the pool in place with the C++ ops of `kernels/cpu` when
    they serve the pool's dtypes and build here. Otherwise (CUDA, fp8 KV, no compiler) extend runs
    per request (a causal mask aligned to the cached prefix) and decode as one padded batch whose
    gather indices and key mask are built once per step (also under the CUDA-graph hooks).
    """

    def __init__(self, device: "torch.device | str" = "cpu", q_dtype: Optional[torch.dtype] = None,
                 kv_dtype: Optional[torch.dtype] = None, extend_op: bool = True):
        """`q_dtype` and `kv_dtype` (the model's and the KV storage's) let extend and decode use
        the C++ ops; without them both keep the torch path (the oracle that tests compare against).
        `extend_op=False` keeps extend on the torch path (SDPA) while decode uses the op."""
        self._graph_device = device
        if torch.device(device).type == "cuda":
            disable_cudnn_sdpa()
        self.paged_decode = None if kv_dtype is None else paged_decode_op(device, q_dtype or kv_dtype, kv_dtype)
        self.paged_extend = (None if kv_dtype is None or not extend_op
                             else paged_extend_op(device, q_dtype or kv_dtype, kv_dtype))
        self.extend_lens: Optional[tuple] = None  # this step's (prefix_lens, extend_lens) for the C++ op
        self.use_paged_decode = False  # this step's decode: the C++ op (False under the graph hooks)
        self.decode_indices: Optional[torch.Tensor] = None
        self.decode_mask: Optional[torch.Tensor] = None
        self.extend_rows: list = []
        self.graph_indices: Optional[torch.Tensor] = None  # static [max_bs, max_kv_len] (CUDA graphs)
        self.graph_mask: Optional[torch.Tensor] = None

    # CUDA graphs: shapes must not depend on the batch's lengths, so a captured decode gathers
    # every column of `req_to_token` (`max_kv_len`) and masks the columns past each seq_len.
    def init_cuda_graph_state(self, max_bs: int, max_kv_len: int) -> None:
        device = self._graph_device
        self.graph_indices = torch.zeros((max_bs, max_kv_len), dtype=torch.int64, device=device)
        self.graph_mask = torch.zeros((max_bs, 1, 1, max_kv_len), dtype=torch.bool, device=device)
        self.graph_columns = torch.arange(max_kv_len, dtype=torch.int64, device=device)

    def init_forward_metadata_capture_cuda_graph(self, bs: int, fb: "ForwardBatch") -> None:
        self.graph_indices[:bs].zero_()
        self.graph_mask[:bs].zero_()
        self.graph_mask[:bs, ..., 0] = True  # the capture run reads the dummy slot only
        self.use_paged_decode = False
        self.decode_indices, self.decode_mask = self.graph_indices[:bs], self.graph_mask[:bs]

    def init_forward_metadata_replay_cuda_graph(self, bs: int, fb: "ForwardBatch") -> None:
        width = self.graph_indices.shape[1]
        idx = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, :width].to(torch.int64)
        valid = self.graph_columns[None, :] < fb.seq_lens[:, None]
        self.graph_indices[:bs].copy_(torch.where(valid, idx, 0))
        self.graph_mask[:bs].copy_(valid[:, None, None, :])
        self.use_paged_decode = False
        self.decode_indices, self.decode_mask = self.graph_indices[:bs], self.graph_mask[:bs]

    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        req_to_token = fb.req_to_token_pool.req_to_token
        seq_lens = fb.seq_lens_cpu
        if fb.forward_mode.is_decode():
            self.use_paged_decode = self.paged_decode is not None
            if self.use_paged_decode:
                return  # the op reads req_to_token through fb.req_pool_indices and fb.seq_lens
            max_len = int(max(seq_lens))
            idx = req_to_token[fb.req_pool_indices, :max_len].to(torch.int64)
            if min(seq_lens) == max_len:
                self.decode_mask = None
            else:
                valid = torch.arange(max_len, device=idx.device)[None, :] < fb.seq_lens[:, None]
                idx = torch.where(valid, idx, 0)  # stale columns may point at unwritten slots
                self.decode_mask = valid[:, None, None, :]
            self.decode_indices = idx
            return
        if self.paged_extend is not None:
            # Host int64 tensors (the op is CPU-only), built once per step: the op reads
            # req_to_token through them.
            self.extend_lens = (torch.tensor(fb.extend_prefix_lens_cpu, dtype=torch.int64, device="cpu"),
                                torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int64, device="cpu"))
            return
        rows = []
        rows_idx = fb.req_pool_indices_cpu
        multiple = SDPA_LEN_MULTIPLE if req_to_token.device.type == "cpu" else 1
        for row, prefix, ext in zip(rows_idx, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu):
            seq = prefix + ext
            pad = -ext % multiple
            slots = req_to_token[row, :seq].to(torch.int64)
            if pad:  # the padded keys read the pool's zeroed dummy slot 0
                slots = torch.cat([slots, slots.new_zeros(pad)])
            mask = None
            if prefix > 0:  # over the padded length: key j <= query i, so no real query sees a padded key
                key_pos = torch.arange(seq + pad, device=slots.device)
                q_pos = torch.arange(prefix, seq + pad, device=slots.device)
                mask = key_pos[None, :] <= q_pos[:, None]
            rows.append((slots, mask, ext, pad))
        self.extend_rows = rows

    def forward_extend(self, q: torch.Tensor, layer: "RadixAttention", fb: "ForwardBatch") -> torch.Tensor:
        pool = fb.token_to_kv_pool
        k_buf = pool.get_key_buffer(layer.layer_id)
        v_buf = pool.get_value_buffer(layer.layer_id)
        H, D = layer.tp_q_head_num, layer.head_dim
        q = q.reshape(-1, H, D)
        if self.paged_extend is not None:
            prefix_lens, extend_lens = self.extend_lens
            o = self.paged_extend(q, k_buf, v_buf, fb.req_to_token_pool.req_to_token, fb.req_pool_indices,
                                  prefix_lens, extend_lens, layer.scaling)
            return o.view(-1, H * D)
        out = torch.empty_like(q)
        start = 0
        for slots, mask, ext, pad in self.extend_rows:
            # 4-D inputs: CPU SDPA takes its flash kernel only for [batch, heads, len, dim]
            # (3-D falls back to the math path, 2-3x slower at 256-512 tokens). Queries padded
            # with zero rows at the end (SDPA_LEN_MULTIPLE), keys with the dummy slot's.
            qi = q[start : start + ext]
            if pad:
                qi = F.pad(qi, (0, 0, 0, 0, 0, pad))
            qi = qi.transpose(0, 1)[None]
            ki = k_buf.index_select(0, slots).to(q.dtype).transpose(0, 1)[None]
            vi = v_buf.index_select(0, slots).to(q.dtype).transpose(0, 1)[None]
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, is_causal=mask is None,
                scale=layer.scaling, enable_gqa=H != ki.shape[1],
            )
            out[start : start + ext] = oi[0, :, :ext].transpose(0, 1)
            start += ext
        return out.view(-1, H * D)

    def forward_decode(self, q: torch.Tensor, layer: "RadixAttention", fb: "ForwardBatch") -> torch.Tensor:
        pool = fb.token_to_kv_pool
        if self.use_paged_decode:
            H, D = layer.tp_q_head_num, layer.head_dim
            o = self.paged_decode(
                q.reshape(-1, H, D), pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id),
                fb.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens, layer.scaling,
            )
            return o.view(-1, H * D)
        idx = self.decode_indices
        H, D = layer.tp_q_head_num, layer.head_dim
        bs = idx.shape[0]
        flat = idx.view(-1)  # index_select on a flat index: multi-dim advanced indexing is ~100x slower on CPU
        shape = (bs, idx.shape[1], layer.tp_k_head_num, D)
        k = pool.get_key_buffer(layer.layer_id).index_select(0, flat).view(shape).to(q.dtype).transpose(1, 2)
        v = pool.get_value_buffer(layer.layer_id).index_select(0, flat).view(shape).to(q.dtype).transpose(1, 2)
        # One query row per head of a KV group: query head h reads KV head h // group (as
        # enable_gqa would), with no K/V expansion. Masked GQA has no fused SDPA kernel on CUDA
        # once cuDNN is off: enable_gqa with a mask fell back to the math path, which took a
        # captured batch-64 decode step of a 1B Llama from 10 to 136 ms on an H200.
        qd = q.reshape(bs, layer.tp_k_head_num, H // layer.tp_k_head_num, D)
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=self.decode_mask, scale=layer.scaling)
        return o.reshape(bs, H * D)
