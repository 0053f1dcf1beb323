"""Grouped GEMMs of the MoE experts over kernels.moe_align's blocks (one expert per block).

Program (b, n) reads block b of sorted_ids (block_m pair ids p = t * top_k + j, all routed
to expert expert_ids[b]; padding rows hold N = T * top_k and are masked) and one BLOCK_N
tile of output columns; blocks past the last expert (expert id -1) return at once, so experts
that receive no tokens cost one early-exiting program per empty block slot, nothing per expert.

gate_up: act[p, n] = silu(x[t] . w13[e, n]) * (x[t] . w13[e, I + n]), two fp32 accumulators,
         SiLU-and-mul in the epilogue, act [N, I] stored in x.dtype in pair order.
down:    y[p, h] = topk_weights[p] * (act[p] . w2[e, h]) in fp32, then the top-k sum
         out[t, h] = sum_j y[t * top_k + j, h], stored in x.dtype.

The top-k sum is deterministic, not fp32 atomics: each program stores its weighted rows to an
fp32 scratch [N, H] and bumps, per row, the arrival counter of (token, column tile); the
program whose row is the token's top_k-th arrival adds the token's top_k rows in slot order
j = 0..top_k-1 and stores out[t] once. atomic_add into an fp32 [T, H] buffer would add in
arrival order, so the same batch could round differently from run to run (greedy outputs that
change between identical requests, P/D replays that do not reproduce), and it needs a zero-fill
and a final cast to x.dtype: two more launches than this. The cost is the scratch: N * H * 4
bytes (kernels.fused_moe bounds it by running large batches in token chunks). The counters
are zeroed by the alignment launch before (kernels.moe_align's `zero`), not reset here, so a
token whose pairs never all arrive (an id outside [0, E), a caller error) cannot leave a
counter that breaks a later launch. top_k = 1 stores out directly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.kernels._triton import (
    FLOAT_DTYPES,
    check_launchable,
    check_tensor,
    dot_dtype,
    dot_precision,
    interpreting,
    jit,
    next_pow2,
    pdl_enter,
    pdl_launch,
)
from pdserve.kernels.fp8_scales import FP8_DTYPE, Block, check_scales, fit_block_k, fp8_n_scales, kernel_block
from pdserve.kernels.gemv import device_entry


@dataclass(frozen=True)
class MoeConfig:
    block_m: int  # rows per block (kernels.moe_align's block_m)
    block_n_up: int  # columns of I per gate_up program (gate and up tiles each)
    block_k_up: int  # steps over H
    block_n_down: int  # columns of H per down program
    block_k_down: int  # steps over I
    num_warps: int = 4
    num_stages: int = 3
    # the down GEMM's, where they differ from gate_up's (None: the same)
    num_warps_down: int | None = None
    num_stages_down: int | None = None

    def down_launch(self) -> dict:
        return {"num_warps": self.num_warps_down or self.num_warps,
                "num_stages": self.num_stages_down or self.num_stages}

    def check(self) -> None:
        sizes = (self.block_m, self.block_n_up, self.block_k_up, self.block_n_down,
                 self.block_k_down)
        if any(s < 16 or s & (s - 1) for s in sizes):
            raise ValueError(f"config: tile sizes must be powers of 2 >= 16 (tl.dot), got {self}")


# Tiles measured per device for decode batches (at most one pair per 4 experts: nearly every
# block holds one row), where they beat pick_moe_config's rule by >= 3%: {device name
# fragment: {(E, H, I): MoeConfig}} (kernels.gemv's device_entry; `python -m
# bench.lab.bench_moe --sweep` measures them at batch 1, "gate_up" / "down"). H200,
# Qwen3-30B-A3B at batch 1: none did. gate_up 16.0 us (3.1 TB/s of its 50 MB) with the rule's
# 32 x 128, 64 x 128 15.6, 16-wide 18.6-19.0, 8 warps 17.8; down 11.75 us (counter zeroing
# included) with 64 x 128, 32 x 128 on 2 warps 11.73, 16-wide 14.4; and the two best
# together with the best router tile took 38.9 us per MoE block where the rule's took 33.5
# (bench/results/moe_h200_2026-11-25_tuned.json).
DEVICE_TILES: dict[str, dict[tuple[int, int, int], MoeConfig]] = {
    "H200": {},
}


def pick_moe_config(num_pairs: int, num_experts: int, H: int, I: int,
                    elem_size: int = 2, device: torch.device | None = None) -> MoeConfig:
    """Decode (a few pairs per expert): 16-row blocks, the least padding tl.dot allows; prefill:
    64-row blocks. GPU tiles after vLLM's fused_moe defaults (M <= E: 16 x 32/64 x 64-128);
    at batch 1 on the H200 no swept tile beat them (see DEVICE_TILES); fp32 halves the K
    step. The interpreter takes the biggest tiles that the shapes use, so that it runs few
    programs. device: decode batches take that device's DEVICE_TILES entry for (E, H, I)
    where there is one (16-bit weights)."""
    if num_pairs * 4 <= num_experts and elem_size <= 2:
        tile = device_entry(DEVICE_TILES, device, (num_experts, H, I))
        if tile is not None:
            return tile
    per_expert = num_pairs / max(1, num_experts)
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
    if interpreting():
        up, down = min(64, max(16, next_pow2(I))), min(64, max(16, next_pow2(H)))
        return MoeConfig(block_m, up, min(128, max(16, next_pow2(H))), down,
                         min(128, max(16, next_pow2(I))))
    k_step = 128 if elem_size <= 2 else 64
    if block_m == 16:
        return MoeConfig(16, 32, k_step, 64, k_step, num_warps=4, num_stages=4)
    return MoeConfig(block_m, 64, k_step // 2, 128, k_step // 2, num_warps=8 if block_m == 64
                     else 4, num_stages=3)


@jit
def _gate_up_kernel(x_ptr, w_ptr, act_ptr, sorted_ptr, expert_ptr, s_ptr, N, H, I, stride_x,
                    stride_we, stride_wn, stride_act, stride_se, stride_sn, TOP_K: tl.constexpr,
                    SCALED: tl.constexpr, S_BN: tl.constexpr, S_BK: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PREC: tl.constexpr, DOT_DTYPE: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    b = tl.program_id(0)
    e = tl.load(expert_ptr + b)
    if e < 0:  # past the last expert's blocks
        return
    pairs = tl.load(sorted_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < N
    x_rows = x_ptr + (pairs // TOP_K)[:, None].to(tl.int64) * stride_x
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    w_gate = w_ptr + e.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    w_up = w_gate + I * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < H
        a = tl.load(x_rows + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = n_ok[:, None] & k_ok[None, :]
        wg = tl.load(w_gate + offs_k[None, :], mask=w_mask, other=0.0)
        wu = tl.load(w_up + offs_k[None, :], mask=w_mask, other=0.0)
        if SCALED:  # FP8 expert weights: dequantized in registers (each K step in one block)
            s_e = s_ptr + e.to(tl.int64) * stride_se
            wg = wg.to(tl.float32) * fp8_n_scales(s_e, offs_n, I, k0, stride_sn, S_BN, S_BK)[:, None]
            wu = wu.to(tl.float32) * fp8_n_scales(s_e, I + offs_n, 2 * I, k0, stride_sn, S_BN,
                                                  S_BK)[:, None]
        a = a.to(DOT_DTYPE)
        acc_g += tl.dot(a, tl.trans(wg.to(DOT_DTYPE)), input_precision=PREC)
        acc_u += tl.dot(a, tl.trans(wu.to(DOT_DTYPE)), input_precision=PREC)
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(act_ptr + pairs[:, None].to(tl.int64) * stride_act + offs_n[None, :], act,
             mask=row_ok[:, None] & n_ok[None, :])


@jit
def _down_kernel(act_ptr, w_ptr, wts_ptr, out_ptr, part_ptr, count_ptr, sorted_ptr, expert_ptr,
                 s_ptr, N, H, I, stride_act, stride_we, stride_wn, stride_out, stride_se,
                 stride_sn, TOP_K: tl.constexpr, SCALED: tl.constexpr, S_BN: tl.constexpr,
                 S_BK: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PREC: tl.constexpr, DOT_DTYPE: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    b = tl.program_id(0)
    e = tl.load(expert_ptr + b)
    if e < 0:
        return
    n = tl.program_id(1)
    pairs = tl.load(sorted_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < N
    a_rows = act_ptr + pairs[:, None].to(tl.int64) * stride_act
    offs_n = n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    w_rows = w_ptr + e.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < I
        a = tl.load(a_rows + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if SCALED:
            w = w.to(tl.float32) * fp8_n_scales(s_ptr + e.to(tl.int64) * stride_se, offs_n, H, k0,
                                                stride_sn, S_BN, S_BK)[:, None]
        acc += tl.dot(a.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), input_precision=PREC)
    acc = acc * tl.load(wts_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    tok = (pairs // TOP_K).to(tl.int64)
    if TOP_K == 1:
        tl.store(out_ptr + tok[:, None] * stride_out + offs_n[None, :], acc,
                 mask=row_ok[:, None] & n_ok[None, :])
    else:
        _sum_top_k(acc, part_ptr, count_ptr, out_ptr, pairs, row_ok, tok, offs_n, n_ok, n, H,
                   stride_out, TOP_K)


@jit
def _sum_top_k(acc, part_ptr, count_ptr, out_ptr, pairs, row_ok, tok, offs_n, n_ok, n, H,
               stride_out, TOP_K: tl.constexpr):
    """Store this block's weighted rows to the fp32 scratch [N, H]; for each token whose last
    pair this was, out[t] = the sum of its TOP_K rows in slot order (see the module docstring)."""
    tl.store(part_ptr + pairs[:, None].to(tl.int64) * H + offs_n[None, :], acc,
             mask=row_ok[:, None] & n_ok[None, :])
    tl.debug_barrier()  # every thread's rows stored before the releases below
    # counters [T, column tiles]; each row's old count (rows of one token add one each)
    tiles = tl.num_programs(1)
    seen = tl.atomic_add(count_ptr + tok * tiles + n, 1, mask=row_ok, sem="acq_rel")
    last = row_ok & (seen == TOP_K - 1)
    tl.debug_barrier()  # the acquiring threads' view before any thread reads the rows
    mask = last[:, None] & n_ok[None, :]
    total = tl.zeros_like(acc)
    for j in tl.static_range(TOP_K):
        rows = (tok * TOP_K + j)[:, None] * H + offs_n[None, :]
        total += tl.load(part_ptr + rows, mask=mask, other=0.0, cache_modifier=".cg")
    tl.store(out_ptr + tok[:, None] * stride_out + offs_n[None, :], total, mask=mask)


def _check_blocks(sorted_ids: torch.Tensor, expert_ids: torch.Tensor, cfg: MoeConfig,
                  device: torch.device) -> None:
    check_tensor("expert_ids", expert_ids, ndim=1, dtypes=(torch.int32,), device=device)
    check_tensor("sorted_ids", sorted_ids, shape=(expert_ids.numel() * cfg.block_m,),
                 dtypes=(torch.int32,), device=device)
    for name, t in (("sorted_ids", sorted_ids), ("expert_ids", expert_ids)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous, strides {t.stride()}")


def fp8_launch(w: torch.Tensor, scales: torch.Tensor | None, block: Block | None,
               block_n: int, block_k: int) -> tuple[dict, int]:
    """The GEMM kernels' scale arguments for expert weights w [E, N, K] (FP8: scales
    [E, gn, gk]) and the K step, shrunk until each step lies in one K block."""
    if scales is None:
        return ({"s_ptr": w, "stride_se": 0, "stride_sn": 0, "SCALED": False, "S_BN": 1,
                 "S_BK": 1}, block_k)
    N, K = w.shape[1], w.shape[2]
    block_k = fit_block_k((1, block[1]), N, K, block_n, block_k)  # per-row way (SCALE 2)
    s_bn, s_bk = kernel_block(block, N, K)
    return ({"s_ptr": scales, "stride_se": scales.stride(0), "stride_sn": scales.stride(1),
             "SCALED": True, "S_BN": s_bn, "S_BK": s_bk}, block_k)


def check_gate_up(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor | None,
                  block: Block | None) -> None:
    """The gate_up launchers' shared checks: x [T, H] float rows, w13 [E, 2I, H] in x's dtype
    or FP8 (with its scales for `block`), gate rows over up rows."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_contiguous=True)
    check_launchable("x", x)
    check_tensor("w13", w13, shape=(None, None, x.shape[1]), dtypes=(x.dtype, FP8_DTYPE),
                 device=x.device, last_contiguous=True)
    check_scales(w13, w13_scale, block, "w13")
    if w13.shape[1] % 2:
        raise ValueError(f"w13: {w13.shape[1]} rows per expert; expected [gate | up], 2 * I")


def moe_gate_up(x: torch.Tensor, w13: torch.Tensor, sorted_ids: torch.Tensor,
                expert_ids: torch.Tensor, top_k: int, config: MoeConfig, pdl: bool = False,
                w13_scale: torch.Tensor | None = None, block: Block | None = None
                ) -> torch.Tensor:
    """act [T * top_k, I] (x.dtype, pair order) = silu(x[t] @ gate_e.T) * (x[t] @ up_e.T) for
    x [T, H] (rows may be strided) and w13 [E, 2I, H] (gate rows over up rows), over the
    blocks of kernels.moe_align(topk_ids, E, config.block_m). One kernel launch. pdl: a
    programmatic dependent launch (only right after another pdserve Triton kernel: after a
    cuBLAS GEMM, PDL broke CUDA-graph captures, see kernels.rmsnorm). FP8: w13
    float8_e4m3fn with w13_scale [E, ceil(2I / bn), ceil(H / bk)] for block (bn, bk),
    dequantized tile by tile in registers (activations stay in x.dtype)."""
    check_gate_up(x, w13, w13_scale, block)
    if top_k < 1:
        raise ValueError(f"top_k: must be >= 1, got {top_k}")
    config.check()
    _check_blocks(sorted_ids, expert_ids, config, x.device)
    T, H = x.shape
    inter = w13.shape[1] // 2
    act = torch.empty((T * top_k, inter), dtype=x.dtype, device=x.device)
    if T == 0 or expert_ids.numel() == 0:
        return act
    grid = (expert_ids.numel(), triton.cdiv(inter, config.block_n_up))
    fp8, block_k = fp8_launch(w13, w13_scale, block, config.block_n_up, config.block_k_up)
    _gate_up_kernel[grid](
        x, w13, act, sorted_ids, expert_ids, N=T * top_k, H=H, I=inter, stride_x=x.stride(0),
        stride_we=w13.stride(0), stride_wn=w13.stride(1), stride_act=act.stride(0), TOP_K=top_k,
        **fp8, BLOCK_M=config.block_m, BLOCK_N=config.block_n_up, BLOCK_K=block_k,
        PREC=dot_precision(x.dtype),
        DOT_DTYPE=dot_dtype(x.dtype), num_warps=config.num_warps, num_stages=config.num_stages,
        **(pdl_launch(x) if pdl else {"USE_PDL": False}))
    return act


def down_counters(num_tokens: int, H: int, config: MoeConfig) -> int:
    """int32 arrival counters moe_down needs zeroed: one per (token, column tile)."""
    return num_tokens * triton.cdiv(H, config.block_n_down)


def _check_down(act: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                out: torch.Tensor | None, counters: torch.Tensor | None, cfg: MoeConfig,
                w2_scale: torch.Tensor | None, block: Block | None) -> None:
    check_tensor("act", act, ndim=2, dtypes=FLOAT_DTYPES, last_contiguous=True)
    check_launchable("act", act)
    check_tensor("w2", w2, shape=(None, None, act.shape[1]), dtypes=(act.dtype, FP8_DTYPE),
                 device=act.device, last_contiguous=True)
    check_scales(w2, w2_scale, block, "w2")
    check_tensor("topk_weights", topk_weights, ndim=2, dtypes=FLOAT_DTYPES, device=act.device)
    T, top_k = topk_weights.shape
    if not topk_weights.is_contiguous() or top_k < 1 or T * top_k != act.shape[0]:
        raise ValueError(f"topk_weights: expected a contiguous [T, top_k] with T * top_k = "
                         f"{act.shape[0]} (act's rows), got {tuple(topk_weights.shape)}")
    if out is not None:
        check_tensor("out", out, shape=(T, w2.shape[1]), dtypes=(act.dtype,), device=act.device,
                     last_contiguous=True)
    if counters is not None:
        check_tensor("counters", counters, ndim=1, dtypes=(torch.int32,), device=act.device)
        if counters.numel() < down_counters(T, w2.shape[1], cfg) or not counters.is_contiguous():
            raise ValueError(f"counters: {counters.numel()} elements; need a contiguous "
                             f"{down_counters(T, w2.shape[1], cfg)}")


def moe_down(act: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             sorted_ids: torch.Tensor, expert_ids: torch.Tensor, config: MoeConfig,
             out: torch.Tensor | None = None, counters: torch.Tensor | None = None,
             pdl: bool = False, w2_scale: torch.Tensor | None = None,
             block: Block | None = None) -> torch.Tensor:
    """out [T, H] = sum_j topk_weights[t, j] * (act[t * top_k + j] @ w2[e].T) in fp32, stored
    in act.dtype, for act [T * top_k, I] (moe_gate_up's), w2 [E, H, I], topk_weights
    [T, top_k] (contiguous, any float dtype). out: where to write (rows contiguous), default
    new. counters: down_counters(T, H, config) zeroed int32s (kernels.moe_align zeroes them
    in its launch); default a torch.zeros (one more launch). One kernel launch; pdl as
    moe_gate_up's; FP8 w2 with w2_scale as moe_gate_up's w13."""
    _check_down(act, w2, topk_weights, out, counters, config, w2_scale, block)
    config.check()
    _check_blocks(sorted_ids, expert_ids, config, act.device)
    (T, top_k), (_, H, inter) = topk_weights.shape, w2.shape
    if out is None:
        out = torch.empty((T, H), dtype=act.dtype, device=act.device)
    if T == 0 or expert_ids.numel() == 0:
        return out
    part = count = out  # unused with top_k = 1
    if top_k > 1:
        part = torch.empty((T * top_k, H), dtype=torch.float32, device=act.device)
        count = counters if counters is not None else torch.zeros(
            down_counters(T, H, config), dtype=torch.int32, device=act.device)
    grid = (expert_ids.numel(), triton.cdiv(H, config.block_n_down))
    fp8, block_k = fp8_launch(w2, w2_scale, block, config.block_n_down, config.block_k_down)
    _down_kernel[grid](
        act, w2, topk_weights, out, part, count, sorted_ids, expert_ids, N=T * top_k, H=H,
        I=inter, stride_act=act.stride(0), stride_we=w2.stride(0), stride_wn=w2.stride(1),
        stride_out=out.stride(0), TOP_K=top_k, **fp8,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n_down, BLOCK_K=block_k,
        PREC=dot_precision(act.dtype), DOT_DTYPE=dot_dtype(act.dtype), **config.down_launch(),
        **(pdl_launch(act) if pdl else {"USE_PDL": False}))
    return out
