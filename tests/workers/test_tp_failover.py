"""A rank of a tensor-parallel decode worker killed under load, with a real `pdserve serve
--decode-tp 2` process (its own Ray, real NIXL, gloo ranks): nothing hangs, requests in
flight complete on the other decode worker or end with a clear error, the prefill worker's
leases free every block, and the dead rank's whole worker comes back as a new generation
(new incarnation) that the router serves from again."""
from __future__ import annotations

import json
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pbg
from pdserve.proto.rpc import make_channel

from tests.cluster_secret import SECRET
from tests.router.harness import ServeProcess, metric_sum, wait_until
from tests.workers.cluster import tokens_of


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.dist.tp_models import save_tiny

    model = save_tiny("qwen3", tmp_path_factory.mktemp("tp-failover") / "qwen3")
    srv = ServeProcess(["--model", str(model), "--device", "cpu", "--prefill", "1",
                        "--decode", "2", "--decode-tp", "2", "--tp-timeout", "8",
                        "--block-size", "4", "--num-blocks", "96", "--max-num-seqs", "8",
                        "--lease-ttl", "10", "--request-timeout", "120",
                        "--drain-timeout", "4", "--startup-timeout", "600"],
                       cluster_secret=SECRET)  # the test calls the new worker directly
    yield srv
    srv.stop()


def workers(server) -> dict[str, dict]:
    return {w["worker_id"]: w for w in server.health()["workers"]}


def one_request(server, i: int) -> str:
    """'ok', or 'error: <message>' for a clean failure; anything else fails the test. Token-id
    prompts: the tiny checkpoint has no tokenizer."""
    prompt = [(i * 7 + k) % 97 + 2 for k in range(5 + i % 7)]
    body = {"prompt": prompt, "max_tokens": 16, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=180) as c:
        with c.stream("POST", server.url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                err = json.loads(r.read())["error"]
                assert r.status_code == 503 and err["message"], (r.status_code, err)
                return f"error: {err['message']}"
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    reason = None
    for line in lines[:-1]:
        event = json.loads(line[6:])
        if "error" in event:
            assert event["error"]["message"]
            return f"error: {event['error']['message']}"
        reason = event["choices"][0]["finish_reason"] or reason
    assert reason == "length", lines[-3:]
    return "ok"


def follower_ranks(server) -> list[psutil.Process]:
    """The serve process tree's follower rank actors (ray::RankActor processes)."""
    out = []
    for p in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if any("RankActor" in part for part in p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def test_killed_decode_rank_fails_its_worker_which_comes_back(server) -> None:
    before = workers(server)
    decode = {wid: w for wid, w in before.items() if w["role"] == "decode"}
    assert len(decode) == 2 and all(w["up"] for w in decode.values()), before
    assert [one_request(server, i) for i in range(4)] == ["ok"] * 4
    ranks = follower_ranks(server)
    assert len(ranks) == 2, [p.cmdline() for p in ranks]  # one follower per decode worker
    results: list[str] = []
    stop = threading.Event()

    def load(k: int) -> None:
        i = 1000 * (k + 1)
        while not stop.is_set():
            results.append(one_request(server, i))
            i += 1

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(load, k) for k in range(4)]
        wait_until(lambda: len(results) >= 8, 300, "steady load to be running")
        ranks[0].send_signal(signal.SIGKILL)  # one rank of one decode worker dies
        killed_at = len(results)
        wait_until(lambda: len(results) >= killed_at + 16, 300, "load to go on after the kill")
        stop.set()
        for f in futures:
            f.result(timeout=300)  # none hangs
    errors = [r for r in results if r != "ok"]
    assert len(errors) <= 4, errors  # only streams caught mid-step on the dead worker may fail

    def replaced() -> list[str]:
        now = workers(server)
        return [wid for wid, w in decode.items()
                if now[wid]["up"] and now[wid]["incarnation"] != w["incarnation"]]
    # the dead rank's rank 0 ended itself; the router's pool relaunched the whole group
    wait_until(lambda: len(replaced()) == 1 and all(w["up"] for w in workers(server).values()),
               300, lambda: f"one decode worker to rejoin as a new incarnation: {workers(server)}")
    assert server.health()["status"] == "ok"
    # the dead rank's worker came back once, as one new group; the other never restarted
    [back] = replaced()
    assert {wid: workers(server)[wid]["restarts"] for wid in decode} == {
        wid: int(wid == back) for wid in decode}
    assert len(follower_ranks(server)) == 2 and ranks[0].pid not in {
        p.pid for p in follower_ranks(server)}
    assert [one_request(server, 90_000 + i) for i in range(8)] == ["ok"] * 8
    new = workers(server)[back]  # the new generation decodes (greedy, both ranks)
    params = pb.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with make_channel(new["grpc_address"], cluster_secret=SECRET) as ch:
        stream = pbg.WorkerStub(ch).Decode(pb.DecodeRequest(
            request_id="after", prompt_token_ids=[5, 6, 7, 8, 9], params=params,
            timeout_s=60), timeout=65)
        toks, reason = tokens_of(stream)
    assert len(toks) == 6 and reason == "length"

    gauges = ("kv_blocks_pinned", "num_requests_held", "kv_cache_usage_perc",
              "num_requests_running", "num_requests_waiting")

    def leftovers() -> dict:
        return {(wid, g): v for wid, w in workers(server).items() for g in gauges
                if (v := metric_sum(w["metrics_address"], g))}
    wait_until(lambda: not leftovers(), 30,
               lambda: f"no pinned, held or used blocks on any worker; left: {leftovers()}")
