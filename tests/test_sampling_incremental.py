"""The running batch's sampling state is kept up to date by filter/merge/cumulate, never rebuilt,
and always equals what a from-scratch build would give."""

from __future__ import annotations

import random
from typing import List, Optional, Set

import pytest
import torch

from managers.schedule_batch import ScheduleBatch
from model_utils import random_prompts
from scheduler_utils import Harness
from srt.sampling import SamplingBatchInfo, SamplingParams

VOCAB = 64
ROW_TENSORS = ("temperatures", "top_ps", "top_ks", "min_ps", "greedy_mask", "seeds", "has_seed",
               "output_lens", "logit_bias", "min_new_tokens", "stop_token_mask")
FLAGS = ("is_all_greedy", "need_top_p_sampling", "need_top_k_sampling", "need_min_p_sampling", "any_seeded")


def assert_same_state(got: SamplingBatchInfo, want: SamplingBatchInfo) -> None:
    """Every tensor, flag and row group of `got` equals `want`'s (penalty counts included)."""
    for name in ROW_TENSORS:
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), f"{name}: {a} vs {b}"
        assert a is None or torch.equal(a, b), name
    assert [getattr(got, f) for f in FLAGS] == [getattr(want, f) for f in FLAGS]
    assert (got.penalties is None) == (want.penalties is None)
    if want.penalties is not None:
        for name in ("frequency_penalties", "presence_penalties", "repetition_penalties",
                     "output_counts", "count_weights"):
            assert torch.equal(getattr(got.penalties, name), getattr(want.penalties, name)), name
        assert (got.penalties.need_additive, got.penalties.need_repetition) == (
            want.penalties.need_additive, want.penalties.need_repetition)
    for path in ("truncated", "plain"):
        a, b = getattr(got.groups, path), getattr(want.groups, path)
        assert (a is None) == (b is None), path
        if a is not None:
            assert (a.candidates, a.need_top_p, a.need_min_p) == (b.candidates, b.need_top_p, b.need_min_p)
            assert (a.rows is None) == (b.rows is None) and (a.rows is None or torch.equal(a.rows, b.rows))
            for name in ("temperatures", "top_ks", "top_ps", "min_ps"):
                assert torch.equal(getattr(a, name), getattr(b, name)), f"{path}.{name}"
    assert got.groups.any_greedy == want.groups.any_greedy


def random_params(rng: random.Random) -> SamplingParams:
    kind = rng.choice(["greedy", "temperature", "top_k", "top_p", "both", "min_p"])
    p = SamplingParams(
        temperature=0.0 if kind == "greedy" else rng.choice([0.5, 1.0, 1.3]),
        top_k=rng.choice([2, 5, 40]) if kind in ("top_k", "both") else -1,
        top_p=rng.choice([0.5, 0.9]) if kind in ("top_p", "both") else 1.0,
        min_p=0.1 if kind == "min_p" else 0.0,
        sampling_seed=rng.choice([None, rng.randrange(1000)]),
    )
    if rng.random() < 0.4:
        p.frequency_penalty, p.presence_penalty = rng.choice([(0.5, 0.0), (0.0, 0.3), (0.4, 0.2)])
    if rng.random() < 0.3:
        p.repetition_penalty = 1.3
    if rng.random() < 0.3:
        p.logit_bias = {rng.randrange(VOCAB): 2.0}
    if rng.random() < 0.3:
        p.min_new_tokens, p.max_new_tokens, p.stop_token_ids = rng.randrange(1, 6), 16, [rng.randrange(VOCAB)]
    p.verify(VOCAB)
    p.normalize()
    return p


class Mirror:
    """The batch as plain Python lists: what a from-scratch build is made from."""

    def __init__(self) -> None:
        self.params: List[SamplingParams] = []
        self.outputs: List[List[int]] = []
        self.stops: List[Optional[Set[int]]] = []

    def add(self, rng: random.Random, n: int) -> SamplingBatchInfo:
        params = [random_params(rng) for _ in range(n)]
        outputs = [[rng.randrange(VOCAB) for _ in range(rng.randrange(4))] for _ in range(n)]
        stops = [{0} for _ in range(n)]
        self.params += params
        self.outputs += outputs
        self.stops += stops
        return SamplingBatchInfo.from_params(params, VOCAB, "cpu", output_ids=outputs, stop_token_ids=stops)

    def keep(self, rows: List[int]) -> None:
        self.params = [self.params[i] for i in rows]
        self.outputs = [self.outputs[i] for i in rows]
        self.stops = [self.stops[i] for i in rows]

    def rebuild(self) -> SamplingBatchInfo:
        return SamplingBatchInfo.from_params(self.params, VOCAB, "cpu", output_ids=self.outputs,
                                             stop_token_ids=self.stops)


@pytest.mark.parametrize("seed", range(6))
def test_merges_filters_and_steps_equal_a_rebuild(seed):
    rng = random.Random(seed)
    mirror = Mirror()
    info = mirror.add(rng, 3)
    for _ in range(40):
        op = rng.choice(["step", "step", "filter", "merge"])
        if op == "step":
            tokens = [rng.randrange(VOCAB) for _ in mirror.params]
            for out, t in zip(mirror.outputs, tokens):
                out.append(t)
            info.cumulate_output_tokens(torch.tensor(tokens, dtype=torch.int64))
        elif op == "filter":
            rows = rng.sample(range(len(mirror.params)), rng.randrange(len(mirror.params) + 1))
            mirror.keep(rows)
            info.filter_batch(rows)
        else:
            info.merge_batch(mirror.add(rng, rng.randrange(1, 4)))
        assert_same_state(info, mirror.rebuild())
        logits_a = torch.randn(len(mirror.params), VOCAB, generator=torch.Generator().manual_seed(seed))
        logits_b = logits_a.clone()
        info.apply_logits_bias(logits_a)
        mirror.rebuild().apply_logits_bias(logits_b)
        assert torch.equal(logits_a, logits_b)


def test_penalty_state_is_dropped_when_the_last_penalised_request_leaves():
    params = [SamplingParams(frequency_penalty=0.5), SamplingParams(logit_bias={3: 1.0}), SamplingParams()]
    info = SamplingBatchInfo.from_params(params, VOCAB, "cpu", output_ids=[[1], [2], [3]])
    assert info.penalties is not None and info.logit_bias is not None
    info.filter_batch([2])
    assert info.penalties is None and info.logit_bias is None


def test_unpenalised_rows_count_nothing():
    params = [SamplingParams(presence_penalty=0.5), SamplingParams()]
    info = SamplingBatchInfo.from_params(params, VOCAB, "cpu", output_ids=[[4, 4], [5]])
    info.cumulate_output_tokens(torch.tensor([6, 7]))
    counts = info.penalties.output_counts
    assert counts[0, 4] == 2 and counts[0, 6] == 1 and counts[1].sum() == 0


# ------------------------------------------------------------------ through the scheduler
def _workload(h: Harness, vocab: int) -> None:
    """Requests that join and leave at different steps, with penalties, bias and min_new_tokens."""
    prompts = random_prompts(vocab, [5, 9, 7, 12, 6, 8, 10], seed=31)
    kinds = [
        dict(temperature=0, frequency_penalty=0.6, presence_penalty=0.2),
        dict(temperature=0.9, top_k=20, top_p=0.9, sampling_seed=3, repetition_penalty=1.3),
        dict(temperature=0, logit_bias={7: 3.0}, min_new_tokens=4),
        dict(temperature=1.1, sampling_seed=8, min_p=0.05, frequency_penalty=0.3),
        dict(temperature=0),
        dict(temperature=0.7, top_p=0.8, sampling_seed=12, presence_penalty=0.5),
        dict(temperature=0, repetition_penalty=1.5, top_k=1),
    ]
    lengths = [9, 4, 13, 6, 3, 11, 7]
    for wave in ((0, 1, 2), (3, 4), (5, 6)):
        for i in wave:
            h.submit(f"r{i}", prompts[i], max_new_tokens=lengths[i], ignore_eos=True, **kinds[i])
        for _ in range(4):
            h.sched.step()


def test_running_batch_state_equals_a_rebuild_at_every_decode_step(llama_model, monkeypatch):
    h = Harness(llama_model)
    original = ScheduleBatch.prepare_for_decode
    seen = {"steps": 0, "reused": 0, "previous": None}

    def checked(batch, *args, **kwargs):
        fb = original(batch, *args, **kwargs)
        assert_same_state(fb.sampling_info, batch._sampling_info())
        seen["steps"] += 1
        seen["reused"] += fb.sampling_info is seen["previous"]
        seen["previous"] = fb.sampling_info
        return fb

    monkeypatch.setattr(ScheduleBatch, "prepare_for_decode", checked)
    _workload(h, h.runner.model_config.vocab_size)
    h.run()
    assert seen["steps"] > 10
    assert seen["reused"] == seen["steps"] - 1, "joins and leaves must update the state, not rebuild it"
    h.assert_conserved()


def test_outputs_equal_those_of_rebuilding_every_step(llama_model, monkeypatch):
    runs = []
    for rebuild in (False, True):
        if rebuild:
            monkeypatch.setattr(ScheduleBatch, "_advance_sampling_info", lambda self, last_tokens: None)
        h = Harness(llama_model)
        _workload(h, h.runner.model_config.vocab_size)
        runs.append({rid: f["output_ids"] for rid, f in h.run().items()})
        h.assert_conserved()
    assert runs[0] == runs[1]
    assert len(runs[0]) == 7


def test_retracted_requests_rejoin_with_their_state(llama_model, monkeypatch):
    monkeypatch.setenv("SRT_TEST_RETRACT_INTERVAL", "3")
    h = Harness(llama_model)
    original = ScheduleBatch.prepare_for_decode

    def checked(batch, *args, **kwargs):
        fb = original(batch, *args, **kwargs)
        assert_same_state(fb.sampling_info, batch._sampling_info())
        return fb

    monkeypatch.setattr(ScheduleBatch, "prepare_for_decode", checked)
    _workload(h, h.runner.model_config.vocab_size)
    h.run()
    assert h.sched.stats["num_retractions"] > 0
    h.assert_conserved()
