"""ANCHORS #10 on real workers: time across the split adds up, and lands where it was spent.

A real router in front of a real prefill and decode worker in this process (tiny Qwen3
engines, gRPC on loopback, the in-process KV transport). Decode's KV read is made to take
DELAY_S (kv_transfer/faults.py), as a slow link would. The completion's trace must put that
second in kv_transfer, not in decode's queue or its decode, while the stages still add up to
the end-to-end time; the router's and the workers' counters name each finish's reason.
"""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import generate_latest

from pdserve.kv_transfer.faults import FaultConfig
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pbg
from pdserve.proto.rpc import make_channel
from pdserve.router.core import RouterConfig
from pdserve.worker.server import Worker

from tests.router.harness import RouterThread, inproc_stack, sample_sum, wait_until

DELAY_S = 1.0
PROMPT = [7, 3, 99, 5, 40, 11, 8, 21, 64, 3]
STAGES = ("router_queue", "prefill_queue", "prefill", "kv_transfer", "decode_queue", "decode")


@pytest.fixture(scope="module")
def stack(frontend) -> Iterator[tuple[RouterThread, dict[str, Worker]]]:
    with inproc_stack(frontend, {"sa-p": "prefill", "sa-d": "decode"},
                      RouterConfig(block_size=4, router_id="router-stages"), num_blocks=128,
                      faults={"sa-d": FaultConfig(delay_s=DELAY_S)}) as stack:
        yield stack


def generate(rt: RouterThread, rid: str, **params) -> list[pb.GenerateResponse]:
    with make_channel(rt.grpc_address) as ch:
        req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=PROMPT), request_id=rid,
                                 params=pb.SamplingParams(temperature=0.0, **params))
        return list(pbg.PdserveStub(ch).Generate(req, timeout=60))


def router_text(rt: RouterThread) -> str:
    return httpx.get(rt.url + "/metrics", timeout=10).text


def worker_text(w: Worker) -> str:
    return generate_latest(w.rt.registry).decode()


def stage_sums(text: str) -> dict[str, float]:
    """The router's stage histograms' sums, and e2e's."""
    return {s: sample_sum(text, f"pdserve:stage_{s}_seconds_sum") for s in STAGES} | {
        "e2e": sample_sum(text, "pdserve:e2e_request_latency_seconds_sum")}


def test_a_slow_kv_read_lands_in_kv_transfer_and_the_stages_add_up(stack) -> None:
    rt, ws = stack
    sums0 = stage_sums(router_text(rt))
    reads0 = sample_sum(worker_text(ws["sa-d"]), "pdserve:nixl_xfer_time_seconds_count")
    msgs = generate(rt, "slow-read", max_tokens=5, ignore_eos=True)
    assert [m.HasField("trace") for m in msgs] == [False] * (len(msgs) - 1) + [True]
    t = msgs[-1].trace
    assert (t.prefill_worker, t.decode_worker, t.retries) == ("sa-p", "sa-d", 0)
    stages = {s: getattr(t, s) for s in STAGES}
    assert all(v >= 0 for v in stages.values()), stages
    # added up, not double-counted: were the read also in decode_queue (its first message
    # sent after the read) the sum would pass e2e, since decode is what is left of it
    assert sum(stages.values()) == pytest.approx(t.e2e, rel=1e-6)
    assert t.kv_transfer >= DELAY_S, stages
    assert t.decode_queue + t.decode < t.e2e - DELAY_S, stages
    # the router's histograms say the same
    sums = {k: v - sums0[k] for k, v in stage_sums(router_text(rt)).items()}
    assert sum(sums[s] for s in STAGES) == pytest.approx(sums["e2e"], rel=1e-6)
    assert sums["kv_transfer"] == pytest.approx(t.kv_transfer, rel=1e-6)
    # and decode's own transfer histogram saw the one read, the delay included
    text = worker_text(ws["sa-d"])
    assert sample_sum(text, "pdserve:nixl_xfer_time_seconds_count") == reads0 + 1
    assert sample_sum(text, "pdserve:nixl_xfer_time_seconds_sum") >= DELAY_S


def test_each_finish_is_counted_under_its_reason(stack) -> None:
    """request_success{finished_reason}: vLLM's label, at the router and at the decode
    worker that ended the request. max_tokens ends one request, a stop token the other."""
    rt, ws = stack

    def counts() -> tuple[float, ...]:
        """(router, decode worker) x (stop, length)."""
        texts = router_text(rt), worker_text(ws["sa-d"])
        return tuple(sample_sum(text, "pdserve:request_success_total", finished_reason=reason)
                     for reason in ("stop", "length") for text in texts)
    before = counts()
    greedy = [i for m in generate(rt, "by-length", max_tokens=6, ignore_eos=True)
              for i in m.token_ids]
    assert len(greedy) == 6
    # a token decode makes that the greedy path has not made before: as a stop token, the
    # same path ends there (the tiny model's weights are seeded, so this one is fixed)
    at = next(i for i in range(1, 6) if greedy[i] not in greedy[:i])
    stopped = generate(rt, "by-stop", max_tokens=6, ignore_eos=True,
                       stop_token_ids=[greedy[at]])
    assert stopped[-1].finish_reason == "stop"
    assert [i for m in stopped for i in m.token_ids] == greedy[:at + 1]

    def deltas() -> tuple[float, ...]:
        return tuple(a - b for a, b in zip(counts(), before))
    wait_until(lambda: deltas() == (1, 1, 1, 1), 10,
               lambda: f"each finish counted once by reason; (router, decode) x (stop, length) "
                       f"deltas {deltas()}")
