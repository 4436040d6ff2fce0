"""Frontend language vs plain requests: prefill tokens computed and wall time of a 4-way fork +
select program, run as `run_batch` of --num-programs, against the same logical requests sent one
by one to /generate without the language.

    python scripts/bench_lang.py                               # starts a demo-model server itself
    python scripts/bench_lang.py --url http://127.0.0.1:30000 --num-programs 64 --num-threads 16

Each program is a ~350-token shared prefix (instructions and solved examples) plus a short
question of its own; it forks into 4 reviewers that each `gen` a short answer, joins them, and
`select`s a verdict out of 4 choices. The baseline sends each branch's full prompt as its own
request and scores each choice with its own full-text request (logprobs from the verdict on, so
the prefix cache may serve the rest). Both runs start from an empty cache (/flush_cache);
tokens requested and cached come from the server's /metrics counters (needs --enable-metrics),
and computed = requested - cached. The server started here runs float32: in bfloat16 a greedy
answer can flip with how the cache split its prompt, and the two runs' texts are compared.
"""

from __future__ import annotations

import argparse
import logging
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import requests

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import srt.lang as sgl  # noqa: E402

logger = logging.getLogger("bench_lang")

SYSTEM = ("You are a panel of four reviewers who read questions about free software licenses and the "
          "Python language. Each reviewer answers in a few words on one line, then the panel gives one "
          "verdict: yes, no, unclear or depends.\n\n")
SHOTS = (
    ("May I sell copies of a program under the GPL?",
     ("Yes, for any price.", "Yes, but source must follow.", "Yes; the license allows a fee.",
      "Yes, with the same freedoms."), "yes"),
    ("Can I add terms that forbid modification?",
     ("No, that is a further restriction.", "No.", "No; section 10 forbids it.",
      "No, recipients keep their rights."), "no"),
    ("Does a Python class need an __init__ method?",
     ("No, it is optional.", "Only to set attributes.", "No; object provides one.",
      "It depends on the class."), "depends"),
)
ACTIONS = ("copy", "modify", "sell", "translate", "link", "fork", "relicense", "patch")
OBJECTS = ("the library", "a module", "the manual", "a script", "the compiler", "a theme", "the test suite",
           "a plugin")
BRANCHES = 4
ANSWER_TOKENS = 10
CHOICES = ("yes", "no", "unclear", "depends")
COUNTERS = ("num_requests", "prompt_tokens", "cached_tokens", "prefix_cache_queried_tokens",
            "prefix_cache_hit_tokens")
TARGET_X = 3.0


def shared_prefix() -> str:
    shots = "".join(f"Question: {q}\n" + "".join(f"Reviewer {i + 1}: {v}\n" for i, v in enumerate(views))
                    + f"Verdict: {verdict}\n\n" for q, views, verdict in SHOTS)
    return SYSTEM + shots


PREFIX = shared_prefix()


def questions(n: int) -> List[str]:
    """n distinct short questions (64 action x object pairs, then numbered rounds of them)."""
    pairs = [f"{a} {o}" for o in OBJECTS for a in ACTIONS]
    return [f"May I {pairs[i % len(pairs)]}{f' in round {i // len(pairs)}' if i >= len(pairs) else ''}?"
            for i in range(n)]


def branch_head(i: int) -> str:
    return f"Reviewer {i + 1}:"


@sgl.function
def panel(s, question):
    s += PREFIX + f"Question: {question}\n"
    reviewers = s.fork(BRANCHES)
    for i, reviewer in enumerate(reviewers):
        reviewer += branch_head(i) + sgl.gen("view", max_tokens=ANSWER_TOKENS, stop="\n", temperature=0)
    reviewers.join()
    for i, reviewer in enumerate(reviewers):
        s += branch_head(i) + reviewer["view"] + "\n"
    s += "Verdict: " + sgl.select("verdict", choices=list(CHOICES))


# ---------------------------------------------------------------------------------- the baseline
class PlainClient:
    """The same logical requests, one POST /generate each, no language."""

    def __init__(self, url: str, tokenizer) -> None:
        self.url, self.tokenizer = url, tokenizer
        self.session = requests.Session()

    def generate(self, text: str) -> str:
        params = {"max_new_tokens": ANSWER_TOKENS, "stop": ["\n"], "temperature": 0}
        return self._post({"text": text, "sampling_params": params})["text"]

    def select(self, text: str) -> str:
        """One full-text scoring request per choice; mean logprob of the tokens from the verdict on
        (two tokens back, as the language does, so a token merged across the boundary counts)."""
        start = max(len(self.tokenizer(text).input_ids) - 2, 0)
        scores = []
        for choice in CHOICES:
            out = self._post({"text": text + choice, "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                              "return_logprob": True, "logprob_start_len": start})
            values = [lp for lp, *_ in out["meta_info"]["input_token_logprobs"] if lp is not None]
            scores.append(sum(values) / len(values))
        return CHOICES[max(range(len(CHOICES)), key=scores.__getitem__)]

    def panel(self, question: str) -> str:
        """The program's final text: prefix, question, the reviewers' views and the verdict."""
        head = PREFIX + f"Question: {question}\n"
        views = [self.generate(head + branch_head(i)) for i in range(BRANCHES)]
        text = head + "".join(branch_head(i) + v + "\n" for i, v in enumerate(views)) + "Verdict: "
        return text + self.select(text)

    def _post(self, payload: dict) -> dict:
        resp = self.session.post(self.url + "/generate", json=payload, timeout=300)
        if resp.status_code != 200:
            raise RuntimeError(f"/generate returned {resp.status_code}: {resp.text[:500]}")
        return resp.json()


# ---------------------------------------------------------------------------------- measurement
@dataclass
class Row:
    name: str
    counters: Dict[str, float]
    wall_s: float

    @property
    def computed(self) -> float:
        return self.counters["prompt_tokens"] - self.counters["cached_tokens"]


def read_counters(url: str) -> Dict[str, float]:
    resp = requests.get(url + "/metrics", timeout=30)
    if resp.status_code != 200:
        raise RuntimeError(f"GET /metrics returned {resp.status_code}: start the server with --enable-metrics")
    values = {}
    for name in COUNTERS:
        found = re.search(rf"^sglang:{name}_total{{[^}}]*}} (\S+)$", resp.text, flags=re.MULTILINE)
        if found is None:
            raise RuntimeError(f"/metrics has no sglang:{name}_total")
        values[name] = float(found.group(1))
    return values


def measure(name: str, url: str, work) -> tuple[Row, object]:
    requests.post(url + "/flush_cache", timeout=30).raise_for_status()
    before = read_counters(url)
    t0 = time.perf_counter()
    result = work()
    wall = time.perf_counter() - t0
    after = read_counters(url)
    row = Row(name, {k: after[k] - before[k] for k in COUNTERS}, wall)
    logger.info("%s: %s, %.2f s", name, {k: int(v) for k, v in row.counters.items()}, wall)
    return row, result


def print_table(rows: List[Row], logical_requested: float) -> None:
    print("| run | requests | prompt tokens requested | computed | reuse (requested / computed) | wall s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        c = r.counters
        print(f"| {r.name} | {int(c['num_requests'])} | {int(c['prompt_tokens']):,} | {int(r.computed):,} | "
              f"{c['prompt_tokens'] / max(r.computed, 1):.2f}x | {r.wall_s:.2f} |")
    lang, plain = rows
    vs_requested = logical_requested / max(lang.computed, 1)
    vs_plain = plain.computed / max(lang.computed, 1)
    verdict = "met" if vs_requested >= TARGET_X else "NOT met"
    print(f"\nTarget >= {TARGET_X:.0f}x fewer prefill tokens computed than requested: {verdict} "
          f"({int(logical_requested):,} tokens in the logical requests / {int(lang.computed):,} computed by the "
          f"language = {vs_requested:.2f}x). Against the one-by-one run's computed tokens "
          f"({int(plain.computed):,}, which the radix cache also reuses): {vs_plain:.2f}x. "
          f"Wall time: {plain.wall_s / lang.wall_s:.2f}x faster with the language.")


# ---------------------------------------------------------------------------------- server
@contextmanager
def demo_server(model_path: str, log_path: Path) -> Iterator[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "srt.launch_server", "--model-path", model_path, "--host", "127.0.0.1",
           "--port", str(port), "--device", "cpu", "--dtype", "float32", "--enable-metrics"]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if requests.get(url + "/health_generate", timeout=30).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError(f"server did not start (log: {log_path}):\n{log_path.read_text()[-3000:]}")
        logger.info("server %s ready (log %s)", url, log_path)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)  # the server stops its scheduler and detokenizer on Ctrl-C
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def run(url: str, args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    info = requests.get(url + "/get_model_info", timeout=30).json()
    tokenizer_path = Path(info["tokenizer_path"])
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path if tokenizer_path.is_absolute()
                                              else REPO_ROOT / tokenizer_path)
    backend = sgl.RuntimeEndpoint(url)
    plain = PlainClient(url, tokenizer)
    qs = questions(args.num_programs)
    panel.run(question="May I read the source?", backend=backend)  # warm-up, not measured
    plain.panel("May I read the source?")

    lang_row, states = measure("language run_batch", url, lambda: panel.run_batch(
        [{"question": q} for q in qs], backend=backend, num_threads=args.num_threads, progress_bar=False))
    failed = [st.error() for st in states if st.error() is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(states)} programs failed; the first: {failed[0]!r}")
    plain_row, outs = measure("one-by-one /generate", url, lambda: [plain.panel(q) for q in qs])
    same = sum(st.text() == out for st, out in zip(states, outs))
    logger.info("programs whose final text (views and verdict) is the same both ways: %d / %d", same, len(qs))
    logical = plain_row.counters["prompt_tokens"]
    print_table([lang_row, plain_row], logical)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="A running server (with --enable-metrics); default: start one.")
    parser.add_argument("--model-path", default="srt/demo_model", help="Model of the server started without --url.")
    parser.add_argument("--num-programs", type=int, default=64)
    parser.add_argument("--num-threads", type=int, default=16)
    parser.add_argument("--server-log", type=Path, default=Path("/tmp/bench_lang_server.log"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)
    if args.url:
        run(args.url.rstrip("/"), args)
    else:
        with demo_server(args.model_path, args.server_log) as url:
            run(url, args)


if __name__ == "__main__":
    main()
