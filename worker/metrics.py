"""Engine metrics of one worker, vLLM's names with the `pdserve:` prefix.

Each worker owns a CollectorRegistry (several workers may share a process in tests); the
gauges are refreshed from the engine on the loop thread, counters advance from deltas.
Per-request latencies are observed on the loop thread too: a service `track`s a request
when it admits it, and `observe_step` sees every step's outputs before they are published.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from pdserve.engine.core.outputs import RequestOutput
from pdserve.engine.core.request import Request
from pdserve.engine.llm_engine import LLMEngine

P = "pdserve:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LABELS = ("role", "worker")


@dataclass
class _Timeline:
    """One admitted request as this worker sees it (loop thread only)."""

    request: Request  # the engine's object: first_scheduled_time, first_token_time
    arrival: float  # time.monotonic() when its Prefill/Decode RPC reached this worker
    first_emit: float | None = None  # when this worker emitted its first token of it
    last_emit: float | None = None  # when this worker last emitted tokens of it
    tokens: int = 0  # tokens of it this worker emitted


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry, role: str, worker_id: str) -> None:
        self.registry = registry
        self.labels = {"role": role, "worker": worker_id}

        def g(name: str, doc: str) -> Gauge:
            return Gauge(P + name, doc, LABELS, registry=registry)

        def c(name: str, doc: str) -> Counter:
            return Counter(P + name, doc, LABELS, registry=registry)

        def h(name: str, doc: str) -> Histogram:
            return Histogram(P + name, doc, LABELS, buckets=LATENCY_BUCKETS, registry=registry)

        self.running = g("num_requests_running", "requests in the running batch")
        self.waiting = g("num_requests_waiting", "requests waiting to be scheduled")
        self.kv_usage = g("kv_cache_usage_perc", "fraction of KV blocks in use (0-1)")
        self.held = g("num_requests_held", "finished prefills whose blocks wait for a reader")
        self.quarantined = g("kv_quarantined_blocks",
                             "KV blocks taken out of the pool for good: a remote read that "
                             "could not be cancelled may still write them")
        self.prefix_queries = c("prefix_cache_queries", "prompt tokens looked up in the prefix cache")
        self.prefix_hits = c("prefix_cache_hits", "prompt tokens found in the prefix cache")
        self.preemptions = c("num_preemptions", "requests preempted by recompute")
        self.prompt_tokens = c("prompt_tokens", "prompt tokens admitted")
        self.generation_tokens = c("generation_tokens", "tokens generated")
        self.kv_recomputes = c("kv_recompute_fallbacks", "remote KV reads replaced by local prefill")
        self.request_success = Counter(P + "request_success", "finished requests",
                                       LABELS + ("finished_reason",), registry=registry)
        self.queue_time = h("request_queue_time_seconds", "arrival here to first scheduled")
        self.prefill_time = h("request_prefill_time_seconds", "first scheduled to first token")
        self.ttft = h("time_to_first_token_seconds", "arrival at this worker to its first token")
        self.itl = h("inter_token_latency_seconds", "time between output tokens")
        self.e2e = h("e2e_request_latency_seconds", "arrival at this worker to finish")
        self.decode_time = h("request_decode_time_seconds",
                             "this worker's first output token to its last")
        self.tpot = h("request_time_per_output_token_seconds",
                      "per request: decode time / (its output tokens here - 1), 2+ tokens")
        self.kv_transfer_stage = h("stage_kv_transfer_seconds", "decode side: KV read incl. release")
        self.decode_queue_stage = h("stage_decode_queue_seconds",
                                    "decode side: Decode RPC arrival to admission")
        # MTP speculative decoding (vLLM's spec_decode_* names); zero without speculation
        self.spec_drafts = c("spec_decode_num_drafts", "verify events (a request with drafts)")
        self.spec_draft_tokens = c("spec_decode_num_draft_tokens", "draft tokens verified")
        self.spec_accepted = c("spec_decode_num_accepted_tokens", "draft tokens accepted")
        self.spec_accepted_per_pos = Counter(
            P + "spec_decode_num_accepted_tokens_per_pos", "draft tokens accepted by position",
            LABELS + ("position",), registry=registry)
        # every child exported at zero from the start (a labelled metric has no sample before)
        for m in (self.prefix_queries, self.prefix_hits, self.preemptions, self.prompt_tokens,
                  self.generation_tokens, self.kv_recomputes, self.queue_time, self.prefill_time,
                  self.ttft, self.itl, self.e2e, self.decode_time, self.tpot,
                  self.kv_transfer_stage, self.decode_queue_stage,
                  self.spec_drafts, self.spec_draft_tokens, self.spec_accepted):
            m.labels(**self.labels)
        for reason in ("stop", "length"):
            self.request_success.labels(**self.labels, finished_reason=reason)
        self.spec_accepted_per_pos.labels(**self.labels, position="0")
        self._last: dict[str, int] = {}
        self._timelines: dict[str, _Timeline] = {}  # tracked requests, until they finish

    def _delta(self, key: str, value: int, counter: Counter) -> None:
        prev = self._last.get(key, 0)
        if value > prev:
            counter.labels(**self.labels).inc(value - prev)
        self._last[key] = value

    # -- per-request latencies (loop thread) ----------------------------------------------
    def track(self, engine: LLMEngine, arrival: float, request_ids: list[str]) -> None:
        """Follow requests just admitted to `engine` (call in the admitting loop command)."""
        for rid in request_ids:
            req = engine.scheduler.get_request(rid)
            if req is not None:
                self._timelines[rid] = _Timeline(req, arrival)

    def observe_step(self, outputs: list[RequestOutput]) -> None:
        """Observe one engine step's outputs, before they are published to the streams.

        TTFT is arrival -> the first token this worker emits. On a decode worker that got a
        prefilled request, the prefill worker's token never passes a step here, so its TTFT
        runs to the first token it decodes itself (KV read included); its queue time runs to
        that first decode step and its prefill time is that step (vLLM's P/D semantics).
        ITL: a step that emits n tokens at once (speculation) counts its gap n times, each
        gap / n, as the router does: count = tokens, sum = decode time, so the mean is the
        per-token latency and worker and router series compare directly.
        """
        now, lb = time.monotonic(), self.labels
        for out in outputs:
            t = self._timelines.get(out.request_id)
            if t is None:
                continue
            n = len(out.new_token_ids)
            if n and t.last_emit is None:
                self._first_token(t, now)
                t.first_emit = now
            elif n:
                gap = (now - t.last_emit) / n
                for _ in range(n):
                    self.itl.labels(**lb).observe(gap)
            if n:
                t.last_emit = now
                t.tokens += n
            if out.finished:
                del self._timelines[out.request_id]
                self._finished(t, out, now)

    def _finished(self, t: _Timeline, out: RequestOutput, now: float) -> None:
        """e2e, success and, for a request this worker emitted tokens of, vLLM's decode time
        (its first token here to its last) and TPOT (that / (tokens - 1), 2+ tokens)."""
        lb = self.labels
        self.e2e.labels(**lb).observe(now - t.arrival)
        if out.finish_reason in ("stop", "length"):
            self.request_success.labels(**lb, finished_reason=out.finish_reason).inc()
        if t.first_emit is not None and t.last_emit is not None:
            decode = t.last_emit - t.first_emit
            self.decode_time.labels(**lb).observe(decode)
            if t.tokens >= 2:
                self.tpot.labels(**lb).observe(decode / (t.tokens - 1))

    def _first_token(self, t: _Timeline, now: float) -> None:
        lb, req = self.labels, t.request
        scheduled, first = req.first_scheduled_time, req.first_token_time
        self.ttft.labels(**lb).observe(now - t.arrival)
        if scheduled is not None:
            self.queue_time.labels(**lb).observe(max(0.0, scheduled - t.arrival))
            if first is not None:
                self.prefill_time.labels(**lb).observe(max(0.0, first - scheduled))

    def refresh(self, engine: LLMEngine) -> None:
        """Copy the engine's counters into Prometheus (runs on the loop thread)."""
        s, bm = engine.scheduler, engine.scheduler.block_manager
        lb = self.labels
        # aborted requests end without a step output: forget them here
        for rid in [rid for rid, t in self._timelines.items() if t.request.is_finished]:
            del self._timelines[rid]
        self.running.labels(**lb).set(s.num_running)
        self.waiting.labels(**lb).set(s.num_waiting)
        self.kv_usage.labels(**lb).set(bm.usage)
        self.held.labels(**lb).set(len(s.held_request_ids()))
        self.quarantined.labels(**lb).set(s.num_quarantined_blocks)
        self._delta("pq", bm.prefix_cache_queries, self.prefix_queries)
        self._delta("ph", bm.prefix_cache_hits, self.prefix_hits)
        self._delta("pre", s.num_preemptions, self.preemptions)
        self._delta("rec", s.num_kv_recomputes, self.kv_recomputes)
        self._delta("pt", engine.stats.prompt_tokens, self.prompt_tokens)
        self._delta("gt", engine.stats.generation_tokens, self.generation_tokens)
        spec = getattr(engine, "spec_stats", None)
        if spec is not None:
            self._delta("sd", spec.num_drafts, self.spec_drafts)
            self._delta("sdt", spec.num_draft_tokens, self.spec_draft_tokens)
            self._delta("sa", spec.num_accepted_tokens, self.spec_accepted)
            for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
                child = self.spec_accepted_per_pos.labels(**lb, position=str(pos))
                prev = self._last.get(f"sap{pos}", 0)
                if n > prev:
                    child.inc(n - prev)
                self._last[f"sap{pos}"] = n


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> ThreadingHTTPServer:
    """Serve `registry` at http://host:port/metrics (port 0 = pick one) on a daemon thread.

    Always the classic text format (0.0.4), whatever the scraper's Accept header asks:
    prometheus_client's own server answers OpenMetrics to Prometheus, and its OpenMetrics
    writer renames the samples of `pdserve:x` to `pdserve_x` (client_python issue 1177),
    so no dashboard or alert query would match a worker's series. Stop with .shutdown().
    """
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                self.send_error(404, "only /metrics is served here")
                return
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # noqa: A002 - base signature
            pass  # one line per scrape would flood the worker's log

    httpd = ThreadingHTTPServer((host, port), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return httpd
