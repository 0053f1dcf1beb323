"""Paged KV block manager: refcounts, chained prefix hashes, LRU eviction, counters."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.engine.core.block_manager import (
    BlockManager,
    NoFreeBlocksError,
    compute_block_hashes,
    hash_block,
)
from pdserve.engine.core.config import CacheConfig
from pdserve.engine.core.request import Request
from pdserve.engine.core.sampling_params import InvalidRequestError, SamplingParams

REPO = Path(__file__).resolve().parents[2]


def make_req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4))


def admit(bm: BlockManager, req: Request, compute: bool = True) -> list[int]:
    """Allocate the whole prompt (after prefix hits) and, if `compute`, mark its KV computed."""
    hits = bm.get_computed_blocks(req)
    assert bm.allocate(req, req.num_tokens - len(hits) * bm.block_size, hits)
    if compute:
        req.num_computed_tokens = req.num_tokens
        bm.cache_full_blocks(req)
    return hits


def check_invariants(bm: BlockManager, live: list[Request]) -> None:
    """Every block is in exactly one state and refcounts match the live block tables."""
    refs = [0] * bm.num_blocks
    for req in live:
        for b in req.block_table:
            refs[b] += 1
    assert refs == bm.ref_counts
    free, evictable = set(bm._free), set(bm._evictable)
    used = {b for b in range(bm.num_blocks) if refs[b] > 0}
    assert len(free) == len(bm._free)  # no duplicates in the heap
    assert not (free & evictable) and not (free & used) and not (evictable & used)
    assert len(free) + len(evictable) + len(used) == bm.num_blocks
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    for b in used:
        if refs[b] > 1:  # only a cached prefix block may be shared
            assert bm.block_hashes[b] is not None
    for b in evictable:
        assert bm.block_hashes[b] is not None
    for b in free:
        assert bm.block_hashes[b] is None
    assert {h: b for b, h in enumerate(bm.block_hashes) if h is not None} == bm.hash_to_block


def test_import_is_torch_free() -> None:
    code = ("import sys, pdserve.engine.core.block_manager, engine.core.scheduler; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_block_hashes_chain_and_are_process_stable() -> None:
    tokens = list(range(100, 140))
    hashes = compute_block_hashes(tokens, 16)
    assert len(hashes) == 2  # the trailing 8 tokens form no full block
    assert hashes[1] == hash_block(hashes[0], tokens[16:32])
    assert all(0 <= h < 2**64 for h in hashes)
    # same block after a different parent -> different hash
    other = compute_block_hashes([7] * 16 + tokens[16:32], 16)
    assert other[1] != hashes[1]
    # incremental use with parent_hash gives the same chain
    assert compute_block_hashes(tokens[16:32], 16, parent_hash=hashes[0]) == hashes[1:]
    # a different interpreter with a different PYTHONHASHSEED agrees
    code = ("from pdserve.engine.core.block_manager import compute_block_hashes as c; "
            "print(c(list(range(100, 140)), 16))")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True,
                         capture_output=True, text=True)
    assert res.stdout.strip() == str(hashes)


def test_refcounts_and_prefix_hit() -> None:
    bm = BlockManager(CacheConfig(block_size=16, num_blocks=10))
    prompt = list(range(40))
    a = make_req("a", prompt)
    assert admit(bm, a) == []
    assert len(a.block_table) == 3 and bm.num_allocations == 3
    b = make_req("b", prompt)
    hits = admit(bm, b)
    assert hits == a.block_table[:2]
    assert b.num_cached_tokens == 32 and b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]  # the partial block is private
    assert bm.num_allocations == 4  # only b's partial block was new
    assert [bm.ref_counts[x] for x in a.block_table] == [2, 2, 1]
    assert bm.prefix_cache_queries == 80 and bm.prefix_cache_hits == 32
    check_invariants(bm, [a, b])
    assert bm.free(a)
    assert [bm.ref_counts[x] for x in b.block_table] == [1, 1, 1]
    check_invariants(bm, [b])


def test_different_earlier_block_means_no_hit() -> None:
    bm = BlockManager(CacheConfig(block_size=4, num_blocks=16))
    shared_tail = [9, 9, 9, 9, 5]
    a = make_req("a", [1, 2, 3, 4] + shared_tail)
    admit(bm, a)
    b = make_req("b", [1, 2, 3, 0] + shared_tail)  # block 1 identical, block 0 differs
    assert bm.get_computed_blocks(b) == []
    c = make_req("c", [1, 2, 3, 4, 9, 9, 9, 9, 6])  # same two full blocks
    assert bm.get_computed_blocks(c) == a.block_table[:2]


def test_cache_leaves_at_least_one_token_to_compute() -> None:
    bm = BlockManager(CacheConfig(block_size=4, num_blocks=16))
    a = make_req("a", list(range(12)))
    admit(bm, a)
    assert len(bm.hash_to_block) == 3
    # an identical 12-token prompt may reuse only 8 tokens: the last token must be computed
    same = make_req("same", list(range(12)))
    assert len(bm.get_computed_blocks(same)) == 2
    assert bm.allocate(same, 4, bm.get_computed_blocks(same))
    assert same.num_computed_tokens == 8
    longer = make_req("longer", list(range(13)))
    assert len(bm.get_computed_blocks(longer)) == 3
    one_block = make_req("one", list(range(4)))
    assert bm.get_computed_blocks(one_block) == []


def test_hash_registered_only_when_computed() -> None:
    bm = BlockManager(CacheConfig(block_size=4, num_blocks=16))
    a = make_req("a", list(range(12)))
    assert bm.allocate(a, 12)
    b = make_req("b", list(range(13)))
    assert bm.get_computed_blocks(b) == []  # allocated but not computed: no sharing
    a.num_computed_tokens = 6  # first chunk done: one full block computed
    bm.cache_full_blocks(a)
    assert bm.get_computed_blocks(b) == a.block_table[:1]
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a)
    assert bm.get_computed_blocks(b) == a.block_table


def test_lru_eviction_order() -> None:
    bm = BlockManager(CacheConfig(block_size=4, num_blocks=4))
    reqs = {}
    for rid, first in (("a", 10), ("b", 20), ("c", 30)):
        reqs[rid] = make_req(rid, list(range(first, first + 4)))
        admit(bm, reqs[rid])
    block_of = {rid: r.block_table[0] for rid, r in reqs.items()}
    for rid in "abc":
        bm.free(reqs[rid])
    assert bm.num_evictable_blocks == 3 and bm.num_free_blocks == 4
    assert bm.usage == 0.0
    # touch b: a hit revives it; freed again it becomes the most recently used
    b2 = make_req("b2", list(range(20, 25)))
    assert admit(bm, b2, compute=False) == [block_of["b"]]
    bm.free(b2)  # b's block back to the LRU tail; b2's own block was the never-cached one
    assert bm.num_evictions == 0
    # LRU now: a, c, b. Three new blocks: the never-cached one first, then evict a, then c.
    d = make_req("d", [99] * 12)
    assert bm.allocate(d, 12)
    assert bm.num_evictions == 2
    assert d.block_table == [3, block_of["a"], block_of["c"]]
    for rid, hit in (("a", False), ("c", False), ("b", True)):
        probe = make_req("p" + rid, reqs[rid].prompt_token_ids + [0])
        assert bool(bm.get_computed_blocks(probe)) is hit, rid


def test_tail_blocks_evicted_before_the_prefix() -> None:
    bm = BlockManager(CacheConfig(block_size=4, num_blocks=3))
    a = make_req("a", list(range(12)))
    admit(bm, a)
    bm.free(a)  # 3 cached blocks
    b = make_req("b", [50] * 4)
    assert bm.allocate(b, 4)  # evicts one: a's last block, so a's prefix still hits
    probe = make_req("probe", list(range(12)) + [0])
    assert len(bm.get_computed_blocks(probe)) == 2


def test_free_blocks_taken_before_evicting() -> None:
    bm = BlockManager(CacheConfig(block_size=4, num_blocks=3))
    a = make_req("a", list(range(4)))
    admit(bm, a)
    bm.free(a)
    b = make_req("b", [50] * 8)
    assert bm.allocate(b, 8)
    assert bm.num_evictions == 0
    assert len(bm.hash_to_block) == 1  # a's cached block survived
    c = make_req("c", [60] * 2)
    assert bm.allocate(c, 2)
    assert bm.num_evictions == 1 and not bm.hash_to_block


def test_free_is_idempotent() -> None:
    bm = BlockManager(CacheConfig(block_size=4, num_blocks=8))
    a, b = make_req("a", list(range(9))), make_req("b", list(range(9)))
    admit(bm, a)
    admit(bm, b)
    assert bm.free(a) is True
    refs = list(bm.ref_counts)
    assert bm.free(a) is False
    assert bm.ref_counts == refs  # b still holds the shared prefix
    check_invariants(bm, [b])
    assert bm.release(b) and not bm.release(b)
    check_invariants(bm, [])


def test_counters_and_usage() -> None:
    bm = BlockManager(CacheConfig(block_size=4, num_blocks=10))
    a = make_req("a", list(range(10)))
    admit(bm, a)
    assert bm.num_used_blocks == 3 and bm.num_free_blocks == 7
    assert bm.usage == pytest.approx(0.3)
    bm.free(a)
    assert bm.num_evictable_blocks == 2  # the two full blocks stay cached
    assert bm.usage == 0.0 and bm.num_free_blocks == 10
    assert bm.num_allocations == 3


def test_append_slots_on_block_boundaries() -> None:
    bm = BlockManager(CacheConfig(block_size=4, num_blocks=4))
    a = make_req("a", list(range(4)))
    assert bm.allocate(a, 4)
    a.num_computed_tokens = 4
    a.append_token(100)
    assert bm.append_slots(a, 1) and len(a.block_table) == 2  # token 4 opens block 1
    a.num_computed_tokens = 5
    assert bm.append_slots(a, 3) and len(a.block_table) == 2  # tokens 5..7 fit
    assert bm.append_slots(a, 4) and len(a.block_table) == 3  # speculative k+1 = 4 spans
    assert bm.num_allocations == 3
    # short pool: fails and changes nothing
    table = list(a.block_table)
    assert not bm.append_slots(a, 12)
    assert a.block_table == table and bm.num_free_blocks == 1


def test_allocate_fails_cleanly_and_counts_revived_blocks() -> None:
    bm = BlockManager(CacheConfig(block_size=4, num_blocks=3))
    a = make_req("a", list(range(8)))
    admit(bm, a)
    bm.free(a)  # 2 evictable cached blocks + 1 free
    b = make_req("b", list(range(8)) + [1, 2, 3, 4, 5])
    hits = bm.get_computed_blocks(b)
    assert len(hits) == 2
    # reviving the 2 hits leaves 1 block; 5 new tokens need 2 -> refuse, no change
    assert not bm.allocate(b, 5, hits)
    assert b.block_table == [] and bm.num_evictable_blocks == 2 and bm.num_allocations == 2
    assert bm.allocate(b, 4, hits)
    check_invariants(bm, [b])


def test_allocate_for_remote() -> None:
    bm = BlockManager(CacheConfig(block_size=4, num_blocks=4))
    r = make_req("r", list(range(10)))
    r.append_token(7)
    blocks = bm.allocate_for_remote(r, 10)
    assert blocks == r.block_table and len(blocks) == 3
    assert r.num_computed_tokens == 0
    big = make_req("big", list(range(8)))
    with pytest.raises(NoFreeBlocksError):
        bm.allocate_for_remote(big, 8)
    assert big.block_table == [] and bm.num_free_blocks == 1
    with pytest.raises(ValueError, match="num_tokens"):
        bm.allocate_for_remote(make_req("x", [1]), 2)


def test_same_blocks_computed_twice_register_once() -> None:
    bm = BlockManager(CacheConfig(block_size=4, num_blocks=8))
    a, b = make_req("a", list(range(9))), make_req("b", list(range(9)))
    assert bm.allocate(a, 9) and bm.allocate(b, 9)  # both before either computed
    for r in (a, b):
        r.num_computed_tokens = 9
        bm.cache_full_blocks(r)
    assert sorted(bm.hash_to_block.values()) == sorted(a.block_table[:2])
    bm.free(b)
    bm.free(a)
    assert bm.num_evictable_blocks == 2
    check_invariants(bm, [])


def test_prefix_caching_off() -> None:
    bm = BlockManager(CacheConfig(block_size=4, num_blocks=8, enable_prefix_caching=False))
    a, b = make_req("a", list(range(9))), make_req("b", list(range(9)))
    admit(bm, a)
    assert admit(bm, b) == [] and not bm.hash_to_block
    bm.free(a)
    assert bm.num_evictable_blocks == 0 and bm.prefix_cache_queries == 0


@pytest.mark.parametrize("seed", range(12))
def test_random_workload_keeps_invariants(seed: int) -> None:
    """Random admits (shared prefixes), chunked computes, decodes and frees."""
    rng = random.Random(seed)
    bm = BlockManager(CacheConfig(block_size=rng.choice([2, 4]), num_blocks=rng.randint(6, 24)))
    stems = [[rng.randrange(4) for _ in range(12)] for _ in range(3)]
    live: list[Request] = []
    for step in range(300):
        op = rng.random()
        if op < 0.3:
            prompt = rng.choice(stems)[:rng.randint(1, 12)] + [rng.randrange(4)] * rng.randint(0, 3)
            req = make_req(f"r{step}", prompt)
            hits = bm.get_computed_blocks(req)
            cached = len(hits) * bm.block_size
            assert cached <= req.num_tokens - 1 and cached % bm.block_size == 0
            if bm.allocate(req, rng.randint(1, req.num_tokens - cached), hits):
                live.append(req)
        elif op < 0.75 and live:
            req = rng.choice(live)
            remaining = req.num_tokens - req.num_computed_tokens
            new = rng.randint(1, remaining) if remaining > 0 else 0
            covered = len(req.block_table) * bm.block_size - req.num_computed_tokens
            if new and (new <= covered or bm.append_slots(req, new)):
                req.num_computed_tokens += new
                bm.cache_full_blocks(req)
            if req.num_computed_tokens == req.num_tokens:
                req.append_token(rng.randrange(4))  # "sampled"
        elif live:
            req = live.pop(rng.randrange(len(live)))
            assert bm.free(req) and not bm.free(req)
        check_invariants(bm, live)
    for req in live:
        bm.free(req)
    check_invariants(bm, [])
    assert bm.num_used_blocks == 0


def test_reset_prefix_cache_forgets_every_cached_block_and_the_counters() -> None:
    bm = BlockManager(CacheConfig(block_size=16, num_blocks=10))
    prompt = list(range(40))
    a = make_req("a", prompt)
    admit(bm, a)
    with pytest.raises(RuntimeError, match="1 requests still hold blocks"):
        bm.reset_prefix_cache()
    assert bm.free(a)
    assert bm.num_evictable_blocks == 2 and bm.prefix_cache_queries == 40
    bm.reset_prefix_cache()
    check_invariants(bm, [])
    assert bm.num_evictable_blocks == 0 and bm.hash_to_block == {}
    assert bm.num_free_blocks == bm.num_blocks
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits, bm.num_allocations,
            bm.num_evictions) == (0, 0, 0, 0)
    b = make_req("b", prompt)  # the same prompt again: no longer a hit
    assert admit(bm, b) == []
    assert bm.prefix_cache_hits == 0 and bm.num_allocations == 3
    check_invariants(bm, [b])


def test_cache_salt_seeds_the_chain_so_only_equal_salts_share_blocks() -> None:
    """vLLM's cache_salt (SamplingParams): equal prompts under another salt, or none, find
    nothing cached; under the same salt they hit."""
    from pdserve.engine.core.block_manager import ROOT_HASH, root_hash

    assert root_hash(None) == ROOT_HASH and root_hash("a") != root_hash("b") != ROOT_HASH
    bm = BlockManager(CacheConfig(block_size=16, num_blocks=20))
    prompt = list(range(40))

    def salted(rid: str, salt: str | None) -> Request:
        return Request(rid, list(prompt), SamplingParams(max_tokens=4, cache_salt=salt))

    live = [salted("a", "tenant-a")]
    assert admit(bm, live[0]) == []
    for rid, salt, hits in (("b", "tenant-b", 0), ("c", None, 0), ("d", "tenant-a", 2)):
        live.append(salted(rid, salt))
        assert len(admit(bm, live[-1])) == hits, rid
    check_invariants(bm, live)
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        SamplingParams(cache_salt="")
