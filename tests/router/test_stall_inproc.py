"""A worker whose engine loop stalls (a hung GPU or collective: the process lives, its gRPC
server answers, nothing steps) is marked down by the router within --stall-timeout, and the
requests on it move: a prefill goes decode-only (the only prefill worker stalled), a stream
is continued on the other decode worker from the tokens already sent. Real workers in this
process (tiny Qwen3 engines, gRPC on loopback, in-process KV transport) behind a real router;
the stall is a command that holds the loop, as a kernel that never returns would."""
from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pbg
from pdserve.proto.rpc import make_channel
from pdserve.router.core import RouterConfig
from pdserve.worker.server import Worker

from tests.router.harness import RouterThread, inproc_stack, wait_until
from tests.router.test_failures_fake import metric

PROMPT = [7, 3, 99, 5, 40, 11, 8, 21, 64, 3]


def generate(rt: RouterThread, max_tokens: int = 12) -> Iterator[pb.GenerateResponse]:
    """Greedy tokens for PROMPT through the router's gRPC face (token ids: the workers' tiny
    model has no tokenizer of its own, so the router's text would be empty)."""
    with make_channel(rt.grpc_address) as ch:
        req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=PROMPT), params=pb.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        yield from pbg.PdserveStub(ch).Generate(req, timeout=60)


def tokens(rt: RouterThread, max_tokens: int = 12) -> list[int]:
    return [t for m in generate(rt, max_tokens) for t in m.token_ids]


@pytest.fixture(scope="module")
def stack(frontend) -> Iterator[tuple[RouterThread, dict[str, Worker]]]:
    # 3 s: far above a tiny model's step on a loaded CI machine, so only the stall counts
    cfg = RouterConfig(block_size=4, stall_timeout_s=3.0, router_id="router-stall")
    roles = {"st-p": "prefill", "st-d0": "decode", "st-d1": "decode"}
    with inproc_stack(frontend, roles, cfg, num_blocks=256) as (rt, workers):
        for w in workers.values():  # "busy" after 0.5 s (2 s in production): a faster test
            w.rt.health_timeout_s = 0.5
        yield rt, workers


def stall(w: Worker) -> threading.Event:
    """Hold w's engine loop until the returned event is set."""
    release = threading.Event()
    w.rt.loop.submit(lambda e: release.wait(120))
    return release


def all_up(rt: RouterThread) -> bool:
    return all(s.up for s in rt.core.pool.workers.values())


def no_leaks(workers: dict[str, Worker]) -> bool:
    def idle(w: Worker) -> bool:
        e = w.rt.engine
        return w.rt.loop.call(lambda _: not e.has_unfinished() and
                              e.scheduler.block_manager.num_free_blocks ==
                              e.scheduler.block_manager.num_blocks, timeout_s=10)
    return all(idle(w) for w in workers.values()) and \
        all(w.rt.leases.pinned_blocks == 0 for w in workers.values())


def test_a_stalled_only_prefill_worker_is_routed_around_then_rejoins(stack) -> None:
    rt, workers = stack
    wait_until(lambda: all_up(rt), 30, "workers up")
    want = tokens(rt)
    assert len(want) == 12
    fallbacks = metric(rt, "pdserve:router_prefill_fallbacks_total")
    release = stall(workers["st-p"])
    try:
        assert tokens(rt) == want  # answered while P is still stuck: decode-only
        assert metric(rt, "pdserve:router_prefill_fallbacks_total") > fallbacks
        assert metric(rt, "pdserve:router_worker_up", worker="st-p") == 0
        assert metric(rt, "pdserve:router_worker_loop_busy_seconds", worker="st-p") >= 3.0
        assert not release.is_set()
    finally:
        release.set()
    wait_until(lambda: all_up(rt), 30, "the prefill worker back up once its loop came round")
    assert not rt.core.pool.workers["st-p"].stall.stalled
    fallbacks = metric(rt, "pdserve:router_prefill_fallbacks_total")
    assert tokens(rt) == want  # prefilled on P again: no fallback
    assert metric(rt, "pdserve:router_prefill_fallbacks_total") == fallbacks
    wait_until(lambda: no_leaks(workers), 30, "no request or block left on any worker")


def test_a_stream_on_a_stalled_decode_worker_is_continued_on_the_other(stack) -> None:
    rt, workers = stack
    wait_until(lambda: all_up(rt), 30, "workers up")
    want = tokens(rt, 200)  # long enough that the stall lands mid-stream
    continued = metric(rt, "pdserve:stream_continuations_total", result="ok")
    got: list[int] = []
    release = None
    try:
        for msg in generate(rt, 200):
            got += msg.token_ids
            if release is None and got:  # output started: stall the worker sending it
                serving = [s for s in rt.core.pool.workers.values()
                           if s.role == "decode" and s.inflight]
                assert len(serving) == 1
                release = stall(workers[serving[0].worker_id])
        assert release is not None and not release.is_set()
    finally:
        if release is not None:
            release.set()
    assert got == want  # nothing lost or repeated across the two decode workers
    assert metric(rt, "pdserve:stream_continuations_total", result="ok") == continued + 1
    assert metric(rt, "pdserve:router_retries_total", reason="stalled") >= 1
    wait_until(lambda: all_up(rt), 30, "the decode worker back up once its loop came round")
    wait_until(lambda: no_leaks(workers), 30, "no request or block left on any worker")
