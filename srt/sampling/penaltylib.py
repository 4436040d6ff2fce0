"""Frequency, presence and repetition penalties over each request's generated tokens.

Scope (as in SGLang): only *output* tokens count, never the prompt. A token id's count is how many
times the request has generated it so far; the counts live in one dense [bs, vocab] tensor that is
built once per request and then updated with one `scatter_add_` per step, and follows the batch
through `filter` / `merge` (row gathers and concatenations on the device, no per-token Python).
Only rows that use a penalty are counted; the others stay zero, so an incrementally kept state
equals a from-scratch build exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from srt.sampling.sampling_params import SamplingParams
from kernels.device_utils import host_to_device


def uses_penalty(p: SamplingParams) -> bool:
    return p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 or p.repetition_penalty != 1.0


def count_output_tokens(
    output_ids: Optional[Sequence[Sequence[int]]], batch_size: int, vocab_size: int, device,
    counted: Optional[Sequence[bool]] = None,
) -> torch.Tensor:
    """Dense [bs, vocab] float32 counts of each request's generated token ids.

    Rows where `counted[i]` is False stay zero (their tokens are not even read). The ragged lists
    become one padded tensor; padding scatters a weight of 0, so no per-token Python loop is needed.
    """
    counts = torch.zeros(batch_size, vocab_size, dtype=torch.float32, device=device)
    if not output_ids:
        return counts
    assert len(output_ids) == batch_size, f"output_ids has {len(output_ids)} rows for {batch_size} requests"
    rows = [ids if counted is None or counted[i] else () for i, ids in enumerate(output_ids)]
    max_len = max((len(ids) for ids in rows), default=0)
    if max_len == 0:
        return counts
    padded = [list(ids) + [0] * (max_len - len(ids)) for ids in rows]
    weight = [[1.0] * len(ids) + [0.0] * (max_len - len(ids)) for ids in rows]
    counts.scatter_add_(1, host_to_device(padded, torch.int64, device), host_to_device(weight, torch.float32, device))
    return counts


@dataclass
class PenaltyState:
    """Per-request penalty coefficients ([bs, 1]) and output-token counts ([bs, vocab]).

    `apply` rewrites logits of seen tokens, in this order:
      1. repetition: a seen token's logit is divided by `r` when positive, multiplied when not;
      2. additive: `logit -= frequency * count + presence * (count > 0)`.
    `count_weights` [bs, 1] is 1.0 on rows that use a penalty, 0.0 elsewhere (what `cumulate` adds).
    The `need_*` flags are derived from the host-side parameters, never read back from the device.
    """

    frequency_penalties: torch.Tensor
    presence_penalties: torch.Tensor
    repetition_penalties: torch.Tensor
    output_counts: torch.Tensor
    count_weights: torch.Tensor
    need_additive: bool
    need_repetition: bool

    @staticmethod
    def is_needed(params: Sequence[SamplingParams]) -> bool:
        return any(uses_penalty(p) for p in params)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        output_ids: Optional[Sequence[Sequence[int]]],
        vocab_size: int,
        device,
    ) -> Optional["PenaltyState"]:
        """The batch's penalty state, or None when no request uses a penalty (the common case)."""
        if not cls.is_needed(params):
            return None
        bs = len(params)
        counted = [uses_penalty(p) for p in params]

        def column(values: List[float]) -> torch.Tensor:
            return host_to_device(values, torch.float32, device).view(bs, 1)

        state = cls(
            frequency_penalties=column([p.frequency_penalty for p in params]),
            presence_penalties=column([p.presence_penalty for p in params]),
            repetition_penalties=column([p.repetition_penalty for p in params]),
            output_counts=count_output_tokens(output_ids, bs, vocab_size, device, counted),
            count_weights=column([1.0 if c else 0.0 for c in counted]),
            need_additive=False,
            need_repetition=False,
        )
        state.refresh_flags(params)
        return state

    @classmethod
    def neutral(cls, batch_size: int, vocab_size: int, device) -> "PenaltyState":
        """Rows that penalise (and count) nothing; used to pad a merge with a penalty-free batch."""
        zeros = torch.zeros(batch_size, 1, dtype=torch.float32, device=device)
        return cls(
            frequency_penalties=zeros,
            presence_penalties=zeros.clone(),
            repetition_penalties=torch.ones_like(zeros),
            output_counts=torch.zeros(batch_size, vocab_size, dtype=torch.float32, device=device),
            count_weights=zeros.clone(),
            need_additive=False,
            need_repetition=False,
        )

    def refresh_flags(self, params: Sequence[SamplingParams]) -> None:
        """Re-derive which penalties run from the rows' host parameters."""
        self.need_additive = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)
        self.need_repetition = any(p.repetition_penalty != 1.0 for p in params)

    def apply(self, logits: torch.Tensor) -> None:
        """Penalise `logits` [bs, vocab] in place."""
        seen = self.output_counts > 0
        if self.need_repetition:
            r = self.repetition_penalties
            penalised = torch.where(logits > 0, logits / r, logits * r)
            logits.copy_(torch.where(seen, penalised, logits))
        if self.need_additive:
            logits -= self.frequency_penalties * self.output_counts
            logits -= self.presence_penalties * seen.to(logits.dtype)

    def cumulate(self, next_token_ids: torch.Tensor) -> None:
        """Count one newly generated token per request ([bs] int64); unpenalised rows add 0."""
        ids = next_token_ids.view(-1, 1).to(torch.int64)
        self.output_counts.scatter_add_(1, ids, self.count_weights)

    def filter(self, keep: torch.Tensor, kept_params: Sequence[SamplingParams]) -> Optional["PenaltyState"]:
        """Rows `keep` ([k] int64 on the state's device), in that order; `kept_params` are their
        parameters. None when none of the kept rows uses a penalty (as a fresh build would give)."""
        if not self.is_needed(kept_params):
            return None
        for name in ("frequency_penalties", "presence_penalties", "repetition_penalties",
                     "output_counts", "count_weights"):
            setattr(self, name, getattr(self, name)[keep])
        self.refresh_flags(kept_params)
        return self

    @classmethod
    def merge(
        cls,
        first: Optional["PenaltyState"],
        first_bs: int,
        second: Optional["PenaltyState"],
        second_bs: int,
        vocab_size: int,
        device,
    ) -> Optional["PenaltyState"]:
        """Rows of `first` then rows of `second`; a missing side is padded with neutral rows."""
        if first is None and second is None:
            return None
        a = first if first is not None else cls.neutral(first_bs, vocab_size, device)
        b = second if second is not None else cls.neutral(second_bs, vocab_size, device)
        return cls(
            frequency_penalties=torch.cat([a.frequency_penalties, b.frequency_penalties]),
            presence_penalties=torch.cat([a.presence_penalties, b.presence_penalties]),
            repetition_penalties=torch.cat([a.repetition_penalties, b.repetition_penalties]),
            output_counts=torch.cat([a.output_counts, b.output_counts]),
            count_weights=torch.cat([a.count_weights, b.count_weights]),
            need_additive=a.need_additive or b.need_additive,
            need_repetition=a.need_repetition or b.need_repetition,
        )
