"""Drive a fixed batch through extend and decode steps without the scheduler.

Used by model-level tests and `scripts/bench_one_batch.py`: it allocates request rows and KV
slots exactly as the scheduler does (`alloc_extend` / `alloc_decode`, rows written into
`req_to_token` before the forward) and gives everything back in `release`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Sequence

import torch

from srt.layers.logits_processor import LogitsProcessorOutput
from srt.model_executor.forward_batch_info import ForwardBatch
from kernels.device_utils import host_to_device

if TYPE_CHECKING:
    from srt.model_executor.model_runner import ModelRunner


class StaticBatch:
    def __init__(self, runner: ModelRunner, batch_size: int):
        self.runner = runner
        rows = runner.req_to_token_pool.alloc(batch_size)
        if rows is None:
            raise RuntimeError(f"no {batch_size} free request slots")
        self.rows = rows
        self.rows_t = torch.tensor(rows, dtype=torch.int64, device=runner.device)
        self.seq_lens = [0] * batch_size

    def _last_locs(self, idx: Sequence[int]) -> torch.Tensor:
        """Slot of each request's last position, gathered on the device (unused where empty)."""
        table = self.runner.req_to_token_pool.req_to_token
        width = table.shape[1]
        flat = [self.rows[i] * width + max(self.seq_lens[i] - 1, 0) for i in idx]
        return table.view(-1).index_select(0, host_to_device(flat, torch.int64, table.device)).to(torch.int64)

    def extend(self, new_ids: Sequence[Sequence[int]], which: Optional[Sequence[int]] = None,
               logprob_starts: Optional[Sequence[int]] = None) -> LogitsProcessorOutput:
        """Append `new_ids[j]` to request `which[j]` (all requests by default) in one EXTEND."""
        which = list(range(len(self.rows))) if which is None else list(which)
        prefix = [self.seq_lens[i] for i in which]
        seq = [p + len(ids) for p, ids in zip(prefix, new_ids)]
        alloc = self.runner.token_to_kv_pool_allocator
        slots = alloc.alloc_extend(prefix, seq, self._last_locs(which))
        if slots is None:
            raise RuntimeError("KV pool exhausted")
        pool, off = self.runner.req_to_token_pool, 0
        for i, p, s in zip(which, prefix, seq):
            pool.write(self.rows[i], p, slots[off : off + s - p])
            off += s - p
            self.seq_lens[i] = s
        fb = ForwardBatch.create_extend(self.runner, new_ids, prefix, [self.rows[i] for i in which],
                                        slots, logprob_starts)
        return self.runner.forward(fb)

    def decode(self, input_ids: torch.Tensor) -> LogitsProcessorOutput:
        """One token per request (all requests), at position `seq_len`."""
        fb = self.prepare_decode(input_ids)
        return self.runner.forward(fb)

    def prepare_decode(self, input_ids: torch.Tensor) -> ForwardBatch:
        """Allocate and record one KV slot per request; the `ForwardBatch` of that decode step."""
        table = self.runner.req_to_token_pool.req_to_token
        last_loc = self._last_locs(range(len(self.rows)))
        new_lens = [s + 1 for s in self.seq_lens]
        slots = self.runner.token_to_kv_pool_allocator.alloc_decode(new_lens, last_loc)
        if slots is None:
            raise RuntimeError("KV pool exhausted")
        width = table.shape[1]
        flat = host_to_device([r * width + n for r, n in zip(self.rows, self.seq_lens)], torch.int64, table.device)
        table.view(-1).index_copy_(0, flat, slots.to(torch.int32))
        self.seq_lens = new_lens
        return ForwardBatch.create_decode(self.runner, input_ids, self.seq_lens, self.rows, slots)

    def release(self) -> None:
        """Free every KV slot and request row this batch holds."""
        table = self.runner.req_to_token_pool.req_to_token
        for row, n in zip(self.rows, self.seq_lens):
            if n:
                self.runner.token_to_kv_pool_allocator.free(table[row, :n].to(torch.int64))
        self.runner.req_to_token_pool.free(self.rows)
        self.rows, self.seq_lens = [], []
