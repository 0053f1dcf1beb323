"""Pull KV blocks from a peer worker's KV cache with NIXL (UCX backend), under deadlines.

Each worker registers its whole KV tensor with NIXL once, publishes a `PeerInfo` (opaque
NIXL metadata + address + layout + compatibility), and adds the peers the router introduces.
Decode pulls: `read_blocks` READs remote blocks straight into local blocks.

Descriptors (the measured cost is ~8 us each; DESIGN.md). Two modes, same descriptor count:
  "coalesced" (default): per read, pair up (local, remote) ids into runs where both sides
      advance by one (layout.coalesce_pairs) and hand NIXL one descriptor per run
      (initialize_xfer). `max_descriptor_bytes` can cap a run's size.
  "prepped": per peer, prepare block-granularity descriptor lists once (prep_xfer_dlist,
      one entry per block of the pool) and build each read by index (make_prepped_xfer).
      NIXL merges index-adjacent entries that are contiguous on both sides, so a read also
      costs one descriptor per run (verified through NIXL telemetry in the tests), minus the
      per-read validation; it cannot cap descriptor size.
Measured (bench/lab/bench_kv_transfer.py, Qwen3-8B KV of 10,000 tokens = 1.47 GB, cuda:0 ->
cuda:1 on two NVLinked H200s, UCX_TLS=cuda_ipc,cuda_copy,tcp; medians of 10): one coalesced
descriptor 5.1 ms (287 GB/s), same via "prepped" 5.5 ms, capped at 16 MiB (90 descriptors)
6.3 ms, runs of 4 blocks (157) 6.0 ms, one per block (625) 9.6 ms; torch peer copy 3.8 ms.
So "coalesced" with no cap is the default: fewest descriptors, and the count is ours.

Thread-safety: `read_blocks` may run from many threads at once (the NIXL agent runs in
reader-writer sync mode; the peer table is under a lock; each read holds its own transfer
handle). `add_peer`/`remove_peer` are safe concurrently with reads: a replaced or removed
peer is dropped from NIXL when its last in-flight read finishes, and new reads on it raise
StalePeerError (replaced) or UnknownPeerError (removed). The caller must not use the
destination blocks while a read is in flight.
`close()` waits (bounded) for in-flight reads, then releases everything.

No pickle: nixl_agent's only pickle paths (get_serialized_descs / deserialize_descs) and its
socket metadata exchange (listener thread, send_local_metadata) are not used; metadata
travels as PeerInfo bytes on the lead's protobuf channel.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from .errors import (
    KVTransferError,
    KVTransferTimeout,
    StalePeerError,
    TransferStats,
    UnknownPeerError,
)
from .faults import FaultInjector, InjectedFault
from .handshake import (
    HandshakeError,
    PeerInfo,
    check_layout_matches_compat,
    check_new_peer,
    compat_hash,
    normalize_config,
)
from .layout import (
    KVLayout,
    Run,
    block_descriptors,
    check_block_ids,
    coalesce_pairs,
    run_descriptors,
)
from .metrics import KVMetrics, kv_metrics

log = logging.getLogger(__name__)

DescriptorMode = Literal["coalesced", "prepped"]
SPIN_POLLS = 200  # busy polls (GPU reads finish in ms) before backing off
POLL_SLEEP_S = 0.0002


@dataclass
class _Peer:
    info: PeerInfo
    remote_dlist: Any = None  # nixl_prepped_dlist_handle in "prepped" mode
    inflight: int = 0
    retired: bool = False
    leaked: list = field(default_factory=list)


class NixlKVTransport:
    def __init__(self, kv_cache: torch.Tensor, worker_id: str, compat: dict,
                 faults: FaultInjector | None = None, *, role: str = "decode",
                 metrics: KVMetrics | None = None, descriptor_mode: DescriptorMode = "coalesced",
                 max_descriptor_bytes: int | None = None, backends: Sequence[str] = ("UCX",),
                 num_threads: int = 0) -> None:
        if not isinstance(worker_id, str) or not worker_id:
            raise ValueError(f"worker_id: must be a non-empty str, got {worker_id!r}")
        if descriptor_mode not in ("coalesced", "prepped"):
            raise ValueError(f"descriptor_mode: unknown {descriptor_mode!r}")
        self.layout = KVLayout.from_cache(kv_cache)
        compat = normalize_config(compat)
        check_layout_matches_compat(self.layout, compat)
        self._max_blocks = self._blocks_per_descriptor(descriptor_mode, max_descriptor_bytes)
        self.worker_id = worker_id
        self.incarnation = secrets.token_hex(8)
        self.descriptor_mode = descriptor_mode
        self._faults = faults
        self._metrics = metrics or kv_metrics().bind(role, worker_id)
        self._kv = kv_cache  # NIXL holds raw pointers into it: keep it alive
        self._mem_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        self._device_id = kv_cache.get_device() if kv_cache.is_cuda else 0
        self._agent = _make_agent(f"{worker_id}#{self.incarnation}", backends, num_threads)
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
            compat_config=compat)
        self._lock = threading.Condition()
        self._peers: dict[str, _Peer] = {}
        self._retiring: list[_Peer] = []  # replaced/removed peers with reads in flight
        self._inflight = 0
        self._closed = False

    def _blocks_per_descriptor(self, mode: str, max_bytes: int | None) -> int | None:
        if max_bytes is None:
            return None
        if mode == "prepped":
            raise ValueError("max_descriptor_bytes: only supported with descriptor_mode="
                             "'coalesced' (NIXL merges prepped descriptors itself)")
        if max_bytes < self.layout.block_bytes:
            raise ValueError(f"max_descriptor_bytes: {max_bytes} is below one block "
                             f"({self.layout.block_bytes} bytes)")
        return max_bytes // self.layout.block_bytes

    def peer_info(self) -> PeerInfo:
        return self._info

    # ---- peers ---------------------------------------------------------------------------

    def add_peer(self, info: PeerInfo) -> None:
        """Trust `info` for reads; refuses incompatible peers, replaces older incarnations."""
        check_new_peer(self._info, info)
        with self._lock:
            self._check_open()
            old = self._peers.get(info.worker_id)
            if old is not None and old.info.incarnation == info.incarnation:
                if old.info.agent_metadata != info.agent_metadata:
                    raise HandshakeError(f"peer_info.agent_metadata: changed for {info.worker_id!r}"
                                         f" incarnation {info.incarnation}")
                return  # same peer announced again
            peer = _Peer(info, remote_dlist=self._load_peer(info))
            self._peers[info.worker_id] = peer
            if old is not None:
                self._retire(old)
        log.info("kv peer %s incarnation %s added%s", info.worker_id, info.incarnation,
                 f" (replaces {old.info.incarnation})" if old is not None else "")

    def remove_peer(self, worker_id: str) -> bool:
        with self._lock:
            peer = self._peers.pop(worker_id, None)
            if peer is not None:
                self._retire(peer)
        return peer is not None

    def peers(self) -> dict[str, str]:
        """worker_id -> incarnation of the peers reads may target now."""
        with self._lock:
            return {wid: p.info.incarnation for wid, p in self._peers.items()}

    def _load_peer(self, info: PeerInfo) -> Any:
        try:
            name = self._agent.add_remote_agent(info.agent_metadata)
        except Exception as e:
            raise KVTransferError(f"peer {info.worker_id!r}: NIXL refused its agent "
                                  f"metadata") from e
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != info.agent_name:
            self._agent.remove_remote_agent(name)
            raise HandshakeError(f"peer_info.agent_name: {info.agent_name!r} but its NIXL "
                                 f"metadata names {name!r}")
        if self.descriptor_mode != "prepped":
            return None
        descs = block_descriptors(info.kv_base_addr, info.layout, info.kv_device_id)
        try:
            return self._agent.prep_xfer_dlist(name, descs, info.kv_mem_type)
        except Exception as e:  # e.g. the advertised KV range is not what the peer registered
            self._agent.remove_remote_agent(name)
            raise KVTransferError(f"peer {info.worker_id!r}: NIXL could not prepare its block "
                                  f"descriptors") from e

    def _retire(self, peer: _Peer) -> None:
        """Caller holds the lock. Drop now, or when the peer's last read finishes."""
        peer.retired = True
        if peer.inflight == 0:
            self._drop(peer)
        else:
            self._retiring.append(peer)

    def _drop(self, peer: _Peer) -> None:
        for handle in peer.leaked:  # reads that timed out and could not be aborted then
            _try_release(handle)
        if peer.remote_dlist is not None:
            _try_release(peer.remote_dlist)
        in_use = any(p.info.agent_name == peer.info.agent_name for p in self._peers.values())
        if not in_use:
            try:
                self._agent.remove_remote_agent(peer.info.agent_name)
            except Exception:
                log.warning("removing NIXL agent %s failed", peer.info.agent_name, exc_info=True)

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
            peer = self._acquire(peer_worker_id, incarnation)
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
            self._unacquire(peer)
        self._metrics.transfer_done(stats.bytes, stats.seconds, stats.descriptors)
        return stats

    def _acquire(self, worker_id: str, incarnation: str) -> _Peer:
        with self._lock:
            self._check_open()
            peer = self._peers.get(worker_id)
            if peer is None:
                raise UnknownPeerError(f"peer {worker_id!r}: not added to {self.worker_id!r}")
            if peer.info.incarnation != incarnation:
                raise StalePeerError(f"peer {worker_id!r}: incarnation {incarnation} is stale "
                                     f"(current {peer.info.incarnation}); it restarted")
            peer.inflight += 1
            self._inflight += 1
            return peer

    def _unacquire(self, peer: _Peer) -> None:
        with self._lock:
            peer.inflight -= 1
            self._inflight -= 1
            if peer.retired and peer.inflight == 0 and peer in self._retiring:
                self._retiring.remove(peer)
                self._drop(peer)
            self._lock.notify_all()

    def _read(self, peer: _Peer, local_ids: list[int], remote_ids: list[int],
              deadline: float, start: float) -> TransferStats:
        wid = peer.info.worker_id
        if not local_ids:
            return TransferStats(0, time.monotonic() - start, 0, 0)
        runs = coalesce_pairs(local_ids, remote_ids, self._max_blocks)
        fault = self._faults.on_transfer() if self._faults is not None else None
        if fault is not None and fault.fail:
            raise KVTransferError(f"peer {wid!r}: read failed (fault injected into "
                                  f"transfer #{fault.number})") from InjectedFault(fault.number)
        if time.monotonic() >= deadline:
            raise KVTransferTimeout(f"peer {wid!r}: deadline passed before the read started")
        handle = self._make_handle(peer, runs, local_ids, remote_ids)
        delay_s = fault.delay_s if fault is not None else 0.0
        descriptors = self._run(handle, peer, deadline, delay_s, len(runs))
        nbytes = len(local_ids) * self.layout.block_bytes
        return TransferStats(nbytes, time.monotonic() - start, descriptors, len(local_ids))

    def _run(self, handle: Any, peer: _Peer, deadline: float, delay_s: float,
             runs: int) -> int:
        """Post a transfer, wait for it, release it; returns NIXL's descriptor count."""
        wid = peer.info.worker_id
        try:
            posted = time.monotonic()
            state = self._nixl(wid, "post", self._agent.transfer, handle)
            self._wait(handle, state, deadline, posted + delay_s, wid)
            descriptors = self._descriptor_count(handle, runs)
        except KVTransferTimeout as e:
            e.local_blocks_safe = self._free(handle, peer)
            raise
        except BaseException:
            self._free(handle, peer)
            raise
        self._free(handle, peer)
        return descriptors

    def warm_up(self, peer_worker_id: str, incarnation: str, deadline: float) -> float:
        """Read the peer's block 0 into a private scratch block; returns seconds taken.

        The first read to a peer pays connection and remote-key setup (tens of ms on CPU,
        IPC handle opening on GPUs); call this after add_peer so no request pays it.
        No KV block of this worker is written.
        """
        start = time.monotonic()
        peer = self._acquire(peer_worker_id, incarnation)
        try:
            info, agent, nbytes = peer.info, self._agent, self.layout.block_bytes
            local = [(self._scratch.data_ptr(), nbytes, self._device_id)]
            remote = [(info.kv_base_addr, nbytes, info.kv_device_id)]
            handle = self._nixl(info.worker_id, "initialize_xfer", agent.initialize_xfer,
                                "READ", agent.get_xfer_descs(local, self._mem_type),
                                agent.get_xfer_descs(remote, info.kv_mem_type),
                                info.agent_name)
            self._run(handle, peer, deadline, 0.0, 1)
        finally:
            self._unacquire(peer)
        return time.monotonic() - start

    def _make_handle(self, peer: _Peer, runs: list[Run], local_ids: list[int],
                     remote_ids: list[int]) -> Any:
        info, agent = peer.info, self._agent
        if self.descriptor_mode == "prepped":
            return self._nixl(info.worker_id, "make_prepped_xfer", agent.make_prepped_xfer,
                              "READ", self._local_dlist, np.asarray(local_ids, np.int32),
                              peer.remote_dlist, np.asarray(remote_ids, np.int32))
        counts = [r.count for r in runs]
        local = run_descriptors(self._info.kv_base_addr, self.layout.block_bytes,
                                [r.local_start for r in runs], counts, self._device_id)
        remote = run_descriptors(info.kv_base_addr, self.layout.block_bytes,
                                 [r.remote_start for r in runs], counts, info.kv_device_id)
        return self._nixl(info.worker_id, "initialize_xfer", agent.initialize_xfer, "READ",
                          agent.get_xfer_descs(local, self._mem_type),
                          agent.get_xfer_descs(remote, info.kv_mem_type), info.agent_name)

    def _wait(self, handle: Any, state: str, deadline: float, not_before: float,
              wid: str) -> None:
        """Poll until DONE (and not before `not_before`, the injected delay) or deadline."""
        polls = 0
        while True:
            now = time.monotonic()
            if state == "ERR":
                raise KVTransferError(f"peer {wid!r}: NIXL reported the read failed (ERR)")
            if state == "DONE" and now >= not_before:
                return
            if now >= deadline:
                raise KVTransferTimeout(f"peer {wid!r}: read not done by its deadline")
            wake = min(deadline, not_before) if state == "DONE" else deadline
            time.sleep(0 if polls < SPIN_POLLS else min(POLL_SLEEP_S, max(0.0, wake - now)))
            polls += 1
            if state != "DONE":
                state = self._nixl(wid, "check_xfer_state", self._agent.check_xfer_state, handle)

    def _descriptor_count(self, handle: Any, runs: int) -> int:
        try:
            return int(self._agent.get_xfer_telemetry(handle).descCount)
        except Exception:  # telemetry unavailable: NIXL merges to one descriptor per run
            return runs

    def _free(self, handle: Any, peer: _Peer) -> bool:
        """Release a transfer handle; False (kept for later) if NIXL cannot abort it yet."""
        if _try_release(handle):
            return True
        with self._lock:
            peer.leaked.append(handle)
        return False

    def _nixl(self, wid: str, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:
            raise KVTransferError(f"peer {wid!r}: NIXL {what} failed: "
                                  f"{type(e).__name__}: {e}") from e

    # ---- lifetime ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise KVTransferError(f"transport of {self.worker_id!r} is closed")

    def close(self, drain_timeout_s: float = 5.0) -> None:
        """Wait (bounded) for in-flight reads, then drop peers and deregister memory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.wait_for(lambda: self._inflight == 0, timeout=drain_timeout_s)
            peers = list(self._peers.values()) + self._retiring
            self._peers.clear()
            self._retiring = []
            for peer in peers:
                self._drop(peer)
        if self._local_dlist is not None:
            _try_release(self._local_dlist)
        try:
            self._agent.deregister_memory(self._reg)
            self._agent.deregister_memory(self._scratch_reg)
        except Exception:
            log.warning("deregistering KV memory of %s failed", self.worker_id, exc_info=True)

    def __enter__(self) -> NixlKVTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _make_agent(name: str, backends: Sequence[str], num_threads: int) -> Any:
    # Imported here: `import nixl` loads UCX and CUDA plugins; handshake users don't need it.
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    config = nixl_agent_config(
        enable_prog_thread=True, enable_listen_thread=False,  # no socket metadata exchange
        capture_telemetry=True,  # per-transfer descriptor counts
        num_threads=num_threads, backends=list(backends),
        sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)  # concurrent reads from a pool
    agent = nixl_agent(name, config)
    missing = [b for b in backends if b not in agent.backends]
    if missing:
        raise KVTransferError(f"backends: NIXL plugin(s) {missing} unavailable "
                              f"(have {agent.get_plugin_list()})")
    return agent


def _try_release(handle: Any) -> bool:
    try:
        handle.release()
        return True
    except Exception:
        log.warning("releasing NIXL handle %r failed", handle, exc_info=True)
        return False
