"""The in-process Engine over real subprocesses: round trips, streaming, logprobs, n > 1, stops."""

from __future__ import annotations

import asyncio

import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from srt.entrypoints.engine import Engine

ENGINE_KW = dict(dtype="float32", device="cpu", max_total_tokens=65536)


@pytest.fixture(scope="module")
def engine(llama_model):
    eng = Engine(model_path=str(llama_model), **ENGINE_KW)
    yield eng
    eng.shutdown()


def hf_greedy_text(path, prompt, max_new):
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok(prompt)["input_ids"]
    eos = {2, 0}
    out = []
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
            out.append(nxt)
            if nxt in eos:
                break
    return out, tok.decode(out, skip_special_tokens=True)


def test_greedy_text_matches_hf(engine, llama_model):
    prompt = "The licensee may copy and distribute"
    res = engine.generate(prompt, {"max_new_tokens": 16, "temperature": 0})
    ids, text = hf_greedy_text(llama_model, prompt, 16)
    assert res["output_ids"] == ids
    assert res["text"] == text
    meta = res["meta_info"]
    assert meta["completion_tokens"] == len(ids) and meta["prompt_tokens"] > 0
    assert meta["finish_reason"]["type"] in ("length", "stop")


def test_batch_prompts_and_input_ids(engine):
    outs = engine.generate(["Hello world", "Copyright (C)"], {"max_new_tokens": 5, "temperature": 0})
    assert isinstance(outs, list) and len(outs) == 2
    single = engine.generate("Copyright (C)", {"max_new_tokens": 5, "temperature": 0})
    assert outs[1]["output_ids"] == single["output_ids"]
    tok = AutoTokenizer.from_pretrained(engine.server_args.tokenizer_path)
    by_ids = engine.generate(input_ids=tok("Copyright (C)")["input_ids"],
                             sampling_params={"max_new_tokens": 5, "temperature": 0})
    assert by_ids["output_ids"] == single["output_ids"]


def test_streaming_is_cumulative_and_ends_like_non_stream(engine):
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    final = engine.generate("Permission is hereby granted", params)
    updates = list(engine.generate("Permission is hereby granted", params, stream=True))
    assert len(updates) >= 2
    for a, b in zip(updates, updates[1:]):
        assert b["text"].startswith(a["text"])
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert updates[-1]["text"] == final["text"] and updates[-1]["output_ids"] == final["output_ids"]


def test_logprobs_one_per_output_token(engine):
    res = engine.generate("GNU GENERAL PUBLIC LICENSE", {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
                          return_logprob=True, top_logprobs_num=3, logprob_start_len=0)
    meta = res["meta_info"]
    assert len(meta["output_token_logprobs"]) == 6
    assert [e[1] for e in meta["output_token_logprobs"]] == res["output_ids"]
    assert all(e[0] <= 0 for e in meta["output_token_logprobs"])
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert meta["input_token_logprobs"][0][0] is None


def test_n_samples(engine):
    outs = engine.generate("In the beginning", {"max_new_tokens": 8, "temperature": 1.0, "n": 3,
                                                "sampling_seed": 11, "ignore_eos": True})
    assert len(outs) == 3 and len({tuple(o["output_ids"]) for o in outs}) > 1
    greedy = engine.generate("In the beginning", {"max_new_tokens": 8, "temperature": 0, "n": 2, "ignore_eos": True})
    assert greedy[0]["output_ids"] == greedy[1]["output_ids"]


def test_stop_strings_trimmed_and_no_stop_trim(engine):
    base = engine.generate("This program is free software", {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True})
    text = base["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert len(stop) == 3 and stop.strip()
    cut = engine.generate("This program is free software",
                          {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True, "stop": [stop]})
    assert cut["text"] == text[: text.index(stop)]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = engine.generate("This program is free software",
                           {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True, "stop": [stop], "no_stop_trim": True})
    assert kept["text"].startswith(text[: text.index(stop)] + stop)


def test_async_generate_inside_running_loop(engine):
    async def main():
        res = await engine.async_generate("Hello", {"max_new_tokens": 4, "temperature": 0})
        chunks = [c async for c in await engine.async_generate("Hello", {"max_new_tokens": 4, "temperature": 0},
                                                                stream=True)]
        blocking = engine.generate("Hello", {"max_new_tokens": 4, "temperature": 0})  # from inside a loop
        return res, chunks, blocking

    res, chunks, blocking = asyncio.run(main())
    assert chunks[-1]["output_ids"] == res["output_ids"] == blocking["output_ids"]


def test_flush_cache_and_cached_tokens(engine):
    first = engine.generate("A repeated prompt for caching", {"max_new_tokens": 2, "temperature": 0})
    again = engine.generate("A repeated prompt for caching", {"max_new_tokens": 2, "temperature": 0})
    assert again["meta_info"]["cached_tokens"] == first["meta_info"]["prompt_tokens"] - 1
    assert engine.flush_cache().success
    after = engine.generate("A repeated prompt for caching", {"max_new_tokens": 2, "temperature": 0})
    assert after["meta_info"]["cached_tokens"] == 0


def test_unimplemented_and_out_of_range_fields_are_refused_not_ignored(engine):
    from managers.generate_input import RequestError

    with pytest.raises(RequestError, match="sampling_params.regex does not compile"):
        engine.generate("Hello", {"max_new_tokens": 2, "regex": "[a-z"})
    out = engine.generate("Hello", {"max_new_tokens": 6, "regex": "[a-z]{3}", "temperature": 1.0})
    assert re.fullmatch("[a-z]{3}", out["text"]), out["text"]
    with pytest.raises(RequestError, match=r"logprob_start_len \(99\) must be smaller than the input length"):
        engine.generate("Hello", {"max_new_tokens": 2}, return_logprob=True, logprob_start_len=99)
