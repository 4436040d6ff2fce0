"""Shared helpers for model-level tests: build a runner, run greedy extend + decode."""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from srt.model_executor.model_runner import ModelRunner
from srt.model_executor.static_batch import StaticBatch
from srt.server_args import ServerArgs


def make_runner(model_path, max_total_tokens: int = 8192, max_running_requests: int = 16, **kw) -> ModelRunner:
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", "cpu")
    args = ServerArgs(model_path=str(model_path), **kw)
    return ModelRunner(args, max_total_tokens=max_total_tokens, max_running_requests=max_running_requests)


def random_prompts(vocab: int, lengths: Sequence[int], seed: int = 0) -> List[List[int]]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g, device="cpu").tolist() for n in lengths]


def greedy_run(runner: ModelRunner, prompts: Sequence[Sequence[int]], steps: int) -> Tuple[List[List[int]], torch.Tensor]:
    """One EXTEND of all prompts then `steps` DECODE steps; returns tokens and first logits."""
    batch = StaticBatch(runner, len(prompts))
    try:
        out = batch.extend(prompts)
        first = out.next_token_logits.clone()
        toks = [[t] for t in out.next_token_logits.argmax(-1).tolist()]
        for _ in range(steps):
            out = batch.decode(torch.tensor([t[-1] for t in toks]))
            for t, nxt in zip(toks, out.next_token_logits.argmax(-1).tolist()):
                t.append(nxt)
    finally:
        batch.release()
    return toks, first


def assert_bf16_close_to_dense(packed: ModelRunner, model_path, prompts, monkeypatch, steps: int = 8) -> ModelRunner:
    """A bf16 runner with packed weights against the same model with packing off (the oracle):
    first logits within bf16 noise and at least 90% of the greedy tokens equal. Returns the dense
    runner; packing stays off (monkeypatch) for the rest of the test."""
    toks, logits = greedy_run(packed, prompts, steps=steps)
    monkeypatch.setenv("SRT_CPU_WEIGHT_PACKING", "0")
    dense = make_runner(model_path, dtype="bfloat16")
    ref_toks, ref_logits = greedy_run(dense, prompts, steps=steps)
    torch.testing.assert_close(logits, ref_logits, rtol=0.05, atol=0.05)
    assert sum(a == b for t, r in zip(toks, ref_toks) for a, b in zip(t, r)) >= 0.9 * sum(map(len, toks))
    return dense


def assert_pool_conserved(runner: ModelRunner) -> None:
    """Every KV slot back in the allocator and every request row free."""
    assert runner.token_to_kv_pool_allocator.available_size() == runner.max_total_num_tokens
    assert runner.req_to_token_pool.available_size() == runner.req_to_token_pool.size


def hf_greedy_chat_answers(model_path, tokenizer, conversations, max_new_tokens: int) -> List[List[int]]:
    """HF `generate`, greedy, one conversation at a time (chat template applied): the generated
    ids, eos included. The oracle of the real-model tiers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    answers = []
    with torch.no_grad():
        for messages in conversations:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)
            out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
            answers.append(out[0, ids["input_ids"].shape[1]:].tolist())
    return answers
