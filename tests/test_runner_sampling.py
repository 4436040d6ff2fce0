"""Sampling through the model runner: seeded requests do not depend on their batch."""

from __future__ import annotations

import torch

from model_utils import assert_pool_conserved, make_runner, random_prompts
from srt.model_executor.static_batch import StaticBatch
from srt.sampling.sampling_batch_info import SamplingBatchInfo
from srt.sampling.sampling_params import SamplingParams


def _sample_run(runner, prompts, params, steps=8):
    vocab = runner.model_config.vocab_size
    batch = StaticBatch(runner, len(prompts))
    outs = [[] for _ in prompts]
    logits = batch.extend(prompts)
    for step in range(steps):
        info = SamplingBatchInfo.from_params(params, vocab, runner.device, output_ids=outs)
        fb = type("FB", (), {"sampling_info": info, "seq_lens": torch.tensor(batch.seq_lens)})
        ids = runner.sample(logits, fb).next_token_ids
        for o, t in zip(outs, ids.tolist()):
            o.append(t)
        if step + 1 < steps:
            logits = batch.decode(ids)
    batch.release()
    return outs


def test_seeded_request_same_alone_and_in_a_batch(llama_model):
    runner = make_runner(llama_model)
    prompts = random_prompts(runner.model_config.vocab_size, (7, 19, 12, 4), seed=10)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, sampling_seed=1234)
    others = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, sampling_seed=9),
              SamplingParams(temperature=0)]
    alone = _sample_run(runner, prompts[:1], [seeded])[0]
    mixed = _sample_run(runner, [prompts[1], prompts[0], prompts[2], prompts[3]],
                        [others[0], seeded, others[1], others[2]])
    assert mixed[1] == alone
    other_seed = _sample_run(runner, prompts[:1], [SamplingParams(temperature=1.0, top_p=0.95, sampling_seed=4321)])[0]
    assert other_seed != alone
    assert_pool_conserved(runner)


def test_top_k_1_through_runner_is_greedy(qwen3_model):
    runner = make_runner(qwen3_model)
    prompts = random_prompts(runner.model_config.vocab_size, (9, 15), seed=11)
    greedy = _sample_run(runner, prompts, [SamplingParams(temperature=0)] * 2)
    topk1 = _sample_run(runner, prompts, [SamplingParams(temperature=1.5, top_k=1)] * 2)
    assert greedy == topk1
