"""Pull KV blocks from a peer worker's KV cache with NIXL (UCX backend), under deadlines.

Each worker registers its whole KV tensor with NIXL once, publishes a `PeerInfo` (opaque
NIXL metadata + address + layout + compatibility), and adds the peers the router introduces.
Decode pulls: `read_blocks` READs remote blocks straight into local blocks.

Descriptors cost ~8 us each (docs/design.md, KV transfer). "coalesced" (default): per read,
(local, remote) id pairs that both advance by one form runs (layout.coalesce_pairs), one
descriptor per run, optionally capped by `max_descriptor_bytes`. "prepped": per peer,
block-granularity lists prepared once (prep_xfer_dlist), each read built by index; NIXL
merges adjacent entries, so it costs the same descriptors minus per-read validation.

Tensor parallelism: each rank of a TP worker has its own transport (`tp`, `rank`) over its
own KV tensor; rank 0 publishes the group's PeerInfo (handshake.group_peer_info). Every
decode rank adds the prefill worker's PeerInfo, loads the agents of the prefill ranks its
pull_plan row reads from, and reads its head slices from each (kv_transfer/tp_pull.py): one
transfer handle per source rank, all posted before the first wait, one deadline for all.
Whole-block pulls (equal TP, rank r <- rank r) coalesce into runs as at TP 1.

Thread-safety: `read_blocks` may run from many threads at once (the NIXL agent runs in
reader-writer sync mode; the peer table, kv_transfer/nixl_peers.py, is under a lock; each
read holds its own transfer handle). `add_peer`/`remove_peer` are safe concurrently with
reads: a replaced or removed peer is dropped from NIXL when its last in-flight read
finishes, and new reads on it raise StalePeerError (replaced) or UnknownPeerError (removed).
The caller must not use the destination blocks while a read is in flight. `close()` waits
(bounded) for in-flight reads, then releases everything.

No pickle: nixl_agent's only pickle paths (get_serialized_descs / deserialize_descs) and its
socket metadata exchange (listener thread, send_local_metadata) are not used; metadata
travels as PeerInfo bytes on the lead's protobuf channel.
"""
from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch

from pdserve.engine.core.tp import TPKVInfo

from .errors import (
    KVTransferError,
    KVTransferTimeout,
    TransferStats,
)
from .faults import FaultInjector, InjectedFault
from .handshake import (
    PeerInfo,
    RankEndpoint,
    cache_layout,
    compat_hash,
    local_tp_info,
    normalize_config,
)
from .layout import block_descriptors, blocks_per_descriptor, check_block_ids
from .metrics import KVMetrics, kv_metrics
from .nixl_agent import descriptor_count, make_agent, nixl_call, read_xfer, try_release, wait_done
from .nixl_peers import Peer, PeerTable
from .tp_pull import SourcePull, byte_ranges, descriptors

log = logging.getLogger(__name__)

DescriptorMode = Literal["coalesced", "prepped"]


class NixlKVTransport:
    def __init__(self, kv_cache: torch.Tensor, worker_id: str, compat: dict,
                 faults: FaultInjector | None = None, *, role: str = "decode",
                 metrics: KVMetrics | None = None, descriptor_mode: DescriptorMode = "coalesced",
                 max_descriptor_bytes: int | None = None, backends: Sequence[str] = ("UCX",),
                 num_threads: int = 0, tp: TPKVInfo | None = None, rank: int = 0) -> None:
        if not isinstance(worker_id, str) or not worker_id:
            raise ValueError(f"worker_id: must be a non-empty str, got {worker_id!r}")
        if descriptor_mode not in ("coalesced", "prepped"):
            raise ValueError(f"descriptor_mode: unknown {descriptor_mode!r}")
        compat = normalize_config(compat)
        self.layout = cache_layout(kv_cache, compat)
        self.tp = local_tp_info(self.layout, compat, tp, rank)
        self.rank = rank
        self._max_blocks = blocks_per_descriptor(self.layout, descriptor_mode,
                                                max_descriptor_bytes)
        self.worker_id = worker_id
        self.incarnation = secrets.token_hex(8)
        self.descriptor_mode = descriptor_mode
        self._faults = faults
        self._metrics = metrics or kv_metrics().bind(role, worker_id)
        self._kv = kv_cache  # NIXL holds raw pointers into it: keep it alive
        self._mem_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        self._device_id = kv_cache.get_device() if kv_cache.is_cuda else 0
        name = f"{worker_id}#{self.incarnation}" if rank == 0 else \
            f"{worker_id}/{rank}#{self.incarnation}"
        self._agent = make_agent(name, backends, num_threads)
        self._reg = self._agent.register_memory(kv_cache)
        # one block of private memory that warm_up() reads into (never a real KV block)
        self._scratch = torch.empty(self.layout.block_bytes, dtype=torch.uint8,
                                    device=kv_cache.device)
        self._scratch_reg = self._agent.register_memory(self._scratch)
        self._local_dlist = None
        if descriptor_mode == "prepped":
            self._local_dlist = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", block_descriptors(kv_cache.data_ptr(), self.layout,
                                                     self._device_id), self._mem_type)
        self._info = PeerInfo(
            worker_id=worker_id, incarnation=self.incarnation, agent_name=self._agent.name,
            agent_metadata=bytes(self._agent.get_agent_metadata()),
            kv_base_addr=kv_cache.data_ptr(), kv_device_id=self._device_id,
            kv_mem_type=self._mem_type, layout=self.layout, compat_hash=compat_hash(compat),
            compat_config=compat, tp=self.tp)
        self._table = PeerTable(self._agent, self._info, self.tp, rank,
                                prepped=descriptor_mode == "prepped")

    def peer_info(self) -> PeerInfo:
        """This rank's own PeerInfo (a TP group publishes group_peer_info of rank 0's)."""
        return self._info

    def rank_endpoint(self) -> RankEndpoint:
        """This rank's agent and KV memory, for rank 0's group PeerInfo."""
        return self._info.endpoint

    # ---- peers ---------------------------------------------------------------------------

    def add_peer(self, info: PeerInfo) -> None:
        """Trust `info` for reads (nixl_peers.PeerTable.add): refuses incompatible peers
        naming the field, replaces older incarnations, loads the agents of the peer's ranks
        this rank reads from."""
        self._table.add(info)

    def remove_peer(self, worker_id: str) -> bool:
        return self._table.remove(worker_id)

    def peers(self) -> dict[str, str]:
        """worker_id -> incarnation of the peers reads may target now."""
        return self._table.incarnations()

    # ---- reads ---------------------------------------------------------------------------

    def read_blocks(self, peer_worker_id: str, incarnation: str,
                    remote_block_ids: Sequence[int], local_block_ids: Sequence[int],
                    deadline: float) -> TransferStats:
        """READ remote blocks into local blocks (pair i: remote_block_ids[i] -> local[i]).

        `deadline` is absolute, in time.monotonic() seconds. Raises KVTransferTimeout past
        it, StalePeerError for a replaced incarnation, UnknownPeerError for an unknown peer,
        KVTransferError (with its cause) for any other failure; ValueError for bad ids.
        """
        start = time.monotonic()
        try:
            peer = self._table.acquire(peer_worker_id, incarnation, self.worker_id)
        except KVTransferError:
            self._metrics.transfer_failed()
            raise
        try:
            local_ids, remote_ids = check_block_ids(local_block_ids, remote_block_ids,
                                                   self.layout.num_blocks,
                                                   peer.info.layout.num_blocks)
            stats = self._read(peer, local_ids, remote_ids, deadline, start)
        except KVTransferError:
            self._metrics.transfer_failed()
            raise
        finally:
            self._table.release(peer)
        self._metrics.transfer_done(stats.bytes, stats.seconds, stats.descriptors)
        return stats

    def _read(self, peer: Peer, local_ids: list[int], remote_ids: list[int],
              deadline: float, start: float) -> TransferStats:
        wid = peer.info.worker_id
        if not local_ids:
            return TransferStats(0, time.monotonic() - start, 0, 0)
        # [n, 3] (remote offset, local offset, length) per source rank
        ranges = [byte_ranges(src, local_ids, remote_ids, self.layout, self._max_blocks)
                  for src in peer.sources]
        fault = self._faults.on_transfer() if self._faults is not None else None
        if fault is not None and fault.fail:
            raise KVTransferError(f"peer {wid!r}: read failed (fault injected into "
                                  f"transfer #{fault.number})") from InjectedFault(fault.number)
        if time.monotonic() >= deadline:
            raise KVTransferTimeout(f"peer {wid!r}: deadline passed before the read started")
        makers = [lambda s=src, r=r: self._make_handle(peer, s, r, local_ids, remote_ids)
                  for src, r in zip(peer.sources, ranges)]
        delay_s = fault.delay_s if fault is not None else 0.0
        descriptors = self._run(makers, [len(r) for r in ranges], peer, deadline, delay_s)
        nbytes = int(sum(int(r[:, 2].sum()) for r in ranges))
        return TransferStats(nbytes, time.monotonic() - start, descriptors, len(local_ids))

    def _run(self, makers: list[Any], runs: list[int], peer: Peer, deadline: float,
             delay_s: float) -> int:
        """Make and post one transfer per source rank, then wait for all by `deadline`, and
        release them; returns NIXL's descriptor count (summed)."""
        wid = peer.info.worker_id
        handles: list[Any] = []
        try:
            for make in makers:
                handles.append(make())
            posted = time.monotonic()
            states = [nixl_call(wid, "post", self._agent.transfer, h) for h in handles]
            for handle, state in zip(handles, states):
                wait_done(self._agent, handle, state, deadline, posted + delay_s, wid)
            descriptors = sum(descriptor_count(self._agent, h, n) for h, n in zip(handles, runs))
        except KVTransferTimeout as e:
            e.local_blocks_safe = all([self._free(h, peer) for h in handles])
            raise
        except BaseException:
            for h in handles:
                self._free(h, peer)
            raise
        for h in handles:
            self._free(h, peer)
        return descriptors

    def warm_up(self, peer_worker_id: str, incarnation: str, deadline: float) -> float:
        """Read the first slice of the peer's block 0 from each rank this rank reads from into
        a private scratch block; returns seconds taken.

        The first read to a peer pays connection and remote-key setup (tens of ms on CPU,
        IPC handle opening on GPUs); call this after add_peer so no request pays it.
        No KV block of this worker is written.
        """
        start = time.monotonic()
        peer = self._table.acquire(peer_worker_id, incarnation, self.worker_id)
        try:
            makers = [lambda s=src: self._scratch_handle(peer, s) for src in peer.sources]
            self._run(makers, [1] * len(makers), peer, deadline, 0.0)
        finally:
            self._table.release(peer)
        return time.monotonic() - start

    def _scratch_handle(self, peer: Peer, src: SourcePull) -> Any:
        # a whole block, or the first slice into where it would land (slices of different
        # sources land in different heads, so concurrent warm-ups never overlap)
        hb, first = self.layout.head_bytes, src.pulls[0]
        src_off, dst_off, nbytes = (0, 0, self.layout.block_bytes) if src.whole else \
            (first.src_head * hb, first.dst_head * hb, first.count * hb)
        ep = src.endpoint
        return read_xfer(self._agent, peer.info.worker_id,
                         [(self._scratch.data_ptr() + dst_off, nbytes, self._device_id)],
                         self._mem_type, [(ep.kv_base_addr + src_off, nbytes, ep.kv_device_id)],
                         ep)

    def _make_handle(self, peer: Peer, src: SourcePull, ranges: np.ndarray,
                     local_ids: list[int], remote_ids: list[int]) -> Any:
        """One READ from source rank `src`: its byte ranges (or, "prepped" and whole blocks,
        the block indices into the prepared lists)."""
        wid, agent, ep = peer.info.worker_id, self._agent, src.endpoint
        dlist = peer.remote_dlists.get(src.src_rank)
        if dlist is not None:
            return nixl_call(wid, "make_prepped_xfer", agent.make_prepped_xfer,
                              "READ", self._local_dlist, np.asarray(local_ids, np.int32),
                              dlist, np.asarray(remote_ids, np.int32))
        return read_xfer(agent, wid, descriptors(self._info.kv_base_addr, ranges[:, 1],
                                                 ranges[:, 2], self._device_id),
                         self._mem_type, descriptors(ep.kv_base_addr, ranges[:, 0], ranges[:, 2],
                                                     ep.kv_device_id), ep)

    def _free(self, handle: Any, peer: Peer) -> bool:
        """Release a transfer handle; False (kept for later) if NIXL cannot abort it yet."""
        if try_release(handle):
            return True
        self._table.keep_leaked(peer, handle)
        return False

    # ---- lifetime ------------------------------------------------------------------------

    def close(self, drain_timeout_s: float = 5.0) -> None:
        """Wait (bounded) for in-flight reads, then drop peers and deregister memory."""
        if not self._table.close(drain_timeout_s):
            return  # closed before
        if self._local_dlist is not None:
            try_release(self._local_dlist)
        try:
            self._agent.deregister_memory(self._reg)
            self._agent.deregister_memory(self._scratch_reg)
        except Exception:
            log.warning("deregistering KV memory of %s failed", self.worker_id, exc_info=True)

    def __enter__(self) -> NixlKVTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

