"""`ForwardMode` and `ForwardBatch`: everything one forward step needs, passed explicitly."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Union

import torch

from kernels.device_utils import host_to_device

if TYPE_CHECKING:
    from kernels.attention.base_attn_backend import AttentionBackend
    from mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # new tokens of each request after its cached prefix (prefill)
    DECODE = 2  # exactly one new token per request

    def is_extend(self) -> bool:
        return self == ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


@dataclass
class ForwardBatch:
    """One step's inputs. Tokens of all requests are concatenated in request order.

    `seq_lens[i]` counts every position of request i after this step (prefix + new);
    `out_cache_loc` holds the KV slots of this step's new tokens, already written into
    `req_to_token` at their positions.
    """

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: List[int]
    req_pool_indices_cpu: List[int]
    req_to_token_pool: "ReqToTokenPool"
    token_to_kv_pool: "MHATokenToKVPool"
    attn_backend: "AttentionBackend"
    extend_prefix_lens_cpu: List[int] = field(default_factory=list)
    extend_seq_lens_cpu: List[int] = field(default_factory=list)
    # Per request, the first extend position (0-based within the new tokens) whose logits are
    # wanted for input logprobs; None = only the last position of each request.
    extend_logprob_start_lens_cpu: Optional[List[int]] = None
    sampling_info: Any = None

    @classmethod
    def create_extend(
        cls,
        runner,
        input_ids: Sequence[Sequence[int]],
        prefix_lens: Sequence[int],
        req_pool_indices: Sequence[int],
        out_cache_loc: torch.Tensor,
        extend_logprob_start_lens: Optional[Sequence[int]] = None,
    ) -> "ForwardBatch":
        """Extend step for requests whose new tokens are `input_ids[i]` after `prefix_lens[i]`."""
        device = runner.device
        ext = [len(x) for x in input_ids]
        seq = [p + e for p, e in zip(prefix_lens, ext)]
        flat = [t for ids in input_ids for t in ids]
        positions = [j for p, s in zip(prefix_lens, seq) for j in range(p, s)]
        rows = [int(r) for r in req_pool_indices]
        return cls(
            forward_mode=ForwardMode.EXTEND,
            batch_size=len(input_ids),
            input_ids=host_to_device(flat, torch.int64, device),
            positions=host_to_device(positions, torch.int64, device),
            out_cache_loc=out_cache_loc.to(device),
            req_pool_indices=host_to_device(rows, torch.int64, device),
            seq_lens=host_to_device(seq, torch.int64, device),
            seq_lens_cpu=seq,
            req_pool_indices_cpu=rows,
            req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool=runner.token_to_kv_pool,
            attn_backend=runner.attn_backend,
            extend_prefix_lens_cpu=list(prefix_lens),
            extend_seq_lens_cpu=ext,
            extend_logprob_start_lens_cpu=None if extend_logprob_start_lens is None else list(extend_logprob_start_lens),
        )

    @classmethod
    def create_decode(
        cls,
        runner,
        input_ids: Union[torch.Tensor, Sequence[int]],
        seq_lens: Sequence[int],
        req_pool_indices: Sequence[int],
        out_cache_loc: torch.Tensor,
    ) -> "ForwardBatch":
        """Decode step: `input_ids[i]` sits at position `seq_lens[i] - 1` (seq_lens include it).
        Lengths and rows are host lists (the scheduler knows them), so nothing is read back."""
        device = runner.device
        seq = [int(s) for s in seq_lens]
        rows = [int(r) for r in req_pool_indices]
        seq_t = host_to_device(seq, torch.int64, device)
        if isinstance(input_ids, torch.Tensor):
            ids = input_ids.to(device=device, dtype=torch.int64)
        else:
            ids = host_to_device(list(input_ids), torch.int64, device)
        return cls(
            forward_mode=ForwardMode.DECODE,
            batch_size=len(seq),
            input_ids=ids,
            positions=seq_t - 1,
            out_cache_loc=out_cache_loc.to(device),
            req_pool_indices=host_to_device(rows, torch.int64, device),
            seq_lens=seq_t,
            seq_lens_cpu=seq,
            req_pool_indices_cpu=rows,
            req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool=runner.token_to_kv_pool,
            attn_backend=runner.attn_backend,
        )
