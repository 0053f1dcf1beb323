"""Worker registry: endpoints, gRPC channels, health polling, peer introduction, breakers.

Each worker is reached through a `WorkerRef` (router/worker_refs.py: a Ray actor in
production; a fixed address in unit tests) that says where its gRPC service listens and
under which incarnation. The pool:
  * polls every worker's Health RPC; a failure opens the worker's breaker (routing skips it);
    while open, probes re-read its endpoints (a Ray actor that restarted has a new
    incarnation and port), reconnect, re-introduce peers, and close the breaker on a good
    Health reply (half-open -> closed), so a transient failure never sticks (ANCHORS #4);
  * introduces every prefill worker to every decode worker (GetPeerInfo -> AddPeer), keyed
    by (worker id, incarnation): a restarted prefill worker is a new peer (ANCHORS #3);
  * caps the requests the router keeps on one worker (`capacity`) so a worker's gRPC thread
    pool never fills with streams; requests beyond wait in the router queue;
  * marks a worker stuck past `stall_timeout_s` as stalled (router/stall.py): down, its calls
    cancelled and moved, and restarted past twice that.
Client errors (4xx) are never reported here.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pbg
from pdserve.proto.rpc import make_aio_channel
from pdserve.router.stall import StallState
from pdserve.router.worker_refs import WorkerRef, WorkerStartFailed

log = logging.getLogger(__name__)


class Breaker:
    """closed -> open on a hard failure, or on soft_threshold soft ones (timeouts, internal
    errors) with no request served between them -> (backoff elapsed, a good health probe)
    trial -> closed once a request is served there, or open again, with twice the backoff,
    on any failure. A health probe alone never clears soft failures: a worker whose Health
    answers "ok" but whose requests fail is taken out as one that does not answer."""

    def __init__(self, base_s: float = 0.5, max_s: float = 10.0, soft_threshold: int = 3) -> None:
        self.base_s, self.max_s, self.soft_threshold = base_s, max_s, soft_threshold
        self.open = False
        self.trial = False  # closed by a probe, no request served since
        self.soft_failures = 0
        self.backoff_s = base_s
        self.retry_at = 0.0

    def failure(self, hard: bool) -> None:
        """hard: the worker does not answer; soft: a request failed (a timeout, an internal
        error) on a worker that may otherwise serve."""
        self.soft_failures = 0 if hard else self.soft_failures + 1
        if hard or self.trial or self.soft_failures >= self.soft_threshold:
            if self.open or self.trial:
                self.backoff_s = min(self.max_s, self.backoff_s * 2)
            self.open, self.trial = True, False
            self.retry_at = time.monotonic() + self.backoff_s

    def probe_ok(self) -> None:
        """Its Health answered "ok": an open breaker lets requests try it again."""
        if self.open:
            self.open, self.trial, self.soft_failures = False, True, 0

    def served(self) -> None:
        """A request was served there: the run of failures is over."""
        self.trial, self.soft_failures, self.backoff_s = False, 0, self.base_s

    def probe_due(self) -> bool:
        return self.open and time.monotonic() >= self.retry_at


HARD_CODES = (grpc.StatusCode.UNAVAILABLE,)
# not the worker's fault: an earlier attempt of the same request still holds the id there
NOT_FAULTS = (grpc.StatusCode.ALREADY_EXISTS,)
# a pair refused for a passing reason (or whose introduction failed) is introduced again
# after PEER_RETRY_S, doubling with each failure in a row up to PEER_RETRY_MAX_S
PEER_RETRY_S, PEER_RETRY_MAX_S = 2.0, 60.0
ADD_PEER_TIMEOUT_S = 15.0  # AddPeer includes the decode worker's warm-up read (10 s at most)


class WorkerState:
    """One worker as the router sees it."""

    def __init__(self, ref: WorkerRef, capacity: int) -> None:
        self.ref = ref
        self.worker_id, self.role = ref.worker_id, ref.role
        self.capacity = capacity
        self.endpoints: dict = {}
        self.incarnation = ""
        self.channel: grpc.aio.Channel | None = None
        self.stub: pbg.WorkerStub | None = None
        self.health: pb.HealthResponse | None = None
        self.breaker = Breaker()
        self.inflight = 0
        self.peers: set[tuple[str, str]] = set()  # decode: (prefill id, incarnation) accepted
        self.refused: dict[tuple[str, str], str] = {}  # decode: peers refused, with the reason
        # decode: peers whose introduction failed for a passing reason, introduced again
        # after this monotonic time (until then requests skip the pair, see may_pair)
        self.retry_peer_at: dict[tuple[str, str], float] = {}
        self.peer_failures: dict[tuple[str, str], int] = {}  # in a row, for the backoff
        self._pending_blocks = 0  # reserved since the last health poll
        self.stall = StallState()  # stuck in one step, or its Health unanswered (stall.py)

    @property
    def up(self) -> bool:
        """Connected, breaker closed, not draining."""
        draining = self.health is not None and self.health.status == "draining"
        return self.stub is not None and not self.breaker.open and not draining

    def may_pair(self, p: WorkerState, now: float) -> bool:
        """This decode worker may take KV from prefill worker p: not refused as incompatible
        (ANCHORS #8), and not backing off after a refusal that may pass."""
        key = (p.worker_id, p.incarnation)
        return key not in self.refused and self.retry_peer_at.get(key, 0.0) <= now

    @property
    def usable(self) -> bool:
        """Up and with room for one more request."""
        return self.up and self.inflight < self.capacity

    @property
    def load(self) -> int:
        return self.inflight + (self.health.num_waiting if self.health else 0)

    @property
    def free_blocks(self) -> int:
        if self.health is None:
            return 0
        return self.health.num_free_blocks - self._pending_blocks

    @property
    def total_blocks(self) -> int:
        return self.health.num_total_blocks if self.health else 0

    def reserve(self, blocks: int) -> None:
        self.inflight += 1
        self._pending_blocks += blocks

    def unreserve(self) -> None:
        self.inflight -= 1


class WorkerPool:
    def __init__(self, refs: list[WorkerRef], *, cluster_secret: str, capacity: int = 64,
                 poll_interval_s: float = 0.5, rpc_timeout_s: float = 5.0,
                 on_change: Callable[[WorkerState], None] | None = None,
                 on_health: Callable[[WorkerState], None] | None = None,
                 stall_timeout_s: float = 120.0) -> None:
        self.workers = {r.worker_id: WorkerState(r, capacity) for r in refs}
        self._cluster_secret = cluster_secret  # every call to a worker carries it
        self.poll_interval_s = poll_interval_s
        self.rpc_timeout_s = rpc_timeout_s
        # a worker whose engine loop is this long in one step is down (its requests go
        # elsewhere); twice this long, its ref restarts it (a Ray actor: a new incarnation)
        self.stall_timeout_s = stall_timeout_s
        self.on_change = on_change  # a worker came back as a new incarnation (forget its cache)
        self.on_health = on_health  # after each poll of a worker (metrics)
        self._changed = asyncio.Event()  # replaced on each notify (see changed_event)
        self._task: asyncio.Task | None = None
        self._intro_lock = asyncio.Lock()

    # -- views ---------------------------------------------------------------------------
    def by_role(self, *roles: str) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.role in roles]

    def usable(self, *roles: str) -> list[WorkerState]:
        return [w for w in self.by_role(*roles) if w.usable]

    def release(self, w: WorkerState) -> None:
        w.unreserve()
        self._notify()

    def changed_event(self) -> asyncio.Event:
        """Set at the next change (capacity freed, worker back). Take it before checking the
        pool, then wait on it: a change between the check and the wait is not lost."""
        return self._changed

    def _notify(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self, deadline_s: float = 600.0,
                    progress: Callable[[int, int], None] | None = None) -> None:
        """Connect to every worker (waiting for it to come up), introduce peers, poll once."""
        end = time.monotonic() + deadline_s
        pending = set(self.workers)
        while pending:
            for wid in list(pending):
                w = self.workers[wid]
                if await self._refresh(w, timeout_s=max(0.1, min(5.0, end - time.monotonic()))):
                    pending.discard(wid)
                    if progress:
                        progress(len(self.workers) - len(pending), len(self.workers))
            if pending and time.monotonic() > end:
                raise TimeoutError(f"workers not ready within {deadline_s:.0f} s: {sorted(pending)}")
            if pending:
                await asyncio.sleep(0.2)
        for d in self.by_role("decode"):
            for p in self.by_role("prefill"):
                await self.ensure_peer(p, d)
        self._task = asyncio.create_task(self._poll_forever(), name="pool-poll")

    async def close(self, shutdown_workers: bool = False, timeout_s: float = 10.0) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if shutdown_workers:
            await asyncio.gather(*(asyncio.wait_for(w.ref.shutdown(), timeout_s)
                                   for w in self.workers.values()), return_exceptions=True)
        for w in self.workers.values():
            if w.channel is not None:
                await w.channel.close()

    # -- connect / re-wire -----------------------------------------------------------------
    async def _refresh(self, w: WorkerState, timeout_s: float) -> bool:
        """Re-read endpoints; reconnect on a new incarnation; close the breaker on good health."""
        try:
            ep = await asyncio.wait_for(w.ref.endpoints(), timeout_s)
        except WorkerStartFailed:
            raise  # it would fail again: startup ends (start's caller says why)
        except Exception as e:  # noqa: BLE001 - actor restarting or dead: stay down, probe later
            log.info("worker %s: endpoints unavailable: %r", w.worker_id, e)
            w.stall.unanswered(process_lives=False)
            if self.on_health:
                self.on_health(w)
            return False
        if ep.get("incarnation") != w.incarnation or ep.get("grpc_address") != \
                w.endpoints.get("grpc_address") or w.channel is None:
            await self._connect(w, ep)
        return await self.poll(w)

    async def _connect(self, w: WorkerState, ep: dict) -> None:
        old = w.channel
        w.endpoints, w.incarnation = ep, ep.get("incarnation", "")
        w.channel = make_aio_channel(ep["grpc_address"], self._cluster_secret)
        w.stub = pbg.WorkerStub(w.channel)
        w.peers.clear()  # a new decode incarnation knows no peers
        w.refused.clear()
        w.retry_peer_at.clear()
        w.peer_failures.clear()
        w.stall.clear()  # a new incarnation is not the one that stalled
        if old is not None:
            await old.close()
            log.warning("worker %s rejoined as incarnation %s at %s", w.worker_id,
                        w.incarnation, ep["grpc_address"])
            if self.on_change:
                self.on_change(w)
        if w.role == "prefill":  # decode workers learn the new incarnation lazily + here
            for d in self.by_role("decode"):
                d.peers = {pair for pair in d.peers if pair[0] != w.worker_id}
        self._notify()

    async def ensure_peer(self, p: WorkerState, d: WorkerState) -> bool:
        """Introduce prefill worker p to decode worker d unless d already accepted this incarnation."""
        key = (p.worker_id, p.incarnation)
        if key in d.peers:
            return True
        if not d.may_pair(p, time.monotonic()) or p.stub is None or d.stub is None:
            return False
        async with self._intro_lock:
            if key in d.peers:
                return True
            try:
                info = await p.stub.GetPeerInfo(pb.GetPeerInfoRequest(), timeout=self.rpc_timeout_s)
                if info.incarnation != p.incarnation:  # restarted under us: re-read endpoints
                    return False
                reply = await d.stub.AddPeer(info, timeout=ADD_PEER_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:  # a slow or failed warm-up too: may pass
                _back_off(p, d, f"introduction failed: {e.code().name}: {e.details()}")
                return False
            if not reply.accepted and reply.retryable:  # e.g. a failed warm-up read
                _back_off(p, d, reply.reason)
                return False
            if not reply.accepted:  # incompatible pair (ANCHORS #8): never route across it
                log.error("decode %s refused prefill %s: %s", d.worker_id, p.worker_id, reply.reason)
                d.refused[key] = reply.reason
                return False
            d.retry_peer_at.pop(key, None)
            d.peer_failures.pop(key, None)
            d.peers.add(key)
            return True

    # -- health --------------------------------------------------------------------------
    async def poll(self, w: WorkerState) -> bool:
        if w.stub is None:
            return False
        try:
            h = await w.stub.Health(pb.HealthRequest(), timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            await self._health_failed(w, e.code())
            return False
        if h.incarnation and h.incarnation != w.incarnation:
            w.breaker.failure(hard=True)  # a different process answers: re-read endpoints
            return False
        # "busy" (or "draining" with loop_busy_s): the loop is inside one step and the
        # other fields are its last snapshot; busy under stall_timeout_s changes nothing
        w.health = h
        w.stall.answered(h.loop_busy_s)
        if h.loop_busy_s == 0:  # came round: a fresh snapshot, which counts reservations
            w._pending_blocks = 0
            if w.stall.stalled:
                log.warning("worker %s: its engine loop came round again", w.worker_id)
            w.stall.clear()
        if h.status == "ok":
            was_open = w.breaker.open
            w.breaker.probe_ok()
            if was_open:
                self._notify()
        elif w.stall.stuck_s >= self.stall_timeout_s:
            await self._stalled(w)
        if self.on_health:
            self.on_health(w)
        return h.status == "ok"

    async def _stalled(self, w: WorkerState) -> None:
        """w has been stuck past stall_timeout_s (router/stall.py): down now, its calls
        cancelled (their watches wait on w.stall.event); past twice that, restarted by its
        ref where it can be."""
        if w.stall.mark():
            log.error("worker %s stalled: stuck in one step (or its Health unanswered) for "
                      "%.0f s (--stall-timeout %g s); its requests go to other workers",
                      w.worker_id, w.stall.stuck_s, self.stall_timeout_s)
        if not w.breaker.open:
            w.breaker.failure(hard=True)
            self._notify()
        if w.stall.stuck_s < 2 * self.stall_timeout_s or w.stall.restarted:
            return
        try:
            restarted = await w.ref.restart()
        except Exception:  # noqa: BLE001 - logged; the next probe tries again
            log.exception("worker %s: restarting it failed", w.worker_id)
            return
        w.stall.restarted = True
        log.error("worker %s: still stuck after %.0f s: %s", w.worker_id, w.stall.stuck_s,
                  "restarted" if restarted else "stays down until it comes round (its ref "
                  "cannot restart it: not a Ray worker, or its restarts are spent)")

    async def _health_failed(self, w: WorkerState, code: grpc.StatusCode) -> None:
        hard = code in HARD_CODES
        lives = not hard and await _safe_alive(w.ref) is True
        w.stall.unanswered(process_lives=lives)
        if not lives:
            self.report_failure(w, code)
        elif w.stall.stuck_s >= self.stall_timeout_s:  # no thread answers it, for this long
            await self._stalled(w)
        # else busy, not dead: its process answers Ray; keep routing to it
        if self.on_health:
            self.on_health(w)

    def report_served(self, w: WorkerState) -> None:
        """A request's call on `w` ended well (its prefill, or its decode stream)."""
        w.breaker.served()

    def report_failure(self, w: WorkerState, code: grpc.StatusCode) -> None:
        """A worker-side failure (never a client error) seen by a request or a poll."""
        if code in NOT_FAULTS:
            return
        was_open = w.breaker.open
        w.breaker.failure(hard=code in HARD_CODES)
        if w.breaker.open and not was_open:
            log.warning("worker %s marked down (%s)", w.worker_id, code.name)

    async def _poll_forever(self) -> None:
        while True:
            started = time.monotonic()
            await asyncio.gather(*(self._poll_one(w) for w in self.workers.values()),
                                 return_exceptions=True)
            await asyncio.sleep(max(0.0, self.poll_interval_s - (time.monotonic() - started)))

    async def _poll_one(self, w: WorkerState) -> None:
        if w.breaker.open:
            if w.breaker.probe_due():
                due = w.breaker.retry_at
                # still down, and the probe's own path did not count it: back off further
                if not await self._refresh(w, timeout_s=10.0) and w.breaker.retry_at == due:
                    w.breaker.failure(hard=True)
        else:
            await self.poll(w)
        if w.role == "decode" and not w.breaker.open:
            for p in self.by_role("prefill"):
                if not p.breaker.open:
                    await self.ensure_peer(p, w)


def _back_off(p: WorkerState, d: WorkerState, why: str) -> None:
    """d may not pair with p for a while: PEER_RETRY_S, doubling with each failure in a row
    up to PEER_RETRY_MAX_S (requests meanwhile pair elsewhere or run decode-only)."""
    key = (p.worker_id, p.incarnation)
    n = d.peer_failures[key] = d.peer_failures.get(key, 0) + 1
    wait = min(PEER_RETRY_MAX_S, PEER_RETRY_S * 2 ** (n - 1))
    d.retry_peer_at[key] = time.monotonic() + wait
    log.warning("decode %s cannot pair with prefill %s for now (again in %.0f s): %s",
                d.worker_id, p.worker_id, wait, why)


async def _safe_alive(ref: WorkerRef) -> bool | None:
    try:
        return await asyncio.wait_for(ref.alive(), 5.0)
    except Exception:  # noqa: BLE001 - dead or restarting
        return False
