"""Tensor-parallel workers served like any worker (worker/tp_worker.py), on a real local Ray
instance with real NIXL (UCX, host memory) between the ranks' own transports: disaggregated
greedy between TP sizes equals the colocated run, and the KV each decode rank received is
bitwise equal to the matching head slices on the prefill ranks; a pair whose KV cannot map
is refused at the handshake naming the field, within the call's deadline."""
from __future__ import annotations

import pytest
import ray

from pdserve.proto import pdserve_pb2 as pb

from tests.workers.cluster import (
    decode_stream,
    idle,
    introduce,
    metric_value,
    prefill,
    scrape,
    start_ray,
    tokens_of,
    wait_until,
)
from tests.workers.tp_cluster import head_digests, start_tp_worker, start_tp_workers, stop

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [11, 3, 50, 2, 9], [99, 1, 2, 3, 4, 5, 6, 7, 8, 12, 13]]
GREEDY = pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _offline_greedy(model: str) -> list[list[int]]:
    """The offline engine at TP 1 on PROMPTS: what every pair must produce."""
    from pdserve.engine.core.sampling_params import SamplingParams
    from pdserve.engine.llm import LLM

    from tests.workers.tp_cluster import ENGINE

    with LLM(model, **{k: v for k, v in ENGINE.items() if k != "max_num_seqs"}) as llm:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        return [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]


def _serve_one(p, d, rid: str, prompt: list[int], want: list[int]) -> list[int]:
    """`prompt` through prefill `p` and decode `d`: greedy equals `want` and the KV heads the
    decode ranks pulled equal the prefill ranks'. Returns the decode-side blocks."""
    res = prefill(p, rid, prompt, GREEDY)
    assert res.kv.num_tokens == len(prompt)
    heads = head_digests(p, list(res.kv.block_ids), len(prompt))
    toks, reason = tokens_of(decode_stream(d, rid, prompt, GREEDY, res))
    assert (toks, reason) == (want, "length"), rid
    pulls = {r: (loc, n) for r, _, loc, n in ray.get(d.actor.recent_pulls.remote())}
    local, n = pulls[rid]
    assert head_digests(d, local, n) == heads, f"{rid}: KV heads differ"
    return local


def _serve_pair_like(p, d, want: list[list[int]], tag: str) -> None:
    """Each prompt through `p` and `d` (_serve_one), then nothing leaks."""
    ptp, dtp = p.cfg.engine.tensor_parallel_size, d.cfg.engine.tensor_parallel_size
    reply = introduce(p, d)
    assert reply.accepted, reply.reason
    for i, prompt in enumerate(PROMPTS):
        _serve_one(p, d, f"{tag}-p{ptp}d{dtp}-{i}", prompt, want[i])
    wait_until(lambda: idle(p) and idle(d), 20, "both workers idle (no leaked blocks)")


@pytest.mark.parametrize("family", ["llama_1kv", "qwen3_moe"])
def test_between_tp_sizes_on_a_replicated_kv_head_and_a_moe_model(tmp_path, family) -> None:
    """The same two pairs on the other tiny models: one KV head (replicated on both ranks of
    a TP-2 worker: each reads it from the one TP-1 rank, a TP-1 decode reads it from either
    prefill replica) and a Qwen3-MoE (experts split inside each rank). First in the module:
    it runs before the module's shared workers start, so theirs are the only ones up."""
    from tests.dist.tp_models import save_tiny

    model = str(save_tiny(family, tmp_path / family))
    want = _offline_greedy(model)
    start_ray()
    # P TP-2 -> D TP-1, then P TP-1 -> D TP-2
    p2, d1, p1, d2 = start_tp_workers(
        [("prefill", f"{family}-p2", 2), ("decode", f"{family}-d1", 1),
         ("prefill", f"{family}-p1", 1), ("decode", f"{family}-d2", 2)],
        model, lease_ttl_s=5.0, tp_timeout_s=60.0)
    try:
        _serve_pair_like(p2, d1, want, family)
        _serve_pair_like(p1, d2, want, family)
    finally:
        stop(p2, d1, p1, d2)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from tests.dist.tp_models import save_tiny

    return str(save_tiny("qwen3", tmp_path_factory.mktemp("tp-serve") / "qwen3"))


@pytest.fixture(scope="module")
def colocated(model) -> list[list[int]]:
    return _offline_greedy(model)


@pytest.fixture(scope="module")
def workers(model):
    """The module's four workers, started together (tp_cluster.start_tp_workers) and shared
    by its tests: get(role, tp)."""
    start_ray()
    keys = [("prefill", 2), ("decode", 2), ("decode", 1), ("prefill", 1)]
    started = dict(zip(keys, start_tp_workers([(role, f"tp{tp}-{role}", tp) for role, tp in keys],
                                              model, lease_ttl_s=5.0, tp_timeout_s=60.0)))
    yield lambda role, tp: started[role, tp]
    stop(*started.values())


@pytest.mark.parametrize("ptp,dtp", [(2, 2), (2, 1), (1, 2)])
def test_disaggregated_between_tp_sizes_equals_colocated_and_kv_is_bitwise(
        workers, colocated, ptp, dtp) -> None:
    p, d = workers("prefill", ptp), workers("decode", dtp)
    reply = introduce(p, d)
    assert reply.accepted, reply.reason
    pulled_before = metric_value(scrape(d), "pdserve:kv_transfer_bytes_total")
    blocks = 0
    for i, prompt in enumerate(PROMPTS):
        blocks += len(_serve_one(p, d, f"p{ptp}d{dtp}-{i}", prompt, colocated[i]))
    # the worker's metric counts every rank's bytes: whole blocks of all KV heads (2 layers,
    # K and V, 4 tokens, 2 KV heads, 16 dims, float32)
    pulled = metric_value(scrape(d), "pdserve:kv_transfer_bytes_total") - pulled_before
    assert pulled == blocks * 2 * 2 * 4 * 2 * 16 * 4
    wait_until(lambda: idle(p) and idle(d), 20, "both workers idle (no leaked blocks)")


def test_tp_worker_serves_colocated_like_tp1(workers, colocated) -> None:
    d = workers("decode", 2)
    for i, prompt in enumerate(PROMPTS):
        assert tokens_of(decode_stream(d, f"col-{i}", prompt, GREEDY)) == (colocated[i],
                                                                           "length")


@pytest.mark.parametrize("edit,field", [
    ({"tp": {"heads_outer": False}, "layout": {"heads_outer": False}}, "tp.heads_outer"),
    ({"tp": {"num_kv_heads": 4, "head_map": [[0, 4]]}}, "tp.num_kv_heads"),
])
def test_a_pair_that_cannot_map_is_refused_at_the_handshake_naming_the_field(
        workers, edit, field) -> None:
    """A TP-2 decode worker pulls head slices: a prefill peer that keeps heads inside its
    blocks, or holds other KV heads, is refused by every rank, the reason naming the field,
    within the call's deadline; the decode worker keeps no trace of it (a Decode naming it
    fails at once), and a compatible peer is still accepted afterwards."""
    import json

    p, d = workers("prefill", 1), workers("decode", 2)
    real = p.stub.GetPeerInfo(pb.GetPeerInfoRequest(), timeout=10)
    info = json.loads(real.transport_info)
    for key, changes in edit.items():
        info[key].update(changes)
    bad = pb.PeerInfo()
    bad.CopyFrom(real)
    bad.worker_id = info["worker_id"] = "tp-bad-prefill"
    bad.transport_info = json.dumps(info).encode()
    reply = d.stub.AddPeer(bad, timeout=15)  # DEADLINE_EXCEEDED would raise here
    assert not reply.accepted and field in reply.reason, reply.reason
    res = pb.PrefillResult(first_token_id=3)
    res.kv.worker_id, res.kv.incarnation = bad.worker_id, bad.incarnation
    res.kv.compat_hash, res.kv.block_ids[:] = real.compat_hash, [0]
    with pytest.raises(Exception) as e:
        tokens_of(decode_stream(d, f"refused-{field}", PROMPTS[0][:4], GREEDY, res,
                                timeout_s=10))
    assert "unknown prefill peer" in str(e.value)
    assert introduce(p, d).accepted


def test_a_failed_pull_takes_the_request_policy(workers, model, colocated) -> None:
    """Every pull of a TP-2 decode worker fails on its ranks (injected into each rank's
    transport): 'recompute' prefills locally and still equals colocated, 'fail' ends with
    UNAVAILABLE naming kv_transfer; each group read counts one failure; nothing leaks."""
    import grpc

    from pdserve.kv_transfer.faults import FaultConfig

    p = workers("prefill", 1)
    d = start_tp_worker("decode", "tp2-faulty", model, 2, lease_ttl_s=5.0, tp_timeout_s=20.0,
                        faults=FaultConfig(fail_every=1))
    try:
        assert introduce(p, d).accepted
        for policy in ("recompute", "fail"):
            params = pb.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                       transfer_failure_policy=policy)
            rid = f"faulty-{policy}"
            res = prefill(p, rid, PROMPTS[2], params)
            if policy == "recompute":
                assert tokens_of(decode_stream(d, rid, PROMPTS[2], params, res)) == (
                    colocated[2], "length")
            else:
                with pytest.raises(grpc.RpcError) as e:
                    tokens_of(decode_stream(d, rid, PROMPTS[2], params, res, timeout_s=20))
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert e.value.details().startswith("kv_transfer:"), e.value.details()
        assert metric_value(scrape(d), "pdserve:kv_transfer_failures_total") == 2
        wait_until(lambda: idle(p) and idle(d), 20, "both workers idle (no leaked blocks)")
    finally:
        stop(d)
