"""`launch_server --tp-size 2` on CPU (gloo): one node and two nodes on loopback give the TP = 1
server's greedy outputs; a lost rank or node takes the server down naming it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from model_utils import random_prompts
from server_utils import DEFAULT_ARGS, REPO_ROOT, free_port, running_server, server_env, start_server

PARAMS = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
TP_ARGS = ("--max-total-tokens", "4096", "--max-running-requests", "16")


def _prompts(vocab):
    return random_prompts(vocab, [4 + (9 * i) % 31 for i in range(16)], seed=12)


def _generate(handle, prompts):
    resp = handle.post("/generate", json={"input_ids": prompts, "sampling_params": PARAMS}, timeout=300)
    assert resp.status_code == 200, resp.text
    return [r["output_ids"] for r in resp.json()]


@pytest.fixture(scope="module")
def reference(llama_model):
    with running_server(llama_model, *TP_ARGS) as handle:
        vocab = handle.get("/get_model_info").json().get("vocab_size") or 512
        prompts = _prompts(vocab)
        return prompts, _generate(handle, prompts)


def _rank_pid(server_pid: int, title: str) -> int:
    for child in psutil.Process(server_pid).children(recursive=True):
        try:
            if title in " ".join(child.cmdline()):
                return child.pid
        except psutil.Error:
            continue
    raise AssertionError(f"no child process titled {title}")


def _wait_exit(proc, timeout: float) -> float:
    start = time.monotonic()
    proc.wait(timeout)
    return time.monotonic() - start


def _last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


def test_tp2_one_node_matches_tp1_and_a_dead_rank_stops_the_server(llama_model, reference):
    prompts, expected = reference
    handle = start_server(llama_model, *TP_ARGS, "--tp-size", "2")
    try:
        assert _generate(handle, prompts) == expected
        info = handle.get("/get_server_info").json()
        assert info["tp_size"] == 2
        os.kill(_rank_pid(handle.proc.pid, "srt::scheduler_TP1"), signal.SIGKILL)
        waited = _wait_exit(handle.proc, 10)
        assert handle.proc.returncode not in (0, None)
        assert waited < 5.0, f"took {waited:.1f} s"
        last = _last_line(handle.logs())
        assert "Scheduler TP1" in last and "SIGKILL" in last, last
    finally:
        handle.stop(5)


def _node1(model, addr: str, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "srt.launch_server", "--model-path", str(model), *DEFAULT_ARGS, *TP_ARGS,
           "--tp-size", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr]
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=server_env(), stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT)


@pytest.mark.parametrize("kill", ["node1", "node0"])
def test_tp2_across_two_nodes_matches_tp1_and_a_lost_node_is_named(llama_model, reference, kill, tmp_path):
    prompts, expected = reference
    addr = f"127.0.0.1:{free_port()}"
    node1 = _node1(llama_model, addr, tmp_path / "node1.log")
    node0 = start_server(llama_model, *TP_ARGS, "--tp-size", "2", "--nnodes", "2", "--node-rank", "0",
                         "--dist-init-addr", addr)
    try:
        assert _generate(node0, prompts) == expected
        victim, survivor = (node1, node0.proc) if kill == "node1" else (node0.proc, node1)
        victim.send_signal(signal.SIGKILL)
        waited = _wait_exit(survivor, 15)
        assert survivor.returncode not in (0, None)
        assert waited < 10.0, f"took {waited:.1f} s"
        text = node0.logs() if kill == "node1" else (tmp_path / "node1.log").read_text()
        lost = "TP rank 1 (node 1)" if kill == "node1" else "TP rank 0 (node 0)"
        assert lost in _last_line(text), text[-2000:]
    finally:
        node0.stop(5)
        if node1.poll() is None:
            node1.kill()
