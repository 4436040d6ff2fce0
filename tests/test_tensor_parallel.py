"""TP = 2 on CPU (gloo) computes what TP = 1 computes: greedy tokens identical, logits within 1e-4,
for every tiny architecture and for a model with fewer KV heads than ranks (replicated heads)."""

from __future__ import annotations

import pytest
import torch

from tp_utils import run_on_ranks

PROMPTS = 16
NEW_TOKENS = 32


def _greedy(rank: int, tp: int, init_method: str, model_path: str):
    from model_utils import random_prompts
    from srt.model_executor.model_runner import ModelRunner
    from srt.model_executor.static_batch import StaticBatch
    from srt.server_args import ServerArgs

    args = ServerArgs(model_path=model_path, dtype="float32", device="cpu", tp_size=tp)
    runner = ModelRunner(args, max_total_tokens=4096, max_running_requests=PROMPTS, tp_rank=rank,
                         dist_init_method=init_method)
    prompts = random_prompts(runner.model_config.vocab_size, [5 + (11 * i) % 37 for i in range(PROMPTS)], seed=3)
    batch = StaticBatch(runner, len(prompts))
    out = batch.extend(prompts)
    logits = [out.next_token_logits.clone()]
    toks = [[t] for t in out.next_token_logits.argmax(-1).tolist()]
    for _ in range(NEW_TOKENS - 1):
        out = batch.decode(torch.tensor([t[-1] for t in toks]))
        logits.append(out.next_token_logits.clone())
        for t, nxt in zip(toks, out.next_token_logits.argmax(-1).tolist()):
            t.append(nxt)
    batch.release()
    info = dict(kv_heads=runner.num_kv_heads_per_rank, q_heads=runner.num_qo_heads_per_rank,
                pool=runner.max_total_num_tokens)
    return toks, torch.stack(logits), info


@pytest.mark.parametrize("arch,params", [
    ("llama", {}), ("qwen2", {}), ("qwen3", {}), ("mistral", {}),
    ("llama", dict(kv_heads=1)),
], ids=["llama", "qwen2", "qwen3", "mistral", "llama-kv1-replicated"])
def test_tp2_matches_tp1(tiny_model_factory, arch, params):
    path = str(tiny_model_factory(arch, **params))
    (ref_toks, ref_logits, ref_info), = run_on_ranks(_greedy, 1, path)
    ranks = run_on_ranks(_greedy, 2, path)
    for rank, (toks, logits, info) in enumerate(ranks):
        assert toks == ref_toks, f"rank {rank}"
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
        assert info["q_heads"] * 2 == ref_info["q_heads"]
        assert info["kv_heads"] == max(1, ref_info["kv_heads"] // 2)
