"""Where one attempt of a completion goes: a decode worker D and, unless it goes straight to
D, a prefill worker P. plan_attempt is a pure choice over the pool as its health polls last
saw it; reserve_attempt and reserve_continuation reserve what it picks, waiting in the router
queue while every worker it could use is full (the retrying around them is router/
dispatch.py's).

    D   the decode policy's pick among the usable decode (or colocated) workers, those that
        can pair with an up prefill worker first, those this request has not tried first
    P   none for a colocated D, for a pool without prefill workers, or for a short uncached
        prompt (selective disaggregation); else the prefill policy's pick (prefix affinity)
        among the usable ones D may pair with. Pairable ones up but full: wait (None). None
        D may pair with: decode-only, counted as a prefill fallback (ANCHORS #5).
"""
from __future__ import annotations

import asyncio
import time

from pdserve.router.errors import RequestTimeout, WorkerUnavailable
from pdserve.router.policies import straight_to_decode
from pdserve.router.pool import WorkerState

Plan = tuple[WorkerState | None, WorkerState]  # (P or None: D prefills itself, D)


def plan_attempt(core, need_blocks: int, hashes: list[int], prompt_len: int,
                 excluded: set[str]) -> Plan | None:
    """(P, D) for an attempt now, or None while every worker it could use is full."""
    pool, cfg = core.pool, core.cfg
    now = time.monotonic()
    ds = prefer(pairable(pool, pool.usable("decode", "colocated"), now), excluded)
    d = core.decode_policy.choose(ds, need_blocks) if ds else None
    if d is None:
        return None
    if d.role == "colocated" or not pool.by_role("prefill"):
        return None, d
    ps = prefer([p for p in pool.usable("prefill") if d.may_pair(p, now)], excluded)
    if not ps:
        if any(p.up and d.may_pair(p, now) for p in pool.by_role("prefill")):
            return None  # prefill workers d can pair with are up but full: wait for one
        # none d may pair with (refused, or backing off a passing refusal): decode-only
        core.metrics.fallbacks.labels(**core.metrics.labels).inc()  # visible (ANCHORS #5)
        return None, d
    p, cached = core.prefill_policy.choose(ps, hashes)
    if straight_to_decode(prompt_len, cached, cfg.block_size, cfg.disagg_threshold):
        return None, d
    return p, d


def pairable(pool, ds: list[WorkerState], now: float) -> list[WorkerState]:
    """The decode workers that can take KV from an up prefill worker, if any can (so a pair
    refused on one D goes to another D rather than decode-only), else all."""
    ps = [p for p in pool.by_role("prefill") if p.up]
    ok = [d for d in ds if d.role == "colocated" or any(d.may_pair(p, now) for p in ps)]
    return ok or ds


def prefer(workers: list[WorkerState], excluded: set[str]) -> list[WorkerState]:
    """Workers not yet tried for this request, or all of them when every one was tried."""
    fresh = [w for w in workers if w.worker_id not in excluded]
    return fresh or workers


def any_decode_up(pool) -> bool:
    """Some decode worker is healthy but full: waiting will help."""
    return any(w.up for w in pool.by_role("decode", "colocated"))


async def reserve_attempt(core, need_blocks: int, hashes: list[int], prompt_len: int,
                          excluded: set[str], rid: str, arrival: float, deadline: float) -> Plan:
    """plan_attempt's (P, D), reserved; waits while every worker it could use is full, until
    the deadline, or queue_timeout_s past arrival when no decode worker is up at all."""
    pool, cfg = core.pool, core.cfg
    while True:
        changed = pool.changed_event()  # before the check: a change meanwhile is not lost
        plan = plan_attempt(core, need_blocks, hashes, prompt_len, excluded)
        if plan is not None:
            p, d = plan
            d.reserve(need_blocks)
            if p is not None:
                p.reserve(0)
            return p, d
        if deadline - time.monotonic() <= 0:
            raise RequestTimeout(f"request {rid}: no worker had room before the deadline")
        if time.monotonic() - arrival > cfg.queue_timeout_s and not \
                pool.usable("decode", "colocated") and not any_decode_up(pool):
            raise WorkerUnavailable("no healthy decode worker", code="no_healthy_worker")
        await _changed_or(changed, deadline)


async def reserve_continuation(core, dead: set[tuple[str, str]], need: int, rid: str,
                               deadline: float, why: str) -> WorkerState:
    """A decode worker other than those that failed this stream (`dead`: id, incarnation),
    reserved for `need` blocks; waits while the others are up but full; fails at once when
    no other one is up (`why`: the failure that ended the stream there)."""
    pool = core.pool
    while True:
        changed = pool.changed_event()
        alive = [w for w in pool.by_role("decode", "colocated")
                 if w.up and (w.worker_id, w.incarnation) not in dead]
        if not alive:
            raise WorkerUnavailable(f"{why}; output had started and no other decode worker "
                                    "is left to continue it")
        d = core.decode_policy.choose([w for w in alive if w.usable], need)
        if d is not None:
            d.reserve(need)
            return d
        if deadline - time.monotonic() <= 0:
            raise RequestTimeout(f"request {rid}: no decode worker had room to continue it "
                                 "before the deadline")
        await _changed_or(changed, deadline)


async def _changed_or(changed: asyncio.Event, deadline: float) -> None:
    """Until the pool changes, 0.5 s at most (and not past the deadline)."""
    try:
        await asyncio.wait_for(changed.wait(), min(0.5, max(0.01, deadline - time.monotonic())))
    except TimeoutError:
        pass
