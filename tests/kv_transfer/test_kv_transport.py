"""NixlKVTransport between two real processes over NIXL/UCX on host memory."""
from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
from kv_peer_proc import SHAPE, PeerProc
from prometheus_client import CollectorRegistry

from pdserve.engine.core.config import CacheConfig, ModelConfig, compat_payload
from pdserve.kv_transfer import (
    FaultConfig,
    FaultInjector,
    IncompatiblePeerError,
    InjectedFault,
    KVTransferError,
    KVTransferTimeout,
    NixlKVTransport,
    PeerInfo,
    StalePeerError,
    UnknownPeerError,
    coalesce_pairs,
)
from pdserve.kv_transfer.metrics import kv_metrics

pytestmark = pytest.mark.timeout(300)

MODEL = ModelConfig(arch="llama", vocab_size=128, hidden_size=32, num_layers=3, num_heads=4,
                    num_kv_heads=2, head_dim=8, intermediate_size=64)
CACHE = CacheConfig(block_size=4, num_blocks=64, kv_dtype="float32")
COMPAT = compat_payload(MODEL, CACHE)
LABELS = {"role": "decode", "worker": "d0"}

# Non-contiguous on both sides, with runs that only one side would coalesce:
# (7,3)(8,4)(9,5) | (30,10) | (50,11) | (51,20)(52,21) | (0,40)  -> 5 runs
REMOTE = [3, 4, 5, 10, 11, 20, 21, 40]
LOCAL = [7, 8, 9, 30, 50, 51, 52, 0]


@pytest.fixture(scope="module")
def peer():
    proc = PeerProc("p0", COMPAT)
    yield proc
    proc.stop()


def make_local(peer_info_bytes: bytes | None, shape=SHAPE, compat=COMPAT, **kw):
    kv = torch.zeros(shape, dtype=torch.float32)
    registry = CollectorRegistry()
    t = NixlKVTransport(kv, "d0", compat, metrics=kv_metrics(registry).bind("decode", "d0"),
                        **kw)
    if peer_info_bytes is not None:
        t.add_peer(PeerInfo.from_bytes(peer_info_bytes))
    return kv, t, registry


def deadline(s: float = 30.0) -> float:
    return time.monotonic() + s


def block_bytes(kv: torch.Tensor, ids: list[int]) -> list[bytes]:
    return [kv[b].numpy().tobytes() for b in ids]


@pytest.mark.parametrize("mode", ["coalesced", "prepped"])
def test_noncontiguous_read_is_bitwise_exact(peer, mode):
    expected = peer.call("fill", REMOTE, 1)
    kv, t, registry = make_local(peer.info_bytes, descriptor_mode=mode)
    try:
        info = PeerInfo.from_bytes(peer.info_bytes)
        stats = t.read_blocks("p0", info.incarnation, REMOTE, LOCAL, deadline())
    finally:
        t.close()
    assert block_bytes(kv, LOCAL) == expected
    untouched = [b for b in range(SHAPE[0]) if b not in LOCAL]
    assert not kv[untouched].any()  # nothing written outside the destination blocks
    runs = coalesce_pairs(LOCAL, REMOTE)
    assert len(runs) == 5 and stats.descriptors == len(runs)  # NIXL's own count (telemetry)
    assert stats.bytes == len(LOCAL) * kv[0].numel() * 4 and stats.blocks == len(LOCAL)
    assert registry.get_sample_value("pdserve:kv_transfer_bytes_total", LABELS) == stats.bytes
    assert registry.get_sample_value("pdserve:nixl_num_descriptors_sum", LABELS) == 5


def test_descriptor_cap_splits_runs(peer):
    remote, local = list(range(20, 30)), list(range(0, 10))
    expected = peer.call("fill", remote, 2)
    kv, t, _ = make_local(peer.info_bytes, max_descriptor_bytes=4 * kv_block_bytes())
    try:
        stats = t.read_blocks("p0", incarnation(peer), remote, local, deadline())
    finally:
        t.close()
    assert block_bytes(kv, local) == expected
    assert stats.descriptors == 3  # 10 blocks in runs of at most 4


def kv_block_bytes() -> int:
    return torch.zeros(SHAPE)[0].numel() * 4


def incarnation(peer: PeerProc) -> str:
    return PeerInfo.from_bytes(peer.info_bytes).incarnation


def test_metrics_count_exact_bytes_across_reads(peer):
    peer.call("fill", list(range(8)), 3)
    kv, t, registry = make_local(peer.info_bytes)
    try:
        inc = incarnation(peer)
        a = t.read_blocks("p0", inc, [0, 1, 2], [10, 11, 12], deadline())
        b = t.read_blocks("p0", inc, [5, 7], [20, 21], deadline())
        t.read_blocks("p0", inc, [], [], deadline())  # empty read moves nothing
    finally:
        t.close()
    assert a.bytes + b.bytes == 5 * kv_block_bytes()
    assert registry.get_sample_value("pdserve:kv_transfer_bytes_total", LABELS) == 5 * \
        kv_block_bytes()
    assert registry.get_sample_value("pdserve:kv_transfer_seconds_count", LABELS) == 3


def test_incompatible_block_size_refused(peer):
    shape = (64, 2, 3, 2, 8, 8)  # block_size 8
    compat = compat_payload(MODEL, dataclasses.replace(CACHE, block_size=8))
    _, t, _ = make_local(None, shape=shape, compat=compat)
    try:
        with pytest.raises(IncompatiblePeerError, match="block_size: 8 != 4"):
            t.add_peer(PeerInfo.from_bytes(peer.info_bytes))
        with pytest.raises(UnknownPeerError, match="p0"):
            t.read_blocks("p0", incarnation(peer), [0], [0], deadline())
    finally:
        t.close()


def test_incompatible_model_refused(peer):
    compat = compat_payload(dataclasses.replace(MODEL, vocab_size=256), CACHE)
    _, t, _ = make_local(None, compat=compat)
    try:
        with pytest.raises(IncompatiblePeerError, match="model.vocab_size: 256 != 128"):
            t.add_peer(PeerInfo.from_bytes(peer.info_bytes))
        assert t.peers() == {}
    finally:
        t.close()


def test_restarted_transport_replaces_old_incarnation(peer):
    kv, t, _ = make_local(peer.info_bytes)
    try:
        old = incarnation(peer)
        t.read_blocks("p0", old, [1], [1], deadline())
        new_bytes = peer.call("restart_transport")
        peer.info_bytes = new_bytes
        new = PeerInfo.from_bytes(new_bytes).incarnation
        assert new != old
        t.add_peer(PeerInfo.from_bytes(new_bytes))
        assert t.peers() == {"p0": new}
        with pytest.raises(StalePeerError, match=old):
            t.read_blocks("p0", old, [1], [1], deadline())
        expected = peer.call("fill", [6, 2], 4)
        t.read_blocks("p0", new, [6, 2], [3, 4], deadline())
        assert block_bytes(kv, [3, 4]) == expected
    finally:
        t.close()


def test_fail_nth_fails_exactly_that_read(peer):
    expected = peer.call("fill", [9], 5)
    faults = FaultInjector(FaultConfig(fail_nth=2))
    kv, t, registry = make_local(peer.info_bytes, faults=faults)
    outcomes = []
    try:
        for i in range(4):
            try:
                t.read_blocks("p0", incarnation(peer), [9], [i], deadline())
                outcomes.append("ok")
            except KVTransferError as e:
                assert isinstance(e.__cause__, InjectedFault)
                outcomes.append("fail")
    finally:
        t.close()
    assert outcomes == ["ok", "fail", "ok", "ok"]
    assert block_bytes(kv, [0, 2, 3]) == expected * 3
    assert registry.get_sample_value("pdserve:kv_transfer_failures_total", LABELS) == 1
    assert registry.get_sample_value("pdserve:kv_transfer_bytes_total", LABELS) == \
        3 * kv_block_bytes()


def test_delay_past_deadline_times_out_at_the_deadline(peer):
    faults = FaultInjector(FaultConfig(delay_s=60.0))
    _, t, registry = make_local(peer.info_bytes, faults=faults)
    try:
        start = time.monotonic()
        with pytest.raises(KVTransferTimeout) as e:
            t.read_blocks("p0", incarnation(peer), [0, 1], [0, 1], start + 0.3)
        elapsed = time.monotonic() - start
        # the read gave up at its deadline, not after the injected 60 s (slack for 2 busy cores)
        assert 0.3 <= elapsed < 5.0
        assert e.value.local_blocks_safe
        with pytest.raises(KVTransferTimeout, match="before the read started"):
            t.read_blocks("p0", incarnation(peer), [0], [0], time.monotonic() - 1)
    finally:
        t.close()
    assert registry.get_sample_value("pdserve:kv_transfer_failures_total", LABELS) == 2


def test_bad_ids_are_named(peer):
    _, t, _ = make_local(peer.info_bytes)
    inc = incarnation(peer)
    try:
        with pytest.raises(ValueError, match=r"remote_block_ids\[1\]: block 64"):
            t.read_blocks("p0", inc, [0, 64], [0, 1], deadline())
        with pytest.raises(ValueError, match=r"local_block_ids\[0\]: block -1"):
            t.read_blocks("p0", inc, [0], [-1], deadline())
        with pytest.raises(ValueError, match="local_block_ids: a local block appears twice"):
            t.read_blocks("p0", inc, [0, 1], [5, 5], deadline())
        with pytest.raises(ValueError, match="local_block_ids: 1 ids for 2"):
            t.read_blocks("p0", inc, [0, 1], [5], deadline())
        with pytest.raises(ValueError, match="worker itself"):
            t.add_peer(t.peer_info())
    finally:
        t.close()


def test_concurrent_reads_from_threads(peer):
    remote = list(range(32, 64))
    expected = peer.call("fill", remote, 6)
    kv, t, registry = make_local(peer.info_bytes)
    errors: list[BaseException] = []
    inc = incarnation(peer)

    def worker(k: int) -> None:  # thread k owns local blocks 8k .. 8k+7
        try:
            for rep in range(10):
                ids = remote[8 * k:8 * k + 8]
                local = [8 * k + j for j in range(8)]
                if rep % 2:  # vary the pairing so runs differ per rep
                    local = local[::-1]
                t.read_blocks("p0", inc, ids, local, deadline())
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        assert not any(th.is_alive() for th in threads)
    finally:
        t.close()
    assert errors == []
    # last rep (odd) reversed the local order within each thread's slice
    got = block_bytes(kv, [8 * k + 7 - j for k in range(4) for j in range(8)])
    assert got == expected
    assert registry.get_sample_value("pdserve:kv_transfer_bytes_total", LABELS) == \
        40 * 8 * kv_block_bytes()


def test_closed_transport_refuses_reads(peer):
    _, t, _ = make_local(peer.info_bytes)
    t.close()
    t.close()  # idempotent
    with pytest.raises(KVTransferError, match="closed"):
        t.read_blocks("p0", incarnation(peer), [0], [0], deadline())


def test_dead_peer_fails_within_deadline_then_restart_is_a_new_peer():
    """A killed peer process: reads fail (never hang); its replacement is a new incarnation."""
    first = PeerProc("p9", COMPAT)
    kv, t, _ = make_local(first.info_bytes)
    second = None
    try:
        old = PeerInfo.from_bytes(first.info_bytes).incarnation
        t.read_blocks("p9", old, [0], [0], deadline())
        first.kill()
        start = time.monotonic()
        with pytest.raises(KVTransferError):
            t.read_blocks("p9", old, [0, 1], [0, 1], start + 10)
        assert time.monotonic() - start < 15
        second = PeerProc("p9", COMPAT)
        new_info = PeerInfo.from_bytes(second.info_bytes)
        t.add_peer(new_info)
        with pytest.raises(StalePeerError):
            t.read_blocks("p9", old, [0], [0], deadline())
        expected = second.call("fill", [12, 13], 8)
        t.read_blocks("p9", new_info.incarnation, [12, 13], [40, 41], deadline())
        assert block_bytes(kv, [40, 41]) == expected
    finally:
        t.close()
        first.kill()
        if second is not None:
            second.stop()


def test_warm_up_reads_without_touching_kv_blocks(peer):
    peer.call("fill", [0], 9)
    kv, t, registry = make_local(peer.info_bytes)
    try:
        assert t.warm_up("p0", incarnation(peer), deadline()) > 0
        with pytest.raises(StalePeerError):
            t.warm_up("p0", "not-the-incarnation", deadline())
    finally:
        t.close()
    assert not kv.any()  # the scratch block took the bytes, no KV block did
    assert registry.get_sample_value("pdserve:kv_transfer_bytes_total", LABELS) == 0
    assert registry.get_sample_value("pdserve:kv_transfer_failures_total", LABELS) == 0


@pytest.mark.parametrize("mode", ["coalesced", "prepped"])
def test_peer_advertising_memory_it_did_not_register_is_refused(peer, mode):
    """NIXL only reads inside the peer's registered region, whatever PeerInfo claims."""
    info = PeerInfo.from_bytes(peer.info_bytes)
    lying = dataclasses.replace(info, kv_base_addr=info.kv_base_addr + 4 * kv_block_bytes())
    _, t, registry = make_local(None, descriptor_mode=mode)
    try:
        if mode == "prepped":
            with pytest.raises(KVTransferError, match="could not prepare"):
                t.add_peer(lying)
            assert t.peers() == {}
        else:
            t.add_peer(lying)
            with pytest.raises(KVTransferError, match="NIXL initialize_xfer failed"):
                t.read_blocks("p0", info.incarnation, [63], [0], deadline())
            assert registry.get_sample_value("pdserve:kv_transfer_failures_total", LABELS) == 1
    finally:
        t.close()
