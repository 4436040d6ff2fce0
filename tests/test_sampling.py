"""Specification of sampling: parameter checks, logit rewriting, the sampler, seeded draws."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from srt.layers.sampler import Sampler, _fmix32, _mul32, sample_plain, sample_truncated, seeded_uniform, truncate
from srt.sampling import SamplingBatchInfo, SamplingParams

VOCAB = 32


def make_info(params, vocab=VOCAB, **kwargs) -> SamplingBatchInfo:
    for p in params:
        p.verify(vocab)
        p.normalize()
    return SamplingBatchInfo.from_params(params, vocab, "cpu", **kwargs)


def sample(logits, params, positions=None, **kwargs):
    info = make_info(params, vocab=logits.shape[1])
    if positions is not None:
        positions = torch.as_tensor(positions, dtype=torch.int64)
    return Sampler()(logits.clone(), info, positions=positions, **kwargs)


def random_logits(bs, vocab=VOCAB, seed=0):
    return torch.randn(bs, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def logits_from_probs(probs, rows):
    return torch.log(torch.tensor(probs, dtype=torch.float32)).repeat(rows, 1)


# ------------------------------------------------------------------ greedy
def test_temperature_zero_is_argmax():
    logits = random_logits(16)
    out = sample(logits, [SamplingParams(temperature=0.0) for _ in range(16)])
    assert torch.equal(out.next_token_ids, logits.argmax(dim=-1))


def test_greedy_ties_pick_lowest_id():
    logits = torch.zeros(1, VOCAB)
    logits[0, [7, 3, 20]] = 5.0
    assert sample(logits, [SamplingParams(temperature=0.0)]).next_token_ids.item() == 3


def test_top_k_one_equals_greedy_at_temperature_one():
    logits = random_logits(16, seed=1)
    out = sample(logits, [SamplingParams(temperature=1.0, top_k=1) for _ in range(16)])
    assert torch.equal(out.next_token_ids, logits.argmax(dim=-1))


def test_greedy_rows_stay_greedy_in_a_sampled_batch():
    logits = random_logits(8, seed=2)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5) for i in range(8)]
    out = sample(logits, params)
    assert torch.equal(out.next_token_ids[1::2], logits.argmax(dim=-1)[1::2])


# ------------------------------------------------------------------- seeds
def test_same_seed_same_logits_same_position_gives_same_token():
    logits = random_logits(1, seed=3) / 3  # flat enough that draws vary
    firsts = [sample(logits, [SamplingParams(sampling_seed=42)], positions=[p]).next_token_ids.item()
              for p in range(20)]
    seconds = [sample(logits, [SamplingParams(sampling_seed=42)], positions=[p]).next_token_ids.item()
               for p in range(20)]
    assert firsts == seconds
    assert len(set(firsts)) > 1, "different positions must give different draws"


def test_seeded_request_is_independent_of_its_batch():
    vocab = 64
    steps = 30
    target = SamplingParams(temperature=0.9, top_p=0.95, sampling_seed=1234)
    logits_per_step = [random_logits(1, vocab, seed=100 + s) / 2 for s in range(steps)]

    def run(batch_index: int, alone: bool):
        tokens = []
        for s in range(steps):
            if alone:
                params = [SamplingParams(**target.to_dict())]
                logits = logits_per_step[s]
                positions = [10 + s]
            else:
                params = [
                    SamplingParams(temperature=1.0, sampling_seed=i) if i % 2
                    else SamplingParams(temperature=0.7, top_k=5)
                    for i in range(8)
                ]
                params[batch_index] = SamplingParams(**target.to_dict())
                logits = random_logits(8, vocab, seed=500 + s)
                logits[batch_index] = logits_per_step[s][0]
                positions = [3 * i + s for i in range(8)]
                positions[batch_index] = 10 + s
            out = sample(logits, params, positions=positions)
            tokens.append(out.next_token_ids[0 if alone else batch_index].item())
        return tokens

    alone = run(0, alone=True)
    assert alone == run(2, alone=False) == run(7, alone=False)
    assert len(set(alone)) > 3


def test_different_seeds_differ_over_many_draws():
    logits = torch.zeros(200, VOCAB)
    positions = list(range(200))
    a = sample(logits, [SamplingParams(sampling_seed=1) for _ in range(200)], positions=positions)
    b = sample(logits, [SamplingParams(sampling_seed=2) for _ in range(200)], positions=positions)
    agree = (a.next_token_ids == b.next_token_ids).float().mean().item()
    assert agree < 0.2  # independent uniform draws over 32 tokens agree ~1/32 of the time


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# Critical value of chi-square with 7 degrees of freedom at p = 0.001.
CHI2_7DF_P001 = 24.32
SKEWED = [0.4, 0.2, 0.15, 0.1, 0.06, 0.05, 0.03, 0.01]


def test_seeded_draws_over_positions_follow_the_probabilities():
    n = 20000
    out = sample(logits_from_probs(SKEWED, n), [SamplingParams(sampling_seed=7) for _ in range(n)],
                 positions=list(range(n)))
    counts = torch.bincount(out.next_token_ids, minlength=8).float()
    assert _chi_square(counts, torch.tensor(SKEWED)) < CHI2_7DF_P001


def test_seeded_draws_over_seeds_follow_the_probabilities():
    n = 20000
    out = sample(logits_from_probs(SKEWED, n), [SamplingParams(sampling_seed=s) for s in range(n)],
                 positions=[5] * n)
    counts = torch.bincount(out.next_token_ids, minlength=8).float()
    assert _chi_square(counts, torch.tensor(SKEWED)) < CHI2_7DF_P001


def test_unseeded_draws_follow_the_probabilities():
    torch.manual_seed(0)
    n = 20000
    out = sample(logits_from_probs(SKEWED, n), [SamplingParams() for _ in range(n)])
    counts = torch.bincount(out.next_token_ids, minlength=8).float()
    assert _chi_square(counts, torch.tensor(SKEWED)) < CHI2_7DF_P001


def test_seeded_uniform_is_in_open_unit_interval_and_flat():
    u = seeded_uniform(torch.full((50000,), 99, dtype=torch.int64), torch.arange(50000))
    assert 0.0 < u.min().item() and u.max().item() < 1.0
    counts = torch.histc(u.float(), bins=10, min=0.0, max=1.0)
    # chi-square, 9 degrees of freedom, p = 0.001
    assert _chi_square(counts, torch.full((10,), 0.1)) < 27.88


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([0x85EBCA6B, 0xC2B2AE35, 3, 2**32 - 1]))
def test_mul32_matches_modular_product(x, c):
    assert _mul32(torch.tensor([x]), c).item() == (x * c) % 2**32


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_fmix32_matches_reference(x):
    def ref(h):
        h ^= h >> 16
        h = (h * 0x85EBCA6B) % 2**32
        h ^= h >> 13
        h = (h * 0xC2B2AE35) % 2**32
        return h ^ (h >> 16)

    assert _fmix32(torch.tensor([x])).item() == ref(x)


def test_huge_and_negative_seeds_are_accepted():
    logits = random_logits(2)
    out = sample(logits, [SamplingParams(sampling_seed=2**64 + 5), SamplingParams(sampling_seed=-3)])
    assert out.next_token_ids.shape == (2,)


# ------------------------------------------------------------ truncation
def _support(probs, params, n=4000):
    out = sample(logits_from_probs(probs, n), [SamplingParams(**params) for _ in range(n)],
                 positions=list(range(n)))
    return set(out.next_token_ids.tolist())


def test_top_p_keeps_smallest_prefix_reaching_the_mass():
    # Mass before each token: 0, .5, .8, .9 -> top_p=0.75 keeps tokens 0 and 1.
    assert _support([0.5, 0.3, 0.1, 0.1], dict(top_p=0.75, sampling_seed=1)) == {0, 1}


def test_top_p_always_keeps_the_most_likely_token():
    assert _support([0.5, 0.3, 0.1, 0.1], dict(top_p=1e-9, sampling_seed=1)) == {0}


def test_top_k_restricts_support():
    assert _support([0.1, 0.4, 0.2, 0.3], dict(top_k=2, sampling_seed=1)) == {1, 3}


def test_min_p_drops_tokens_below_fraction_of_max():
    # min_p * max = 0.25 * 0.4 = 0.1: drops 0.05 and 0.09, keeps 0.1 and above.
    assert _support([0.4, 0.05, 0.3, 0.09, 0.16], dict(min_p=0.25, sampling_seed=3)) == {0, 2, 4}


def test_top_p_applies_after_top_k_on_the_remaining_mass():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    info = make_info([SamplingParams(top_k=2, top_p=0.5)], vocab=4)
    # After top-k, tokens 0 and 1 hold 0.7; 0.4 / 0.7 >= 0.5, so token 0 alone is kept.
    t = truncate(logits, info.groups.truncated)
    assert t.ids[0, : int(t.n_keep)].tolist() == [0]


def test_a_row_without_top_k_or_top_p_is_sampled_over_the_vocabulary_whatever_its_batch():
    params = [SamplingParams(top_p=0.5, top_k=3, min_p=0.2), SamplingParams(sampling_seed=5)]
    info = make_info(params)
    assert info.groups.truncated.rows.tolist() == [0] and info.groups.plain.rows.tolist() == [1]
    logits = random_logits(2, seed=9) / 3
    together = [sample(logits, params, positions=[0, p]).next_token_ids[1].item() for p in range(40)]
    alone = [sample(logits[1:], params[1:], positions=[p]).next_token_ids.item() for p in range(40)]
    assert together == alone
    assert len(set(alone)) > 5, "the plain row must reach beyond the other row's 3 candidates"


def test_candidates_are_the_largest_top_k_of_the_sampled_rows_only():
    info = make_info([SamplingParams(top_k=5), SamplingParams(top_k=7, top_p=0.9), SamplingParams(temperature=0)])
    assert info.groups.truncated.candidates == 7 and info.groups.plain is None
    info = make_info([SamplingParams(top_k=5), SamplingParams(top_p=0.9)])
    assert info.groups.truncated.candidates == VOCAB, "a row without top-k needs the whole vocabulary"


def test_all_greedy_batch_has_no_sampled_rows():
    info = make_info([SamplingParams(temperature=0), SamplingParams(top_k=1, top_p=0.5)])
    assert info.is_all_greedy and info.groups.truncated is None and info.groups.plain is None


@pytest.mark.parametrize("u", [0.0, 0.5, 1 - 2**-53], ids=["bottom", "middle", "top"])
def test_no_uniform_picks_a_dropped_or_banned_token(u):
    logits = torch.full((3, VOCAB), -math.inf)
    logits[:, 5:9] = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = [SamplingParams(top_k=10), SamplingParams(top_p=0.75), SamplingParams()]
    groups = [make_info([p]).groups for p in params]
    uniforms = torch.full((1,), u, dtype=torch.float64)
    first = sample_truncated(logits[:1], groups[0].truncated, uniforms).item()
    nucleus = sample_truncated(logits[1:2], groups[1].truncated, uniforms).item()
    plain = sample_plain(logits[2:], groups[2].plain, uniforms).item()
    assert first in {5, 6, 7, 8} and nucleus in {5, 6} and plain in {5, 6, 7, 8}
    if u == 0.0:
        assert first == nucleus == plain == 5
    if u > 0.99:
        assert (first, nucleus, plain) == (8, 6, 8)


# The sampler as it was before top-k candidates (full sort of the vocabulary, float64 CDF): the
# oracle for the distribution the sampler must keep, and the "old" column of
# scripts/bench_sampling.py.
def reference_filter_probs(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Probabilities [bs, vocab] with what top-k, top-p, min-p exclude zeroed (not renormalised)."""
    if info.need_top_k_sampling or info.need_top_p_sampling:
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        if info.need_top_k_sampling:
            ranks = torch.arange(probs.shape[1], device=probs.device)
            sorted_probs.masked_fill_(ranks.unsqueeze(0) >= info.top_ks.unsqueeze(1), 0.0)
        if info.need_top_p_sampling:
            kept_mass = sorted_probs.sum(dim=-1, keepdim=True)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            top_ps = info.top_ps.unsqueeze(1)
            sorted_probs.masked_fill_((mass_before >= top_ps * kept_mass) & (top_ps < 1.0), 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    if info.need_min_p_sampling:
        max_probs = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < info.min_ps.unsqueeze(1) * max_probs, 0.0)
    return probs


def reference_sample(logits: torch.Tensor, info: SamplingBatchInfo, u: torch.Tensor) -> torch.Tensor:
    """Next ids [bs] by the full-sort sampler for uniforms `u` [bs] (logits already biased)."""
    greedy = torch.argmax(logits, dim=-1)
    if info.is_all_greedy:
        return greedy
    probs = reference_filter_probs(torch.softmax(logits / info.temperatures, dim=-1), info)
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    ids = torch.searchsorted(cdf, (u.to(torch.float64) * cdf[:, -1]).unsqueeze(1), right=True).view(-1)
    vocab = torch.arange(probs.shape[1], device=probs.device)
    ids = torch.minimum(ids, torch.where(probs > 0, vocab, -1).amax(dim=-1))
    return torch.where(info.greedy_mask, greedy, ids)


def _truncated_probs(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """The sampler's renormalised distribution over the vocabulary, every row truncated."""
    t = truncate(logits, info.groups.truncated)
    ranks = torch.arange(t.weights.shape[1]).unsqueeze(0)
    kept = torch.where(ranks < t.n_keep, t.weights, 0.0)
    dense = torch.zeros_like(logits).scatter_(1, t.ids, kept)
    return dense / dense.sum(dim=-1, keepdim=True)


TRUNCATIONS = [
    dict(top_k=40), dict(top_p=0.9), dict(top_k=40, top_p=0.9), dict(top_k=3, top_p=0.3),
    dict(top_p=0.6, min_p=0.05), dict(top_k=100, top_p=0.95, min_p=0.01, temperature=0.7),
    dict(top_k=1000, top_p=0.99, temperature=1.3), dict(top_k=7, min_p=0.2),
]


@pytest.mark.parametrize("mixed", [False, True], ids=["one_setting", "mixed_rows"])
def test_truncation_matches_the_full_sort_reference_on_random_logits(mixed):
    vocab, bs = 1000, 16
    for seed, setting in enumerate(TRUNCATIONS):
        params = [SamplingParams(**(TRUNCATIONS[(seed + i) % len(TRUNCATIONS)] if mixed else setting))
                  for i in range(bs)]
        info = make_info(params, vocab=vocab)
        logits = random_logits(bs, vocab, seed=seed) * (1 + torch.arange(bs).unsqueeze(1) / 4)
        logits[0, ::3] = -math.inf  # a banned third of the vocabulary
        want = reference_filter_probs(torch.softmax(logits / info.temperatures, dim=-1), info)
        want = want / want.sum(dim=-1, keepdim=True)
        got = _truncated_probs(logits, info)
        assert torch.equal(got > 0, want > 0), f"candidate sets differ for {setting}"
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_truncated_draws_follow_the_reference_probabilities():
    n = 20000
    params = [SamplingParams(top_k=6, top_p=0.9, temperature=0.8, sampling_seed=s) for s in range(n)]
    logits = logits_from_probs(SKEWED, n)
    out = sample(logits, params, positions=[3] * n)
    info = make_info(params[:1], vocab=8)
    want = reference_filter_probs(torch.softmax(logits[:1] / info.temperatures, dim=-1), info)[0]
    want = want / want.sum()
    support = want > 0
    counts = torch.bincount(out.next_token_ids, minlength=8).float()
    assert torch.equal(counts > 0, support)
    # chi-square with (|support| - 1) <= 5 degrees of freedom at p = 0.001
    assert _chi_square(counts[support], want[support]) < 20.52


# ------------------------------------------------------------- penalties
def test_frequency_and_presence_penalties_subtract_exactly():
    logits = random_logits(1, seed=4)
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.3)]
    info = make_info(params, output_ids=[[2, 2, 2, 5]])
    out = logits.clone()
    info.apply_logits_bias(out)
    expected = logits.clone()
    expected[0, 2] -= 0.5 * 3 + 0.3
    expected[0, 5] -= 0.5 * 1 + 0.3
    torch.testing.assert_close(out, expected)


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.zeros(1, VOCAB)
    logits[0, 1], logits[0, 2], logits[0, 3] = 2.0, -2.0, 4.0
    info = make_info([SamplingParams(repetition_penalty=1.6)], output_ids=[[1, 2]])
    info.apply_logits_bias(logits)
    assert logits[0, 1].item() == pytest.approx(2.0 / 1.6)
    assert logits[0, 2].item() == pytest.approx(-2.0 * 1.6)
    assert logits[0, 3].item() == 4.0  # unseen


def test_penalties_count_tokens_added_step_by_step():
    params = [SamplingParams(frequency_penalty=1.0), SamplingParams()]
    stepped = make_info(params, output_ids=[[4], [1]])
    stepped.cumulate_output_tokens(torch.tensor([4, 9]))
    stepped.cumulate_output_tokens(torch.tensor([6, 9]))
    rebuilt = make_info(params, output_ids=[[4, 4, 6], [1, 9, 9]])
    a, b = random_logits(2), random_logits(2)
    b.copy_(a)
    stepped.apply_logits_bias(a)
    rebuilt.apply_logits_bias(b)
    torch.testing.assert_close(a, b)
    assert stepped.output_lens.tolist() == [3, 3]


def test_logit_bias_adds_to_named_tokens():
    logits = random_logits(2, seed=5)
    info = make_info([SamplingParams(logit_bias={"3": 5.0, 7: -2.5}), SamplingParams()])
    out = logits.clone()
    info.apply_logits_bias(out)
    expected = logits.clone()
    expected[0, 3] += 5.0
    expected[0, 7] -= 2.5
    torch.testing.assert_close(out, expected)


def test_no_penalty_or_bias_leaves_logits_unchanged():
    logits = random_logits(3)
    info = make_info([SamplingParams() for _ in range(3)], output_ids=[[1], [2, 2], []])
    out = logits.clone()
    info.apply_logits_bias(out)
    assert info.penalties is None and info.logit_bias is None
    assert torch.equal(out, logits)


def test_min_new_tokens_bans_stop_ids_until_reached_then_allows_them():
    params = [SamplingParams(min_new_tokens=2, stop_token_ids=[5]), SamplingParams()]
    info = make_info(params, output_ids=[[1], [1]], stop_token_ids=[{0}, {0}])
    logits = torch.zeros(2, VOCAB)
    info.apply_logits_bias(logits)
    assert logits[0, 0] == -math.inf and logits[0, 5] == -math.inf
    assert torch.isfinite(logits[1]).all() and torch.isfinite(logits[0, 1:5]).all()
    info.cumulate_output_tokens(torch.tensor([3, 3]))
    logits = torch.zeros(2, VOCAB)
    info.apply_logits_bias(logits)
    assert torch.isfinite(logits).all()


def test_min_new_tokens_prevents_sampling_eos():
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, 0] = 10.0  # eos dominates
    params = [SamplingParams(temperature=0.0, min_new_tokens=1)]
    info = make_info(params, stop_token_ids=[{0}])
    assert Sampler()(logits, info).next_token_ids.item() != 0


# ---------------------------------------------------- batch composition
def test_filter_then_merge_matches_building_from_scratch():
    params = [
        SamplingParams(frequency_penalty=1.0, sampling_seed=3),
        SamplingParams(temperature=0.0),
        SamplingParams(logit_bias={2: 1.0}, top_p=0.5, min_new_tokens=3),
    ]
    extra = [SamplingParams(repetition_penalty=1.5, top_k=4)]
    outs = [[1, 1], [2], [3]]
    info = make_info(params, output_ids=outs, stop_token_ids=[{0}] * 3)
    info.filter_batch([2, 0])
    info.merge_batch(make_info(extra, output_ids=[[5]]))
    expected = make_info([params[2], params[0], extra[0]], output_ids=[[3], [1, 1], [5]],
                         stop_token_ids=[{0}] * 3)
    a = random_logits(3)
    b = a.clone()
    info.apply_logits_bias(a)
    expected.apply_logits_bias(b)
    torch.testing.assert_close(a, b)
    for name in ("temperatures", "top_ps", "top_ks", "min_ps", "greedy_mask", "seeds", "has_seed"):
        assert torch.equal(getattr(info, name), getattr(expected, name)), name
    assert (info.is_all_greedy, info.need_top_p_sampling, info.need_top_k_sampling) == (
        False, True, True)


# ------------------------------------------------------------- logprobs
def test_logprob_of_chosen_token_is_log_softmax_after_penalties_before_temperature():
    logits = random_logits(4, seed=6)
    params = [SamplingParams(temperature=t, sampling_seed=1, presence_penalty=0.5)
              for t in (0.0, 0.5, 1.0, 1.7)]
    info = make_info(params, output_ids=[[1]] * 4)
    penalised = logits.clone()
    info.apply_logits_bias(penalised)
    out = Sampler()(logits.clone(), make_info(params, output_ids=[[1]] * 4), return_logprob=True)
    expected = torch.log_softmax(penalised, dim=-1).gather(1, out.next_token_ids.view(-1, 1)).view(-1)
    torch.testing.assert_close(out.logprobs, expected)


def test_top_logprobs_are_sorted_and_of_the_requested_length():
    logits = random_logits(3, seed=7)
    out = sample(logits, [SamplingParams() for _ in range(3)], return_logprob=True,
                 top_logprobs_nums=[5, 0, 2])
    lengths = [len(values) for values, _ in out.top_logprobs]
    assert lengths == [5, 0, 2]
    for row, (values, ids) in enumerate(out.top_logprobs):
        assert values == sorted(values, reverse=True)
        expected = torch.log_softmax(logits[row], dim=-1)[ids]
        torch.testing.assert_close(torch.tensor(values), expected)
        if ids:
            assert ids[0] == logits[row].argmax().item()


def test_token_ids_logprob_reports_requested_ids():
    logits = random_logits(2, seed=8)
    out = sample(logits, [SamplingParams(), SamplingParams()], return_logprob=True,
                 token_ids_logprob=[[3, 1], None])
    expected = torch.log_softmax(logits[0], dim=-1)[[3, 1]]
    torch.testing.assert_close(torch.tensor(out.token_ids_logprobs[0]), expected)
    assert out.token_ids_logprobs[1] == []


# ------------------------------------------------------ parameter checks
BAD_VALUES = [
    ("temperature", -0.5),
    ("temperature", float("inf")),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", 0),
    ("top_k", -2),
    ("min_p", 2),
    ("min_p", -0.1),
    ("frequency_penalty", 3),
    ("frequency_penalty", -2.5),
    ("presence_penalty", 2.5),
    ("repetition_penalty", 0),
    ("repetition_penalty", 2.5),
    ("max_new_tokens", -1),
    ("min_new_tokens", -1),
    ("min_new_tokens", 500),
    ("n", 0),
    ("temperature", "hot"),
    ("max_new_tokens", 1.5),
    ("ignore_eos", "yes"),
    ("sampling_seed", 1.5),
    ("stop", 5),
    ("stop_regex", "(unclosed"),
]


@pytest.mark.parametrize("name,value", BAD_VALUES, ids=[f"{n}={v!r}" for n, v in BAD_VALUES])
def test_bad_value_is_refused_naming_parameter_and_value(name, value):
    params = SamplingParams.from_dict({name: value})
    with pytest.raises(ValueError) as err:
        params.verify(VOCAB)
    message = str(err.value)
    assert message.startswith(name), message
    assert repr(value) in message or str(value) in message, message


def test_negative_stop_token_id_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"^stop_token_ids must hold token ids in \[0, vocab_size=32\), got -1"):
        SamplingParams(stop_token_ids=[3, -1]).verify(VOCAB)


@pytest.mark.parametrize("bias", [{"99": 1.0}, {"-1": 1.0}, {"abc": 1.0}])
def test_logit_bias_keys_outside_vocab_are_refused(bias):
    with pytest.raises(ValueError, match="logit_bias keys must be token ids in \\[0, vocab_size=32\\)"):
        SamplingParams(logit_bias=bias).verify(VOCAB)


def test_stop_token_id_outside_vocab_is_refused():
    with pytest.raises(ValueError, match="stop_token_ids.*got 32"):
        SamplingParams(stop_token_ids=[32]).verify(VOCAB)


def test_at_most_one_grammar_is_allowed():
    with pytest.raises(ValueError, match="regex, json_schema, ebnf and structural_tag.*got regex and json_schema"):
        SamplingParams(regex="a+", json_schema="{}").verify()


def test_unknown_field_is_refused_by_name():
    with pytest.raises(ValueError, match="Unknown sampling parameter 'foo'"):
        SamplingParams.from_dict({"temperature": 0.5, "foo": 1})


def test_explicit_nulls_and_empty_lists_mean_defaults():
    d = {name: None for name in SamplingParams.field_names()}
    d.update(stop=[], stop_token_ids=[], stop_regex=[])
    params = SamplingParams.from_dict(d)
    params.verify(VOCAB)
    params.normalize()
    assert params.max_new_tokens == 128 and params.temperature == 1.0 and params.top_k == -1
    assert params.stop == [] and params.stop_token_ids == [] and params.sampling_seed is None


def test_normalize_makes_lists_and_int_keys():
    params = SamplingParams(stop="###", stop_regex=r"\d+", logit_bias={"5": 1})
    params.verify(VOCAB)
    params.normalize()
    assert params.stop == ["###"] and params.stop_regex == [r"\d+"]
    assert params.logit_bias == {5: 1.0} and params.stop_str_max_len == 3


def test_top_k_disabled_means_whole_vocabulary():
    info = make_info([SamplingParams(top_k=-1), SamplingParams(top_k=10_000), SamplingParams(top_k=3)])
    assert info.top_ks.tolist() == [VOCAB, VOCAB, 3]
    assert info.need_top_k_sampling
