"""The in-process KV transport keeps the KVTransport contract of the NIXL one: compatibility
refused by name, stale and unknown peers, id checks, deadlines and injected faults; reads are
bitwise copies. (Disaggregated serving through it: tests/workers/test_disagg_inproc.py.)"""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from pdserve.engine.core.config import CacheConfig, ModelConfig, compat_payload
from pdserve.kv_transfer import (
    TRANSPORTS,
    FaultConfig,
    FaultInjector,
    IncompatiblePeerError,
    KVTransferError,
    KVTransferTimeout,
    KVTransport,
    StalePeerError,
    UnknownPeerError,
    make_transport,
)
from pdserve.kv_transfer.inproc_transport import InProcessKVTransport

MODEL = ModelConfig(arch="llama", vocab_size=128, hidden_size=32, num_layers=3, num_heads=4,
                    num_kv_heads=2, head_dim=8, intermediate_size=64)
CACHE = CacheConfig(block_size=4, num_blocks=16, kv_dtype="float32")
SHAPE = (16, 2, 3, 2, 4, 8)  # [blocks, kv_heads, layers, K/V, block_size, head_dim]


def pair(faults: FaultInjector | None = None) -> tuple[torch.Tensor, KVTransport,
                                                       torch.Tensor, KVTransport]:
    kv_p, kv_d = torch.randn(SHAPE), torch.zeros(SHAPE)
    p = make_transport("inproc", kv_p, "p0", compat_payload(MODEL, CACHE), role="prefill")
    d = make_transport("inproc", kv_d, "d0", compat_payload(MODEL, CACHE), faults=faults)
    d.add_peer(p.peer_info())
    return kv_p, p, kv_d, d


def soon(s: float = 10.0) -> float:
    return time.monotonic() + s


def test_registry_names_both_backends_and_refuses_unknown() -> None:
    assert set(TRANSPORTS) == {"nixl", "inproc"}
    with pytest.raises(ValueError, match="kv_transport"):
        make_transport("rdma", torch.zeros(SHAPE), "x", compat_payload(MODEL, CACHE))


def test_read_copies_blocks_bitwise() -> None:
    kv_p, p, kv_d, d = pair()
    assert isinstance(d, InProcessKVTransport)
    stats = d.read_blocks("p0", p.incarnation, [3, 4, 9], [0, 1, 7], soon())
    assert (stats.blocks, stats.descriptors) == (3, 2)  # runs (3,4)->(0,1) and 9->7
    for r, loc in ((3, 0), (4, 1), (9, 7)):
        assert torch.equal(kv_d[loc], kv_p[r])
    assert kv_d[2].abs().sum() == 0  # nothing else written


def test_incompatible_peer_is_refused_naming_the_field() -> None:
    other = make_transport("inproc", torch.zeros(SHAPE), "p1",
                           compat_payload(dataclasses.replace(MODEL, vocab_size=256), CACHE))
    d = make_transport("inproc", torch.zeros(SHAPE), "d1", compat_payload(MODEL, CACHE))
    with pytest.raises(IncompatiblePeerError, match="vocab_size"):
        d.add_peer(other.peer_info())


def test_unknown_stale_and_closed_peers() -> None:
    kv_p, p, kv_d, d = pair()
    with pytest.raises(UnknownPeerError):
        d.read_blocks("nobody", "x", [0], [0], soon())
    with pytest.raises(StalePeerError):
        d.read_blocks("p0", "not-" + p.incarnation, [0], [0], soon())
    p.close()  # the peer process "died": its incarnation is gone
    with pytest.raises(KVTransferError, match="gone"):
        d.read_blocks("p0", p.incarnation, [0], [0], soon())


def test_bad_ids_deadline_and_injected_fault() -> None:
    kv_p, p, kv_d, d = pair(FaultInjector(FaultConfig(fail_nth=1)))
    with pytest.raises(ValueError, match="remote_block_ids"):
        d.read_blocks("p0", p.incarnation, [99], [0], soon())
    with pytest.raises(ValueError, match="appears twice"):
        d.read_blocks("p0", p.incarnation, [1, 2], [0, 0], soon())
    with pytest.raises(KVTransferError, match="fault injected"):
        d.read_blocks("p0", p.incarnation, [1], [1], soon())
    with pytest.raises(KVTransferTimeout):
        d.read_blocks("p0", p.incarnation, [1], [1], time.monotonic() - 1)
    assert kv_d[1].abs().sum() == 0
    d.read_blocks("p0", p.incarnation, [1], [1], soon())
    assert torch.equal(kv_d[1], kv_p[1])
