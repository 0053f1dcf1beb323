"""How the pool reaches a worker: a `WorkerRef` says where the worker's gRPC service
listens, under which incarnation, and whether its process lives. RayWorkerRef (production)
also relaunches a dead worker actor with backoff; StaticWorkerRef is a fixed address
(tests, workers started outside Ray)."""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)


class WorkerStartFailed(RuntimeError):
    """A worker that never came up failed in its constructor (a model its process cannot
    load, a bad device): launching it again would fail the same way, so startup ends here."""


class WorkerRef(Protocol):
    worker_id: str
    role: str

    async def endpoints(self) -> dict: ...  # grpc_address, incarnation, metrics_address, ...

    async def alive(self) -> bool | None: ...  # process liveness apart from gRPC (None = unknown)

    async def shutdown(self) -> None: ...

    async def restart(self) -> bool: ...  # end a stuck process, to be relaunched (False: can't)

    def lifecycle(self) -> dict: ...  # restarts so far, next restart in s, gave up (for /health)


class StaticWorkerRef:
    """A worker at a fixed address (tests, or workers started outside Ray)."""

    def __init__(self, worker_id: str, role: str, grpc_address: str, incarnation: str = "",
                 metrics_address: str = "") -> None:
        self.worker_id, self.role = worker_id, role
        self.info = {"worker_id": worker_id, "role": role, "grpc_address": grpc_address,
                     "incarnation": incarnation, "metrics_address": metrics_address}

    async def endpoints(self) -> dict:
        return dict(self.info)

    async def alive(self) -> bool | None:
        return None

    async def shutdown(self) -> None:
        return None

    async def restart(self) -> bool:
        return False  # not ours to start: a stalled one stays down until it comes round

    def lifecycle(self) -> dict:
        return {}


class RayWorkerRef:
    """A worker actor (worker/actor.py): Ray tells where it listens and whether it lives.

    Restarts are ours, not Ray's (actors run with max_restarts=0): when the actor has died,
    the next endpoints() call launches a fresh one, `launch(generation=n)` for the nth
    relaunch, after a backoff that
    doubles from `backoff_s` up to `max_backoff_s` with each restart in a row (it starts over
    once a worker has served for `stable_s`). So a pool that lost every worker keeps coming
    back, however often it dies; `max_restarts` (-1 = no limit) can end that. A worker whose
    very first launch fails in its constructor is not relaunched: WorkerStartFailed.
    """

    def __init__(self, actor, worker_id: str, role: str,
                 launch: Callable[..., object] | None = None,
                 max_restarts: int = -1, backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 stable_s: float = 60.0,
                 release: Callable[[int], None] | None = None) -> None:
        self.actor, self.worker_id, self.role = actor, worker_id, role
        self._launch, self.max_restarts = launch, max_restarts
        self._release = release  # after shutdown: what generations 0..n-1 still hold
        self._backoff = (backoff_s, max_backoff_s, stable_s)
        self.restarts = 0
        self._in_a_row = 0
        self._next_at = 0.0  # monotonic time of the next allowed launch
        self._up_since: float | None = None
        self._ever_up = False

    async def endpoints(self) -> dict:
        import ray

        try:
            ep = await self.actor.endpoints.remote()
        except ray.exceptions.ActorDiedError as e:
            self._up_since = None
            if not self._ever_up and getattr(e, "actor_init_failed", False):
                raise WorkerStartFailed(f"worker {self.worker_id} failed to start: "
                                        f"{_last_line(str(e))}") from e
            self._maybe_relaunch()
            raise
        self._ever_up = True
        now = time.monotonic()
        self._up_since = self._up_since or now
        if now - self._up_since >= self._backoff[2]:
            self._in_a_row = 0  # it served for a while: the next crash starts a new series
        return ep

    def _maybe_relaunch(self) -> None:
        import ray

        if self._launch is None or self.gave_up or time.monotonic() < self._next_at:
            return
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)
        self.restarts += 1
        self.actor = self._launch(generation=self.restarts)
        self._in_a_row += 1
        base, cap, _ = self._backoff
        self._next_at = time.monotonic() + min(cap, base * 2 ** (self._in_a_row - 1))
        log.warning("worker %s died: launched a new one (restart %d)", self.worker_id,
                    self.restarts)

    @property
    def gave_up(self) -> bool:
        return 0 <= self.max_restarts <= self.restarts

    def lifecycle(self) -> dict:
        wait = max(0.0, self._next_at - time.monotonic())
        return {"restarts": self.restarts, "next_restart_in_s": round(wait, 1),
                "gave_up": self.gave_up}

    async def alive(self) -> bool | None:
        await self.actor.ping.remote()
        return True

    async def shutdown(self) -> None:
        """Stop the worker, end its actor, then `release(generations)`: a TP worker's
        placement groups, which the actor's own shutdown removes on a timer that the kill
        cuts short (the group would hold its GPUs until this job ends)."""
        import ray

        try:
            await self.actor.shutdown.remote()
        finally:
            ray.kill(self.actor, no_restart=True)
            if self._release is not None:
                self._release(self.restarts + 1)

    async def restart(self) -> bool:
        """Kill the actor (stuck in a step, it would not stop when asked): the next
        endpoints() call finds it dead and launches a new one, as after a crash."""
        import ray

        if self._launch is None or self.gave_up:
            return False
        ray.kill(self.actor, no_restart=True)
        return True


def _last_line(text: str) -> str:
    """The exception line of a Ray error's text (its traceback comes first)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else text
