"""Logits only where they are needed: each request's last position, plus the positions whose
input logprobs were asked for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional

import itertools

import torch
from torch import nn

from kernels.device_utils import host_to_device
from srt.distributed.parallel_state import tensor_model_parallel_all_gather
from srt.layers.cpu_weight_packing import packed_linear

if TYPE_CHECKING:
    from srt.model_executor.forward_batch_info import ForwardBatch


@dataclass
class LogitsProcessorOutput:
    # [batch_size, vocab]: logits that predict each request's next token (fp32).
    next_token_logits: torch.Tensor
    # [sum of requested input positions, vocab] or None; row order: request by request.
    input_token_logits: Optional[torch.Tensor] = None
    # Per request: how many rows of input_token_logits belong to it.
    input_token_logits_lens: Optional[List[int]] = None


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def _logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """fp32 logits over the whole vocabulary: this rank's slice, gathered over the TP ranks
        (rank order = vocabulary order) and cut to the real vocabulary (no padding rows)."""
        packed = getattr(lm_head, "packed_weight", None)
        if packed is not None:  # packed on CPU (srt/layers/cpu_weight_packing.py)
            local = packed_linear(hidden, packed, out_dtype=torch.float32, out_features=lm_head.packed_out_features)
        else:
            local = hidden @ lm_head.weight.T
        logits = tensor_model_parallel_all_gather(local.float(), dim=-1)
        return logits[:, : self.vocab_size] if logits.shape[-1] != self.vocab_size else logits

    def forward(self, hidden_states: torch.Tensor, lm_head: nn.Module, fb: "ForwardBatch") -> LogitsProcessorOutput:
        if fb.forward_mode.is_decode():
            return LogitsProcessorOutput(self._logits(hidden_states, lm_head))
        ext = fb.extend_seq_lens_cpu
        device = hidden_states.device
        ends = list(itertools.accumulate(ext))
        last = self._logits(hidden_states[host_to_device([e - 1 for e in ends], torch.int64, device)], lm_head)
        starts = fb.extend_logprob_start_lens_cpu
        if starts is None:
            return LogitsProcessorOutput(last)
        idx, lens, offset = [], [], 0
        for n, s in zip(ext, starts):
            s = min(max(s, 0), n)
            idx.extend(range(offset + s, offset + n))
            lens.append(n - s)
            offset += n
        full = self._logits(hidden_states[host_to_device(idx, torch.int64, device)], lm_head)
        return LogitsProcessorOutput(last, full, lens)
