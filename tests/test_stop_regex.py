"""`stop_regex` on RE2: catastrophic patterns cost linear time on a bounded tail, RE2's matches
agree with Python's `re` wherever both accept the pattern, unsupported patterns are refused by name,
and the scheduler's per-request step budget aborts a request whose own work is too slow."""

from __future__ import annotations

import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from managers.finish_reason import FINISH_ABORT, FINISH_LENGTH, FINISH_MATCHED_STR
from managers.req import Req
from managers.scheduler_output import take_token
from scheduler_utils import Harness
from managers.scheduler import Scheduler
from model_utils import random_prompts
from srt.sampling.sampling_params import SamplingParams
from srt.sampling.stop_regex import STOP_REGEX_TAIL_TOKENS, StopRegexError, compile_stop_regex, tail_tokens

FORCE = 100.0
CATASTROPHIC = ["(a+)+b", "(a|aa)+$", "(.*a){20}$", "((a*)*)*b", "(a|a?)+c"]


@pytest.fixture(scope="module")
def tok(llama_model):
    return AutoTokenizer.from_pretrained(llama_model)


def single_token(tok, text: str) -> int:
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 1 and tok.decode(ids) == text
    return ids[0]


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode received."""

    def __init__(self, tok, delay_s: float = 0.0):
        self.tok, self.sizes, self.delay_s = tok, [], delay_s

    def __getattr__(self, name):  # everything but decode is the real tokenizer's
        return getattr(self.tok, name)

    def decode(self, ids, **kw):
        self.sizes.append(len(ids))
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.tok.decode(ids, **kw)


# -- compile: what RE2 refuses is refused by name --------------------------------------------------

@pytest.mark.parametrize("pattern", [r"(a)\1", r"(?=a)b", r"(?<!x)y", r"a{2000}{2000}"])
def test_patterns_re2_cannot_run_are_refused_naming_stop_regex(pattern):
    with pytest.raises(StopRegexError):
        compile_stop_regex(pattern)
    sp = SamplingParams(stop_regex=pattern)
    with pytest.raises(ValueError, match=r"^stop_regex must be a regular expression RE2 can compile"):
        sp.verify()


def test_tail_bound_follows_the_longest_match():
    assert tail_tokens("abc") == 12  # three characters, up to four tokens each
    assert tail_tokens(r"\d{1,3}\.") == 16
    assert tail_tokens("(a+)+b") == STOP_REGEX_TAIL_TOKENS  # unbounded
    assert tail_tokens("x" * 500) == STOP_REGEX_TAIL_TOKENS  # bounded, but past the cap


# -- RE2 agrees with Python's re -------------------------------------------------------------------

_atoms = st.sampled_from(["a", "b", "ab", ".", "[ab]", "a*", "b+", "(a|b)", "a?", "(ab)*", r"\d", "c"])
_patterns = st.lists(_atoms, min_size=1, max_size=6).map("".join)
_texts = st.text(alphabet="abc12", max_size=30)


@settings(max_examples=300, deadline=None)
@given(_patterns, _texts)
def test_re2_search_matches_python_re(pattern, text):
    ours = compile_stop_regex(pattern).search(text)
    oracle = re.search(pattern, text)
    assert (ours is None) == (oracle is None)
    if oracle is not None:
        assert (ours.start(), ours.end(), ours.group(0)) == (oracle.start(), oracle.end(), oracle.group(0))


def test_re2_positions_are_characters_in_non_ascii_text():
    m = compile_stop_regex("é+x").search("ab éééx")
    assert (m.start(), m.end(), m.group(0)) == (3, 7, "éééx")


# -- the check itself: bounded text, linear engine -------------------------------------------------

@pytest.mark.parametrize("pattern", CATASTROPHIC)
def test_catastrophic_pattern_with_a_long_stop_string_sees_only_its_own_tail(tok, pattern):
    """A 3,000-character stop string costs a step a decode of the newest tokens (its text is kept
    incrementally), and never widens the regex's bounded tail."""
    a = single_token(tok, "a")
    sp = SamplingParams(max_new_tokens=4000, stop=["z" * 3000], stop_regex=pattern)
    sp.normalize(tok)
    req = Req("r", [1, 2, 3], sp)
    counting = CountingTokenizer(tok)
    steps = []
    while len(req.output_ids) < 3500 and not req.finished():
        req.output_ids.append(a)
        counting.sizes.clear()
        req.check_finished(counting)
        steps.append(list(counting.sizes))
    matches_a_run = compile_stop_regex(pattern).search("a" * 50) is not None
    assert req.finished() == matches_a_run
    if matches_a_run:
        assert isinstance(req.finished_reason, FINISH_MATCHED_STR) and len(req.output_ids) < 100
        return
    # Steady state: one and two tokens for the stop strings, then the regex's tail and its "before".
    assert all(sizes == [1, 2, STOP_REGEX_TAIL_TOKENS + 2, STOP_REGEX_TAIL_TOKENS + 1] for sizes in steps[100:]), steps[100]
    assert len(req._stop_window.text) == 3000  # the stop's length - 1 characters before the newest one


def test_a_match_must_end_in_the_newest_token(tok):
    sp = SamplingParams(max_new_tokens=100, stop_regex=r"x\d")
    sp.normalize(tok)
    req = Req("r", [1, 2, 3], sp)
    for i, ch in enumerate("ax1bbbx2"):
        req.output_ids.append(single_token(tok, ch))
        req.check_finished(tok)
        assert req.finished() == (i in (2,)), i
        if req.finished():
            break
    assert req.finished_reason == FINISH_MATCHED_STR("x1")


def test_stop_strings_win_over_regexes_in_one_step(tok):
    sp = SamplingParams(max_new_tokens=100, stop="bc", stop_regex="abc")
    sp.normalize(tok)
    req = Req("r", [1, 2, 3], sp)
    for ch in "abc":
        req.output_ids.append(single_token(tok, ch))
        req.check_finished(tok)
    assert req.finished_reason == FINISH_MATCHED_STR("bc")


# -- the per-request step budget --------------------------------------------------------------------

class _Sample:
    logprobs = None


def test_step_budget_aborts_a_request_whose_own_work_is_too_slow(tok):
    sp = SamplingParams(max_new_tokens=100, stop="never")
    sp.normalize(tok)
    slow, fast = Req("slow", [1, 2], sp), Req("fast", [1, 2], SamplingParams(max_new_tokens=100))
    take_token(slow, 0, single_token(tok, "a"), _Sample(), CountingTokenizer(tok, delay_s=0.02), budget_s=0.005)
    take_token(fast, 1, single_token(tok, "a"), _Sample(), tok, budget_s=0.005)
    assert isinstance(slow.finished_reason, FINISH_ABORT) and slow.finished_reason.status_code == 400
    assert "--request-step-budget-ms" in slow.finished_reason.message
    assert fast.finished_reason is None


def test_step_budget_zero_never_aborts(tok):
    sp = SamplingParams(max_new_tokens=100, stop="never")
    sp.normalize(tok)
    req = Req("slow", [1, 2], sp)
    take_token(req, 0, single_token(tok, "a"), _Sample(), CountingTokenizer(tok, delay_s=0.01), budget_s=0.0)
    assert req.finished_reason is None


def test_scheduler_aborts_only_the_slow_request_and_serves_the_rest(llama_model, tok):
    """In the scheduler loop: a request whose stop check is slow is aborted; the others finish, and
    every KV slot comes back."""
    h = Harness(llama_model, request_step_budget_ms=5.0)
    h.sched = Scheduler(h.args, h.runner, tokenizer=CountingTokenizer(tok, delay_s=0.02), send=h.outbox.append)
    prompts = random_prompts(1000, [12, 12, 12], seed=5)
    h.submit("evil", prompts[0], max_new_tokens=30, temperature=0, ignore_eos=True, stop="never")
    for i, p in enumerate(prompts[1:]):
        h.submit(f"ok{i}", p, max_new_tokens=30, temperature=0, ignore_eos=True)
    out = h.run()
    assert out["evil"]["finish"]["type"] == "abort"
    assert "--request-step-budget-ms" in out["evil"]["finish"]["message"]
    assert len(out["evil"]["output_ids"]) == 1
    for i in range(2):
        assert out[f"ok{i}"]["finish"] == FINISH_LENGTH(30).to_json()
        assert len(out[f"ok{i}"]["output_ids"]) == 30
    h.assert_conserved()


# -- the incremental stop-string window against a whole-output decode -----------------------------

def _oracle_stop_step(tok, ids, stops):
    """The first step whose newest token ends an occurrence, found by decoding the whole output."""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n], skip_special_tokens=False)
        before = len(tok.decode(ids[: n - 1], skip_special_tokens=False).rstrip("\ufffd"))
        hits = [(text.find(s, max(0, before - len(s) + 1)), s) for s in stops]
        hits = [(p, s) for p, s in hits if p != -1]
        if hits:
            p, s = min(hits)
            return n, s, len(text) - p
    return None


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 1023), min_size=1, max_size=40), st.data())
def test_incremental_window_finds_what_a_whole_decode_finds(tok, ids, data):
    text = tok.decode(ids, skip_special_tokens=False)
    stops = [s for s in data.draw(st.lists(st.text(alphabet=text or "x", min_size=1, max_size=6), min_size=1,
                                           max_size=3)) if "\ufffd" not in s] or ["\x00never"]
    sp = SamplingParams(max_new_tokens=100, stop=stops)
    sp.normalize(tok)
    req = Req("r", [1], sp)
    got = None
    for n, t in enumerate(ids, start=1):
        req.output_ids.append(t)
        req._check_stop_strings(tok)
        if req.finished():
            got = (n, req.finished_reason.matched, req.finished_reason.from_end)
            break
    assert got == _oracle_stop_step(tok, ids, stops)
