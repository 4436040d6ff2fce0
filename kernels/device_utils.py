"""Host-to-device transfers for the per-step tensors built from Python lists (any layer may use it).

Every hot-path tensor names its device. Tensors built on the host from scheduler state are
created on `device="cpu"` on purpose and, when the target is a GPU, in pinned memory so the
copy is asynchronous (the caching host allocator keeps the buffer alive until it lands).
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

Device = Union[str, torch.device]


def is_cuda(device: Device) -> bool:
    return torch.device(device).type == "cuda"


def host_to_device(values: Sequence, dtype: torch.dtype, device: Device) -> torch.Tensor:
    """`values` (a list, possibly nested) as a tensor on `device`, pinned and non-blocking on CUDA."""
    if not is_cuda(device):
        return torch.tensor(values, dtype=dtype, device=device)
    host = torch.tensor(values, dtype=dtype, device="cpu").pin_memory()
    return host.to(device, non_blocking=True)


def empty_on(device: Device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=device)
