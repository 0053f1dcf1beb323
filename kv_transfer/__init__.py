"""pdserve kv_transfer: KV block layout, NIXL transport, leases, handshake, fault injection.

    from kv_transfer import NixlKVTransport, PeerInfo, LeaseTable, compat_config

Importing this package does not import NIXL; constructing a NixlKVTransport does.
"""
from .faults import FaultConfig, FaultInjector, InjectedFault
from .handshake import (HandshakeError, IncompatiblePeerError, PeerInfo, check_compatible,
                        compat_config, compat_hash)
from .layout import KVLayout, Run, coalesce, coalesce_pairs
from .lease import Lease, LeaseError, LeaseTable
from .metrics import KVMetrics, KVTransferMetrics, kv_metrics
from .errors import (KVTransferError, KVTransferTimeout, StalePeerError, TransferStats,
                     UnknownPeerError)
from .nixl_transport import NixlKVTransport

__all__ = [
    "FaultConfig", "FaultInjector", "InjectedFault",
    "HandshakeError", "IncompatiblePeerError", "PeerInfo", "check_compatible",
    "compat_config", "compat_hash",
    "KVLayout", "Run", "coalesce", "coalesce_pairs",
    "Lease", "LeaseError", "LeaseTable",
    "KVMetrics", "KVTransferMetrics", "kv_metrics",
    "KVTransferError", "KVTransferTimeout", "NixlKVTransport", "StalePeerError",
    "TransferStats", "UnknownPeerError",
]
