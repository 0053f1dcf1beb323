"""Disaggregated == colocated greedy through the in-process KV transport: two Workers in this
process (engine loop + gRPC server on loopback each), KV copied between their engines by
kv_transfer/inproc_transport.py instead of NIXL. The real-NIXL versions of these checks run
in test_disagg.py (Ray actors) and tests/engine/test_spec_decode_disagg.py."""
from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdserve.engine.llm import build_engine
from pdserve.engine.llm_engine import LLMEngine
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pbg
from pdserve.proto.rpc import make_channel
from pdserve.worker.config import WorkerConfig
from pdserve.worker.server import Worker

from tests.cluster_secret import SECRET
from tests.engine.test_model_identity import edit_token, save_checkpoint
from tests.engine.test_spec_decode_disagg import plain_greedy

TINY = dict(device="cpu", block_size=4, num_blocks=256)
PROMPTS = [[7 + i, 3, 99, 2 * i + 1, 40, 11] * (i + 2) for i in range(3)]


@contextlib.contextmanager
def introduced(p_engine: LLMEngine, d_engine: LLMEngine, kv_transport: str = "inproc"
               ) -> Iterator[tuple[Worker, Worker, pbg.WorkerStub, pbg.WorkerStub, pb.AddPeerReply]]:
    """A prefill and a decode worker in this process over these engines, the decode worker
    introduced to the prefill one as the router does (AddPeer); yields its reply as well."""
    p_engine.keep_hidden = True  # as build_worker_engine does for the prefill role
    workers = [Worker(WorkerConfig(role=role, worker_id=wid, cluster_secret=SECRET,
                                   metrics_port=-1, kv_transport=kv_transport), engine=e).start()
               for role, wid, e in (("prefill", "ip-p", p_engine), ("decode", "ip-d", d_engine))]
    channels = [make_channel(w.address, cluster_secret=SECRET) for w in workers]
    try:
        ps, ds = (pbg.WorkerStub(ch) for ch in channels)
        reply = ds.AddPeer(ps.GetPeerInfo(pb.GetPeerInfoRequest(), timeout=10), timeout=30)
        yield workers[0], workers[1], ps, ds, reply
    finally:
        for ch in channels:
            ch.close()
        for w in workers:
            w.stop()


@contextlib.contextmanager
def inproc_pair(model: str, kv_transport: str = "inproc", **engine: object
                ) -> Iterator[tuple[Worker, Worker, pbg.WorkerStub, pbg.WorkerStub]]:
    """A prefill and a decode worker in this process, introduced; kv_transport "nixl" moves
    the KV over real NIXL (UCX, host memory) between their two agents."""
    with introduced(build_engine(model, **TINY, **engine), build_engine(model, **TINY, **engine),
                    kv_transport) as (p, d, ps, ds, reply):
        assert reply.accepted, reply.reason
        yield p, d, ps, ds


def disagg_greedy(ps: pbg.WorkerStub, ds: pbg.WorkerStub, rid: str, prompt: list[int],
                  n: int) -> list[int]:
    params = pb.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    res = ps.Prefill(pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, params=params,
                                       timeout_s=60), timeout=65)
    assert res.HasField("kv") and len(res.kv.block_ids) > 0
    toks: list[int] = []  # the decode stream starts with the prefill worker's first token
    for out in ds.Decode(pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt, params=params,
                                          prefill=res, timeout_s=60), timeout=65):
        toks += list(out.token_ids)
    assert toks[0] == res.first_token_id
    return toks


@pytest.mark.parametrize("model, engine", [("tiny-llama", {}),
                                           ("tiny-qwen3", {"speculative": "mtp",
                                                           "num_speculative_tokens": 2})])
def test_disaggregated_equals_colocated_through_the_inproc_transport(model, engine) -> None:
    expected = plain_greedy(build_engine(model, **TINY), PROMPTS, 16)
    with inproc_pair(model, **engine) as (P, D, ps, ds):
        got = [disagg_greedy(ps, ds, f"r{i}", p, 16) for i, p in enumerate(PROMPTS)]
        assert got == expected
        # the decode worker's blocks hold the prefill worker's KV, bit for bit (the last
        # block also takes the decoded tokens, and with MTP a recomputed position)
        rid, remote, local, n = D.decode.recent_pulls[-1]
        kv_p, kv_d = P.engine.runner.kv_cache, D.engine.runner.kv_cache
        assert len(remote) >= 3
        for r, loc in zip(remote[:-1], local[:-1]):
            torch.testing.assert_close(kv_d[loc], kv_p[r], atol=0, rtol=0)
        assert P.rt.health().num_pinned_blocks == 0  # every lease was released


def test_a_pair_of_other_weights_or_tokenizer_is_refused_at_introduction(tmp_path: Path) -> None:
    """One shape, other weights (another seed: a different fine-tune), one renamed token or
    the same weights quantized to FP8 at load: the decode worker refuses the prefill worker
    when they are introduced, naming what differs, instead of pulling KV that means
    something else (ANCHORS #8); the same checkpoint copied to another folder pairs."""
    ckpt = save_checkpoint(tmp_path / "p", 0)
    cases = [("identity.weights", save_checkpoint(tmp_path / "other-seed", 1), {}),
             ("identity.tokenizer", edit_token(Path(shutil.copytree(ckpt, tmp_path / "tok"))),
              {}),
             ("identity.quantization", ckpt, {"quantization": "fp8"}),
             (None, Path(shutil.copytree(ckpt, tmp_path / "copy")), {})]
    for field, folder, engine in cases:
        with introduced(build_engine(str(ckpt), **TINY),
                        build_engine(str(folder), **TINY, **engine)) as (P, D, _, _, reply):
            if field is None:
                assert reply.accepted, reply.reason
                continue
            assert not reply.accepted
            assert field in reply.reason, reply.reason
            assert reply.reason.count("identity.") == 1, reply.reason  # only that field
            assert P.rt.compat_hash != D.rt.compat_hash  # a stray handle is refused too
