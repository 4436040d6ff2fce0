"""Start-up rows of the error contract (ARCHITECTURE.md section 7): each runs `launch_server` to
its exit and checks the exit code, that the last stderr line is the cause (no traceback wall,
no generic wrapper), its searchable first sentence, its numbers and the flag that fixes it."""

from __future__ import annotations

import math
import socket
import time

import pytest

from contract_utils import assert_clean_failure, copy_model, find, launch, parse_size, torch_cuda_available
from srt.server_args import ServerArgs


def test_weights_over_the_static_fraction_exit_with_the_smallest_fraction(llama_model):
    done = launch("--model-path", llama_model, "--mem-fraction-static", "0.000001")
    line = assert_clean_failure(done)
    assert line.startswith("Loaded weights leave no host memory for the KV cache under --mem-fraction-static=1e-06. "
                           "Raise --mem-fraction-static above ")
    m = find(r"above (\d\.\d{3}): the weights take ([\d.]+ [GM]iB) of the ([\d.]+ [GM]iB) of available host RAM "
             r"before loading, and the static budget is 1e-06 x ([\d.]+ [GM]iB) = ", line)
    suggested, weights, pre = float(m[1]), parse_size(m[2]), parse_size(m[3])
    assert m[3] == m[4]
    # The suggestion is the weights' share rounded up to 3 decimals (the printed sizes have 3 digits).
    assert math.isclose(suggested, max(0.001, math.ceil(weights / pre * 1000) / 1000))
    assert "--kv-cache-dtype fp8_e4m3" in line and "--dtype" in line
    assert line.endswith("]") and "[Scheduler process, pid " in line  # the child that measured it


def test_pool_below_one_page_says_not_enough_memory_and_names_the_cap(llama_model):
    done = launch("--model-path", llama_model, "--max-total-tokens", "4", "--page-size", "16")
    line = assert_clean_failure(done)
    assert line.startswith("Not enough memory. Please try to increase --mem-fraction-static. The KV budget is ")
    find(r"one token needs a cell of 512 bytes, so the pool holds \d+ tokens \(capped to 4 by "
         r"--max-total-tokens=4\), less than one page of 16 tokens \(--page-size\)\. "
         r"Raise --max-total-tokens to at least 16\.", line)


def test_tokenizer_needing_remote_code_names_the_flag(llama_model, tmp_path):
    path = copy_model(llama_model, tmp_path / "custom-tok", tokenizer_config={
        "tokenizer_class": "MyTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_my.MyTokenizer", None]}})
    line = assert_clean_failure(launch("--model-path", path))
    assert line.startswith("Failed to load the tokenizer. If the tokenizer is a custom tokenizer not yet available "
                           "in the HuggingFace transformers library, consider setting trust_remote_code=True")
    assert "--trust-remote-code" in line and "MyTokenizer" in line and "auto_map" in line


def test_missing_model_path_is_named_never_a_hub_repo_id(tmp_path):
    missing = tmp_path / "does-not-exist"
    done = launch("--model-path", missing)
    line = assert_clean_failure(done)
    assert line == (f"Model path '{missing}' does not exist. --model-path must be a local Hugging Face format "
                    f"directory (this runtime never downloads from a model hub).")
    assert "Repo id" not in done.stderr and "repo_name" not in done.stderr


def test_directory_without_config_json_is_not_a_model_directory(tmp_path):
    line = assert_clean_failure(launch("--model-path", tmp_path))
    assert line == f"Model path '{tmp_path}' has no config.json: it is not a Hugging Face format model directory."


def test_context_length_above_the_derived_one_names_its_source_and_the_override(llama_model):
    line = assert_clean_failure(launch("--model-path", llama_model, "--context-length", "4K"))
    assert line.startswith("User-specified --context-length (4096) is greater than the derived context length "
                           "(2048, from max_position_embeddings). Lower --context-length, or set "
                           "SRT_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 to allow it")
    # With the override the server starts: tests/error_contract/test_startup_warnings_contract.py.


CHOICES = [
    ("--dtype", "float64", ("auto", "half", "float16", "bfloat16", "float", "float32")),
    ("--kv-cache-dtype", "fp4", ("auto", "bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2")),
    ("--schedule-policy", "sjf", ("fcfs", "lpm", "dfs-weight", "lof", "random")),
    ("--radix-eviction-policy", "mru", ("lru", "lfu")),
    ("--attention-backend", "triton", ("auto", "torch_native", "flashinfer")),
]


@pytest.mark.parametrize("flag,value,accepted", CHOICES, ids=[c[0] for c in CHOICES])
def test_bad_choice_lists_the_accepted_values(llama_model, flag, value, accepted):
    done = launch("--model-path", llama_model, flag, value, timeout=30)
    assert done.returncode == 2  # argparse: usage error
    line = done.stderr.strip().splitlines()[-1]
    assert f"argument {flag}: invalid choice: '{value}'" in line
    assert all(a in line for a in accepted)
    # The in-process Engine path (ServerArgs) says the same in its own words.
    with pytest.raises(ValueError) as info:
        ServerArgs(model_path=str(llama_model), **{flag[2:].replace("-", "_"): value})
    assert str(info.value) == f"Invalid {flag} '{value}'. Accepted values: {', '.join(accepted)}."


def test_port_in_use_is_one_line_before_loading_anything(llama_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        done = launch("--model-path", llama_model, "--port", port, timeout=30)
        elapsed = time.monotonic() - t0
    line = assert_clean_failure(done)
    assert done.stderr.strip() == line  # nothing else printed: no model was loaded
    find(rf"^Address already in use: 127\.0\.0\.1:{port} is taken by another process\. Stop it or pass "
         rf"--port <other> \(for example --port \d+, which is free now\)\.$", line)
    assert elapsed < 20  # generous: only the argument parser and a socket were involved


def test_child_failing_at_startup_shows_its_own_error_last(llama_model, tmp_path):
    """The seeds' 'Engine core initialization failed' case: here the child's own error is the line."""
    path = copy_model(llama_model, tmp_path / "foo-arch", config={"architectures": ["FooForCausalLM"]})
    line = assert_clean_failure(launch("--model-path", path))
    find(r"^Model architectures \['FooForCausalLM'\] are not supported\. Supported architectures: "
         r"LlamaForCausalLM, .*Qwen3ForCausalLM\. \[Scheduler process, pid \d+\]$", line)


RANGES = [
    ("--mem-fraction-static", "1.5", "--mem-fraction-static must be in (0, 1), got 1.5."),
    ("--page-size", "0", "--page-size must be >= 1, got 0."),
    ("--max-running-requests", "0", "--max-running-requests must be >= 1, got 0."),
    ("--context-length", "16q", "Invalid --context-length '16q': use an integer or a suffix like 16k (16000) or "
                                "16K (16384)."),
]


@pytest.mark.parametrize("flag,value,expected", RANGES, ids=[r[0] for r in RANGES])
def test_flag_out_of_range_names_the_flag_value_and_range(llama_model, flag, value, expected):
    done = launch("--model-path", llama_model, flag, value, timeout=30)
    if flag == "--context-length":  # parsed by argparse's type= hook: a usage error
        assert done.returncode == 2 and f"argument --context-length: {expected}" in done.stderr
        return
    assert assert_clean_failure(done) == expected


@pytest.mark.skipif(torch_cuda_available(), reason="this machine has CUDA: --device cuda is valid here")
def test_device_cuda_without_cuda_says_what_to_pass(llama_model):
    line = assert_clean_failure(launch("--model-path", llama_model, "--device", "cuda"))
    find(r"^--device cuda was given but CUDA is not available \(torch [^)]+\); use --device cpu or auto\.", line)


def test_engine_start_up_failure_raises_the_childs_error_and_leaves_no_process(llama_model):
    """The in-process Engine gets the same first sentence as an exception, and stops its children."""
    import multiprocessing as mp

    from srt.entrypoints.engine import Engine

    before = {p.pid for p in mp.active_children()}
    with pytest.raises(RuntimeError) as info:
        Engine(model_path=str(llama_model), device="cpu", dtype="float32", mem_fraction_static=0.000001)
    assert str(info.value).startswith("Loaded weights leave no host memory for the KV cache under "
                                      "--mem-fraction-static=1e-06. Raise --mem-fraction-static above ")
    assert "[Scheduler process, pid " in str(info.value)
    assert {p.pid for p in mp.active_children() if p.is_alive()} <= before
