"""The request pipeline shared by the HTTP and gRPC faces.

    admit (bounded in-flight count: 429 when full, 503 while draining)
      -> check the prompt fits the context and the decode KV pool (400 otherwise)
      -> fan out n completions (distinct seeds derived from the request's seed)
      -> each runs through dispatch.ChoiceRun (route, prefill, decode, retries)
      -> their deltas merge into one async stream

Closing the stream early (client gone) cancels every completion's task; the tasks' own
cleanup cancels Decode streams and aborts prefills, so blocks are freed on both sides.
Callers must close the generator (`contextlib.aclosing`) rather than drop it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass

from pdserve.engine.core.config import SCHEDULING_POLICIES
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.router.admission import FairGate, completions_problem, timeout_problem
from pdserve.router.deltas import Delta, coalesced
from pdserve.router.dispatch import TRACE_LOG, ChoiceRun
from pdserve.router.errors import BadRequest, Draining, Overloaded, RequestTimeout, RouterError
from pdserve.router.frontend import Frontend
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import DecodePolicy, PrefillPolicy
from pdserve.router.pool import WorkerPool

SEED_STRIDE = 1_000_003  # choice i of a seeded request samples with seed + i * stride


@dataclass(frozen=True)
class RouterConfig:
    block_size: int = 16
    routing: str = "prefix_aware"  # round_robin | least_loaded | prefix_aware
    disagg_threshold: int = 0  # prompts with fewer uncached tokens prefill on D; 0 = never
    max_inflight: int = 1024  # admitted completions (prompts x n per request); beyond -> 429
    retry_budget: int = 2  # re-dispatches per completion after worker failures
    request_timeout_s: float = 600.0  # default deadline of a request
    prefill_timeout_s: float = 60.0  # one prefill attempt, before retrying elsewhere
    # a worker whose engine loop is this long in one step is down (router/pool.py _stalled)
    stall_timeout_s: float = 120.0
    queue_timeout_s: float = 30.0  # give up waiting for a healthy decode worker after this
    retry_after_s: int = 1  # Retry-After on 429 / 503
    log_requests: bool = False  # one JSON line per finished completion (router/deltas.py Trace)
    router_id: str = "router-0"
    # the workers' scheduling policy: "priority" lets requests carry vLLM's priority, which
    # also orders the router's queue (router/admission.py FairGate); "fcfs" refuses it
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        for name in ("block_size", "max_inflight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.retry_budget < 0 or self.disagg_threshold < 0:
            raise ValueError("retry_budget, disagg_threshold: must be >= 0")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy: must be one of {SCHEDULING_POLICIES}, got "
                             f"{self.scheduling_policy!r}")
        for name in ("prefill_timeout_s", "stall_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0 seconds, got {getattr(self, name)}")


@dataclass
class Job:
    """One validated request: what both faces hand to the core. Completion k of prompt j has
    index j * n + k (OpenAI's order for batched prompts)."""

    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    timeout_s: float | None = None
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    prompt_param: str = "prompt"  # what an over-long prompt's error names ("messages": chat)


class RouterCore:
    def __init__(self, pool: WorkerPool, frontend: Frontend, cfg: RouterConfig,
                 metrics: RouterMetrics | None = None) -> None:
        self.pool, self.frontend, self.cfg = pool, frontend, cfg
        self.metrics = metrics or RouterMetrics(cfg.router_id)
        self.prefill_policy = PrefillPolicy(cfg.routing)
        self.decode_policy = DecodePolicy(cfg.routing)
        self.inflight = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._background: set[asyncio.Task] = set()
        self._outs: set[asyncio.Queue] = set()  # each request's delta queue (cut_all)
        # completions take turns for the decode workers' stream slots, request by request
        self.gate = FairGate(lambda: sum(w.capacity for w in pool.by_role("decode", "colocated")))
        if cfg.log_requests:  # its INFO lines pass whatever the root level (--log-level)
            TRACE_LOG.setLevel(logging.INFO)

    # -- admission -----------------------------------------------------------------------
    def _admit(self, job: Job) -> int:
        """Admit `job` or raise (400 too many completions or a bad deadline, 503 draining,
        429 full). Returns its cost: one unit per completion (router/admission.py)."""
        cost = len(job.prompts) * job.params.n
        too_many = completions_problem(len(job.prompts), job.params.n)
        if too_many:
            raise BadRequest(too_many[1], param=too_many[0])
        bad_deadline = timeout_problem(job.timeout_s)
        if bad_deadline:
            raise BadRequest(bad_deadline, param="timeout_s")
        if job.params.priority and self.cfg.scheduling_policy != "priority":
            raise BadRequest(f"priority: {job.params.priority}: this server serves first come, "
                             f"first served (start it with --scheduling-policy priority)",
                             param="priority")
        if self.draining:
            raise Draining("server is draining; retry on another instance",
                           retry_after_s=self.cfg.retry_after_s)
        if self.inflight + cost > self.cfg.max_inflight:
            raise Overloaded(f"server is at its limit of {self.cfg.max_inflight} completions in "
                             f"flight ({self.inflight} now, this request asks for {cost}); "
                             "retry later", retry_after_s=self.cfg.retry_after_s)
        self.inflight += cost
        self._idle.clear()
        return cost

    def _leave(self, cost: int) -> None:
        self.inflight -= cost
        if self.inflight == 0:
            self._idle.set()

    def start_drain(self) -> None:
        self.draining = True

    def cut_all(self) -> int:
        """End every request in flight with an error (the drain deadline passed): each
        stream sends what it has, then an error chunk and [DONE]. Returns how many."""
        for out in self._outs:
            out.put_nowait(Draining("the server stopped at its drain deadline before this "
                                    "request finished; retry on another instance"))
        return len(self._outs)

    def count_failure(self, e: RouterError) -> None:
        """Count a request's error once, wherever it was raised (parsing, admission or
        dispatch); client errors (4xx but 429: 404, 413, ...) are the caller's, never an
        outage: all labelled code="invalid_request", which error-rate alerts leave out."""
        if not e.counted:
            e.counted = True
            client = e.status < 500 and e.status != 429
            self.metrics.failed("invalid_request" if client else e.code)

    async def wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    def status(self) -> str:
        """What both faces' health says: "draining"; "ok" with every worker up; "degraded"
        while some decode worker serves; else "unavailable" (nothing can finish a request)."""
        ws = list(self.pool.workers.values())
        if self.draining:
            return "draining"
        if ws and all(w.up for w in ws):
            return "ok"
        serving = any(w.up for w in ws if w.role in ("decode", "colocated"))
        return "degraded" if serving else "unavailable"

    def pool_tokens(self) -> int | None:
        """Tokens the largest decode-capable worker's KV pool holds (None before any poll)."""
        totals = [w.total_blocks for w in self.pool.by_role("decode", "colocated")]
        best = max(totals, default=0)
        return best * self.cfg.block_size if best else None

    def max_tokens_default(self, prompt_len: int) -> int:
        """OpenAI's "as many as fit": the rest of the context (or of the KV pool)."""
        limit = min(self.frontend.max_model_len, self.pool_tokens() or self.frontend.max_model_len)
        return max(1, limit - prompt_len)

    def background(self, coro: Coroutine) -> None:
        """Run cleanup that must outlive a cancelled request (aborts on workers)."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- the pipeline --------------------------------------------------------------------
    async def generate(self, job: Job) -> AsyncIterator[Delta]:
        """Deltas of all n completions, interleaved; raises RouterError on failure."""
        cost = self._admit(job)
        tasks: list[asyncio.Task] = []
        out: asyncio.Queue = asyncio.Queue()
        self._outs.add(out)
        try:
            for ids in job.prompts:
                self.frontend.check_length(len(ids), job.params.max_tokens, self.pool_tokens(),
                                           job.prompt_param)
            deadline = job.arrival + (job.timeout_s or self.cfg.request_timeout_s)
            for i, (rid, ids, params) in enumerate(self._fan_out(job)):
                run = ChoiceRun(self, rid, i, ids, params, job.arrival, deadline, out.put_nowait)
                tasks.append(asyncio.create_task(self._run(run, out, job.request_id)))
            async for delta in self._merge(out, len(tasks), job):
                yield delta
        except RouterError as e:
            self.count_failure(e)
            raise
        finally:
            # synchronous first: a cancelled caller may not get to run the await below
            for t in tasks:
                t.cancel()
            self._outs.discard(out)
            self._leave(cost)
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

    def _fan_out(self, job: Job) -> list[tuple[str, list[int], SamplingParams]]:
        """(worker request id, prompt, params) per completion; seeds differ per completion."""
        p, total = job.params, len(job.prompts) * job.params.n
        if total == 1:
            return [(job.request_id, job.prompts[0], p)]
        out = []
        for j, ids in enumerate(job.prompts):
            for k in range(p.n):
                seed = None if p.seed is None else (p.seed + k * SEED_STRIDE) % (1 << 63)
                out.append((f"{job.request_id}-{j * p.n + k}", ids,
                            dataclasses.replace(p, n=1, seed=seed)))
        return out

    async def _run(self, run: ChoiceRun, out: asyncio.Queue, key: str) -> None:
        try:
            await self._take_turn(run, key)
            try:
                await run.run()
            finally:
                self.gate.release()
            out.put_nowait(_DONE)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            out.put_nowait(e)

    async def _take_turn(self, run: ChoiceRun, key: str) -> None:
        """The completion's decode stream slot (FairGate): waited for in the router queue,
        counted as waiting, and never past the request's deadline (ANCHORS #1)."""
        run.set_waiting(True)
        try:
            async with asyncio.timeout(max(0.0, run.remaining())):
                await self.gate.acquire(key, run.params.priority)
        except TimeoutError:
            raise RequestTimeout(f"request {run.rid}: no decode stream slot came free before "
                                 "the deadline (all decode workers at capacity)") from None
        finally:
            run.set_waiting(False)

    async def _merge(self, out: asyncio.Queue, total: int, job: Job) -> AsyncIterator[Delta]:
        """Deltas as the completions produce them, until all `total` have ended; what queued
        while the caller was busy comes coalesced (router/deltas.py coalesced)."""
        done = 0
        while done < total:
            items = [await out.get()]
            while not out.empty():
                items.append(out.get_nowait())
            for item in coalesced(items):
                if item is _DONE:
                    done += 1
                    continue
                if isinstance(item, BaseException):
                    if isinstance(item, RouterError):
                        raise item
                    raise RouterError(f"internal error: {item!r}") from item
                assert isinstance(item, Delta)
                if item.finish_reason:
                    # prompt tokens once per prompt, not once per completion
                    n = job.params.n
                    self.metrics.finished(item.finish_reason, len(job.prompts[item.index // n])
                                          if item.index % n == 0 else 0)
                yield item


_DONE = object()


async def collect(deltas: AsyncIterator[Delta], n: int) -> list[Delta]:
    """Non-streaming: fold each index's deltas into one (text, tokens, logprobs, finish)."""
    acc = [Delta(i) for i in range(n)]
    async for d in deltas:
        a = acc[d.index]
        a.text += d.text
        a.token_ids += d.token_ids
        a.logprobs += d.logprobs
        if d.prompt_logprobs is not None:
            a.prompt_logprobs = d.prompt_logprobs
        if d.finish_reason:
            a.finish_reason, a.completion_tokens, a.cached_tokens, a.stop_reason = \
                d.finish_reason, d.completion_tokens, d.cached_tokens, d.stop_reason
    return acc
