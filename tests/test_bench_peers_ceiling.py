"""scripts/bench_peers_ceiling.py: its FLOP count against torch's FLOP counter on Hugging Face's own
Llama (eager attention), and the ceiling table on a hand-computed run."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from tiny_models import REPO_ROOT, load_script

# transformers 5.24 renames past_key_values to cache; 5.17, the oldest pyproject.toml allows, has only the old name.
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def bc():
    return load_script(REPO_ROOT / "scripts" / "bench_peers_ceiling.py")


@pytest.fixture(scope="module")
def hf_llama():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
                         num_key_value_heads=2, head_dim=16, vocab_size=97, attn_implementation="eager")
    return LlamaForCausalLM(config).eval()


def counted(fn) -> int:
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        fn()
    return counter.get_total_flops()


def test_a_request_costs_what_hf_computes(bc, hf_llama):
    """Prompt 11 tokens, 4 of them cached, 5 out: the prefill of the 7 new tokens (one logits row)
    and 4 decode steps, each counted by torch on HF's forward. Eager attention also scores the
    masked (future) keys of the prefill block, n (n - 1) / 2 of them per head and layer; the
    script counts only the keys a token attends to."""
    shape = bc.ModelShape.from_config(hf_llama.config.to_dict())
    prompt, cached, output = 11, 4, 5
    ids = torch.randint(0, 97, (1, prompt + output), device="cpu")
    cache = DynamicCache(config=hf_llama.config)
    with torch.no_grad():
        hf_llama(ids[:, :cached], past_key_values=cache, use_cache=True)
    prefill = counted(lambda: hf_llama(ids[:, cached:prompt], past_key_values=cache, use_cache=True, logits_to_keep=1))
    decode = sum(counted(lambda i=i: hf_llama(ids[:, i:i + 1], past_key_values=cache, use_cache=True))
                 for i in range(prompt, prompt + output - 1))
    new = prompt - cached
    masked = 4 * shape.layers * shape.heads * shape.head_dim * new * (new - 1) // 2
    assert bc.request_flops(shape, prompt, cached, output) == (prefill - masked, decode)


def test_one_decode_step_matches_hf_at_several_positions(bc, hf_llama):
    shape = bc.ModelShape.from_config(hf_llama.config.to_dict())
    for position in (1, 7, 30):
        cache = DynamicCache(config=hf_llama.config)
        ids = torch.randint(0, 97, (1, position + 1), device="cpu")
        with torch.no_grad():
            hf_llama(ids[:, :position], past_key_values=cache, use_cache=True)
        step = counted(lambda: hf_llama(ids[:, position:], past_key_values=cache, use_cache=True))
        assert step == shape.linear_flops + shape.attention_flops(position, position + 1) + shape.lm_head_flops


def test_config_defaults_head_dim_and_kv_heads(bc):
    shape = bc.ModelShape.from_config({"num_attention_heads": 4, "num_hidden_layers": 3, "hidden_size": 64,
                                       "intermediate_size": 128, "vocab_size": 10})
    assert (shape.kv_heads, shape.head_dim) == (4, 16)


def unit_shape(bc):
    """Every size 1: a token's linears cost 2 * (1 + 2 + 1 + 3) = 14 FLOPs, an LM head row 2, and a
    token at position i attends to i + 1 keys at 4 FLOPs each."""
    return bc.ModelShape(layers=1, hidden=1, heads=1, kv_heads=1, head_dim=1, intermediate=1, vocab=1)


def test_run_flops_by_hand_skips_failed_requests(bc):
    shape = unit_shape(bc)
    # prompt 2, cached 1, 2 out: prefill 1 token at position 1 (14 + 4 * 2) + 1 LM head row (2) = 24;
    # decode 1 step at position 2: 14 + 2 + 4 * 3 = 28.
    assert bc.request_flops(shape, 2, 1, 2) == (24, 28)
    records = [{"success": True, "prompt_tokens": 2, "cached_tokens": 1, "output_tokens": 2},
               {"success": True, "prompt_tokens": 1, "cached_tokens": None, "output_tokens": 1},  # 14 + 4 + 2
               {"success": False, "prompt_tokens": 50, "cached_tokens": 0, "output_tokens": 0}]
    assert bc.run_flops(shape, records) == (24 + 20, 28, 2, 3)


def test_ceiling_table_by_hand(bc, tmp_path):
    shape = unit_shape(bc)
    runs = tmp_path / "runs.jsonl"
    lines = [("ours", 0, 8.0), ("llama.cpp", 0, 4.0), ("ours", 1, 12.0), ("llama.cpp", 1, 8.0)]
    runs.write_text("".join(json.dumps({"workload": "random", "dtype": "fp32", "server": s, "round": r,
                                        "summary": {"output_throughput": v}}) + "\n" for s, r, v in lines)
                    + json.dumps({"workload": "random", "dtype": "fp32", "server": "llama.cpp", "round": 2,
                                  "summary": None}) + "\n")  # a failed run is left out
    logs = tmp_path / "logs"
    logs.mkdir()
    record = {"success": True, "prompt_tokens": 2, "cached_tokens": 1, "output_tokens": 2}
    (logs / "ours-fp32-random-round0.requests.jsonl").write_text(json.dumps(record) + "\n")
    rates = bc.load_rates(runs)
    assert rates == {("random", "fp32", "ours"): [8.0, 12.0], ("random", "fp32", "llama.cpp"): [4.0, 8.0]}
    # 52 FLOPs for 2 tokens at a peak of 520 FLOP/s: at most 20 tok/s; at a GEMM rate of 260, 10.
    [row] = bc.ceiling_rows(shape, rates, logs, peak=520e-9, gemm=260e-9)
    assert dict(zip(bc.HEADER, row)) == {
        "workload": "random", "dtype": "fp32", "new prompt tokens": "1", "out tokens": "2",
        "TFLOP prefill + decode": "0.000 + 0.000", "ceiling tok/s at peak": "20.0", "at GEMM rate": "10.0",
        "ours tok/s (of ceiling)": "10.0 (50%)", "peer": "llama.cpp", "peer tok/s": "6.0",
        "ceiling / peer": "3.33x", "measured ours / peer": "1.75x",  # rounds: 8 / 4 and 12 / 8
        "target": "1.5x", "target needs": "45% of the peak"}  # 1.5 x 6 / 20


def test_missing_request_log_names_the_file(bc, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"ours-bf16-multi-turn\*\.requests\.jsonl"):
        bc.our_records(tmp_path, "multi-turn", "bf16")


def test_a_run_without_tokens_of_ours_is_refused_by_name(bc, tmp_path):
    rates = {("random", "bf16", "ours"): [1.0], ("random", "bf16", "llama.cpp"): [1.0]}
    failed = {"success": False, "prompt_tokens": 5, "cached_tokens": 0, "output_tokens": 0}
    (tmp_path / "ours-bf16-random.requests.jsonl").write_text(json.dumps(failed) + "\n")
    with pytest.raises(ValueError, match=r"ours wrote no tokens in random / bf16"):
        bc.ceiling_rows(unit_shape(bc), rates, tmp_path, peak=1.0, gemm=1.0)


def test_targets_are_the_issues(bc):
    assert bc.target("llama.cpp", "random") == 1.5
    assert bc.target("llama.cpp", "multi-turn") == bc.target("llama.cpp", "generated-shared-prefix") == 3.0
    assert bc.target("transformers", "random") == 3.0


def test_fma_loop_without_a_compiler_says_so(bc, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert bc.fma_peak_gflops(threads=1, iters=1000, repeats=1) is None
    assert "FMA peak not measured" in caplog.text


def test_fma_loop_runs(bc):
    rate = bc.fma_peak_gflops(threads=1, iters=100_000, repeats=1)
    assert rate is not None and rate > 0
