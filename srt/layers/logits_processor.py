"""Logits only where they are needed: each request's last position, plus the positions whose
input logprobs were asked for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional

import torch
from torch import nn

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

    def forward(self, hidden_states: torch.Tensor, lm_head: nn.Module, fb: "ForwardBatch") -> LogitsProcessorOutput:
        weight = lm_head.weight
        if fb.forward_mode.is_decode():
            return LogitsProcessorOutput((hidden_states @ weight.T).float())
        ext = fb.extend_seq_lens_cpu
        ends = torch.tensor(ext, device=hidden_states.device).cumsum(0)
        last = (hidden_states[ends - 1] @ weight.T).float()
        starts = fb.extend_logprob_start_lens_cpu
        if starts is None:
            return LogitsProcessorOutput(last)
        rows, lens, offset = [], [], 0
        for n, s in zip(ext, starts):
            s = min(max(s, 0), n)
            rows.append(torch.arange(offset + s, offset + n, device=hidden_states.device))
            lens.append(n - s)
            offset += n
        idx = torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64)
        full = (hidden_states[idx] @ weight.T).float()
        return LogitsProcessorOutput(last, full, lens)
