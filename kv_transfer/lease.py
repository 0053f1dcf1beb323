"""Leases on the prefill side: KV blocks stay pinned until decode has read them.

Protocol (ANCHORS #2 and #6: no leak, and a read from freed blocks is an error, never output)

  1. P prefills request r, then `lease = table.pin(r, block_ids, ttl_s)` and answers the
     router with a KV handle carrying (worker_id, incarnation, block_ids, lease.generation,
     time left on the lease). P's block manager keeps a reference on those blocks for as long
     as the lease is in the table; P frees them ONLY from what `release()` or `expire()`
     returns.
  2. D allocates local blocks and READs P's blocks (NixlKVTransport.read_blocks). D may skip
     the read when too little lease time is left (a cheap pre-check, not the guarantee).
  3. After the read, D calls P's release(r, generation). P runs
     `blocks = table.release(r, generation)`:
       - a list (possibly empty, see 5): the lease was still in the table when the release
         arrived, so its blocks were never freed or reused while D read them: the read is
         valid. P frees `blocks`; D may decode.
       - None: the lease is unknown, has expired, or has a different generation (the request
         was re-pinned). The blocks may have been freed and reused during the read, so D
         MUST treat the read as stale: error or re-prefill, never output.
     D must also treat "no answer before its deadline" as stale.
  4. A background sweep calls `table.expire()`; P frees the returned leases' blocks and
     the table counts kv_lease_expired. An expired lease never validates a release.
  5. Release is idempotent: a retried release of a generation already released returns []
     again (valid, nothing more to free), from a bounded memory of recent releases.
     `release(r)` without generation drops whatever lease r holds (P's own abort paths) and
     is not remembered: a reader's later release(r, generation) is then stale (None).

"Alive" means "still in the table": past its deadline but not yet swept by expire(), a
lease's blocks are still pinned, so a release then is still a valid read. The deadline is
in the table's clock (monotonic by default, injectable for tests).

Fault injection: with a FaultInjector whose drop_release_prob fires, release() is swallowed
(state unchanged, returns None as if the message were lost); the lease later expires.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .faults import FaultInjector
from .metrics import KVMetrics

RELEASED_MEMORY = 4096  # recent (request_id, generation) releases kept for idempotency


class LeaseError(ValueError):
    """A pin request is invalid; the message names the field."""


@dataclass(frozen=True)
class Lease:
    request_id: str
    generation: int  # unique per table; a re-pin of the same request gets a new one
    deadline: float  # in the table's clock
    block_ids: tuple[int, ...]


class LeaseTable:
    """request_id -> Lease, thread-safe (one lock around every method)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 faults: FaultInjector | None = None, metrics: KVMetrics | None = None) -> None:
        self._clock = clock
        self._faults = faults
        self._metrics = metrics
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._released: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._generations = itertools.count(1)
        self._pinned = 0  # blocks held under lease, for the gauge
        self.expired_total = 0

    def pin(self, request_id: str, block_ids: Iterable[int], ttl_s: float) -> Lease:
        if not isinstance(request_id, str) or not request_id:
            raise LeaseError(f"request_id: must be a non-empty str, got {request_id!r}")
        if not ttl_s > 0:  # also refuses NaN
            raise LeaseError(f"ttl_s: must be > 0, got {ttl_s!r}")
        blocks = tuple(int(b) for b in block_ids)
        if any(b < 0 for b in blocks):
            raise LeaseError(f"block_ids: negative id in {list(blocks)}")
        with self._lock:
            held = self._leases.get(request_id)
            if held is not None:
                raise LeaseError(f"request_id: {request_id!r} already holds lease generation "
                                 f"{held.generation}; release it first")
            lease = Lease(request_id, next(self._generations), self._clock() + ttl_s, blocks)
            self._leases[request_id] = lease
            self._set_pinned(self._pinned + len(blocks))
        return lease

    def release(self, request_id: str, generation: int | None = None) -> list[int] | None:
        """Blocks to free if the lease was alive (valid read), else None (stale read)."""
        if self._faults is not None and self._faults.drop_release():
            return None
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or (generation is not None and lease.generation != generation):
                if generation is not None and (request_id, generation) in self._released:
                    return []  # a retried release of a generation we already released
                return None
            del self._leases[request_id]
            self._set_pinned(self._pinned - len(lease.block_ids))
            if generation is not None:  # only a reader's release vouches for its read: an
                # abort (no generation) freed the blocks under any read still in flight, so
                # that reader's later release must come back stale (None), not []
                self._released[(request_id, lease.generation)] = None
                while len(self._released) > RELEASED_MEMORY:
                    self._released.popitem(last=False)
            return list(lease.block_ids)

    def expire(self, now: float | None = None) -> list[Lease]:
        """Remove and return leases past their deadline; the caller frees their blocks."""
        with self._lock:
            now = self._clock() if now is None else now
            gone = [lease for lease in self._leases.values() if lease.deadline <= now]
            for lease in gone:
                del self._leases[lease.request_id]
            if gone:
                self._set_pinned(self._pinned - sum(len(lease.block_ids) for lease in gone))
                self.expired_total += len(gone)
                if self._metrics is not None:
                    self._metrics.leases_expired(len(gone))
        return gone

    def check(self, request_id: str, generation: int) -> bool:
        """True while this exact lease is in the table (its blocks are still pinned)."""
        with self._lock:
            lease = self._leases.get(request_id)
            return lease is not None and lease.generation == generation

    def get(self, request_id: str) -> Lease | None:
        with self._lock:
            return self._leases.get(request_id)

    def next_deadline(self) -> float | None:
        """Earliest deadline in the table (when the sweeper should next run), or None."""
        with self._lock:
            return min((lease.deadline for lease in self._leases.values()), default=None)

    @property
    def pinned_blocks(self) -> int:
        with self._lock:
            return self._pinned

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def _set_pinned(self, n: int) -> None:
        self._pinned = n
        if self._metrics is not None:
            self._metrics.set_blocks_pinned(n)
