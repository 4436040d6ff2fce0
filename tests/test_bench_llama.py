"""The benchmark model llama-26m (scripts/make_bench_llama.py): ~25M parameters of seeded random init
behind SmolLM2-135M-Instruct's real tokenizer and chat template, answered by our Engine token for
token as HF `generate` does.

It is built from the SmolLM2 folder (the real-model tier's download), so it follows that tier's
convention: a build that fails fails these tests with the cause; only SRT_SKIP_REAL_MODEL=1 skips.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from model_utils import hf_greedy_chat_answers
from srt.entrypoints.engine import Engine
from tiny_models import CACHE_DIR, REPO_ROOT, SKIP_REAL_MODEL_ENV, get_real_model, load_script, skip_real_model

MAX_NEW_TOKENS = 16
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Name three primary colors."}],
]


def load_bench_builder():
    """Import scripts/make_bench_llama.py by path (it imports make_real_model, already loaded)."""
    return load_script(REPO_ROOT / "scripts" / "make_bench_llama.py")


@pytest.fixture(scope="module")
def models():
    """(SmolLM2 folder, llama-26m folder), both through the builders' cached paths."""
    if skip_real_model():
        pytest.skip(f"{SKIP_REAL_MODEL_ENV}=1: the real-model tier (and llama-26m, built from it) is skipped")
    try:
        smollm2 = get_real_model()  # registers make_real_model in sys.modules for the bench builder
        return smollm2, load_bench_builder().get_bench_llama(CACHE_DIR)
    except Exception as exc:  # any cause: fail loudly, never skip
        pytest.fail(f"could not build llama-26m ({type(exc).__name__}: {exc}); fix the cause or set "
                    f"{SKIP_REAL_MODEL_ENV}=1 to skip this tier explicitly", pytrace=False)


@pytest.fixture(scope="module")
def bench_model(models):
    return models[1]


@pytest.fixture(scope="module")
def tokenizer(bench_model):
    return AutoTokenizer.from_pretrained(bench_model)


@pytest.fixture(scope="module")
def hf_answers(bench_model, tokenizer):
    return hf_greedy_chat_answers(bench_model, tokenizer, CONVERSATIONS, MAX_NEW_TOKENS)


@pytest.fixture(scope="module")
def engine(bench_model):
    eng = Engine(model_path=str(bench_model), dtype="float32", device="cpu", max_total_tokens=4096)
    yield eng
    eng.shutdown()


def test_shape_and_parameter_count(bench_model, models):
    cfg = AutoConfig.from_pretrained(bench_model)
    shape = (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
             cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size, cfg.max_position_embeddings)
    assert shape == ("llama", 16, 256, 4, 2, 64, 768, 8192)
    assert cfg.tie_word_embeddings and cfg.architectures == ["LlamaForCausalLM"]
    smol = json.loads((models[0] / "config.json").read_text())
    for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "rms_norm_eps"):
        assert getattr(cfg, key) == smol[key], key
    stored = load_bench_builder().count_parameters(bench_model)  # the tied lm_head is not stored
    assert 24_000_000 <= stored <= 28_000_000
    model = AutoModelForCausalLM.from_pretrained(bench_model, dtype=torch.float32)
    assert model.num_parameters() == stored
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_tokenizer_and_chat_template_are_smollm2s(models, tokenizer):
    smollm2, bench = models
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (bench / name).read_bytes() == (smollm2 / name).read_bytes(), name
    theirs = AutoTokenizer.from_pretrained(smollm2)
    assert tokenizer.chat_template == theirs.chat_template
    text = "Hello, world! 12345 naïve café <|im_start|>user\nhi<|im_end|>"
    assert tokenizer(text)["input_ids"] == theirs(text)["input_ids"]
    for messages in CONVERSATIONS:
        assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
            theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_weights_are_the_seeded_init(bench_model, models, tmp_path):
    """A second build writes the same bytes: the weights depend only on the seed and library versions."""
    again = load_bench_builder().build_bench_llama(tmp_path / "again", models[0])

    def digest(path):
        return hashlib.sha256(path.read_bytes()).hexdigest()

    assert digest(again / "model.safetensors") == digest(bench_model / "model.safetensors")


def test_our_chat_template_renders_as_hf(engine, tokenizer):
    for messages in CONVERSATIONS:
        ours = engine.frontend.template.apply(messages)
        assert ours == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_greedy_chat_answers_match_hf_generate(engine, hf_answers):
    prompts = [engine.frontend.template.apply(messages) for messages in CONVERSATIONS]
    outs = engine.generate(prompts, {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0})
    for i, (out, ref) in enumerate(zip(outs, hf_answers)):
        assert len(ref) > 1, f"conversation {i}: HF's answer is only {ref}: nothing to compare"
        assert out["output_ids"] == ref, f"conversation {i}: ours {out['text']!r} != HF's answer"


def test_logprobs_at_every_position_match_hf(engine, tokenizer, bench_model):
    """Random weights answer by repeating one token, so greedy ids check little past the first step;
    the logprobs of every prompt token (prefill) and answer token (decode) check every position."""
    model = AutoModelForCausalLM.from_pretrained(bench_model, dtype=torch.float32).eval()
    for i, messages in enumerate(CONVERSATIONS):
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 8, "temperature": 0},
                              return_logprob=True, logprob_start_len=0)
        meta, full = out["meta_info"], ids + out["output_ids"]
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([full])).logits[0], dim=-1)
        scored = [e[0] for e in meta["input_token_logprobs"][1:]] + [e[0] for e in meta["output_token_logprobs"]]
        want = [ref[pos - 1, full[pos]].item() for pos in range(1, len(full))]
        assert scored == pytest.approx(want, abs=1e-4), f"conversation {i}"
