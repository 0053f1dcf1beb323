"""Host lists onto the device without stopping the host.

torch.tensor(values, device="cuda") builds the tensor in pageable memory and copies it with a
stream synchronize: the host waits for every kernel already queued (a whole forward), and
the work it launches next finds the GPU idle. A verify step did this twice (its row index,
then its argmax) -- ~0.75 ms of GPU idle each on an H100 (bench/lab/diag_spec.py). Staging
through pinned memory makes the copy an ordinary queued operation. The other way, HostCopy
brings ids back on a side stream.
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


def bind_thread(device: torch.device | str) -> None:
    """Make `device` the calling thread's current CUDA device; nothing on CPU. CUDA keeps one
    current device per host thread, and Triton launches on it (whatever device the tensors
    are on), so each thread that runs a model's steps binds its device first: a rank of a
    serving TP worker sees every GPU of its node and runs on one other than cuda:0
    (worker/rank_gpu.py), its steps on threads of its own."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:  # "cuda": the current one
        torch.cuda.set_device(device)


def rows_of(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] for a host list of row indices; x itself when rows are all of x in order."""
    if len(rows) == x.shape[0] and rows == list(range(len(rows))):
        return x
    return x[to_device(rows, torch.int64, x.device)]


class HostCopy:
    """An asynchronous device -> host copy of int64 ids through a reused pinned buffer, so
    work queued after start() does not delay wait() (a plain .tolist() would queue behind it).

    The copy runs on a side stream, after the work that produced the ids: on the compute
    stream it would sit between this step's sampling and the next step's inputs and forward
    (~3 us per copy at batch 1 on an H100, bench/results/diag_spec_k0_*). The ids must not
    be overwritten before wait() (fresh tensors are kept alive for the side stream; static
    graph outputs are replayed again only after the host has read them)."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        self._produced: torch.cuda.Event | None = None
        self._stream: torch.cuda.Stream | None = None
        self._n = 0
        self._ids: list[int] | None = None

    def start(self, ids: torch.Tensor) -> None:
        """Queue the copy of ids (any shape; wait() returns them flattened)."""
        ids = ids.reshape(-1)
        self._n = ids.numel()
        if ids.device.type != "cuda":  # nothing runs ahead of the host on a CPU
            self._ids = ids.tolist()
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(ids.device)
            self._event, self._produced = torch.cuda.Event(), torch.cuda.Event()
        if self._buf is None or self._buf.numel() < self._n:
            self._buf = torch.empty(max(self._n, 256), dtype=torch.int64, pin_memory=True)
        self._produced.record()  # on the compute stream, after the ids' producer
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(self._produced)
            self._buf[:self._n].copy_(ids, non_blocking=True)
            self._event.record(self._stream)
        ids.record_stream(self._stream)
        self._ids = None

    def wait(self) -> list[int]:
        if self._ids is not None:
            return self._ids
        self._event.synchronize()
        return self._buf[:self._n].tolist()
