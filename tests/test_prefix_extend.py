"""Extending on top of a cached prefix gives the logits of prefilling the whole prompt."""

from __future__ import annotations

import pytest
import torch

from model_utils import assert_pool_conserved, make_runner, random_prompts
from srt.model_executor.static_batch import StaticBatch


@pytest.mark.parametrize("page_size", [1, 16])
def test_second_half_on_cached_first_half_equals_whole_prefill(llama_model, page_size):
    runner = make_runner(llama_model, page_size=page_size)
    prompts = random_prompts(runner.model_config.vocab_size, (37, 50, 21), seed=3)

    whole = StaticBatch(runner, len(prompts))
    ref = whole.extend(prompts).next_token_logits
    whole.release()

    split = StaticBatch(runner, len(prompts))
    halves = [len(p) // 2 for p in prompts]
    split.extend([p[:h] for p, h in zip(prompts, halves)])
    got = split.extend([p[h:] for p, h in zip(prompts, halves)]).next_token_logits
    split.release()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert_pool_conserved(runner)


def test_mixed_batch_of_cached_and_fresh_requests(qwen2_model):
    """One EXTEND where request 0 has a cached prefix and request 1 has none."""
    runner = make_runner(qwen2_model, page_size=4)
    a, b = random_prompts(runner.model_config.vocab_size, (30, 11), seed=4)
    ref = StaticBatch(runner, 2)
    ref_logits = ref.extend([a, b]).next_token_logits
    ref.release()

    batch = StaticBatch(runner, 2)
    batch.extend([a[:13]], which=[0])
    got = batch.extend([a[13:], b], which=[0, 1]).next_token_logits
    batch.release()
    torch.testing.assert_close(got, ref_logits, rtol=1e-5, atol=1e-5)
    assert_pool_conserved(runner)
