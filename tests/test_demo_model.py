"""The embedded demo model (srt/demo_model): small, loads through the real paths, writes English.

It is what `launch_server` serves without `--model-path`, so these tests pin what a first-time
user sees: the committed folder loads in our runtime and in HF transformers with identical greedy
tokens, its text is mostly words from the training corpus, and `scripts/launch_demo.sh` serves it.
"""

from __future__ import annotations

import functools
import json
import os
import re
import socket
import subprocess
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from model_utils import assert_pool_conserved, greedy_run, make_runner
from tiny_models import REPO_ROOT, load_builder, load_script

DEMO = REPO_ROOT / "srt" / "demo_model"
MAX_FOLDER_BYTES = 6 * 1024 * 1024  # "a few MB": it is committed and shipped as package data
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                  "generation_config.json", "chat_template.jinja")
PLAIN_PROMPT = "The license"
CHAT_MESSAGES = [{"role": "user", "content": "Tell me about the GPL-3 license."}]
STEPS = 40


def load_trainer() -> ModuleType:
    """Import scripts/train_demo_model.py by path (registered first: its dataclasses need that)."""
    return load_script(REPO_ROOT / "scripts" / "train_demo_model.py")


@functools.lru_cache(maxsize=1)
def corpus_words() -> frozenset[str]:
    words: set[str] = set()
    for text in load_builder()._training_texts():
        words.update(w.lower() for w in re.findall(r"[A-Za-z]+", text))
    return frozenset(words)


def word_hit_rate(text: str, vocabulary: frozenset[str]) -> tuple[float, int]:
    """(share, count) of whitespace-separated words with letters whose letter runs are all in
    `vocabulary` (case-folded): "non-free," counts if both "non" and "free" are corpus words."""
    words = [re.findall(r"[a-z]+", w.lower()) for w in text.split()]
    words = [runs for runs in words if runs]
    hits = sum(all(r in vocabulary for r in runs) for runs in words)
    return (hits / len(words) if words else 0.0), len(words)


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens by full recomputation each step: the plainest oracle."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:cut]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> dict[str, list[int]]:
    chat = tokenizer.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True, tokenize=False)
    return {"plain": tokenizer.encode(PLAIN_PROMPT), "chat": tokenizer.encode(chat)}


@pytest.fixture(scope="module")
def runtime_greedy(prompts) -> dict[str, list[int]]:
    """Our ModelRunner (fp32 compute) on both prompts at once: one extend, then decode steps."""
    runner = make_runner(DEMO, dtype="float32")
    toks, _ = greedy_run(runner, [prompts["plain"], prompts["chat"]], steps=STEPS - 1)
    assert_pool_conserved(runner)
    return {"plain": toks[0], "chat": toks[1]}


def test_demo_folder_is_complete_and_a_few_megabytes() -> None:
    missing = [f for f in REQUIRED_FILES if not (DEMO / f).is_file()]
    assert not missing, f"srt/demo_model lacks {missing}; run scripts/train_demo_model.py"
    size = sum(f.stat().st_size for f in DEMO.iterdir() if f.is_file())
    assert size < MAX_FOLDER_BYTES, f"srt/demo_model is {size / 2**20:.1f} MiB, over the limit"


def test_weights_are_half_precision_and_config_says_which() -> None:
    config = json.loads((DEMO / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    with safe_open(str(DEMO / "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes == {"BF16"} and config["torch_dtype"] == "bfloat16"


def test_runtime_greedy_tokens_equal_hf_greedy(prompts, runtime_greedy) -> None:
    hf = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()
    for name, prompt in prompts.items():
        assert runtime_greedy[name] == hf_greedy(hf, prompt, STEPS), f"{name} prompt diverged from HF"


def test_greedy_completion_is_mostly_corpus_words(tokenizer, runtime_greedy) -> None:
    eos = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    text = tokenizer.decode(until_eos(runtime_greedy["plain"], eos), skip_special_tokens=True)
    rate, n = word_hit_rate(text, corpus_words())
    assert n >= 8 and rate > 0.6, f"{n} words, {rate:.0%} from the corpus: {text!r}"


def test_chat_reply_is_mostly_corpus_words(tokenizer, runtime_greedy) -> None:
    eos = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    text = tokenizer.decode(until_eos(runtime_greedy["chat"], eos), skip_special_tokens=True)
    rate, n = word_hit_rate(text, corpus_words())
    assert n >= 5 and rate > 0.6, f"{n} words, {rate:.0%} from the corpus: {text!r}"


def test_trainer_renders_chat_exactly_as_the_committed_template(tokenizer) -> None:
    trainer = load_trainer()
    messages = CHAT_MESSAGES + [{"role": "assistant", "content": "It is a license.\n\nTwo paragraphs."}]
    assert trainer.render_chat(messages) == tokenizer.apply_chat_template(messages, tokenize=False)
    assert (DEMO / "chat_template.jinja").read_text().strip() == tokenizer.chat_template.strip()


def test_engine_serves_the_demo_model_at_its_checkpoint_dtype() -> None:
    from srt.entrypoints.engine import Engine

    engine = Engine(model_path=str(DEMO), max_total_tokens=8192)
    try:
        out = engine.generate(PLAIN_PROMPT, {"max_new_tokens": 30, "temperature": 0})
    finally:
        engine.shutdown()
    rate, n = word_hit_rate(out["text"], corpus_words())
    assert n >= 5 and rate > 0.6, f"{n} words, {rate:.0%} from the corpus: {out['text']!r}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not (REPO_ROOT / "srt" / "launch_server.py").is_file(), reason="srt/launch_server.py not built yet")
def test_launch_demo_script_serves_one_request_and_exits() -> None:
    env = dict(os.environ, PORT=str(_free_port()), DEMO_EXIT_AFTER_READY="1", DEMO_READY_TIMEOUT="240")
    done = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "launch_demo.sh")], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    marker = "[demo] reply: The license"
    assert marker in done.stdout, done.stdout[-2000:]
    reply = done.stdout.split(marker, 1)[1]
    rate, n = word_hit_rate(reply, corpus_words())
    assert n >= 5 and rate > 0.6, f"{n} words, {rate:.0%} from the corpus: {reply!r}"
