"""An FP8 checkpoint served disaggregated: a prefill and a decode worker in-process, talking
gRPC + NIXL on loopback (CPU), produce the same greedy tokens as one colocated engine. The
KV that travels is computed from FP8 weights on the prefill side and read on the decode side,
so a weight-format mismatch between roles would show as different tokens."""
from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine.llm import build_engine
from pdserve.engine.model.fp8 import Fp8Linear
from pdserve.proto import pdserve_pb2 as pb

from tests.engine.test_fp8 import tiny, write_fp8
from tests.engine.test_spec_decode_disagg import plain_greedy, workers

TINY = dict(device="cpu", block_size=4, num_blocks=128)
PROMPTS = [[5 + i, 17, 60, 3 * i + 1, 42] * (i + 2) for i in range(3)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fp8_disagg")
    write_fp8(tiny("qwen3"), out, "block")
    return out


def _disagg(ps, ds, rid: str, prompt: list[int], max_tokens: int) -> list[int]:
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    res = ps.Prefill(pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, params=params,
                                       timeout_s=60), timeout=65)
    toks: list[int] = []
    for out in ds.Decode(pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt, params=params,
                                          prefill=res, timeout_s=60), timeout=65):
        toks += list(out.token_ids)
    return toks


def test_fp8_disaggregated_greedy_equals_colocated(folder: Path) -> None:
    colocated = build_engine(str(folder), **TINY)
    assert isinstance(colocated.runner.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    expected = plain_greedy(colocated, PROMPTS, 12)
    with workers(build_engine(str(folder), **TINY), build_engine(str(folder), **TINY)) as (
            P, D, ps, ds, reply):
        assert reply.accepted, reply.reason
        got = [_disagg(ps, ds, f"r{i}", p, 12) for i, p in enumerate(PROMPTS)]
        assert D.decode.recent_pulls  # the KV did travel over NIXL
    assert got == expected
