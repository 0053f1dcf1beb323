"""Router metrics: vLLM's names with the `pdserve:` prefix, labelled role="router", worker=<id>.

Per-stage histograms split each request's end-to-end latency into router queue, prefill
queue, prefill, KV transfer, decode queue and decode, so the stages add up to e2e
(ANCHORS #10). The router also re-exports what its health polls see of each worker
(labelled with that worker's role and id), so one scrape shows the whole pool.
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

P = "pdserve:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LABELS = ("role", "worker")
STAGES = ("router_queue", "prefill_queue", "prefill", "kv_transfer", "decode_queue", "decode")
# label values exported at zero from startup, so dashboards and alerts see every series before
# the first event (dispatch.Retry reasons; errors.RouterError codes, "internal" for code=None)
RETRY_REASONS = ("prefill", "peer", "kv_transfer", "decode", "decode_full", "in_use", "stalled")
FAILURE_CODES = ("internal", "overloaded", "draining", "worker_unavailable", "no_healthy_worker",
                 "kv_transfer_failed", "request_timeout", "invalid_request")
FINISH_REASONS = ("stop", "length")
CONTINUATION_RESULTS = ("ok", "failed")  # of streams continued after their decode worker failed


@dataclass
class StageTimes:
    """Seconds one request spent in each stage (router-side view, worker reports folded in)."""

    router_queue: float = 0.0
    prefill_queue: float = 0.0
    prefill: float = 0.0
    kv_transfer: float = 0.0
    decode_queue: float = 0.0
    decode: float = 0.0


class RouterMetrics:
    def __init__(self, router_id: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.labels = {"role": "router", "worker": router_id}
        reg = self.registry

        def h(name: str, doc: str) -> Histogram:
            return Histogram(P + name, doc, LABELS, buckets=LATENCY_BUCKETS, registry=reg)

        def c(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(P + name, doc, LABELS + extra, registry=reg)

        def g(name: str, doc: str) -> Gauge:
            return Gauge(P + name, doc, LABELS, registry=reg)

        self.ttft = h("time_to_first_token_seconds", "arrival at the router to first token sent")
        self.itl = h("inter_token_latency_seconds", "time between tokens sent to the client")
        self.e2e = h("e2e_request_latency_seconds", "arrival at the router to last token sent")
        self.queue_time = h("request_queue_time_seconds", "arrival to dispatch to a worker")
        self.stages = {s: h(f"stage_{s}_seconds", f"time a request spent in stage {s}")
                       for s in STAGES}
        self.retries = c("router_retries", "requests re-dispatched after a worker failure",
                         ("reason",))
        self.continuations = c(
            "stream_continuations", "streams whose decode worker failed after output started, "
            "continued on another decode worker: ok = finished there, failed = ended with an "
            "error (no other decode worker, retry budget spent, or that one failed too)",
            ("result",))
        self.fallbacks = c("router_prefill_fallbacks",
                           "requests prefilled on the decode worker because no prefill worker was usable")
        self.success = c("request_success", "finished requests", ("finished_reason",))
        self.failures = c("request_failures", "requests that ended with an error", ("code",))
        self.prompt_tokens = c("prompt_tokens", "prompt tokens of finished requests")
        self.generation_tokens = c("generation_tokens", "tokens sent to clients")
        self.running = g("num_requests_running", "requests dispatched to workers")
        self.waiting = g("num_requests_waiting", "admitted requests not yet dispatched")
        for gauge in (self.running, self.waiting):
            gauge.labels(**self.labels).set(0)
        self._precreate()
        # the children observed per token, bound once (labels() costs a few us a call; the
        # router streams ~10K tokens/s per core: bench/lab/router_overhead.py)
        lb = self.labels
        self._ttft, self._itl = self.ttft.labels(**lb), self.itl.labels(**lb)
        self._generated = self.generation_tokens.labels(**lb)
        # the pool as the router's health polls see it (labels: the worker's role and id)
        self.worker_up = Gauge(P + "router_worker_up", "1 when the worker's breaker is closed",
                               LABELS, registry=reg)
        self.kv_usage = Gauge(P + "kv_cache_usage_perc", "fraction of KV blocks in use (0-1)",
                              LABELS, registry=reg)
        self.worker_pinned = Gauge(P + "router_worker_pinned_blocks",
                                   "blocks a prefill worker holds for readers", LABELS, registry=reg)
        self.loop_busy = Gauge(P + "router_worker_loop_busy_seconds",
                               "how long the worker's engine loop has been in its current step "
                               "(0 for one that comes round; past --stall-timeout: down)",
                               LABELS, registry=reg)

    def _precreate(self) -> None:
        """Create every child at zero: a labelled metric exports no sample until it has one."""
        lb = self.labels
        for m in (self.ttft, self.itl, self.e2e, self.queue_time, *self.stages.values(),
                  self.fallbacks, self.prompt_tokens, self.generation_tokens):
            m.labels(**lb)
        for reason in RETRY_REASONS:
            self.retries.labels(**lb, reason=reason)
        for code in FAILURE_CODES:
            self.failures.labels(**lb, code=code)
        for reason in FINISH_REASONS:
            self.success.labels(**lb, finished_reason=reason)
        for result in CONTINUATION_RESULTS:
            self.continuations.labels(**lb, result=result)

    def tokens_sent(self, n: int, gap_s: float, first: bool) -> None:
        """n tokens sent to a client, gap_s after its previous ones (or after its arrival,
        the first): TTFT, or n inter-token latencies spreading a multi-token step's gap."""
        if first:
            self._ttft.observe(gap_s)
        else:
            for _ in range(n):
                self._itl.observe(gap_s / n)
        self._generated.inc(n)

    def observe_stages(self, st: StageTimes) -> None:
        for name in STAGES:
            self.stages[name].labels(**self.labels).observe(max(0.0, getattr(st, name)))

    def retry(self, reason: str) -> None:
        self.retries.labels(**self.labels, reason=reason).inc()

    def continuation(self, result: str) -> None:
        self.continuations.labels(**self.labels, result=result).inc()

    def finished(self, reason: str, prompt_tokens: int) -> None:
        self.success.labels(**self.labels, finished_reason=reason).inc()
        self.prompt_tokens.labels(**self.labels).inc(prompt_tokens)

    def failed(self, code: str | None) -> None:
        self.failures.labels(**self.labels, code=code or "internal").inc()

    def worker_seen(self, role: str, worker_id: str, up: bool, kv_usage: float | None,
                    pinned: int | None, loop_busy_s: float | None = None) -> None:
        lb = {"role": role, "worker": worker_id}
        self.worker_up.labels(**lb).set(1 if up else 0)
        if loop_busy_s is not None:
            self.loop_busy.labels(**lb).set(loop_busy_s)
        if kv_usage is not None:
            self.kv_usage.labels(**lb).set(kv_usage)
        if pinned is not None:
            self.worker_pinned.labels(**lb).set(pinned)
