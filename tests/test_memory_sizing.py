"""KV-pool sizing at start-up (ARCHITECTURE.md 4.3): the arithmetic on simulated measurements,
both start-up memory errors with their numbers, the log line and warning, and a real runner."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from mem_cache.memory_pool import MHATokenToKVPool
from model_utils import greedy_run, make_runner
from srt.model_executor import model_runner as model_runner_module
from srt.model_executor.memory_sizing import (
    CPU_DEFAULT_MAX_RUNNING_REQUESTS, GiB, MiB, REQ_TO_TOKEN_BUDGET_BYTES, REQ_TO_TOKEN_MAX_ROWS, KVCacheMemoryError,
    MemoryReading, compute_kv_budget, cpu_pool_need, default_mem_fraction_static, module_nbytes, read_free_memory,
)
from srt.model_executor.model_runner import ModelRunner
from srt.server_args import ServerArgs

SIZING_LOGGER = "srt.model_executor.memory_sizing"


def budget(pre=10 * GiB, avail=9 * GiB, fraction=0.5, cell=1024, page=1, context=2048,
           max_total_tokens=None, max_running_requests=None, kind="cpu"):
    return compute_kv_budget(pre, avail, fraction, cell, page, context, max_total_tokens,
                             max_running_requests, kind)


# --- T ------------------------------------------------------------------------------------------

# On CUDA the pool is the fraction's; on CPU it is also capped by need (tests/test_pool_sizing.py).

def test_pool_holds_rest_over_cell_size_tokens():
    b = budget(pre=10 * GiB, avail=9 * GiB, fraction=0.5, cell=1024, kind="cuda")
    rest = 9 * GiB - 5 * GiB
    assert b.rest_bytes == rest
    assert b.weight_bytes == GiB
    assert b.max_total_num_tokens == rest // 1024
    assert b.total_bound == "--mem-fraction-static=0.5"


def test_pool_is_rounded_down_to_a_page_multiple():
    b = budget(cell=1000, page=16, kind="cuda")
    t0 = (4 * GiB) // 1000
    assert t0 % 16 != 0
    assert b.max_total_num_tokens == t0 // 16 * 16
    assert "rounded down to a multiple of page_size 16" in b.total_bound


def test_max_total_tokens_caps_the_pool_then_pages_round_it():
    b = budget(page=16, max_total_tokens=1000)
    assert b.max_total_num_tokens == 992
    assert b.total_bound.startswith("--max-total-tokens=1000")


def test_max_total_tokens_above_the_memory_pool_does_not_bind():
    b = budget(max_total_tokens=10**12)
    assert b.max_total_num_tokens == 4 * GiB // 1024
    assert b.total_bound.startswith("--mem-fraction-static")


# --- max_running_requests -------------------------------------------------------------------------

def test_max_running_requests_defaults_to_half_the_pool():
    b = budget(max_total_tokens=1000, context=512)
    assert b.max_running_requests == 500
    assert b.running_bound == "T // 2"


def test_max_running_requests_flag_binds_when_below_the_table():
    b = budget(max_running_requests=7)
    assert b.max_running_requests == 7
    assert b.running_bound == "--max-running-requests=7"


def test_request_table_row_cap_bounds_a_large_pool():
    b = budget(context=2048, kind="cuda")
    assert b.max_running_requests == REQ_TO_TOKEN_MAX_ROWS
    assert "request-slot table" in b.running_bound


def test_long_context_shrinks_the_request_table_to_its_byte_budget():
    b = budget(context=131072, max_running_requests=1000)
    rows = REQ_TO_TOKEN_BUDGET_BYTES["cpu"] // ((131072 + 4) * 4)
    assert b.max_running_requests == rows
    assert rows * (131072 + 4) * 4 <= REQ_TO_TOKEN_BUDGET_BYTES["cpu"]
    assert "request-slot table" in b.running_bound
    assert any("--max-running-requests=1000 lowered to" in w for w in b.warnings)


def test_max_running_requests_is_at_least_one():
    b = budget(max_total_tokens=7)  # the smallest pool that admits a request
    assert (b.max_total_num_tokens, b.max_req_input_len, b.max_running_requests) == (7, 1, 3)
    b = budget(context=10**9)  # one row is 4 GB: still one row
    assert b.max_running_requests == 1


# --- max_req_len / max_req_input_len --------------------------------------------------------------

def test_request_length_bound_by_context_length_when_the_pool_is_larger():
    b = budget(context=2048)
    assert (b.max_req_len, b.max_req_input_len) == (2047, 2042)
    assert b.input_bound == "context length 2048"
    assert b.warnings == ()


def test_request_length_bound_by_the_pool_when_it_is_smaller_than_the_context():
    b = budget(context=2048, max_total_tokens=1000)
    assert (b.max_req_len, b.max_req_input_len) == (999, 994)
    assert b.input_bound == "KV pool of T=1000 tokens"


def test_pool_equal_to_context_length_does_not_warn():
    b = budget(context=2048, max_total_tokens=2048)
    assert b.max_req_input_len == 2048 - 6
    assert b.warnings == ()


# --- start-up errors -------------------------------------------------------------------------------

def _suggested_fraction(message: str) -> float:
    match = re.search(r"Raise --mem-fraction-static above (\d\.\d{3})", message)
    assert match, message
    return float(match.group(1))


def test_weights_over_the_static_fraction_raise_with_the_smallest_fraction_that_fits():
    pre, weights = GiB, int(0.95 * GiB)
    with pytest.raises(KVCacheMemoryError) as exc:
        budget(pre=pre, avail=pre - weights, fraction=0.5)
    msg = str(exc.value)
    assert msg.startswith("Loaded weights leave no host memory for the KV cache under "
                          "--mem-fraction-static=0.5. Raise --mem-fraction-static above 0.950")
    assert "0.95 GiB" in msg and "1 GiB" in msg
    assert "--dtype" in msg and "--kv-cache-dtype fp8_e4m3" in msg
    assert isinstance(exc.value, ValueError)


@pytest.mark.parametrize("pre,weights", [(GiB, int(0.95 * GiB)), (80 * GiB, 71 * GiB + 12345),
                                         (24 * GiB, int(17.3 * GiB)), (3 * GiB, 2 * GiB + 1)])
def test_suggested_fraction_is_the_smallest_that_leaves_room(pre, weights):
    with pytest.raises(KVCacheMemoryError) as exc:
        budget(pre=pre, avail=pre - weights, fraction=0.5 * weights / pre, cell=16)
    x = _suggested_fraction(str(exc.value))
    assert budget(pre=pre, avail=pre - weights, fraction=x + 0.001, cell=16).max_total_num_tokens > 0
    with pytest.raises(KVCacheMemoryError):
        budget(pre=pre, avail=pre - weights, fraction=x - 0.001, cell=16)


def test_weights_error_names_the_gpu_on_cuda():
    with pytest.raises(KVCacheMemoryError, match=r"^Loaded weights leave no GPU memory for the KV cache "
                                                 r"under --mem-fraction-static=0.88\. Raise"):
        budget(pre=20 * GiB, avail=GiB, fraction=0.88, kind="cuda")


def test_pool_smaller_than_one_page_raises_not_enough_memory():
    pre = 2 * GiB
    with pytest.raises(KVCacheMemoryError) as exc:
        budget(pre=pre, avail=GiB + 5000, fraction=0.5, cell=1024, page=16)
    msg = str(exc.value)
    assert msg.startswith("Not enough memory. Please try to increase --mem-fraction-static. ")
    assert "5000 bytes" in msg and "1024 bytes" in msg and "holds 4 tokens" in msg
    assert "one page of 16 tokens" in msg


def test_max_total_tokens_below_one_page_raises_not_enough_memory():
    with pytest.raises(KVCacheMemoryError, match=r"^Not enough memory\. Please try to increase "
                                                 r"--mem-fraction-static\. .*--max-total-tokens=8"):
        budget(page=16, max_total_tokens=8)


def test_pool_too_small_for_any_request_raises_not_enough_memory():
    with pytest.raises(KVCacheMemoryError, match=r"^Not enough memory\. .*T=6 tokens"):
        budget(max_total_tokens=6)


# --- odd measurements -------------------------------------------------------------------------------

def test_free_memory_growing_during_load_is_clamped_and_reported():
    b = budget(pre=GiB, avail=2 * GiB, fraction=0.5, cell=1024)
    assert b.weight_bytes == 0
    assert b.max_total_num_tokens == GiB // 2 // 1024
    assert any("grew while loading weights" in w for w in b.warnings)


def test_negative_free_memory_before_loading_is_clamped_to_an_error():
    with pytest.raises(KVCacheMemoryError, match="No free host memory was measured before loading"):
        budget(pre=-1, avail=-1)


# --- defaults ------------------------------------------------------------------------------------

@pytest.mark.parametrize("total_gib,expected", [(141, 0.88), (80, 0.88), (24, 0.875), (16, 0.812),
                                                (8, 0.625), (4, 0.5)])
def test_cuda_default_fraction_shrinks_on_small_cards(total_gib, expected):
    assert default_mem_fraction_static("cuda", total_gib * GiB) == expected


def test_cpu_default_fraction_is_conservative():
    assert default_mem_fraction_static("cpu", 512 * GiB) == 0.3


def test_host_memory_reading_is_positive_and_below_total():
    reading = read_free_memory("cpu")
    assert 0 < reading.free_bytes <= reading.total_bytes


# --- log line and warning ------------------------------------------------------------------------------

def test_log_line_states_each_size_and_its_bound(caplog):
    b = budget(pre=10 * GiB, avail=9 * GiB, fraction=0.5, cell=1024, page=16, context=2048, kind="cuda")
    with caplog.at_level(logging.INFO, logger=SIZING_LOGGER):
        b.log()
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1
    line = infos[0]
    assert f"T={b.max_total_num_tokens} tokens (4 GiB, bound by --mem-fraction-static=0.5)" in line
    assert "page_size=16" in line and "C=2048" in line
    assert "max_req_input_len=2042 (bound by context length 2048)" in line
    assert f"max_running_requests={REQ_TO_TOKEN_MAX_ROWS} (bound by the request-slot table" in line
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_pool_below_context_length_warns_how_to_raise_it(caplog):
    b = budget(context=2048, max_total_tokens=1000)
    with caplog.at_level(logging.INFO, logger=SIZING_LOGGER):
        b.log()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    text = warnings[0]
    assert "Requests longer than max_req_input_len=994 tokens will be refused" in text
    assert "context length C=2048" in text and "holds only T=1000 tokens" in text
    for flag in ("--mem-fraction-static", "--max-total-tokens", "--kv-cache-dtype fp8_e4m3", "--context-length"):
        assert flag in text


# --- the model runner -------------------------------------------------------------------------------

def test_runner_without_sizes_sizes_the_pool_from_host_memory(llama_model, caplog):
    with caplog.at_level(logging.INFO, logger=SIZING_LOGGER):
        runner = ModelRunner(ServerArgs(model_path=str(llama_model), dtype="float32", device="cpu"))
    b, cfg = runner.kv_budget, runner.model_config
    cell = MHATokenToKVPool.cell_size_bytes(cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers,
                                            torch.float32)
    assert b.cell_size == cell
    assert b.mem_fraction_static == 0.3
    assert b.weight_bytes == module_nbytes(runner.model) > 0
    rest = int(b.pre_bytes - b.weight_bytes - b.pre_bytes * (1 - 0.3))
    assert b.rest_bytes == rest
    T, C = runner.max_total_num_tokens, cfg.context_len
    need, _ = cpu_pool_need(None, REQ_TO_TOKEN_MAX_ROWS, C, 1)  # the tiny model's C leaves the row cap
    assert T == min(rest // cell, need)
    assert runner.token_to_kv_pool.size == T
    assert runner.max_req_len == min(C - 1, T - 1)
    assert runner.max_req_input_len == runner.max_req_len - 5
    assert runner.req_to_token_pool.size == runner.max_running_requests == CPU_DEFAULT_MAX_RUNNING_REQUESTS
    assert any(r.getMessage().startswith(f"KV cache: T={T} tokens") for r in caplog.records)
    toks, _ = greedy_run(runner, [[5, 6, 7, 8]], steps=2)
    assert len(toks[0]) == 3


def test_runner_honours_max_total_tokens_and_page_size_flags(llama_model, caplog):
    args = ServerArgs(model_path=str(llama_model), dtype="float32", device="cpu", max_total_tokens=1000,
                      page_size=16, max_running_requests=8)
    with caplog.at_level(logging.INFO, logger=SIZING_LOGGER):
        runner = ModelRunner(args)
    assert runner.max_total_num_tokens == 992
    assert runner.max_running_requests == 8
    assert (runner.max_req_len, runner.max_req_input_len) == (991, 986)
    assert any("will be refused" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_runner_with_explicit_sizes_uses_them_as_given(llama_model):
    runner = make_runner(llama_model, max_total_tokens=8192, max_running_requests=16)
    assert runner.max_total_num_tokens == 8192
    assert runner.max_running_requests == runner.req_to_token_pool.size == 16
    assert runner.max_req_input_len == runner.model_config.context_len - 6
    assert runner.kv_budget.pre_bytes is None


def test_runner_refuses_to_start_when_weights_fill_the_budget(llama_model, monkeypatch):
    tiny = MemoryReading(free_bytes=2 * MiB, total_bytes=4 * MiB, source="test")
    monkeypatch.setattr(model_runner_module, "read_free_memory", lambda device: tiny)
    with pytest.raises(KVCacheMemoryError, match=r"^Loaded weights leave no host memory for the KV cache "
                                                 r"under --mem-fraction-static=0\.3\. Raise"):
        ModelRunner(ServerArgs(model_path=str(llama_model), dtype="float32", device="cpu"))
