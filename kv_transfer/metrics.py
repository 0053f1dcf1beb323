"""Prometheus metrics of the KV transfer layer (names prefixed `pdserve:`, labels role, worker).

pdserve's own names (DESIGN.md, Observability) plus the names vLLM's NIXL connector exports,
so dashboards built for `vllm:nixl_*` port by a prefix swap:

    pdserve:kv_transfer_bytes_total         Counter    bytes pulled into this worker
    pdserve:kv_transfer_seconds             Histogram  wall time of one read_blocks
    pdserve:kv_transfer_failures_total      Counter    read_blocks that raised
    pdserve:kv_lease_expired_total          Counter    leases freed by expiry, not release
    pdserve:kv_blocks_pinned                Gauge      blocks held under lease now
    pdserve:nixl_xfer_time_seconds          Histogram  same samples as kv_transfer_seconds
    pdserve:nixl_bytes_transferred          Histogram  bytes per transfer
    pdserve:nixl_num_descriptors            Histogram  descriptors per transfer
    pdserve:nixl_num_failed_transfers_total Counter    same as kv_transfer_failures
    pdserve:nixl_num_kv_expired_reqs_total  Counter    same as kv_lease_expired

`kv_metrics(registry)` is idempotent per registry, so every transport and lease table of a
process shares one set; tests pass their own CollectorRegistry to stay isolated.
"""
from __future__ import annotations

import threading
import weakref

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "pdserve:"
LABELS = ("role", "worker")
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0, 30.0)
BYTES_BUCKETS = tuple(float(1 << p) for p in range(16, 36, 2))  # 64 KiB .. 16 GiB
DESC_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)


class KVTransferMetrics:
    """The metric families, registered once in one registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, LABELS, registry=registry)

        def hist(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(PREFIX + name, doc, LABELS, buckets=buckets, registry=registry)

        self.transfer_bytes = counter("kv_transfer_bytes", "KV bytes pulled from peers")
        self.transfer_seconds = hist("kv_transfer_seconds", "Wall time of one KV read",
                                     SECONDS_BUCKETS)
        self.transfer_failures = counter("kv_transfer_failures", "KV reads that failed")
        self.lease_expired = counter("kv_lease_expired", "KV leases freed by expiry")
        self.blocks_pinned = Gauge(PREFIX + "kv_blocks_pinned", "KV blocks held under lease",
                                   LABELS, registry=registry)
        self.nixl_xfer_time = hist("nixl_xfer_time_seconds", "NIXL transfer time",
                                   SECONDS_BUCKETS)
        self.nixl_bytes = hist("nixl_bytes_transferred", "Bytes per NIXL transfer",
                               BYTES_BUCKETS)
        self.nixl_descriptors = hist("nixl_num_descriptors", "Descriptors per NIXL transfer",
                                     DESC_BUCKETS)
        self.nixl_failed = counter("nixl_num_failed_transfers", "Failed NIXL transfers")
        self.nixl_expired = counter("nixl_num_kv_expired_reqs", "Requests whose KV expired")

    def bind(self, role: str, worker: str) -> KVMetrics:
        return KVMetrics(self, role, worker)


class KVMetrics:
    """The families with (role, worker) labels applied; what transports and tables call."""

    def __init__(self, families: KVTransferMetrics, role: str, worker: str) -> None:
        f, labels = families, {"role": role, "worker": worker}
        self._bytes = f.transfer_bytes.labels(**labels)
        self._seconds = f.transfer_seconds.labels(**labels)
        self._failures = f.transfer_failures.labels(**labels)
        self._expired = f.lease_expired.labels(**labels)
        self._pinned = f.blocks_pinned.labels(**labels)
        self._nixl_time = f.nixl_xfer_time.labels(**labels)
        self._nixl_bytes = f.nixl_bytes.labels(**labels)
        self._nixl_desc = f.nixl_descriptors.labels(**labels)
        self._nixl_failed = f.nixl_failed.labels(**labels)
        self._nixl_expired = f.nixl_expired.labels(**labels)

    def transfer_done(self, nbytes: int, seconds: float, descriptors: int) -> None:
        self._bytes.inc(nbytes)
        self._seconds.observe(seconds)
        self._nixl_time.observe(seconds)
        self._nixl_bytes.observe(nbytes)
        self._nixl_desc.observe(descriptors)

    def transfer_failed(self) -> None:
        self._failures.inc()
        self._nixl_failed.inc()

    def leases_expired(self, n: int) -> None:
        self._expired.inc(n)
        self._nixl_expired.inc(n)

    def set_blocks_pinned(self, n: int) -> None:
        self._pinned.set(n)


_lock = threading.Lock()
_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, KVTransferMetrics] = \
    weakref.WeakKeyDictionary()


def kv_metrics(registry: CollectorRegistry | None = None) -> KVTransferMetrics:
    """The KV metric families of `registry` (default: the global one), created on first use."""
    registry = REGISTRY if registry is None else registry
    with _lock:
        families = _by_registry.get(registry)
        if families is None:
            families = _by_registry[registry] = KVTransferMetrics(registry)
        return families
