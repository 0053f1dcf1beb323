"""pdserve kv_transfer: KV block layout, the KVTransport interface and its backends (NIXL, and
in-process for unit tests), leases, handshake, fault injection.

    from pdserve.kv_transfer import make_transport, PeerInfo, LeaseTable

Importing this package does not import NIXL; constructing a NixlKVTransport does.
"""
from .errors import (
    KVTransferError,
    KVTransferTimeout,
    StalePeerError,
    TransferStats,
    UnknownPeerError,
)
from .faults import FaultConfig, FaultInjector, InjectedFault
from .handshake import (
    HandshakeError,
    IncompatiblePeerError,
    PeerInfo,
    RankEndpoint,
    check_compatible,
    compat_hash,
    group_peer_info,
)
from .inproc_transport import InProcessKVTransport
from .layout import KVLayout, Run, coalesce, coalesce_pairs
from .lease import Lease, LeaseError, LeaseTable
from .metrics import KVMetrics, KVTransferMetrics, kv_metrics
from .nixl_transport import NixlKVTransport
from .transport import TRANSPORTS, KVTransport, make_transport

__all__ = [
    "FaultConfig", "FaultInjector", "InjectedFault",
    "HandshakeError", "IncompatiblePeerError", "PeerInfo", "RankEndpoint", "check_compatible",
    "compat_hash", "group_peer_info",
    "KVLayout", "Run", "coalesce", "coalesce_pairs",
    "Lease", "LeaseError", "LeaseTable",
    "KVMetrics", "KVTransferMetrics", "kv_metrics",
    "InProcessKVTransport", "KVTransferError", "KVTransferTimeout", "KVTransport",
    "NixlKVTransport", "StalePeerError", "TRANSPORTS", "make_transport",
    "TransferStats", "UnknownPeerError",
]
