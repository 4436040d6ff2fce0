"""llguidance vs xgrammar on CPU: compile time of a nested JSON schema and the time to compute one
token mask, at vocabulary sizes of 32k and 150k (the numbers behind --grammar-backend).

    python scripts/bench_grammar_backends.py [--vocab-sizes 32000 151936] [--steps 64]

No tokenizer of that size can be downloaded here, so each vocabulary is synthetic but shaped like
a real byte-level BPE one: the 256 byte tokens, then words and word pieces of the local corpus
(with and without a leading space) up to the size. Both libraries read the same Hugging Face fast
tokenizer. The mask time is the median over a random walk through the grammar (each step: mask,
pick an allowed token, accept it). xgrammar is optional: install it where you run this
(`pip install xgrammar`; on Linux it pulls Triton), else only llguidance is measured.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["user", "admin", "service"]},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "geo": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"]}}, "required": ["city", "geo"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 5},
        "roles": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "level": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["name", "level"]}},
    },
    "required": ["id", "name", "kind", "address"],
}


def synthetic_tokenizer(size: int):
    """A byte-level BPE fast tokenizer with `size` tokens (no merges: only the vocabulary matters)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from make_tiny_model import corpus_sources

    byte_map = pre_tokenizers.ByteLevel.alphabet()
    alphabet = sorted(byte_map)
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    enc = {b: c for b, c in zip(range(256), _bytes_to_unicode())}
    words = set()
    for _, text in corpus_sources():
        for word in text.split():
            for piece in (word, word[:4], word[:6], word[2:], word[:3]):
                if piece:
                    words.add(piece)
    rng = random.Random(0)
    pool = sorted(words)
    rng.shuffle(pool)
    for word in pool:
        for text in (word, " " + word):
            token = "".join(enc[b] for b in text.encode("utf-8"))
            if token not in vocab:
                vocab[token] = len(vocab)
            if len(vocab) >= size - 1:
                break
        if len(vocab) >= size - 1:
            break
    while len(vocab) < size - 1:  # pad with random letter strings if the corpus runs out
        token = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9)))
        vocab.setdefault(token, len(vocab))
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def _bytes_to_unicode():
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def walk(fill, accept, vocab: int, steps: int, seed: int = 0):
    """Median seconds per mask over a random walk of `steps` tokens."""
    rng = torch.Generator().manual_seed(seed)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        allowed = fill()
        times.append(time.perf_counter() - t0)
        ids = allowed.nonzero().flatten()
        if len(ids) == 0:
            break
        if not accept(int(ids[torch.randint(len(ids), (1,), generator=rng)])):
            break
    return statistics.median(times), len(times)


def bench_llguidance(hf_tok, vocab: int, steps: int):
    import llguidance
    import llguidance.hf

    t0 = time.perf_counter()
    ll_tok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
    compile_s = time.perf_counter() - t0
    bits = torch.arange(32, dtype=torch.int32)

    def fill():
        words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
        return (((words[:, None] >> bits) & 1).view(-1)[:vocab]).bool()

    mask_s, n = walk(fill, lambda t: matcher.consume_token(t), vocab, steps)
    return setup, compile_s, mask_s, n


def bench_xgrammar(hf_tok, vocab: int, steps: int):
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_s = time.perf_counter() - t0
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    bits = torch.arange(32, dtype=torch.int32)

    def fill():
        matcher.fill_next_token_bitmask(bitmask)
        return (((bitmask[0][:, None] >> bits) & 1).view(-1)[:vocab]).bool()

    mask_s, n = walk(fill, lambda t: matcher.accept_token(t), vocab, steps)
    return setup, compile_s, mask_s, n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab-sizes", type=int, nargs="+", default=[32000, 151936])
    p.add_argument("--steps", type=int, default=64)
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for size in args.vocab_sizes:
        tok = synthetic_tokenizer(size)
        for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
            try:
                rows.append((size, name, *fn(tok, size, args.steps)))
            except ImportError as exc:
                rows.append((size, name, None, None, None, f"not installed ({exc.name})"))
    print("# bench_grammar_backends: nested JSON schema (objects, arrays, enums, required keys), 1 thread, "
          "synthetic byte-level vocabularies")
    print("| vocab | backend | tokenizer setup s | schema compile ms | mask per token us (median) | steps |")
    print("|---|---|---|---|---|---|")
    for size, name, setup, compile_s, mask_s, n in rows:
        if setup is None:
            print(f"| {size:,} | {name} | - | - | - | {n} |")
        else:
            print(f"| {size:,} | {name} | {setup:.2f} | {compile_s * 1e3:.1f} | {mask_s * 1e6:.0f} | {n} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
