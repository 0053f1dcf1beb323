"""The fused MoE block: route -> align -> grouped gate_up (SiLU-and-mul) -> grouped down
(routing weights, top-k sum). kernels.reference.moe_route_ref + moe_experts_ref are the
contract; the pieces are kernels.moe_route, kernels.moe_align and kernels.moe_gemm.

Launches per MoE layer and step: fused_moe 4 (route, align + counter zeroing, gate_up,
down), 3 for decode-sized batches (route + align + counter zeroing in one launch:
kernels.moe_route.route_aligns); fused_experts (routing precomputed, e.g. by torch for a
prefill batch) 3 per chunk. Batches of one (and up to 4 tokens while pairs are few,
kernels.moe_gemv.use_gemv) take the one-row expert GEMVs instead: route, gate_up, down, no
alignment. H200, Qwen3-30B-A3B, batch 1, CUDA-graph replay of 8 layers: 35.4 us per MoE
block with the grouped GEMMs, 30.2-30.4 with the GEMVs in bf16; FP8 experts 41.5 -> 19.8 us.
Decode step: bf16 2.71 ms (355 tok/s), FP8 2.19 ms (431 tok/s)
(bench/results/moe_h200_2026-11-25_b1.json).
gate_up and down are programmatic dependent launches (PDL) behind the pdserve kernel before
them. Grouped GEMMs, H200, Qwen3-30B-A3B, batch 1, CUDA-graph replay of 8 layers: 34.9 us
per MoE block with 4 launches, 33.5 with 3. In the whole decode step
(3.64 -> 3.48 ms) router + alignment went from 0.75 to 0.31 ms of the critical path, but
gate_up's share rose from 0.74 to 0.97 ms (bench/results/moe_h200_2026-11-25.json,
moe_h200_2026-11-25_tuned.json; not yet explained).
Batch-1 decode layers hand the block the un-normed rows (fused_moe norm): the router
normalises in its prologue and stores the normed rows for gate_up, so the post-attention norm
kernel is gone, and it is a PDL launch behind o_proj's GEMV (pdl). H200, Qwen3-30B-A3B bf16,
same-build A/B of the batch-1 step (CUDA-graph replays): 2.528 -> 2.428 ms, 7 -> 6 kernels per
MoE decoder layer; critical path per step: norm 0.108 -> 0 ms, router 0.252 -> 0.232, gate_up
0.763 -> 0.773, down 0.467 -> 0.491. Without the router's PDL launch no gain (2.545 vs 2.534
ms); gate_up normalising in its own prologue instead of reading the stored rows: 2.471 ms
(bench/results/moe_h200_2026-11-25_b1_s14b.json, "norm_in_router_ab").
Nothing synchronises with the host and every shape depends on T only, so a decode step can
be captured in a CUDA graph. Experts without tokens cost nothing (kernels.moe_align).

First H200 numbers (bf16 experts, fp32 router, top-8 of 128, CUDA-graph replay of the 4
kernels; untuned GEMM tiles): Qwen3-30B-A3B shapes (H 2048, I 768) 50 us at batch 1, 97 at
4, 212 at 16, 327 at 64; GLM-4.5-Air shapes (H 4096, I 1408) 105 / 289 / 668 / 1039 us. The
GEMMs read the routed experts' weights at 3.8-4.5 TB/s; the torch reference takes 1.5-40 ms.
Called eagerly, the four launchers cost ~250-350 us of host time per layer (Python checks
and Triton's launch path): decode wants the CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels._triton import FLOAT_DTYPES, check_launchable, check_tensor
from pdserve.kernels.fp8_scales import FP8_DTYPE, Block, check_scales
from pdserve.kernels.moe_align import moe_align
from pdserve.kernels.moe_gemm import MoeConfig, down_counters, moe_down, moe_gate_up, pick_moe_config
from pdserve.kernels.moe_gemv import GemvMoeConfig, moe_down_gemv, moe_gate_up_gemv, use_gemv
from pdserve.kernels.moe_route import (
    Norm,
    RouteConfig,
    check_norm,
    moe_route,
    moe_route_align,
    route_aligns,
)
from pdserve.kernels.rmsnorm import fused_add_rmsnorm

# The down GEMM's deterministic top-k sum keeps fp32 rows [T * top_k, H]; batches beyond this
# many bytes of them run in token chunks (each chunk reads the experts' weights again): at
# H = 4096 and top-8, 8K tokens per chunk; at H = 2048 (Qwen3-30B-A3B), 16K.
SCRATCH_BYTES = 1 << 30


def chunk_tokens(H: int, top_k: int) -> int:
    """Tokens per chunk of fused_experts: the fp32 top-k scratch stays under SCRATCH_BYTES."""
    return max(1, SCRATCH_BYTES // (4 * H * top_k))


def _check_weights(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   fp8: Fp8Experts | None = None) -> None:
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_contiguous=True)
    check_launchable("x", x)
    H = x.shape[1]
    dtypes = (x.dtype, FP8_DTYPE) if fp8 is not None else (x.dtype,)
    check_tensor("w13", w13, shape=(None, None, H), dtypes=dtypes, device=x.device,
                 last_contiguous=True)
    E, two_i, _ = w13.shape
    if two_i % 2 or E < 1:
        raise ValueError(f"w13: expected [E, 2I, H] with E >= 1, got {tuple(w13.shape)}")
    check_tensor("w2", w2, shape=(E, H, two_i // 2), dtypes=dtypes, device=x.device,
                 last_contiguous=True)
    f = fp8 or Fp8Experts()
    check_scales(w13, f.w13_scale, f.blocks[0] if f.blocks else None, "w13")
    check_scales(w2, f.w2_scale, f.blocks[1] if f.blocks else None, "w2")


@dataclass(frozen=True)
class Fp8Experts:
    """FP8 expert weights' scales: w13_scale [E, ceil(2I / bn), ceil(H / bk)] and w2_scale
    [E, ceil(H / bn'), ceil(I / bk')] for blocks ((bn, bk), (bn', bk')) (kernels/fp8_scales.py);
    all None for float weights."""

    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    blocks: tuple[Block, Block] | None = None


def _check_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   fp8: Fp8Experts | None) -> None:
    _check_weights(x, w13, w2, fp8)
    T = x.shape[0]
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64),
                 device=x.device)
    check_tensor("topk_weights", topk_weights, shape=tuple(topk_ids.shape), dtypes=FLOAT_DTYPES,
                 device=x.device)
    if topk_ids.shape[0] != T or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids: expected [{T}, top_k >= 1], got {tuple(topk_ids.shape)}")
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous, strides {t.stride()}")


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  config: MoeConfig | GemvMoeConfig | None = None,
                  max_chunk: int | None = None, fp8: Fp8Experts | None = None) -> torch.Tensor:
    """moe_experts_ref(x, w13, w2, topk_weights, topk_ids) with Triton kernels: x [T, H] (rows
    may be strided), w13 [E, 2I, H], w2 [E, H, I] in x.dtype; topk_weights (any float dtype)
    and topk_ids (int32/int64, values in [0, E)) contiguous [T, top_k]. Returns a new [T, H]
    in x.dtype. max_chunk: tokens per chunk (default chunk_tokens(H, top_k)). fp8: the
    scales of float8_e4m3fn w13 / w2 (the reference: their dequantized weights). config: a
    GemvMoeConfig takes the one-row GEMVs, a MoeConfig the grouped GEMMs, None picks by rows
    (kernels.moe_gemv.use_gemv)."""
    _check_experts(x, w13, w2, topk_weights, topk_ids, fp8)
    T, H = x.shape
    E, top_k = w13.shape[0], topk_ids.shape[1]
    if _gemv_path(config, T, top_k, E):
        return _gemv_experts(x, w13, w2, topk_weights, topk_ids, config, fp8, pdl=False)
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    step = max_chunk or chunk_tokens(H, top_k)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        cfg = config or pick_moe_config((t1 - t0) * top_k, E, H, w2.shape[2], x.element_size(),
                                        x.device)
        _experts_chunk(x[t0:t1], w13, w2, topk_weights[t0:t1], topk_ids[t0:t1], out[t0:t1], cfg,
                       fp8)
    return out


def _experts_chunk(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor,
                   cfg: MoeConfig, fp8: Fp8Experts | None) -> None:
    """align (zeroing the down GEMM's counters in the same launch), gate_up, down into out."""
    T, top_k = topk_ids.shape
    counters = _counters(T, x.shape[1], top_k, cfg, x.device)
    sorted_ids, expert_ids, _ = moe_align(topk_ids, w13.shape[0], cfg.block_m, zero=counters)
    _gemms(x, w13, w2, topk_weights, sorted_ids, expert_ids, out, counters, cfg, fp8)


def _gemv_path(config: MoeConfig | GemvMoeConfig | None, T: int, top_k: int, E: int) -> bool:
    """The one-row GEMVs: asked for by their config, or chosen by rows when none is given."""
    return isinstance(config, GemvMoeConfig) or (config is None and use_gemv(T, top_k, E))


def _gemv_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  config: GemvMoeConfig | None, fp8: Fp8Experts | None, pdl: bool
                  ) -> torch.Tensor:
    """kernels.moe_gemv's gate_up then down (2 launches, no alignment); pdl: gate_up is a
    programmatic dependent launch (only behind a pdserve kernel), down always is."""
    f = fp8 or Fp8Experts()
    b13, b2 = f.blocks or (None, None)
    act = moe_gate_up_gemv(x, w13, topk_ids, config, pdl=pdl, w13_scale=f.w13_scale,
                           block=b13)
    return moe_down_gemv(act, w2, topk_weights, topk_ids, config, pdl=True,
                         w2_scale=f.w2_scale, block=b2, ids_ready=True)


def _counters(T: int, H: int, top_k: int, cfg: MoeConfig, device: torch.device
              ) -> torch.Tensor | None:
    """The down GEMM's arrival counters (zeroed by the alignment's launch); none for top-1."""
    if top_k == 1:
        return None
    return torch.empty(down_counters(T, H, cfg), dtype=torch.int32, device=device)


def _gemms(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
           sorted_ids: torch.Tensor, expert_ids: torch.Tensor, out: torch.Tensor,
           counters: torch.Tensor | None, cfg: MoeConfig, fp8: Fp8Experts | None) -> None:
    """gate_up then down into out, each a programmatic dependent launch behind the pdserve
    kernel before it (alignment, gate_up): scheduled while that one drains."""
    f = fp8 or Fp8Experts()
    b13, b2 = f.blocks or (None, None)
    act = moe_gate_up(x, w13, sorted_ids, expert_ids, topk_weights.shape[1], cfg, pdl=True,
                      w13_scale=f.w13_scale, block=b13)
    moe_down(act, w2, topk_weights, sorted_ids, expert_ids, cfg, out=out, counters=counters,
             pdl=True, w2_scale=f.w2_scale, block=b2)


def fused_moe(x: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor, top_k: int, scoring: str = "softmax",
              correction_bias: torch.Tensor | None = None, n_group: int = 1,
              topk_group: int = 1, renormalize: bool = True, routed_scaling: float = 1.0,
              config: MoeConfig | GemvMoeConfig | None = None,
              route_config: RouteConfig | None = None,
              max_chunk: int | None = None, fp8: Fp8Experts | None = None,
              norm: Norm | None = None, pdl: bool = False) -> torch.Tensor:
    """The MoE block's routed experts for x [T, H]: moe_route (router_weight [E, H] and the
    routing arguments as kernels.reference.moe_route_ref) then fused_experts. Returns a new
    [T, H] in x.dtype. 4 launches for a batch of up to chunk_tokens(H, top_k) tokens; 3 for
    decode-sized batches (route_aligns: the router's launch aligns the pairs too); 3 with no
    alignment at all where the one-row GEMVs serve (kernels.moe_gemv.use_gemv). fp8 and
    config: as fused_experts'. norm (weight [H], eps): x holds the un-normed rows h and the
    block runs on rmsnorm(h) * weight: on the GEMV path the router normalises (its prologue)
    and stores the normed rows for gate_up (no norm kernel: 3 launches), else one
    fused_add_rmsnorm launch first.
    pdl: on the GEMV path the router is a programmatic dependent launch (behind a pdserve
    kernel that triggers its dependents, e.g. the o_proj GEMV of kernels.gemv)."""
    check_tensor("router_weight", router_weight, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("w13", w13, ndim=3, dtypes=(*FLOAT_DTYPES, FP8_DTYPE))
    if router_weight.shape[0] != w13.shape[0]:
        raise ValueError(f"router_weight: {router_weight.shape[0]} experts, w13 has "
                         f"{w13.shape[0]}")
    routing = dict(scoring=scoring, correction_bias=correction_bias, n_group=n_group,
                   topk_group=topk_group, renormalize=renormalize, routed_scaling=routed_scaling)
    T, H = x.shape if isinstance(x, torch.Tensor) and x.dim() == 2 else (0, 0)
    E = w13.shape[0]
    device = x.device if isinstance(x, torch.Tensor) else None
    if T and _gemv_path(config, T, top_k, E):  # route (PDL trigger), gate_up, down
        _check_weights(x, w13, w2, fp8)
        wts, ids, *normed = moe_route(x, router_weight, top_k, config=route_config,
                                      trigger_dependents=True, norm=norm, pdl=pdl, **routing)
        return _gemv_experts(normed[0] if normed else x, w13, w2, wts, ids, config, fp8,
                             pdl=True)
    if norm is not None:  # the grouped GEMMs take normed rows: one norm kernel first
        check_norm(norm, check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES))
        x, _ = fused_add_rmsnorm(x, None, norm[0], norm[1])
    if route_aligns(T, E, H, top_k, route_config, device) and \
            T <= (max_chunk or chunk_tokens(H, top_k)):
        return _fused_decode(x, router_weight, w13, w2, top_k, routing, config, route_config,
                             fp8)
    topk_weights, topk_ids = moe_route(x, router_weight, top_k, config=route_config, **routing)
    return fused_experts(x, w13, w2, topk_weights, topk_ids, config=config, max_chunk=max_chunk,
                         fp8=fp8)


def _fused_decode(x: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, top_k: int, routing: dict, config: MoeConfig | None,
                  route_config: RouteConfig | None, fp8: Fp8Experts | None) -> torch.Tensor:
    """Decode-sized batches in 3 launches: route + align (+ counter zeroing), gate_up, down;
    the router lets gate_up be scheduled early (PDL), gate_up lets down."""
    _check_weights(x, w13, w2, fp8)
    T, H = x.shape
    E, inter = w13.shape[0], w2.shape[2]
    cfg = config or pick_moe_config(T * top_k, E, H, inter, x.element_size(), x.device)
    counters = _counters(T, H, top_k, cfg, x.device)
    wts, _, sorted_ids, expert_ids, _ = moe_route_align(
        x, router_weight, top_k, cfg.block_m, zero=counters, config=route_config,
        trigger_dependents=True, **routing)
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    _gemms(x, w13, w2, wts, sorted_ids, expert_ids, out, counters, cfg, fp8)
    return out
