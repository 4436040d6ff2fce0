"""Decode reuses sampling tensors only while they are exactly what a rebuild would give."""

from __future__ import annotations

import torch

from scheduler_utils import Harness


def test_cached_sampling_info_equals_rebuild_with_penalties(llama_model):
    h = Harness(llama_model)
    for i in range(3):
        h.submit(f"p{i}", [5 + i, 6, 7, 8], max_new_tokens=12, temperature=0, ignore_eos=True,
                 frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2, min_new_tokens=4)
    h.sched.step()  # prefill
    for _ in range(6):
        batch = h.sched.running_batch
        fb = batch.prepare_for_decode()
        rebuilt = batch._sampling_info()
        assert torch.equal(fb.sampling_info.output_lens, rebuilt.output_lens)
        logits_a, logits_b = torch.zeros(3, 1024), torch.zeros(3, 1024)
        fb.sampling_info.apply_logits_bias(logits_a)
        rebuilt.apply_logits_bias(logits_b)
        assert torch.equal(logits_a, logits_b)
        # Finish the step as the scheduler would.
        logits = h.runner.forward(fb)
        h.sched.process_batch_result_decode(batch, h.runner.sample(logits, fb))
    h.run()
    h.assert_conserved()


def test_cache_not_reused_when_a_step_added_no_tokens(llama_model):
    h = Harness(llama_model)
    h.submit("a", [5, 6, 7], max_new_tokens=8, temperature=0, ignore_eos=True, frequency_penalty=1.0)
    h.sched.step()
    batch = h.sched.running_batch
    batch.prepare_for_decode()
    batch.prepare_for_decode()  # no tokens were appended in between: must rebuild, not advance
    assert int(batch._sampling_cache[2].output_lens[0]) == len(batch.reqs[0].output_ids)
