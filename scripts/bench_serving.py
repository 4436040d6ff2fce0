"""Online serving benchmark: an async client streams requests to a running server on this machine.

    python scripts/bench_serving.py --dataset-name random --num-prompts 64 --request-rate 8
    python scripts/bench_serving.py --backend openai --dataset-name generated-shared-prefix \\
        --gsp-num-groups 8 --gsp-prompts-per-group 16 --max-concurrency 16
    python scripts/bench_serving.py --dataset-name multi-turn --multi-turn-conversations 8 --multi-turn-turns 4

Backends: `native` streams POST /generate with random token ids (`input_ids`); `openai` streams
POST /v1/completions with text of random words. Datasets:
  random                   independent prompts, lengths uniform in [len * range_ratio, len]
  generated-shared-prefix  groups of prompts sharing one system prompt, each with its own question
  multi-turn               conversations; each turn sends the whole history (earlier prompts and
                           replies) plus a new user message; turns of a conversation run in order,
                           conversations concurrently
Arrivals are Poisson at --request-rate (inf: all at once; multi-turn: conversation starts) and/or
capped by --max-concurrency. Reports throughput, TTFT / TPOT / ITL (mean, median, p99) and the
prefix-cache hit rate (server counters from /metrics before and after; needs --enable-metrics).
Writes one JSON line per request plus a summary line to --output-file, and a PNG plot when
matplotlib is installed. Only talks to 127.0.0.1 / localhost, and stops after the fixed request set.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Union
from urllib.parse import urlparse

import aiohttp

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
MAX_REQUESTS = 100_000
WORDS = (
    "the of and to in is was for that with as on by at from his her an which or be are this had not but "
    "they were have their one all we there been has when who more will would if no out so said what up its "
    "about into than them can only other new some time could these two may then do first any my now such "
    "like our over man me even most made after also did many before must through back years where much your "
    "way well down should because each just those people how too little state good very make world still "
    "own see men work long get here between both life being under never day same another know while last "
    "might us great old year off come since against go came right used take three small water house light"
).split()


# ---------------------------------------------------------------------------------------- datasets
@dataclass
class Turn:
    """One user message: token ids (native) or text (openai), and how many tokens to generate."""

    user: Union[List[int], str]
    output_len: int


@dataclass
class Work:
    """A request (one turn) or a conversation (several turns that each extend the history)."""

    conversation: int
    turns: List[Turn]


class PromptMaker:
    def __init__(self, backend: str, vocab_size: int, rng: random.Random) -> None:
        self.backend, self.vocab_size, self.rng = backend, vocab_size, rng

    def make(self, n_tokens: int) -> Union[List[int], str]:
        if self.backend == "native":
            return [self.rng.randrange(self.vocab_size) for _ in range(n_tokens)]
        return " " + " ".join(self.rng.choice(WORDS) for _ in range(n_tokens))


def _length(rng: random.Random, full: int, ratio: float) -> int:
    return rng.randint(max(1, int(full * ratio)), max(1, full))


def build_work(args: argparse.Namespace, maker: PromptMaker) -> List[Work]:
    rng, ratio = maker.rng, args.random_range_ratio
    if args.dataset_name == "random":
        return [Work(i, [Turn(maker.make(_length(rng, args.random_input_len, ratio)),
                              _length(rng, args.random_output_len, ratio))]) for i in range(args.num_prompts)]
    if args.dataset_name == "generated-shared-prefix":
        work = []
        for g in range(args.gsp_num_groups):
            system = maker.make(args.gsp_system_prompt_len)
            for _ in range(args.gsp_prompts_per_group):
                question = maker.make(args.gsp_question_len)
                work.append(Work(len(work), [Turn(system + question, args.gsp_output_len)]))
        rng.shuffle(work)  # groups interleave, as users of one system prompt arrive mixed with others
        return work
    return [Work(c, [Turn(maker.make(_length(rng, args.multi_turn_user_len, ratio)),
                          _length(rng, args.multi_turn_output_len, ratio)) for _ in range(args.multi_turn_turns)])
            for c in range(args.multi_turn_conversations)]


# ---------------------------------------------------------------------------------------- client
@dataclass
class Record:
    conversation: int
    turn: int
    start: float = 0.0           # seconds since the benchmark started
    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0            # seconds
    latency: float = 0.0
    itl: List[float] = field(default_factory=list)  # gaps between stream chunks that carried tokens

    @property
    def tpot(self) -> Optional[float]:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def _sse_events(resp: aiohttp.ClientResponse):
    """Yield the JSON payload of each `data:` event until `[DONE]`."""
    async for raw in resp.content:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


class Client:
    def __init__(self, args: argparse.Namespace, session: aiohttp.ClientSession, model: str, t0: float) -> None:
        self.args, self.session, self.model, self.t0 = args, session, model, t0

    def _payload(self, prompt: Union[List[int], str], output_len: int) -> Dict[str, Any]:
        sampling = {"temperature": 0.0, "ignore_eos": not self.args.disable_ignore_eos}
        if self.args.backend == "native":
            key = "input_ids" if isinstance(prompt, list) else "text"
            return {key: prompt, "stream": True, "sampling_params": {**sampling, "max_new_tokens": output_len}}
        body = {"model": self.model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}}
        if sampling["ignore_eos"]:
            body["ignore_eos"] = True
        return body

    async def send(self, prompt: Union[List[int], str], output_len: int, record: Record) -> Union[List[int], str]:
        """Stream one request into `record`; return the generated ids (native) or text (openai)."""
        path = "/generate" if self.args.backend == "native" else "/v1/completions"
        start = time.perf_counter()
        record.start = start - self.t0
        last, output = start, ([] if self.args.backend == "native" else "")
        try:
            async with self.session.post(self.args.base_url + path, json=self._payload(prompt, output_len)) as resp:
                if resp.status != 200:
                    record.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                    return output
                async for event in _sse_events(resp):
                    if "error" in event:
                        record.error = json.dumps(event["error"])[:500]
                        return output
                    now = time.perf_counter()
                    grew = self._absorb(event, record)
                    if grew:
                        if record.ttft == 0.0:
                            record.ttft = now - start
                        else:
                            record.itl.append(now - last)
                        last = now
                    output = self._output(event, output)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
            return output
        record.latency = time.perf_counter() - start
        record.success = record.output_tokens > 0 or output_len == 0
        if not record.success:
            record.error = "the stream ended without generated tokens"
        return output

    def _absorb(self, event: Dict[str, Any], record: Record) -> bool:
        """Update token counts from one event; True when it carried new output."""
        if self.args.backend == "native":
            meta = event.get("meta_info", {})
            tokens = int(meta.get("completion_tokens", len(event.get("output_ids", []))))
            record.prompt_tokens = int(meta.get("prompt_tokens", record.prompt_tokens))
            record.cached_tokens = int(meta.get("cached_tokens", record.cached_tokens))
            grew, record.output_tokens = tokens > record.output_tokens, max(tokens, record.output_tokens)
            return grew
        usage = event.get("usage")
        if usage:
            record.prompt_tokens = int(usage.get("prompt_tokens", 0))
            record.output_tokens = int(usage.get("completion_tokens", 0))
            details = usage.get("prompt_tokens_details") or {}
            record.cached_tokens = int(details.get("cached_tokens") or 0)
        return any(choice.get("text") for choice in event.get("choices", []))

    def _output(self, event: Dict[str, Any], output: Union[List[int], str]) -> Union[List[int], str]:
        if self.args.backend == "native":
            return list(event.get("output_ids", output))
        return output + "".join(choice.get("text", "") for choice in event.get("choices", []))


async def run_work(client: Client, work: Work, sem: Optional[asyncio.Semaphore]) -> List[Record]:
    """Turns in order; each prompt is the previous prompt + its reply + the new user message."""
    records, history = [], type(work.turns[0].user)()
    for t, turn in enumerate(work.turns):
        prompt = history + turn.user
        record = Record(work.conversation, t)
        if sem is None:
            reply = await client.send(prompt, turn.output_len, record)
        else:
            async with sem:
                reply = await client.send(prompt, turn.output_len, record)
        records.append(record)
        if not record.success:
            break  # the rest of the conversation would build on a reply that never came
        history = prompt + reply
    return records


async def run_all(client: Client, work: List[Work], rate: float, max_concurrency: Optional[int],
                  rng: random.Random) -> List[Record]:
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    tasks = []
    for i, item in enumerate(work):
        if i and math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
        tasks.append(asyncio.create_task(run_work(client, item, sem)))
    return [record for records in await asyncio.gather(*tasks) for record in records]


# ---------------------------------------------------------------------------------------- server info
async def get_json(session: aiohttp.ClientSession, url: str) -> Optional[Any]:
    try:
        async with session.get(url) as resp:
            return await resp.json(content_type=None) if resp.status == 200 else None
    except (aiohttp.ClientError, ValueError):
        return None


async def prefix_counters(session: aiohttp.ClientSession, base_url: str) -> Optional[Dict[str, float]]:
    """Server-wide prefix-cache counters from /metrics (None when the server has metrics disabled)."""
    try:
        async with session.get(base_url + "/metrics") as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except aiohttp.ClientError:
        return None
    out: Dict[str, float] = {}
    for line in text.splitlines():
        for key in ("sglang:prefix_cache_queried_tokens_total", "sglang:prefix_cache_hit_tokens_total"):
            if line.startswith(key + "{") or line.startswith(key + " "):
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out if len(out) == 2 else None


async def discover(args: argparse.Namespace, session: aiohttp.ClientSession) -> tuple:
    """(model name for the OpenAI backend, vocabulary size for random token ids)."""
    info = await get_json(session, args.base_url + "/get_model_info") or {}
    model = args.model
    if args.backend == "openai" and model is None:
        listing = await get_json(session, args.base_url + "/v1/models") or {}
        ids = [m.get("id") for m in listing.get("data", [])]
        model = ids[0] if ids else info.get("model_path")
        if model is None:
            sys.exit(f"Could not read a model name from {args.base_url}/v1/models; pass --model.")
    vocab = args.vocab_size or info.get("vocab_size")
    if vocab is None and args.backend == "native":
        config = Path(str(info.get("model_path", ""))) / "config.json"
        if config.is_file():
            vocab = json.loads(config.read_text()).get("vocab_size")
        if vocab is None:
            sys.exit("Could not find the model's vocab size (from /get_model_info or the model's config.json); "
                     "pass --vocab-size.")
    return model, int(vocab or 0)


# ---------------------------------------------------------------------------------------- report
def _stats_ms(values: List[float]) -> Dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    xs = sorted(v * 1000 for v in values)

    def pct(q: float) -> float:  # linear interpolation, as numpy.percentile
        k = (len(xs) - 1) * q
        lo = math.floor(k)
        return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)

    return {"mean": sum(xs) / len(xs), "median": pct(0.5), "p99": pct(0.99)}


def summarize(args: argparse.Namespace, records: List[Record], duration: float,
              before: Optional[Dict[str, float]], after: Optional[Dict[str, float]]) -> Dict[str, Any]:
    ok = [r for r in records if r.success]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    server_rate = None
    if before is not None and after is not None:
        queried = after["sglang:prefix_cache_queried_tokens_total"] - before["sglang:prefix_cache_queried_tokens_total"]
        hit = after["sglang:prefix_cache_hit_tokens_total"] - before["sglang:prefix_cache_hit_tokens_total"]
        server_rate = hit / queried if queried > 0 else 0.0
    return {
        "type": "summary", "backend": args.backend, "dataset": args.dataset_name,
        "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
        "completed": len(ok), "failed": len(records) - len(ok), "duration_s": duration,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration, "input_throughput": input_tokens / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "ttft_ms": _stats_ms([r.ttft for r in ok]),
        "tpot_ms": _stats_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _stats_ms([gap for r in ok for gap in r.itl]),
        "e2e_latency_ms": _stats_ms([r.latency for r in ok]),
        "cached_tokens_ratio": sum(r.cached_tokens for r in ok) / input_tokens if input_tokens else 0.0,
        "server_prefix_cache_hit_rate": server_rate,
        "prefix_cache_hit_rate_optimum": _optimum_hit_rate(args, input_tokens) if len(ok) == len(records) else None,
    }


def _optimum_hit_rate(args: argparse.Namespace, input_tokens: int) -> Optional[float]:
    """generated-shared-prefix: the best a prefix cache can do is to compute each group's system
    prompt once, so (prompts per group - 1) x system length per group is reusable (approximate
    where the backend retokenizes text)."""
    if args.dataset_name != "generated-shared-prefix" or not input_tokens:
        return None
    reusable = args.gsp_num_groups * (args.gsp_prompts_per_group - 1) * args.gsp_system_prompt_len
    return reusable / input_tokens


def print_table(s: Dict[str, Any]) -> None:
    rate = s["server_prefix_cache_hit_rate"]
    rows = [
        ("Backend", s["backend"]), ("Dataset", s["dataset"]), ("Traffic request rate", s["request_rate"]),
        ("Max request concurrency", s["max_concurrency"] or "not set"),
        ("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
        ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
        ("Total input tokens", s["total_input_tokens"]), ("Total generated tokens", s["total_output_tokens"]),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Input token throughput (tok/s)", f"{s['input_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}"),
    ]
    for key, title in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_latency_ms", "E2E Latency")):
        rows.append((None, title))
        rows += [(f"{stat.capitalize() if stat != 'p99' else 'P99'} {title} (ms)", f"{s[key][stat]:.2f}")
                 for stat in ("mean", "median", "p99")]
    rows.append((None, "Prefix cache"))
    rows.append(("Cached / prompt tokens (responses)", f"{s['cached_tokens_ratio']:.3f}"))
    rows.append(("Prefix cache hit rate (server)",
                 "n/a (server started without --enable-metrics)" if rate is None else f"{rate:.3f}"))
    if s.get("prefix_cache_hit_rate_optimum") is not None:
        best = s["prefix_cache_hit_rate_optimum"]
        share = f" ({rate / best:.1%} of it)" if rate is not None and best else ""
        rows.append(("Prefix cache hit rate (optimum)", f"{best:.3f}{share}"))
    print("{:=^60}".format(" Serving Benchmark Result "))
    for name, value in rows:
        print("{:-^60}".format(value) if name is None else f"{name + ':':<42}{value}")
    print("=" * 60)


def write_outputs(args: argparse.Namespace, records: List[Record], summary: Dict[str, Any]) -> None:
    if args.output_file:
        with open(args.output_file, "w") as f:
            for r in records:
                f.write(json.dumps({"type": "request", **asdict(r), "tpot": r.tpot}) + "\n")
            f.write(json.dumps(summary) + "\n")
        print(f"Wrote {len(records)} request records and a summary to {args.output_file}")
    plot_file = args.plot_file or (str(Path(args.output_file).with_suffix(".png")) if args.output_file else None)
    if plot_file is None:
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("Skipping the plot: matplotlib is not installed (pip install matplotlib).")
        return
    ok = [r for r in records if r.success]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.scatter([r.start for r in ok], [r.ttft * 1000 for r in ok], s=8, label="TTFT")
    ax1.scatter([r.start for r in ok], [r.latency * 1000 for r in ok], s=8, label="E2E latency")
    ax1.set(xlabel="request start (s)", ylabel="ms", title="Latency by arrival")
    ax1.legend()
    ax2.hist([gap * 1000 for r in ok for gap in r.itl], bins=40)
    ax2.set(xlabel="inter-token latency (ms)", ylabel="chunks", title="ITL distribution")
    fig.suptitle(f"{summary['backend']} / {summary['dataset']}: {summary['output_throughput']:.1f} output tok/s")
    fig.tight_layout()
    fig.savefig(plot_file, dpi=100)
    print(f"Wrote plot to {plot_file}")


# ---------------------------------------------------------------------------------------- main
async def main_async(args: argparse.Namespace) -> Dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as session:
        model, vocab = await discover(args, session)
        rng = random.Random(args.seed)
        work = build_work(args, PromptMaker(args.backend, vocab, rng))
        if sum(len(w.turns) for w in work) > MAX_REQUESTS:
            sys.exit(f"Refusing to send more than {MAX_REQUESTS} requests.")
        before = await prefix_counters(session, args.base_url)
        t0 = time.perf_counter()
        records = await run_all(Client(args, session, model, t0), work, args.request_rate, args.max_concurrency, rng)
        duration = time.perf_counter() - t0
        after = await prefix_counters(session, args.base_url)
    summary = summarize(args, records, duration, before, after)
    print_table(summary)
    write_outputs(args, records, summary)
    for r in records:
        if r.error:
            print(f"request {r.conversation}/{r.turn} failed: {r.error}", file=sys.stderr)
    return summary


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("native", "openai"), default="native")
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="Server URL (127.0.0.1/localhost only).")
    p.add_argument("--model", default=None, help="Model name for the OpenAI backend (default: first of /v1/models).")
    p.add_argument("--api-key", default=None, help="Sent as Authorization: Bearer.")
    p.add_argument("--vocab-size", type=int, default=None, help="For random ids (default: from the server's model).")
    p.add_argument("--dataset-name", choices=("random", "generated-shared-prefix", "multi-turn"), default="random")
    p.add_argument("--num-prompts", type=int, default=32, help="random: number of requests.")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=1.0,
                   help="random and multi-turn lengths are uniform in [len * ratio, len].")
    p.add_argument("--gsp-num-groups", type=int, default=4)
    p.add_argument("--gsp-prompts-per-group", type=int, default=8)
    p.add_argument("--gsp-system-prompt-len", type=int, default=512)
    p.add_argument("--gsp-question-len", type=int, default=64)
    p.add_argument("--gsp-output-len", type=int, default=32)
    p.add_argument("--multi-turn-conversations", type=int, default=8)
    p.add_argument("--multi-turn-turns", type=int, default=4)
    p.add_argument("--multi-turn-user-len", type=int, default=64, help="Tokens (words) per new user message.")
    p.add_argument("--multi-turn-output-len", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals per second (multi-turn: conversation starts); inf = all at once.")
    p.add_argument("--max-concurrency", type=int, default=None, help="Cap on requests in flight.")
    p.add_argument("--disable-ignore-eos", action="store_true",
                   help="Let requests stop at EOS (default: generate exactly the output length).")
    p.add_argument("--request-timeout", type=float, default=600.0, help="Seconds before one request fails.")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", default=None, help="JSONL: one line per request, then a summary line.")
    p.add_argument("--plot-file", default=None, help="PNG (default: the output file with .png; needs matplotlib).")
    args = p.parse_args(argv)
    args.base_url = args.base_url.rstrip("/")
    host = urlparse(args.base_url).hostname
    if host not in LOCAL_HOSTS:
        p.error(f"--base-url host {host!r} is not local; this benchmark only targets {', '.join(LOCAL_HOSTS)}.")
    for name in ("num_prompts", "random_input_len", "gsp_num_groups", "gsp_prompts_per_group", "gsp_system_prompt_len",
                 "gsp_question_len", "multi_turn_conversations", "multi_turn_turns", "multi_turn_user_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
    if not 0.0 <= args.random_range_ratio <= 1.0:
        p.error(f"--random-range-ratio must be in [0, 1], got {args.random_range_ratio}.")
    if args.request_rate <= 0:
        p.error(f"--request-rate must be > 0 (inf = all at once), got {args.request_rate}.")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error(f"--max-concurrency must be >= 1, got {args.max_concurrency}.")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    summary = asyncio.run(main_async(parse_args(argv)))
    return 0 if summary["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
