"""`python -m srt.check_config` / `launch_server --dry-run` predict the server's start-up: the same
KV-pool figures as `/get_server_info` reports once the server runs, the same fatal line when it
cannot start, the bytes the loaded weights take, and the smallest change that admits a prompt."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, Optional, Tuple

import pytest
from safetensors import safe_open

from server_utils import REPO_ROOT, ServerHandle, free_port, server_env, wait_until_ready

from srt.check_config_target import ContextInfo, SizingInputs, plan_target, refusal, tokens_needed
from srt.model_executor.memory_sizing import KVCacheMemoryError, compute_kv_budget, fixed_kv_budget

CPU = ("--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1")
CAPPED = ("--max-total-tokens", "3000", "--max-running-requests", "8", "--context-length", "512")
MEMORY_BOUND = ("--mem-fraction-static", "0.001")
NO_ROOM = ("--mem-fraction-static", "0.000001")
LONG_CONTEXT_ENV = {"SRT_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}


def run_module(module: str, model: Path, *args: str, env: Optional[Dict[str, str]] = None,
               timeout: float = 180) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", module, "--model-path", str(model), *args]
    return subprocess.run(cmd, cwd=REPO_ROOT, env={**server_env(), **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)


def check_json(model: Path, *args: str, **kw) -> Tuple[subprocess.CompletedProcess, dict]:
    done = run_module("srt.check_config", model, *args, "--json", **kw)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done, json.loads(done.stdout)


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert lines, "no output"
    return lines[-1]


def settings(*extra: str) -> Tuple[str, ...]:
    """One server's flags on a port free now (check_config runs the server's port check)."""
    return (*CPU, "--port", str(free_port()), *extra)


def start_server(model: Path, args: Tuple[str, ...]) -> ServerHandle:
    """`launch_server` with exactly `args` (server_utils adds --max-total-tokens, which (b) must not have)."""
    port = int(args[args.index("--port") + 1])
    log = tempfile.NamedTemporaryFile(prefix=f"srt-check-{port}-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "srt.launch_server", "--model-path", str(model), *args],
                            cwd=REPO_ROOT, env=server_env(), stdout=log, stderr=subprocess.STDOUT)
    log.close()
    handle = ServerHandle(f"http://127.0.0.1:{port}", proc, None, port, Path(log.name))
    try:
        wait_until_ready(handle)
    except BaseException:
        handle.stop(5)
        raise
    return handle


def check_then_serve(model: Path, args: Tuple[str, ...], *check_args: str) -> Tuple[subprocess.CompletedProcess,
                                                                                   dict, dict]:
    """check_config's JSON, then the `/get_server_info` of a server started with the same flags."""
    done, check = check_json(model, *args, *check_args)
    assert done.returncode == 0, done.stderr[-3000:]
    with start_server(model, args) as server:
        info = server.get("/get_server_info").json()
    return done, check, info


def admits(n: int, make_budget) -> bool:
    """`admitted` under the budget `make_budget()` builds; no pool at all admits nothing."""
    try:
        return admitted(n, make_budget())
    except KVCacheMemoryError:
        return False


def admitted(n: int, budget) -> bool:
    """The runtime's admission rules, written out here: tokenizer manager L < C; scheduler
    L < max_req_input_len and ceil((L + 1) / P) * P <= T (the real scheduler is the oracle in
    `test_refusal_agrees_with_the_scheduler_around_the_limits`)."""
    P, T = budget.page_size, budget.max_total_num_tokens
    return n < budget.context_len and n < budget.max_req_input_len and -(-(n + 1) // P) * P <= T


# --- (a) a capped pool: every figure equal ----------------------------------------------------------

@pytest.fixture(scope="module")
def capped(llama_model):
    return check_then_serve(llama_model, settings(*CAPPED), "--target-input-len", "500")


def test_capped_pool_figures_equal_the_servers(capped):
    _, check, info = capped
    for key in ("max_total_num_tokens", "max_req_input_len", "max_req_len", "max_running_requests"):
        assert check[key] == info[key], key
    assert (check["max_total_num_tokens"], check["max_req_input_len"], check["max_running_requests"]) == (3000, 506, 8)
    assert check["context_len"] == info["context_length"] == 512
    server = info["kv_budget"]
    for key in ("cell_size", "total_bound", "running_bound", "input_bound", "weight_bytes", "mem_fraction_static",
                "page_size", "max_total_num_tokens", "max_req_input_len", "warnings"):
        assert check["kv_budget"][key] == server[key], key
    assert server["total_bound"] == "--max-total-tokens=3000"


def test_admitted_target_exits_zero(capped):
    done, check, _ = capped
    assert done.returncode == 0
    assert check["target"]["admitted"] is True and check["target"]["changes"] == []
    assert check["target"]["refused_because"] is None


# --- (b) a memory-bound pool -------------------------------------------------------------------------

def test_memory_bound_pool_matches_the_servers_arithmetic(llama_model):
    _, check, info = check_then_serve(llama_model, settings(*MEMORY_BOUND))
    server = info["kv_budget"]
    assert check["weight_bytes"] == server["weight_bytes"]
    assert check["cell_size"] == server["cell_size"]
    assert check["mem_fraction_static"] == server["mem_fraction_static"] == 0.001
    assert server["total_bound"] == check["kv_budget"]["total_bound"] == "--mem-fraction-static=0.001"
    # The same arithmetic on the server's own reading of free memory gives the server's pool exactly.
    pre = server["pre_bytes"]
    again = compute_kv_budget(pre, pre - check["weight_bytes"], check["mem_fraction_static"], check["cell_size"],
                              check["page_size"], check["context_len"], None, None, "cpu")
    assert again.to_dict() == server
    assert again.max_total_num_tokens == info["max_total_num_tokens"]
    # Free host memory moves between the two readings, so check_config's pool is close, not equal.
    assert check["max_total_num_tokens"] == pytest.approx(info["max_total_num_tokens"], rel=0.05)


# --- (c) a start-up that fails ----------------------------------------------------------------------

def test_failing_start_up_ends_with_the_servers_error(llama_model):
    args = settings(*NO_ROOM)
    done, check = check_json(llama_model, *args)
    server = run_module("srt.launch_server", llama_model, *args)
    assert done.returncode == 1 and server.returncode != 0
    mine, theirs = last_line(done.stderr), last_line(server.stderr)
    assert check["ok"] is False and check["error"] == mine
    first = "Loaded weights leave no host memory for the KV cache under --mem-fraction-static=1e-06."
    assert mine.startswith(first + " Raise --mem-fraction-static above ")
    assert re.fullmatch(re.escape(mine.split(":")[0]) + r":.* \[Scheduler process, pid \d+\]", theirs), theirs
    # Beyond the first sentence only the measured numbers may differ.
    digits = re.compile(r"\d+(\.\d+)?")
    assert digits.sub("#", re.sub(r" \[Scheduler process, pid \d+\]$", "", theirs)) == digits.sub("#", mine)
    assert "T (max_total_num_tokens)" not in done.stdout  # no pool figures for a pool that is never built


def test_bad_context_length_fails_with_the_model_configs_error(llama_model):
    from srt.configs.model_config import ModelConfig

    with pytest.raises(ValueError) as expected:
        ModelConfig.load(str(llama_model), "float32", "auto", 4096)
    done, check = check_json(llama_model, *settings("--context-length", "4096"))
    assert done.returncode == 1
    assert last_line(done.stderr) == check["error"] == str(expected.value)


def test_unknown_tokenizer_class_fails_with_the_trust_remote_code_hint(llama_model, tmp_path):
    from srt.utils.hf_transformers_utils import TRUST_REMOTE_CODE_HINT

    model = tmp_path / "model"
    shutil.copytree(llama_model, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "NoSuchTokenizer"}))
    done, check = check_json(model, *settings())
    assert done.returncode == 1
    assert last_line(done.stderr).startswith(TRUST_REMOTE_CODE_HINT)
    assert check["max_total_num_tokens"] > 0  # the pool figures come first, as in the server's start-up


# --- weights -----------------------------------------------------------------------------------------

def _checkpoint_bytes(model: Path) -> int:
    total = 0
    for path in sorted(model.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            tensors = [f.get_tensor(k) for k in f.keys()]
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


@pytest.mark.parametrize("shape, dtype", [({}, "float32"), ({}, "bfloat16"), ({"tie_word_embeddings": True}, "auto")],
                         ids=["fp32", "bf16", "tied-embeddings"])
def test_weight_bytes_equal_the_loaded_models(tiny_model_factory, shape, dtype):
    from srt.model_executor.memory_sizing import module_nbytes
    from srt.model_executor.model_runner import ModelRunner
    from srt.server_args import ServerArgs

    model = tiny_model_factory("llama", **shape)
    done, check = check_json(model, *settings("--dtype", dtype))
    assert done.returncode == 0, done.stderr[-3000:]
    runner = ModelRunner(ServerArgs(model_path=str(model), dtype=dtype, device="cpu"), max_total_tokens=64,
                         max_running_requests=1)
    assert check["weight_bytes"] == module_nbytes(runner.model)
    assert check["weight_bytes_disk"] == _checkpoint_bytes(model)


# --- --target-input-len ------------------------------------------------------------------------------

def test_suggested_fraction_is_the_smallest_that_admits_the_prompt(llama_model):
    # A pool for 4M tokens needs more than 0.001 of any host's memory, so the step below is a real fraction.
    n = 4_000_000
    args = settings("--context-length", str(2 * n), "--page-size", "16", *NO_ROOM, "--target-input-len", str(n))
    done, check = check_json(llama_model, *args, env=LONG_CONTEXT_ENV)
    assert done.returncode == 1
    plan = check["target"]
    fraction = plan["min_mem_fraction_static"]
    assert plan["admitted"] is False
    assert [(c["flag"], c["value"]) for c in plan["changes"]] == [("--mem-fraction-static", f"{fraction:.3f}")]
    assert f"--mem-fraction-static {fraction:.3f}" in plan["suggestion"]
    assert last_line(done.stderr) == check["error"]  # the start-up error stays the last line
    inputs = SizingInputs(check["pre_bytes"], check["avail_bytes"], fraction, check["cell_size"], 16,
                          check["context_len"], None, None, "cpu")
    below = round(fraction - 0.001, 3)
    assert below > 0
    assert admits(n, inputs.budget)
    assert not admits(n, dataclasses.replace(inputs, fraction=below).budget)


def test_max_total_tokens_cap_below_the_need_names_the_needed_cap(llama_model):
    # Page size 16: the pool must hold 1500 + 7 tokens (max_req_input_len > 1500), rounded up to 1520.
    args = settings("--max-total-tokens", "1000", "--page-size", "16", "--target-input-len", "1500")
    done, check = check_json(llama_model, *args)
    assert done.returncode == 1
    plan = check["target"]
    assert plan["tokens_needed"] == 1520
    assert [(c["flag"], c["value"]) for c in plan["changes"]] == [("--max-total-tokens", "1520")]
    assert "--max-total-tokens 1520" in last_line(done.stderr)
    assert "max_req_input_len=986" in plan["refused_because"]


@pytest.mark.parametrize("context, n, needs_env", [(None, 2048, True), ("512", 1000, False)],
                         ids=["at-the-derived-length", "above-a-lowered-length"])
def test_prompt_at_or_over_the_context_length_names_context_length(llama_model, context, n, needs_env):
    extra = ("--context-length", context) if context else ()
    done, check = check_json(llama_model, *settings(*extra, "--target-input-len", str(n)))
    assert done.returncode == 1
    plan = check["target"]
    assert plan["refused_because"].startswith("the tokenizer manager refuses it")
    assert [(c["flag"], c["value"]) for c in plan["changes"]] == [("--context-length", str(n + 7))]
    line = last_line(done.stderr)
    assert f"--context-length {n + 7}" in line
    assert ("SRT_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1" in line) is needs_env


@pytest.mark.parametrize("page_size", [1, 16])
def test_tokens_needed_is_the_smallest_pool_that_admits_the_prompt(page_size):
    for n in (1, 15, 16, 17, 100, 1000):
        need = tokens_needed(n, page_size)
        assert need % page_size == 0
        assert admits(n, lambda: fixed_kv_budget(need, None, 512, page_size, 1 << 20))
        assert not admits(n, lambda: fixed_kv_budget(need - page_size, None, 512, page_size, 1 << 20))


@pytest.mark.parametrize("page_size", [1, 16])
def test_refusal_agrees_with_the_scheduler_around_the_limits(llama_model, page_size):
    """check_config's prediction against the real scheduler: every length around max_req_input_len,
    submitted one by one, is refused exactly when `refusal` says so."""
    from scheduler_utils import Harness

    h = Harness(llama_model, max_total_tokens=256, page_size=page_size, context_length=512)
    budget = h.runner.kv_budget
    M = budget.max_req_input_len
    for n in range(M - 20, M + 3):
        h.submit(f"n{n}", [5] * n, max_new_tokens=1)
        finish = h.run()[f"n{n}"]["finish"]
        assert (refusal(n, budget) is None) == (finish["type"] != "abort"), (n, finish)
    assert "max_req_input_len" in refusal(M, budget)
    h.assert_conserved()


def test_fp8_kv_cache_is_suggested_when_no_fraction_below_one_fits():
    # 600k tokens x 2048 B exceed all of 1 GiB; with 1-byte elements (1024 B per token) they fit.
    n = 600_000
    inputs = SizingInputs(1 << 30, (1 << 30) - (100 << 20), 0.3, 2048, 1, 1 << 20, None, None, "cpu")
    plan = plan_target(n, inputs, ContextInfo(1 << 20, "test", lambda c: 100 << 20), 1024, inputs.budget(), None)
    assert plan["min_mem_fraction_static"] is None
    fraction = plan["fp8_min_mem_fraction_static"]
    assert [(c["flag"], c["value"]) for c in plan["changes"]] == [("--kv-cache-dtype", "fp8_e4m3"),
                                                                  ("--mem-fraction-static", f"{fraction:.3f}")]
    fp8 = dataclasses.replace(inputs, cell=1024, fraction=fraction)
    assert admits(n, fp8.budget)
    assert not admits(n, dataclasses.replace(fp8, fraction=round(fraction - 0.001, 3)).budget)


def test_a_prompt_no_setting_fits_says_so():
    inputs = SizingInputs(1 << 30, (1 << 30) - (100 << 20), 0.3, 2048, 1, 1 << 22, None, None, "cpu")
    plan = plan_target(2_000_000, inputs, ContextInfo(1 << 22, "test", lambda c: 100 << 20), 1024, inputs.budget(),
                       None)
    assert plan["changes"] == [] and plan["admitted"] is False
    assert "No --mem-fraction-static below 1 admits it, not even with --kv-cache-dtype fp8_e4m3" in plan["suggestion"]


# --- the human table and launch_server --dry-run ----------------------------------------------------

def test_table_shows_each_limit_its_bound_and_the_flag_that_raises_it(llama_model):
    done = run_module("srt.check_config", llama_model, *settings(*CAPPED))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split("  ")[1].strip(): line for line in done.stdout.splitlines() if line.startswith("  ")}
    pool = rows["T (max_total_num_tokens)"]
    assert "3000" in pool and "bound by --max-total-tokens=3000" in pool
    for flag in ("--mem-fraction-static", "--max-total-tokens", "--kv-cache-dtype fp8_e4m3"):
        assert flag in pool
    assert "506 = max_req_len - 5" in rows["max_req_input_len"] and "--context-length" in rows["max_req_input_len"]
    assert "bound by context length 512" in rows["max_req_input_len"]
    assert "511 = min(C - 1, T - 1)" in rows["max_req_len"]
    assert "8" in rows["max_running_requests"] and "--max-running-requests=8" in rows["max_running_requests"]
    assert "C = 512" in rows["context length"] and "derived 2048" in rows["context length"]
    assert "cell = 2 x 16 x 2 x 2 x 4 = 512 B" in rows["KV bytes per token"]
    assert "(default on cpu)" in rows["mem_fraction_static"] and "pre = " in done.stdout


def test_launch_server_dry_run_prints_the_figures_without_serving(llama_model, capped):
    _, check, _ = capped
    args = settings(*CAPPED)
    done = run_module("srt.launch_server", llama_model, *args, "--dry-run", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    dry = json.loads(done.stdout)
    for key in ("max_total_num_tokens", "max_req_input_len", "max_req_len", "max_running_requests", "context_len",
                "cell_size", "weight_bytes", "weight_bytes_disk"):
        assert dry[key] == check[key], key
    assert "fired up" not in done.stderr
    from srt.launch_server import port_problem

    assert port_problem("127.0.0.1", int(args[args.index("--port") + 1])) is None


def test_launch_server_refuses_check_flags_without_dry_run(llama_model):
    done = run_module("srt.launch_server", llama_model, *settings("--json"), timeout=60)
    assert done.returncode == 1
    assert last_line(done.stderr) == ("--json and --target-input-len only apply with --dry-run "
                                      "(or python -m srt.check_config).")
