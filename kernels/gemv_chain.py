"""A decoder layer's batch-1 tail as ONE kernel: o_proj -> gate_up -> down, 16-bit or FP8.

    h  = W_o a + residual                  ([1, D])    a: the attention output [1, Hq * Dh]
    gu = W_gu (rmsnorm(h) * norm_weight)   ([1, 2I])   [gate | up]
    y  = W_down (silu(gate) * up) + h      ([1, D])    the residual stream after the layer

Why: at batch 1 each projection is a GEMV bound by reading its weight once, and each kernel
boundary costs its ramp (the first loads' latency) and its tail (the last programs draining,
SMs idle) even with PDL. On an H200 at Qwen3-8B's FP8 shapes a kernel that only READS the
weights with the GEMVs' tiles took o 5.9 us (4.0 at the copy rate), gate_up 26.9 (24.3), down
14.4 (12.1) (bench/results/fp8_b1_probes_h200_2026-11-26.json), while the long LM head GEMV
reads at 4.45 TB/s. Here the three GEMVs are one stream of work items.

How (a persistent kernel with a work queue):
  - GRID programs (as many as fit the GPU at once) take items from a ticket counter in
    increasing order: the o_proj row blocks, then gate_up's, then down's. An item is one
    kernels/gemv_row.py program's work (BLOCK_N rows of one projection, its prologue and
    epilogue), so the math and the tiles are the one-row GEMV's.
  - Stage s + 1 needs all of stage s's output (gate_up's norm needs all of h; down's K runs
    over all of gu). An item stores its rows, then bumps its stage's done counter (release);
    an item of the next stage first loads its first weight tile (weights never change), then
    waits (acquire) until that counter is full -- once per program and stage. So at a stage
    boundary the programs that are done already stream the next stage's first tiles while the
    last items of the stage before finish: no launch, no drained GPU.
  - No deadlock for any GRID, resident or not: tickets are taken in order and an item waits
    only on items of lower tickets, each taken by a running program that never waits on a
    higher one. The smallest unfinished item can always run. In Triton's interpreter (one
    program at a time) GRID is 1 and the waits are met at once.
  - The last program out zeroes the counters for the next launch (each call site has its own
    counters, kernels._triton.chain_counters), so the kernel is CUDA-graph safe. Before the
    PDL wait a program takes its first ticket (this site's counters were last written by its
    own previous launch, long complete) and asks L2 for its share of o_proj's weight, which
    streams in while the latency-bound attention kernel before it runs.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pdserve.kernels._triton import (
    FLOAT_DTYPES,
    chain_counters,
    check_launchable,
    check_tensor,
    interpreting,
    jit,
    l2_prefetch_flat,
    next_pow2,
    num_sms,
    pdl_launch,
)
from pdserve.kernels.fp8_scales import (
    FP8_DTYPE,
    Block,
    check_scales,
    fit_block_k,
    kernel_block,
    scale_mode,
)
from pdserve.kernels.gemv_row import _load_w, _row_step

# counters of one call site (int32, CHAIN_SLOT of them): the ticket, the done counters of
# o_proj, gate_up, down, and the programs out, the ticket and the done counters on 128-byte
# lines of their own (every item takes a ticket; waiting programs poll the done counters)
_TICKET = tl.constexpr(0)
_DONE = tl.constexpr(32)  # + stage
_OUT = tl.constexpr(64)


@jit
def _spin_until(ptr, target, PTX: tl.constexpr):
    """Wait until the int32 counter at ptr reaches target: polled with plain (volatile)
    loads and a short sleep, so that up to every program of the grid waiting here does not
    queue atomics ahead of the producers' releases on that L2 line; then one acquire, so
    that what the counted items stored before their release is visible after it."""
    seen = tl.load(ptr, volatile=True)
    while seen < target:
        if PTX:
            tl.inline_asm_elementwise("nanosleep.u32 256;\n\tmov.u32 $0, $1;", "=r,r", [seen],
                                      dtype=tl.int32, is_pure=False, pack=1)
        seen = tl.load(ptr, volatile=True)
    tl.atomic_add(ptr, 0, sem="acquire")


@jit
def _count_in(done_ptr, mine):
    """Add this program's finished items of a stage to its done counter, after every
    thread's stores (release)."""
    if mine > 0:
        tl.debug_barrier()
        tl.atomic_add(done_ptr, mine, sem="release")


@jit
def _prefetch_first(t, n_o, n_g, n_d, wo_ptr, wg_ptr, wd_ptr, D, KO, I, BN_O: tl.constexpr,
                    BK_O: tl.constexpr, BN_G: tl.constexpr, BK_G: tl.constexpr,
                    BN_D: tl.constexpr, BK_D: tl.constexpr, LINE: tl.constexpr,
                    PTX: tl.constexpr):
    """Ask L2 for the first K step's weight tile [BN, BK] of ticket t's item (LINE elements
    a 128-byte line; nothing past the last item). A prefetch holds no register: carried
    from item to item in registers, the FP8 tile took one register per byte (168 per
    thread, 3 programs per SM)."""
    if PTX:
        if t < n_o:
            _prefetch_tile(wo_ptr, t, D, KO, BN_O, BK_O, LINE)
        elif t < n_o + n_g:
            _prefetch_tile(wg_ptr, t - n_o, 2 * I, D, BN_G, BK_G, LINE)
        elif t < n_o + n_g + n_d:
            _prefetch_tile(wd_ptr, t - n_o - n_g, D, I, BN_D, BK_D, LINE)


@jit
def _prefetch_tile(w_ptr, blk, N, K, BN: tl.constexpr, BK: tl.constexpr, LINE: tl.constexpr):
    """prefetch.global.L2 of tile [BN, BK] at rows blk * BN .., columns 0.. of W [N, K]."""
    r = tl.minimum(blk * BN + tl.arange(0, BN)[:, None], N - 1).to(tl.int64)
    cols = (tl.arange(0, max(BK // LINE, 1)) * LINE)[None, :]
    l2_prefetch_flat(w_ptr, r * K + tl.minimum(cols, K - 1))


@jit
def _item(blk, nt, x_ptr, nw_ptr, w_ptr, s_ptr, add_ptr, y_ptr, N, K, stride_s, eps,
          n_o, n_g, n_d, wo_ptr, wg_ptr, wd_ptr, D, KO, I, PROLOGUE: tl.constexpr,
          HAS_ADD: tl.constexpr, SCALE: tl.constexpr, S_BN: tl.constexpr, S_BK: tl.constexpr,
          BN: tl.constexpr, BK: tl.constexpr, BN_O: tl.constexpr, BK_O: tl.constexpr,
          BN_G: tl.constexpr, BK_G: tl.constexpr, BN_D: tl.constexpr, BK_D: tl.constexpr,
          VEC: tl.constexpr, LINE: tl.constexpr, PTX: tl.constexpr):
    """Rows blk * BN .. of y = prologue(x) @ W[N, K]^T (+ add), as kernels/gemv_row.py's
    program blk computes them. With the last K step's tile in flight it asks L2 for the
    first tile of ticket nt's item and takes the ticket after that (a scalar atomic holds
    the program until it answers; returned), so the next item's first bytes are on their
    way while this one finishes."""
    offs_n = blk * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    offs_k0 = tl.arange(0, BK)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    acc = tl.zeros([BN, BK // VEC], tl.float32)
    ss = tl.zeros([BK // VEC], tl.float32)
    # The next item's first tile is asked into L2 first, then the K loop. (A K step peeled
    # off the loop, to send it with the last load or to preload the first tile, took
    # 121-125 registers per thread inside the work loop, against 72 without: cuobjdump of
    # the sm_90 build; 3-4 programs per SM instead of 8.)
    _prefetch_first(nt, n_o, n_g, n_d, wo_ptr, wg_ptr, wd_ptr, D, KO, I, BN_O, BK_O, BN_G,
                    BK_G, BN_D, BK_D, LINE, PTX)
    for k0 in range(0, K, BK):
        w = _load_w(w_rows, n_ok, offs_k0, k0, K, VEC, "evict_first")
        acc, ss = _row_step(w, k0, acc, ss, blk, offs_n, n_ok, offs_k0, x_ptr, x_ptr, nw_ptr,
                            x_ptr, s_ptr, N, K, stride_s, PROLOGUE, False, SCALE, S_BN, S_BK,
                            BN, BK, VEC)
    y = tl.sum(acc, axis=1)
    if PROLOGUE == 1:  # rmsnorm's per-row scale commutes with the dot product
        y = y * tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
    if HAS_ADD:
        y += tl.load(add_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y, mask=n_ok)


@jit
def _chain_kernel(a_ptr, res_ptr, nw_ptr, h_ptr, gu_ptr, y_ptr, wo_ptr, so_ptr, wg_ptr, sg_ptr,
                  wd_ptr, sd_ptr, cnt_ptr, D, KO, I, stride_so, stride_sg, stride_sd, eps,
                  n_o, n_g, n_d, grid, o_lines, o_elems,
                  SC_O: tl.constexpr, SBN_O: tl.constexpr, SBK_O: tl.constexpr,
                  SC_G: tl.constexpr, SBN_G: tl.constexpr, SBK_G: tl.constexpr,
                  SC_D: tl.constexpr, SBN_D: tl.constexpr, SBK_D: tl.constexpr,
                  BN_O: tl.constexpr, BK_O: tl.constexpr, BN_G: tl.constexpr,
                  BK_G: tl.constexpr, BN_D: tl.constexpr, BK_D: tl.constexpr,
                  VEC: tl.constexpr, PF: tl.constexpr,
                  PF_LINE: tl.constexpr, PTX: tl.constexpr, USE_PDL: tl.constexpr):
    """Weights are contiguous [N, K] (W_o [D, KO], W_gu [2I, D], W_down [D, I]), all of one
    dtype, FP8 ones as int8 bytes with their scales (SC_* as kernels/fp8_scales.py's SCALE);
    tiles [BN_*, BK_*] per projection."""
    total = n_o + n_g + n_d
    it = tl.program_id(0)
    _prefetch_first(it, n_o, n_g, n_d, wo_ptr, wg_ptr, wd_ptr, D, KO, I, BN_O, BK_O, BN_G,
                    BK_G, BN_D, BK_D, PF_LINE, PTX)
    if PF > 0:  # this program's share of o_proj's weight, PF_LINE elements a line, into L2
        first = tl.program_id(0) * o_lines
        line = tl.minimum(first + tl.arange(0, PF), first + o_lines - 1).to(tl.int64)
        l2_prefetch_flat(wo_ptr, tl.minimum(line * PF_LINE, o_elems - 1))
    if USE_PDL:  # the attention's output; the next kernel launches once all are in down
        tl.extra.cuda.gdc_wait()
    # One loop per stage (a program's items only grow): ptxas allocates each loop's
    # registers on its own (one loop over all three with a branch per item took 168 per
    # thread at 8 x 1024 FP8: 3 programs per SM).
    mine = it * 0  # this program's items of the stage, counted in once at its end
    while it < n_o:
        _item(it, it + grid, a_ptr, nw_ptr, wo_ptr, so_ptr, res_ptr, h_ptr, D, KO, stride_so,
              eps, n_o, n_g, n_d, wo_ptr, wg_ptr, wd_ptr, D, KO, I, 0, True, SC_O, SBN_O,
              SBK_O, BN_O, BK_O, BN_O, BK_O, BN_G, BK_G, BN_D, BK_D, VEC, PF_LINE, PTX)
        mine += 1
        it += grid
    _count_in(cnt_ptr + _DONE, mine)
    mine = it * 0
    if it < n_o + n_g:  # h whole (gate_up's norm reads all of it)
        _spin_until(cnt_ptr + _DONE, n_o, PTX)
    while it < n_o + n_g:
        _item(it - n_o, it + grid, h_ptr, nw_ptr, wg_ptr, sg_ptr, h_ptr, gu_ptr, 2 * I, D,
              stride_sg, eps, n_o, n_g, n_d, wo_ptr, wg_ptr, wd_ptr, D, KO, I, 1, False, SC_G,
              SBN_G, SBK_G, BN_G, BK_G, BN_O, BK_O, BN_G, BK_G, BN_D, BK_D, VEC, PF_LINE, PTX)
        mine += 1
        it += grid
    _count_in(cnt_ptr + _DONE + 1, mine)
    if it < total:
        _spin_until(cnt_ptr + _DONE + 1, n_g, PTX)
    if USE_PDL:  # the next kernel's programs take the places of those that finish
        tl.extra.cuda.gdc_launch_dependents()
    while it < total:
        _item(it - n_o - n_g, it + grid, gu_ptr, nw_ptr, wd_ptr, sd_ptr, h_ptr, y_ptr, D, I,
              stride_sd, eps, n_o, n_g, n_d, wo_ptr, wg_ptr, wd_ptr, D, KO, I, 2, True, SC_D,
              SBN_D, SBK_D, BN_D, BK_D, BN_O, BK_O, BN_G, BK_G, BN_D, BK_D, VEC, PF_LINE, PTX)
        it += grid
    # the last program out resets the counters for the next launch
    if tl.atomic_add(cnt_ptr + _OUT, 1, sem="acq_rel") == grid - 1:
        z = tl.arange(0, 128)
        tl.store(cnt_ptr + z, z * 0, mask=z <= _OUT)


class ChainWeight(NamedTuple):
    """One projection's weight [N, K] (16-bit, or FP8 with its float32 scales and block)."""
    weight: torch.Tensor
    scales: torch.Tensor | None = None
    block: Block | None = None


@dataclass(frozen=True)
class ChainConfig:
    """Tiles (block_n, block_k) of o_proj, gate_up, down (block_k shrinks to fit FP8 scales
    and K), warps per program, programs per SM (0: as many as fit; never more)."""
    o: tuple[int, int] = (4, 2048)
    gate_up: tuple[int, int] = (8, 1024)
    down: tuple[int, int] = (4, 2048)
    num_warps: int = 4
    per_sm: int = 0

    def __post_init__(self) -> None:
        for name in ("o", "gate_up", "down"):
            t = getattr(self, name)
            if len(t) != 2 or any(not isinstance(v, int) or v < 1 or v & (v - 1) for v in t):
                raise ValueError(f"config.{name}: {t!r} must be two powers of 2 >= 1")
        if not isinstance(self.num_warps, int) or self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"config.num_warps: {self.num_warps!r} not in 1, 2, 4, 8, 16")
        if not isinstance(self.per_sm, int) or not 0 <= self.per_sm <= 32:
            raise ValueError(f"config.per_sm: {self.per_sm!r} must be an int in [0, 32]")


def _stage_consts(ws: tuple[ChainWeight, ...], cfg: ChainConfig, vec: int
                  ) -> tuple[list[tuple], dict, list[int]]:
    """Per projection: (weight as the kernel reads it, scales, scales' row stride), the
    SC_/SBN_/SBK_/BN_/BK_ constexprs, and its number of items (row blocks)."""
    ptrs, consts, counts = [], {}, []
    for tag, w, (bn, bk) in zip("OGD", ws, (cfg.o, cfg.gate_up, cfg.down)):
        N, K = w.weight.shape
        bk = min(bk, next_pow2(K))
        sc, s_bn, s_bk = 0, 1, 1
        if w.scales is not None:
            bk = fit_block_k(w.block, N, K, bn, bk)
            s_bn, s_bk = kernel_block(w.block, N, K)
            sc = scale_mode(w.block, N, K, bn, bk)
        if bk < vec:
            raise ValueError(f"config: a K step of {bk} is narrower than {vec} columns per "
                             f"thread")
        ptrs.append((w.weight, w.weight, 0) if w.scales is None else
                    (w.weight.view(torch.int8), w.scales, w.scales.stride(0)))
        consts.update({f"SC_{tag}": sc, f"SBN_{tag}": s_bn, f"SBK_{tag}": s_bk,
                       f"BN_{tag}": bn, f"BK_{tag}": bk})
        counts.append(triton.cdiv(N, bn))
    return ptrs, consts, counts


def _check(a: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
           ws: tuple[ChainWeight, ChainWeight, ChainWeight]) -> tuple[int, int, int]:
    check_tensor("attn", a, ndim=2, dtypes=FLOAT_DTYPES, last_contiguous=True)
    check_launchable("attn", a)
    if a.shape[0] != 1:
        raise ValueError(f"attn: the chain takes one row, got {a.shape[0]}")
    D, KO = ws[0].weight.shape
    I2, I = ws[1].weight.shape[0], ws[2].weight.shape[1]
    for name, w, shape in (("o_proj", ws[0], (D, a.shape[1])), ("gate_up_proj", ws[1], (2 * I, D)),
                           ("down_proj", ws[2], (D, I))):
        check_tensor(f"{name}.weight", w.weight, shape=shape, dtypes=(a.dtype, FP8_DTYPE),
                     device=a.device)
        if not w.weight.is_contiguous():
            raise ValueError(f"{name}.weight: must be contiguous")
        check_scales(w.weight, w.scales, w.block, f"{name}.weight")
    if I2 != 2 * I:
        raise ValueError(f"gate_up_proj.weight: {I2} rows, expected 2 x down's {I} columns")
    check_tensor("residual", residual, shape=(1, D), dtypes=(a.dtype,), device=a.device,
                 last_contiguous=True)
    check_tensor("norm_weight", norm_weight, shape=(D,), dtypes=FLOAT_DTYPES, device=a.device)
    return D, KO, I


@functools.cache
def _per_sm(n_regs: int, shared: int, num_warps: int) -> int:
    """Programs of num_warps warps that fit one SM at once: by registers (64K, allocated in
    units of 8 per thread), threads (2048), shared memory (227 KB, 1 KB of it reserved per
    program) and the 32-program cap."""
    threads = 32 * num_warps
    regs = max(8, -(-n_regs // 8) * 8) * threads
    return max(1, min(65536 // regs, 2048 // threads, (227 << 10) // (shared + 1024), 32))


# the compiled kernel's (registers per thread, shared memory, spilled registers), by its
# constexprs: the grid must fit the GPU at once (module doc)
COMPILED: dict[tuple, tuple[int, int, int]] = {}


def gemv_chain(attn: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
               o_proj: ChainWeight, gate_up: ChainWeight, down: ChainWeight, slot: int,
               config: ChainConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h) of the module doc for one row: attn [1, KO], residual [1, D] (the stream before
    o_proj's add), norm_weight [D] (post-attention norm), weights o [D, KO], gate_up [2I, D],
    down [D, I]. slot: this call site's counters (one per decoder layer; two launches in
    flight must not share one)."""
    if not (isinstance(eps, float) and eps > 0):
        raise ValueError(f"eps: must be a float > 0, got {eps!r}")
    D, KO, I = _check(attn, residual, norm_weight, (o_proj, gate_up, down))
    ws = (o_proj, gate_up, down)
    # the interpreter runs one program at a time: big tiles run fastest there
    big = ((16, 256),) * 3
    cfg = config or (ChainConfig(*big) if interpreting() else ChainConfig())
    vec = 16 // attn.element_size()
    ptrs, consts, counts = _stage_consts(ws, cfg, vec)
    h = torch.empty((1, D), dtype=attn.dtype, device=attn.device)
    gu = torch.empty((1, 2 * I), dtype=attn.dtype, device=attn.device)
    y = torch.empty((1, D), dtype=attn.dtype, device=attn.device)
    cnt = chain_counters(attn.device, slot)
    key = (tuple(sorted(consts.items())), cfg.num_warps, attn.dtype)
    grid = 1  # the interpreter; on a GPU, before the first compile: one program per SM
    if not interpreting():
        cap = _per_sm(*COMPILED[key][:2], cfg.num_warps) if key in COMPILED else 1
        grid = num_sms(attn.device.index or 0) * min(cfg.per_sm or cap, cap)
    line = 128 // o_proj.weight.element_size()  # elements per 128-byte line
    o_lines = 0 if interpreting() else triton.cdiv(triton.cdiv(o_proj.weight.numel(), line), grid)
    kernel = _chain_kernel[(grid,)](
        attn, residual, norm_weight, h, gu, y, *ptrs[0][:2], *ptrs[1][:2], *ptrs[2][:2], cnt, D,
        KO, I, ptrs[0][2], ptrs[1][2], ptrs[2][2], float(eps), counts[0], counts[1], counts[2],
        grid, o_lines, o_proj.weight.numel(), **consts, VEC=vec,
        PF=min(next_pow2(o_lines), 512) if o_lines else 0, PF_LINE=line,
        PTX=not interpreting(),
        num_warps=cfg.num_warps, num_stages=1, **pdl_launch(attn))
    if not interpreting() and key not in COMPILED:
        COMPILED[key] = (int(kernel.n_regs), int(kernel.metadata.shared),
                         int(getattr(kernel, "n_spills", -1)))
    return y, h
