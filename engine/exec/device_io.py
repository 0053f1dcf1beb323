"""Host lists onto the device without stopping the host.

torch.tensor(values, device="cuda") builds the tensor in pageable memory and copies it with a
stream synchronize: the host waits for every kernel already queued (a whole forward), and
the work it launches next finds the GPU idle. A verify step did this twice (its row index,
then its argmax) -- ~0.75 ms of GPU idle each on an H100 (bench/lab/diag_spec.py). Staging
through pinned memory makes the copy an ordinary queued operation.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """values (a flat or nested list) as a tensor of `dtype` on `device`, queued behind the
    stream's work instead of waiting for it (pinned staging; the caching host allocator keeps
    the staging buffer until the copy has run)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def rows_of(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] for a host list of row indices; x itself when rows are all of x in order."""
    if len(rows) == x.shape[0] and rows == list(range(len(rows))):
        return x
    return x[to_device(rows, torch.int64, x.device)]
