"""Routing policies: which prefill worker P and which decode worker D serve a request.

Prefill:  round_robin | least_loaded | prefix_aware. Prefix-aware keeps a bounded LRU index
          block hash -> workers that recently prefilled that block (the hashes are the
          engine's chained block hashes, so a hit on block i implies blocks 0..i), and sends a
          prompt to the worker holding its longest cached prefix unless that worker is
          clearly busier than the least loaded one.
Decode:   KV-capacity-aware: among workers with room for prompt + max_tokens, the one with
          the most free blocks left after this request, ties to the lightest load
          (round_robin keeps plain rotation among those with room).
Selective disaggregation: when the uncached part of a prompt on its best P is shorter than
a threshold, prefill on D itself (a network hop costs more than computing a few tokens).

Policies see workers through the small `Candidate` protocol, so tests feed plain objects.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

ROUTING_POLICIES = ("round_robin", "least_loaded", "prefix_aware")


class Candidate(Protocol):
    worker_id: str

    @property
    def load(self) -> int: ...  # requests the router has on it + its waiting queue

    @property
    def free_blocks(self) -> int: ...  # estimated free KV blocks (health poll - reservations)


class PrefixIndex:
    """Bounded LRU map: block hash -> ids of workers that prefilled it recently."""

    def __init__(self, max_entries: int = 200_000) -> None:
        self._map: OrderedDict[int, set[str]] = OrderedDict()
        self._max = max_entries

    def __len__(self) -> int:
        return len(self._map)

    def match(self, hashes: Sequence[int], worker_ids: Sequence[str]) -> dict[str, int]:
        """Length (in blocks) of each worker's cached prefix of `hashes`."""
        depth = {w: 0 for w in worker_ids}
        for i, h in enumerate(hashes):
            holders = self._map.get(h)
            if not holders:
                break
            alive = False
            for w in holders:
                if depth.get(w) == i:  # chained: only a worker that had block i-1 can extend
                    depth[w] = i + 1
                    alive = True
            if not alive:
                break
        return depth

    def record(self, hashes: Sequence[int], worker_id: str) -> None:
        for h in hashes:
            holders = self._map.pop(h, None) or set()
            holders.add(worker_id)
            self._map[h] = holders  # most recent at the end
        while len(self._map) > self._max:
            self._map.popitem(last=False)

    def forget(self, worker_id: str) -> None:
        """The worker restarted: its prefix cache is empty."""
        for h in [h for h, ws in self._map.items() if worker_id in ws]:
            ws = self._map[h]
            ws.discard(worker_id)
            if not ws:
                del self._map[h]


class PrefillPolicy:
    def __init__(self, kind: str = "prefix_aware", balance_slack: int = 4,
                 index: PrefixIndex | None = None) -> None:
        if kind not in ROUTING_POLICIES:
            raise ValueError(f"routing: must be one of {ROUTING_POLICIES}, got {kind!r}")
        self.kind = kind
        self.balance_slack = balance_slack  # extra load accepted to keep a cache hit
        self.index = index or PrefixIndex()
        self._rr = itertools.count()

    def choose(self, workers: Sequence[Candidate], hashes: Sequence[int]) -> tuple[Candidate, int]:
        """Pick a worker; returns (worker, cached prefix blocks expected there)."""
        if not workers:
            raise ValueError("workers: need at least one candidate")
        depth = self.index.match(hashes, [w.worker_id for w in workers])
        # rotate the list each call: min/max keep the first of equals, so ties take turns
        start = next(self._rr) % len(workers)
        workers = list(workers[start:]) + list(workers[:start])
        if self.kind == "round_robin":
            w = workers[0]
        elif self.kind == "least_loaded":
            w = min(workers, key=lambda w: (w.load, -depth[w.worker_id]))
        else:
            least = min(w.load for w in workers)
            near = [w for w in workers if w.load <= least + self.balance_slack]
            w = max(near, key=lambda w: (depth[w.worker_id], -w.load))
        return w, depth[w.worker_id]

    def prefilled(self, hashes: Sequence[int], worker_id: str) -> None:
        self.index.record(hashes, worker_id)

    def forget(self, worker_id: str) -> None:
        self.index.forget(worker_id)


class DecodePolicy:
    def __init__(self, kind: str = "prefix_aware") -> None:
        self.round_robin = kind == "round_robin"
        self._rr = itertools.count()

    def choose(self, workers: Sequence[Candidate], need_blocks: int) -> Candidate | None:
        """A worker with room for `need_blocks` more blocks, or None when none has room."""
        fits = [w for w in workers if w.free_blocks >= need_blocks]
        if not fits:
            return None
        if self.round_robin:
            return fits[next(self._rr) % len(fits)]
        return max(fits, key=lambda w: (w.free_blocks - need_blocks, -w.load))


def straight_to_decode(prompt_len: int, cached_blocks: int, block_size: int,
                       threshold: int) -> bool:
    """Selective disaggregation: skip the prefill pool when the uncached part is short."""
    uncached = prompt_len - min(prompt_len, cached_blocks * block_size)
    return uncached < threshold


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
