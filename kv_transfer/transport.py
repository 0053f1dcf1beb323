"""KVTransport: exactly what the workers call to move KV blocks, and the backends behind it.

    transport = make_transport(cfg.kv_transport, kv_cache, worker_id, compat, ...)
    info = transport.peer_info()          # published to peers (PeerInfo bytes over gRPC)
    transport.add_peer(peer_info)         # refuses an incompatible peer, naming the field
    # tensor parallelism: one transport per rank (tp=TPKVInfo, rank=r); rank 0 publishes
    # group_peer_info(its peer_info(), [each rank's rank_endpoint()]); every rank adds peers
    # and reads its own head slices (same block ids on every rank)
    transport.warm_up(peer, incarnation, deadline)
    transport.read_blocks(peer, incarnation, remote_ids, local_ids, deadline)   # pull
    transport.close()

Backends: "nixl" (NixlKVTransport: UCX between processes, GPUs or host memory; the real one)
and "inproc" (InProcessKVTransport: copies between engines of one process; unit tests).
Both check compatibility, ids, deadlines and injected faults the same way, so a worker runs
unchanged on either.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from pdserve.engine.core.tp import TPKVInfo

from .errors import TransferStats
from .faults import FaultInjector
from .handshake import PeerInfo, RankEndpoint
from .metrics import KVMetrics


class KVTransport(Protocol):
    """One worker's end of KV transfer: its KV tensor registered once, peers by incarnation."""

    worker_id: str
    incarnation: str  # random per construction: a restarted worker is a new peer

    def peer_info(self) -> PeerInfo: ...

    def rank_endpoint(self) -> RankEndpoint: ...

    def add_peer(self, info: PeerInfo) -> None: ...

    def remove_peer(self, worker_id: str) -> bool: ...

    def warm_up(self, peer_worker_id: str, incarnation: str, deadline: float) -> float: ...

    def read_blocks(self, peer_worker_id: str, incarnation: str,
                    remote_block_ids: Sequence[int], local_block_ids: Sequence[int],
                    deadline: float) -> TransferStats: ...

    def close(self) -> None: ...


TransportFactory = Callable[..., KVTransport]


def _nixl(*args: object, **kw: object) -> KVTransport:
    from .nixl_transport import NixlKVTransport  # NIXL itself loads on construction

    return NixlKVTransport(*args, **kw)  # type: ignore[arg-type]


def _inproc(*args: object, **kw: object) -> KVTransport:
    from .inproc_transport import InProcessKVTransport

    return InProcessKVTransport(*args, **kw)  # type: ignore[arg-type]


TRANSPORTS: dict[str, TransportFactory] = {"nixl": _nixl, "inproc": _inproc}


def make_transport(name: str, kv_cache: torch.Tensor, worker_id: str, compat: dict, *,
                   faults: FaultInjector | None = None, role: str = "decode",
                   metrics: KVMetrics | None = None, tp: TPKVInfo | None = None,
                   rank: int = 0) -> KVTransport:
    """The backend `name` (TRANSPORTS) over this worker's KV tensor (with `tp`: over rank
    `rank`'s KV tensor of a tensor-parallel worker)."""
    try:
        factory = TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"kv_transport: unknown {name!r}; known: {sorted(TRANSPORTS)}") from None
    return factory(kv_cache, worker_id, compat, faults, role=role, metrics=metrics, tp=tp,
                   rank=rank)
