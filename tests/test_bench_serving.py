"""scripts/bench_serving.py end to end: a few requests per dataset against a real server process."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from server_utils import running_server

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_serving.py"

# dataset -> (bench arguments, requests it sends)
RUNS = {
    "random": (["--dataset-name", "random", "--num-prompts", "4", "--random-input-len", "24",
                "--random-output-len", "6", "--random-range-ratio", "0.5"], 4),
    "generated-shared-prefix": (["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2",
                                 "--gsp-prompts-per-group", "2", "--gsp-system-prompt-len", "48",
                                 "--gsp-question-len", "8", "--gsp-output-len", "4",
                                 "--max-concurrency", "1"], 4),
    "multi-turn": (["--dataset-name", "multi-turn", "--multi-turn-conversations", "2", "--multi-turn-turns", "2",
                    "--multi-turn-user-len", "16", "--multi-turn-output-len", "4"], 4),
}


@pytest.fixture(scope="module")
def server(llama_model):
    with running_server(llama_model, "--enable-metrics") as handle:
        yield handle


def run_bench(server, tmp_path: Path, *args: str) -> tuple:
    out = tmp_path / "bench.jsonl"
    cmd = [sys.executable, str(SCRIPT), "--base-url", server.url, "--output-file", str(out), *args]
    if server.api_key:
        cmd += ["--api-key", server.api_key]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    return proc.stdout, [r for r in lines if r["type"] == "request"], [r for r in lines if r["type"] == "summary"]


def table_value(stdout: str, label: str) -> float:
    match = re.search(re.escape(label) + r":\s+([0-9.]+)", stdout)
    assert match, f"{label!r} missing from the table:\n{stdout}"
    return float(match.group(1))


@pytest.mark.parametrize("dataset", list(RUNS))
def test_native_backend_dataset(server, tmp_path, dataset):
    args, expected = RUNS[dataset]
    stdout, records, summaries = run_bench(server, tmp_path, "--backend", "native", *args)
    assert len(records) == expected and all(r["success"] for r in records), records
    assert len(summaries) == 1 and summaries[0]["completed"] == expected
    assert table_value(stdout, "Request throughput (req/s)") > 0
    assert table_value(stdout, "Output token throughput (tok/s)") > 0
    assert all(r["ttft"] > 0 and r["output_tokens"] > 0 for r in records)
    if dataset != "random":  # a later prompt extends an earlier one: the server reports prefix hits
        assert table_value(stdout, "Prefix cache hit rate (server)") > 0
    if dataset == "generated-shared-prefix":  # 2 groups x (2 - 1) x 48 reusable of 2 x 2 x (48 + 8) prompt tokens
        assert summaries[0]["prefix_cache_hit_rate_optimum"] == pytest.approx(96 / 224, rel=0.05)
        assert table_value(stdout, "Prefix cache hit rate (optimum)") == pytest.approx(96 / 224, abs=0.01)


def test_multi_turn_prompts_grow_by_reply_and_user_message(server, tmp_path):
    _, records, _ = run_bench(server, tmp_path, "--backend", "native", *RUNS["multi-turn"][0])
    by_conv = {}
    for r in records:
        by_conv.setdefault(r["conversation"], {})[r["turn"]] = r
    for turns in by_conv.values():
        assert turns[1]["prompt_tokens"] == turns[0]["prompt_tokens"] + turns[0]["output_tokens"] + 16
        assert turns[1]["cached_tokens"] > 0


def test_openai_backend_random(server, tmp_path):
    stdout, records, _ = run_bench(server, tmp_path, "--backend", "openai", "--dataset-name", "random",
                                   "--num-prompts", "2", "--random-input-len", "12", "--random-output-len", "4")
    assert len(records) == 2 and all(r["success"] and r["prompt_tokens"] > 0 for r in records), records
    assert table_value(stdout, "Output token throughput (tok/s)") > 0


def test_refuses_a_non_local_host():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--base-url", "http://example.com:30000"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "'example.com' is not local" in proc.stderr
