"""The attention backend contract shared by the torch and FlashInfer implementations."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # higher layers, for hints only
    from srt.layers.radix_attention import RadixAttention
    from srt.model_executor.forward_batch_info import ForwardBatch


class AttentionBackend(ABC):
    """Paged attention over the KV pool of one model runner.

    Contract:
    - `init_forward_metadata(fb)` is called once per forward step, before any layer runs;
      it may read `fb.req_to_token_pool.req_to_token[fb.req_pool_indices, :fb.seq_lens]`,
      which must already hold the KV slots of every position of this step (prefix + new).
    - `forward(q, k, v, layer, fb)` writes this step's K/V at `fb.out_cache_loc`, then
      attends each query to its request's keys at positions `0 .. its own position`.
      q is `[num_tokens, num_heads * head_dim]`; k, v are `[num_tokens, num_kv_heads, head_dim]`.
      Returns `[num_tokens, num_heads * head_dim]`.
    - KV slot indices read from `req_to_token` are valid only for the current step.
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: "RadixAttention",
        fb: "ForwardBatch",
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        if save_kv_cache:
            fb.token_to_kv_pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        if fb.forward_mode.is_decode():
            return self.forward_decode(q, layer, fb)
        return self.forward_extend(q, layer, fb)

    @abstractmethod
    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        """Build per-step metadata (index maps, masks, planned kernels) for `fb`."""

    @abstractmethod
    def forward_extend(self, q: torch.Tensor, layer: "RadixAttention", fb: "ForwardBatch") -> torch.Tensor:
        """Causal attention of the new tokens over cached prefix + new tokens."""

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, layer: "RadixAttention", fb: "ForwardBatch") -> torch.Tensor:
        """One query per request over all of that request's keys."""

    # ------------------------------------------------------------------ CUDA graphs
    # Decode under `CudaGraphRunner`: metadata lives in static buffers sized once for the largest
    # captured batch; capture points the kernels at them, replay refills them in place.
    def init_cuda_graph_state(self, max_bs: int, max_kv_len: int) -> None:
        """Allocate the static metadata buffers for batches of up to `max_bs` requests."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_capture_cuda_graph(self, bs: int, fb: "ForwardBatch") -> None:
        """Point this backend at its static buffers for a captured batch of `bs` (the padded
        static `fb`: every row has seq_len 1 and writes the dummy slot 0)."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_replay_cuda_graph(self, bs: int, fb: "ForwardBatch") -> None:
        """Refill the static buffers in place for the padded batch `fb` before a replay."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")
