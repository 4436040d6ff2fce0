"""Build tiny, offline, Hugging Face-format causal LMs with seeded random weights.

Tests and demos need real checkpoints (config.json, safetensors, a byte-level BPE tokenizer, a
chat template) on machines without a network; these are built in seconds from text that every
Debian-like box and every CPython install carries, and are byte-identical for the same arguments.

    python scripts/make_tiny_model.py --arch qwen3 --out /tmp/tiny-qwen3 --shards 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub, even by accident
import transformers  # noqa: E402  (after the offline switch on purpose)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<|endoftext|>", "<|im_end|>", "<|pad|>"

# Pre-tokenizer split patterns. Qwen's splits every digit alone; Llama 3's keeps up to 3 digits.
QWEN_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
LLAMA3_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML. Content may be a string, None (tool-call turns) or a list of OpenAI-style parts.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is none -%}{%- set content = '' -%}"
    "{%- elif message['content'] is string -%}{%- set content = message['content'] -%}"
    "{%- else -%}{%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') -%}{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class ArchSpec:
    """What differs between the supported architectures, as data."""

    architecture: str
    model_type: str
    rope_theta: float
    # transformers 5 forces Qwen2Tokenizer on model_type qwen2 whatever tokenizer_config says, and
    # that class rebuilds the pipeline (NFC + QWEN_SPLIT), so qwen tokenizers are trained with it.
    tokenizer_class: str
    split_pattern: str
    nfc: bool


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec("LlamaForCausalLM", "llama", 500000.0, "PreTrainedTokenizerFast", LLAMA3_SPLIT, False),
    "mistral": ArchSpec("MistralForCausalLM", "mistral", 10000.0, "PreTrainedTokenizerFast", LLAMA3_SPLIT, False),
    "qwen2": ArchSpec("Qwen2ForCausalLM", "qwen2", 1000000.0, "Qwen2Tokenizer", QWEN_SPLIT, True),
    "qwen3": ArchSpec("Qwen3ForCausalLM", "qwen3", 1000000.0, "Qwen2Tokenizer", QWEN_SPLIT, True),
}


@dataclass(frozen=True)
class TinyModelParams:
    """Shape and build options; the defaults make a ~1 MB model that loads in well under a second.

    head_dim None means hidden // heads, except qwen3 where it is 2 * hidden // heads: real Qwen3
    models have head_dim != hidden / heads, and runtimes must not assume otherwise.
    """

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    context: int = 2048
    vocab: int = 1024
    head_dim: int | None = None
    tie_word_embeddings: bool = False
    rope_theta: float | None = None  # None: the architecture's usual base
    rope_scaling: str | None = None  # None or "llama3"
    shards: int = 1
    dtype: str = "float32"
    seed: int = 0
    init_std: float = 0.08  # larger than HF's 0.02 so greedy decoding has clear winners


def corpus_sources() -> list[tuple[str, str]]:
    """(name, text) of the text present on every machine we run on, in a fixed order (training
    is order-sensitive): the license files (each real file once), then CPython's pydoc topics."""
    out: list[tuple[str, str]] = []
    licenses = Path("/usr/share/common-licenses")
    if licenses.is_dir():
        seen: set[Path] = set()
        for path in sorted(licenses.iterdir()):
            real = path.resolve()
            if real.is_file() and real not in seen:
                seen.add(real)
                out.append((f"license:{real.name}", real.read_text(encoding="utf-8", errors="replace")))
    from pydoc_data.topics import topics

    out.extend((f"topic:{name}", topics[name]) for name in sorted(topics))
    return out


def _training_texts() -> list[str]:
    return [text for _, text in corpus_sources()]


def train_tokenizer(arch: str, vocab: int) -> Tokenizer:
    """Train a byte-level BPE whose tokenizer.json transformers 5 uses without changing its output."""
    spec = ARCHS[arch]
    tokenizer = Tokenizer(models.BPE())
    if spec.nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(spec.split_pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_texts(), trainer=trainer)
    return tokenizer


def _rope_parameters(arch: str, p: TinyModelParams) -> dict:
    theta = p.rope_theta if p.rope_theta is not None else ARCHS[arch].rope_theta
    if p.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    return {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": max(p.context // 8, 16),
    }


def _head_dim(arch: str, p: TinyModelParams) -> int:
    if p.head_dim is not None:
        return p.head_dim
    return (2 if arch == "qwen3" else 1) * p.hidden // p.heads


def make_config(arch: str, p: TinyModelParams, ids: dict[str, int]) -> transformers.PreTrainedConfig:
    """The transformers config object, so its own validation checks our numbers."""
    if p.hidden % p.heads or p.heads % p.kv_heads:
        raise ValueError(f"need hidden % heads == 0 and heads % kv_heads == 0, got {p.hidden}/{p.heads}/{p.kv_heads}")
    fields = dict(
        vocab_size=p.vocab,
        hidden_size=p.hidden,
        intermediate_size=p.intermediate,
        num_hidden_layers=p.layers,
        num_attention_heads=p.heads,
        num_key_value_heads=p.kv_heads,
        max_position_embeddings=p.context,
        rms_norm_eps=1e-6,
        initializer_range=p.init_std,
        tie_word_embeddings=p.tie_word_embeddings,
        rope_parameters=_rope_parameters(arch, p),
        bos_token_id=ids[BOS_TOKEN],
        eos_token_id=ids[EOS_TOKEN],
        pad_token_id=ids[PAD_TOKEN],
        dtype=p.dtype,
        architectures=[ARCHS[arch].architecture],
    )
    if arch == "qwen2":
        if p.head_dim is not None and p.head_dim != p.hidden // p.heads:
            raise ValueError(f"qwen2 has no head_dim field: head_dim must be hidden // heads = {p.hidden // p.heads}")
        fields.update(use_sliding_window=False, max_window_layers=p.layers)
    else:
        fields["head_dim"] = _head_dim(arch, p)
    if arch == "qwen3":
        fields.update(use_sliding_window=False, max_window_layers=p.layers, attention_bias=False)
    if arch == "mistral":
        fields["sliding_window"] = None  # full attention, like Mistral v0.2+
    return transformers.AutoConfig.for_model(ARCHS[arch].model_type, **fields)


def _config_json(config: transformers.PreTrainedConfig) -> dict:
    """config.json as transformers 5 writes it, plus the classic keys plain JSON readers look for."""
    data = json.loads(config.to_json_string(use_diff=True))
    rope = dict(data["rope_parameters"])
    data["rope_theta"] = rope.pop("rope_theta")
    data["rope_scaling"] = rope if rope["rope_type"] != "default" else None
    data["torch_dtype"] = data["dtype"]
    return data


def random_state_dict(config: transformers.PreTrainedConfig, seed: int, std: float, dtype: str) -> dict:
    """Seeded weights under HF parameter names, independent of transformers' own init code.

    Norm weights are 1 + noise and biases non-zero, so a loader that skips them produces different
    logits instead of passing by luck.
    """
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(std * noise)
    state = {name: t.detach().to(getattr(torch, dtype)).contiguous() for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def write_weights(state: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    """model.safetensors, or `shards` files in name order plus model.safetensors.index.json."""
    names = sorted(state)
    if shards == 1:
        save_file({n: state[n] for n in names}, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    total = sum(state[n].numel() * state[n].element_size() for n in names)
    groups: list[list[str]] = [[] for _ in range(shards)]
    before = 0
    for name in names:
        groups[min(shards - 1, before * shards // total)].append(name)
        before += state[name].numel() * state[name].element_size()
    if any(not g for g in groups):
        raise ValueError(f"--shards {shards} leaves a shard empty; this model has {len(names)} tensors")
    weight_map = {}
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: state[n] for n in group}, str(out / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in group})
    _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def _tokenizer_config(arch: str, tokenizer: Tokenizer, context: int) -> dict:
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    return {
        "tokenizer_class": ARCHS[arch].tokenizer_class,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "model_max_length": context,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for t, i in ids.items()
        },
        "chat_template": CHAT_TEMPLATE,
    }


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def make_params(arch: str, **params: object) -> TinyModelParams:
    """Validated parameters; unknown names and values raise ValueError naming what is allowed."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(ARCHS)}")
    known = {f.name for f in dataclasses.fields(TinyModelParams)}
    if unknown := sorted(set(params) - known):
        raise ValueError(f"unknown parameters {unknown}; known: {sorted(known)}")
    p = TinyModelParams(**params)  # type: ignore[arg-type]
    if p.dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype={p.dtype!r}; use float32, bfloat16 or float16")
    if p.rope_scaling not in (None, "llama3"):
        raise ValueError(f"rope_scaling={p.rope_scaling!r} is not supported; use None or 'llama3'")
    if p.shards < 1:
        raise ValueError(f"shards={p.shards}; use 1 or more")
    return p


def build_tiny_model(arch: str, out: str | Path, **params: object) -> Path:
    """Write a complete HF model directory at `out` (which must be empty or absent); return its path."""
    p = make_params(arch, **params)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty; choose a new --out")
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer(arch, p.vocab)
    if tokenizer.get_vocab_size() > p.vocab:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, more than vocab={p.vocab}")
    tokenizer.save(str(out / "tokenizer.json"))
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    _write_json(out / "tokenizer_config.json", _tokenizer_config(arch, tokenizer, p.context))

    config = make_config(arch, p, ids)
    _write_json(out / "config.json", _config_json(config))
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": ids[BOS_TOKEN],
            "eos_token_id": [ids[EOS_TOKEN], ids[BOS_TOKEN]],
            "pad_token_id": ids[PAD_TOKEN],
            "transformers_version": transformers.__version__,
        },
    )
    write_weights(random_state_dict(config, p.seed, p.init_std, p.dtype), out, p.shards)
    return out


def _parse_args(argv: list[str] | None = None) -> tuple[str, Path, dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", required=True, choices=sorted(ARCHS))
    parser.add_argument("--out", required=True, type=Path)
    defaults = TinyModelParams()
    for name, kind in [
        ("layers", int), ("hidden", int), ("heads", int), ("kv_heads", int), ("intermediate", int),
        ("context", int), ("vocab", int), ("head_dim", int), ("rope_theta", float), ("shards", int),
        ("seed", int), ("init_std", float),
    ]:
        parser.add_argument("--" + name.replace("_", "-"), type=kind, help=f"default {getattr(defaults, name)}")
    parser.add_argument("--tie-word-embeddings", action="store_true", default=None)
    parser.add_argument("--rope-scaling", choices=["llama3"])
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    args = vars(parser.parse_args(argv))
    arch, out = args.pop("arch"), args.pop("out")
    return arch, out, {k: v for k, v in args.items() if v is not None}


def main(argv: list[str] | None = None) -> None:
    arch, out, params = _parse_args(argv)
    path = build_tiny_model(arch, out, **params)
    files = sorted(f.name for f in path.iterdir())
    print(f"wrote {arch} tiny model to {path}: {', '.join(files)}")


if __name__ == "__main__":
    main()
