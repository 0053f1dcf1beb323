"""200 disaggregated requests with random aborts and injected transfer failures: no hang,
and afterwards both workers hold zero pinned or leaked blocks (ANCHORS #1, #2)."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import ray

from pdserve.kv_transfer.faults import FaultConfig
from pdserve.proto import pdserve_pb2 as pb

from tests.workers.cluster import (
    decode_stream,
    idle,
    introduce,
    metric_value,
    prefill,
    scrape,
    start_ray,
    start_worker,
    wait_until,
)

N_REQUESTS = 200


def _one(p, d, i: int) -> str:
    rng = random.Random(i)
    rid = f"stress-{i}"
    prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(3, 40))]
    policy = rng.choice(["recompute", "fail"])
    params = pb.SamplingParams(max_tokens=rng.randrange(2, 12), temperature=0.7, seed=i,
                               ignore_eos=True, transfer_failure_policy=policy)
    action = rng.choice(["normal", "normal", "abort_prefill", "cancel_decode", "abort_decode"])
    res = prefill(p, rid, prompt, params, timeout_s=30)
    if action == "abort_prefill":
        p.stub.Abort(pb.AbortRequest(request_id=rid), timeout=10)
        return action
    stream = decode_stream(d, rid, prompt, params, res, timeout_s=30)
    got = 0
    try:
        for out in stream:
            got += len(out.token_ids)
            if action == "cancel_decode" and got >= 1:
                stream.cancel()
                return action
            if action == "abort_decode" and got >= 1:
                d.stub.Abort(pb.AbortRequest(request_id=rid), timeout=10)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNAVAILABLE and "kv_transfer" in e.details():
            assert policy == "fail"
            return "transfer_failed"
        if e.code() == grpc.StatusCode.CANCELLED:
            return action
        raise
    return action


def test_200_requests_with_aborts_and_transfer_failures_leak_nothing() -> None:
    start_ray()
    p = start_worker("prefill", "stress-p", model="tiny-llama", block_size=4, num_blocks=256,
                     lease_ttl_s=2.0)
    d = start_worker("decode", "stress-d", model="tiny-llama", block_size=4, num_blocks=256,
                     faults=FaultConfig(fail_prob=0.2, seed=3))
    try:
        assert introduce(p, d).accepted
        with ThreadPoolExecutor(8) as pool:
            outcomes = list(pool.map(lambda i: _one(p, d, i), range(N_REQUESTS), timeout=600))
        assert len(outcomes) == N_REQUESTS
        assert "transfer_failed" in outcomes and "cancel_decode" in outcomes
        wait_until(lambda: idle(p) and idle(d), 15, "both workers to return to idle")
        assert metric_value(scrape(d), "pdserve:kv_transfer_failures_total") > 0
        # every path above releases P's blocks itself (abort, a finished or failed read,
        # a cancelled stream): none may have been left to the 2 s lease (ANCHORS #2)
        text = scrape(p)
        assert "pdserve:kv_lease_expired_total{" in text  # exported, and at zero
        assert metric_value(text, "pdserve:kv_lease_expired_total") == 0
    finally:
        for w in (p, d):
            ray.kill(w.actor, no_restart=True)
