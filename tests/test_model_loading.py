"""Checkpoint loading paths and the start-up errors users hit first."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from model_utils import make_runner, random_prompts
from srt.configs.model_config import ModelConfig
from srt.model_executor.static_batch import StaticBatch
from srt.server_args import ServerArgs, prepare_server_args


def _first_logits(runner, prompts):
    batch = StaticBatch(runner, len(prompts))
    out = batch.extend(prompts).next_token_logits
    batch.release()
    return out


def _hf_last_logits(path, prompt):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, -1]


def test_sharded_checkpoint_loads_same_weights(tiny_model_factory):
    single = tiny_model_factory("llama")
    sharded = tiny_model_factory("llama", shards=2)
    assert (sharded / "model.safetensors.index.json").is_file()
    prompts = random_prompts(500, (9, 14), seed=6)
    a = _first_logits(make_runner(single), prompts)
    b = _first_logits(make_runner(sharded), prompts)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_tied_embeddings_match_hf(tiny_model_factory):
    path = tiny_model_factory("qwen2", tie_word_embeddings=True)
    runner = make_runner(path)
    assert runner.model.lm_head.weight is runner.model.model.embed_tokens.weight
    prompt = random_prompts(500, (12,), seed=7)[0]
    got = _first_logits(runner, [prompt])[0]
    torch.testing.assert_close(got, _hf_last_logits(path, prompt), rtol=1e-4, atol=1e-4)


def test_llama3_rope_scaling_matches_hf(tiny_model_factory):
    path = tiny_model_factory("llama", rope_scaling="llama3")
    cfg = ModelConfig.load(str(path))
    assert cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "llama3"
    prompt = random_prompts(500, (300,), seed=8)[0]
    got = _first_logits(make_runner(path), [prompt])[0]
    torch.testing.assert_close(got, _hf_last_logits(path, prompt), rtol=1e-4, atol=1e-4)


def test_dummy_load_is_seeded_and_needs_no_weights(llama_model, tmp_path):
    shutil.copy(llama_model / "config.json", tmp_path / "config.json")
    prompts = random_prompts(500, (8,), seed=9)
    a = _first_logits(make_runner(tmp_path, load_format="dummy", random_seed=1), prompts)
    b = _first_logits(make_runner(tmp_path, load_format="dummy", random_seed=1), prompts)
    c = _first_logits(make_runner(tmp_path, load_format="dummy", random_seed=2), prompts)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert torch.isfinite(a).all()


def test_missing_path_is_named_not_treated_as_hub_id(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match="does not exist") as e:
        make_runner(missing)
    assert str(missing) in str(e.value)
    assert "Repo id" not in str(e.value)


def test_directory_without_config_json(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        make_runner(tmp_path)


def test_unknown_architecture_lists_supported(llama_model, tmp_path):
    for f in llama_model.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        make_runner(tmp_path)
    msg = str(e.value)
    assert "FooForCausalLM" in msg and "not supported" in msg
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in msg


def test_bad_dtype_lists_accepted_values(llama_model):
    with pytest.raises(ValueError) as e:
        ServerArgs(model_path=str(llama_model), dtype="float64")
    assert "--dtype" in str(e.value) and "'float64'" in str(e.value)
    assert "bfloat16" in str(e.value) and "float32" in str(e.value)
    with pytest.raises(SystemExit):
        prepare_server_args(["--model-path", str(llama_model), "--dtype", "float64"])


def test_bad_kv_cache_dtype_lists_accepted_values(llama_model):
    with pytest.raises(ValueError, match="--kv-cache-dtype 'int4'.*fp8_e4m3"):
        ServerArgs(model_path=str(llama_model), kv_cache_dtype="int4")


@pytest.mark.parametrize("text,value", [("16k", 16000), ("16K", 16384), ("2048", 2048), ("1.5k", 1500)])
def test_context_length_suffixes(text, value):
    assert prepare_server_args(["--model-path", "x", "--context-length", text]).context_length == value


def test_context_length_above_derived_is_refused_unless_env(llama_model, monkeypatch):
    derived = ModelConfig.load(str(llama_model)).context_len
    with pytest.raises(ValueError) as e:
        ModelConfig.load(str(llama_model), context_length=derived * 2)
    assert str(derived) in str(e.value) and "SRT_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN" in str(e.value)
    monkeypatch.setenv("SRT_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")
    assert ModelConfig.load(str(llama_model), context_length=derived * 2).context_len == derived * 2


def test_derived_context_length_and_eos(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096, "eos_token_id": [5, 6],
           "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    mc = ModelConfig.load(str(tmp_path))
    assert mc.context_len == 8192 and "factor" in mc.context_len_source
    assert mc.eos_token_ids == {5, 6, 7}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1000}))
    assert ModelConfig.load(str(tmp_path)).context_len == 1000
    cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "tokenizer_config.json").unlink()
    assert ModelConfig.load(str(tmp_path)).context_len == 4096  # llama3 configs state the scaled length


def test_bf16_on_a_cpu_without_bf16_matmuls_is_warned(monkeypatch, caplog):
    import logging

    import torch

    from srt.model_loader import loader

    monkeypatch.setattr(loader, "cpu_has_fast_bf16", lambda: False)
    with caplog.at_level(logging.WARNING, logger="srt.model_loader.loader"):
        assert loader.warn_slow_cpu_bf16(torch.bfloat16, "cpu") is True
        assert loader.warn_slow_cpu_bf16(torch.float32, "cpu") is False
        assert loader.warn_slow_cpu_bf16(torch.bfloat16, "cuda:0") is False
        assert loader.warn_slow_cpu_bf16(torch.bfloat16, "cpu", fast_weights=True) is False  # panels or widened
    assert "Use --dtype float32" in caplog.text and caplog.text.count("bfloat16 on a CPU") == 1
    assert "SRT_CPU_WIDEN_BF16=0" in caplog.text  # the switch that left the weights unwidened
    monkeypatch.setattr(loader, "cpu_has_fast_bf16", lambda: True)
    assert loader.warn_slow_cpu_bf16(torch.bfloat16, "cpu") is False
