"""`DataParallelController`: `--dp-size` scheduler replicas behind one tokenizer manager.

Each replica (its own TP group, KV pool and radix cache) listens on its own socket. A new
request goes to one replica, chosen by SGLang's `--load-balance-method`: `round_robin` (in turn)
or `shortest_queue` (fewest requests in flight from this front end, lowest index on a tie),
unless the request names its `data_parallel_rank` (sglang-router's `--dp-aware` mode). An
n > 1 request stays whole on its replica, so its children share the cached prompt. Aborts and
admin queries go to every replica; their replies are merged by `merge_loads` / `merge_flushes`.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, List

from managers.io_struct import FlushCacheReqOutput, GetLoadReqOutput, TokenizedGenerateReqInput

logger = logging.getLogger(__name__)


class DataParallelController:
    def __init__(self, sends: List[Callable[[object], None]], method: str = "round_robin"):
        if method not in ("round_robin", "shortest_queue"):
            raise ValueError(f"Invalid --load-balance-method {method!r}. Accepted values: round_robin, shortest_queue.")
        self.sends = sends
        self.method = method
        self.inflight = [0] * len(sends)
        self.dispatched = [0] * len(sends)
        self.owner: Dict[str, int] = {}
        self._next = 0

    @property
    def dp_size(self) -> int:
        return len(self.sends)

    def pick(self) -> int:
        if self.method == "round_robin":
            replica, self._next = self._next, (self._next + 1) % self.dp_size
            return replica
        return min(range(self.dp_size), key=lambda d: (self.inflight[d], d))

    def send(self, msg: object) -> None:
        if isinstance(msg, TokenizedGenerateReqInput):
            chosen = msg.data_parallel_rank
            replica = self.pick() if chosen is None else chosen
            self.owner[msg.rid] = replica
            self.inflight[replica] += 1
            self.dispatched[replica] += 1
            self.sends[replica](msg)
            return
        for send in self.sends:  # aborts, flush, load: every replica
            send(msg)

    def release(self, rid: str) -> None:
        """The front end is done with `rid` (finished, aborted or refused)."""
        replica = self.owner.pop(rid, None)
        if replica is not None:
            self.inflight[replica] -= 1


def merge_loads(loads: List[GetLoadReqOutput]) -> GetLoadReqOutput:
    """Totals over the replicas (token usage weighted by pool size), each replica kept in `replicas`."""
    loads = sorted(loads, key=lambda x: x.dp_rank)
    pool = sum(x.max_total_num_tokens for x in loads)
    counters: Dict[str, float] = {}
    for load in loads:
        for key, value in load.counters.items():
            counters[key] = counters.get(key, 0) + value
    memory: Dict[str, int] = {}
    for load in loads:
        for key, value in load.memory.items():
            memory[key] = memory.get(key, 0) + value
    usage = sum(x.token_usage * x.max_total_num_tokens for x in loads) / pool if pool else 0.0
    return GetLoadReqOutput(sum(x.num_running_reqs for x in loads), sum(x.num_waiting_reqs for x in loads), usage,
                            pool, counters, dp_rank=-1, replicas=[_replica_dict(x) for x in loads], memory=memory)


def _replica_dict(load: GetLoadReqOutput) -> dict:
    return dict(dp_rank=load.dp_rank, num_running_reqs=load.num_running_reqs, num_waiting_reqs=load.num_waiting_reqs,
                token_usage=load.token_usage, max_total_num_tokens=load.max_total_num_tokens,
                counters=dict(load.counters), memory=dict(load.memory))


def merge_flushes(replies: List[FlushCacheReqOutput]) -> FlushCacheReqOutput:
    ok = all(r.success for r in replies)
    if ok:
        return FlushCacheReqOutput(True, "Cache flushed.")
    return FlushCacheReqOutput(False, "; ".join(r.message for r in replies if not r.success))
