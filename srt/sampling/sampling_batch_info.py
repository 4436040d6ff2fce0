"""`SamplingBatchInfo`: the sampling parameters of a running batch as tensors on the model's device.

Per-request Python work happens once per request, in `from_params`; each decode step then costs a
handful of batched tensor ops (`apply_logits_bias`, the sampler, `cumulate_output_tokens`),
whatever the batch size. The running batch builds it once, calls `cumulate_output_tokens(next_ids)`
after each step, `filter_batch` when requests leave and `merge_batch` when newly prefilled ones
join; flags and row groups are re-derived from the host-side `params`, never read from the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Sequence, Set, Union

import torch

from srt.sampling.penaltylib import PenaltyState
from srt.sampling.sampling_groups import SamplingGroups, clamp_top_k, split_rows
from srt.sampling.sampling_params import SamplingParams, fold_seed
from kernels.device_utils import host_to_device

Indices = Union[torch.Tensor, Sequence[int]]


@dataclass
class SamplingBatchInfo:
    """Batched sampling state; row i belongs to the batch's i-th request.

    Greedy rows (temperature < 1e-6 or top_k == 1) hold temperature 1.0 so that scaling never
    divides by zero; the sampler takes their argmax regardless. `top_ks` is already clamped to
    [1, vocab_size] (-1 -> vocab_size). `seeds` hold each request's `sampling_seed` folded to
    int64 and are meaningful only where `has_seed`. `params` are the rows' `SamplingParams` (host
    side): every flag and `groups` (which sampler path each row takes) is derived from them.
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
    params: List[SamplingParams] = field(default_factory=list)
    groups: SamplingGroups = field(default_factory=lambda: SamplingGroups(any_greedy=True))

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

        def rows(values, dtype):  # host lists -> one pinned, non-blocking copy each
            return host_to_device(values, dtype, device)

        info = cls(
            temperatures=rows([1.0 if g else float(p.temperature) for p, g in zip(params, greedy)],
                              torch.float32).view(bs, 1),
            top_ps=rows([float(p.top_p) for p in params], torch.float32),
            top_ks=rows([clamp_top_k(p.top_k, vocab_size) for p in params], torch.int64),
            min_ps=rows([float(p.min_p) for p in params], torch.float32),
            greedy_mask=rows(greedy, torch.bool),
            seeds=rows([fold_seed(p.sampling_seed) if p.sampling_seed is not None else 0 for p in params],
                       torch.int64),
            has_seed=rows([p.sampling_seed is not None for p in params], torch.bool),
            output_lens=rows([len(ids) for ids in output_ids] if output_ids is not None else [0] * bs,
                             torch.int64),
            vocab_size=vocab_size,
            device=device,
            params=list(params),
        )
        info.penalties = PenaltyState.build(params, output_ids, vocab_size, device)
        info.logit_bias = _build_logit_bias(params, vocab_size, device)
        if any(p.min_new_tokens > 0 for p in params):
            info.min_new_tokens = host_to_device([p.min_new_tokens for p in params], torch.int64, device)
            info.stop_token_mask = _build_stop_token_mask(params, stop_token_ids, vocab_size, device)
        info._refresh_flags()
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
        """Keep only rows `keep_indices` (in that order), e.g. after requests finish. State no kept
        row uses (penalties, logit_bias, min_new_tokens) is dropped, as a fresh build would."""
        keep_list = keep_indices.tolist() if isinstance(keep_indices, torch.Tensor) else list(keep_indices)
        keep = host_to_device(keep_list, torch.int64, self.device)
        for name in _ROW_TENSORS:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value[keep])
        self.params = [self.params[i] for i in keep_list]
        if self.penalties is not None:
            self.penalties = self.penalties.filter(keep, self.params)
        if not any(p.logit_bias for p in self.params):
            self.logit_bias = None
        if not any(p.min_new_tokens > 0 for p in self.params):
            self.min_new_tokens = self.stop_token_mask = None
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
        self.params = self.params + other.params
        self._refresh_flags()

    def _refresh_flags(self) -> None:
        """Re-derive the host flags and row groups from `params` (no device read)."""
        vocab = self.vocab_size
        sampled = [p for p in self.params if not p.is_greedy]
        self.is_all_greedy = not sampled
        self.need_top_p_sampling = any(p.top_p < 1.0 for p in sampled)
        self.need_top_k_sampling = any(clamp_top_k(p.top_k, vocab) < vocab for p in sampled)
        self.need_min_p_sampling = any(p.min_p > 0.0 for p in sampled)
        self.any_seeded = any(p.sampling_seed is not None for p in self.params)
        self.groups = split_rows(self, self.params)


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
