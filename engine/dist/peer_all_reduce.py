"""A one-shot all-reduce through peer GPU memory, for the collectives inside CUDA graphs.

Why not NCCL there (two H200s joined by NVLink, bf16 [T, 4096], per all-reduce inside a
graph of 73; bench/results/allreduce_h200x2_2026-11-29b.json and _2026-11-30_push.json):

    rows   torch's NCCL group    NCCL called directly   torch's one-shot   this (push)
    1      hung in 3 of 3 runs   18.1 us                6.2-6.3 us         2.3 us
    64     (at 64 or 256 rows)   21.4 us                9.5-9.6 us         4.7 us
    256                          36.0 us                18.5-18.6 us       14.7 us

A decode step's all-reduces are small (one row per sequence), where NCCL's ring protocol pays
its fixed cost twice over. torch's one-shot kernel (copy in, a barrier of device-side
signals, a sum over the peers' buffers read over NVLink, a barrier again) still cost ~10 us
a call inside Qwen3-8B's TP 2 decode graphs, 0.74 ms of a 2.96 ms batch-1 step, and as a
non-Triton kernel it broke the PDL chain of the GEMVs twice a layer. So the sum is our own
kernel, kernels/push_all_reduce.py: each rank pushes its rows into every rank's buffer and
sums what arrived in its own, polling per element for a sentinel (no barrier), and it takes
part in PDL behind the GEMVs (pdl=True).

Only graph captures use it (TPGroup.all_reduce). Eager all-reduces stay on NCCL, whose
watchdog aborts one that a dead peer never joins; the kernel's polling has no deadline, as no
collective inside a replayed graph has (the GPU watchdog ends the process,
docs/tensor_parallel.md).

    # TPGroup._peer, at the group's join: every rank, or none
    peer = PeerAllReduce.join(cfg, store, nccl) if group.all_agree(fresh_process()) else None
    peer = peer if group.all_agree(peer is not None) else None
    if peer is not None and peer.fits(x):
        y = peer.all_reduce(x, pdl)          # a new [T, H] tensor, on the current stream
"""
from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pdserve.engine.dist.config import ParallelConfig

if TYPE_CHECKING:
    from pdserve.kernels.push_all_reduce import PushBuffers

log = logging.getLogger(__name__)

# the activations' dtypes the kernel sums (kernels/push_all_reduce.py BITS): bf16 (bf16 and
# FP8 checkpoints), fp32 (the tests); fp16 all-reduces stay on NCCL
DTYPES = (torch.bfloat16, torch.float32)
MAX_WORLD = 8  # kernels/push_all_reduce.py MAX_WORLD (imported with triton, only on join)
NAME_KEY = "peer_all_reduce/name"


class PeerAllReduce:
    """One rank's receive buffers in symmetric memory, one per dtype holding up to
    cfg.peer_all_reduce_bytes of rows (the kernel sums in the input's dtype), and the group
    they joined.

    One group per process: torch exchanges the buffers' handles under keys numbered by a
    per-process counter, so a process's second group (an offline engine made after another,
    in rank 0's process) would wait for keys its fresh follower processes never write, then
    fail at the store's deadline. TPGroup asks every rank for fresh_process() first."""

    _exchanged = False  # this process has exchanged symmetric memory (joined or tried)

    @classmethod
    def fresh_process(cls) -> bool:
        return not cls._exchanged

    def __init__(self, buffers: dict[torch.dtype, PushBuffers], group_name: str,
                 registered: dist.ProcessGroup, keep: list[torch.Tensor]) -> None:
        self.buffers = buffers  # dtype -> this rank's side of the kernel's buffers
        self.group_name = group_name
        self.registered = registered  # c10d's registry holds it weakly: kept alive here
        self._keep = keep  # the symmetric tensors (the buffers hold every rank's view)

    @classmethod
    def join(cls, cfg: ParallelConfig, store: dist.Store,
             nccl: dist.ProcessGroupNCCL) -> PeerAllReduce | None:
        """Allocate and exchange the buffers, each filled with the kernel's sentinel before
        this returns (every rank of the group calls this, in step; the caller's agreement
        after it is the barrier before any rank pushes). None, with the reason logged, when
        this torch or machine cannot map peer memory: graph captures then use NCCL."""
        if cfg.backend != "nccl" or not 2 <= cfg.tp_size <= MAX_WORLD \
                or cfg.peer_all_reduce_bytes == 0:
            return None
        # a name no other group of this process has (rank 0's random one, read from the
        # store): a group left registered by an engine in this process must not be joined
        if cfg.is_leader:
            store.set(NAME_KEY, f"pdserve-tp-{secrets.token_hex(8)}")
        name = store.get(NAME_KEY).decode()
        PeerAllReduce._exchanged = True
        try:
            registered = _register(name, cfg, store, nccl)
            buffers, keep = {}, []
            for dtype in DTYPES:
                buffers[dtype] = _exchange(dtype, cfg, name, keep)
            torch.cuda.synchronize(cfg.device)  # every buffer empty before anyone pushes
        except Exception as e:  # noqa: BLE001 - any failure here means: use NCCL
            log.warning("rank %d: no peer-memory all-reduce (%s: %s); CUDA graphs at TP use "
                        "NCCL", cfg.rank, type(e).__name__, e)
            _unregister(name)
            return None
        return cls(buffers, name, registered, keep)

    def fits(self, x: torch.Tensor) -> bool:
        """x's dtype has a buffer that holds x. Shape and dtype only: they are the same on
        every rank, so every rank takes the same path (one rank in the peer kernel and
        another in NCCL would wait for each other forever)."""
        buffers = self.buffers.get(x.dtype)
        return buffers is not None and x.numel() <= buffers.slot

    def all_reduce(self, x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        """The sum of every rank's x [T, H], as a new tensor (x is left as it was), in one
        kernel on the current stream. pdl: the kernel before is a PDL-chained Triton one."""
        from pdserve.kernels.push_all_reduce import push_all_reduce

        return push_all_reduce(x.contiguous(), self.buffers[x.dtype], pdl=pdl)

    def close(self) -> None:
        self.buffers, self._keep = {}, []
        _unregister(self.group_name)
        self.registered = None


def _exchange(dtype: torch.dtype, cfg: ParallelConfig, name: str,
              keep: list[torch.Tensor]) -> PushBuffers:
    """This rank's receive buffer for dtype in symmetric memory, emptied, and every rank's
    buffer as mapped here."""
    import torch.distributed._symmetric_memory as symm_mem

    from pdserve.kernels.push_all_reduce import BITS, PushBuffers

    slot = cfg.peer_all_reduce_bytes // dtype.itemsize
    numel = PushBuffers.elements(slot, cfg.tp_size)
    bits = BITS[dtype]
    mine = PushBuffers.empty(symm_mem.empty(numel, dtype=bits, device=cfg.device))
    handle = symm_mem.rendezvous(mine, name)
    views = [handle.get_buffer(q, (numel,), bits) for q in range(cfg.tp_size)]
    keep.append(mine)
    return PushBuffers(dtype, views, slot, cfg.rank)


def _register(name: str, cfg: ParallelConfig, store: dist.Store,
              nccl: dist.ProcessGroupNCCL) -> dist.ProcessGroup:
    """Symmetric memory finds its group by name in c10d's registry, where
    torch.distributed's own groups go (TPGroup makes its groups without that global
    state): register a ProcessGroup over the group's NCCL backend under `name`. The
    registry keeps a weak reference: the caller keeps the group."""
    from torch._C._distributed_c10d import ProcessGroup, _register_process_group

    pg = ProcessGroup(dist.PrefixStore("peer_all_reduce", store), cfg.rank, cfg.tp_size)
    pg._set_default_backend(ProcessGroup.BackendType.NCCL)
    pg._register_backend(torch.device(cfg.device), ProcessGroup.BackendType.NCCL, nccl)
    pg._set_group_name(name)
    _register_process_group(name, pg)
    return pg


def _unregister(name: str) -> None:
    from torch._C._distributed_c10d import _unregister_process_group

    try:
        _unregister_process_group(name)
    except RuntimeError:  # never registered
        pass
