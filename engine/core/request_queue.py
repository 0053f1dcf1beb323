"""The scheduler's waiting queue, one class per scheduling policy (vLLM's
--scheduling-policy), and which running request that policy preempts first:

    fcfs      arrival order. Requests put back (preempted, a failed KV read, siblings that
              waited for their leader) go to the front, in the order given; the most recently
              admitted running request is preempted first.
    priority  SamplingParams.priority order, lower first, then arrival (vLLM's rule). Requests
              put back keep their key; the running request with the largest (priority,
              arrival) is preempted first.

Plain Python, no torch.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from pdserve.engine.core.request import Request


class FCFSQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._q.append(req)

    def put_back(self, reqs: list[Request]) -> None:
        """In front of everything, keeping the given order."""
        self._q.extendleft(reversed(reqs))

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    @staticmethod
    def victim(running: list[Request]) -> Request:
        """running is in admission order: the newest goes first."""
        return running[-1]

    def __len__(self) -> int:
        return len(self._q)

    def __contains__(self, req: object) -> bool:
        return req in self._q

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()  # equal keys: insertion order, and never compares Requests

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, (*_key(req), next(self._seq), req))

    def put_back(self, reqs: list[Request]) -> None:
        for req in reqs:
            self.add(req)

    def peek(self) -> Request:
        return self._heap[0][-1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def remove(self, req: Request) -> None:
        self._heap = [e for e in self._heap if e[-1] is not req]
        heapq.heapify(self._heap)

    @staticmethod
    def victim(running: list[Request]) -> Request:
        return max(reversed(running), key=_key)  # equal keys: the newest admitted

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, req: object) -> bool:
        return any(e[-1] is req for e in self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[-1] for e in sorted(self._heap, key=lambda e: e[:3]))


def _key(req: Request) -> tuple[int, float]:
    return req.sampling_params.priority, req.arrival_time


def make_queue(policy: str) -> FCFSQueue | PriorityQueue:
    """The queue of one of config.SCHEDULING_POLICIES (SchedulerConfig validated it)."""
    return {"fcfs": FCFSQueue, "priority": PriorityQueue}[policy]()
