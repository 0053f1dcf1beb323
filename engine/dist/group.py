"""The process groups of one tensor-parallel worker, joined and left with deadlines.

Two groups and a channel over one TCP store (rank 0 hosts it):
  * `device`: the forward's collectives (all-reduce after row-parallel layers, the vocabulary
    all-gather); NCCL on CUDA, gloo on CPU.
  * `control`: gloo over CPU tensors, for the join's barrier.
  * `steps`: the lockstep step messages (protocol.py) on TCP streams from rank 0
    (step_channel.py: a send does not wait for the followers, as a gloo broadcast does), so
    a follower waiting for the next step never blocks a GPU stream, and the leader's idle
    keep-alives cost no device work.

Groups are ProcessGroup objects built directly on the store (no torch.distributed default
group, no global state): a process may hold several (tests run one per rank process), and
every wait goes through TPGroup with its deadline.

Deadlines (a dead rank must not hang the others):
  * join: the store connection and the store barrier wait at most timeout_s;
  * gloo collectives raise after timeout_s, and at once when a peer's socket closes (a
    killed rank: "Connection reset by peer");
  * NCCL: the communicator's timeout is timeout_s; torch's NCCL watchdog thread aborts a
    collective that outlives it and tears the process down (TORCH_NCCL_ASYNC_ERROR_HANDLING's
    default), so the rank actor dies and Ray restarts the whole group (worker/tp_group.py);
    collectives inside CUDA graphs, which torch's watchdog does not see, by the group's
    GpuWatchdog (watchdog.py): no GPU progress for timeout_s past a step message ends the
    process the same way;
  * a follower's wait for the next step: the leader sends a keep-alive message at least every
    timeout_s / 4 while idle, so silence for timeout_s means the leader is gone; a closed
    step stream fails at once.
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist

from pdserve.engine.dist.config import ParallelConfig
from pdserve.engine.dist.errors import GroupError
from pdserve.engine.dist.peer_all_reduce import PeerAllReduce
from pdserve.engine.dist.step_channel import StepChannel
from pdserve.engine.dist.watchdog import GpuWatchdog, end_process

__all__ = ["GroupError", "TPGroup", "open_store"]

log = logging.getLogger(__name__)


def _split(address: str) -> tuple[str, int]:
    """("host", port) of "tcp://host:port"; an IPv6 host may come bracketed ("[::1]")."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    return host.removeprefix("[").removesuffix("]"), int(port)


def open_store(cfg: ParallelConfig) -> dist.TCPStore:
    """Rank 0 hosts the store (port 0 in init_address: any free port, see .port); the others
    connect to it, waiting at most cfg.join_deadline_s.

    Rank 0 listens on init_address's host only: torch's store server, left to itself,
    listens on every interface (::) whatever host it is given, and the store is an
    unauthenticated key-value service that the ranks read their step messages from. So the
    socket is bound here and handed over (master_listen_fd; the store closes it)."""
    host, port = _split(cfg.init_address)
    # the join's deadline; TPGroup._join sets timeout_s once the group has formed
    timeout = datetime.timedelta(seconds=cfg.join_deadline_s)
    if cfg.is_leader:
        return _host_store(cfg, host, port, timeout)
    try:
        return dist.TCPStore(host, port, cfg.tp_size, False, timeout=timeout)
    except (RuntimeError, TimeoutError) as e:  # DistStoreError is a RuntimeError
        raise GroupError(f"init_address: rank {cfg.rank} could not reach the store at "
                         f"{cfg.init_address} within {cfg.join_deadline_s} s: {e}") from e


def _host_store(cfg: ParallelConfig, host: str, port: int,
                timeout: datetime.timedelta) -> dist.TCPStore:
    """Rank 0's store on a socket bound to `host` alone (IPv4 or IPv6), handed to torch."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        listener = socket.create_server((host, port), family=family)
    except OSError as e:
        raise GroupError(f"init_address: rank 0 could not listen on {cfg.init_address}: "
                         f"{e}") from e
    port, fd = listener.getsockname()[1], listener.detach()
    try:
        return dist.TCPStore(host, port, cfg.tp_size, True, timeout=timeout,
                             wait_for_workers=False, master_listen_fd=fd)
    except (RuntimeError, TimeoutError) as e:  # the store did not take the socket: close it
        os.close(fd)
        raise GroupError(f"init_address: rank 0 could not start the store on "
                         f"{cfg.init_address}: {e}") from e


class TPGroup:
    """One rank's view of its worker's groups. size 1: every collective is the identity.
    on_gpu_stall: what the NCCL group's GpuWatchdog does on a stall (default: end the
    process); the watchdog runs once started (start_watchdog(), after the graph captures)."""

    def __init__(self, cfg: ParallelConfig, store: dist.Store | None = None,
                 on_gpu_stall: Callable[[str], None] = end_process) -> None:
        self.cfg = cfg
        self.rank, self.size = cfg.rank, cfg.tp_size
        self.timeout = datetime.timedelta(seconds=cfg.timeout_s)
        self.store = store
        self.device: dist.ProcessGroup | None = None
        self.control: dist.ProcessGroup | None = None
        self.steps: StepChannel | None = None
        self.peer: PeerAllReduce | None = None  # graph captures' all-reduce (NCCL only)
        self.watchdog: GpuWatchdog | None = None  # NCCL only: collectives inside graphs
        self._on_gpu_stall = on_gpu_stall
        if self.size == 1:
            return
        if store is None:
            self.store = store = open_store(cfg)
        try:
            self._join(cfg, store)
        except BaseException:
            self.close()  # what joined so far: sockets, groups (the caller gets no object)
            raise

    def _join(self, cfg: ParallelConfig, store: dist.Store) -> None:
        try:
            # every rank in the control group within the join deadline (a peer may still be
            # loading); from then on each store wait takes timeout_s, and so does each
            # collective (_run waits timeout_s whatever the group's own timeout)
            join = datetime.timedelta(seconds=cfg.join_deadline_s)
            store.set_timeout(join)  # a store the caller passed may have another timeout
            self.control = dist.ProcessGroupGloo(dist.PrefixStore("control", store),
                                                 self.rank, self.size, join)
            store.set_timeout(self.timeout)
            if cfg.backend == "nccl":
                # NCCL binds a communicator to the current device, and Triton launches on it:
                # make it this rank's GPU, and connect now (not lazily inside the first
                # forward's all-reduce, where a rank still loading holds the others up)
                dev = torch.device(cfg.device)
                torch.cuda.set_device(dev)
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = self.timeout
                self.device = dist.ProcessGroupNCCL(dist.PrefixStore("device", store),
                                                    self.rank, self.size, opts)
                self.device.eager_connect_single_device(dev)
                self.peer = self._peer(cfg, store)
                self.watchdog = GpuWatchdog(dev, cfg.timeout_s, f"tensor-parallel rank "
                                            f"{self.rank}", on_stall=self._on_gpu_stall)
            else:
                self.device = dist.ProcessGroupGloo(dist.PrefixStore("device", store),
                                                    self.rank, self.size, self.timeout)
        except RuntimeError as e:
            raise GroupError(f"rank {self.rank}: joining the group of {self.size} failed "
                             f"within {cfg.join_deadline_s} s: {e}") from e
        self.steps = StepChannel(self.rank, self.size, store, _split(cfg.init_address)[0],
                                 cfg.timeout_s)
        self.barrier()  # every rank is in: a rank that never came fails here, in timeout_s

    def _peer(self, cfg: ParallelConfig, store: dist.Store) -> PeerAllReduce | None:
        """The graph captures' peer all-reduce on every rank, or on none: a rank that could
        not map peer memory makes every rank capture NCCL (mixed, they would deadlock).
        Only when cfg asks for it (a group that captures graphs), and only a process's first
        group (PeerAllReduce.fresh_process: every rank must be fresh)."""
        if cfg.peer_all_reduce_bytes == 0:  # the same on every rank: one config, asdict'ed
            return None
        if not self.all_agree(PeerAllReduce.fresh_process()):
            log.warning("rank %d: a process of this group joined peer memory before; CUDA "
                        "graphs at TP use NCCL", self.rank)
            return None
        peer = None
        try:
            peer = PeerAllReduce.join(cfg, store, self.device)
            if self.all_agree(peer is not None):
                return peer
        except BaseException:
            if peer is not None:
                peer.close()
            raise
        if peer is not None:
            peer.close()
        return None

    def start_watchdog(self) -> None:
        """Start the GPU watchdog (an NCCL group's; none elsewhere): call it once this rank's
        graphs are captured, since marks before it are skipped."""
        if self.watchdog is not None:
            self.watchdog.start()

    # -- collectives (each waits at most timeout_s) ---------------------------------------
    def all_agree(self, ok: bool) -> bool:
        """True on every rank when every rank's ok is True (a minimum over the control
        group, on the host)."""
        if self.size == 1:
            return ok
        flag = torch.tensor([int(ok)], dtype=torch.int32)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._run(lambda: self.control.allreduce([flag], opts), "all_agree")
        return bool(flag.item())

    def _run(self, start: Callable[[], dist.Work | None], what: str,
             on_device: bool = False) -> None:
        """Start a collective (start() inside the try: a synchronous failure is a GroupError
        too) and wait for it. A device collective on NCCL is stream-ordered: wait() makes the
        current stream wait for it and returns at once, so the forward queues on without a
        host round trip per all-reduce and can be captured in a CUDA graph; its deadline is
        the communicator's timeout, enforced by torch's NCCL watchdog. (wait(timeout) on NCCL
        polls the collective's completion from the host, ~1 ms sleeps apart, and cannot run
        under graph capture.) gloo collectives wait on the host, at most timeout_s."""
        nccl = on_device and self.cfg.backend == "nccl"
        try:
            work = start()
            if nccl and work is None:  # asyncOp False (torch 2.11): on the stream, no Work
                return
            if nccl:
                work.wait()
            else:
                work.wait(self.timeout)
        except RuntimeError as e:
            raise GroupError(f"rank {self.rank}: {what} failed (a rank died or passed the "
                             f"{self.cfg.timeout_s} s deadline): {e}") from e

    def reduces_in_triton(self, t: torch.Tensor, eager_peer: bool = False) -> bool:
        """Whether all_reduce(t, eager_peer=eager_peer) here launches the push kernel: a
        Triton kernel that lets its dependents in, so the next launch may be a PDL one
        (behind NCCL's kernel a PDL launch broke graph captures, kernels/rmsnorm.py)."""
        return self.peer is not None and self.peer.fits(t) and (
            eager_peer or torch.cuda.is_current_stream_capturing())

    def all_reduce(self, t: torch.Tensor, pdl: bool = False,
                   eager_peer: bool = False) -> torch.Tensor:
        """Sum over ranks; returns the sum (t itself, summed in place, or a new tensor).
        Under a CUDA graph capture, or outside one where the caller asks (eager_peer: a
        decode step's small collectives, where NCCL's eager call costs ~30 us): the one-shot
        peer all-reduce (peer_all_reduce.py), when the group joined it, launched as a PDL
        dependent when `pdl` (t comes from a PDL-chained Triton kernel). Each call site
        decides the same way on every rank (capture and eager_peer follow the lockstep
        messages; fits() looks at shape and dtype only). Else NCCL: the collective runs on
        the current stream (asyncOp False, torch >= 2.8): no side stream to join and no
        event pair per call."""
        if self.reduces_in_triton(t, eager_peer):
            return self.peer.all_reduce(t, pdl=pdl)
        if self.size > 1:
            opts = dist.AllreduceOptions()
            opts.asyncOp = self.cfg.backend != "nccl"
            self._run(lambda: self.device.allreduce([t], opts), "all_reduce", on_device=True)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1, eager_peer: bool = False
                   ) -> torch.Tensor:
        """[..., n, ...] per rank -> the ranks' pieces concatenated along dim (rank order).
        eager_peer: as all_reduce's, a sum of zero-padded pieces when the peer kernel takes
        the dtype and the whole (exact: each value plus zeros)."""
        if self.size == 1:
            return t
        dim = dim % t.dim()
        if eager_peer and self.peer is not None:
            shape = list(t.shape)
            n, shape[dim] = shape[dim], shape[dim] * self.size
            padded = t.new_zeros(shape)
            if self.peer.fits(padded):
                padded.narrow(dim, self.rank * n, n).copy_(t)
                return self.peer.all_reduce(padded)
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._run(lambda: self.device.allgather([parts], [t]), "all_gather", on_device=True)
        return torch.cat(parts, dim=dim)

    def broadcast_control(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's CPU tensor into t on every rank (the lockstep step channel), in place."""
        return self.steps.broadcast(t) if self.size > 1 else t

    def barrier(self) -> None:
        if self.size > 1:
            self._run(lambda: self.control.allreduce([torch.zeros(1)]), "barrier")

    def close(self) -> None:
        """Leave: drop the groups (their sockets close, so peers still waiting fail at once
        instead of at their deadline) and the store connection."""
        if self.watchdog is not None:
            self.watchdog.close()
        if self.steps is not None:
            self.steps.close()
        if self.peer is not None:
            self.peer.close()
        for pg in (self.device, self.control):
            # NCCL: abort (ncclCommAbort) rather than a destroy that waits for collectives
            # a dead or departed peer never joins
            end = getattr(pg, "abort", None) if self.cfg.backend == "nccl" and pg is self.device \
                else None
            end = end or getattr(pg, "shutdown", None)
            if end is not None:
                try:
                    end()
                except RuntimeError:
                    pass
        self.device = self.control = self.steps = self.peer = self.watchdog = None
        self.store = None
