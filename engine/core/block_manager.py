"""Paged KV block manager: fixed-size blocks, reference counts, prefix caching, LRU eviction.

Plain Python, no torch: it hands out block ids; the model runner owns the KV tensor
(layout in engine/model/attention.py). A request's blocks live in Request.block_table, and block i
holds the KV of tokens [i * block_size, (i + 1) * block_size).

Block states (every block is in exactly one):
    free       ref 0, no hash          -> in the min-heap `_free` (lowest id first, so a
                                          request's blocks tend to form contiguous runs,
                                          which KV transfer coalesces into one descriptor)
    evictable  ref 0, hash registered  -> in the LRU `_evictable` (oldest first); its KV is
                                          still valid and a prefix hit revives it
    used       ref > 0                 -> in one or more block tables (> 1 only for a
                                          cached, shared prefix block)

Prefix caching: a full block is named by a chained hash (its tokens and its parent's hash,
see compute_block_hashes). The hash is registered only once the block's KV is computed
(cache_full_blocks, called after a step), so a sibling never reads uncomputed KV.

Allocation is lazy: `allocate` covers only the tokens scheduled this step (a prefill chunk),
and `append_slots` grows the table step by step. That lets more requests run at once; the
price is that a running request may need a block later when none is free, which the
scheduler answers with preemption by recompute.
"""
from __future__ import annotations

import hashlib
import heapq
import struct
from collections import OrderedDict
from collections.abc import Sequence

from pdserve.engine.core.config import CacheConfig
from pdserve.engine.core.request import Request

ROOT_HASH = 0  # the parent hash of a sequence's first block (no cache_salt)


class NoFreeBlocksError(RuntimeError):
    """The KV pool has too few free (or evictable) blocks for this allocation."""


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Process-stable 64-bit hash of one full block: blake2b(parent, tokens), little-endian."""
    data = struct.pack(f"<Q{len(token_ids)}q", parent_hash, *token_ids)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def root_hash(cache_salt: str | None) -> int:
    """The parent hash of a prompt's first block: ROOT_HASH, or one derived from its
    cache_salt (SamplingParams), so that equal prompts under other salts share no block."""
    if cache_salt is None:
        return ROOT_HASH
    data = b"pdserve-cache-salt\0" + cache_salt.encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def compute_block_hashes(token_ids: Sequence[int], block_size: int,
                         parent_hash: int = ROOT_HASH) -> list[int]:
    """Chained hashes of the full blocks of `token_ids` (a trailing partial block has none).

    Hash i depends on every token of blocks 0..i, so equal blocks after different prefixes
    get different hashes. Stable across processes: the router uses it for prefix affinity.
    """
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start:start + block_size])
        hashes.append(parent_hash)
    return hashes


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, config: CacheConfig) -> None:
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks
        self.enable_prefix_caching = config.enable_prefix_caching
        self.ref_counts = [0] * self.num_blocks
        self.block_hashes: list[int | None] = [None] * self.num_blocks
        self.hash_to_block: dict[int, int] = {}
        self._free: list[int] = list(range(self.num_blocks))  # sorted list = valid min-heap
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._owners: set[str] = set()  # request ids that hold blocks (guards double free)
        self._req_hashes: dict[str, list[int]] = {}  # request id -> hashes of its full blocks
        self._num_registered: dict[str, int] = {}  # request id -> leading blocks already cached
        # counters (monotonic)
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # of those, tokens found in the cache
        self.num_allocations = 0  # blocks handed out (fresh or evicted)
        self.num_evictions = 0  # cached blocks whose hash was dropped to reuse them

    # -- occupancy ----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: never-cached free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool referenced by requests (evictable cached blocks count as free)."""
        return self.num_used_blocks / self.num_blocks

    def holds_blocks(self, req: Request) -> bool:
        return req.request_id in self._owners

    # -- prefix cache -------------------------------------------------------------------
    def _request_hashes(self, req: Request, num_blocks: int) -> list[int]:
        """Hashes of the request's first `num_blocks` full blocks, extended incrementally."""
        hashes = self._req_hashes.setdefault(req.request_id, [])
        if len(hashes) < num_blocks:  # only build the token list when a new block is full
            start = len(hashes) * self.block_size
            tokens = req.all_token_ids[start:num_blocks * self.block_size]
            parent = hashes[-1] if hashes else root_hash(req.sampling_params.cache_salt)
            hashes += compute_block_hashes(tokens, self.block_size, parent)
        return hashes[:num_blocks]

    def get_computed_blocks(self, req: Request, max_cached_tokens: int | None = None) -> list[int]:
        """Block ids of the longest cached prefix of full blocks. Pure: changes nothing.

        By default at most num_tokens - 1 tokens may come from the cache (rounded down to a
        block boundary): the last token must be computed, its logits give the next token.
        """
        if not self.enable_prefix_caching:
            return []
        cap = req.num_tokens - 1 if max_cached_tokens is None else max_cached_tokens
        hits: list[int] = []
        for h in self._request_hashes(req, min(cap, req.num_tokens) // self.block_size):
            block = self.hash_to_block.get(h)
            if block is None:
                break  # chained hashes: nothing after a miss can hit
            hits.append(block)
        return hits

    def cache_full_blocks(self, req: Request) -> None:
        """Register the hashes of the request's full blocks whose KV is now computed."""
        if not self.enable_prefix_caching or req.request_id not in self._owners:
            return
        bs = self.block_size
        num_full = min(req.num_computed_tokens, len(req.block_table) * bs) // bs
        start = self._num_registered.get(req.request_id, 0)
        if num_full <= start:
            return
        hashes = self._request_hashes(req, num_full)
        for i in range(start, num_full):
            block, h = req.block_table[i], hashes[i]
            if self.block_hashes[block] is not None or h in self.hash_to_block:
                continue  # a prefix hit, or the same tokens computed twice: keep the first
            self.hash_to_block[h] = block
            self.block_hashes[block] = h
        self._num_registered[req.request_id] = num_full

    def reset_prefix_cache(self) -> None:
        """Forget every cached block and zero the counters, as vLLM's reset_prefix_cache. Only
        while no request holds blocks (the start-up warm-up's prompts must not become hits,
        nor count in the metrics, of the first served requests)."""
        if self._owners:
            raise RuntimeError(f"reset_prefix_cache: {len(self._owners)} requests still hold "
                               f"blocks")
        for block in self._evictable:
            del self.hash_to_block[self.block_hashes[block]]
            self.block_hashes[block] = None
            heapq.heappush(self._free, block)
        self._evictable.clear()
        self._req_hashes.clear()
        self._num_registered.clear()
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        self.num_allocations = self.num_evictions = 0

    # -- allocation ---------------------------------------------------------------------
    def _take_block(self) -> int:
        if self._free:
            block = heapq.heappop(self._free)
        else:  # evict the least recently used cached block; its KV is about to be overwritten
            block, _ = self._evictable.popitem(last=False)
            del self.hash_to_block[self.block_hashes[block]]
            self.block_hashes[block] = None
            self.num_evictions += 1
        self.ref_counts[block] = 1
        self.num_allocations += 1
        return block

    def _incref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._evictable[block]  # a hit revives an evictable cached block
        self.ref_counts[block] += 1

    def _decref(self, block: int) -> None:
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"block {block}: reference count would go below 0")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self.block_hashes[block] is not None:
                self._evictable[block] = None  # most recently used end
            else:
                heapq.heappush(self._free, block)

    def allocate(self, req: Request, num_new_tokens: int,
                 computed_blocks: Sequence[int] = ()) -> bool:
        """Give a request without blocks the cached prefix `computed_blocks` (from
        get_computed_blocks) plus blocks for `num_new_tokens` more tokens.

        Returns False, changing nothing, when the pool is short. On success sets
        block_table, num_computed_tokens = num_cached_tokens = cached prefix length.
        """
        if req.request_id in self._owners:
            raise RuntimeError(f"request {req.request_id!r} already holds blocks")
        num_cached = len(computed_blocks) * self.block_size
        need = _cdiv(num_cached + num_new_tokens, self.block_size) - len(computed_blocks)
        reviving = sum(1 for b in computed_blocks if self.ref_counts[b] == 0)
        if need > self.num_free_blocks - reviving:
            return False
        for block in computed_blocks:  # incref first so the evictions below cannot take them
            self._incref(block)
        req.block_table = list(computed_blocks) + [self._take_block() for _ in range(need)]
        req.num_computed_tokens = num_cached
        req.num_cached_tokens = num_cached
        self._owners.add(req.request_id)
        if self.enable_prefix_caching:
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += num_cached
        return True

    def append_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Make the table cover num_computed_tokens + num_new_tokens tokens (a decode step,
        k + 1 speculative tokens, or the next prefill chunk). False, changing nothing, when
        the pool is short."""
        if req.request_id not in self._owners:
            return self.allocate(req, num_new_tokens)
        total = req.num_computed_tokens + num_new_tokens
        need = _cdiv(total, self.block_size) - len(req.block_table)
        if need <= 0:
            return True
        if need > self.num_free_blocks:
            return False
        req.block_table += [self._take_block() for _ in range(need)]
        return True

    def allocate_for_remote(self, req: Request, num_tokens: int) -> list[int]:
        """Blocks for the first `num_tokens` tokens, to be filled by a remote KV read.

        No prefix reuse: the returned list is the whole block table, so block i here
        receives the remote side's block i (an unambiguous mapping for the reader). The
        blocks enter the prefix cache once the read lands (cache_full_blocks).
        """
        if not 0 < num_tokens <= req.num_tokens:
            raise ValueError(f"num_tokens: must be in [1, {req.num_tokens}], got {num_tokens}")
        if not self.allocate(req, num_tokens):
            need = _cdiv(num_tokens, self.block_size)
            raise NoFreeBlocksError(f"request {req.request_id!r} needs {need} KV blocks, "
                                    f"{self.num_free_blocks} free")
        return list(req.block_table)

    # -- release ------------------------------------------------------------------------
    def free(self, req: Request) -> bool:
        """Drop the request's references. Idempotent: False if it held no blocks.

        Blocks go back in reverse order, so a request's tail blocks (the least likely to be
        shared) become the least recently used and are evicted first.
        """
        self._req_hashes.pop(req.request_id, None)
        self._num_registered.pop(req.request_id, None)
        if req.request_id not in self._owners:
            return False
        self._owners.discard(req.request_id)
        for block in reversed(req.block_table):
            self._decref(block)
        req.block_table = []
        return True

    def release(self, req: Request) -> bool:
        """Free blocks kept pinned after a request finished (prefill role, remote reader done)."""
        return self.free(req)
