"""End to end: two prefill workers under steady load, one killed (its process, SIGKILL).
Requests in flight complete through retry (or end with a clear error), none hangs, no blocks
leak, and Ray restarts the killed worker, which rejoins under a new incarnation."""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import psutil
import pytest

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pbg
from pdserve.proto.rpc import make_channel

from tests.router.harness import (
    ServeProcess,
    metric_sum,
    pid_listening_on,
    wait_until,
    worker_rpcs_refused,
)

pytestmark = pytest.mark.slow
DRAIN_S = 4.0


@pytest.fixture(scope="module")
def server():
    # no --api-key, no secret file: serve makes a cluster secret that this test never learns
    srv = ServeProcess(["--prefill", "2", "--decode", "1", "--lease-ttl", "10",
                        "--request-timeout", "300", "--drain-timeout", str(DRAIN_S),
                        "--max-inflight", "300"])
    yield srv
    srv.stop()


def health_workers(server) -> dict[str, dict]:
    return {w["worker_id"]: w for w in server.health()["workers"]}


def one_request(server, i: int) -> str:
    """'ok', or 'error: <message>' for a clean failure; anything else fails the test."""
    body = {"prompt": f"Question {i}: what is {i} plus {i}?", "max_tokens": 12, "stream": True}
    text, reason = "", None
    with httpx.Client(timeout=180) as c:
        with c.stream("POST", server.url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                err = json.loads(r.read())["error"]
                assert r.status_code == 503 and err["message"], (r.status_code, err)
                return f"error: {err['message']}"
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    for line in lines[:-1]:
        event = json.loads(line[6:])
        if "error" in event:
            assert event["error"]["message"]
            return f"error: {event['error']['message']}"
        text += event["choices"][0]["text"]
        reason = event["choices"][0]["finish_reason"] or reason
    assert reason in ("length", "stop")
    return "ok"


def test_structured_outputs_and_tools_without_mtp(server):
    """test_e2e_serve.py runs these with MTP on; this server runs without it."""
    import openai

    from tests.router import test_e2e_serve as with_mtp

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=300)
    with_mtp.test_nested_schemas_validate_streamed_or_not(client)
    with_mtp.test_forced_tool_calls_parse_and_stream(client)


def test_killed_prefill_worker_retry_no_leak_and_rejoin(server):
    before = health_workers(server)
    victim = before["prefill-1"]
    grpc_line = re.search(r"worker prefill-1\s+prefill\s+grpc (\S+)", server.output()).group(1)
    results: list[str] = []
    stop = threading.Event()

    def load(worker: int) -> None:
        i = worker * 10_000
        while not stop.is_set():
            results.append(one_request(server, i))
            i += 1

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(load, k) for k in range(6)]
        wait_until(lambda: len(results) >= 12, 300, "steady load to be running")
        os.kill(pid_listening_on(grpc_line), signal.SIGKILL)  # the worker process dies
        killed_at = len(results)
        wait_until(lambda: len(results) >= killed_at + 24, 300, "load to continue after the kill")
        stop.set()
        for f in futures:
            f.result(timeout=300)  # none hangs

    assert results.count("ok") >= len(results) - 6, results  # at most a few clean errors
    # Ray restarts the worker; the router re-reads its endpoints and it rejoins
    wait_until(lambda: (lambda w: w["up"] and w["incarnation"] != victim["incarnation"])(
        health_workers(server)["prefill-1"]), 300, "prefill-1 to rejoin as a new incarnation")
    assert server.health()["status"] == "ok"
    new = health_workers(server)["prefill-1"]
    # Prometheus's service discovery (/metrics/targets, open like /metrics) follows the
    # relaunch: the new process's metrics address, not the dead one's
    sd = httpx.get(server.url + "/metrics/targets", timeout=10).json()
    found = {t["labels"]["__meta_pdserve_worker"]: t["targets"] for t in sd}
    assert found["prefill-1"] == [new["metrics_address"]] != [victim["metrics_address"]]
    assert set(found) == set(health_workers(server))
    served_before = metric_sum(new["metrics_address"], "prompt_tokens_total")
    for i in range(8):  # prompts spread over both prefill workers again
        assert one_request(server, 900_000 + i) == "ok"
    assert metric_sum(new["metrics_address"], "prompt_tokens_total") > served_before

    gauges = ("kv_blocks_pinned", "num_requests_held", "kv_cache_usage_perc",
              "num_requests_running", "num_requests_waiting")

    def leftovers() -> dict:
        return {(wid, g): v for wid, w in health_workers(server).items() for g in gauges
                if (v := metric_sum(w["metrics_address"], g))}
    wait_until(lambda: not leftovers(), 30,
               lambda: f"no pinned, held or used blocks on any worker; left: {leftovers()}")


def test_decode_worker_killed_three_times_comes_back_each_time(server):
    """The only decode worker is SIGKILLed three times in a row under load: each time the
    pool launches a new one (backoff 0.5 s, 1 s, 2 s, ...; no restart limit by default),
    /health counts the restarts, and requests after the last one succeed."""
    results: list[str] = []
    stop = threading.Event()

    def load(k: int) -> None:
        i = 500_000 + k * 10_000
        while not stop.is_set():
            results.append(one_request(server, i))
            i += 1

    def decode() -> dict:
        return health_workers(server)["decode-0"]

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(load, k) for k in range(3)]
        for n in range(1, 4):
            wait_until(lambda: decode()["up"], 180, "decode-0 to be up")
            before = decode()
            os.kill(pid_listening_on(before["metrics_address"]), signal.SIGKILL)
            wait_until(lambda b=before: decode()["up"] and
                       decode()["incarnation"] != b["incarnation"], 180,
                       lambda: f"decode-0 to come back after kill {n}: {decode()}")
            assert decode()["restarts"] == n and not decode()["gave_up"]
        stop.set()
        for f in futures:
            f.result(timeout=300)  # no request hangs
    assert server.health()["status"] == "ok"
    assert [one_request(server, 990_000 + i) for i in range(6)] == ["ok"] * 6


def test_workers_refuse_callers_without_the_secret(server):
    """No client API key configured: the workers still require the cluster credential."""
    for wid, w in health_workers(server).items():  # addresses of the current incarnations
        codes = worker_rpcs_refused(w["grpc_address"])
        assert len(codes) == 7 and set(codes.values()) == {"UNAUTHENTICATED"}, (wid, codes)
    assert one_request(server, 7) == "ok"


def test_admission_counts_completions_and_takes_turns(server):
    """64 concurrent requests of 200 prompts each: --max-inflight 300 counts completions, so
    one is admitted and the rest get 429 at once. A 4-token request sent while the admitted
    one's 200 completions queue for the single decode worker's 56 slots takes turns with
    them (router/admission.py's bound: within R slot releases, R = requests waiting ahead),
    so it finishes while most of them are still to come. Too many completions or a deadline
    out of range get 400 / INVALID_ARGUMENT naming the field."""
    with make_channel(server.grpc_address) as ch:
        stub = pbg.PdserveStub(ch)
        for params, timeout_s, field in ((pb.SamplingParams(n=1000), 0, "n"),
                                         (pb.SamplingParams(max_tokens=2), 1e10, "timeout_s"),
                                         (pb.SamplingParams(max_tokens=2), -1, "timeout_s")):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(pb.GenerateRequest(prompt="hi", params=params,
                                                      timeout_s=timeout_s), timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith(f"{field}:"), e.value.details()
    r = httpx.post(server.url + "/v1/completions", json={"prompt": ["hi"] * 300, "max_tokens": 1},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text

    big_done, statuses, small_at = [], [], []
    first_big = threading.Event()

    def big(i: int) -> None:
        body = {"prompt": [f"Count to {i}:"] * 200, "max_tokens": 8, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=300) as c, c.stream("POST", server.url + "/v1/completions",
                                                      json=body) as r:
            statuses.append(r.status_code)
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    first_big.set()
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    big_done.extend(c for c in event["choices"] if c["finish_reason"])

    with ThreadPoolExecutor(64) as pool:
        futures = [pool.submit(big, i) for i in range(64)]
        assert first_big.wait(120)
        small = httpx.post(server.url + "/v1/completions",
                           json={"prompt": "Say hi", "max_tokens": 4, "ignore_eos": True},
                           timeout=300)
        small_at.append(len(big_done))
        for f in futures:
            f.result(timeout=300)
    assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 4
    assert sorted(set(statuses)) == [200, 429] and statuses.count(200) == 1, statuses
    assert len(big_done) == 200
    assert small_at[0] < 100, f"the small request waited for {small_at[0]} of 200 completions"


def stream_until_end(server, i: int, started: threading.Event) -> list[dict | str]:
    body = {"prompt": f"Story {i}:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    events: list[dict | str] = []
    with httpx.Client(timeout=120) as c, c.stream("POST", server.url + "/v1/completions",
                                                  json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                started.set()
    return events


def test_sigterm_to_the_process_group_drains(server):
    """Last test: SIGTERM to the whole process group (systemd's default) while 10 streams
    run. Every stream ends with [DONE] (finished, or an error chunk at the drain deadline),
    and every process, Ray's included, exits within the drain timeout plus 30 s."""
    family = [server.proc.pid] + [p.pid for p in psutil.Process(server.proc.pid).children(True)]
    starts = [threading.Event() for _ in range(10)]
    with ThreadPoolExecutor(10) as pool:
        futures = [pool.submit(stream_until_end, server, i, starts[i]) for i in range(10)]
        for e in starts:
            assert e.wait(120), "a stream did not start"
        os.killpg(os.getpgid(server.proc.pid), signal.SIGTERM)
        t0 = time.monotonic()
        outcomes = [f.result(timeout=DRAIN_S + 60) for f in futures]
    for events in outcomes:
        assert events[-1] == "[DONE]", events[-2:]
        last = events[-2]
        finished = "choices" in last and last["choices"] and last["choices"][0]["finish_reason"]
        assert finished or ("error" in last and "drain" in last["error"]["message"]), last
    assert any("error" in ev[-2] for ev in outcomes)  # 400 tokens outlast a 4 s drain on CPU
    wait_until(lambda: not [p for p in family if psutil.pid_exists(p) and
                            psutil.Process(p).status() != psutil.STATUS_ZOMBIE],
               DRAIN_S + 30 - (time.monotonic() - t0), "every process to exit")
    assert server.proc.wait(5) == 0
