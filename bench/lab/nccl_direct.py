"""NCCL called directly (ctypes), for the all-reduce probe (bench/lab/probe_allreduce.py
--comm direct): a candidate for the TP decode graphs' collectives.

Why: torch's ProcessGroupNCCL tracks every collective's work for its watchdog, and under CUDA
graph capture that tracking is where two known hangs live (pytorch/pytorch#115388: a group
that captured collectives hangs when destroyed; #104487: later captures of a warm-up-then-
capture loop fail where the first worked), both seen on two H200s here
(bench/results/allreduce_h200x2_2026-11-29.json). vLLM and SGLang call NCCL themselves on the
current stream for graphs; this is that, small, for measuring. On two H200s (2026-11-29,
bench/results/allreduce_h200x2_2026-11-29b.json) it captured and replayed cleanly, 18.1 /
21.4 / 36.0 us an all-reduce at 1 / 64 / 256 rows inside a graph; torch's symmetric-memory
one-shot kernel took 6.2 / 9.5 / 18.5, and the engine's graphs use that
(engine/dist/peer_all_reduce.py). Lab code, not used by the engine.

    comm = DirectComm.join(rank, size, store, device)   # rank 0's unique id through the store
    comm.all_reduce(x)                                   # in place, on the current stream
    comm.close()
"""
from __future__ import annotations

import ctypes
import os
import time

import torch

_DTYPES = {torch.float16: 6, torch.float32: 7, torch.bfloat16: 9, torch.int64: 4}
_SUM = 0
_ID_BYTES = 128
UNIQUE_ID_KEY = "nccl_direct/unique_id"


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * _ID_BYTES)]


def _library() -> ctypes.CDLL:
    """libnccl.so.2: the copy torch already loaded (its path in /proc/self/maps), else the
    loader's search path."""
    import torch.distributed  # noqa: F401 - loads NCCL with torch's CUDA build

    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libnccl.so" in line}
    found = [p for p in sorted(paths) if os.path.exists(p)]
    lib = ctypes.CDLL(found[0] if found else "libnccl.so.2")
    c = ctypes
    lib.ncclGetUniqueId.argtypes = [c.POINTER(_UniqueId)]
    lib.ncclCommInitRank.argtypes = [c.POINTER(c.c_void_p), c.c_int, _UniqueId, c.c_int]
    lib.ncclAllReduce.argtypes = [c.c_void_p, c.c_void_p, c.c_size_t, c.c_int, c.c_int,
                                  c.c_void_p, c.c_void_p]
    lib.ncclCommDestroy.argtypes = lib.ncclCommAbort.argtypes = [c.c_void_p]
    lib.ncclGetErrorString.argtypes = [c.c_int]
    lib.ncclGetErrorString.restype = c.c_char_p
    return lib


class NcclError(RuntimeError):
    """An NCCL call failed; the message names the call and NCCL's reason."""


class DirectComm:
    """One rank's NCCL communicator, its collectives launched on the current CUDA stream."""

    def __init__(self, lib: ctypes.CDLL, comm: ctypes.c_void_p, rank: int, size: int,
                 device: torch.device) -> None:
        self.lib, self.comm, self.rank, self.size, self.device = lib, comm, rank, size, device

    def _check(self, what: str, code: int) -> None:
        if code != 0:
            reason = self.lib.ncclGetErrorString(code).decode()
            raise NcclError(f"rank {self.rank}: {what} failed: {reason} ({code})")

    @classmethod
    def join(cls, rank: int, size: int, store, device: torch.device,
             timeout_s: float = 60.0) -> DirectComm:
        """Rank 0 makes the unique id and puts it in `store`; every rank reads it (the store's
        get waits for it) and joins. ncclCommInitRank blocks until all ranks joined."""
        lib = _library()
        uid = _UniqueId()
        if rank == 0:
            code = lib.ncclGetUniqueId(ctypes.byref(uid))
            if code != 0:
                raise NcclError(f"rank 0: ncclGetUniqueId failed ({code})")
            store.set(UNIQUE_ID_KEY, bytes(bytearray(uid.internal)))
        else:
            raw = store.get(UNIQUE_ID_KEY)
            ctypes.memmove(ctypes.byref(uid), raw, _ID_BYTES)
        torch.cuda.set_device(device)
        comm = ctypes.c_void_p()
        t0 = time.monotonic()
        code = lib.ncclCommInitRank(ctypes.byref(comm), size, uid, rank)
        out = cls(lib, comm, rank, size, device)
        out._check(f"ncclCommInitRank ({time.monotonic() - t0:.1f} s)", code)
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks in place, on the current stream (capturable: a kernel node)."""
        if x.dtype not in _DTYPES or not x.is_contiguous() or x.device != self.device:
            raise ValueError(f"x: a contiguous {sorted(map(str, _DTYPES))} tensor on "
                             f"{self.device}, got {x.dtype} on {x.device}")
        stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        ptr = ctypes.c_void_p(x.data_ptr())
        self._check("ncclAllReduce", self.lib.ncclAllReduce(
            ptr, ptr, x.numel(), _DTYPES[x.dtype], _SUM, self.comm, stream))
        return x

    def close(self, abort: bool = False) -> None:
        """Destroy the communicator (abort: without waiting for collectives in flight)."""
        if self.comm:
            fn = self.lib.ncclCommAbort if abort else self.lib.ncclCommDestroy
            self._check("ncclCommAbort" if abort else "ncclCommDestroy", fn(self.comm))
            self.comm = ctypes.c_void_p()
