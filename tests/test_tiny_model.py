"""The tiny offline models are real Hugging Face checkpoints that transformers reads as we intend."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from tokenizers import Tokenizer

from tiny_models import CACHE_DIR, get_tiny_model, load_builder

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
TEXTS = [
    "Hello world",
    "  leading and trailing spaces  ",
    "digits 1234567 and 3.14159, 42nd",
    "line one\nline two\r\n\n\tindented",
    "héllo wörld, naïve café: 你好，世界 🙂👍🏽 Ω≈ç√",
    "e\u0301 is not NFC",
    "<|im_start|>user\nhi<|im_end|>\n",
    "don't I'll WE'RE they've",
    "",
    "x" * 300,
]


@pytest.fixture(params=sorted(ARCHITECTURES))
def arch_model(request: pytest.FixtureRequest) -> tuple[str, Path]:
    return request.param, request.getfixturevalue(f"{request.param}_model")


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _hf_state(path: Path) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_config_names_the_architecture_and_model_type(arch_model: tuple[str, Path]) -> None:
    arch, path = arch_model
    config = _config(path)
    assert config["architectures"] == [ARCHITECTURES[arch]]
    assert config["model_type"] == arch
    assert config["max_position_embeddings"] == 2048
    assert config["torch_dtype"] == config["dtype"] == "float32"


def test_hf_loads_offline_and_forward_gives_finite_logits(arch_model: tuple[str, Path]) -> None:
    arch, path = arch_model
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == ARCHITECTURES[arch]
    with torch.no_grad():
        logits = model(torch.tensor([[5, 17, 300, 2]])).logits
    assert logits.shape == (1, 4, _config(path)["vocab_size"])
    assert torch.isfinite(logits).all()


def test_autotokenizer_ids_equal_raw_tokenizer_json_ids(arch_model: tuple[str, Path]) -> None:
    _, path = arch_model
    hf = transformers.AutoTokenizer.from_pretrained(path)
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    for text in TEXTS:
        expected = raw.encode(text).ids
        assert hf(text)["input_ids"] == expected, text
        assert hf(text, add_special_tokens=False)["input_ids"] == expected, text
        assert hf.encode(text) == expected, text


def test_byte_level_decode_inverts_encode(arch_model: tuple[str, Path]) -> None:
    _, path = arch_model
    hf = transformers.AutoTokenizer.from_pretrained(path)
    for text in TEXTS:
        # Qwen tokenizers NFC-normalize first (as the real ones do); llama/mistral keep text as is.
        want = unicodedata.normalize("NFC", text) if _config(path)["model_type"].startswith("qwen") else text
        assert hf.decode(hf.encode(text)) == want, text


def test_tokenizer_covers_the_vocab_and_special_ids_match_config(arch_model: tuple[str, Path]) -> None:
    _, path = arch_model
    hf = transformers.AutoTokenizer.from_pretrained(path)
    config = _config(path)
    generation = json.loads((path / "generation_config.json").read_text())
    assert len(hf) == config["vocab_size"] == 1024
    assert hf.convert_tokens_to_ids("<|endoftext|>") == hf.bos_token_id == config["bos_token_id"]
    assert hf.convert_tokens_to_ids("<|im_end|>") == hf.eos_token_id == config["eos_token_id"]
    assert hf.convert_tokens_to_ids("<|pad|>") == hf.pad_token_id == config["pad_token_id"]
    assert config["eos_token_id"] in generation["eos_token_id"]
    assert hf.convert_tokens_to_ids("<|im_start|>") not in (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)


def test_chat_template_renders_chatml_with_generation_prompt(arch_model: tuple[str, Path]) -> None:
    _, path = arch_model
    hf = transformers.AutoTokenizer.from_pretrained(path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    prompt = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    without = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert without == prompt.removesuffix("<|im_start|>assistant\n")


def test_chat_template_accepts_openai_content_parts(qwen2_model: Path) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(qwen2_model)
    parts = [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]
    prompt = hf.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)
    assert prompt == "<|im_start|>user\nHi there<|im_end|>\n"


def test_classic_rope_keys_agree_with_rope_parameters(arch_model: tuple[str, Path]) -> None:
    _, path = arch_model
    config = _config(path)
    hf_config = transformers.AutoConfig.from_pretrained(path)
    assert config["rope_scaling"] is None
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == hf_config.rope_parameters["rope_theta"]


def test_qwen2_has_nonzero_qkv_bias(qwen2_model: Path) -> None:
    state = load_file(qwen2_model / "model.safetensors")
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert state[f"model.layers.0.self_attn.{proj}.bias"].abs().sum() > 0
    assert "model.layers.0.self_attn.o_proj.bias" not in state


def test_qwen3_has_qk_norm_and_head_dim_unequal_to_hidden_over_heads(qwen3_model: Path) -> None:
    config = _config(qwen3_model)
    state = load_file(qwen3_model / "model.safetensors")
    assert config["head_dim"] != config["hidden_size"] // config["num_attention_heads"]
    assert state["model.layers.0.self_attn.q_norm.weight"].shape == (config["head_dim"],)
    assert state["model.layers.0.self_attn.q_proj.weight"].shape == (
        config["num_attention_heads"] * config["head_dim"],
        config["hidden_size"],
    )
    assert "model.layers.0.self_attn.k_norm.weight" in state


def test_norm_weights_are_not_all_ones(llama_model: Path) -> None:
    state = load_file(llama_model / "model.safetensors")
    assert not torch.allclose(state["model.norm.weight"], torch.ones_like(state["model.norm.weight"]))


def test_two_shards_have_an_index_and_the_same_weights_as_one_file(llama_model: Path) -> None:
    sharded = get_tiny_model("llama", shards=2)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert not (sharded / "model.safetensors").exists()
    one, two = _hf_state(llama_model), _hf_state(sharded)
    assert one.keys() == two.keys()
    assert all(torch.equal(one[k], two[k]) for k in one)


def test_same_arguments_give_byte_identical_files(tmp_path: Path) -> None:
    builder = load_builder()
    first = builder.build_tiny_model("qwen3", tmp_path / "a", seed=3)
    second = builder.build_tiny_model("qwen3", tmp_path / "b", seed=3)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_different_seeds_give_different_weights(llama_model: Path) -> None:
    other = get_tiny_model("llama", seed=1)
    a, b = load_file(llama_model / "model.safetensors"), load_file(other / "model.safetensors")
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])


def test_llama3_rope_scaling_is_written_and_loaded_by_hf() -> None:
    path = get_tiny_model("llama", rope_scaling="llama3")
    config = _config(path)
    assert config["rope_scaling"]["rope_type"] == "llama3"
    assert config["rope_scaling"]["factor"] == 8.0
    assert config["rope_scaling"]["original_max_position_embeddings"] < config["max_position_embeddings"]
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert model.config.rope_parameters["rope_type"] == "llama3"
    assert model.config.rope_parameters["low_freq_factor"] == 1.0
    assert model.config.rope_parameters["high_freq_factor"] == 4.0
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_tied_embeddings_store_no_lm_head_and_hf_ties_them() -> None:
    path = get_tiny_model("qwen2", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_bfloat16_weights_are_the_float32_weights_rounded(llama_model: Path) -> None:
    path = get_tiny_model("llama", dtype="bfloat16")
    assert _config(path)["torch_dtype"] == "bfloat16"
    low, full = load_file(path / "model.safetensors"), load_file(llama_model / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in low.values())
    assert all(torch.equal(low[k], full[k].to(torch.bfloat16)) for k in full)
    assert transformers.AutoModelForCausalLM.from_pretrained(path).dtype == torch.bfloat16


def test_cache_returns_the_same_folder_and_leaves_no_temporaries(llama_model: Path) -> None:
    assert get_tiny_model("llama") == llama_model
    assert llama_model.parent == CACHE_DIR
    leftovers = list((CACHE_DIR / ".tmp").iterdir()) if (CACHE_DIR / ".tmp").is_dir() else []
    assert not [p for p in leftovers if p.name.startswith(llama_model.name)]


def test_unknown_parameter_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown parameters"):
        get_tiny_model("llama", hiden=32)
    with pytest.raises(ValueError, match="unknown parameters"):
        load_builder().build_tiny_model("llama", tmp_path / "m", hiden=32)


def test_cli_writes_a_loadable_model(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    load_builder().main(["--arch", "mistral", "--out", str(out), "--layers", "1", "--vocab", "512"])
    config = _config(out)
    assert (config["num_hidden_layers"], config["vocab_size"]) == (1, 512)
    assert len(transformers.AutoTokenizer.from_pretrained(out)) == 512
