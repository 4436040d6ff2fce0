"""Which sampler path each row of a batch takes, decided on the host once per batch composition.

A row's path depends only on its own parameters, never on its neighbours, so a seeded request
draws the same token whatever shares its batch:
  * greedy (temperature ~ 0 or top_k == 1): argmax of the logits;
  * truncated (top-k and/or top-p, perhaps min-p): inverse CDF over its best candidates, most
    likely first;
  * plain (temperature, perhaps min-p): inverse CDF over the whole vocabulary in token-id order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from srt.sampling.sampling_params import SamplingParams
from kernels.device_utils import host_to_device


def clamp_top_k(top_k: int, vocab_size: int) -> int:
    """top_k in [1, vocab]: -1 (disabled) and values past the vocabulary mean all of it."""
    return vocab_size if (top_k < 0 or top_k > vocab_size) else top_k


def is_truncated(p: SamplingParams, vocab_size: int) -> bool:
    """A sampled row whose candidates are cut by top-k or top-p (min-p alone cuts in place)."""
    return not p.is_greedy and (clamp_top_k(p.top_k, vocab_size) < vocab_size or p.top_p < 1.0)


@dataclass
class SamplingGroup:
    """Rows that take one sampler path, with their parameters gathered once (not every step)."""

    rows: Optional[torch.Tensor]  # [n] int64 batch rows, ascending; None = the whole batch
    temperatures: torch.Tensor  # [n, 1] float32
    top_ks: torch.Tensor  # [n] int64, in [1, candidates]
    top_ps: torch.Tensor  # [n] float32
    min_ps: torch.Tensor  # [n] float32
    # K: how many candidates each row keeps before top-p / min-p: the group's largest top_k,
    # or the whole vocabulary when a row has no top-k.
    candidates: int
    need_top_p: bool
    need_min_p: bool


@dataclass
class SamplingGroups:
    """The batch split by path; `truncated` / `plain` are None when no row takes that path."""

    any_greedy: bool
    truncated: Optional[SamplingGroup] = None
    plain: Optional[SamplingGroup] = None


def split_rows(info, params: Sequence[SamplingParams]) -> SamplingGroups:
    """Group the rows of `info` (a `SamplingBatchInfo` whose row i has `params[i]`)."""
    vocab = info.vocab_size
    greedy = [p.is_greedy for p in params]
    truncated = [i for i, p in enumerate(params) if is_truncated(p, vocab)]
    chosen = set(truncated)
    plain = [i for i, g in enumerate(greedy) if not g and i not in chosen]
    return SamplingGroups(
        any_greedy=any(greedy),
        truncated=_group(info, params, truncated, max(
            (clamp_top_k(params[i].top_k, vocab) for i in truncated), default=vocab)),
        plain=_group(info, params, plain, vocab),
    )


def _group(info, params: Sequence[SamplingParams], rows: List[int], candidates: int) -> Optional[SamplingGroup]:
    if not rows:
        return None
    whole = len(rows) == info.batch_size
    index = None if whole else host_to_device(rows, torch.int64, info.device)

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t if index is None else t.index_select(0, index)

    return SamplingGroup(
        rows=index,
        temperatures=pick(info.temperatures),
        top_ks=pick(info.top_ks),
        top_ps=pick(info.top_ps),
        min_ps=pick(info.min_ps),
        candidates=candidates,
        need_top_p=any(params[i].top_p < 1.0 for i in rows),
        need_min_p=any(params[i].min_p > 0.0 for i in rows),
    )
