"""The load generator against a real streaming HTTP server (tests/bench/sse_server.py).

Timing checks compare the client's measurements with the server's own timestamps on the
same clock: causality gives hard lower bounds (the client cannot see a token before the
server sent it), and upper bounds are generous multiples of the server's recorded gaps.
"""
from __future__ import annotations

import math
import re

import pytest
from sse_server import TokenStreamServer

from pdserve.bench import loadgen, report
from pdserve.bench.workload import (
    LengthRange,
    RequestSpec,
    TraceEntry,
    random_workload,
    trace_workload,
)

FIRST_DELAY, TOKEN_DELAY = 0.15, 0.03


@pytest.fixture(scope="module")
def server():
    srv = TokenStreamServer(first_token_delay=FIRST_DELAY, token_delay=TOKEN_DELAY)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def fresh(server):
    server.reset()
    return server


def _cfg(server: TokenStreamServer, **kw) -> loadgen.LoadConfig:
    return loadgen.LoadConfig(base_url=server.base_url, model=server.model, progress=False, **kw)


def _rid(result: loadgen.RequestResult) -> int:
    m = re.match(r"\s*r(\d+)t0", result.text)
    assert m, f"unexpected streamed text {result.text[:40]!r}"
    return int(m.group(1))


def test_measurements_match_server_timings(fresh):
    specs = random_workload(6, LengthRange(5, 20), LengthRange(8, 12), seed=3)
    run = loadgen.run_load(specs, _cfg(fresh, request_rate=math.inf))
    assert [r.error for r in run.results] == [""] * len(specs)
    served = fresh.by_rid()
    assert len(served) == len(specs)
    for spec, res in zip(specs, run.results):
        rec = served[_rid(res)]
        # token counts come from the server's usage and match what it really did
        assert res.usage_reported
        assert res.output_tokens == rec.max_tokens == spec.output_len
        assert res.prompt_tokens == rec.prompt_tokens == spec.input_len
        assert len(res.chunk_times) == spec.output_len and len(res.itl) == spec.output_len - 1
        # causality: the empty first chunk must not count as the first token
        assert res.ttft >= rec.ttft >= FIRST_DELAY
        assert res.e2e >= rec.done - rec.recv
        # ITL: the client's token span tracks the server's (generous bounds)
        client_span = res.chunk_times[-1] - res.chunk_times[0]
        assert 0.5 * rec.span <= client_span <= 2.0 * rec.span + TOKEN_DELAY
        server_gap = rec.span / (rec.max_tokens - 1)
        mean_itl = sum(res.itl) / len(res.itl)
        assert 0.5 * server_gap <= mean_itl <= 2.0 * server_gap + TOKEN_DELAY
        assert res.tpot == pytest.approx((res.e2e - res.ttft) / (res.output_tokens - 1))


def test_max_concurrency_caps_requests_in_flight(fresh):
    specs = random_workload(6, LengthRange(4, 4), LengthRange(5, 5), seed=1)
    run = loadgen.run_load(specs, _cfg(fresh, max_concurrency=2))
    assert all(r.success for r in run.results)
    assert fresh.max_in_flight == 2


def test_unbounded_rate_sends_all_at_once(fresh):
    specs = random_workload(6, LengthRange(4, 4), LengthRange(5, 5), seed=1)
    run = loadgen.run_load(specs, _cfg(fresh))
    assert all(r.success for r in run.results)
    assert fresh.max_in_flight > 2


def test_trace_replay_honours_timestamps(fresh):
    entries = [TraceEntry(1000.0 + t, 30, 3, (1, 2)) for t in (0.0, 400.0, 800.0)]
    specs = trace_workload(entries, block_size=16)
    run = loadgen.run_load(specs, _cfg(fresh))
    assert all(r.success for r in run.results)
    recv = sorted(r.recv for r in fresh.records)
    for i, offset in enumerate((0.0, 0.4, 0.8)):
        # sent no earlier than its timestamp (minus the first request's transit), nor much later
        assert offset - 0.05 <= recv[i] - recv[0] <= offset + 0.4
    # the two shared hash-id blocks (32 words) open every prompt the server received
    prompts = [r.body["prompt"].split() for r in fresh.records]
    assert prompts[0][:30] == prompts[1][:30] == prompts[2][:30]


def test_warmup_requests_are_sent_but_not_measured(fresh):
    specs = random_workload(3, LengthRange(4, 4), LengthRange(2, 2), seed=5)
    warm = random_workload(2, LengthRange(4, 4), LengthRange(2, 2), seed=6)
    run = loadgen.run_load(specs, _cfg(fresh), warmup=warm)
    assert len(fresh.records) == 5 and len(run.results) == 3
    assert run.warmup_failures == 0


def test_goodput_against_server_first_token_delay(fresh):
    specs = random_workload(4, LengthRange(4, 4), LengthRange(4, 4), seed=2)
    run = loadgen.run_load(specs, _cfg(fresh))
    # every client TTFT >= the server's first-token delay, so this SLO can't be met
    strict = report.summarize(run.results, run.duration_s, {"ttft": FIRST_DELAY / 2})
    loose = report.summarize(run.results, run.duration_s, {"ttft": 60.0, "tpot": 60.0})
    assert strict["goodput"] == 0.0 and strict["slo_attainment"] == 0.0
    assert loose["goodput"] == pytest.approx(loose["request_throughput"])
    assert loose["slo_attainment"] == 1.0


def test_chat_endpoint_streams_deltas(fresh):
    spec = RequestSpec("hello there world", 3, 4)
    [res] = loadgen.run_load([spec], _cfg(fresh, endpoint="/v1/chat/completions")).results
    assert res.success and res.output_tokens == 4 and res.prompt_tokens == 3
    assert fresh.records[0].body["messages"][0]["content"] == "hello there world"


def test_ignore_eos_rejected_by_strict_server_is_reported():
    srv = TokenStreamServer(strict_fields=True, first_token_delay=0.0, token_delay=0.0)
    srv.start()
    try:
        specs = random_workload(3, LengthRange(4, 4), LengthRange(2, 2), seed=7)
        run = loadgen.run_load(specs, _cfg(srv, ignore_eos=True))
        ok = loadgen.run_load(specs, _cfg(srv))  # without the flag the same server accepts
    finally:
        srv.stop()
    assert srv.rejected == 3
    assert all(not r.success and "HTTP 400" in r.error and "ignore_eos" in r.error
               for r in run.results)
    summary = report.summarize(run.results, run.duration_s, {"ttft": 1.0})
    assert summary["completed"] == 0 and summary["failed"] == 3
    assert summary["ttft_ms"]["mean"] is None and summary["goodput"] == 0.0
    assert "ignore_eos" in report.format_summary(summary, "strict")
    assert all(r.success for r in ok.results)


def test_without_usage_counts_content_chunks():
    srv = TokenStreamServer(send_usage=False, first_token_delay=0.0, token_delay=0.0)
    srv.start()
    try:
        [res] = loadgen.run_load([RequestSpec("a b c", 3, 5)], _cfg(srv)).results
    finally:
        srv.stop()
    assert res.success and not res.usage_reported
    assert res.output_tokens == 5 and res.prompt_tokens == 0


def test_unreachable_server_is_an_error_not_a_crash():
    cfg = loadgen.LoadConfig(base_url="http://127.0.0.1:9", model="m", progress=False,
                             timeout_s=5.0)
    [res] = loadgen.run_load([RequestSpec("a", 1, 1)], cfg).results
    assert not res.success and "ConnectError" in res.error
    with pytest.raises(OSError, match="--base-url: cannot reach http://127.0.0.1:9/v1/models"):
        loadgen.fetch_models("http://127.0.0.1:9", timeout_s=5.0)


def test_fetch_models_lists_server_model(server):
    assert loadgen.fetch_models(server.base_url) == [server.model]
