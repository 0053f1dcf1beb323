"""Admission: what one request may cost, and fair turns at the workers.

A request costs one unit per completion (prompts x n). Both faces (HTTP and gRPC) go
through RouterCore.generate, which refuses a request above MAX_COMPLETIONS (400 /
INVALID_ARGUMENT, naming the field) and counts its completions against --max-inflight
(429 beyond). A deadline must lie in (0, MAX_TIMEOUT_S].

Admitted completions then take turns for the workers' stream slots through a FairGate:
round-robin across requests, so 200 completions of one request take turns with the single
completion of the next, rather than queueing it behind all 200. The documented bound: a
request waiting at the gate is granted a slot within the next R slot releases, where R is
the number of requests waiting at the gate ahead of it (at most --max-inflight); how many
completions those requests carry does not matter.

With --scheduling-policy priority, vLLM's request priority orders the gate first: a free
slot goes to the lowest priority value waiting, round-robin among the requests of that
value (the bound above holds within a priority). Under fcfs every request has priority 0.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import math
from collections.abc import AsyncIterator, Callable, Hashable

MAX_COMPLETIONS = 256  # prompts x n of one request
MAX_TIMEOUT_S = 86_400.0  # one day: a longer deadline is a bug on the caller's side


def completions_problem(num_prompts: int, n: int) -> tuple[str, str] | None:
    """(field, message) when one request asks for more completions than MAX_COMPLETIONS."""
    total = num_prompts * n
    if total <= MAX_COMPLETIONS:
        return None
    field = "n" if num_prompts == 1 else "prompt"
    return field, (f"{field}: {num_prompts} prompt(s) x n={n} = {total} completions; one "
                   f"request may ask for at most {MAX_COMPLETIONS}")


def timeout_problem(timeout_s: float | None) -> str | None:
    """A message when a request's deadline (seconds; None = the server's default) is not sane."""
    if timeout_s is None:
        return None
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s)
            and 0 < timeout_s <= MAX_TIMEOUT_S):
        return f"timeout_s: must be in (0, {MAX_TIMEOUT_S:.0f}] seconds, got {timeout_s!r}"
    return None


class FairGate:
    """Slots for running completions, granted round-robin across requests (keys).

    `slots()` is read at each grant (the pool's decode capacity, which changes as workers
    come and go). A completion holds its slot for its whole run, retries included.
    """

    def __init__(self, slots: Callable[[], int]) -> None:
        self._slots = slots
        self._held = 0
        # priority -> (key -> its waiters in arrival order; the dict's order is the
        # round-robin order among that priority's requests)
        self._levels: dict[int, collections.OrderedDict[Hashable,
                                                        collections.deque[asyncio.Future]]] = {}

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for level in self._levels.values() for q in level.values())

    @contextlib.asynccontextmanager
    async def slot(self, key: Hashable, priority: int = 0) -> AsyncIterator[None]:
        await self.acquire(key, priority)
        try:
            yield
        finally:
            self.release()

    def release(self) -> None:
        """Give back a slot that acquire() granted."""
        self._held -= 1
        self._grant()

    async def acquire(self, key: Hashable, priority: int = 0) -> None:
        """Wait for key's turn (among the requests of its priority, after every lower
        priority value) and a free slot. Cancellable at any point (a timeout around it
        included): a slot granted as the waiter was cancelled goes to the next."""
        if not self._levels and self._held < max(1, self._slots()):
            self._held += 1
            return
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        level = self._levels.setdefault(priority, collections.OrderedDict())
        level.setdefault(key, collections.deque()).append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted as we were cancelled: pass it on
                self._held -= 1
                self._grant()
            else:
                self._forget(key, priority, fut)
            raise

    def _grant(self) -> None:
        while self._levels and self._held < max(1, self._slots()):
            priority = min(self._levels)
            waiting = self._levels[priority]
            key, queue = next(iter(waiting.items()))
            fut = queue.popleft()
            del waiting[key]
            if queue:  # its next completion waits for the key's next turn, at the back
                waiting[key] = queue
            if not waiting:
                del self._levels[priority]
            if not fut.done():
                self._held += 1
                fut.set_result(None)

    def _forget(self, key: Hashable, priority: int, fut: asyncio.Future) -> None:
        waiting = self._levels.get(priority, {})
        queue = waiting.get(key)
        if queue is None:
            return
        with contextlib.suppress(ValueError):
            queue.remove(fut)
        if not queue:
            del waiting[key]
        if not waiting:
            self._levels.pop(priority, None)
