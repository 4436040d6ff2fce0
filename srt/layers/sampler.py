"""`Sampler`: next-token choice from logits — penalties, greedy/temperature, top-k/top-p/min-p,
per-request seeds — plus the logprobs the API reports, all as batched tensor ops.

Choices:
  * Logprobs are `log_softmax` of the logits *after* penalties, logit_bias and bans but *before*
    temperature and top-k/top-p/min-p, so they describe the model (plus the user's explicit
    edits), not the sampling knobs, and greedy and sampled requests report on the same scale.
  * Rows take one of three paths (srt/sampling/sampling_groups.py), each row by its own
    parameters: greedy rows only argmax; top-k/top-p rows keep their best K candidates
    (`torch.topk`, K = the largest top_k among them; a full sort when one has no top-k) and
    apply top-p and min-p to those alone; plain rows (temperature, min-p) use the whole vocabulary.
  * Each sampled row draws one uniform u and inverts the float32 CDF of its kept candidates.
    Unseeded rows take u from torch's global RNG; seeded rows take it from a counter-based hash
    of (seed, position), so a seeded request's draw depends on nothing else in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from srt.layers.cpu_fused_ops import fused_ops_for
from srt.sampling.sampling_batch_info import SamplingBatchInfo
from srt.sampling.sampling_groups import SamplingGroup
from kernels.device_utils import host_to_device

_MASK32 = 0xFFFFFFFF
_MASK16 = 0xFFFF


@dataclass
class SampleOutput:
    """Result of one sampling step for a batch of bs requests: device tensors, read on the host
    all at once by `to_host()` (one device-to-host transfer per step)."""

    next_token_ids: torch.Tensor  # [bs] int64
    # [bs] float32: logprob of next_token_ids[i] (see the module docstring); None unless asked.
    logprobs: Optional[torch.Tensor] = None
    # [bs, k_max] values and ids of the most likely tokens, best first; row i keeps top_ks[i].
    top_logprobs_val: Optional[torch.Tensor] = None
    top_logprobs_idx: Optional[torch.Tensor] = None
    top_ks: Optional[List[int]] = None
    # [bs, m_max] logprobs of the ids each request asked for; row i keeps len(token_ids[i]).
    token_ids_val: Optional[torch.Tensor] = None
    token_ids: Optional[List[Optional[Sequence[int]]]] = None
    _host: Optional["SampleOutputHost"] = None

    def to_host(self) -> "SampleOutputHost":
        """Everything the scheduler reads, in one transfer: the tensors are packed side by side
        as float64 (exact for int64 token ids below 2^53 and for float32 values) and read with
        a single `.tolist()`."""
        if self._host is not None:
            return self._host
        bs = self.next_token_ids.shape[0]
        parts = [self.next_token_ids.view(bs, 1)]
        for t in (self.logprobs.view(bs, 1) if self.logprobs is not None else None,
                  self.top_logprobs_val, self.top_logprobs_idx, self.token_ids_val):
            if t is not None:
                parts.append(t)
        packed = parts[0].view(bs, 1) if len(parts) == 1 else torch.cat([p.to(torch.float64) for p in parts], 1)
        rows = packed.tolist()
        host = SampleOutputHost(next_token_ids=[int(r[0]) for r in rows])
        col = 1
        if self.logprobs is not None:
            host.logprobs = [r[col] for r in rows]
            col += 1
        if self.top_logprobs_val is not None:
            k = self.top_logprobs_val.shape[1]
            host.top_logprobs = [(r[col : col + n], [int(x) for x in r[col + k : col + k + n]])
                                 for r, n in zip(rows, self.top_ks)]
            col += 2 * k
        if self.token_ids_val is not None:
            host.token_ids_logprobs = [r[col : col + len(ids or ())] for r, ids in zip(rows, self.token_ids)]
        self._host = host
        return host

    @property
    def top_logprobs(self) -> Optional[List[Tuple[List[float], List[int]]]]:
        return self.to_host().top_logprobs

    @property
    def token_ids_logprobs(self) -> Optional[List[List[float]]]:
        return self.to_host().token_ids_logprobs


@dataclass
class SampleOutputHost:
    """`SampleOutput` as Python lists (per request)."""

    next_token_ids: List[int]
    logprobs: Optional[List[float]] = None
    top_logprobs: Optional[List[Tuple[List[float], List[int]]]] = None
    token_ids_logprobs: Optional[List[List[float]]] = None


class Sampler(nn.Module):
    """Chooses one token per request. Stateless: all per-request state is in `SamplingBatchInfo`."""

    def forward(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        return_logprob: bool = False,
        top_logprobs_nums: Optional[Sequence[int]] = None,
        positions: Optional[torch.Tensor] = None,
        token_ids_logprob: Optional[Sequence[Optional[Sequence[int]]]] = None,
    ) -> SampleOutput:
        """Sample from `logits` [bs, vocab] (float32; modified in place by `info.apply_logits_bias`).

        `positions` [bs]: the step counter of each seeded draw — pass each request's current
        sequence length so that every step draws afresh. Defaults to `info.output_lens`.
        """
        assert logits.dim() == 2 and logits.shape[0] == info.batch_size, (
            f"logits {tuple(logits.shape)} do not match a batch of {info.batch_size}"
        )
        info.apply_logits_bias(logits)
        if info.is_all_greedy:
            next_ids = greedy_ids(logits)
        else:
            next_ids = _sample_rows(logits, info, _uniforms(info, positions))
        return self._with_logprobs(
            next_ids, logits, return_logprob, top_logprobs_nums, token_ids_logprob
        )

    @staticmethod
    def _with_logprobs(
        next_ids: torch.Tensor,
        logits: torch.Tensor,
        return_logprob: bool,
        top_logprobs_nums: Optional[Sequence[int]],
        token_ids_logprob: Optional[Sequence[Optional[Sequence[int]]]],
    ) -> SampleOutput:
        out = SampleOutput(next_token_ids=next_ids)
        if not return_logprob:
            return out
        logprobs = torch.log_softmax(logits, dim=-1)
        out.logprobs = logprobs.gather(1, next_ids.view(-1, 1)).view(-1)
        if top_logprobs_nums is not None and any(k > 0 for k in top_logprobs_nums):
            k_max = min(max(top_logprobs_nums), logprobs.shape[1])
            out.top_logprobs_val, out.top_logprobs_idx = logprobs.topk(k_max, dim=-1)
            out.top_ks = [min(k, k_max) for k in top_logprobs_nums]
        if token_ids_logprob is not None and any(token_ids_logprob):
            width = max(len(ids or ()) for ids in token_ids_logprob)
            index = [list(ids or ()) + [0] * (width - len(ids or ())) for ids in token_ids_logprob]
            out.token_ids_val = logprobs.gather(1, host_to_device(index, torch.int64, logprobs.device))
            out.token_ids = list(token_ids_logprob)
        return out


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """`torch.argmax(logits, dim=-1)`: on the CPU through the C++ op (kernels/cpu/csrc/sampling.cpp,
    the same answer at a fraction of torch's element-by-element cost), else torch's."""
    ops = fused_ops_for(logits) if logits.dim() == 2 else None
    return ops.argmax_rows(logits) if ops is not None else torch.argmax(logits, dim=-1)


def _sample_rows(logits: torch.Tensor, info: SamplingBatchInfo, u: torch.Tensor) -> torch.Tensor:
    """Next token of every row ([bs] int64): argmax for greedy rows, a draw for the others."""
    groups = info.groups
    if groups.any_greedy:
        next_ids = greedy_ids(logits)
    else:
        next_ids = torch.empty(info.batch_size, dtype=torch.int64, device=logits.device)
    for group, draw in ((groups.truncated, sample_truncated), (groups.plain, sample_plain)):
        if group is None:
            continue
        if group.rows is None:  # the whole batch takes this path
            return draw(logits, group, u)
        ids = draw(logits.index_select(0, group.rows), group, u.index_select(0, group.rows))
        next_ids.index_copy_(0, group.rows, ids)
    return next_ids


@dataclass
class Truncation:
    """Each row's best candidates, most likely first, and how many of them it keeps.

    `weights` are softmax numerators relative to the row's most likely token (that one is 1), so
    they do not depend on how many candidates the batch takes. Top-k, top-p and min-p each keep
    a prefix of this order, so the kept set is ranks [0, n_keep).
    """

    ids: torch.Tensor  # [n, K] int64 token ids
    weights: torch.Tensor  # [n, K] float32
    cdf: torch.Tensor  # [n, K] float32: cumulative weights
    n_keep: torch.Tensor  # [n, 1] int64, in [1, K]


def truncate(logits: torch.Tensor, group: SamplingGroup) -> Truncation:
    """Top-k, then top-p, then min-p, on the `group.candidates` best tokens of each row.

    As in HF's warpers each filter sees what the previous one kept: top-p keeps the smallest
    prefix whose share of the top-k mass reaches top_p (the most likely token always survives);
    min-p drops tokens below min_p times the most likely one's probability. Which of several
    tokens tied exactly at the top-k boundary survive is `torch.topk`'s choice (a full sort, used
    when K is the whole vocabulary, keeps the lower ids).
    """
    k = group.candidates
    if k >= logits.shape[1]:
        values, ids = logits.sort(dim=-1, descending=True, stable=True)
    else:
        values, ids = logits.topk(k, dim=-1)
    weights = torch.exp((values - values[:, :1]) / group.temperatures)
    cdf = weights.cumsum(dim=-1)
    ranks = torch.arange(k, device=logits.device)
    kept = ranks.unsqueeze(0) < group.top_ks.unsqueeze(1)
    if group.need_top_p:
        top_k_mass = cdf.gather(1, (group.top_ks - 1).unsqueeze(1))
        mass_before = cdf - weights
        top_ps = group.top_ps.unsqueeze(1)
        kept &= (mass_before < top_ps * top_k_mass) | (top_ps >= 1.0)
    if group.need_min_p:
        kept &= weights >= group.min_ps.unsqueeze(1)
    n_keep = kept.sum(dim=-1, keepdim=True).clamp_(min=1)
    return Truncation(ids=ids, weights=weights, cdf=cdf, n_keep=n_keep)


def sample_truncated(logits: torch.Tensor, group: SamplingGroup, u: torch.Tensor) -> torch.Tensor:
    """Draw among each row's kept candidates ([n] int64 token ids)."""
    t = truncate(logits, group)
    pick = _invert_cdf(t.cdf, t.cdf.gather(1, t.n_keep - 1), u)
    return t.ids.gather(1, pick).view(-1)


def sample_plain(logits: torch.Tensor, group: SamplingGroup, u: torch.Tensor) -> torch.Tensor:
    """Draw over the whole vocabulary in token-id order, min-p applied in place ([n] int64)."""
    weights = torch.exp((logits - logits.amax(dim=-1, keepdim=True)) / group.temperatures)
    if group.need_min_p:
        weights.masked_fill_(weights < group.min_ps.unsqueeze(1), 0.0)
    cdf = weights.cumsum(dim=-1)
    return _invert_cdf(cdf, cdf[:, -1:], u).view(-1)


def _invert_cdf(cdf: torch.Tensor, total: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[n, 1] index of the first entry whose cumulative weight exceeds u * total.

    The target is kept strictly below `total`, so the entry found has weight > 0 and lies within
    the kept prefix (rounding of u * total can never land on a dropped or zero-weight token).
    """
    target = torch.minimum(u.to(cdf.dtype).unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)


def _uniforms(info: SamplingBatchInfo, positions: Optional[torch.Tensor]) -> torch.Tensor:
    """One uniform in [0, 1) per row: hashed for seeded rows, from torch's RNG for the rest."""
    bs = info.batch_size
    if not info.any_seeded:
        return torch.rand(bs, dtype=torch.float64, device=info.device)
    steps = info.output_lens if positions is None else positions.to(info.device, torch.int64)
    hashed = seeded_uniform(info.seeds, steps)
    fresh = torch.rand(bs, dtype=torch.float64, device=info.device)
    return torch.where(info.has_seed, hashed, fresh)


# ------------------------------------------------------------------------ seed hashing
def seeded_uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Uniform in (0, 1) (float64, 52 random bits) from int64 `seeds` and `positions`.

    A counter-based hash (murmur3's 32-bit finaliser chained over the seed's two words and the
    position), computed with int64 tensor ops on any device. Values stay below 2^32 between
    steps and products below 2^49, so nothing relies on integer overflow.
    """
    seed_lo = seeds & _MASK32
    seed_hi = (seeds >> 32) & _MASK32
    pos = positions & _MASK32
    key = _fmix32(seed_lo ^ 0x9E3779B9)
    key = _fmix32(key ^ seed_hi)
    key = _fmix32(key ^ pos)
    word_a = _fmix32(key ^ 0x68E31DA4)
    word_b = _fmix32((key + 0x1B56C4E9) & _MASK32)
    bits52 = (word_a << 20) | (word_b >> 12)
    return (bits52.to(torch.float64) + 0.5) * (2.0 ** -52)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32), split into 16-bit halves to stay within int64."""
    low = (x & _MASK16) * c
    high = (((x >> 16) * c) & _MASK16) << 16
    return (low + high) & _MASK32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)
