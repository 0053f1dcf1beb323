"""MTP across the prefill/decode split: two in-process workers talking gRPC + NIXL (CPU).

The prefill worker runs the MTP layer over the prompt (its KV lands in the same blocks as the
target's and travels with them) and ships the last hidden state; the decode worker drafts
from its very first step. Greedy output equals plain colocated decoding token for token.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from pdserve.engine.core.config import SpecConfig
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import build_engine
from pdserve.engine.llm_engine import LLMEngine
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pbg
from pdserve.proto.rpc import make_channel
from pdserve.worker.config import WorkerConfig
from pdserve.worker.server import Worker

from tests.cluster_secret import SECRET

TINY = dict(device="cpu", block_size=4, num_blocks=256)
PROMPTS = [[5 + i, 17, 99, 3 * i + 1, 42] * (i + 2) for i in range(3)]


def spec_engine(model: str | None, k: int, **kw: object) -> LLMEngine:
    spec = SpecConfig(num_speculative_tokens=k, batch_k_caps=())
    return build_engine(model, speculative=spec, **kw)


def plain_greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(p, params)[0] for p in prompts]
    out: dict[str, list[int]] = {r: [] for r in rids}
    for o in engine.generate_until_done():
        out[o.request_id] += o.new_token_ids
    return [out[r] for r in rids]


@contextlib.contextmanager
def workers(p_engine: LLMEngine, d_engine: LLMEngine) -> Iterator[tuple]:
    p_engine.keep_hidden = True  # what build_worker_engine does for the prefill role
    P = Worker(WorkerConfig(role="prefill", worker_id="p0", cluster_secret=SECRET,
                            metrics_port=-1), engine=p_engine).start()
    D = Worker(WorkerConfig(role="decode", worker_id="d0", cluster_secret=SECRET,
                            metrics_port=-1), engine=d_engine).start()
    try:
        ps, ds = (pbg.WorkerStub(make_channel(w.address, cluster_secret=SECRET)) for w in (P, D))
        reply = ds.AddPeer(ps.GetPeerInfo(pb.GetPeerInfoRequest(), timeout=10), timeout=30)
        yield P, D, ps, ds, reply
    finally:
        P.stop()
        D.stop()


def disagg_greedy(ps, ds, rid: str, prompt: list[int], max_tokens: int) -> list[int]:
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    res = ps.Prefill(pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, params=params,
                                       timeout_s=60), timeout=65)
    assert len(res.last_hidden_state) > 0  # the hidden state travels for MTP drafting
    toks: list[int] = []
    for out in ds.Decode(pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt, params=params,
                                          prefill=res, timeout_s=60), timeout=65):
        toks += list(out.token_ids)
    return toks


def record_first_drafts(engine: LLMEngine) -> dict[str, list[int]]:
    """Drafts the decode engine holds for a request right after its KV arrived."""
    seen: dict[str, list[int]] = {}
    arrived = engine.kv_arrived

    def kv_arrived(request_id: str) -> None:
        arrived(request_id)
        seen[request_id] = list(engine.scheduler.spec_tokens.get(request_id, []))

    engine.kv_arrived = kv_arrived
    return seen


def test_tiny_qwen3_disaggregated_greedy_equals_colocated() -> None:
    expected = plain_greedy(build_engine("tiny-qwen3", **TINY), PROMPTS, 20)
    d_engine = spec_engine("tiny-qwen3", 3, **TINY)
    first = record_first_drafts(d_engine)
    with workers(spec_engine("tiny-qwen3", 3, **TINY), d_engine) as (P, D, ps, ds, reply):
        assert reply.accepted, reply.reason
        got = [disagg_greedy(ps, ds, f"r{i}", p, 20) for i, p in enumerate(PROMPTS)]
        assert got == expected
        assert all(len(first[f"r{i}"]) == 3 for i in range(len(PROMPTS)))  # drafted at once
        assert D.engine.spec_stats.num_drafts > 0
        # the MTP layer's KV of the prompt travelled in the same blocks as the target's
        rid, remote, local, n = D.decode.recent_pulls[-1]
        kv_p, kv_d, bs = P.engine.runner.kv_cache, D.engine.runner.kv_cache, 4
        mtp_layer = P.engine.config.model.num_layers
        for pos in range(n - 1):  # L-1 is recomputed on D from the shipped hidden state
            # a block is [Hkv, L, 2, BS, D]: the MTP layer's K and V of position pos
            a = kv_p[remote[pos // bs], :, mtp_layer, :, pos % bs]
            b = kv_d[local[pos // bs], :, mtp_layer, :, pos % bs]
            assert a.abs().sum() > 0
            torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_speculation_mismatch_is_refused_at_handshake() -> None:
    with workers(spec_engine("tiny-qwen3", 1, **TINY), build_engine("tiny-qwen3", **TINY)) as (
            _, _, _, _, reply):
        assert not reply.accepted
        assert "speculative" in reply.reason and "num_mtp_layers" in reply.reason
