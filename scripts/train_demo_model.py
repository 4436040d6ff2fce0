"""Train the embedded demo model: a ~1M-parameter Llama chat model, on CPU, in a few minutes.

The corpus is text every machine here carries (/usr/share/common-licenses and CPython's pydoc
topics), plus ChatML pairs built from its paragraphs ("Tell me about X" -> a paragraph on X), so
both plain completion and the chat template produce readable English with no download. One
document in ten is held out. The folder written is plain Hugging Face format (LlamaForCausalLM,
safetensors, byte-level BPE, ChatML template), loaded by the runtime's ordinary loading path.

    python scripts/train_demo_model.py                # the committed model: 1200 steps, ~10 min on one core
    python scripts/train_demo_model.py --minutes 3    # as many steps as fit in 3 minutes (report says how many)
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import random
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_tiny_model as mtm  # noqa: E402  (scripts/ is not a package)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "srt" / "demo_model"
DEFAULT_REPORT = REPO_ROOT / "docs" / "demo_model.md"
# No question ends in a phrase a plain prompt would (such as "... license say?"), or plain
# completions learn to stop after a few words as if they were questions.
QUESTIONS = ("Tell me about {}.", "Explain {}, please.", "Can you describe {}?", "Tell me more about {}.")
DEFAULT_STEPS = 1200  # where held-out loss is still falling but slowly; see docs/demo_model.md
SAMPLE_PROMPT = "The license"
SAMPLE_CHAT = "Tell me about the GPL-3 license."


@dataclass(frozen=True)
class DemoConfig:
    """Model shape and training recipe; every number in the report comes from here."""

    vocab: int = 2048
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 352
    context: int = 512
    rope_theta: float = 10000.0
    seq_len: int = 512
    batch: int = 4
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_windows: int = 16
    holdout_every: int = 10
    seed: int = 0
    save_dtype: str = "bfloat16"


@dataclass(frozen=True)
class Document:
    title: str  # how a user would name it: "the GPL-3 license", 'The "with" statement'
    text: str


def corpus_documents() -> list[Document]:
    """make_tiny_model's corpus with a title per document, same order, exact duplicates dropped."""
    docs: list[Document] = []
    for source, text in mtm.corpus_sources():
        kind, name = source.split(":", 1)
        if kind == "license":
            docs.append(Document(f"the {name} license", text))
        else:
            first = text.strip().split("\n", 1)[0].strip()
            docs.append(Document(first if 0 < len(first) <= 60 else name, text))
    unique: dict[str, Document] = {}
    for doc in docs:
        unique.setdefault(doc.text, doc)
    return list(unique.values())


def split_documents(docs: list[Document], every: int) -> tuple[list[Document], list[Document]]:
    """(train, held-out): every `every`-th document, starting at the middle of the first block."""
    held = [d for i, d in enumerate(docs) if i % every == every // 2]
    return [d for i, d in enumerate(docs) if i % every != every // 2], held


def paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks that read as prose: long enough, not a rule line or a table."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        block = block.strip("\n")
        words = re.findall(r"[A-Za-z]+", block)
        if 80 <= len(block) <= 1500 and len(words) >= 12:
            out.append(block)
    return out


def render_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The committed ChatML template, rendered by jinja2 exactly as transformers does."""
    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(mtm.CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=add_generation_prompt)


def training_units(docs: list[Document]) -> list[str]:
    """Each document as plain text after a BOS separator, and one chat pair per prose paragraph."""
    units = [mtm.BOS_TOKEN + doc.text for doc in docs]
    for doc in docs:
        for i, para in enumerate(paragraphs(doc.text)):
            question = QUESTIONS[i % len(QUESTIONS)].format(doc.title)
            units.append(render_chat([{"role": "user", "content": question}, {"role": "assistant", "content": para}]))
    return units


def token_stream(tokenizer, units: list[str], seed: int) -> torch.Tensor:
    """All units tokenized and concatenated in a seeded order, as one int64 tensor."""
    order = list(units)
    random.Random(seed).shuffle(order)
    ids: list[int] = []
    for enc in tokenizer.encode_batch(order):
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.long)


def build_model(cfg: DemoConfig, tokenizer):
    """LlamaForCausalLM from make_tiny_model's config builder, seeded HF init (std 0.02)."""
    import transformers

    params = mtm.make_params(
        "llama", layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads, kv_heads=cfg.kv_heads,
        intermediate=cfg.intermediate, context=cfg.context, vocab=cfg.vocab, rope_theta=cfg.rope_theta,
        tie_word_embeddings=True, dtype=cfg.save_dtype, seed=cfg.seed, init_std=0.02,
    )
    ids = {tok: tokenizer.token_to_id(tok) for tok in mtm.SPECIAL_TOKENS}
    config = mtm.make_config("llama", params, ids)
    torch.manual_seed(cfg.seed)
    # A copy: from_config records the float32 training dtype on the config it is given, and the
    # saved config.json must name the checkpoint's dtype (--dtype auto serves with it).
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
    return model, config


def lr_at(step: int, total: int, cfg: DemoConfig) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr at `total`."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, total - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def lm_loss(model, windows: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=windows[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, seq_len: int, max_windows: int | None) -> float:
    """Mean next-token loss over non-overlapping held-out windows (evenly spaced if capped)."""
    n = (len(stream) - 1) // seq_len
    picks = range(n) if max_windows is None or n <= max_windows else [i * n // max_windows for i in range(max_windows)]
    model.eval()
    losses = [lm_loss(model, stream[i * seq_len: i * seq_len + seq_len + 1][None]).item() for i in picks]
    model.train()
    return sum(losses) / len(losses)


def _optimizer(model, cfg: DemoConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def _steps_for_budget(model, cfg: DemoConfig, held_ids: torch.Tensor, step: int, elapsed: float,
                      minutes: float) -> int:
    """Total steps that fit `minutes`, from the warm-up's step time and one timed evaluation."""
    t0 = time.monotonic()
    heldout_loss(model, held_ids, cfg.seq_len, cfg.eval_windows)
    per_step = elapsed / step + (time.monotonic() - t0) / cfg.eval_every
    total = max(step + 1, int((minutes * 60 - elapsed) / per_step) + step)
    print(f"[train] {per_step * 1000:.0f} ms/step with evals -> {total} steps for {minutes} min", flush=True)
    return total


def train(model, cfg: DemoConfig, train_ids: torch.Tensor, held_ids: torch.Tensor,
          steps: int | None, minutes: float | None) -> tuple[dict, list[dict], int]:
    """AdamW + cosine; returns (best state by held-out loss, the loss curve, total steps).

    With `steps` None the total is fixed after warm-up from the measured step time, so that the
    run fits `minutes`; the report records it, and `--steps` with that number repeats the run.
    """
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = _optimizer(model, cfg)
    curve: list[dict] = []
    best: tuple[float, dict] = (float("inf"), {})
    total, start, cpu_start, running = steps, time.monotonic(), time.process_time(), []
    step = 0
    while total is None or step < total:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total or 10**9, cfg)
        starts = torch.randint(0, len(train_ids) - cfg.seq_len - 1, (cfg.batch,), generator=gen)
        loss = lm_loss(model, torch.stack([train_ids[s: s + cfg.seq_len + 1] for s in starts.tolist()]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        running.append(loss.item())
        step += 1
        if total is None and step == cfg.warmup:
            total = _steps_for_budget(model, cfg, held_ids, step, time.monotonic() - start, minutes)
        if step % cfg.eval_every == 0 or step == total:
            held = heldout_loss(model, held_ids, cfg.seq_len, cfg.eval_windows)
            row = dict(step=step, tokens=step * cfg.batch * cfg.seq_len, seconds=time.monotonic() - start,
                       cpu=time.process_time() - cpu_start,
                       train=sum(running) / len(running), heldout=held, lr=opt.param_groups[0]["lr"])
            curve.append(row)
            running = []
            print("[train] step {step:5d}  {seconds:6.1f}s  train {train:.3f}  held-out {heldout:.3f}".format(**row),
                  flush=True)
            if held < best[0]:
                best = (held, copy.deepcopy(model.state_dict()))
    return best[1], curve, step


def _write_folder(work: Path, tokenizer, config, state: dict, cfg: DemoConfig) -> None:
    tokenizer.save(str(work / "tokenizer.json"))
    mtm._write_json(work / "tokenizer_config.json", mtm._tokenizer_config("llama", tokenizer, cfg.context))
    (work / "chat_template.jinja").write_text(mtm.CHAT_TEMPLATE + "\n", encoding="utf-8")
    mtm._write_json(work / "config.json", mtm._config_json(config))
    ids = {tok: tokenizer.token_to_id(tok) for tok in mtm.SPECIAL_TOKENS}
    mtm._write_json(work / "generation_config.json", {
        "bos_token_id": ids[mtm.BOS_TOKEN],
        "eos_token_id": [ids[mtm.EOS_TOKEN], ids[mtm.BOS_TOKEN]],
        "pad_token_id": ids[mtm.PAD_TOKEN],
    })
    dtype = getattr(torch, cfg.save_dtype)
    weights = {n: t.detach().to(dtype).contiguous() for n, t in state.items() if n != "lm_head.weight"}
    mtm.write_weights(weights, work, shards=1)


def save_model(out: Path, tokenizer, config, state: dict, cfg: DemoConfig) -> None:
    """Write into a temporary sibling, then swap it in, so `out` is never half-written."""
    if out.exists() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise ValueError(f"{out} exists and is not a model folder; choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        _write_folder(work, tokenizer, config, state, cfg)
        work.chmod(0o755)  # mkdtemp makes it private; this folder ships as package data
        for f in work.iterdir():
            f.chmod(0o644)
        if out.exists():
            shutil.rmtree(out)
        work.rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@torch.no_grad()
def greedy_text(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """Greedy continuation by full recomputation, stopping at <|im_end|> or <|endoftext|>."""
    ids = tokenizer.encode(prompt).ids
    stops = {tokenizer.token_to_id(mtm.EOS_TOKEN), tokenizer.token_to_id(mtm.BOS_TOKEN)}
    new: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax())
        if nxt in stops:
            break
        new.append(nxt)
    return tokenizer.decode(new)


def write_report(path: Path, cfg: DemoConfig, n_params: int, curve: list[dict], facts: dict) -> None:
    """docs/demo_model.md: recipe, loss curve, final held-out loss of the saved weights, samples."""
    rows = "\n".join(
        f"| {r['step']} | {r['tokens'] / 1e6:.2f} | {r['seconds']:.0f} | {r['cpu']:.0f} | {r['lr']:.2e} | {r['train']:.3f} | {r['heldout']:.3f} |"
        for r in curve
    )
    early = [r for r in curve if r["cpu"] <= 180]
    three_minutes = (f"After 3 CPU-minutes (step {early[-1]['step']}) held-out loss was {early[-1]['heldout']:.3f} "
                     "and still falling fast, which is why the default run is longer."
                     if early and early[-1] is not curve[-1] else "")
    recipe = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items())
    path.write_text(f"""# The embedded demo model

`srt/demo_model/` is what `launch_server` serves when no `--model-path` is given: a
{n_params / 1e6:.2f}M-parameter Llama-architecture chat model trained by
`scripts/train_demo_model.py` on one CPU thread in {curve[-1]['cpu'] / 60:.1f} CPU-minutes
({facts['seconds'] / 60:.1f} minutes wall clock on a shared machine) on text every machine
here carries (`/usr/share/common-licenses/*` and CPython's `pydoc_data.topics`, {facts['train_tokens']:,}
training tokens including ChatML "Tell me about X" pairs; one document in ten, {facts['held_tokens']:,}
tokens, held out). It is a demo, not a useful model: it writes license- and Python-doc-flavoured
English. Weights are stored as {cfg.save_dtype} ({facts['size_kb']:,} KB for the whole folder).

Reproduce exactly (same seed, same step count; CPU thread count can change the last digits):

    python scripts/train_demo_model.py --steps {facts['steps']}

Recipe: {recipe}; AdamW (betas 0.9/0.95), linear warm-up then cosine decay, tied embeddings.

## Loss curve (next-token cross-entropy, nats)

| step | tokens (M) | wall s | CPU s | lr | train | held-out |
|---:|---:|---:|---:|---:|---:|---:|
{rows}

The held-out column uses {cfg.eval_windows} evenly spaced windows of {cfg.seq_len} tokens. The saved
weights are the best held-out checkpoint (step {facts['best_step']}); rounded to {cfg.save_dtype} and
evaluated on all held-out windows they score {facts['final_heldout']:.3f}. {three_minutes}

## Samples (greedy, from the saved folder)

`{SAMPLE_PROMPT}` ->

```text
{SAMPLE_PROMPT}{facts['sample_plain']}
```

Chat, user: `{SAMPLE_CHAT}` -> assistant:

```text
{facts['sample_chat']}
```
""", encoding="utf-8")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"model folder (default {DEFAULT_OUT})")
    parser.add_argument("--report", type=Path, default=DEFAULT_REPORT, help="markdown report path; 'none' to skip")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, default=None, help=f"fixed step count (default {DEFAULT_STEPS})")
    budget.add_argument("--minutes", type=float, default=None, help="time budget instead of a step count")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: tiny matmuls gain little from more, and lose a lot on a busy box)")
    defaults = DemoConfig()
    for f in dataclasses.fields(DemoConfig):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(defaults, f.name)),
                            default=getattr(defaults, f.name), help=f"default {getattr(defaults, f.name)}")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    cfg = DemoConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DemoConfig)})
    torch.set_num_threads(args.threads)
    tokenizer = mtm.train_tokenizer("llama", cfg.vocab)
    train_docs, held_docs = split_documents(corpus_documents(), cfg.holdout_every)
    train_ids = token_stream(tokenizer, training_units(train_docs), cfg.seed)
    held_ids = token_stream(tokenizer, training_units(held_docs), cfg.seed)
    model, config = build_model(cfg, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[train] {n_params:,} parameters; {len(train_ids):,} train / {len(held_ids):,} held-out tokens", flush=True)
    steps = args.steps if args.steps is not None or args.minutes is not None else DEFAULT_STEPS
    state, curve, steps = train(model, cfg, train_ids, held_ids, steps, args.minutes)
    save_model(args.out, tokenizer, config, state, cfg)

    import transformers

    saved = transformers.LlamaForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval()
    chat = render_chat([{"role": "user", "content": SAMPLE_CHAT}], add_generation_prompt=True)
    facts = dict(
        steps=steps, seconds=curve[-1]["seconds"], train_tokens=len(train_ids), held_tokens=len(held_ids),
        best_step=min(curve, key=lambda r: r["heldout"])["step"],
        final_heldout=heldout_loss(saved, held_ids, cfg.seq_len, None),
        size_kb=sum(f.stat().st_size for f in args.out.iterdir()) // 1024,
        sample_plain=greedy_text(saved, tokenizer, SAMPLE_PROMPT, 60),
        sample_chat=greedy_text(saved, tokenizer, chat, 120),
    )
    print(f"[train] saved {args.out} ({facts['size_kb']} KB); held-out {facts['final_heldout']:.3f}")
    print(f"[train] {SAMPLE_PROMPT!r} -> {facts['sample_plain']!r}\n[train] chat -> {facts['sample_chat']!r}")
    if str(args.report) != "none":
        write_report(args.report, cfg, n_params, curve, facts)
        print(f"[train] wrote {args.report}")


if __name__ == "__main__":
    main()
