"""One-row expert GEMVs on the CUDA cores for decode-sized MoE batches (T * top_k small).

At batch 1 each routed expert gets one row, but the grouped GEMMs of kernels.moe_gemm pad
tl.dot's M to 16 rows and stream the experts at 2.3-3.1 TB/s on an H200 (moe_gemm's
DEVICE_TILES note). Here no alignment is needed: the router's topk_ids say which expert each
(token, slot) pair p = t * top_k + j reads, and

gate_up: program (p, n) streams BLOCK_N gate rows and the matching up rows of expert
         ids[p] (w13 [E, 2I, H]) over H in BLOCK_K steps with wide loads; each thread sums
         its VEC consecutive products at once (_vec_sums, kernels/gemv_row.py's layout), the
         [BLOCK_N, BLOCK_K / VEC] fp32 sums are added up once after the loop, then
         act[p, n] = silu(g) * u in x.dtype (the grouped GEMM rounds act the same way).
down:    program (t, n) owns BLOCK_N output columns of token t and loads, per K step, the
         rows of all top_k experts at once ([top_k, BLOCK_N, BLOCK_K]), accumulating the
         VEC-sums of w2[ids[t, j], n, k] * topk_weights[t, j] * act[t * top_k + j, k] in one
         fp32 tile summed once at the end (VEC-sums, then slots); out[t, n] is stored once,
         in x.dtype. Its ids are final two launches back (the router), so it reads them and
         its first weight tile before its PDL wait (preload_down).

The top-k sum is inside the program, not fp32 atomics and not a second reduction: it is
deterministic (a fixed reduction tree; atomics add in arrival order and would round
differently from run to run), needs no scratch, no zero-fill and no final cast launch, and at
batch 1 still spreads H / BLOCK_N programs (512 at Qwen3-30B-A3B's H 2048) over the SMs. A
first version walked the slots one after another, [BLOCK_N, BLOCK_K] per step: 4 KB of
weights in flight per program, 17.8-27.5 us per layer on an H200 where the grouped GEMM took
11.2 (bench/results/moe_h200_2026-11-25_b1.json, "first_version").

FP8 experts (float8_e4m3fn + block scales, kernels.fp8_scales; activations stay in
x.dtype): where a program's rows lie in one row block (128 x 128 blocks: always at the
default tiles), the step's few K-block scales scale the activation lanes (SCALE 1, one load
per K block, any K step); otherwise each K step is cut to lie in one K block and each row's
scale multiplies that step's products (SCALE 2).

The MoE block at decode sizes is then 3 launches, none of them alignment: route (it lets the
next launch be scheduled at its start), gate_up, down (PDL chain). H200, Qwen3-30B-A3B,
batch 1, the whole decode step (graph replay incl. LM head): with the VEC-sum layout, wide K
steps and down's preload 2.517 -> 2.202 ms bf16, 1.858 -> 1.797 FP8; engine batch 1
382.3 -> 457.4 tok/s bf16 (bench/results/diag_preload_h200_2026-11-25.json,
diag_moe_tiles_h200_2026-11-26.json, moe_h200_2026-11-26.json; pick_gemv_config has the
tiles). The first version, [BLOCK_N, BLOCK_K] fp32 products per thread at [16, 256] tiles:
bf16 gate_up 16.7 us per layer alone, down 10.5, route 5.0
(bench/results/moe_h200_2026-11-25_b1.json).
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
    interpreting,
    jit,
    next_pow2,
    pdl_enter,
    pdl_launch,
)
from pdserve.kernels.fp8_scales import (
    FP8_DTYPE,
    Block,
    check_scales,
    fit_block_k,
    fp8_n_scales,
    kernel_block,
)
from pdserve.kernels.gemv import device_entry
from pdserve.kernels.moe_gemm import check_gate_up

MAX_TOKENS = 4  # beyond this the grouped GEMMs read each shared expert once (kernels.moe_gemm)


def use_gemv(T: int, top_k: int, E: int) -> bool:
    """Whether T tokens' experts take the one-row GEMVs: a batch of one always (each of its
    top_k experts gets one row), up to MAX_TOKENS while at most one pair per 4 experts (few
    experts read twice; the second read mostly hits L2)."""
    return T == 1 or (1 <= T <= MAX_TOKENS and T * top_k * 4 <= E)


@dataclass(frozen=True)
class GemvMoeConfig:
    block_n_up: int  # gate (and up) rows per gate_up program
    block_k_up: int  # H columns per step
    block_n_down: int  # output columns per down program
    block_k_down: int  # I columns per step
    num_warps_up: int = 4
    num_warps_down: int = 4
    # software-pipelining depth of the K loops (tl.range num_stages; 1: none)
    num_stages_up: int = 1
    num_stages_down: int = 1
    # down loads its ids and first weight tile before its PDL wait, where the caller says
    # the ids are final by then (moe_down_gemv ids_ready)
    preload_down: bool = False

    def check(self) -> None:
        sizes = (self.block_n_up, self.block_k_up, self.block_n_down, self.block_k_down)
        if any(s < 1 or s & (s - 1) for s in sizes) or min(self.block_k_up,
                                                            self.block_k_down) < 16:
            raise ValueError(f"config: tile sizes must be powers of 2 (K steps >= 16), got "
                             f"{self}")


# Tiles measured per device at batch 1: {device name fragment: {(E, H, I, weight bytes):
# GemvMoeConfig}} (kernels.gemv's device_entry; `python -m bench.lab.bench_moe --paths`
# times the candidates and installs the fastest for its run).
DEVICE_TILES: dict[str, dict[tuple[int, int, int, int], GemvMoeConfig]] = {
    "H200": {},
}


def pick_gemv_config(E: int, H: int, I: int, elem_size: int = 2,
                     device: torch.device | None = None) -> GemvMoeConfig:
    """The fastest tiles of H200 sweeps at Qwen3-30B-A3B's shape, each in the whole batch-1
    decode step (`python -m bench.lab.diag_decode --preset qwen3-30b-a3b [--quantization
    fp8]`, bench/results/diag_moe_tiles_h200_2026-11-26.json; graph replay incl. LM head,
    round-robin medians): with the kernels' VEC-sum layout (_vec_sums), wide K steps win:
    gate_up 16-bit [4, 1024] per gate / up half (step 2.913 ms at the former [16, 256] ->
    2.320), FP8 [8, 1024] (2.142 -> 2.018); down [top_k, 2, 256] (2.913 -> 2.815 bf16, 2.142
    -> 1.968 FP8); 16-bit gate_up on 2 warps (2.224 -> 2.202, "second_bf16"), the rest on
    4; no software pipelining (3 stages: 2.403 vs 2.414 bf16 at [8, 1024], 2.056 vs 2.018
    FP8). down reads its ids and first tile before its PDL wait (preload_down): step bf16
    2.517 -> 2.420 ms, FP8 1.858 -> 1.824 (with the former kernels and tiles;
    bench/results/diag_preload_h200_2026-11-25.json). device: its DEVICE_TILES entry where
    there is one. The interpreter takes the biggest tiles that the shapes use (it runs
    programs one by one)."""
    tile = device_entry(DEVICE_TILES, device, (E, H, I, elem_size))
    if tile is not None:
        return tile
    if interpreting():
        return GemvMoeConfig(min(64, next_pow2(I)), min(128, max(16, next_pow2(H))),
                             min(64, next_pow2(H)), min(128, max(16, next_pow2(I))))
    return GemvMoeConfig(8 if elem_size == 1 else 4, min(1024, max(16, next_pow2(H))), 2,
                         min(256, max(16, next_pow2(I))), num_warps_up=4 if elem_size == 1 else 2,
                         preload_down=True)


@jit
def _scale_lanes(a, s, R: tl.constexpr, G: tl.constexpr, BLOCK_K: tl.constexpr):
    """a [R, BLOCK_K] fp32 times s [R, G], the scales of the step's G K blocks, each
    broadcast over its BLOCK_K // G lanes (one load per block, not a gather per lane)."""
    return tl.reshape(tl.reshape(a, [R, G, BLOCK_K // G]) * s[:, :, None], [R, BLOCK_K])


@jit
def _vec_sums(w, a, R: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    """w [R, BLOCK_K] (any float type) * a [R or 1, BLOCK_K] fp32 -> [R, BLOCK_K / VEC]: each
    thread sums its VEC consecutive products at once (kernels/gemv_row.py's layout, which
    keeps the accumulator small and the tile out of shared memory)."""
    return tl.sum(tl.reshape(w.to(tl.float32) * a, [R, BLOCK_K // VEC, VEC]), axis=2)


@jit
def _gate_up_gemv_kernel(x_ptr, w_ptr, act_ptr, ids_ptr, s_ptr, H, I, stride_x, stride_we,
                         stride_wn, stride_act, stride_se, stride_sn, TOP_K: tl.constexpr,
                         SCALE: tl.constexpr, S_BN: tl.constexpr, S_BK: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
                         STAGES: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    p = tl.program_id(0)  # pair t * TOP_K + j
    e = tl.load(ids_ptr + p).to(tl.int64)
    x_row = x_ptr + (p // TOP_K).to(tl.int64) * stride_x
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    w_gate = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    w_up = w_gate + I * stride_wn
    s_e = s_ptr + e * stride_se
    acc_g = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)  # VEC-sums, summed after the loop
    acc_u = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=STAGES):
        offs_k = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), VEC), VEC)
        k_ok = offs_k < H
        a = tl.load(x_row + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]  # [1, BK]
        m = n_ok[:, None] & k_ok[None, :]
        wg = tl.load(w_gate + offs_k[None, :], mask=m, other=0.0, eviction_policy="evict_first")
        wu = tl.load(w_up + offs_k[None, :], mask=m, other=0.0, eviction_policy="evict_first")
        if SCALE == 1:  # FP8, the gate rows in one row block, the up rows in one: scale a
            G: tl.constexpr = BLOCK_K // S_BK if BLOCK_K > S_BK else 1
            g = tl.arange(0, G)
            s_k = s_e + k0 // S_BK + g  # the step's K blocks [G]
            g_ok = k0 + g * S_BK < H
            sg = tl.load(s_k + (n0 // S_BN) * stride_sn, mask=g_ok, other=0.0)
            su = tl.load(s_k + ((I + n0) // S_BN) * stride_sn, mask=g_ok, other=0.0)
            ag = _scale_lanes(a, sg[None, :], 1, G, BLOCK_K)
            au = _scale_lanes(a, su[None, :], 1, G, BLOCK_K)
        elif SCALE == 2:  # FP8, the step in one K block: each row's scale
            ag = a * fp8_n_scales(s_e, offs_n, I, k0, stride_sn, S_BN, S_BK)[:, None]
            au = a * fp8_n_scales(s_e, I + offs_n, 2 * I, k0, stride_sn, S_BN, S_BK)[:, None]
        else:
            ag = a
            au = a
        acc_g += _vec_sums(wg, ag, BLOCK_N, BLOCK_K, VEC)
        acc_u += _vec_sums(wu, au, BLOCK_N, BLOCK_K, VEC)
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    act = g / (1.0 + tl.exp(-g)) * u
    tl.store(act_ptr + p.to(tl.int64) * stride_act + offs_n, act, mask=n_ok)


@jit
def _down_w(w_rows, wmask, k0, I, BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    """The step's weight tile [K_P, BLOCK_N, BLOCK_K] at columns k0.. (zeros past I)."""
    offs_k = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), VEC), VEC)
    return tl.load(w_rows + offs_k[None, None, :], mask=wmask & (offs_k < I)[None, None, :],
                   other=0.0, eviction_policy="evict_first")


@jit
def _down_step(w, k0, acc, act_ptr, p, j_ok, wt, s_e, n0, offs_n, n_ok, I, stride_act,
               stride_sn, K_P: tl.constexpr, SCALE: tl.constexpr, S_BN: tl.constexpr,
               S_BK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               VEC: tl.constexpr):
    """acc [K_P, BLOCK_N, BLOCK_K / VEC] + the VEC-sums of one K step's products on the
    loaded tile w (as _vec_sums)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_ok = offs_k < I
    a = tl.load(act_ptr + p[:, None] * stride_act + offs_k[None, :],
                mask=j_ok[:, None] & k_ok[None, :], other=0.0)
    a = a.to(tl.float32) * wt[:, None]  # [K_P, BK], routing weight folded in
    w = w.to(tl.float32)
    if SCALE == 1:  # FP8, the columns in one row block: scales per slot and K lane
        G: tl.constexpr = BLOCK_K // S_BK if BLOCK_K > S_BK else 1
        g = tl.arange(0, G)
        sc = tl.load(s_e[:, None] + (n0 // S_BN) * stride_sn + k0 // S_BK + g[None, :],
                     mask=j_ok[:, None] & (k0 + g * S_BK < I)[None, :], other=0.0)
        prod = w * _scale_lanes(a, sc, K_P, G, BLOCK_K)[:, None, :]
    elif SCALE == 2:  # FP8, the step in one K block: scales per slot and column
        sc = tl.load(s_e[:, None] + (offs_n // S_BN)[None, :] * stride_sn + k0 // S_BK,
                     mask=j_ok[:, None] & n_ok[None, :], other=0.0)
        prod = w * (a[:, None, :] * sc[:, :, None])
    else:
        prod = w * a[:, None, :]
    return acc + tl.sum(tl.reshape(prod, [K_P, BLOCK_N, BLOCK_K // VEC, VEC]), axis=3)


@jit
def _down_gemv_kernel(act_ptr, w_ptr, wts_ptr, ids_ptr, out_ptr, s_ptr, H, I, stride_act,
                      stride_we, stride_wn, stride_out, stride_se, stride_sn,
                      TOP_K: tl.constexpr, K_P: tl.constexpr, SCALE: tl.constexpr,
                      S_BN: tl.constexpr, S_BK: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, VEC: tl.constexpr, STAGES: tl.constexpr,
                      PRELOAD: tl.constexpr, USE_PDL: tl.constexpr):
    """PRELOAD: the ids, routing weights and first weight tile are read before the PDL wait
    (moe_down_gemv ids_ready: they were final before the launch ahead of this one)."""
    if not PRELOAD:
        pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    j = tl.arange(0, K_P)  # the token's top_k slots, all loaded in each step
    j_ok = j < TOP_K
    p = t * TOP_K + j
    e = tl.load(ids_ptr + p, mask=j_ok, other=0).to(tl.int64)
    wt = tl.load(wts_ptr + p, mask=j_ok, other=0.0).to(tl.float32)
    w_rows = w_ptr + e[:, None, None] * stride_we + offs_n[None, :, None].to(tl.int64) * stride_wn
    s_e = s_ptr + e * stride_se  # [K_P]
    wmask = j_ok[:, None, None] & n_ok[None, :, None]
    acc = tl.zeros([K_P, BLOCK_N, BLOCK_K // VEC], tl.float32)  # [slot, column, VEC-sums]
    start = 0
    if PRELOAD:  # the first step peeled off the loop (no tile carried through it)
        w0 = _down_w(w_rows, wmask, 0, I, BLOCK_K, VEC)
        pdl_enter(USE_PDL)
        acc = _down_step(w0, 0, acc, act_ptr, p, j_ok, wt, s_e, n0, offs_n, n_ok, I,
                         stride_act, stride_sn, K_P, SCALE, S_BN, S_BK, BLOCK_N, BLOCK_K, VEC)
        start = BLOCK_K
    for k0 in tl.range(start, I, BLOCK_K, num_stages=STAGES):
        w = _down_w(w_rows, wmask, k0, I, BLOCK_K, VEC)
        acc = _down_step(w, k0, acc, act_ptr, p, j_ok, wt, s_e, n0, offs_n, n_ok, I,
                         stride_act, stride_sn, K_P, SCALE, S_BN, S_BK, BLOCK_N, BLOCK_K, VEC)
    # fixed reduction order (VEC-sums, then slots): the same bits on every run
    tl.store(out_ptr + t * stride_out + offs_n, tl.sum(tl.sum(acc, axis=2), axis=0), mask=n_ok)


def _scale_args(w: torch.Tensor, scales: torch.Tensor | None, block: Block | None,
                block_n: int, block_k: int, row_step: int) -> tuple[dict, int]:
    """Scale arguments for expert weights w [E, N, K] and the K step. SCALE 1 (scales per K
    lane, scaling the activation) when each program's rows lie in one row block: block_n
    divides the row block and row_step (gate_up: I, where the up rows start; down: block_n);
    else SCALE 2 with the step cut to lie in one K block (kernels.fp8_scales)."""
    if scales is None:
        return ({"s_ptr": w, "stride_se": 0, "stride_sn": 0, "SCALE": 0, "S_BN": 1,
                 "S_BK": 1}, block_k)
    N, K = w.shape[1], w.shape[2]
    s_bn, s_bk = kernel_block(block, N, K)
    mode = 1 if s_bn % block_n == 0 and row_step % block_n == 0 else 2
    if mode == 2:
        block_k = fit_block_k((1, block[1]), N, K, block_n, block_k)
    return ({"s_ptr": scales, "stride_se": scales.stride(0), "stride_sn": scales.stride(1),
             "SCALE": mode, "S_BN": s_bn, "S_BK": s_bk}, block_k)


def _check_ids(topk_ids: torch.Tensor, topk_weights: torch.Tensor | None, T: int | None,
               device: torch.device) -> None:
    """Contiguous topk_ids [T, top_k >= 1] (and topk_weights of its shape); T None: any."""
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64), device=device)
    if (T is not None and topk_ids.shape[0] != T) or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids: expected [{T}, top_k >= 1], got {tuple(topk_ids.shape)}")
    pairs = [("topk_ids", topk_ids)]
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, shape=tuple(topk_ids.shape),
                     dtypes=FLOAT_DTYPES, device=device)
        pairs.append(("topk_weights", topk_weights))
    for name, t in pairs:
        if not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous, strides {t.stride()}")


def moe_gate_up_gemv(x: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor,
                     config: GemvMoeConfig | None = None, pdl: bool = False,
                     w13_scale: torch.Tensor | None = None, block: Block | None = None
                     ) -> torch.Tensor:
    """act [T * top_k, I] (x.dtype, pair order) = silu(x[t] @ gate_e.T) * (x[t] @ up_e.T) for
    e = topk_ids[t, j], x [T, H] (rows may be strided), w13 [E, 2I, H] (gate rows over up
    rows; FP8 with w13_scale for block, as kernels.moe_gemm.moe_gate_up). One launch; pdl: a
    programmatic dependent launch behind the pdserve kernel before it. Ids must lie in
    [0, E) (the router's are)."""
    check_gate_up(x, w13, w13_scale, block)
    _check_ids(topk_ids, None, x.shape[0], x.device)
    T, H = x.shape
    top_k, inter = topk_ids.shape[1], w13.shape[1] // 2
    cfg = config or pick_gemv_config(w13.shape[0], H, inter, w13.element_size(), x.device)
    cfg.check()
    act = torch.empty((T * top_k, inter), dtype=x.dtype, device=x.device)
    if T == 0:
        return act
    fp8, block_k = _scale_args(w13, w13_scale, block, cfg.block_n_up, cfg.block_k_up, inter)
    _gate_up_gemv_kernel[(T * top_k, triton.cdiv(inter, cfg.block_n_up))](
        x, w13, act, topk_ids, H=H, I=inter, stride_x=x.stride(0), stride_we=w13.stride(0),
        stride_wn=w13.stride(1), stride_act=act.stride(0), TOP_K=top_k, **fp8,
        BLOCK_N=cfg.block_n_up, BLOCK_K=block_k, VEC=min(16 // x.element_size(), block_k),
        STAGES=cfg.num_stages_up, num_warps=cfg.num_warps_up,
        **(pdl_launch(x) if pdl else {"USE_PDL": False}))
    return act


def moe_down_gemv(act: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, config: GemvMoeConfig | None = None,
                  out: torch.Tensor | None = None, pdl: bool = False,
                  w2_scale: torch.Tensor | None = None, block: Block | None = None,
                  ids_ready: bool = False) -> torch.Tensor:
    """out [T, H] = sum_j topk_weights[t, j] * (act[t * top_k + j] @ w2[topk_ids[t, j]].T),
    fp32 sums in a fixed order (deterministic), stored in act.dtype, for act [T * top_k, I]
    (moe_gate_up_gemv's), w2 [E, H, I] (FP8 with w2_scale for block), contiguous
    topk_weights / topk_ids [T, top_k]. out: where to write (rows contiguous), default new.
    One launch; pdl as moe_gate_up_gemv's. ids_ready: topk_ids and topk_weights were
    written before the launch ahead of this one (fused_moe's route -> gate_up -> down), so
    with pdl and config.preload_down the program reads them and its first weight tile before
    its PDL wait."""
    check_tensor("act", act, ndim=2, dtypes=FLOAT_DTYPES, last_contiguous=True)
    check_launchable("act", act)
    check_tensor("w2", w2, shape=(None, None, act.shape[1]), dtypes=(act.dtype, FP8_DTYPE),
                 device=act.device, last_contiguous=True)
    check_scales(w2, w2_scale, block, "w2")
    _check_ids(topk_ids, topk_weights, None, act.device)
    T, top_k = topk_ids.shape
    if T * top_k != act.shape[0]:
        raise ValueError(f"act: {act.shape[0]} rows; expected T * top_k = {T * top_k}")
    H, inter = w2.shape[1], w2.shape[2]
    if out is None:
        out = torch.empty((T, H), dtype=act.dtype, device=act.device)
    check_tensor("out", out, shape=(T, H), dtypes=(act.dtype,), device=act.device,
                 last_contiguous=True)
    cfg = config or pick_gemv_config(w2.shape[0], H, inter, w2.element_size(), act.device)
    cfg.check()
    if T == 0:
        return out
    fp8, block_k = _scale_args(w2, w2_scale, block, cfg.block_n_down, cfg.block_k_down,
                               cfg.block_n_down)
    _down_gemv_kernel[(T, triton.cdiv(H, cfg.block_n_down))](
        act, w2, topk_weights, topk_ids, out, H=H, I=inter, stride_act=act.stride(0),
        stride_we=w2.stride(0), stride_wn=w2.stride(1), stride_out=out.stride(0), TOP_K=top_k,
        K_P=next_pow2(top_k), **fp8, BLOCK_N=cfg.block_n_down, BLOCK_K=block_k,
        VEC=min(16 // act.element_size(), block_k),
        STAGES=cfg.num_stages_down, PRELOAD=cfg.preload_down and ids_ready and pdl,
        num_warps=cfg.num_warps_down,
        **(pdl_launch(act) if pdl else {"USE_PDL": False}))
    return out
