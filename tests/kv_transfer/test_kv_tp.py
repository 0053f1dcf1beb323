"""KV transfer between tensor-parallel workers: one transport per rank, the group PeerInfo
(version 2: the TP map and every rank's endpoint), add_peer's TP pair check, and reads of each
rank's pull_plan row. Same-TP whole-block pulls here (P TP2 rank r <- D TP2 rank r), on the
in-process transport and on real NIXL (UCX, host memory, agents of one process); pulls between
different TP sizes: tests/kv_transfer/test_kv_tp_mixed.py."""
from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

from pdserve.engine.core.config import (
    KV_LAYOUT_VERSION,
    CacheConfig,
    ModelConfig,
    compat_payload,
)
from pdserve.engine.core.tp import TPKVInfo
from pdserve.engine.exec.kv_cache import allocate_kv_cache
from pdserve.kv_transfer import (
    HandshakeError,
    IncompatiblePeerError,
    NixlKVTransport,
    PeerInfo,
    RankEndpoint,
    StalePeerError,
    coalesce_pairs,
    group_peer_info,
    make_transport,
)
from pdserve.kv_transfer.handshake import cache_layout

pytestmark = pytest.mark.timeout(300)

MODEL = ModelConfig(arch="llama", vocab_size=128, hidden_size=32, num_layers=3, num_heads=4,
                    num_kv_heads=2, head_dim=8, intermediate_size=64)
CACHE = CacheConfig(block_size=4, num_blocks=16, kv_dtype="float32")
COMPAT = compat_payload(MODEL, CACHE)
REMOTE = [3, 4, 5, 9, 12]
LOCAL = [0, 1, 2, 7, 8]  # runs (3,4,5)->(0,1,2), 9->7, 12->8: 3 runs


def rank_cache(heads: int, seed: int | None, compat: dict = COMPAT) -> torch.Tensor:
    """One rank's KV tensor with `heads` KV heads, laid out as compat's layout_version says
    (the engine's allocation for the current version); random if seeded."""
    if compat["layout_version"] == KV_LAYOUT_VERSION:
        kv = allocate_kv_cache(dataclasses.replace(MODEL, num_kv_heads=heads), CACHE.num_blocks,
                               CACHE.block_size, torch.float32, "cpu")
    else:  # version 1: heads inner
        kv = torch.zeros(CACHE.num_blocks, MODEL.num_layers, 2, CACHE.block_size, heads,
                         MODEL.head_dim)
    if seed is not None:
        kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(seed)))
    return kv


def group(backend: str, worker_id: str, tp_size: int, seed: int | None, role: str,
          compat: dict = COMPAT, heads_outer: bool | None = None) -> list:
    """A TP worker's per-rank transports (rank order)."""
    tp = TPKVInfo.of(MODEL.num_heads, MODEL.num_kv_heads, tp_size,
                     heads_outer=compat["layout_version"] >= 2 if heads_outer is None
                     else heads_outer)
    return [make_transport(backend, rank_cache(tp.head_map[r][1],
                                               None if seed is None else seed + r, compat),
                           worker_id, compat, role=role, tp=tp, rank=r)
            for r in range(tp_size)]


def published(ranks: list) -> PeerInfo:
    """What rank 0 publishes, through its wire format."""
    info = group_peer_info(ranks[0].peer_info(), [t.rank_endpoint() for t in ranks])
    return PeerInfo.from_bytes(info.to_bytes())


def soon(s: float = 30.0) -> float:
    return time.monotonic() + s


def close(*groups: list) -> None:
    for g in groups:
        for t in g:
            t.close()


def test_group_peer_info_round_trips_with_every_rank() -> None:
    p = group("inproc", "p0", 2, 1, "prefill")
    try:
        info = published(p)
        assert info.version == 2 and info.tp.tp_size == 2
        assert info.tp.head_map == ((0, 1), (1, 1))
        assert [r.agent_name for r in info.ranks] == [t.rank_endpoint().agent_name for t in p]
        assert info.ranks[0] == info.endpoint and info.incarnation == p[0].incarnation
        ep = p[1].rank_endpoint()
        assert RankEndpoint.from_bytes(ep.to_bytes()) == ep
        single = PeerInfo.from_bytes(group("inproc", "p1", 1, 1, "prefill")[0].peer_info()
                                     .to_bytes())
        assert single.tp.tp_size == 1 and len(single.ranks) == 1
    finally:
        close(p)


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.update(ranks=d["ranks"][:1]), "peer_info.ranks"),
    (lambda d: d["ranks"][1].update(kv_mem_type="HBM"), "peer_info.ranks[1].kv_mem_type"),
    (lambda d: d["ranks"][1].update(agent_metadata="%%"), "peer_info.ranks[1].agent_metadata"),
    (lambda d: d["ranks"][1].pop("kv_base_addr"), "peer_info.ranks[1].kv_base_addr"),
    (lambda d: d["ranks"][0].update(kv_base_addr=d["kv_base_addr"] + 8), "peer_info.ranks[0]"),
    (lambda d: d["tp"].pop("head_map"), "tp.head_map"),
    (lambda d: d["tp"].update(tp_size="2"), "tp.tp_size"),
    (lambda d: d["tp"].update(version=9), "tp.version"),
    (lambda d: d.pop("tp"), "peer_info.tp"),
    (lambda d: d.update(version=1), "peer_info.version"),
])
def test_bad_group_peer_info_is_refused_naming_the_field(edit, field) -> None:
    p = group("inproc", "p0", 2, 1, "prefill")
    try:
        d = json.loads(group_peer_info(p[0].peer_info(),
                                       [t.rank_endpoint() for t in p]).to_bytes())
        edit(d)
        with pytest.raises(HandshakeError, match=field.replace("[", r"\[").replace("]", r"\]")):
            PeerInfo.from_bytes(json.dumps(d).encode())
    finally:
        close(p)


def test_group_peer_info_checks_its_endpoints() -> None:
    p = group("inproc", "p0", 2, 1, "prefill")
    try:
        with pytest.raises(ValueError, match="endpoints"):
            group_peer_info(p[0].peer_info(), [p[0].rank_endpoint()])
        with pytest.raises(ValueError, match=r"endpoints\[0\]"):
            group_peer_info(p[0].peer_info(), [p[1].rank_endpoint(), p[0].rank_endpoint()])
    finally:
        close(p)


def test_transport_refuses_a_tp_map_its_tensor_does_not_hold() -> None:
    tp = TPKVInfo.of(4, 2, 2, heads_outer=COMPAT["layout_version"] >= 2)
    with pytest.raises(ValueError, match="rank"):
        make_transport("inproc", rank_cache(1, None), "x", COMPAT, tp=tp, rank=2)
    with pytest.raises(ValueError, match="num_kv_heads"):  # rank tensor with both heads
        make_transport("inproc", rank_cache(2, None), "x", COMPAT, tp=tp, rank=0)
    with pytest.raises(ValueError, match="tp.heads_outer"):
        make_transport("inproc", rank_cache(1, None), "x", COMPAT, rank=0,
                       tp=dataclasses.replace(tp, heads_outer=not tp.heads_outer))
    with pytest.raises(ValueError, match="tp.head_map"):
        make_transport("inproc", rank_cache(1, None), "x", COMPAT, rank=0,
                       tp=dataclasses.replace(tp, head_map=((1, 1), (0, 1))))


def check_whole_block_pull(backend: str) -> None:
    p = group(backend, "p0", 2, 1, "prefill")
    d = group(backend, "d0", 2, None, "decode")
    try:
        info = published(p)
        for rank in d:
            rank.add_peer(info)
            rank.add_peer(info)  # announced again: kept
            assert rank.warm_up("p0", info.incarnation, soon()) >= 0
        stats = [rank.read_blocks("p0", info.incarnation, REMOTE, LOCAL, soon()) for rank in d]
        for r in range(2):  # D rank r holds exactly P rank r's blocks
            assert torch.equal(d[r]._kv[LOCAL], p[r]._kv[REMOTE])
            untouched = [b for b in range(CACHE.num_blocks) if b not in LOCAL]
            assert not d[r]._kv[untouched].any()
            assert stats[r].blocks == len(LOCAL)
            assert stats[r].bytes == len(LOCAL) * cache_layout(p[r]._kv, COMPAT).block_bytes
            assert stats[r].descriptors == len(coalesce_pairs(LOCAL, REMOTE)) == 3
        with pytest.raises(StalePeerError):
            d[1].read_blocks("p0", "not-it", REMOTE, LOCAL, soon())
        assert d[1].remove_peer("p0") and not d[1].remove_peer("p0")
    finally:
        close(d, p)


@pytest.mark.parametrize("backend", ["inproc", "nixl"])
def test_same_tp_ranks_pull_whole_blocks_from_their_peer_rank(backend: str) -> None:
    check_whole_block_pull(backend)


def test_pair_that_cannot_map_is_refused_at_add_peer_naming_tp_field() -> None:
    heads_inner = dict(COMPAT, layout_version=1)
    p = group("inproc", "p0", 2, 1, "prefill", compat=heads_inner)
    d = group("inproc", "d0", 1, None, "decode", compat=heads_inner)
    try:
        with pytest.raises(IncompatiblePeerError, match=r"tp\.heads_outer"):
            d[0].add_peer(published(p))
    finally:
        close(d, p)
    other = dict(COMPAT, model=dict(COMPAT["model"], num_kv_heads=4))
    d = [make_transport("inproc", rank_cache(2, None), "d1", other, role="decode",
                        tp=TPKVInfo.of(4, 4, 2, heads_outer=COMPAT["layout_version"] >= 2),
                        rank=0)]
    p = group("inproc", "p1", 2, 1, "prefill")
    try:
        with pytest.raises(IncompatiblePeerError, match=r"tp\.num_kv_heads"):
            d[0].add_peer(published(p))
    finally:
        close(d, p)


@pytest.mark.skipif(KV_LAYOUT_VERSION < 2, reason="head slices need the heads-outer layout")
@pytest.mark.parametrize("backend, mode", [("inproc", None), ("nixl", "coalesced"),
                                           ("nixl", "prepped")])
def test_one_decode_rank_pulls_each_head_from_its_prefill_rank(backend, mode) -> None:
    """P TP2 -> D TP1: D0's head h of each block is P rank h's only head, bitwise; whole-block
    prepared lists do not apply to slices (they go by byte range in either mode)."""
    p = group(backend, "p0", 2, 1, "prefill")
    tp1 = TPKVInfo.of(MODEL.num_heads, MODEL.num_kv_heads, 1)
    kw = {} if mode is None else {"descriptor_mode": mode}
    d = make_transport("inproc", rank_cache(2, None), "d0", COMPAT, tp=tp1) \
        if backend == "inproc" else NixlKVTransport(rank_cache(2, None), "d0", COMPAT, tp=tp1,
                                                    **kw)
    try:
        info = published(p)
        d.add_peer(info)
        d.warm_up("p0", info.incarnation, soon())
        stats = d.read_blocks("p0", info.incarnation, REMOTE, LOCAL, soon())
        for h in range(2):
            assert torch.equal(d._kv[LOCAL, h], p[h]._kv[REMOTE, 0])
        assert stats.descriptors == 2 * len(LOCAL)  # one slice per block per source rank
        assert stats.bytes == d._kv[LOCAL].numel() * 4
    finally:
        close([d], p)


def test_peer_whose_tp_map_contradicts_its_layout_is_refused() -> None:
    p = group("inproc", "p0", 2, 1, "prefill")
    d = group("inproc", "d0", 2, None, "decode")
    try:
        info = published(p)
        lie = dataclasses.replace(info, tp=dataclasses.replace(
            info.tp, heads_outer=not info.tp.heads_outer))
        with pytest.raises(IncompatiblePeerError, match=r"tp\.heads_outer"):
            d[0].add_peer(lie)
    finally:
        close(d, p)
