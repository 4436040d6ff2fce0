"""Our server against its peers on the same model, workloads and client: one table of ratios.

Servers, each started fresh for every (workload, dtype) measurement, warmed up by one untimed request:
  ours          python -m srt.launch_server --enable-metrics (prefix hit rate from /metrics)
  transformers  transformers serve MODEL --continuous-batching (`pip install transformers[serving]`)
  llama.cpp     llama-server, only with --llama-server BIN; the HF folder is converted once per dtype
                to a GGUF (f32 / bf16) with llama.cpp's convert_hf_to_gguf.py into .tiny_models/.gguf/
Workloads are scripts/bench_serving.py's (as a library; OpenAI /v1/completions, greedy, EOS ignored so
every server writes the same tokens): random, generated-shared-prefix, multi-turn, at --concurrency.
Each run leaves its server's log and one JSON line per request (start, TTFT, latency, tokens) in --log-dir.

    python scripts/bench_peers.py --quick                         # smoke run on the demo model
    python scripts/bench_peers.py --model smollm2                 # the full run (SmolLM2-135M-Instruct)
    python scripts/bench_peers.py --model llama-26m               # the full run on a ~25M-parameter Llama
    python scripts/bench_peers.py --model smollm2 --llama-server /tmp/llama_build/build/bin/llama-server
    python scripts/bench_peers.py --model llama-26m --workloads random --repeats 5   # medians of 5 paired rounds

Building llama-server offline from PyPI (212 compile steps: tens of minutes on 2 cores):
    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d /tmp/llama_build
    tar xzf /tmp/llama_build/llama_cpp_python-0.3.36.tar.gz -C /tmp/llama_build
    cd /tmp/llama_build/llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -B /tmp/llama_build/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON \\
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
    cmake --build /tmp/llama_build/build --target llama-server -j2
--llama-cpp-dir (default: the source tree named in the build's CMakeCache.txt) holds
convert_hf_to_gguf.py, which needs `sentencepiece` even for BPE models and recognises SmolLM2's
tokenizer, not the demo model's home-made one.
Models: demo (srt/demo_model, context 512: --quick only), smollm2 (SmolLM2-135M-Instruct, fp32, built by
scripts/make_real_model.py), llama-26m (a randomly initialised ~25M-parameter Llama with SmolLM2's tokenizer
and 8k context, built by scripts/make_bench_llama.py: the same workloads at a fifth of the weights), or the
path of a Hugging Face folder.
Ratios are ours/peer: above 1 for tok/s and below 1 for TTFT mean ours is better. Under the table, a
line per dtype says what each server keeps its KV cache in: llama-server stores f16 K/V even for f32
weights unless --llama-args sets -ctk / -ctv; ours follows the weights unless --our-args sets
--kv-cache-dtype.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import aiohttp

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))
import bench_serving as bs  # noqa: E402  (scripts/ is not a package)
# HEADER and ratio: re-exported for callers and tests of this script.
from bench_peers_table import HEADER, Key, build_rows, format_table, kv_cache_dtypes, ratio  # noqa: E402,F401

REPO_ROOT = SCRIPTS.parent
GGUF_CACHE = REPO_ROOT / ".tiny_models" / ".gguf"  # git-ignored, beside the other built models
SERVERS = ("ours", "transformers", "llama.cpp")
DTYPES = {"fp32": ("float32", "f32"), "bf16": ("bfloat16", "bf16")}  # ours / transformers, GGUF outtype
WORKLOADS = ("random", "generated-shared-prefix", "multi-turn")
START_TIMEOUT_S = 600.0


# ---------------------------------------------------------------------------------------- workloads
@dataclass(frozen=True)
class Sizes:
    """Workload sizes; the defaults are the full run, `quick()` a smoke run that fits a 512 context."""

    random_prompts: int = 64
    random_input_min: int = 64
    random_input_max: int = 512
    random_output: int = 64
    gsp_groups: int = 8
    gsp_per_group: int = 8
    gsp_system: int = 1024
    gsp_question: int = 64
    gsp_output: int = 32
    mt_conversations: int = 16
    mt_turns: int = 4
    mt_user: int = 64
    mt_output: int = 32
    concurrency: int = 16

    @classmethod
    def quick(cls) -> Sizes:
        return cls(random_prompts=4, random_input_min=16, random_input_max=64, random_output=16, gsp_groups=2,
                   gsp_per_group=4, gsp_system=96, gsp_question=16, gsp_output=16, mt_conversations=4, mt_turns=2,
                   mt_user=32, mt_output=16, concurrency=4)

    def longest(self, workload: str) -> int:
        """Most prompt words plus output tokens one request of `workload` holds (a context lower bound)."""
        if workload == "random":
            return self.random_input_max + self.random_output
        if workload == "generated-shared-prefix":
            return self.gsp_system + self.gsp_question + self.gsp_output
        return self.mt_turns * (self.mt_user + self.mt_output)


def bench_argv(workload: str, s: Sizes, base_url: str) -> List[str]:
    """bench_serving.py's command line for one workload against one server."""
    common = ["--backend", "openai", "--base-url", base_url, "--dataset-name", workload,
              "--max-concurrency", str(s.concurrency), "--seed", "1"]
    if workload == "random":
        return common + ["--num-prompts", str(s.random_prompts), "--random-input-len", str(s.random_input_max),
                         "--random-range-ratio", str(s.random_input_min / s.random_input_max),
                         "--random-output-len", str(s.random_output)]
    if workload == "generated-shared-prefix":
        return common + ["--gsp-num-groups", str(s.gsp_groups), "--gsp-prompts-per-group", str(s.gsp_per_group),
                         "--gsp-system-prompt-len", str(s.gsp_system), "--gsp-question-len", str(s.gsp_question),
                         "--gsp-output-len", str(s.gsp_output)]
    return common + ["--multi-turn-conversations", str(s.mt_conversations), "--multi-turn-turns", str(s.mt_turns),
                     "--multi-turn-user-len", str(s.mt_user), "--multi-turn-output-len", str(s.mt_output)]


# ---------------------------------------------------------------------------------------- client
class PeerClient(bs.Client):
    """bench_serving's OpenAI client, with each server's way of saying "greedy, ignore EOS"."""

    def __init__(self, args: argparse.Namespace, session: aiohttp.ClientSession, model: str, server: str) -> None:
        super().__init__(args, session, model, time.perf_counter())
        self.server = server

    def _payload(self, prompt: Any, output_len: int) -> Dict[str, Any]:
        body = super()._payload(prompt, output_len)
        if self.server == "transformers":
            # Unknown fields get a 422 there; an eos of -1 disables stopping (continuous batching
            # takes its generation config from the first request, so every request sends the same).
            body.pop("ignore_eos", None)
            body["generation_config"] = json.dumps({"do_sample": False, "eos_token_id": -1})
        return body

    def _absorb(self, event: Dict[str, Any], record: bs.Record) -> bool:
        grew = super()._absorb(event, record)
        if grew and not event.get("usage"):
            record.output_tokens += 1  # one token a chunk until a usage block (if any) gives the count
        return grew


async def _warm_up(client: PeerClient, timeout: float) -> None:
    """One untimed request, retried while the server still starts (503s, refused connections)."""
    deadline, record = time.monotonic() + timeout, bs.Record(-1, 0)
    while time.monotonic() < deadline:
        record = bs.Record(-1, 0)
        await client.send(" the of and to in is was", 4, record)
        if record.success:
            return
        await asyncio.sleep(1.0)
    raise RuntimeError(f"warm-up request kept failing for {timeout:.0f}s: {record.error}")


async def measure(argv: List[str], server: str, fixed_output: Optional[int],
                  records_file: Optional[Path] = None) -> Dict[str, Any]:
    """Run one workload against a ready server; bench_serving's summary plus the expected token count.
    `records_file`: also write one JSON line per request (start, TTFT, latency, tokens)."""
    args = bs.parse_args(argv)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    # force_close: one connection per request. llama-server closes idle keep-alive connections on
    # its side, and a pooled one reused after that fails with "Can not write request body" (a lost
    # request, and in multi-turn a lost conversation); a fresh connection costs every server the same.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model, vocab = await bs.discover(args, session)
        rng = random.Random(args.seed)
        work = bs.build_work(args, bs.PromptMaker(args.backend, vocab, rng))
        for turn in (t for item in work for t in item.turns if fixed_output is not None):
            turn.output_len = fixed_output  # bench_serving's range ratio varies outputs too; the issue fixes them
        client = PeerClient(args, session, model, server)
        await _warm_up(client, START_TIMEOUT_S)
        before = await bs.prefix_counters(session, args.base_url)
        client.t0 = start = time.perf_counter()
        records = await bs.run_all(client, work, args.request_rate, args.max_concurrency, rng)
        duration = time.perf_counter() - start
        after = await bs.prefix_counters(session, args.base_url)
    summary = bs.summarize(args, records, duration, before, after)
    if records_file is not None:
        with open(records_file, "w") as f:
            f.writelines(json.dumps({**asdict(r), "itl": None}) + "\n" for r in records)
    summary["expected_output_tokens"] = sum(t.output_len for item in work for t in item.turns)
    summary["errors"] = sorted({r.error for r in records if r.error})[:3]
    return summary


# ---------------------------------------------------------------------------------------- servers
@dataclass
class Launched:
    """A server process in its own session (so stopping it reaches every child it started)."""

    name: str
    argv: List[str]
    port: int
    log_path: Path
    proc: Optional[subprocess.Popen] = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, env: Dict[str, str]) -> "Launched":
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(self.argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        return self

    def wait_healthy(self, timeout: float) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) before it was ready:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} did not answer /health within {timeout:.0f}s:\n{self.tail()}")

    def tail(self, lines: int = 15) -> str:
        """The last lines of the server's log, for start-up failures."""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 30.0) -> None:
        """Ctrl-C to the server (it stops its own children), then SIGKILL to its process group."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        try:  # children that outlived their parent (same group)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def server_argv(name: str, model: Path, dtype: str, port: int, opts: argparse.Namespace) -> List[str]:
    """The command line of one server for one dtype."""
    torch_dtype, gguf_type = DTYPES[dtype]
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if name == "ours":
        return [sys.executable, "-m", "srt.launch_server", "--model-path", str(model), "--dtype", torch_dtype,
                "--enable-metrics", *host, *shlex.split(opts.our_args)]
    if name == "transformers":
        return [sys.executable, "-m", "transformers.cli.transformers", "serve", str(model), "--continuous-batching",
                "--dtype", torch_dtype, *host, *shlex.split(opts.transformers_args)]
    slots = opts.sizes.concurrency
    per_slot = max(opts.sizes.longest(w) for w in opts.workloads) * 2 + 64  # words -> tokens, with margin
    threads = ["-t", str(opts.threads)] if opts.threads else []
    return [str(opts.llama_server), "-m", str(llama_gguf(model, gguf_type, opts)), *host, "-np", str(slots),
            "-c", str(per_slot * slots), *threads, *shlex.split(opts.llama_args)]


def llama_gguf(model: Path, gguf_type: str, opts: argparse.Namespace) -> Path:
    """The model as a GGUF of `gguf_type`, converted once with llama.cpp's convert_hf_to_gguf.py."""
    out = GGUF_CACHE / f"{model.name}-{gguf_type}.gguf"  # never inside the model folder (the demo's is tracked)
    if out.is_file():
        return out
    GGUF_CACHE.mkdir(parents=True, exist_ok=True)
    script = opts.llama_cpp_dir / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise RuntimeError(f"{script} not found: pass --llama-cpp-dir (the llama.cpp source tree)")
    tmp = out.with_suffix(".partial")
    cmd = [sys.executable, str(script), str(model), "--outtype", gguf_type, "--outfile", str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`{shlex.join(cmd)}` failed:\n" + "\n".join(proc.stderr.splitlines()[-10:]))
    tmp.rename(out)
    return out


def server_env(threads: Optional[int]) -> Dict[str, str]:
    """Offline Hugging Face, this repo importable, and the same thread count for all when asked."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_one(workload: str, dtype: str, name: str, model: Path, opts: argparse.Namespace,
            rnd: Optional[int] = None) -> Optional[Dict[str, Any]]:
    """Start a fresh `name` server, measure `workload` on it, stop it; None (and why, on stderr) if it
    failed. `rnd`: the round of a --repeats run (in the log's name)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = opts.log_dir / f"{name}-{dtype}-{workload}{'' if rnd is None else f'-round{rnd}'}.log"
    print(f"[bench_peers] {workload} / {dtype} / {name}: starting (log {log})", flush=True)
    server = Launched(name, [], port, log)
    try:
        server.argv = server_argv(name, model, dtype, port, opts)
        server.start(server_env(opts.threads)).wait_healthy(START_TIMEOUT_S)
        fixed = opts.sizes.random_output if workload == "random" else None
        summary = asyncio.run(measure(bench_argv(workload, opts.sizes, server.url), name, fixed,
                                      log.with_suffix(".requests.jsonl")))
    except (RuntimeError, OSError) as exc:
        print(f"[bench_peers] {workload} / {dtype} / {name} failed: {exc}", file=sys.stderr, flush=True)
        return None
    finally:
        server.stop()
    if summary["errors"]:
        print(f"[bench_peers]   request errors: {summary['errors']}", file=sys.stderr, flush=True)
    return summary


# ---------------------------------------------------------------------------------------- main
def resolve_model(name: str) -> Path:
    if name == "demo":
        return REPO_ROOT / "srt" / "demo_model"
    if name == "smollm2":
        import make_real_model

        return make_real_model.get_real_model()
    if name == "llama-26m":
        import make_bench_llama

        return make_bench_llama.get_bench_llama()
    return Path(name).resolve()


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo", help="demo (srt/demo_model), smollm2 (scripts/make_real_model.py), "
                   "llama-26m (scripts/make_bench_llama.py) or a Hugging Face folder.")
    p.add_argument("--quick", action="store_true", help="Smoke-run sizes (Sizes.quick), fit for the demo model.")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=None,
                   help="Default: ours and transformers, plus llama.cpp when --llama-server is given.")
    p.add_argument("--llama-server", type=Path, default=None, help="Path of a llama-server binary.")
    p.add_argument("--llama-cpp-dir", type=Path, default=None, help="llama.cpp tree with convert_hf_to_gguf.py.")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for every server, -t for llama.cpp.")
    p.add_argument("--repeats", type=int, default=1,
                   help="Rounds per workload and dtype, each running every server (in alternating order); "
                        "the table gives medians and the median of the per-round ratios.")
    p.add_argument("--our-args", default="", help="Extra flags for launch_server, one string; with the '=' "
                   "when it starts with a dash: --our-args='--enable-torch-compile'.")
    p.add_argument("--transformers-args", default="",
                   help="Extra flags for transformers serve, one string (--transformers-args='...').")
    p.add_argument("--llama-args", default="", help="Extra flags for llama-server, one string (--llama-args='...').")
    p.add_argument("--log-dir", type=Path, default=None, help="Server logs (default: a new temporary folder).")
    p.add_argument("--output", type=Path, default=None, help="Write every summary as JSON lines here.")
    for name, value in vars(Sizes()).items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=f"full-run default {value}")
    opts = p.parse_args(argv)
    base = Sizes.quick() if opts.quick else Sizes()
    overrides = {k: getattr(opts, k) for k in vars(base) if getattr(opts, k) is not None}
    opts.sizes = Sizes(**{**vars(base), **overrides})
    if opts.servers is None:
        opts.servers = ["ours", "transformers"] + (["llama.cpp"] if opts.llama_server else [])
    if "llama.cpp" in opts.servers:
        if opts.llama_server is None or not opts.llama_server.is_file():
            p.error(f"--servers llama.cpp needs --llama-server BIN (an existing file), got {opts.llama_server}")
        opts.llama_cpp_dir = opts.llama_cpp_dir or llama_source_dir(opts.llama_server)
    if opts.repeats < 1:
        p.error(f"--repeats must be at least 1, got {opts.repeats}")
    opts.log_dir = opts.log_dir or Path(tempfile.mkdtemp(prefix="bench-peers-"))
    opts.log_dir.mkdir(parents=True, exist_ok=True)
    return opts


def llama_source_dir(binary: Path) -> Path:
    """The llama.cpp tree a build/bin/llama-server was configured from (CMAKE_HOME_DIRECTORY)."""
    cache = binary.resolve().parents[1] / "CMakeCache.txt"
    for line in cache.read_text().splitlines() if cache.is_file() else []:
        if line.startswith("CMAKE_HOME_DIRECTORY:"):
            return Path(line.split("=", 1)[1])
    return binary.resolve().parents[2]  # an in-tree build: llama.cpp/build/bin/llama-server


def check_context(model: Path, opts: argparse.Namespace) -> None:
    """Refuse sizes that cannot fit the model's context (prompt words are at least that many tokens)."""
    context = json.loads((model / "config.json").read_text()).get("max_position_embeddings")
    too_long = [w for w in opts.workloads if context and opts.sizes.longest(w) > context]
    if too_long:
        longest = max(opts.sizes.longest(w) for w in too_long)
        sys.exit(f"{model.name}: context {context} is shorter than the longest request of {', '.join(too_long)} "
                 f"({longest} prompt words + output tokens); use --quick, smaller sizes, --model smollm2 "
                 "or --model llama-26m.")


def main(argv: Optional[List[str]] = None) -> int:
    opts = parse_args(argv)
    model = resolve_model(opts.model)
    check_context(model, opts)
    print(f"[bench_peers] model {model}, servers {opts.servers}, sizes {opts.sizes}", flush=True)
    results: Dict[Key, Any] = {}
    for workload, dtype in itertools.product(opts.workloads, opts.dtypes):
        for rnd in range(opts.repeats):
            # Rounds alternate the servers' order, so a drift of the machine's speed during a
            # round does not favour the server that always runs first.
            for name in (opts.servers if rnd % 2 == 0 else opts.servers[::-1]):
                summary = run_one(workload, dtype, name, model, opts, None if opts.repeats == 1 else rnd)
                if opts.repeats == 1:
                    results[(workload, dtype, name)] = summary
                else:
                    results.setdefault((workload, dtype, name), []).append(summary)
                if opts.output:  # line by line, so a run that dies half-way keeps what it measured
                    with opts.output.open("a") as f:
                        f.write(json.dumps({"workload": workload, "dtype": dtype, "server": name, "round": rnd,
                                            "summary": summary}) + "\n")
    results = {key: results[key] for key in itertools.product(opts.workloads, opts.dtypes, opts.servers)}
    print(f"\nmodel {model.name}, concurrency {opts.sizes.concurrency}; ratios are ours/peer")
    print(format_table(build_rows(results)))
    for dtype in opts.dtypes:
        kv = kv_cache_dtypes(opts, dtype)
        print(f"KV cache under {dtype} weights: " + ", ".join(f"{name} {kv[name]}" for name in opts.servers))
    complete = all(s and not s["failed"] and s["total_output_tokens"] == s["expected_output_tokens"]
                   for v in results.values() for s in (v if isinstance(v, list) else [v]))
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
