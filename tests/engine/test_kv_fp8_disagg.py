"""FP8 KV across the prefill/decode split: two in-process workers, gRPC + real NIXL (CPU).

The blocks move as e4m3 values with their per-(block, layer, KV head) scales in the same
region, so the decode worker's received blocks equal the prefill worker's byte for byte,
and greedy decoding equals colocated decoding over an FP8 cache. A decode worker with a
bf16/float cache refuses an FP8 prefill worker at the handshake, naming the field.
"""
from __future__ import annotations

import torch

from pdserve.engine.exec.kv_cache import block_scales
from pdserve.engine.llm import build_engine
from pdserve.kernels.kv_quant import FP8
from pdserve.proto import pdserve_pb2 as pb

from tests.engine.test_spec_decode_disagg import plain_greedy, workers

FP8_TINY = dict(device="cpu", block_size=4, num_blocks=256, kv_cache_dtype="fp8")
PROMPTS = [[5 + i, 17, 99, 3 * i + 1, 42] * (i + 2) for i in range(3)]


def _colocated(prompts: list[list[int]], n: int) -> list[list[int]]:
    return plain_greedy(build_engine("tiny-qwen3", **FP8_TINY), prompts, n)


def _disagg(ps, ds, rid: str, prompt: list[int], n: int) -> list[int]:
    params = pb.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    res = ps.Prefill(pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, params=params,
                                       timeout_s=60), timeout=65)
    toks: list[int] = []
    for out in ds.Decode(pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt,
                                          params=params, prefill=res, timeout_s=60), timeout=65):
        toks += list(out.token_ids)
    return toks


def test_fp8_blocks_and_scales_move_bitwise_and_greedy_equals_colocated() -> None:
    expected = _colocated(PROMPTS, 12)
    with workers(build_engine("tiny-qwen3", **FP8_TINY),
                 build_engine("tiny-qwen3", **FP8_TINY)) as (P, D, ps, ds, reply):
        assert reply.accepted, reply.reason
        kv_p, kv_d = P.engine.runner.kv_cache, D.engine.runner.kv_cache
        assert kv_p.dtype == kv_d.dtype == FP8
        got = []
        for i, p in enumerate(PROMPTS):
            got.append(_disagg(ps, ds, f"r{i}", p, 12))
            _, remote, local, n = D.decode.recent_pulls[-1]
            full = n // 4  # whole blocks: D's decode appends to the last partial one
            assert full >= 2
            a, b = kv_p[remote[:full]], kv_d[local[:full]]
            assert block_scales(kv_p)[remote[:full]].gt(0).all()  # scales were written
            assert (a.view(torch.uint8) == b.view(torch.uint8)).all()  # values and scales, bitwise
        assert got == expected


def test_float_decode_refuses_fp8_prefill_naming_the_field() -> None:
    plain = dict(FP8_TINY, kv_cache_dtype="auto")
    with workers(build_engine("tiny-qwen3", **FP8_TINY),
                 build_engine("tiny-qwen3", **plain)) as (_, _, _, _, reply):
        assert not reply.accepted
        assert "kv_cache_dtype" in reply.reason and "kv_dtype" in reply.reason
