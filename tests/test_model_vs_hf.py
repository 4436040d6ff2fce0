"""Our paged runtime vs HF transformers on the same weights: greedy tokens and logits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from model_utils import assert_pool_conserved, greedy_run, make_runner, random_prompts

ARCH_FIXTURES = ["llama_model", "qwen2_model", "qwen3_model", "mistral_model"]
LENGTHS = (3, 17, 9, 31, 1, 24, 12, 40)


def hf_greedy(hf, prompt, n):
    """Greedy tokens by full recomputation each step (no cache, no eos): the plainest oracle."""
    ids = list(prompt)
    first = None
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1]
            first = logits if first is None else first
            ids.append(int(logits.argmax()))
    return first, ids[len(prompt):]


@pytest.mark.parametrize("fixture", ARCH_FIXTURES)
def test_batch_extend_then_decode_matches_hf_greedy(fixture, request):
    path = request.getfixturevalue(fixture)
    runner = make_runner(path)
    prompts = random_prompts(runner.model_config.vocab_size, LENGTHS, seed=1)
    toks, first_logits = greedy_run(runner, prompts, steps=16)

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        ref_logits, ref = hf_greedy(hf, prompt, 17)
        assert toks[i] == ref, f"request {i} (len {len(prompt)}) diverged from HF"
        rel = (ref_logits - first_logits[i]).abs().max() / ref_logits.abs().max()
        assert rel < 1e-4, f"request {i}: last-position logits differ by {rel:.2e} (relative)"
    assert_pool_conserved(runner)


def test_input_logits_cover_requested_range(llama_model):
    runner = make_runner(llama_model)
    prompts = random_prompts(runner.model_config.vocab_size, (10, 6), seed=2)
    from srt.model_executor.static_batch import StaticBatch

    batch = StaticBatch(runner, 2)
    out = batch.extend(prompts, logprob_starts=[4, 0])
    batch.release()
    assert out.input_token_logits_lens == [6, 6]
    hf = AutoModelForCausalLM.from_pretrained(llama_model, dtype=torch.float32).eval()
    with torch.no_grad():
        ref0 = hf(torch.tensor([prompts[0]])).logits[0, 4:]
    torch.testing.assert_close(out.input_token_logits[:6], ref0, rtol=1e-4, atol=1e-4)
    assert_pool_conserved(runner)
