"""Stop strings end to end (issue 15, items 7 and 8): the scheduler finds a stop however many
tokens it spans, only an occurrence at or after `min_new_tokens` stops the request, and the
detokenizer trims the text at that occurrence, not at the first one."""

from __future__ import annotations

from typing import Dict, List

import pytest
from transformers import AutoTokenizer

from managers.detokenizer_manager import DetokenizerManager
from managers.finish_reason import FINISH_MATCHED_STR
from managers.io_struct import BatchTokenIDOut, DecodeParams
from managers.req import Req
from managers.scheduler import Scheduler
from model_utils import random_prompts
from scheduler_utils import Harness
from srt.sampling.sampling_params import SamplingParams

FORCE = 100.0  # a logit bias that makes greedy decoding emit one chosen token every step


@pytest.fixture(scope="module")
def tok(llama_model):
    return AutoTokenizer.from_pretrained(llama_model)


def single_token(tok, text: str) -> int:
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 1 and tok.decode(ids) == text, f"{text!r} must be one token of the tiny tokenizer"
    return ids[0]


def harness(llama_model, tok, **kw) -> Harness:
    """An in-process scheduler that checks stop strings (it needs the tokenizer)."""
    h = Harness(llama_model, **kw)
    h.sched = Scheduler(h.args, h.runner, tokenizer=tok, send=h.outbox.append)
    return h


def detokenized(h: Harness, tok) -> Dict[str, List[str]]:
    """Every update's text per rid, through a detokenizer fed the scheduler's messages in order."""
    detok, texts = DetokenizerManager(tok), {}
    for msg in h.outbox:
        if isinstance(msg, BatchTokenIDOut):
            out = detok.handle_batch_token_id_out(msg)
            for rid, offset, piece in zip(out.rids, out.text_offsets, out.texts):  # pieces: rebuild the text
                seen = texts.setdefault(rid, [])
                text = seen[-1] if seen else ""
                assert offset == len(text), f"{rid}: a text piece at {offset} after {len(text)} characters"
                seen.append(text + piece)
    return texts


def prompt():
    return random_prompts(1000, [10], seed=31)[0]


# -- item 8: the tail decoded for the check is bounded in characters, not in the stop's tokens ------

def test_long_stop_string_emitted_one_character_per_token_is_found(tok):
    stop = "abcdefghijklmnopqrst"
    assert len(tok.encode(stop, add_special_tokens=False)) < len(stop)  # the stop alone merges
    sp = SamplingParams(max_new_tokens=100, stop=stop)
    sp.normalize(tok)
    req = Req("r", [1, 2, 3], sp)
    for i, ch in enumerate("xx" + stop):
        req.output_ids.append(single_token(tok, ch))
        req.check_finished(tok)
        assert req.finished() == (i == len(stop) + 1)
    assert req.finished_reason == FINISH_MATCHED_STR(stop)


def test_stop_of_twenty_characters_from_two_tokens_stops_a_request(llama_model, tok):
    dash = single_token(tok, "-")
    stop = "-" * 20
    assert len(tok.encode(stop, add_special_tokens=False)) <= 2
    h = harness(llama_model, tok)
    h.submit("d", prompt(), max_new_tokens=40, temperature=0, ignore_eos=True, stop=stop,
             logit_bias={dash: FORCE})
    out = h.run()["d"]
    assert out["finish"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == [dash] * 20
    assert detokenized(h, tok)["d"][-1] == ""
    h.assert_conserved()


def test_multibyte_stop_split_across_byte_tokens_is_found(tok):
    stop = "é" * 6
    byte_ids = tok.encode("é", add_special_tokens=False)
    assert len(byte_ids) == 2  # one character, two byte-level tokens
    sp = SamplingParams(max_new_tokens=100, stop=stop)
    sp.normalize(tok)
    req = Req("r", [1, 2, 3], sp)
    for _ in range(6):
        for t in byte_ids:
            req.output_ids.append(t)
            req.check_finished(tok)
    assert req.finished_reason == FINISH_MATCHED_STR(stop) and len(req.output_ids) == 12


# -- item 7: min_new_tokens and the occurrence that stopped the request ---------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_min_new_tokens_with_a_stop_trims_at_the_stopping_occurrence(llama_model, tok, stream):
    x = single_token(tok, "X")
    h = harness(llama_model, tok)
    h.submit("m", prompt(), max_new_tokens=40, min_new_tokens=10, temperature=0, ignore_eos=True,
             stop="X", logit_bias={x: FORCE}, stream=stream)
    out = h.run()["m"]
    assert out["finish"] == {"type": "stop", "matched": "X"}
    assert len(out["output_ids"]) == 10  # the 10th X is the first that may stop it
    texts = detokenized(h, tok)["m"]
    assert texts[-1] == "X" * 9  # every ignored X is kept; the stopping one is trimmed
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # streamed text never shrinks
    if stream:
        assert texts[-2] == "X" * 9  # the ignored stops were streamed, not held back to the end
    h.assert_conserved()


def test_a_stop_seen_before_min_new_tokens_does_not_stop_the_request_later(tok):
    """The stop ends at token 5 of 6 (ignored) and again later: only the late one stops it."""
    sp = SamplingParams(max_new_tokens=100, min_new_tokens=6, stop="ab")
    sp.normalize(tok)
    req = Req("r", [1, 2, 3], sp)
    for i, ch in enumerate("xxxabyyab"):
        req.output_ids.append(single_token(tok, ch))
        req.check_finished(tok)
        assert req.finished() == (i == 8), i


def _stopped(ids: List[int], matched: str, from_end, params: DecodeParams) -> BatchTokenIDOut:
    return BatchTokenIDOut(rids=["r"], output_ids=[ids], finished_reasons=[{"type": "stop", "matched": matched}],
                           meta_info=[{"id": "r"}], decode_params=[params], input_tail_ids=[[]],
                           stop_str_from_end=[from_end])


def test_detokenizer_trims_at_the_position_the_scheduler_reports(tok):
    ids = tok.encode("aXbXcX.", add_special_tokens=False)
    out = DetokenizerManager(tok).handle_batch_token_id_out(_stopped(ids, "X", 4, DecodeParams(stop=["X"])))
    assert out.texts == ["aXb"]


def test_detokenizer_without_a_position_trims_at_the_last_occurrence(tok):
    ids = tok.encode("aXbXcX", add_special_tokens=False)
    out = DetokenizerManager(tok).handle_batch_token_id_out(_stopped(ids, "X", None, DecodeParams(stop=["X"])))
    assert out.texts == ["aXbXc"]
