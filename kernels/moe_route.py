"""MoE router in one kernel: router GEMV, scoring, correction bias, group-limited top-k,
renormalisation and scaling (kernels.reference.moe_route_ref is the contract).

Unfused, the router of a decode step is ~10 small torch kernels (GEMV, softmax or sigmoid,
add, view/topk per group, scatter, masked_fill, topk, gather, sum, div, mul). Here program
(b, s) computes logits [BLOCK_T, BLOCK_E] = x[b-th block of BLOCK_T rows] @ router_weight[s-th
slice of BLOCK_E experts].T in fp32, on the CUDA cores (the default: fp32 products summed
once after the K loop, as kernels.gemv's batch-1 kernel) or the tensor cores (tl.dot, rows
padded to 16). With one slice (the interpreter's default) it then scores and selects in
registers. With SPLITS > 1 slices (on a GPU: 2-8 experts per program, so that even a batch-1
router reads its weight from dozens of SMs) each program stores its slice to fp32 scratch
and the last program of the row block to arrive (arrival counter, as kernels.gemv's split-K)
selects over all E experts. Every program arrives unconditionally, so the shared counters
return to zero after each launch.

Selection, per row, on [BLOCK_T, E_P] tiles (E_P = E rounded up to a power of two; padding
lanes never win):
  softmax: p = softmax(logits); weights and choice are p.
  sigmoid: s = sigmoid(logits); choice = s + correction_bias; with n_group > 1 a group scores
           the sum of its best two choices, the topk_group best groups are kept and every
           other expert's choice is -inf (as transformers' GLM-4.5 / DeepSeek-V3 routers and
           the reference do); weights are s (no bias).
  top-k by iterative max, one int64 max reduction per expert over keys that order like
  (choice, -index) (_order_keys); weights / (sum + 1e-20 for sigmoid) if renormalize;
  * routed_scaling.
Ties: the lowest index wins, among experts and among groups alike (torch.topk leaves tie order
unspecified; the tests use random data without ties). NaN choices count as -inf, so the ids
are always valid experts.

Decode batches (moe_route_align: one row block, at most MAX_ALIGN_PAIRS pairs): the program
that selects also aligns the pairs for the grouped GEMMs (kernels.moe_align.align_few) and
zeroes the down GEMM's counters, so the MoE block is 3 launches instead of 4, and it lets the
next (PDL) launch be scheduled at its start.

The MoE block's RMSNorm (moe_route norm; kernels.fused_moe has the measurements): the router
takes the un-normed rows h, the norm weight scales the activation lanes and each row's rstd
(h^2 summed per lane) its dot products; program (b, 0) stores the normed rows in h.dtype for
the expert GEMVs. pdl: its first weight step loads before the PDL wait.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.kernels._triton import (
    FLOAT_DTYPES,
    arrival_counters,
    check_launchable,
    check_tensor,
    dot_dtype,
    interpreting,
    jit,
    next_pow2,
    pdl_launch,
    scratch_fp32,
)
from pdserve.kernels.gemv import device_entry
from pdserve.kernels.moe_align import (
    MAX_FEW,
    align_few,
    alignment_buffers,
    check_align_args,
    few_chunk,
    few_pairs,
    zero_int32,
)
from pdserve.kernels.moe_select import select_store

MAX_EXPERTS = 512  # selection holds [16, E_P] fp32 tiles in registers
MAX_TOP_K = 16
MAX_ALIGN_PAIRS = MAX_FEW  # moe_route_align: the (token, slot) pairs its last program aligns
SCORINGS = ("softmax", "sigmoid")
# the MoE block's RMSNorm in the router's prologue: (norm weight [H], eps) (moe_route norm)
Norm = tuple[torch.Tensor, float]


@dataclass(frozen=True)
class RouteConfig:
    block_t: int  # token rows per program (a power of 2; >= 16 with tensor cores)
    block_e: int  # experts per program (a power of 2 dividing E_P; >= 16 with tensor cores)
    block_k: int  # hidden columns per step of the router GEMV (a power of 2 >= 16)
    num_warps: int = 4
    # the GEMV on the tensor cores (tl.dot; fp32 operands as "tf32x3" on a GPU, ~fp32
    # accuracy) or on the CUDA cores ([block_t, block_e, block_k] fp32 products summed once
    # after the loop, as kernels.gemv's batch-1 kernel)
    tensor_cores: bool = False


# Batch-1 router tiles measured per device, where they beat pick_route_config's rule by
# >= 3%: {device name fragment: {(E, H): (block_t, block_e, block_k, num_warps)}} (kernels.
# gemv's device_entry; `python -m bench.lab.bench_moe --sweep` measures them, "route").
# H200, Qwen3-30B-A3B (route + alignment in one launch, CUDA-graph replays): one expert per
# program, the whole row in one step, 2 warps: 6.75 us; the rule's 2 x 512 with 4 warps 7.13;
# 1 warp 7.5-8.5 (bench/results/moe_h200_2026-11-25_tuned.json).
DEVICE_TILES: dict[str, dict[tuple[int, int], tuple[int, int, int, int]]] = {
    "H200": {(128, 2048): (1, 1, 2048, 2)},
}


def pick_route_config(T: int, E: int, H: int, device: torch.device | None = None
                      ) -> RouteConfig:
    """The GEMV on the CUDA cores, 2-8 experts per program so that even a batch-1 router reads
    its weight from 32-128 SMs. From an H200 sweep over Qwen3-30B-A3B, GLM-4.5-Air and
    DeepSeek-V3 router shapes (E 128-256, H 2048-7168, fp32 weight, bf16 x; CUDA-graph
    replays): batch 1 6.6 / 7.3 / 13.5 us, batch 64 9.2 / 12.4 / 31 us, batch 256 20 / 30 /
    87 us. The tensor-core tiles (16 x 16, fp32 operands as tf32x3) took 28-45 us at every
    batch up to 256 (too few programs, each reading a 16-expert slice for 16 rows).
    The interpreter takes 16 rows and all experts per program (it runs programs one by one).
    device: a batch of one takes that device's DEVICE_TILES entry for (E, H) where there is
    one."""
    e_p = max(16, next_pow2(E))
    tile = device_entry(DEVICE_TILES, device, (E, H)) if T == 1 else None
    if tile is not None:
        return RouteConfig(tile[0], tile[1], tile[2], num_warps=tile[3])
    if interpreting():
        return RouteConfig(16, e_p, min(32, max(16, next_pow2(H))))
    block_k = min(512, max(16, next_pow2(H)))
    if T <= 4:
        return RouteConfig(next_pow2(T), min(2, e_p), block_k)
    if T <= 64:
        return RouteConfig(8, min(4, e_p), block_k)
    return RouteConfig(8, min(8, e_p), min(256, block_k))


@jit
def _x_tile(x_rows, nw_ptr, row_ok, offs_k, H, ss, NORM: tl.constexpr):
    """x [BLOCK_T, BLOCK_K] in fp32; NORM: times the norm weight, ss += x^2 (per lane)."""
    k_ok = offs_k < H
    x = tl.load(x_rows + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                other=0.0).to(tl.float32)
    if NORM:
        ss += x * x
        x = x * tl.load(nw_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    return x, ss


@jit
def _logits_step(acc, x, w, DOT_DTYPE: tl.constexpr, PREC: tl.constexpr,
                 USE_DOT: tl.constexpr):
    if USE_DOT:  # acc [BLOCK_T, BLOCK_E]
        acc += tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), input_precision=PREC)
    else:  # acc [BLOCK_T, BLOCK_E, BLOCK_K]: per-lane products, reduced after the loop
        acc += x[:, None, :] * w.to(tl.float32)[None, :, :]
    return acc


@jit
def _logits(x_rows, w_rows, w0, nw_ptr, row_ok, e_ok, H, eps, BLOCK_T: tl.constexpr,
            BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
            PREC: tl.constexpr, USE_DOT: tl.constexpr, NORM: tl.constexpr):
    """Router logits [BLOCK_T, BLOCK_E] in fp32; w0: the first K step's weights (loaded before
    the PDL wait). USE_DOT: on the tensor cores (fp32 router: DOT_DTYPE fp32 whenever x and
    the weight differ in dtype or either is fp32, then PREC "tf32x3" on a GPU); else on the
    CUDA cores, fp32 products [BLOCK_T, BLOCK_E, BLOCK_K] accumulated per lane and reduced
    once after the loop (no cross-lane sums inside it), as kernels.gemv. NORM: x holds
    un-normed rows h; the rows' rstd (from ss, h^2 per lane) scales the dot products."""
    offs_k = tl.arange(0, BLOCK_K)
    if USE_DOT:
        acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    else:
        acc = tl.zeros([BLOCK_T, BLOCK_E, BLOCK_K], tl.float32)
    x, ss = _x_tile(x_rows, nw_ptr, row_ok, offs_k, H, tl.zeros([BLOCK_T, BLOCK_K], tl.float32),
                    NORM)
    acc = _logits_step(acc, x, w0, DOT_DTYPE, PREC, USE_DOT)
    for k0 in range(BLOCK_K, H, BLOCK_K):
        w = tl.load(w_rows + (k0 + offs_k)[None, :],
                    mask=e_ok[:, None] & (k0 + offs_k < H)[None, :], other=0.0)
        x, ss = _x_tile(x_rows, nw_ptr, row_ok, k0 + offs_k, H, ss, NORM)
        acc = _logits_step(acc, x, w, DOT_DTYPE, PREC, USE_DOT)
    logits = acc if USE_DOT else tl.sum(acc, axis=2)
    rstd = tl.rsqrt(tl.sum(ss, axis=1) / H + eps)  # [BLOCK_T]; unused without NORM
    if NORM:  # rmsnorm's per-row scale commutes with the dot product
        logits = logits * rstd[:, None]
    return logits, rstd


@jit
def _store_normed(x_rows, nw_ptr, xn_ptr, rows, row_ok, rstd, H, stride_xn,
                  BLOCK_K: tl.constexpr):
    """xn[rows] = h * rstd * norm weight, stored in xn's dtype as kernels.rmsnorm stores it
    (h: these rows of x, read again from L1/L2), for the expert GEMVs behind the router."""
    xn_rows = xn_ptr + rows[:, None].to(tl.int64) * stride_xn
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < H
        m = row_ok[:, None] & k_ok[None, :]
        h = tl.load(x_rows + offs_k[None, :], mask=m, other=0.0).to(tl.float32)
        w = tl.load(nw_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        tl.store(xn_rows + offs_k[None, :], h * rstd[:, None] * w[None, :], mask=m)


@jit
def _route_kernel(x_ptr, w_ptr, bias_ptr, wts_ptr, ids_ptr, part_ptr, count_ptr, sorted_ptr,
                  expert_ptr, npad_ptr, zero_ptr, nw_ptr, xn_ptr, T, E, H, stride_x,
                  stride_xn, stride_w, group_size, n_group, topk_group, scaling, eps, ROWS,
                  BLOCKS, ZERO_N,
                  SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr,
                  RENORM: tl.constexpr, TOP_K: tl.constexpr, K_P: tl.constexpr,
                  NG_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                  E_P: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
                  DOT_DTYPE: tl.constexpr, PREC: tl.constexpr, USE_DOT: tl.constexpr,
                  ALIGN: tl.constexpr, BLOCK_M: tl.constexpr, N_P: tl.constexpr,
                  R_CHUNK: tl.constexpr, NORM: tl.constexpr, TRIGGER: tl.constexpr,
                  USE_PDL: tl.constexpr):
    tb = tl.program_id(0)
    s = tl.program_id(1)
    rows = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    es = s * BLOCK_E + tl.arange(0, BLOCK_E)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x
    w_rows = w_ptr + es[:, None].to(tl.int64) * stride_w
    k0 = tl.arange(0, BLOCK_K)  # the first K step's weights: never written, so before the wait
    w0 = tl.load(w_rows + k0[None, :], mask=(es < E)[:, None] & (k0 < H)[None, :], other=0.0)
    if USE_PDL:  # a PDL launch: the kernel before (o_proj) wrote x
        tl.extra.cuda.gdc_wait()
    if TRIGGER:  # the next kernel (a PDL launch) may be scheduled now; it waits for this one
        tl.extra.cuda.gdc_launch_dependents()
    logits, rstd = _logits(x_rows, w_rows, w0, nw_ptr, row_ok, es < E, H, eps, BLOCK_T,
                           BLOCK_E, BLOCK_K, DOT_DTYPE, PREC, USE_DOT, NORM)
    if NORM and s == 0:  # one program per row block stores its normed rows
        _store_normed(x_rows, nw_ptr, xn_ptr, rows, row_ok, rstd, H, stride_xn, BLOCK_K)
    last = True
    if SPLITS > 1:
        # scratch [row blocks * BLOCK_T, E_P] fp32: this slice's columns of this row block
        base = part_ptr + rows[:, None].to(tl.int64) * E_P
        tl.store(base + es[None, :], logits)
        tl.debug_barrier()  # every thread's logits stored before the release below
        last = tl.atomic_add(count_ptr + tb, 1, sem="acq_rel") == SPLITS - 1
    if last:
        if SPLITS > 1:  # all slices arrived: reset the counter for the next launch
            tl.store(count_ptr + tb, 0)
            full = tl.load(base + tl.arange(0, E_P)[None, :], cache_modifier=".cg")
        else:
            full = logits
        select_store(full, rows, row_ok, bias_ptr, wts_ptr, ids_ptr, E, group_size,
                      n_group, topk_group, scaling, SIGMOID, HAS_BIAS, GROUPED, RENORM,
                      TOP_K, K_P, NG_P, BLOCK_T, E_P)
        if ALIGN:  # one row block holds every token: align its pairs here (see moe_route)
            tl.debug_barrier()  # every thread's ids stored before this program reads them
            zero_int32(zero_ptr, 0, ZERO_N, 1024)
            align_few(ids_ptr, sorted_ptr, expert_ptr, npad_ptr, T * TOP_K, E, ROWS, BLOCKS,
                      N_P, BLOCK_M, R_CHUNK)


def _check_route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, scoring: str,
                 correction_bias: torch.Tensor | None, n_group: int, topk_group: int) -> None:
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_contiguous=True)
    check_launchable("x", x)
    check_tensor("router_weight", router_weight, shape=(None, x.shape[1]), dtypes=FLOAT_DTYPES,
                 device=x.device, last_contiguous=True)
    E = router_weight.shape[0]
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"router_weight: {E} experts; moe_route takes 1..{MAX_EXPERTS}")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring: expected 'softmax' or 'sigmoid', got {scoring!r}")
    if not 1 <= top_k <= min(E, MAX_TOP_K):
        raise ValueError(f"top_k: {top_k} not in 1..{min(E, MAX_TOP_K)} ({E} experts)")
    if correction_bias is not None:
        if scoring != "sigmoid":
            raise ValueError("correction_bias: only used with scoring 'sigmoid'")
        check_tensor("correction_bias", correction_bias, shape=(E,), dtypes=FLOAT_DTYPES,
                     device=x.device, last_contiguous=True)
    if n_group < 1 or E % n_group:
        raise ValueError(f"n_group: {n_group} does not divide the {E} experts into groups")
    if n_group > 1:
        if scoring != "sigmoid":
            raise ValueError("n_group: group-limited routing is only used with scoring 'sigmoid'")
        if E // n_group < 2:
            raise ValueError(f"n_group: groups of {E // n_group} expert; a group scores its best two")
        if not 1 <= topk_group <= n_group or top_k > topk_group * (E // n_group):
            raise ValueError(f"topk_group: {topk_group} groups of {E // n_group} experts cannot "
                             f"hold top_k = {top_k} (1..n_group = {n_group} groups)")


def check_norm(norm: Norm | None, x: torch.Tensor) -> None:
    """norm: None or (weight [H] float on x's device, eps > 0) for rows x [T, H]."""
    if norm is None:
        return
    if not isinstance(norm, tuple) or len(norm) != 2:
        raise TypeError(f"norm: expected (weight, eps), got {type(norm).__name__}")
    check_tensor("norm weight", norm[0], shape=(x.shape[1],), dtypes=FLOAT_DTYPES,
                 device=x.device, last_contiguous=True)
    if not isinstance(norm[1], (int, float)) or not norm[1] > 0:
        raise ValueError(f"norm: eps must be a number > 0, got {norm[1]!r}")


def _check_route_config(cfg: RouteConfig, e_p: int) -> None:
    low = 16 if cfg.tensor_cores else 1
    sizes_ok = all(v >= lo and v & (v - 1) == 0 for v, lo in
                   ((cfg.block_t, low), (cfg.block_e, low), (cfg.block_k, 16)))
    if not sizes_ok or cfg.block_e > e_p or cfg.block_t > 64:
        raise ValueError(f"config: block_t (<= 64), block_e (<= {e_p}) and block_k must be "
                         f"powers of 2, >= 16 with tensor cores (block_k always), got {cfg}")


def moe_route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, scoring: str = "softmax",
              correction_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
              renormalize: bool = True, routed_scaling: float = 1.0,
              config: RouteConfig | None = None, trigger_dependents: bool = False,
              norm: Norm | None = None, pdl: bool = False) -> tuple[torch.Tensor, ...]:
    """x [T, H] (rows may be strided), router_weight [E, H] (any float dtype; fp32 math) ->
    (topk_weights [T, top_k] float32, topk_ids [T, top_k] int32), both new contiguous tensors,
    each row in descending order of choice, as kernels.reference.moe_route_ref computes them.
    correction_bias [E] and n_group > 1 (then topk_group) are for scoring "sigmoid" only.
    One kernel launch; no host synchronisation (CUDA-graph safe once warmed up: the split
    path's scratch and counters are allocated on the first launch). trigger_dependents: as
    moe_route_align's (kernels.moe_gemv's launches behind it). norm (weight [H], eps): x
    holds un-normed rows h; the router scores rmsnorm(h) * weight (fp32, unrounded) and also
    returns those rows in x.dtype, [T, H] contiguous, as kernels.rmsnorm computes them (the
    experts' input: the norm kernel before the MoE block is gone). pdl: a programmatic
    dependent launch: it loads its first weight step, then waits for the kernel before it
    (which wrote x), then triggers its dependents."""
    _check_route(x, router_weight, top_k, scoring, correction_bias, n_group, topk_group)
    check_norm(norm, x)
    routing = (scoring, correction_bias, n_group, topk_group, renormalize, routed_scaling)
    xn = None if norm is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    wts, ids = _launch(x, router_weight, top_k, routing, config, None, trigger_dependents,
                       (norm, xn), pdl)[:2]
    return (wts, ids) if xn is None else (wts, ids, xn)


def route_aligns(T: int, E: int, H: int, top_k: int, config: RouteConfig | None = None,
                 device: torch.device | None = None) -> bool:
    """Whether moe_route_align can align T tokens' pairs in the router's launch: one program
    must select for every token (one row block) and the pairs must be few (decode sizes).
    config: the router's tiles (default pick_route_config's for device)."""
    cfg = config or pick_route_config(T, E, H, device)
    return 1 <= T <= cfg.block_t and T * top_k <= MAX_ALIGN_PAIRS


def moe_route_align(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, block_m: int,
                    scoring: str = "softmax", correction_bias: torch.Tensor | None = None,
                    n_group: int = 1, topk_group: int = 1, renormalize: bool = True,
                    routed_scaling: float = 1.0, zero: torch.Tensor | None = None,
                    config: RouteConfig | None = None, trigger_dependents: bool = False
                    ) -> tuple[torch.Tensor, ...]:
    """moe_route and kernels.moe_align(topk_ids, E, block_m, zero) in one launch, for batches
    where route_aligns(T, E, H, top_k, config): (topk_weights, topk_ids, sorted_ids,
    expert_ids, num_padded), the same values the two launchers return. At batch 1 the
    alignment is a few hundred bytes of work; as a launch of its own it cost ~7 us of an
    H200's ~76 us Qwen3-30B-A3B decode layer (bench/results/moe_h200_2026-11-25.json), here
    the router's last program does it after its selection. trigger_dependents: let the next
    kernel, if it is a programmatic dependent launch (kernels.moe_gemm with pdl=True), be
    scheduled while this one runs (it still waits for this one's results)."""
    _check_route(x, router_weight, top_k, scoring, correction_bias, n_group, topk_group)
    E, T, H = router_weight.shape[0], x.shape[0], x.shape[1]
    check_align_args(E, block_m, zero, x.device)
    if not route_aligns(T, E, H, top_k, config, x.device):
        raise ValueError(f"x: {T} tokens x top_k {top_k}: the router aligns at most "
                         f"{MAX_ALIGN_PAIRS} pairs of one row block; use moe_route + moe_align")
    routing = (scoring, correction_bias, n_group, topk_group, renormalize, routed_scaling)
    return _launch(x, router_weight, top_k, routing, config, (block_m, zero), trigger_dependents)


def _launch(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, routing: tuple,
            config: RouteConfig | None, align: tuple[int, torch.Tensor | None] | None,
            trigger: bool, normed: tuple = (None, None), pdl: bool = False
            ) -> tuple[torch.Tensor, ...]:
    """The launch behind moe_route / moe_route_align (arguments checked by them); normed:
    (norm, the [T, H] rows it stores) or (None, None)."""
    scoring, correction_bias, n_group, topk_group, renormalize, routed_scaling = routing
    norm, xn = normed
    T, H = x.shape
    E = router_weight.shape[0]
    wts = torch.empty((T, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((T, top_k), dtype=torch.int32, device=x.device)
    block_m, zero = align if align is not None else (16, None)
    aligned = (alignment_buffers(T * top_k, E, block_m, x.device) if align is not None
               else (ids, ids, ids))
    # without alignment its constexprs stay fixed: no recompiles across batch sizes
    n_p, r_chunk = (few_pairs(T * top_k), few_chunk(T * top_k)) if align is not None else (16, 16)
    if T == 0:
        return wts, ids
    cfg = config or pick_route_config(T, E, H, x.device)
    e_p = max(16, next_pow2(E))
    _check_route_config(cfg, e_p)
    splits, row_blocks = e_p // cfg.block_e, triton.cdiv(T, cfg.block_t)
    part, count = wts, wts  # unused with one slice
    if splits > 1:
        part = scratch_fp32(x.device, row_blocks * cfg.block_t * e_p)
        count = arrival_counters(x.device, row_blocks)
    same = x.dtype == router_weight.dtype and x.dtype != torch.float32
    dot = dot_dtype(x.dtype) if same else tl.float32
    bias = correction_bias if correction_bias is not None else wts
    _route_kernel[(row_blocks, splits)](
        x, router_weight, bias, wts, ids, part, count, *aligned,
        zero if zero is not None else ids, x if norm is None else norm[0],
        x if xn is None else xn, T, E, H, x.stride(0), H, router_weight.stride(0),
        E // n_group, n_group, topk_group, float(routed_scaling),
        0.0 if norm is None else float(norm[1]), aligned[0].numel(), aligned[1].numel(),
        0 if zero is None else zero.numel(),
        SIGMOID=scoring == "sigmoid", HAS_BIAS=correction_bias is not None,
        GROUPED=n_group > 1, RENORM=bool(renormalize), TOP_K=top_k,
        K_P=max(2, next_pow2(top_k)), NG_P=max(2, next_pow2(n_group)), BLOCK_T=cfg.block_t,
        BLOCK_E=cfg.block_e, E_P=e_p, BLOCK_K=cfg.block_k, SPLITS=splits,
        DOT_DTYPE=dot, PREC="tf32x3" if dot == tl.float32 and not interpreting() else "ieee",
        USE_DOT=cfg.tensor_cores, ALIGN=align is not None, BLOCK_M=block_m,
        N_P=n_p, R_CHUNK=r_chunk, NORM=norm is not None,
        TRIGGER=trigger and pdl_launch(x)["USE_PDL"], num_warps=cfg.num_warps,
        **(pdl_launch(x) if pdl else {"USE_PDL": False}))
    return (wts, ids, *aligned) if align is not None else (wts, ids)
