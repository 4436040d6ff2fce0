"""The CPU KV pool sized by need: max_running_requests x context x CPU_POOL_REUSE_FACTOR tokens,
capped by --mem-fraction-static; explicit --max-total-tokens wins; the start-up line names the
bound that applied and what the other would give."""

from __future__ import annotations

import logging

from srt.model_executor.memory_sizing import (
    CPU_DEFAULT_MAX_RUNNING_REQUESTS, CPU_POOL_REUSE_FACTOR, GiB, compute_kv_budget,
)

SIZING_LOGGER = "srt.model_executor.memory_sizing"
PRE, WEIGHTS = 22 * GiB, 3 << 20  # the machine of issue 16: a 1M-parameter model
CELL, C = 1024, 512


def cpu_budget(fraction=0.3, page=1, context=C, max_total_tokens=None, max_running_requests=None, kind="cpu"):
    return compute_kv_budget(PRE, PRE - WEIGHTS, fraction, CELL, page, context, max_total_tokens,
                             max_running_requests, kind)


def fraction_tokens(fraction: float) -> int:
    return int(PRE - WEIGHTS - PRE * (1 - fraction)) // CELL


# --- which bound applies --------------------------------------------------------------------------

def test_small_model_pool_is_the_running_requests_at_full_context_twice_over():
    b = cpu_budget()
    assert b.max_total_num_tokens == CPU_DEFAULT_MAX_RUNNING_REQUESTS * C * CPU_POOL_REUSE_FACTOR == 262144
    assert b.max_total_num_tokens < fraction_tokens(0.3)
    assert b.total_bound.startswith("need: max_running_requests 256 (CPU default) x context 512 x 2")
    assert b.other_bound == f"--mem-fraction-static=0.3 would allow {fraction_tokens(0.3)}"


def test_fraction_caps_the_need_and_keeps_its_bound_text():
    b = cpu_budget(fraction=0.001)
    assert b.max_total_num_tokens == fraction_tokens(0.001) < 262144
    assert b.total_bound == "--mem-fraction-static=0.001"
    assert b.other_bound.startswith("the need, max_running_requests 256") and b.other_bound.endswith("is 262144")


def test_explicit_max_total_tokens_wins_over_the_need():
    b = cpu_budget(max_total_tokens=1_000_000)
    assert b.max_total_num_tokens == 1_000_000
    assert b.total_bound == "--max-total-tokens=1000000" and b.other_bound == ""


def test_max_running_requests_flag_sizes_the_need():
    b = cpu_budget(max_running_requests=8, page=16)
    assert b.max_total_num_tokens == 8 * C * 2
    assert b.max_running_requests == 8 and b.running_bound == "--max-running-requests=8"
    assert "max_running_requests 8 (--max-running-requests=8)" in b.total_bound


def test_need_is_rounded_up_to_whole_pages():
    b = cpu_budget(max_running_requests=1, context=100, page=16)  # 200 tokens -> 13 pages
    assert b.max_total_num_tokens == 208


def test_need_uses_at_most_the_request_slot_rows():
    b = compute_kv_budget(PRE, PRE - WEIGHTS, 0.3, 64, 1, 131072)  # 64 MiB of table: 127 rows
    assert b.max_running_requests == 127
    assert b.max_total_num_tokens == 127 * 131072 * 2
    assert "127 (CPU default lowered to the 127 request-slot rows)" in b.total_bound


def test_cuda_pool_takes_the_whole_fraction():
    b = cpu_budget(fraction=0.88, kind="cuda")
    assert b.max_total_num_tokens == fraction_tokens(0.88)
    assert b.total_bound == "--mem-fraction-static=0.88" and b.other_bound == ""


# --- running requests and request lengths ----------------------------------------------------------

def test_without_the_flag_running_requests_default_to_what_sized_the_pool():
    """max_running_requests is T // 2 otherwise: sizing T from it would be circular."""
    b = cpu_budget()
    assert b.max_running_requests == CPU_DEFAULT_MAX_RUNNING_REQUESTS
    assert b.running_bound == "the CPU default that sizes the KV pool"


def test_a_tiny_fraction_pool_still_halves_for_running_requests():
    b = compute_kv_budget(GiB, GiB - WEIGHTS, 0.0032, CELL, 1, C)  # a pool of 283 tokens
    assert b.max_running_requests == b.max_total_num_tokens // 2 < CPU_DEFAULT_MAX_RUNNING_REQUESTS
    assert b.running_bound == "T // 2"


def test_need_sized_pool_keeps_the_context_as_the_request_length_bound():
    b = cpu_budget(max_running_requests=1)
    assert b.max_total_num_tokens == 2 * C
    assert (b.max_req_len, b.max_req_input_len) == (C - 1, C - 6)
    assert b.input_bound == f"context length {C}" and b.warnings == ()


# --- the start-up line ------------------------------------------------------------------------------

def test_start_up_line_names_the_need_and_what_the_fraction_would_allow(caplog):
    with caplog.at_level(logging.INFO, logger=SIZING_LOGGER):
        cpu_budget().log()
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert line.startswith("KV cache: T=262144 tokens (0.25 GiB, bound by need: max_running_requests 256 "
                           "(CPU default) x context 512 x 2 for prefix reuse; --mem-fraction-static=0.3 "
                           f"would allow {fraction_tokens(0.3)}), ")
    assert "max_running_requests=256 (bound by the CPU default that sizes the KV pool)" in line


def test_start_up_line_names_the_fraction_and_what_the_need_would_be(caplog):
    with caplog.at_level(logging.INFO, logger=SIZING_LOGGER):
        cpu_budget(fraction=0.001).log()
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert f"T={fraction_tokens(0.001)} tokens" in line
    assert "bound by --mem-fraction-static=0.001; the need, max_running_requests 256 (CPU default) x context " \
           "512 x 2 for prefix reuse, is 262144)" in line
