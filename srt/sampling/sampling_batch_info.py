"""`SamplingBatchInfo`: the sampling parameters of a running batch as tensors on the model's device.

Per-request Python work happens once, in `from_params`; each decode step then costs a handful of
batched tensor ops (`apply_logits_bias`, the sampler, `cumulate_output_tokens`), whatever the batch
size. Two ways to drive it:
  * rebuild every step with `from_params(..., output_ids=...)`, or
  * build once per batch, call `cumulate_output_tokens(next_ids)` after each step, and
    `filter_batch` / `merge_batch` when requests finish or join.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Set, Union

import torch

from srt.sampling.penaltylib import PenaltyState
from srt.sampling.sampling_params import SamplingParams, fold_seed
from kernels.device_utils import host_to_device

Indices = Union[torch.Tensor, Sequence[int]]


@dataclass
class SamplingBatchInfo:
    """Batched sampling state; row i belongs to the batch's i-th request.

    Greedy rows (temperature < 1e-6 or top_k == 1) hold temperature 1.0 so that scaling never
    divides by zero; the sampler takes their argmax regardless. `top_ks` is already clamped to
    [1, vocab_size] (-1 -> vocab_size). `seeds` hold each request's `sampling_seed` folded to
    int64 and are meaningful only where `has_seed`.
    """

    temperatures: torch.Tensor  # [bs, 1] float32
    top_ps: torch.Tensor  # [bs] float32
    top_ks: torch.Tensor  # [bs] int64
    min_ps: torch.Tensor  # [bs] float32
    greedy_mask: torch.Tensor  # [bs] bool
    seeds: torch.Tensor  # [bs] int64
    has_seed: torch.Tensor  # [bs] bool
    output_lens: torch.Tensor  # [bs] int64: tokens generated so far
    vocab_size: int
    device: torch.device
    is_all_greedy: bool = True
    need_top_p_sampling: bool = False
    need_top_k_sampling: bool = False
    need_min_p_sampling: bool = False
    any_seeded: bool = False
    penalties: Optional[PenaltyState] = None
    # [bs, vocab] float32 added to the logits; None when no request has a logit_bias.
    logit_bias: Optional[torch.Tensor] = None
    # min_new_tokens: stop ids (eos + stop_token_ids) are banned while output_lens < min_new_tokens.
    min_new_tokens: Optional[torch.Tensor] = None  # [bs] int64
    stop_token_mask: Optional[torch.Tensor] = None  # [bs, vocab] bool
    # Grammar-constrained decoding: True = token not allowed this step. Set per step by the
    # grammar backend; filter_batch keeps it, merge_batch drops it (it must be recomputed).
    vocab_mask: Optional[torch.Tensor] = None

    @property
    def batch_size(self) -> int:
        return self.temperatures.shape[0]

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        vocab_size: int,
        device: Union[torch.device, str],
        output_ids: Optional[Sequence[Sequence[int]]] = None,
        stop_token_ids: Optional[Sequence[Optional[Set[int]]]] = None,
    ) -> "SamplingBatchInfo":
        """Tensors for `params` (one per request, already verified).

        `output_ids[i]`: tokens request i has generated so far (drives penalties, min_new_tokens
        and the default seed position). `stop_token_ids[i]`: the ids that would stop request i
        (eos plus its stop_token_ids); its `params[i].stop_token_ids` are added to them. Only
        needed for requests with `min_new_tokens > 0`.
        """
        device = torch.device(device)
        bs = len(params)
        if output_ids is not None:
            assert len(output_ids) == bs, f"{len(output_ids)} output_ids rows for {bs} requests"
        greedy = [p.is_greedy for p in params]
        top_ks = [vocab_size if (p.top_k < 0 or p.top_k > vocab_size) else p.top_k for p in params]
        sampled = [i for i in range(bs) if not greedy[i]]
        def rows(values, dtype):  # host lists -> one pinned, non-blocking copy each
            return host_to_device(values, dtype, device)

        info = cls(
            temperatures=rows([1.0 if g else float(p.temperature) for p, g in zip(params, greedy)],
                              torch.float32).view(bs, 1),
            top_ps=rows([float(p.top_p) for p in params], torch.float32),
            top_ks=rows(top_ks, torch.int64),
            min_ps=rows([float(p.min_p) for p in params], torch.float32),
            greedy_mask=rows(greedy, torch.bool),
            seeds=rows([fold_seed(p.sampling_seed) if p.sampling_seed is not None else 0 for p in params],
                       torch.int64),
            has_seed=rows([p.sampling_seed is not None for p in params], torch.bool),
            output_lens=rows([len(ids) for ids in output_ids] if output_ids is not None else [0] * bs,
                             torch.int64),
            vocab_size=vocab_size,
            device=device,
            is_all_greedy=not sampled,
            need_top_p_sampling=any(params[i].top_p < 1.0 for i in sampled),
            need_top_k_sampling=any(top_ks[i] < vocab_size for i in sampled),
            need_min_p_sampling=any(params[i].min_p > 0.0 for i in sampled),
            any_seeded=any(p.sampling_seed is not None for p in params),
        )
        info.penalties = PenaltyState.build(params, output_ids, vocab_size, device)
        info.logit_bias = _build_logit_bias(params, vocab_size, device)
        if any(p.min_new_tokens > 0 for p in params):
            info.min_new_tokens = host_to_device([p.min_new_tokens for p in params], torch.int64, device)
            info.stop_token_mask = _build_stop_token_mask(params, stop_token_ids, vocab_size, device)
        return info

    # -------------------------------------------------------------- per step
    def apply_logits_bias(self, logits: torch.Tensor) -> None:
        """Rewrite `logits` [bs, vocab] in place: penalties, then logit_bias, then the bans
        (grammar vocab_mask, stop ids before min_new_tokens) as -inf."""
        if self.penalties is not None:
            self.penalties.apply(logits)
        if self.logit_bias is not None:
            logits += self.logit_bias
        if self.vocab_mask is not None:
            logits.masked_fill_(self.vocab_mask, float("-inf"))
        if self.stop_token_mask is not None:
            active = (self.output_lens < self.min_new_tokens).unsqueeze(1)
            logits.masked_fill_(self.stop_token_mask & active, float("-inf"))

    def cumulate_output_tokens(self, next_token_ids: torch.Tensor) -> None:
        """Record one sampled token per request: advances output_lens and penalty counts."""
        self.output_lens += 1
        if self.penalties is not None:
            self.penalties.cumulate(next_token_ids.to(self.device))

    # ------------------------------------------------------ batch composition
    def filter_batch(self, keep_indices: Indices) -> None:
        """Keep only rows `keep_indices` (in that order), e.g. after requests finish."""
        if isinstance(keep_indices, torch.Tensor):
            keep = keep_indices.to(device=self.device, dtype=torch.int64)
        else:
            keep = host_to_device(list(keep_indices), torch.int64, self.device)
        for name in _ROW_TENSORS:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value[keep])
        if self.penalties is not None:
            self.penalties.filter(keep)
        self._refresh_flags()

    def merge_batch(self, other: "SamplingBatchInfo") -> None:
        """Append `other`'s rows after this batch's rows (e.g. a prefilled batch joins decode)."""
        assert other.vocab_size == self.vocab_size, (
            f"cannot merge batches with vocab sizes {self.vocab_size} and {other.vocab_size}"
        )
        bs, other_bs = self.batch_size, other.batch_size
        for name in ("temperatures", "top_ps", "top_ks", "min_ps", "greedy_mask", "seeds",
                     "has_seed", "output_lens"):
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        self.penalties = PenaltyState.merge(
            self.penalties, bs, other.penalties, other_bs, self.vocab_size, self.device
        )
        if self.logit_bias is not None or other.logit_bias is not None:
            self.logit_bias = torch.cat([
                _or_zeros(self.logit_bias, bs, self.vocab_size, torch.float32, self.device),
                _or_zeros(other.logit_bias, other_bs, self.vocab_size, torch.float32, self.device),
            ])
        if self.stop_token_mask is not None or other.stop_token_mask is not None:
            self.stop_token_mask = torch.cat([
                _or_zeros(self.stop_token_mask, bs, self.vocab_size, torch.bool, self.device),
                _or_zeros(other.stop_token_mask, other_bs, self.vocab_size, torch.bool, self.device),
            ])
            self.min_new_tokens = torch.cat([
                _or_zeros(self.min_new_tokens, bs, None, torch.int64, self.device),
                _or_zeros(other.min_new_tokens, other_bs, None, torch.int64, self.device),
            ])
        self.vocab_mask = None
        self._refresh_flags()

    def _refresh_flags(self) -> None:
        """Re-derive the host flags after filter/merge (reads the device: not a per-step path;
        the scheduler rebuilds with `from_params` instead)."""
        sampled = ~self.greedy_mask
        self.is_all_greedy = not bool(sampled.any())
        self.need_top_p_sampling = bool((sampled & (self.top_ps < 1.0)).any())
        self.need_top_k_sampling = bool((sampled & (self.top_ks < self.vocab_size)).any())
        self.need_min_p_sampling = bool((sampled & (self.min_ps > 0.0)).any())
        self.any_seeded = bool(self.has_seed.any())


_ROW_TENSORS = (
    "temperatures", "top_ps", "top_ks", "min_ps", "greedy_mask", "seeds", "has_seed",
    "output_lens", "logit_bias", "min_new_tokens", "stop_token_mask", "vocab_mask",
)


def _or_zeros(value: Optional[torch.Tensor], rows: int, cols: Optional[int], dtype, device) -> torch.Tensor:
    if value is not None:
        return value
    shape = (rows,) if cols is None else (rows, cols)
    return torch.zeros(shape, dtype=dtype, device=device)


def _build_logit_bias(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device
) -> Optional[torch.Tensor]:
    rows: List[int] = []
    cols: List[int] = []
    values: List[float] = []
    for row, p in enumerate(params):
        for key, bias in (p.logit_bias or {}).items():
            rows.append(row)
            cols.append(int(key))
            values.append(float(bias))
    if not rows:
        return None
    assert all(0 <= c < vocab_size for c in cols), "logit_bias token id out of range; verify() first"
    bias = torch.zeros(len(params), vocab_size, dtype=torch.float32, device=device)
    index = (host_to_device(rows, torch.int64, device), host_to_device(cols, torch.int64, device))
    bias.index_put_(index, host_to_device(values, torch.float32, device), accumulate=True)
    return bias


def _build_stop_token_mask(
    params: Sequence[SamplingParams],
    stop_token_ids: Optional[Sequence[Optional[Set[int]]]],
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor:
    """[bs, vocab] bool: True at the ids that would stop each request with min_new_tokens > 0."""
    rows: List[int] = []
    cols: List[int] = []
    for row, p in enumerate(params):
        if p.min_new_tokens <= 0:
            continue
        ids: Iterable[int] = set(p.stop_token_ids or ())
        if stop_token_ids is not None and stop_token_ids[row]:
            ids = set(ids) | set(stop_token_ids[row])
        for tid in ids:
            assert 0 <= tid < vocab_size, f"stop token id {tid} outside the vocabulary [0, {vocab_size})"
            rows.append(row)
            cols.append(tid)
    mask = torch.zeros(len(params), vocab_size, dtype=torch.bool, device=device)
    if rows:
        mask.index_put_((host_to_device(rows, torch.int64, device), host_to_device(cols, torch.int64, device)),
                        torch.ones(len(rows), dtype=torch.bool, device=device))
    return mask
