"""A one-shot all-reduce over peer GPU memory with no barrier: each rank pushes its rows into
every rank's receive buffer, then sums what has arrived in its own (the "Lamport" scheme of
TensorRT-LLM's low-latency all-reduce).

Why: torch's symmetric-memory one-shot kernel copies in, meets every peer at a barrier of
device-side signals (a round trip over NVLink), sums the peers' buffers (another remote read)
and meets them again at the end so that no peer overwrites a buffer still being read: ~6 us a
call on two H200s for one row, 73 calls a Qwen3-8B decode step. Here a rank's data reaches
the peer in one NVLink write and is read locally. And the kernel takes part in programmatic
dependent launch (PDL): it lets the next kernel (a GEMV, which loads its first weight tiles
before its wait) start at once, and waits for the kernel before it only once it is scheduled,
where torch's kernel broke the GEMV chain twice a layer.

How a rank knows its peers' rows arrived: every element slot of a receive buffer holds a
sentinel, the bits of -0.0, until the data is written; a sender writes -0.0 as +0.0 (the sum
is the same number), and a reader polls each element until it is not the sentinel, then sums
and writes the sentinel back. Each element is checked on its own, so no ordering between a
peer's stores is needed.

Buffers: rank r's receive buffer is [2 parities, world slots, slot] elements (bits: int16
for bf16, int32 for fp32); the rows rank q pushes land in slot q. Every rank's buffer is a
kernel argument (up to MAX_WORLD), so that 16-byte vectors move. Consecutive calls
alternate parity, so a fast peer's next call (the other parity) cannot overwrite rows still
being read; the call after next can only start once this rank has pushed its rows for the
call between, which it does only after it finished reading (the kernels of a stream
complete in order; with PDL each waits for the one before). The parity is per program:
chunk c of BLOCK elements is always handled by program c % GROUP, whose own counter in
`epochs` [GROUP] int32 advances once per call it runs in, so every rank agrees on it without
any host state, across CUDA-graph replays too.

No deadline: a peer that never pushes leaves this kernel polling, like any collective inside
a CUDA graph (the GPU watchdog ends the process, engine/dist/watchdog.py).

Reference: torch.stack(xs).sum(0) in fp32, rounded to the dtype (push_all_reduce_reference).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._triton import check_tensor, jit

BLOCK = 1024  # elements per chunk (8 per thread at 4 warps: 16-byte bf16 vectors)
GROUP = 128  # chunk c belongs to program c % GROUP: fixed, so a chunk's parity counter is too
BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}  # the element's bits
SENTINEL = {torch.int16: -(1 << 15), torch.int32: -(1 << 31)}  # the bits of -0.0


@jit
def _pick(q: tl.constexpr, b0, b1, b2, b3, b4, b5, b6, b7):
    """Rank q's receive buffer. Passed as tensors, not as an address table: Triton then knows
    they are 16-byte aligned and moves 16-byte vectors (scalar 2-byte stores over NVLink,
    from addresses loaded at run time, were one transaction per element)."""
    if q == 0:
        return b0
    elif q == 1:
        return b1
    elif q == 2:
        return b2
    elif q == 3:
        return b3
    elif q == 4:
        return b4
    elif q == 5:
        return b5
    elif q == 6:
        return b6
    else:
        return b7


@jit
def _push_all_reduce_kernel(x_ptr, out_ptr, b0, b1, b2, b3, b4, b5, b6, b7, epochs_ptr, n,
                            slot, RANK: tl.constexpr, WORLD: tl.constexpr,
                            GROUP: tl.constexpr, BLOCK: tl.constexpr, SENT: tl.constexpr,
                            PUSH: tl.constexpr, SUM: tl.constexpr, USE_PDL: tl.constexpr):
    """x_ptr, out_ptr: [n] as their bits (int16 / int32); b0..b{WORLD-1}: every rank's
    receive buffer as mapped here (the rest repeat b0); epochs_ptr: [GROUP] int32 (this
    rank's). PUSH and SUM split the call for the CPU tests (one process plays every rank
    in turn)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel's prologue may start now
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
    pid = tl.program_id(0)
    epoch = tl.load(epochs_ptr + pid)
    parity = (epoch % 2).to(tl.int64)
    nchunks = tl.cdiv(n, BLOCK)
    lanes = tl.arange(0, BLOCK)
    if PUSH:  # every chunk first: the peers' reads below then wait about one write's latency
        for c in range(pid, nchunks, GROUP):
            offs = c * BLOCK + lanes
            mask = offs < n
            v = tl.load(x_ptr + offs, mask=mask, other=0)
            v = tl.where(v == SENT, 0, v)  # -0.0 travels as +0.0
            for q in tl.static_range(WORLD):
                dst = _pick(q, b0, b1, b2, b3, b4, b5, b6, b7)
                tl.store(dst + (parity * WORLD + RANK) * slot + offs, v, mask=mask)
    if SUM:
        mine = _pick(RANK, b0, b1, b2, b3, b4, b5, b6, b7)
        for c in range(pid, nchunks, GROUP):
            offs = c * BLOCK + lanes
            mask = offs < n
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for q in tl.static_range(WORLD):  # rank order: the same sum on every rank
                src = mine + (parity * WORLD + q) * slot + offs
                v = tl.load(src, mask=mask, other=0, volatile=True)
                while tl.sum((v == SENT).to(tl.int32), axis=0) > 0:  # not all arrived yet
                    v = tl.load(src, mask=mask, other=0, volatile=True)
                acc += v.to(out_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
                tl.store(src, tl.full([BLOCK], SENT, v.dtype), mask=mask)  # empty again
            tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(epochs_ptr + pid, epoch + 1)


MAX_WORLD = 8  # the kernel's buffer arguments


class PushBuffers:
    """One rank's side of the scheme for one dtype: `bufs`, every rank's receive buffer as
    mapped in this process (its own at index rank), each of 2 * world * slot elements of the
    dtype's bits and filled with the sentinel before any rank pushes (PushBuffers.empty),
    and this rank's parity counters."""

    def __init__(self, dtype: torch.dtype, bufs: list[torch.Tensor], slot: int,
                 rank: int) -> None:
        if dtype not in BITS:
            raise ValueError(f"dtype: push_all_reduce sums {sorted(map(str, BITS))}, got {dtype}")
        world = len(bufs)
        if not 1 <= world <= MAX_WORLD or not 0 <= rank < world or slot <= 0:
            raise ValueError(f"bufs: {world} buffers (1..{MAX_WORLD}) for rank {rank}, "
                             f"slot {slot}")
        for q, b in enumerate(bufs):
            check_tensor(f"bufs[{q}]", b, ndim=1, dtypes=(BITS[dtype],))
            if b.numel() != self.elements(slot, world) or b.device != bufs[0].device:
                raise ValueError(f"bufs[{q}]: {b.numel()} elements on {b.device}, expected "
                                 f"{self.elements(slot, world)} on {bufs[0].device}")
        self.dtype, self.bufs, self.slot, self.rank, self.world = dtype, bufs, slot, rank, world
        self.epochs = torch.zeros(GROUP, dtype=torch.int32, device=bufs[0].device)

    @staticmethod
    def elements(slot: int, world: int) -> int:
        """A receive buffer's length in elements."""
        return 2 * world * slot

    @staticmethod
    def empty(buffer: torch.Tensor) -> torch.Tensor:
        """Fill a receive buffer (its bits dtype) with the sentinel: every slot empty."""
        return buffer.fill_(SENTINEL[buffer.dtype])


def push_all_reduce(x: torch.Tensor, buffers: PushBuffers, pdl: bool = False,
                    phases: tuple[bool, bool] = (True, True)) -> torch.Tensor:
    """The sum over ranks of x (any shape, contiguous, buffers.dtype, at most buffers.slot
    elements) as a new tensor; every rank calls it, in the same order, with the same shape.
    pdl: launched as a programmatic dependent of the kernel before (only behind Triton
    kernels: a PDL launch behind another library's kernel broke graph captures,
    kernels/rmsnorm.py). phases (push, sum): both, except in the CPU tests."""
    check_tensor("x", x, dtypes=(buffers.dtype,))
    if not x.is_contiguous():
        raise ValueError("x: must be contiguous")
    if x.numel() > buffers.slot:
        raise ValueError(f"x: {x.numel()} elements, the buffers hold {buffers.slot}")
    if x.device != buffers.bufs[0].device:
        raise ValueError(f"x: on {x.device}, the buffers on {buffers.bufs[0].device}")
    out = torch.empty_like(x)
    n = x.numel()
    if n == 0:
        return out
    bits = BITS[buffers.dtype]
    grid = (min(GROUP, triton.cdiv(n, BLOCK)),)
    bufs = buffers.bufs + [buffers.bufs[0]] * (MAX_WORLD - buffers.world)
    pdl_args = {"USE_PDL": True, "launch_pdl": True} if pdl and x.is_cuda else {"USE_PDL": False}
    _push_all_reduce_kernel[grid](
        x.view(-1).view(bits), out.view(-1), *bufs, buffers.epochs, n, buffers.slot,
        RANK=buffers.rank, WORLD=buffers.world, GROUP=GROUP, BLOCK=BLOCK, SENT=SENTINEL[bits],
        PUSH=phases[0], SUM=phases[1], num_warps=4, **pdl_args)
    return out


def push_all_reduce_reference(xs: list[torch.Tensor]) -> torch.Tensor:
    """Every rank's x summed in rank order in fp32, rounded to x's dtype."""
    acc = torch.zeros_like(xs[0], dtype=torch.float32)
    for x in xs:
        acc += x.float()
    return acc.to(xs[0].dtype)
