"""--enable-torch-compile on CPU: the decode graphs compile at start-up (inductor freezing the
weights), the pools are empty again afterwards, and no later batch size or KV length compiles."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from model_utils import random_prompts
from scheduler_utils import Harness
from srt.check_config_weights import loaded_model_nbytes
from srt.configs.model_config import ModelConfig
from srt.model_executor.compile_warmup import warmup_batch_sizes


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_warmup_batch_sizes_stay_within_the_limits():
    assert warmup_batch_sizes(32, 256) == [1, 2]
    assert warmup_batch_sizes(1, 256) == [1]
    assert warmup_batch_sizes(32, 1) == [1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_memory_estimate_counts_inductors_frozen_copies(llama_model, dtype):
    """Each compiled graph (batch 1, and the rest) holds a packed copy of every linear weight and
    of the LM head; the dense weights stay for eager prefill."""
    config = ModelConfig.load(str(llama_model), dtype)
    dense = loaded_model_nbytes(config, device="cuda")  # no CPU packing
    h, i, v, L = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i  # qkv, o, gate/up/down
    copy = (L * per_layer + v * h) * config.dtype.itemsize
    assert loaded_model_nbytes(config, device="cpu", enable_torch_compile=True) == dense + 2 * copy
    assert loaded_model_nbytes(config, device="cpu", enable_torch_compile=True, torch_compile_max_bs=1) == \
        dense + copy
    assert loaded_model_nbytes(config, device="cuda", enable_torch_compile=True) == dense


def test_decode_compiles_at_startup_and_never_again(llama_model):
    before = _graphs()
    compiled = Harness(llama_model, enable_torch_compile=True, torch_compile_max_bs=8)
    runner = compiled.runner
    assert _graphs() > before, "nothing compiled at start-up"
    # The warm-up gave back every KV slot and request row it took.
    assert runner.token_to_kv_pool_allocator.available_size() == runner.max_total_num_tokens
    assert runner.req_to_token_pool.available_size() == runner.req_to_token_pool.size
    compiled.sched.check_memory_conservation()

    after_startup = _graphs()
    calls = []
    real = runner.compiled_forward
    runner.compiled_forward = lambda *a: (calls.append(a[2].batch_size), real(*a))[1]
    plain = Harness(llama_model)
    vocab = plain.runner.model_config.vocab_size
    waves = [random_prompts(vocab, lens, seed=s) for s, lens in
             enumerate([[9], [3, 17, 30], [5, 6, 7, 40, 2], [11] * 8])]
    for h in (plain, compiled):
        with torch._dynamo.config.patch(error_on_recompile=True):
            for w, prompts in enumerate(waves):
                for i, p in enumerate(prompts):
                    h.submit(f"w{w}r{i}", p, max_new_tokens=5, temperature=0, ignore_eos=True)
                h.run()
        h.assert_conserved()
    assert _graphs() == after_startup, "a request's decode compiled a new graph"
    assert set(calls) >= {1, 3, 5, 8}
    assert {k: v["output_ids"] for k, v in compiled.finals().items()} == \
        {k: v["output_ids"] for k, v in plain.finals().items()}
