"""kernels.moe_gemv (one-row expert GEMVs for decode batches) against the torch reference
(kernels.reference.moe_experts_ref) and the grouped tensor-core GEMMs (kernels.moe_gemm), on
odd sizes: E, top_k, H and I not multiples of the tiles, FP8 scale blocks cut by the edges."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pdserve.kernels.fused_moe import Fp8Experts, fused_experts, fused_moe
from pdserve.kernels.moe_gemm import MoeConfig
from pdserve.kernels.moe_gemv import (
    GemvMoeConfig,
    moe_down_gemv,
    moe_gate_up_gemv,
    pick_gemv_config,
    use_gemv,
)
from pdserve.kernels.reference import fp8_dequant_ref, moe_experts_ref, moe_route_ref

from tests.kernels.test_fp8_gemv import fp8_weight

H, I = 50, 36  # neither a multiple of any tile below
TILE = GemvMoeConfig(16, 16, 16, 16)  # several programs and K steps, partial edges
TC = MoeConfig(16, 16, 16, 16, 16)  # the grouped GEMMs, for the same result


def _moe(T: int, E: int, dtype, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed * 7919 + T * 131 + E)
    x = torch.randn(T, H + 3, generator=gen)[:, :H].to(device, dtype)  # strided rows
    router = (torch.randn(E, H, generator=gen) / H ** 0.5).to(device)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5).to(device, dtype)
    w2 = (torch.randn(E, H, I, generator=gen) / I ** 0.5).to(device, dtype)
    return x, router, w13, w2


@pytest.mark.parametrize("T,E,top_k,dtype", [(1, 7, 1, torch.float32), (1, 13, 2, torch.float32),
                                             (1, 60, 8, torch.bfloat16),
                                             (3, 61, 2, torch.bfloat16), (4, 9, 8, torch.float32)])
def test_gemv_experts_match_reference_and_grouped_gemms(T, E, top_k, dtype, device, close):
    x, router, w13, w2 = _moe(T, E, dtype, device)
    wts, ids = moe_route_ref(x, router, top_k)
    got = fused_experts(x, w13, w2, wts, ids.to(torch.int32), config=TILE)
    assert got.shape == (T, H) and got.dtype == dtype and got.is_contiguous()
    close(got, moe_experts_ref(x, w13, w2, wts, ids), dtype)
    close(got, fused_experts(x, w13, w2, wts, ids, config=TC), dtype)


@pytest.mark.parametrize("T,E,top_k", [(1, 60, 8), (3, 61, 2)])
def test_down_preload_equals_the_loop(T, E, top_k, device, close):
    """preload_down (ids, routing weights and the first weight tile read before the PDL
    wait, the first K step peeled off the loop): the same output as without, 16-wide K steps
    over I = 36 (the peeled step, a full one, a partial one)."""
    x, router, w13, w2 = _moe(T, E, torch.bfloat16, device, seed=4)
    wts, ids = moe_route_ref(x, router, top_k)
    got = fused_experts(x, w13, w2, wts, ids, config=replace(TILE, preload_down=True))
    close(got, fused_experts(x, w13, w2, wts, ids, config=TILE), torch.bfloat16)
    close(got, moe_experts_ref(x, w13, w2, wts, ids), torch.bfloat16)


def test_gate_up_alone_and_default_tiles(device, close):
    """act rows in pair order, and the default (picked) tiles give the same output."""
    x, router, w13, w2 = _moe(2, 11, torch.float32, device, seed=3)
    wts, ids = moe_route_ref(x, router, 3)
    act = moe_gate_up_gemv(x, w13, ids, TILE)
    ref = torch.stack([torch.nn.functional.silu(w13[e, :I] @ x[p // 3]) * (w13[e, I:] @ x[p // 3])
                       for p, e in enumerate(ids.flatten().tolist())])
    close(act, ref, torch.float32)
    close(moe_down_gemv(act, w2, wts, ids), moe_experts_ref(x, w13, w2, wts, ids), torch.float32)
    close(moe_gate_up_gemv(x, w13, ids), act, torch.float32)


def test_fused_moe_takes_the_gemv_at_batch_one(device, close):
    """fused_moe's default path at batch 1 (route with the PDL trigger, then the GEMVs) equals
    the reference with group-limited sigmoid routing and a correction bias."""
    x, router, w13, w2 = _moe(1, 12, torch.bfloat16, device, seed=5)
    bias = (0.04 * torch.rand(12, generator=torch.Generator().manual_seed(9)) - 0.02).to(device)
    route = {"scoring": "sigmoid", "correction_bias": bias, "n_group": 4, "topk_group": 3,
             "routed_scaling": 2.5}
    out = fused_moe(x, router, w13, w2, 4, **route)
    wts, ids = moe_route_ref(x, router, 4, **route)
    close(out, moe_experts_ref(x, w13, w2, wts, ids), torch.bfloat16)


def test_dispatch_by_rows():
    assert use_gemv(1, 8, 8) and use_gemv(4, 8, 128) and use_gemv(2, 2, 16)
    assert not use_gemv(5, 1, 128) and not use_gemv(2, 8, 60) and not use_gemv(0, 2, 8)


def fp8_experts(E: int, blocks, device):
    parts = [[fp8_weight(n, k, b, device, 10 * e) for e in range(E)]
             for (n, k), b in (((2 * I, H), blocks[0]), ((H, I), blocks[1]))]
    (w13, s13), (w2, s2) = [(torch.stack([w for w, _ in p]), torch.stack([s for _, s in p]))
                            for p in parts]
    return w13, w2, Fp8Experts(s13.contiguous(), s2.contiguous(), blocks)


# square blocks cut by both edges (I = 36 splits a 16-row block between gate and up, H = 50
# and I = 36 end inside a K block), per-row blocks, per channel
FP8_BLOCKS = {"square": ((16, 32), (16, 16)), "per_row": ((1, 16), (16, 32)),
              "channel": ((1, H), (1, I)), "square8": ((8, 16), (8, 32))}
# 16-row tiles: gate_up's up rows start inside a 16-row block (I = 36), so its scales go per
# row with the K step cut to the K block (SCALE 2), down's per K lane (SCALE 1); 4-row tiles
# in 8-row blocks: both per K lane, K steps of 64 over K blocks of 16 / 32
FP8_TILES = {"rows16": GemvMoeConfig(16, 64, 16, 64), "rows4": GemvMoeConfig(4, 64, 4, 64),
             "rows4_preload": GemvMoeConfig(4, 64, 4, 16, preload_down=True)}


@pytest.mark.parametrize("tile", sorted(FP8_TILES))
@pytest.mark.parametrize("layout", sorted(FP8_BLOCKS))
@pytest.mark.parametrize("T,E,top_k,dtype", [(1, 7, 3, torch.bfloat16), (2, 9, 1, torch.float32)])
def test_fp8_gemv_matches_reference(tile, layout, T, E, top_k, dtype, device, close):
    w13, w2, fp8 = fp8_experts(E, FP8_BLOCKS[layout], device)
    x, router, _, _ = _moe(T, E, dtype, device, seed=2)
    wts, ids = moe_route_ref(x, router, top_k)
    got = fused_experts(x, w13, w2, wts, ids, config=FP8_TILES[tile], fp8=fp8)
    d13 = fp8_dequant_ref(w13, fp8.w13_scale, fp8.blocks[0]).to(dtype)
    d2 = fp8_dequant_ref(w2, fp8.w2_scale, fp8.blocks[1]).to(dtype)
    close(got, moe_experts_ref(x, d13, d2, wts, ids), dtype)
    close(got, fused_experts(x, w13, w2, wts, ids, config=TC, fp8=fp8), dtype)


def test_bad_inputs_are_refused_by_name(device):
    x, router, w13, w2 = _moe(2, 5, torch.float32, device)
    ids = torch.zeros(2, 2, dtype=torch.int32, device=device)
    wts = torch.ones(2, 2, device=device)
    with pytest.raises(ValueError, match="topk_ids"):
        moe_gate_up_gemv(x, w13, ids[:1])
    with pytest.raises(ValueError, match="topk_ids: must be contiguous"):
        moe_gate_up_gemv(x, w13, ids.t())
    act = moe_gate_up_gemv(x, w13, ids)
    with pytest.raises(ValueError, match="act"):
        moe_down_gemv(act[:3], w2, wts, ids)
    with pytest.raises(ValueError, match="config"):
        moe_down_gemv(act, w2, wts, ids, config=GemvMoeConfig(12, 16, 16, 16))
    with pytest.raises(ValueError, match="w13_scale"):
        moe_gate_up_gemv(x, w13, ids, w13_scale=torch.ones(5, 1, 1, device=device))


def test_default_tiles_are_valid():
    for h, i, size in ((2048, 768, 2), (4096, 1408, 1), (50, 36, 2)):
        pick_gemv_config(128, h, i, size).check()
