"""Token-to-expert alignment for the grouped MoE GEMMs (vLLM / SGLang's moe_align_block_size).

topk_ids [T, top_k] lists N = T * top_k (token, slot) pairs, pair p = t * top_k + j. The
grouped GEMMs (kernels.moe_gemm) want them grouped by expert, each expert's run padded to a
multiple of block_m, so that one program multiplies one block of rows by one expert:

    sorted_ids [ROWS] int32   pair ids, expert 0's first (in pair order), then expert 1's, ...;
                              padding rows hold N (a pair that does not exist: skipped)
    expert_ids [BLOCKS] int32 the expert of each block of block_m rows; -1 past the last one
    num_padded [1] int32      rows in use (a multiple of block_m), sum_e ceil(n_e / block_m) * block_m

The decode step is captured in CUDA graphs, so nothing here may depend on the data on the host
(no .item(), no data-dependent shapes): ROWS and BLOCKS are the worst case for a given N,
align_capacity(N, E, block_m). At most min(E, N) experts receive pairs and each pads by at most
block_m - 1 rows, so ROWS = ceil((N + min(E, N) * (block_m - 1)) / block_m) * block_m (tighter
than N + E * (block_m - 1) at decode sizes: batch 1, top-8 of 128 experts, block_m 16 gives 8
blocks instead of 121). Experts without pairs get no rows and no blocks: they cost nothing in
the GEMMs. Ids outside [0, E) are a caller error; such pairs are left out of sorted_ids.

One program does the alignment in two passes over the ids (counts; then a stable scatter,
each pair's rank within its expert from a cumulative sum over a [BLOCK, E_P] one-hot tile).
Up to MAX_FEW pairs (decode batches) it compares pairs with pairs instead (align_few: [N_P,
N_P] tiles, no E-wide passes, no barrier; every output a reduction over the pairs), which
kernels.moe_route's last program also runs: there, at batch 1 on an H200, the E-wide passes
made the router launch nearly as slow as the two launches it replaced.
Extra programs zero an optional int32 buffer, the down GEMM's arrival counters, so that needs
no launch of its own.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._triton import (
    check_launchable,
    check_tensor,
    is_pow2,
    jit,
    next_pow2,
    pdl_enter,
    pdl_launch,
)

MAX_EXPERTS = 1024
ZERO_BLOCK = 4096  # elements of the zeroed buffer per extra program
MAX_FEW = 64  # up to this many pairs, align_few (pair-against-pair tiles) does the alignment


def few_pairs(num_pairs: int) -> int:
    """N_P of align_few: the pairs rounded up to a power of 2, at least 16."""
    return max(16, next_pow2(num_pairs))


def few_chunk(num_pairs: int) -> int:
    """Rows of sorted_ids per step of align_few: [R_CHUNK, N_P] tiles of <= 8K elements."""
    return max(16, min(256, 8192 // few_pairs(num_pairs)))


def align_tiles(num_pairs: int, e_p: int) -> tuple[int, int]:
    """(BLOCK, num_warps): pairs per [BLOCK, E_P] one-hot step, no bigger than the batch (a
    decode step does one small step). H200 sweep at E = 128, top-8: 128 pairs and 4 warps won
    at every batch (1: 7 us, 16: 9.5 us, 64: 18 us, 256: 54 us, 2048: 386 us; 8 or 16 warps
    were slower); 512 pairs exceeded shared memory."""
    return max(16, min(128, 16384 // e_p, next_pow2(num_pairs))), 4


def align_capacity(num_pairs: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """(ROWS, BLOCKS): the static lengths of sorted_ids and expert_ids for N pairs."""
    worst = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    blocks = triton.cdiv(worst, block_m)
    return blocks * block_m, blocks


@jit
def _expert_offsets(ids_ptr, N, E, BLOCK: tl.constexpr, E_P: tl.constexpr,
                    BLOCK_M: tl.constexpr):
    """Pass 1: pairs per expert, padded to BLOCK_M; returns (counts-padded start, end) [E_P]."""
    e = tl.arange(0, E_P)
    counts = tl.zeros([E_P], tl.int32)
    for i0 in range(0, N, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + i, mask=i < N, other=-1)
        hit = (ids[:, None] == e[None, :]) & (e < E)[None, :]
        counts += tl.sum(hit.to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    return end - padded, end


@jit
def _fill(sorted_ptr, expert_ptr, npad_ptr, end, N, E, ROWS, BLOCKS, E_P: tl.constexpr,
          BLOCK_M: tl.constexpr, FILL: tl.constexpr):
    """Every row N (padding until the scatter), each block's expert, and num_padded."""
    e = tl.arange(0, E_P)
    total = tl.max(end, axis=0)
    for r0 in range(0, ROWS, FILL):
        r = r0 + tl.arange(0, FILL)
        tl.store(sorted_ptr + r, tl.zeros([FILL], tl.int32) + N, mask=r < ROWS)
    for b0 in range(0, BLOCKS, FILL):
        b = b0 + tl.arange(0, FILL)
        row = b * BLOCK_M
        # the owner of row r is the number of experts whose padded run ends at or before r
        # (ends are non-decreasing; an expert without pairs ends where it starts)
        before = (end[None, :] <= row[:, None]) & (e < E)[None, :]
        owner = tl.sum(before.to(tl.int32), axis=1)
        tl.store(expert_ptr + b, tl.where(row < total, owner, -1), mask=b < BLOCKS)
    tl.store(npad_ptr, total)


@jit
def _scatter(ids_ptr, sorted_ptr, start, N, E, BLOCK: tl.constexpr, E_P: tl.constexpr):
    """Pass 2: pair i goes to start[e] + (pairs of expert e before i): stable, deterministic."""
    e = tl.arange(0, E_P)
    run = start
    for i0 in range(0, N, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + i, mask=i < N, other=-1)
        ok = (i < N) & (ids >= 0) & (ids < E)
        hit = ((ids[:, None] == e[None, :]) & (e < E)[None, :]).to(tl.int32)  # [BLOCK, E_P]
        rank = tl.cumsum(hit, axis=0) - 1 + run[None, :]
        dest = tl.sum(hit * rank, axis=1)
        tl.store(sorted_ptr + dest, i, mask=ok)
        run += tl.sum(hit, axis=0)


@jit
def _few_dests(ids_ptr, N, E, N_P: tl.constexpr, BLOCK_M: tl.constexpr):
    """Pair against pair ([N_P, N_P] tiles; N <= N_P): each pair's expert (-1 when invalid or
    past N), row in sorted_ids, whether it is its expert's first pair, and the padded run
    length of its expert."""
    i = tl.arange(0, N_P)
    e = tl.load(ids_ptr + i, mask=i < N, other=-1).to(tl.int32)
    ok = (i < N) & (e >= 0) & (e < E)
    e = tl.where(ok, e, -1)
    same = (e[:, None] == e[None, :]) & ok[:, None] & ok[None, :]
    rank = tl.sum((same & (i[None, :] < i[:, None])).to(tl.int32), axis=1)  # stable order
    pad = (tl.sum(same.to(tl.int32), axis=1) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    first = ok & (rank == 0)
    # the run of expert e starts after the padded runs of the experts below it, each
    # counted once, at its first pair
    below = first[None, :] & (e[None, :] < e[:, None])
    start = tl.sum(tl.where(below, pad[None, :], 0), axis=1)
    return e, start + rank, first, start, pad


@jit
def align_few(ids_ptr, sorted_ptr, expert_ptr, npad_ptr, N, E, ROWS, BLOCKS,
              N_P: tl.constexpr, BLOCK_M: tl.constexpr, R_CHUNK: tl.constexpr):
    """align_pairs' result for N <= N_P pairs without [., E_P] tiles, barriers or scatter:
    decode batches have a few pairs and BLOCKS <= N (each block holds >= 1 pair), so every
    output is a reduction over the pairs."""
    e, dest, first, start, pad = _few_dests(ids_ptr, N, E, N_P, BLOCK_M)
    i = tl.arange(0, N_P)
    for r0 in range(0, ROWS, R_CHUNK):  # row r holds the pair whose dest is r, else N
        r = r0 + tl.arange(0, R_CHUNK)
        hit = (dest[None, :] == r[:, None]) & (e >= 0)[None, :]
        tl.store(sorted_ptr + r, tl.min(tl.where(hit, i[None, :], N), axis=1), mask=r < ROWS)
    row = i * BLOCK_M  # block b (< BLOCKS <= N_P) belongs to the run that covers its row
    covers = first[None, :] & (start[None, :] <= row[:, None]) & \
        (row[:, None] < (start + pad)[None, :])
    owner = tl.max(tl.where(covers, e[None, :], -1), axis=1)
    tl.store(expert_ptr + i, owner, mask=i < BLOCKS)
    tl.store(npad_ptr, tl.sum(tl.where(first, pad, 0), axis=0))


@jit
def align_pairs(ids_ptr, sorted_ptr, expert_ptr, npad_ptr, N, E, ROWS, BLOCKS,
                BLOCK: tl.constexpr, E_P: tl.constexpr, BLOCK_M: tl.constexpr,
                FILL: tl.constexpr):
    """The whole alignment in the calling program (one program: its barrier orders it).
    Also called by kernels.moe_route's last program for decode-sized batches."""
    start, end = _expert_offsets(ids_ptr, N, E, BLOCK, E_P, BLOCK_M)
    _fill(sorted_ptr, expert_ptr, npad_ptr, end, N, E, ROWS, BLOCKS, E_P, BLOCK_M, FILL)
    # the padding stores above must land before the scatter overwrites real rows (other
    # threads of this program write them): a CTA barrier orders this program's memory
    tl.debug_barrier()
    _scatter(ids_ptr, sorted_ptr, start, N, E, BLOCK, E_P)


@jit
def zero_int32(zero_ptr, first, count, ZBLOCK: tl.constexpr):
    """zero_ptr[first:first + count] = 0, ZBLOCK elements per step."""
    for z0 in range(first, first + count, ZBLOCK):
        z = z0 + tl.arange(0, ZBLOCK)
        tl.store(zero_ptr + z, tl.zeros([ZBLOCK], tl.int32), mask=z < first + count)


@jit
def _align_kernel(ids_ptr, sorted_ptr, expert_ptr, npad_ptr, zero_ptr, N, E, ROWS, BLOCKS,
                  ZERO_N, BLOCK: tl.constexpr, E_P: tl.constexpr, BLOCK_M: tl.constexpr,
                  FILL: tl.constexpr, ZBLOCK: tl.constexpr, FEW: tl.constexpr,
                  USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    if pid > 0:
        zero_int32(zero_ptr, (pid - 1) * ZBLOCK, tl.minimum(ZBLOCK, ZERO_N - (pid - 1) * ZBLOCK),
                   ZBLOCK)
    elif FEW > 0:  # FEW: a power of 2 >= N
        align_few(ids_ptr, sorted_ptr, expert_ptr, npad_ptr, N, E, ROWS, BLOCKS, FEW, BLOCK_M,
                  FILL)
    else:
        align_pairs(ids_ptr, sorted_ptr, expert_ptr, npad_ptr, N, E, ROWS, BLOCKS, BLOCK, E_P,
                    BLOCK_M, FILL)


def alignment_buffers(num_pairs: int, num_experts: int, block_m: int, device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty (sorted_ids [ROWS], expert_ids [BLOCKS], num_padded [1]) int32 for N pairs."""
    rows, blocks = align_capacity(num_pairs, num_experts, block_m)
    return (torch.empty(rows, dtype=torch.int32, device=device),
            torch.empty(blocks, dtype=torch.int32, device=device),
            torch.empty(1, dtype=torch.int32, device=device))


def check_align_args(num_experts: int, block_m: int, zero: torch.Tensor | None,
                     device: torch.device) -> None:
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts: {num_experts} not in 1..{MAX_EXPERTS}")
    if not is_pow2(block_m) or block_m > 256:
        raise ValueError(f"block_m: {block_m} must be a power of 2 in 1..256")
    if zero is not None:
        check_tensor("zero", zero, ndim=1, dtypes=(torch.int32,), device=device)
        if not zero.is_contiguous():
            raise ValueError(f"zero: must be contiguous, strides {zero.stride()}")


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
              zero: torch.Tensor | None = None, pdl: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, top_k] (int32 or int64, contiguous; values in [0, num_experts)) ->
    (sorted_ids [ROWS] int32, expert_ids [BLOCKS] int32, num_padded [1] int32), new tensors
    with (ROWS, BLOCKS) = align_capacity(T * top_k, num_experts, block_m), as the module
    docstring describes. zero: an optional contiguous int32 buffer the same launch sets to 0.
    pdl: a programmatic dependent launch (only right after another pdserve Triton kernel).
    One kernel launch, no host synchronisation."""
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64))
    check_launchable("topk_ids", topk_ids)
    if not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids: must be contiguous, strides {topk_ids.stride()}")
    check_align_args(num_experts, block_m, zero, topk_ids.device)
    N = topk_ids.numel()
    sorted_ids, expert_ids, num_padded = alignment_buffers(N, num_experts, block_m,
                                                           topk_ids.device)
    zero_n = 0 if zero is None else zero.numel()
    if N == 0 and zero_n == 0:  # no tokens: nothing to launch
        return sorted_ids, expert_ids, num_padded.zero_()
    e_p = max(2, next_pow2(num_experts))
    grid = (1 + triton.cdiv(zero_n, ZERO_BLOCK),)
    block, warps = align_tiles(N, e_p)
    _align_kernel[grid](topk_ids, sorted_ids, expert_ids, num_padded,
                        zero if zero is not None else sorted_ids, N, num_experts,
                        sorted_ids.numel(), expert_ids.numel(), zero_n, BLOCK=block, E_P=e_p,
                        BLOCK_M=block_m, FILL=few_chunk(N) if N <= MAX_FEW else 256,
                        ZBLOCK=ZERO_BLOCK, FEW=few_pairs(N) if 0 < N <= MAX_FEW else 0,
                        num_warps=warps,
                        **(pdl_launch(topk_ids) if pdl else {"USE_PDL": False}))
    return sorted_ids, expert_ids, num_padded
