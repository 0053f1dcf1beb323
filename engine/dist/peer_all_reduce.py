"""A one-shot all-reduce through peer GPU memory, for the collectives inside CUDA graphs.

Why not NCCL there (measured on two H200s joined by NVLink, bf16 [T, 4096], per all-reduce
inside a graph of 73; bench/results/allreduce_h200x2_2026-11-29b.json):

    rows   torch's NCCL group         NCCL called directly   this (one-shot, peer memory)
    1      hung in 3 of 3 probe runs  18.1 us                6.2 us
    64     (at 64 or 256 rows)        21.4 us                9.5 us
    256                               36.0 us               18.5 us

In Qwen3-8B's TP 2 decode graphs the two came out level (0.74 vs 0.67 ms of collectives a
step, 337.0 vs 332.8 tok/s at batch 1; bench/results/tp_h200x2_2026-11-29_peer.json,
_nccl_graphs.json): there the wait for the follower rank dominates. This path stays for its
isolated speed, which counts once the ranks launch together, and because torch's NCCL group
hung in graph probes before. A decode step's all-reduces are small (one row per sequence),
where NCCL's ring protocol pays its fixed cost twice over. One-shot: every rank copies its
rows into its own buffer of symmetric memory (mapped into every peer's address space), the
ranks meet at a barrier of device-side signals, and every rank reads all peers' buffers over
NVLink and sums. That is
torch's symmetric-memory kernel (torch.ops.symm_mem.one_shot_all_reduce_copy_out: the copy,
the barrier and the sum in one launch), as vLLM and SGLang use peer memory for theirs.

Only graph captures use it (TPGroup.all_reduce). Eager all-reduces stay on NCCL, whose
watchdog aborts one that a dead peer never joins; the device-side barrier here has no
deadline, as no collective inside a replayed graph has (docs/tensor_parallel.md).

    # TPGroup._peer, at the group's join: every rank, or none
    peer = PeerAllReduce.join(cfg, store, nccl) if group.all_agree(fresh_process()) else None
    peer = peer if group.all_agree(peer is not None) else None
    if peer is not None and peer.fits(x):
        y = peer.all_reduce(x)               # a new [T, H] tensor, on the current stream
"""
from __future__ import annotations

import logging
import secrets

import torch
import torch.distributed as dist

from pdserve.engine.dist.config import ParallelConfig

log = logging.getLogger(__name__)

# the activations' dtypes the kernel sums: bf16 (bf16 and FP8 checkpoints), fp32 (the
# tests). torch's one-shot kernel has no fp16: fp16 all-reduces stay on NCCL
DTYPES = (torch.bfloat16, torch.float32)
NAME_KEY = "peer_all_reduce/name"
ALIGN = 16  # bytes: the kernel reads and writes 16-byte vectors


class PeerAllReduce:
    """One rank's symmetric buffers, one of cfg.peer_all_reduce_bytes per dtype (the kernel
    sums in the input's dtype, so each dtype has its own), and the group they joined.

    One group per process: torch exchanges the buffers' handles under keys numbered by a
    per-process counter, so a process's second group (an offline engine made after another,
    in rank 0's process) would wait for keys its fresh follower processes never write, then
    fail at the store's deadline. TPGroup asks every rank for fresh_process() first."""

    _exchanged = False  # this process has exchanged symmetric memory (joined or tried)

    @classmethod
    def fresh_process(cls) -> bool:
        return not cls._exchanged

    def __init__(self, buffers: dict[torch.dtype, torch.Tensor], group_name: str,
                 registered: dist.ProcessGroup) -> None:
        self.buffers = buffers  # dtype -> [n] symmetric: every rank's holds n elements
        self.group_name = group_name
        self.registered = registered  # c10d's registry holds it weakly: kept alive here

    @classmethod
    def join(cls, cfg: ParallelConfig, store: dist.Store,
             nccl: dist.ProcessGroupNCCL) -> PeerAllReduce | None:
        """Allocate and exchange the buffers (every rank of the group calls this, in step).
        None, with the reason logged, when this torch or machine cannot map peer memory:
        graph captures then use NCCL."""
        if cfg.backend != "nccl" or cfg.tp_size < 2 or cfg.peer_all_reduce_bytes == 0:
            return None
        # a name no other group of this process has (rank 0's random one, read from the
        # store): a group left registered by an engine in this process must not be joined
        if cfg.is_leader:
            store.set(NAME_KEY, f"pdserve-tp-{secrets.token_hex(8)}")
        name = store.get(NAME_KEY).decode()
        PeerAllReduce._exchanged = True
        try:
            import torch.distributed._symmetric_memory as symm_mem

            torch.ops.symm_mem.one_shot_all_reduce_copy_out  # noqa: B018 - this torch has it
            registered = _register(name, cfg, store, nccl)
            buffers = {}
            for dtype in DTYPES:
                n = cfg.peer_all_reduce_bytes // dtype.itemsize
                buffers[dtype] = symm_mem.empty(n, dtype=dtype, device=cfg.device)
                symm_mem.rendezvous(buffers[dtype], name)
        except Exception as e:  # noqa: BLE001 - any failure here means: use NCCL
            log.warning("rank %d: no peer-memory all-reduce (%s: %s); CUDA graphs at TP use "
                        "NCCL", cfg.rank, type(e).__name__, e)
            _unregister(name)
            return None
        return cls(buffers, name, registered)

    def fits(self, x: torch.Tensor) -> bool:
        """x's dtype has a buffer that holds x, and x is whole 16-byte vectors. Shape and
        dtype only: they are the same on every rank, so every rank takes the same path (one
        rank in the peer kernel's barrier and another in NCCL would wait for each other
        forever)."""
        buffer = self.buffers.get(x.dtype)
        return buffer is not None and x.numel() <= buffer.numel() \
            and x.numel() * x.element_size() % ALIGN == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x [T, H], as a new tensor (x is left as it was). One
        kernel: x into this rank's buffer, the barrier, the sum of every rank's buffer."""
        x = x.contiguous()
        out = torch.empty_like(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(
            self.buffers[x.dtype][:x.numel()], x.view(-1), "sum", self.group_name, out.view(-1))
        return out

    def close(self) -> None:
        self.buffers = {}
        _unregister(self.group_name)
        self.registered = None


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
