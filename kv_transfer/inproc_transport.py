"""InProcessKVTransport: KV "transfer" between engines of one process, for unit tests.

The fake beside the real backend (SGLang's disaggregation keeps one too): a read is a tensor
copy of whole blocks from the peer's KV tensor into ours, so disaggregated serving can be
tested without NIXL or a second process. Everything around the copy is the real contract:
the PeerInfo handshake and compatibility check, incarnations (a replaced peer's handle goes
stale), id checks, deadlines, injected faults and metrics. Peers find each other through a
process-wide registry keyed by (worker_id, incarnation); the NIXL fields of PeerInfo carry
placeholders ("inproc" agent, no metadata).
"""
from __future__ import annotations

import secrets
import threading
import time
import weakref
from collections.abc import Sequence

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
    PeerInfo,
    check_layout_matches_compat,
    check_new_peer,
    compat_hash,
    normalize_config,
)
from .layout import KVLayout, check_block_ids, coalesce_pairs
from .metrics import KVMetrics, kv_metrics

# (worker_id, incarnation) -> live transport; weak so a dropped worker disappears
_REGISTRY: weakref.WeakValueDictionary[tuple[str, str], InProcessKVTransport] = \
    weakref.WeakValueDictionary()
_REGISTRY_LOCK = threading.Lock()


class InProcessKVTransport:
    def __init__(self, kv_cache: torch.Tensor, worker_id: str, compat: dict,
                 faults: FaultInjector | None = None, *, role: str = "decode",
                 metrics: KVMetrics | None = None) -> None:
        if not isinstance(worker_id, str) or not worker_id:
            raise ValueError(f"worker_id: must be a non-empty str, got {worker_id!r}")
        self.layout = KVLayout.from_cache(kv_cache)
        compat = normalize_config(compat)
        check_layout_matches_compat(self.layout, compat)
        self.worker_id = worker_id
        self.incarnation = secrets.token_hex(8)
        self._kv = kv_cache
        self._faults = faults
        self._metrics = metrics or kv_metrics().bind(role, worker_id)
        self._info = PeerInfo(
            worker_id=worker_id, incarnation=self.incarnation, agent_name="inproc",
            agent_metadata=b"", kv_base_addr=kv_cache.data_ptr(),
            kv_device_id=kv_cache.get_device() if kv_cache.is_cuda else 0,
            kv_mem_type="VRAM" if kv_cache.is_cuda else "DRAM", layout=self.layout,
            compat_hash=compat_hash(compat), compat_config=compat)
        self._peers: dict[str, PeerInfo] = {}
        self._lock = threading.Lock()
        self._closed = False
        with _REGISTRY_LOCK:
            _REGISTRY[(worker_id, self.incarnation)] = self

    def peer_info(self) -> PeerInfo:
        return self._info

    def add_peer(self, info: PeerInfo) -> None:
        """Trust `info` for reads; refuses incompatible peers, replaces older incarnations."""
        check_new_peer(self._info, info)
        with self._lock:
            self._check_open()
            self._peers[info.worker_id] = info

    def warm_up(self, peer_worker_id: str, incarnation: str, deadline: float) -> float:
        """Nothing to set up in-process: checks the peer is known and alive."""
        start = time.monotonic()
        self._peer(peer_worker_id, incarnation)
        return time.monotonic() - start

    def read_blocks(self, peer_worker_id: str, incarnation: str,
                    remote_block_ids: Sequence[int], local_block_ids: Sequence[int],
                    deadline: float) -> TransferStats:
        """Copy remote blocks into local blocks (pair i: remote[i] -> local[i]); the same
        errors as NixlKVTransport.read_blocks."""
        start = time.monotonic()
        try:
            peer = self._peer(peer_worker_id, incarnation)
            local, remote = check_block_ids(local_block_ids, remote_block_ids,
                                            self.layout.num_blocks, peer.layout.num_blocks)
            stats = self._copy(peer, local, remote, deadline, start)
        except KVTransferError:
            self._metrics.transfer_failed()
            raise
        self._metrics.transfer_done(stats.bytes, stats.seconds, stats.descriptors)
        return stats

    def _copy(self, peer: InProcessKVTransport, local: list[int], remote: list[int],
              deadline: float, start: float) -> TransferStats:
        wid = peer.worker_id
        fault = self._faults.on_transfer() if self._faults is not None and local else None
        if fault is not None and fault.fail:
            raise KVTransferError(f"peer {wid!r}: read failed (fault injected into "
                                  f"transfer #{fault.number})") from InjectedFault(fault.number)
        if fault is not None and fault.delay_s:
            time.sleep(max(0.0, min(fault.delay_s, deadline - time.monotonic())))
        if time.monotonic() >= deadline:
            raise KVTransferTimeout(f"peer {wid!r}: deadline passed before the read finished")
        if local:
            src = torch.tensor(remote, device=peer._kv.device)
            dst = torch.tensor(local, device=self._kv.device)
            self._kv[dst] = peer._kv[src].to(self._kv.device)
        runs = len(coalesce_pairs(local, remote)) if local else 0
        return TransferStats(len(local) * self.layout.block_bytes, time.monotonic() - start,
                             runs, len(local))

    def _peer(self, worker_id: str, incarnation: str) -> InProcessKVTransport:
        with self._lock:
            self._check_open()
            info = self._peers.get(worker_id)
        if info is None:
            raise UnknownPeerError(f"peer {worker_id!r}: not added to {self.worker_id!r}")
        if info.incarnation != incarnation:
            raise StalePeerError(f"peer {worker_id!r}: incarnation {incarnation} is stale "
                                 f"(current {info.incarnation}); it restarted")
        with _REGISTRY_LOCK:
            peer = _REGISTRY.get((worker_id, incarnation))
        if peer is None or peer._closed:
            raise KVTransferError(f"peer {worker_id!r}: incarnation {incarnation} is gone")
        return peer

    def _check_open(self) -> None:
        if self._closed:
            raise KVTransferError(f"transport of {self.worker_id!r} is closed")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._peers.clear()
        with _REGISTRY_LOCK:
            _REGISTRY.pop((self.worker_id, self.incarnation), None)
