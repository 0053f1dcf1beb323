"""Metric families: idempotent per registry, labelled, prefixed."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from pdserve.kv_transfer.metrics import kv_metrics


def test_idempotent_per_registry_and_isolated():
    r1, r2 = CollectorRegistry(), CollectorRegistry()
    assert kv_metrics(r1) is kv_metrics(r1)
    assert kv_metrics(r1) is not kv_metrics(r2)
    kv_metrics(r1).bind("decode", "d0").transfer_done(1000, 0.01, 2)
    assert r1.get_sample_value("pdserve:kv_transfer_bytes_total",
                               {"role": "decode", "worker": "d0"}) == 1000
    assert r2.get_sample_value("pdserve:kv_transfer_bytes_total",
                               {"role": "decode", "worker": "d0"}) is None


def test_exported_names():
    r = CollectorRegistry()
    m = kv_metrics(r).bind("decode", "d0")
    m.transfer_done(4096, 0.002, 3)
    m.transfer_failed()
    text = generate_latest(r).decode()
    for name in ("pdserve:kv_transfer_bytes_total", "pdserve:kv_transfer_seconds_bucket",
                 "pdserve:kv_transfer_failures_total", "pdserve:nixl_xfer_time_seconds_count",
                 "pdserve:nixl_bytes_transferred_sum", "pdserve:nixl_num_descriptors_sum",
                 "pdserve:nixl_num_failed_transfers_total", "pdserve:kv_blocks_pinned"):
        assert name in text, name
    assert 'role="decode",worker="d0"' in text
