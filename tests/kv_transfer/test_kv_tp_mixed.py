"""KV pulls between workers of different TP sizes over real NIXL (UCX, host memory): the
prefill group's ranks live in a spawned process (kv_group_proc.py), each decode rank has its
own transport here. Each decode rank's received bytes must be bitwise the matching head slices
of the prefill ranks' blocks (pull_plan), FP8 scales included (they live in each head's
region); whole-block pulls still coalesce into runs; a pair that cannot map is refused at
add_peer naming the `tp.` field."""
from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch
from kv_group_proc import GroupProc
from prometheus_client import CollectorRegistry

from pdserve.engine.core.config import CacheConfig, ModelConfig, compat_payload
from pdserve.engine.core.tp import TPKVInfo, pull_plan
from pdserve.engine.exec.kv_cache import allocate_kv_cache, block_scales, kv_torch_dtype
from pdserve.kv_transfer import (
    IncompatiblePeerError,
    NixlKVTransport,
    PeerInfo,
    UnknownPeerError,
    coalesce_pairs,
)
from pdserve.kv_transfer.metrics import kv_metrics

pytestmark = pytest.mark.timeout(300)

BASE = ModelConfig(arch="llama", vocab_size=128, hidden_size=32, num_layers=3, num_heads=4,
                   num_kv_heads=2, head_dim=8, intermediate_size=64)
REMOTE = [3, 4, 5, 10, 20, 21]
LOCAL = [7, 8, 9, 0, 30, 31]  # runs (3,4,5)->(7,8,9), 10->0, (20,21)->(30,31): 3 runs


def cache_cfg(fp8: bool) -> CacheConfig:
    return CacheConfig(block_size=4, num_blocks=32, kv_dtype="float32",
                       kv_cache_dtype="fp8" if fp8 else "auto")


def rank_shape(model: ModelConfig, cache: CacheConfig, heads: int) -> tuple:
    local = dataclasses.replace(model, num_kv_heads=heads)
    return tuple(allocate_kv_cache(local, cache.num_blocks, cache.block_size,
                                   kv_torch_dtype(cache), "meta").shape)


def decode_group(model: ModelConfig, cache: CacheConfig, tp_size: int,
                 compat: dict) -> tuple[list[torch.Tensor], list[NixlKVTransport]]:
    tp = TPKVInfo.of(model.num_heads, model.num_kv_heads, tp_size)
    kvs, ranks = [], []
    for r in range(tp_size):
        kvs.append(allocate_kv_cache(dataclasses.replace(model, num_kv_heads=tp.head_map[r][1]),
                                     cache.num_blocks, cache.block_size, kv_torch_dtype(cache),
                                     "cpu"))
        metrics = kv_metrics(CollectorRegistry()).bind("decode", f"d0/{r}")
        ranks.append(NixlKVTransport(kvs[r], "d0", compat, metrics=metrics, tp=tp, rank=r))
    return kvs, ranks


def prefill_group(model: ModelConfig, cache: CacheConfig, tp_size: int,
                  compat: dict) -> GroupProc:
    tp = TPKVInfo.of(model.num_heads, model.num_kv_heads, tp_size)
    dtype = str(kv_torch_dtype(cache)).removeprefix("torch.")
    return GroupProc("p0", compat, tp.to_dict(), rank_shape(model, cache, tp.head_map[0][1]),
                     dtype)


def head(raw: bytes, h: int, heads: int) -> bytes:
    """Head h's bytes of one block's bytes (heads outermost)."""
    n = len(raw) // heads
    return raw[h * n:(h + 1) * n]


def expected_descriptors(pulls_by_src: dict, local_heads: int, src_heads: dict) -> int:
    n = 0
    for src, pulls in pulls_by_src.items():
        whole = len(pulls) == 1 and pulls[0].count == local_heads == src_heads[src]
        n += len(coalesce_pairs(LOCAL, REMOTE)) if whole else len(pulls) * len(LOCAL)
    return n


CASES = [  # (KV heads, prefill TP, decode TP, fp8)
    pytest.param(2, 2, 1, False, id="p2_d1"),
    pytest.param(2, 1, 2, False, id="p1_d2"),
    pytest.param(4, 4, 2, False, id="p4_d2"),
    pytest.param(1, 2, 1, False, id="replicated_1kv_p2_d1"),
    pytest.param(1, 1, 2, False, id="replicated_1kv_p1_d2"),
    pytest.param(2, 2, 1, True, id="fp8_p2_d1"),
    pytest.param(2, 1, 2, True, id="fp8_p1_d2"),
]


@pytest.mark.parametrize("kv_heads, p_tp, d_tp, fp8", CASES)
def test_decode_ranks_receive_their_head_slices_bitwise(kv_heads, p_tp, d_tp, fp8) -> None:
    model, cache = dataclasses.replace(BASE, num_kv_heads=kv_heads), cache_cfg(fp8)
    compat = compat_payload(model, cache)
    proc = prefill_group(model, cache, p_tp, compat)
    kvs, ranks = decode_group(model, cache, d_tp, compat)
    try:
        info = PeerInfo.from_bytes(proc.info_bytes)
        sent = proc.call("fill", REMOTE, 7)  # [prefill rank][i] = bytes of block REMOTE[i]
        stats = []
        for t in ranks:  # the same call on every rank (rank 0's scheduler's block ids)
            t.add_peer(info)
            t.warm_up("p0", info.incarnation, time.monotonic() + 30)
            stats.append(t.read_blocks("p0", info.incarnation, REMOTE, LOCAL,
                                       time.monotonic() + 30))
    finally:
        for t in ranks:
            t.close()
        proc.stop()
    p_heads = {r: n for r, (_, n) in enumerate(info.tp.head_map)}
    for r, (kv, plan) in enumerate(zip(kvs, pull_plan(kv_heads, p_tp, d_tp))):
        raw, local_heads = kv.view(torch.uint8), kv.shape[1]
        covered = sorted(p.dst_head + i for p in plan for i in range(p.count))
        assert covered == list(range(local_heads))  # every local head came from somewhere
        for i, (remote, local) in enumerate(zip(REMOTE, LOCAL)):
            got = raw[local].numpy().tobytes()
            for p in plan:
                for j in range(p.count):
                    want = head(sent[p.src_rank][i], p.src_head + j, p_heads[p.src_rank])
                    assert head(got, p.dst_head + j, local_heads) == want, (r, remote, p)
        untouched = [b for b in range(cache.num_blocks) if b not in LOCAL]
        assert not raw[untouched].any()  # nothing written outside the destination blocks
        by_src: dict = {}
        for p in plan:
            by_src.setdefault(p.src_rank, []).append(p)
        assert stats[r].bytes == len(LOCAL) * raw[0].numel()
        assert stats[r].descriptors == expected_descriptors(by_src, local_heads, p_heads)
        if fp8:  # the scales of each received head are the prefill rank's for that head
            _check_scales(kv, plan, sent, p_heads)


def _check_scales(kv: torch.Tensor, plan: list, sent: list, p_heads: dict) -> None:
    got = block_scales(kv)  # [NB, L, 2, Hkv_local]
    for p in plan:
        n = p_heads[p.src_rank]
        for i, local in enumerate(LOCAL):
            block = torch.frombuffer(bytearray(sent[p.src_rank][i]), dtype=torch.uint8)
            src = block_scales(block.view(kv.dtype).view(1, n, *kv.shape[2:]))[0]
            for j in range(p.count):
                a = got[local, :, :, p.dst_head + j].contiguous().view(torch.int32)
                b = src[:, :, p.src_head + j].contiguous().view(torch.int32)
                assert torch.equal(a, b)


def test_whole_block_pulls_coalesce_into_runs() -> None:
    """Equal TP: rank r <- rank r with all heads: one descriptor per run, not per block."""
    model, cache = BASE, cache_cfg(False)
    compat = compat_payload(model, cache)
    proc = prefill_group(model, cache, 2, compat)
    kvs, ranks = decode_group(model, cache, 2, compat)
    try:
        info = PeerInfo.from_bytes(proc.info_bytes)
        sent = proc.call("fill", REMOTE, 3)
        for r, t in enumerate(ranks):
            t.add_peer(info)
            stats = t.read_blocks("p0", info.incarnation, REMOTE, LOCAL, time.monotonic() + 30)
            assert stats.descriptors == len(coalesce_pairs(LOCAL, REMOTE)) == 3
            assert [kvs[r].view(torch.uint8)[b].numpy().tobytes() for b in LOCAL] == sent[r]
    finally:
        for t in ranks:
            t.close()
        proc.stop()


def test_pairs_that_cannot_map_are_refused_at_add_peer_naming_tp_field() -> None:
    model, cache = BASE, cache_cfg(False)
    compat = compat_payload(model, cache)
    proc = prefill_group(model, cache, 2, compat)
    _, ranks = decode_group(model, cache, 1, compat)
    try:
        d = json.loads(proc.info_bytes)
        d["tp"]["head_map"] = [[1, 1], [0, 1]]  # claims its ranks hold each other's heads
        with pytest.raises(IncompatiblePeerError, match=r"tp\.head_map"):
            ranks[0].add_peer(PeerInfo.from_bytes(json.dumps(d).encode()))
        with pytest.raises(UnknownPeerError):
            ranks[0].read_blocks("p0", d["incarnation"], [0], [0], time.monotonic() + 10)
    finally:
        for t in ranks:
            t.close()
        proc.stop()


def test_heads_inner_layouts_cannot_pull_head_slices() -> None:
    """Layout version 1 keeps heads inner: P TP2 -> D TP1 would need slices of a block that
    are not one byte range, so the pair is refused naming tp.heads_outer."""
    model, cache = BASE, cache_cfg(False)
    compat = dict(compat_payload(model, cache), layout_version=1)
    p_tp = TPKVInfo.of(4, 2, 2, heads_outer=False)
    shape = (cache.num_blocks, model.num_layers, 2, cache.block_size, 1, model.head_dim)
    proc = GroupProc("p0", compat, p_tp.to_dict(), shape)
    kv = torch.zeros(cache.num_blocks, model.num_layers, 2, cache.block_size, 2, model.head_dim)
    t = NixlKVTransport(kv, "d0", compat, metrics=kv_metrics(CollectorRegistry()).bind("d", "d"))
    try:
        with pytest.raises(IncompatiblePeerError, match=r"tp\.heads_outer"):
            t.add_peer(PeerInfo.from_bytes(proc.info_bytes))
    finally:
        t.close()
        proc.stop()
