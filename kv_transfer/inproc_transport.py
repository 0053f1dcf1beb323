"""InProcessKVTransport: KV "transfer" between engines of one process, for unit tests.

The fake beside the real backend (SGLang's disaggregation keeps one too): a read is a tensor
copy of whole blocks from the peer's KV tensor into ours, so disaggregated serving can be
tested without NIXL or a second process. Everything around the copy is the real contract:
the PeerInfo handshake and compatibility check, incarnations (a replaced peer's handle goes
stale), id checks, deadlines, injected faults and metrics. Peers find each other through a
process-wide registry keyed by agent name (one per transport: "inproc:<worker>/<rank>#<incarnation>");
the other NIXL fields of PeerInfo carry placeholders (no metadata). With tensor parallelism
each rank has its own transport (`tp`, `rank`) and a read copies this rank's pull_plan row
as the same byte ranges NixlKVTransport would read (kv_transfer/tp_pull.py).
"""
from __future__ import annotations

import secrets
import threading
import time
import weakref
from collections.abc import Sequence

import torch

from pdserve.engine.core.tp import TPKVInfo

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
    RankEndpoint,
    cache_layout,
    check_new_peer,
    compat_hash,
    local_tp_info,
    normalize_config,
)
from .layout import check_block_ids
from .metrics import KVMetrics, kv_metrics
from .tp_pull import SourcePull, byte_ranges, rank_sources

# agent name -> live transport; weak so a dropped worker disappears
_REGISTRY: weakref.WeakValueDictionary[str, InProcessKVTransport] = \
    weakref.WeakValueDictionary()
_REGISTRY_LOCK = threading.Lock()


class InProcessKVTransport:
    def __init__(self, kv_cache: torch.Tensor, worker_id: str, compat: dict,
                 faults: FaultInjector | None = None, *, role: str = "decode",
                 metrics: KVMetrics | None = None, tp: TPKVInfo | None = None,
                 rank: int = 0) -> None:
        if not isinstance(worker_id, str) or not worker_id:
            raise ValueError(f"worker_id: must be a non-empty str, got {worker_id!r}")
        compat = normalize_config(compat)
        self.layout = cache_layout(kv_cache, compat)
        self.tp = local_tp_info(self.layout, compat, tp, rank)
        self.rank = rank
        self.worker_id = worker_id
        self.incarnation = secrets.token_hex(8)
        self._agent_name = f"inproc:{worker_id}/{rank}#{self.incarnation}"
        self._kv = kv_cache
        self._faults = faults
        self._metrics = metrics or kv_metrics().bind(role, worker_id)
        self._info = PeerInfo(
            worker_id=worker_id, incarnation=self.incarnation, agent_name=self._agent_name,
            agent_metadata=b"", kv_base_addr=kv_cache.data_ptr(),
            kv_device_id=kv_cache.get_device() if kv_cache.is_cuda else 0,
            kv_mem_type="VRAM" if kv_cache.is_cuda else "DRAM", layout=self.layout,
            compat_hash=compat_hash(compat), compat_config=compat, tp=self.tp)
        # worker id -> (its PeerInfo, this rank's sources in it)
        self._peers: dict[str, tuple[PeerInfo, list[SourcePull]]] = {}
        self._lock = threading.Lock()
        self._closed = False
        with _REGISTRY_LOCK:
            _REGISTRY[self._agent_name] = self

    def peer_info(self) -> PeerInfo:
        """This rank's own PeerInfo (a TP group publishes group_peer_info of rank 0's)."""
        return self._info

    def rank_endpoint(self) -> RankEndpoint:
        return self._info.endpoint

    def add_peer(self, info: PeerInfo) -> None:
        """Trust `info` for reads; refuses incompatible peers, replaces older incarnations."""
        check_new_peer(self._info, info)
        sources = rank_sources(info, self.tp, self.rank)
        with self._lock:
            self._check_open()
            self._peers[info.worker_id] = (info, sources)

    def remove_peer(self, worker_id: str) -> bool:
        with self._lock:
            return self._peers.pop(worker_id, None) is not None

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
            info, sources = self._peer(peer_worker_id, incarnation)
            local, remote = check_block_ids(local_block_ids, remote_block_ids,
                                            self.layout.num_blocks, info.layout.num_blocks)
            stats = self._copy(info, sources, local, remote, deadline, start)
        except KVTransferError:
            self._metrics.transfer_failed()
            raise
        self._metrics.transfer_done(stats.bytes, stats.seconds, stats.descriptors)
        return stats

    def _copy(self, info: PeerInfo, sources: list[SourcePull], local: list[int],
              remote: list[int], deadline: float, start: float) -> TransferStats:
        wid = info.worker_id
        fault = self._faults.on_transfer() if self._faults is not None and local else None
        if fault is not None and fault.fail:
            raise KVTransferError(f"peer {wid!r}: read failed (fault injected into "
                                  f"transfer #{fault.number})") from InjectedFault(fault.number)
        if fault is not None and fault.delay_s:
            time.sleep(max(0.0, min(fault.delay_s, deadline - time.monotonic())))
        if time.monotonic() >= deadline:
            raise KVTransferTimeout(f"peer {wid!r}: deadline passed before the read finished")
        nbytes = runs = 0
        if local:
            dst = _bytes_of(self._kv)
            for src in sources:
                peer = self._source(info, src)
                ranges = byte_ranges(src, local, remote, self.layout)
                srcb = _bytes_of(peer._kv)
                for s, d, n in ranges.tolist():
                    dst[d:d + n] = srcb[s:s + n].to(dst.device)
                nbytes, runs = nbytes + int(ranges[:, 2].sum()), runs + len(ranges)
        return TransferStats(nbytes, time.monotonic() - start, runs, len(local))

    def _peer(self, worker_id: str, incarnation: str) -> tuple[PeerInfo, list[SourcePull]]:
        with self._lock:
            self._check_open()
            entry = self._peers.get(worker_id)
        if entry is None:
            raise UnknownPeerError(f"peer {worker_id!r}: not added to {self.worker_id!r}")
        info, sources = entry
        if info.incarnation != incarnation:
            raise StalePeerError(f"peer {worker_id!r}: incarnation {incarnation} is stale "
                                 f"(current {info.incarnation}); it restarted")
        for src in sources:
            self._source(info, src)
        return entry

    def _source(self, info: PeerInfo, src: SourcePull) -> InProcessKVTransport:
        with _REGISTRY_LOCK:
            peer = _REGISTRY.get(src.agent_name)
        if peer is None or peer._closed:
            raise KVTransferError(f"peer {info.worker_id!r}: incarnation {info.incarnation} "
                                  f"(rank {src.src_rank}) is gone")
        return peer

    def _check_open(self) -> None:
        if self._closed:
            raise KVTransferError(f"transport of {self.worker_id!r} is closed")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._peers.clear()
        with _REGISTRY_LOCK:
            _REGISTRY.pop(self._agent_name, None)


def _bytes_of(kv: torch.Tensor) -> torch.Tensor:
    """A contiguous KV tensor as flat bytes (a view: writes land in the cache)."""
    return kv.reshape(-1).view(torch.uint8)
