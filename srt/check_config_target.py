"""`check_config --target-input-len N`: would the runtime admit an N-token prompt under these flags,
and if not, the smallest flag change that admits it (found by re-running `compute_kv_budget`).

The runtime's rules (`managers/scheduler_admission.py`): the tokenizer manager refuses `L >= C`; the
scheduler refuses `L >= max_req_input_len` (`= min(C - 1, T - 1) - 5`) and, with page size P, a
prompt whose pages plus one decode token exceed the pool, `ceil((L + 1) / P) * P > T`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from srt.environ import envs
from srt.model_executor.memory_sizing import KVBudget, KVCacheMemoryError, compute_kv_budget

# L < max_req_input_len = min(C - 1, T - 1) - 5  <=>  C >= L + 7 and T >= L + 7.
INPUT_MARGIN = 7
# --mem-fraction-static is searched in steps of 0.001 over (0, 1) (ServerArgs refuses 1).
_STEPS = 1000


def _pages(n: int, page_size: int) -> int:
    return -(-n // page_size)


def tokens_needed(n: int, page_size: int) -> int:
    """The smallest pool T (a page multiple) whose limits admit an n-token prompt."""
    need = max(n + INPUT_MARGIN, _pages(n + 1, page_size) * page_size)
    return _pages(need, page_size) * page_size


def refusal(n: int, budget: KVBudget) -> Optional[str]:
    """Why the runtime would refuse an n-token prompt under `budget` (None: admitted), first check first."""
    C, M = budget.context_len, budget.max_req_input_len
    P, T = budget.page_size, budget.max_total_num_tokens
    if n >= C:
        return f"the tokenizer manager refuses it: {n} >= the context length C={C}."
    if n >= M:
        return (f"the scheduler refuses it: {n} >= max_req_input_len={M} = min(C - 1, T - 1) - 5 "
                f"(bound by {budget.input_bound}).")
    if _pages(n + 1, P) * P > T:
        return (f"the scheduler refuses it: Request prompt exceeds the KV memory budget ({n} tokens plus one to "
                f"decode need {_pages(n + 1, P)} pages of {P} tokens > T={T}).")
    return None


@dataclass(frozen=True)
class SizingInputs:
    """The arguments `ModelRunner._size_kv_pool` passes to `compute_kv_budget`."""

    pre: int
    avail: int
    fraction: float
    cell: int
    page_size: int
    context_len: int
    max_total_tokens: Optional[int]
    max_running_requests: Optional[int]
    device_kind: str

    def budget(self) -> KVBudget:
        return compute_kv_budget(self.pre, self.avail, self.fraction, self.cell, self.page_size, self.context_len,
                                 self.max_total_tokens, self.max_running_requests, self.device_kind)

    def admits(self, n: int) -> bool:
        try:
            return refusal(n, self.budget()) is None
        except KVCacheMemoryError:
            return False


def smallest_fraction(n: int, inputs: SizingInputs) -> Optional[float]:
    """The smallest --mem-fraction-static in steps of 0.001 that admits n (admission grows with it)."""
    if not dataclasses.replace(inputs, fraction=(_STEPS - 1) / _STEPS).admits(n):
        return None
    lo, hi = 0, _STEPS - 1  # hi admits; lo (0) is not a valid fraction
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if dataclasses.replace(inputs, fraction=mid / _STEPS).admits(n):
            hi = mid
        else:
            lo = mid
    return hi / _STEPS


@dataclass(frozen=True)
class ContextInfo:
    """The derived context length (before --context-length), its source, and the weight bytes at a
    context length (rotary cos/sin buffers grow with it)."""

    derived: int
    source: str
    weight_bytes_at: Callable[[int], int]


def plan_target(n: int, inputs: SizingInputs, context: ContextInfo, fp8_cell: int,
                budget: Optional[KVBudget], error: Optional[str]) -> Dict[str, Any]:
    """Whether n is admitted now (`budget`, or the start-up `error`) and the smallest change that admits it."""
    need_t, need_c = tokens_needed(n, inputs.page_size), n + INPUT_MARGIN
    if error is not None:
        now: Optional[str] = "the server would not start: " + error.split(". ")[0].rstrip(".") + "."
    else:
        now = refusal(n, budget) if budget is not None else "no KV pool."
    changes: List[Tuple[str, str, str]] = []
    setting = inputs
    if setting.context_len < need_c:
        changes.append(_context_change(need_c, setting.context_len, context))
        avail = setting.pre - context.weight_bytes_at(need_c)  # rotary buffers grow with C
        setting = dataclasses.replace(setting, context_len=need_c, avail=avail)
    if setting.max_total_tokens is not None and setting.max_total_tokens < need_t:
        changes.append(("--max-total-tokens", str(need_t), f"the cap {setting.max_total_tokens} is below the "
                        f"{need_t} KV tokens an input of {n} needs"))
        setting = dataclasses.replace(setting, max_total_tokens=need_t)
    fraction = smallest_fraction(n, setting)
    fp8_fraction = None
    if not setting.admits(n):
        fp8_fraction = _memory_changes(n, setting, fraction, fp8_cell, need_t, changes)
    plan = {
        "input_len": n, "admitted": now is None, "refused_because": now, "tokens_needed": need_t,
        "context_len_needed": need_c, "min_mem_fraction_static": fraction,
        "fp8_min_mem_fraction_static": fp8_fraction,
        "changes": [{"flag": f, "value": v, "why": w} for f, v, w in changes],
    }
    plan["suggestion"] = _suggestion(plan, setting, need_t)
    return plan


def _memory_changes(n: int, setting: SizingInputs, fraction: Optional[float], fp8_cell: int, need_t: int,
                    changes: List[Tuple[str, str, str]]) -> Optional[float]:
    """Append the fraction (or fp8 and its fraction) that admits n; returns the fp8 fraction if tried."""
    if fraction is not None:
        changes.append(("--mem-fraction-static", f"{fraction:.3f}",
                        f"the smallest in steps of 0.001 that gives a pool of T >= {need_t} tokens"))
        return None
    if fp8_cell >= setting.cell:
        return None
    fp8 = dataclasses.replace(setting, cell=fp8_cell)
    fp8_fraction = smallest_fraction(n, fp8)
    if fp8_fraction is not None:
        changes.append(("--kv-cache-dtype", "fp8_e4m3", f"no --mem-fraction-static below 1 fits {need_t} tokens "
                        f"of {setting.cell} B; with 1-byte elements a token takes {fp8_cell} B"))
        if not fp8.admits(n):
            changes.append(("--mem-fraction-static", f"{fp8_fraction:.3f}", "the smallest that fits with fp8"))
    return fp8_fraction


def _context_change(need_c: int, current: int, context: ContextInfo) -> Tuple[str, str, str]:
    why = f"C={current} must be at least N + {INPUT_MARGIN} = {need_c}"
    if need_c > context.derived and not envs.ALLOW_OVERWRITE_LONGER_CONTEXT_LEN.get():
        why += (f", above the derived length {context.derived} from {context.source}, which needs "
                f"{envs.ALLOW_OVERWRITE_LONGER_CONTEXT_LEN.name}=1 (RoPE models may produce garbage past it)")
    return "--context-length", str(need_c), why


def _suggestion(plan: Dict[str, Any], setting: SizingInputs, need_t: int) -> str:
    n = plan["input_len"]
    if plan["admitted"]:
        text = f"An input of {n} tokens is admitted."
        if plan["min_mem_fraction_static"] is not None:
            text += (f" The smallest --mem-fraction-static that still admits it is "
                     f"{plan['min_mem_fraction_static']:.3f}.")
        return text
    text = f"An input of {n} tokens is not admitted: {plan['refused_because']}"
    fits = plan["min_mem_fraction_static"] is not None or plan["fp8_min_mem_fraction_static"] is not None
    if not fits and not setting.admits(n):
        weights = setting.pre - setting.avail
        return text + (f" No --mem-fraction-static below 1 admits it, not even with --kv-cache-dtype fp8_e4m3: it "
                       f"needs {need_t} KV tokens x {setting.cell} B on top of {weights} B of weights, and "
                       f"{setting.pre} B are free. Use a smaller --dtype or model, or free memory.")
    flags = " ".join(f"{c['flag']} {c['value']}" for c in plan["changes"])
    env = envs.ALLOW_OVERWRITE_LONGER_CONTEXT_LEN.name
    if any(env in c["why"] for c in plan["changes"]):
        flags = f"{env}=1 and {flags}"
    why = "; ".join(c["why"] for c in plan["changes"])
    return text + f" Smallest change that admits it: {flags}. Why: {why}."


def tp_alternative(n: int, inputs: SizingInputs, total_weights: int, tp_now: int, sizes: List[int],
                   cell_at: Callable[[int], int], max_tp: int = 8) -> Optional[Dict[str, Any]]:
    """CUDA: the smallest larger --tp-size (valid for the model, at most `max_tp`) under which each
    GPU, holding 1/tp of the weights and of the KV heads, would admit an n-token input."""
    for t in sizes:
        if t <= tp_now or t > max_tp:
            continue
        trial = dataclasses.replace(inputs, avail=inputs.pre - total_weights // t, cell=cell_at(t))
        if trial.admits(n):
            return {"tp_size": t, "cell": cell_at(t), "weights_per_rank": total_weights // t,
                    "text": f"Or --tp-size {t}: each GPU then holds about 1/{t} of the weights "
                            f"({total_weights // t} B) and a token's KV takes {cell_at(t)} B per GPU."}
    return None
