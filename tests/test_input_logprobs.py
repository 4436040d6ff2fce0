"""Prompt logprobs on native `/generate` (through an in-process Engine): `input_token_logprobs`
and `input_top_logprobs` against HF transformers' own log-softmax, over a prompt longer than one
log-softmax chunk, SGLang's `logprob_start_len = -1` shape, and n > 1 children keeping
`token_ids_logprob`."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from managers.scheduler_output import INPUT_LOGPROB_CHUNK
from srt.entrypoints.engine import Engine

K = 3


@pytest.fixture(scope="module")
def setup(llama_model):
    hf = AutoModelForCausalLM.from_pretrained(str(llama_model), torch_dtype=torch.float32).eval()
    engine = Engine(model_path=str(llama_model), dtype="float32", device="cpu", max_total_tokens=8192,
                    chunked_prefill_size=-1)
    try:
        yield hf, engine
    finally:
        engine.shutdown()


def hf_logprobs(hf, ids):
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_input_top_logprobs_match_transformers_over_more_than_one_chunk(setup):
    hf, engine = setup
    n = INPUT_LOGPROB_CHUNK + 100
    ids = [(7 * i + 3) % 200 + 10 for i in range(n)]
    start = 5
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
                          return_logprob=True, logprob_start_len=start, top_logprobs_num=K)
    meta = out["meta_info"]
    ref = hf_logprobs(hf, ids)
    tokens, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert len(tokens) == len(tops) == n - start
    assert tokens[0][0] is None and tops[0] is None and tokens[0][1] == ids[start]
    for j in range(1, n - start):
        pos = start + j  # entry j scores token ids[pos] from the row at pos - 1
        assert tokens[j][1] == ids[pos]
        assert tokens[j][0] == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4)
        vals, idx = ref[pos - 1].topk(K)
        assert [t[1] for t in tops[j]] == idx.tolist()
        assert [t[0] for t in tops[j]] == pytest.approx(vals.tolist(), abs=1e-4)


def test_minus_one_start_gives_sglangs_single_last_token_entry(setup):
    _, engine = setup
    ids = [11, 12, 13, 14]
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 2, "temperature": 0},
                          return_logprob=True, top_logprobs_num=2)
    meta = out["meta_info"]
    assert [e[:2] for e in meta["input_token_logprobs"]] == [[None, 14]]
    assert meta["input_top_logprobs"] == [None]
    assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == 2


def test_start_at_the_last_prompt_token_scores_nothing_and_serves(setup):
    _, engine = setup
    out = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2, "temperature": 0},
                          return_logprob=True, logprob_start_len=2, top_logprobs_num=2)
    assert [e[:2] for e in out["meta_info"]["input_token_logprobs"]] == [[None, 7]]
    assert out["meta_info"]["input_top_logprobs"] == [None]
    assert engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 1})["meta_info"]["completion_tokens"] == 1


def test_n_children_keep_token_ids_logprob(setup):
    _, engine = setup
    outs = engine.generate(input_ids=[21, 22, 23], sampling_params={"max_new_tokens": 3, "n": 2, "temperature": 1.0},
                           return_logprob=True, token_ids_logprob=[5, 6])
    assert len(outs) == 2
    for out in outs:
        per_token = out["meta_info"]["output_token_ids_logprobs"]
        assert len(per_token) == 3 and all([e[1] for e in step] == [5, 6] for step in per_token)
    load = engine.get_load()
    assert load.num_running_reqs == 0 and load.token_usage == 0.0
