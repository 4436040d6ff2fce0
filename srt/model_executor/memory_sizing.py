"""KV-pool sizing at start-up (ARCHITECTURE.md 4.3): measure free memory around weight loading,
turn it into T KV slots, the request-slot count and the per-request length limits.

`compute_kv_budget` is pure arithmetic on the measurements, so tests can simulate any machine;
`read_free_memory` / `free_memory_after_load` are the thin measuring side. On CPU the pool is
sized by need (`cpu_pool_need`), capped by the memory fraction.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import nn

logger = logging.getLogger(__name__)

GiB = 1 << 30
MiB = 1 << 20

# CPU: the fraction of *available* host RAM (at start) given to weights + KV pool. Host RAM is
# shared with the OS, the tokenizer and detokenizer processes and, in tests, several servers at
# once, so most of it stays free. The pool is `torch.empty`, so untouched slots cost no RAM.
CPU_DEFAULT_MEM_FRACTION_STATIC = 0.3
# CPU without --max-total-tokens: the pool is what the running requests can use, capped by the
# fraction (host RAM is shared; the fraction alone gave a 1M-parameter model with C=512 a pool of
# 6.9M tokens). need = max_running_requests x C x CPU_POOL_REUSE_FACTOR: every running request at
# the full context, and as much again for the radix cache to keep finished requests' prefixes.
# max_running_requests defaults to T // 2, which would make the need circular, so on this path
# its default is CPU_DEFAULT_MAX_RUNNING_REQUESTS (more than a CPU decodes at once to any gain),
# and that is then also the default cap on running requests. CUDA memory is the server's alone:
# there the whole fraction goes to the pool, as in SGLang.
CPU_DEFAULT_MAX_RUNNING_REQUESTS = 256
CPU_POOL_REUSE_FACTOR = 2
# CUDA: what stays outside the static budget must hold the activations of one prefill chunk,
# the sampler's logits, the attention workspace and allocator fragmentation. We keep at least
# CUDA_RESERVED_MIN_BYTES (enough for an 8192-token chunk of a ~8B model) and at least 12% of
# the card, so large cards get SGLang's 0.88 and small cards less (24 GiB: 0.875, 16 GiB: 0.812,
# 8 GiB: 0.625), never below CUDA_MIN_DEFAULT_FRACTION.
CUDA_MAX_DEFAULT_FRACTION = 0.88
CUDA_MIN_DEFAULT_FRACTION = 0.5
CUDA_RESERVED_MIN_BYTES = 3 * GiB

# `req_to_token` is `rows x (C + 4)` int32 and is zero-filled (so touched) at start-up; keep it
# small: at most this many rows, and at most this many bytes (rows shrink for long contexts,
# e.g. C = 128k gives 128 rows on CPU, 1024 on CUDA).
REQ_TO_TOKEN_MAX_ROWS = 4096
REQ_TO_TOKEN_BUDGET_BYTES = {"cpu": 64 * MiB, "cuda": 512 * MiB}

# SGLang keeps this many tokens of a request's length in reserve: max_req_input_len = max_req_len - 5.
_INPUT_RESERVE = 5


class KVCacheMemoryError(ValueError):
    """Start-up error: the measured memory leaves no room for a usable KV pool."""


def fmt_gib(n_bytes: float) -> str:
    v = n_bytes / GiB
    if abs(v) >= 100:
        return f"{v:.0f} GiB"
    return f"{v:.3g} GiB" if abs(v) >= 0.001 else f"{n_bytes / MiB:.3f} MiB"


def _memory_word(device_kind: str) -> str:
    return "GPU" if device_kind == "cuda" else "host"


def default_mem_fraction_static(device_kind: str, total_bytes: int, graph_reserve_bytes: int = 0) -> float:
    """The `--mem-fraction-static` used when the flag is omitted (see the constants above). On
    CUDA, `graph_reserve_bytes` (what captured CUDA graphs keep, `cuda_graph_runner.py`) is left
    outside the static budget on top of the usual reserve, as SGLang does."""
    if device_kind != "cuda":
        return CPU_DEFAULT_MEM_FRACTION_STATIC
    if total_bytes <= 0:
        return CUDA_MIN_DEFAULT_FRACTION
    reserved = max(CUDA_RESERVED_MIN_BYTES, (1 - CUDA_MAX_DEFAULT_FRACTION) * total_bytes) + graph_reserve_bytes
    fraction = math.floor((total_bytes - reserved) / total_bytes * 1000) / 1000
    return min(CUDA_MAX_DEFAULT_FRACTION, max(CUDA_MIN_DEFAULT_FRACTION, fraction))


def req_slot_pool_size(context_len: int, device_kind: str, budget_bytes: Optional[int] = None) -> int:
    """How many `req_to_token` rows (of `C + 4` int32) fit the row cap and the byte budget; >= 1."""
    if budget_bytes is None:
        budget_bytes = REQ_TO_TOKEN_BUDGET_BYTES.get(device_kind, REQ_TO_TOKEN_BUDGET_BYTES["cpu"])
    row_bytes = (context_len + 4) * 4
    return max(1, min(REQ_TO_TOKEN_MAX_ROWS, budget_bytes // row_bytes))


@dataclass(frozen=True)
class KVBudget:
    """The sizes the model runner builds its pools with, and why each has its value."""

    device_kind: str
    page_size: int
    context_len: int
    cell_size: int
    max_total_num_tokens: int
    total_bound: str
    max_running_requests: int
    running_bound: str
    max_req_len: int
    max_req_input_len: int
    input_bound: str
    mem_fraction_static: Optional[float] = None
    pre_bytes: Optional[int] = None
    weight_bytes: Optional[int] = None
    rest_bytes: Optional[int] = None
    warnings: Tuple[str, ...] = ()
    other_bound: str = ""  # the pool bound that did not apply and what it would give (CPU sizing)

    def to_dict(self) -> dict:
        """The arithmetic as plain numbers and texts (for `/get_server_info` and `check_config`)."""
        out = dataclasses.asdict(self)
        out["warnings"] = list(self.warnings)
        out["kv_bytes"] = self.kv_bytes
        return out

    @property
    def kv_bytes(self) -> int:
        return self.max_total_num_tokens * self.cell_size

    @property
    def log_line(self) -> str:
        bounds = self.total_bound + (f"; {self.other_bound}" if self.other_bound else "")
        line = (
            f"KV cache: T={self.max_total_num_tokens} tokens ({fmt_gib(self.kv_bytes)}, bound by "
            f"{bounds}), page_size={self.page_size}, C={self.context_len}, "
            f"max_req_input_len={self.max_req_input_len} (bound by {self.input_bound}), "
            f"max_running_requests={self.max_running_requests} (bound by {self.running_bound})"
        )
        if self.pre_bytes is not None:
            line += (f"; {_memory_word(self.device_kind)} memory: {fmt_gib(self.pre_bytes)} free before "
                     f"loading, weights {fmt_gib(self.weight_bytes or 0)}, "
                     f"KV budget {fmt_gib(self.rest_bytes or 0)}")
        return line + "."

    def log(self, log: logging.Logger = logger) -> None:
        """One INFO line with the sizes, then one WARNING per clamp or refused length."""
        log.info(self.log_line)
        for text in self.warnings:
            log.warning(text)


def compute_kv_budget(
    pre_bytes: int,
    avail_bytes: int,
    mem_fraction_static: float,
    cell_size: int,
    page_size: int,
    context_len: int,
    max_total_tokens: Optional[int] = None,
    max_running_requests: Optional[int] = None,
    device_kind: str = "cpu",
    req_slot_budget_bytes: Optional[int] = None,
) -> KVBudget:
    """Size the pools from `pre_bytes` (free before loading weights) and `avail_bytes` (free after).

    `rest = avail - pre * (1 - mem_fraction_static)` bytes go to the KV pool, `cell_size` bytes
    per token; `max_total_tokens` / `max_running_requests` are the user's caps (None: no cap).
    On CPU without `max_total_tokens` the pool is also capped by `cpu_pool_need`; `other_bound`
    then says what the bound that did not apply would give.
    Raises `KVCacheMemoryError` when the weights leave nothing or the pool holds no page.
    """
    if not 0 < mem_fraction_static <= 1:
        raise ValueError(f"--mem-fraction-static must be in (0, 1), got {mem_fraction_static}.")
    pre_bytes, avail_bytes, notes = _clamp_readings(pre_bytes, avail_bytes, device_kind)
    weight_bytes = pre_bytes - avail_bytes
    rest = int(avail_bytes - pre_bytes * (1 - mem_fraction_static))
    if rest <= 0:
        raise KVCacheMemoryError(_no_room_message(pre_bytes, weight_bytes, mem_fraction_static,
                                                  cell_size, context_len, device_kind))
    t0 = rest // cell_size
    need = None
    if device_kind == "cpu" and max_total_tokens is None:
        slots = req_slot_pool_size(context_len, device_kind, req_slot_budget_bytes)
        need = cpu_pool_need(max_running_requests, slots, context_len, page_size)
    total, bound, other = _pool_bound(t0, f"--mem-fraction-static={mem_fraction_static:g}", max_total_tokens, need)
    rounded = total // page_size * page_size
    if rounded <= 0:
        raise KVCacheMemoryError(
            "Not enough memory. Please try to increase --mem-fraction-static. "
            f"The KV budget is {rest} bytes ({fmt_gib(rest)}) after {fmt_gib(weight_bytes)} of weights "
            f"under --mem-fraction-static={mem_fraction_static:g}, one token needs a cell of {cell_size} "
            f"bytes, so the pool holds {t0} tokens" + (f" (capped to {total} by {bound})" if total < t0 else "")
            + f", less than one page of {page_size} tokens (--page-size)."
            + (f" Raise --max-total-tokens to at least {page_size}." if total < t0 else "")
        )
    if rounded != total:
        bound += f", rounded down to a multiple of page_size {page_size}"
    budget = _finish(rounded, bound, max_running_requests, cell_size, page_size, context_len, device_kind,
                     req_slot_budget_bytes, notes, cpu_default_running=need is not None,
                     mem_fraction_static=mem_fraction_static, pre_bytes=pre_bytes, weight_bytes=weight_bytes,
                     rest_bytes=rest)
    return dataclasses.replace(budget, other_bound=other) if other else budget


def _clamp_readings(pre_bytes: int, avail_bytes: int, device_kind: str) -> Tuple[int, int, List[str]]:
    """Odd measurements made usable (negative: 0; growing while loading: no weights), with a note each."""
    notes: List[str] = []
    mem = _memory_word(device_kind)
    if pre_bytes < 0:
        notes.append(f"Free {mem} memory before loading measured as {pre_bytes} bytes; using 0.")
        pre_bytes = 0
    if avail_bytes < 0:
        notes.append(f"Free {mem} memory after loading measured as {avail_bytes} bytes; using 0.")
        avail_bytes = 0
    if avail_bytes > pre_bytes:
        notes.append(
            f"Free {mem} memory grew while loading weights ({fmt_gib(pre_bytes)} -> "
            f"{fmt_gib(avail_bytes)}; another process freed memory?); counting the weights as 0 bytes."
        )
        avail_bytes = pre_bytes
    return pre_bytes, avail_bytes, notes


def _pool_bound(t0: int, fraction_bound: str, max_total_tokens: Optional[int],
                need: Optional[Tuple[int, str]]) -> Tuple[int, str, str]:
    """(tokens, the bound that applied, the one that did not and what it gives): the smallest of
    the fraction's `t0`, the flag and the need; an explicit --max-total-tokens replaces the need."""
    if max_total_tokens is not None and max_total_tokens < t0:
        return max_total_tokens, f"--max-total-tokens={max_total_tokens}", ""
    if need is None:
        return t0, fraction_bound, ""
    tokens, why = need
    if tokens < t0:
        return tokens, f"need: {why}", f"{fraction_bound} would allow {t0}"
    return t0, fraction_bound, f"the need, {why}, is {tokens}"


def cpu_pool_need(max_running_requests: Optional[int], slots: int, context_len: int,
                  page_size: int) -> Tuple[int, str]:
    """(tokens, why): the pool a CPU server can use, `max_running_requests` (given, or
    `CPU_DEFAULT_MAX_RUNNING_REQUESTS`; at most the `slots` request rows) requests of the full
    context `CPU_POOL_REUSE_FACTOR` times over, rounded up to whole pages."""
    if max_running_requests is not None:
        running, source = min(max_running_requests, slots), f"--max-running-requests={max_running_requests}"
    else:
        running, source = min(CPU_DEFAULT_MAX_RUNNING_REQUESTS, slots), "CPU default"
    if running < (max_running_requests or CPU_DEFAULT_MAX_RUNNING_REQUESTS):
        source += f" lowered to the {slots} request-slot rows"
    tokens = -(-running * context_len * CPU_POOL_REUSE_FACTOR // page_size) * page_size
    why = (f"max_running_requests {running} ({source}) x context {context_len} x {CPU_POOL_REUSE_FACTOR} "
           f"for prefix reuse")
    return tokens, why


def fixed_kv_budget(
    max_total_tokens: int,
    max_running_requests: Optional[int],
    cell_size: int,
    page_size: int,
    context_len: int,
    device_kind: str = "cpu",
) -> KVBudget:
    """Sizes for a pool of `max_total_tokens` given by the caller (tests, benchmarks): no measuring."""
    rounded = max_total_tokens // page_size * page_size
    if rounded <= 0:
        raise KVCacheMemoryError(
            f"Not enough memory. A KV pool of max_total_tokens={max_total_tokens} holds no page of "
            f"{page_size} tokens (--page-size); pass at least {page_size}."
        )
    bound = f"max_total_tokens={max_total_tokens} given by the caller"
    if rounded != max_total_tokens:
        bound += f", rounded down to a multiple of page_size {page_size}"
    return _finish(rounded, bound, max_running_requests, cell_size, page_size, context_len, device_kind,
                   None, [])


def _no_room_message(pre: int, weights: int, fraction: float, cell_size: int, context_len: int,
                     device_kind: str) -> str:
    mem = _memory_word(device_kind)
    text = f"Loaded weights leave no {mem} memory for the KV cache under --mem-fraction-static={fraction:g}."
    if pre <= 0:
        return text + (f" No free {mem} memory was measured before loading the weights; free memory "
                       f"used by other processes or check the device.")
    # rest > 0  <=>  fraction > weights / pre; round up so that any value above X works.
    smallest = math.ceil(weights / pre * 1000 - 1e-9) / 1000
    full_request = (weights + (context_len + 1) * cell_size) / pre
    where = "free on the GPU" if device_kind == "cuda" else "of available host RAM"
    numbers = (f"the weights take {fmt_gib(weights)} of the {fmt_gib(pre)} {where} before loading, "
               f"and the static budget is {fraction:g} x {fmt_gib(pre)} = {fmt_gib(fraction * pre)}.")
    if smallest < 1:
        text += f" Raise --mem-fraction-static above {smallest:.3f}: " + numbers
    else:
        text += " No --mem-fraction-static below 1 fits a KV cache: " + numbers
    if full_request < 1:
        text += (f" A value of {math.ceil(full_request * 1000) / 1000:.3f} leaves room for one request "
                 f"of the full context length ({context_len} tokens).")
    return text + (
        " Alternatives: load the weights in a smaller --dtype (bfloat16 instead of float32), free memory "
        "used by other processes, or use a smaller model; once the weights fit, --kv-cache-dtype fp8_e4m3 "
        "halves the KV memory per token and a smaller --context-length shrinks the request table."
    )


def _finish(total: int, total_bound: str, max_running_requests: Optional[int], cell_size: int,
            page_size: int, context_len: int, device_kind: str, req_slot_budget_bytes: Optional[int],
            notes: List[str], cpu_default_running: bool = False, **memory) -> KVBudget:
    """Derive the request limits from the final pool size `total` (already a page multiple).
    `cpu_default_running`: the pool was sized by `cpu_pool_need`, so without the flag running
    requests default to `CPU_DEFAULT_MAX_RUNNING_REQUESTS` (or T // 2 when that is smaller)."""
    slots = req_slot_pool_size(context_len, device_kind, req_slot_budget_bytes)
    slot_bound = (f"the request-slot table: {slots} rows of C+4={context_len + 4} int32"
                  f"{' (row cap)' if slots == REQ_TO_TOKEN_MAX_ROWS else ''}")
    if max_running_requests is not None:
        running, running_bound = max_running_requests, f"--max-running-requests={max_running_requests}"
    elif cpu_default_running and CPU_DEFAULT_MAX_RUNNING_REQUESTS <= total // 2:
        running, running_bound = CPU_DEFAULT_MAX_RUNNING_REQUESTS, "the CPU default that sizes the KV pool"
    else:
        running, running_bound = max(1, total // 2), "T // 2"
    if slots < running:
        if max_running_requests is not None:
            notes.append(f"--max-running-requests={max_running_requests} lowered to {slots} to keep "
                         f"req_to_token small ({slots} x {context_len + 4} int32); lower --context-length "
                         f"for more rows.")
        running, running_bound = slots, slot_bound
    if context_len <= total:
        max_req_len, input_bound = context_len - 1, f"context length {context_len}"
    else:
        max_req_len, input_bound = total - 1, f"KV pool of T={total} tokens"
    max_req_input_len = max_req_len - _INPUT_RESERVE
    if max_req_input_len < 1:
        raise KVCacheMemoryError(
            "Not enough memory. Please try to increase --mem-fraction-static. "
            f"The KV pool holds T={total} tokens ({total_bound}), so max_req_input_len = min(C-1, T-1) - "
            f"{_INPUT_RESERVE} = {max_req_input_len}: no request could be admitted."
        )
    if max_req_input_len < context_len - 6:
        notes.append(
            f"Requests longer than max_req_input_len={max_req_input_len} tokens will be refused, below the "
            f"model's context length C={context_len}, because the KV pool holds only T={total} tokens "
            f"({total_bound}). To accept longer requests raise --mem-fraction-static or --max-total-tokens, "
            f"store the KV cache in fp8 (--kv-cache-dtype fp8_e4m3), or set a smaller --context-length."
        )
    return KVBudget(device_kind, page_size, context_len, cell_size, total, total_bound, running,
                    running_bound, max_req_len, max_req_input_len, input_bound, warnings=tuple(notes),
                    **memory)


# --- measuring -------------------------------------------------------------------------------

@dataclass(frozen=True)
class MemoryReading:
    """Free and total bytes of the device (host RAM on CPU) and where they were read."""

    free_bytes: int
    total_bytes: int
    source: str


def _meminfo_kib(key: str) -> Optional[int]:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name == key:
                    return int(value.split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_headroom() -> Optional[int]:
    """Bytes left under this process's cgroup memory limit (v2, then v1); None without a limit."""
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_path, encoding="ascii") as f:
                limit = f.read().strip()
            with open(usage_path, encoding="ascii") as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < (1 << 60):  # "max" or a near-2^63 value: no limit
            return max(0, int(limit) - usage)
    return None


def _host_memory() -> MemoryReading:
    avail_kib, total_kib = _meminfo_kib("MemAvailable"), _meminfo_kib("MemTotal")
    if avail_kib is not None and total_kib is not None:
        reading = MemoryReading(avail_kib * 1024, total_kib * 1024, "/proc/meminfo MemAvailable")
    else:
        try:
            import psutil  # optional; only where /proc/meminfo is missing

            vm = psutil.virtual_memory()
            reading = MemoryReading(int(vm.available), int(vm.total), "psutil")
        except ImportError:
            page = os.sysconf("SC_PAGE_SIZE")
            # Free (not available) pages: undercounts reclaimable cache, which errs on the safe side.
            reading = MemoryReading(os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page,
                                    "os.sysconf free pages")
    headroom = _cgroup_headroom()
    if headroom is not None and headroom < reading.free_bytes:
        return MemoryReading(headroom, reading.total_bytes, reading.source + " capped by the cgroup limit")
    return reading


def read_free_memory(device: str) -> MemoryReading:
    """Free memory now: `torch.cuda.mem_get_info` on CUDA, available host RAM on CPU."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(torch.device(device))
        return MemoryReading(int(free), int(total), "torch.cuda.mem_get_info")
    return _host_memory()


def module_nbytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (shared tensors counted once), packed CPU
    weights included."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        # Meta tensors (check_config's model) and oneDNN-packed weights (opaque, no data_ptr)
        # have no storage to compare: identity is the only key.
        key = ("id", id(t)) if t.is_meta or t.is_mkldnn else (t.device, t.data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def free_memory_after_load(device: str, pre: MemoryReading, model: nn.Module) -> int:
    """`avail` of 4.3. On CUDA, measured. On CPU, `pre - bytes of the loaded weights`: MemAvailable
    moves with the page cache (safetensors are mmapped) and with every other process, so a second
    reading would mostly measure noise."""
    if str(device).startswith("cuda"):
        return read_free_memory(device).free_bytes
    return pre.free_bytes - module_nbytes(model)
