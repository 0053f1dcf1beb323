"""A TP worker's KV channel (worker/tp_kv.py) and its transport facade (worker/tp_transport.py)
on two real rank processes joined by gloo: rank 0's GroupTransport runs every call on its own
transport and, through the KV channel, on rank 1's (the in-process backend over each rank's
heads-outer cache; the peer is a TP-2 prefill worker whose ranks live in the same two
processes). A pull lands each rank's heads; a failure on rank 1 alone fails the call with
rank 1's error kind; a refused peer is refused naming the field; once rank 1 is gone, the
next call fails as a timeout at once (nothing started: the blocks stay safe) and marks the
group broken."""
from __future__ import annotations

import dataclasses
import datetime
import time

import torch

from pdserve.engine.core.config import CacheConfig, compat_payload
from pdserve.engine.core.tp import TPKVInfo
from pdserve.engine.dist.group import TPGroup
from pdserve.engine.exec.kv_cache import allocate_kv_cache
from pdserve.kv_transfer.errors import KVTransferError, KVTransferTimeout, UnknownPeerError
from pdserve.kv_transfer.faults import FaultConfig, FaultInjector
from pdserve.kv_transfer.handshake import (
    IncompatiblePeerError,
    PeerInfo,
    RankEndpoint,
    group_peer_info,
)
from pdserve.kv_transfer.inproc_transport import InProcessKVTransport
from pdserve.worker.tp_kv import KVChannel, KVLeader, KVRankServer
from pdserve.worker.tp_transport import GroupTransport

from tests.dist import tp_ranks
from tests.dist.tp_harness import run_ranks

NUM_BLOCKS, BLOCK = 16, 4
WAIT = datetime.timedelta(seconds=20)


def _transports(group: TPGroup) -> tuple[InProcessKVTransport, InProcessKVTransport]:
    """This rank's prefill-side transport (random KV) and decode-side one (zeros; its 2nd
    read fails on rank 1 only)."""
    full = tp_ranks.tiny("qwen3", 4, 2)
    compat = compat_payload(full, CacheConfig(block_size=BLOCK, num_blocks=NUM_BLOCKS), {})
    local = dataclasses.replace(full, num_kv_heads=1)
    tp, r = TPKVInfo.of(4, 2, 2, heads_outer=True), group.rank
    pkv = allocate_kv_cache(local, NUM_BLOCKS, BLOCK, torch.float32, "cpu")
    pkv.copy_(torch.randn(pkv.shape, generator=torch.Generator().manual_seed(r)))
    dkv = torch.zeros_like(pkv)
    faults = FaultInjector(FaultConfig(fail_nth=2)) if r == 1 else None
    p = InProcessKVTransport(pkv, "p", compat, role="prefill", tp=tp, rank=r)
    d = InProcessKVTransport(dkv, "d", compat, faults, tp=tp, rank=r)
    group.store.set(f"ep/p/{r}", p.rank_endpoint().to_bytes())
    group.store.set(f"ep/d/{r}", d.rank_endpoint().to_bytes())
    return p, d


def _rank(group: TPGroup) -> dict:
    p, d = _transports(group)
    channel = KVChannel(group)
    if group.rank == 1:
        fatal: list[str] = []
        server = KVRankServer(channel, d, lambda e: fatal.append(repr(e))).start()
        server._thread.join(timeout=120)  # until rank 0's STOP
        channel.close()
        group.store.set("rank1/left", b"1")
        return {"handled": server.handled, "fatal": fatal,
                "landed": torch.equal(d._kv[5:8], p._kv[1:4])}
    group.store.wait(["ep/p/1", "ep/d/1"], WAIT)
    ep = {k: RankEndpoint.from_bytes(bytes(group.store.get(f"ep/{k}/1"))) for k in "pd"}
    broken: list[str] = []
    gt = GroupTransport(d, KVLeader(channel), [d.rank_endpoint(), ep["d"]], broken.append)
    peer = group_peer_info(p.peer_info(), [p.rank_endpoint(), ep["p"]])
    return _drive(group, gt, peer, p, d, broken)


def _outcome(fn) -> str:
    try:
        fn()
        return "ok"
    except Exception as e:  # noqa: BLE001 - the test compares kinds and messages
        return f"{type(e).__name__}: {e}"


def _drive(group: TPGroup, gt: GroupTransport, peer: PeerInfo, p, d, broken: list) -> dict:
    out: dict = {"ranks": len(gt.peer_info().ranks), "tp": gt.peer_info().tp_info.tp_size}
    gt.add_peer(peer)
    gt.warm_up("p", peer.incarnation, time.monotonic() + 10)
    stats = gt.read_blocks("p", peer.incarnation, [1, 2, 3], [5, 6, 7], time.monotonic() + 10)
    out["bytes"], out["block_bytes"] = stats.bytes, d.layout.block_bytes
    out["landed"] = torch.equal(d._kv[5:8], p._kv[1:4])
    deadline = time.monotonic() + 10
    try:  # rank 1's injected fault: the call fails with its kind, naming the rank
        gt.read_blocks("p", peer.incarnation, [4], [9], deadline)
        out["second"] = "ok"
    except KVTransferError as e:
        out["second"] = f"{type(e).__name__}: {e}"
    out["unknown"] = _outcome(lambda: gt.read_blocks("q", "x", [1], [1], deadline))
    out["unknown_is"] = isinstance(_catch(lambda: gt.read_blocks("q", "x", [1], [1], deadline)),
                                   UnknownPeerError)
    other = dataclasses.replace(peer, worker_id="p2", tp=TPKVInfo(1, 4, ((0, 4),), True),
                                ranks=peer.ranks[:1])
    refused = _catch(lambda: gt.add_peer(other))
    out["refused"] = (isinstance(refused, IncompatiblePeerError), str(refused))
    out["removed"] = gt.remove_peer("p")
    out["after_remove"] = _outcome(
        lambda: gt.read_blocks("p", peer.incarnation, [1], [1], deadline))
    gt.kv.leader.stop()  # rank 1's KV thread ends and rank 1 leaves the channel
    group.store.wait(["rank1/left"], WAIT)
    gone = _catch(lambda: gt.read_blocks("p", peer.incarnation, [1], [1],
                                         time.monotonic() + 10))
    # the message could not be sent: no rank started a read, so the blocks are safe
    out["gone"] = (isinstance(gone, KVTransferTimeout) and gone.local_blocks_safe, str(gone))
    out["broken"] = bool(gt.broken) and broken == [gt.broken]
    return out


def _catch(fn) -> BaseException | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    return None


def test_group_transport_runs_every_call_on_every_rank_and_fails_as_one() -> None:
    res = run_ranks(_rank, 2, timeout_s=10.0, deadline_s=180.0)
    assert not any(isinstance(v, tuple) for v in res.values()), res
    r0, r1 = res[0], res[1]
    assert (r0["ranks"], r0["tp"]) == (2, 2)  # the group's PeerInfo: both ranks, TP 2
    assert r0["bytes"] == 2 * 3 * r0["block_bytes"] and r0["landed"] and r1["landed"]
    assert r0["second"].startswith("KVTransferError: rank 1: ") and "fault" in r0["second"]
    assert r0["unknown_is"] and "UnknownPeerError" in r0["unknown"]
    assert r0["refused"][0] and "tp.num_kv_heads" in r0["refused"][1], r0["refused"]
    assert r0["removed"] is True and "UnknownPeerError" in r0["after_remove"]
    assert r0["gone"][0] and "broken" in r0["gone"][1], r0["gone"]
    assert r0["broken"]
    # every message reached rank 1 (add, warm-up, 2 reads, 2 unknown reads, the refused add,
    # its undo-free refusal, remove, the read after it) and nothing failed its KV thread
    assert r1["handled"] >= 9 and r1["fatal"] == []
