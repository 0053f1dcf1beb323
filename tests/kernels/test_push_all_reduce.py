"""kernels/push_all_reduce.py with one process playing every rank (under the interpreter, or
compiled on one GPU): every rank maps every buffer at the same address here. The push and
sum phases run apart (a rank's sum polls until every peer has pushed: in one process, on one
stream, the peers push first). The real two-GPU run: tests/dist/test_peer_all_reduce_gpu.py."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pdserve.kernels.push_all_reduce import (
    BITS,
    BLOCK,
    GROUP,
    SENTINEL,
    PushBuffers,
    push_all_reduce,
    push_all_reduce_reference,
)

# the interpreter converts each program's id array to a loop bound (numpy deprecation noise)
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


def _ranks(world: int, slot: int, dtype: torch.dtype,
           device: torch.device = torch.device("cpu")) -> tuple[list[PushBuffers], list]:
    raw = [PushBuffers.empty(torch.empty(PushBuffers.elements(slot, world), dtype=BITS[dtype],
                                         device=device))
           for _ in range(world)]
    return [PushBuffers(dtype, raw, slot, r) for r in range(world)], raw


def _call(ranks: list[PushBuffers], xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """One all-reduce: every rank pushes, then every rank sums (rank 0 in one launch of
    both phases, once the others have pushed)."""
    for b, x in zip(ranks[1:], xs[1:]):
        push_all_reduce(x, b, phases=(True, False))
    outs = [push_all_reduce(xs[0], ranks[0])]
    return outs + [push_all_reduce(x, b, phases=(False, True)) for b, x in zip(ranks[1:], xs[1:])]


@pytest.mark.parametrize("world,dtype", [(2, torch.bfloat16), (3, torch.float32),
                                         (1, torch.bfloat16)])
def test_sums_match_the_reference_across_calls_of_odd_sizes(world: int, dtype, device) -> None:
    """Sizes that end mid-chunk, one chunk, many chunks (more than GROUP: a program loops),
    in turn: every rank gets the reference sum, bit for bit the same; after each call every
    receive buffer is empty again (all sentinel) and the parity counters moved."""
    slot = (GROUP + 3) * BLOCK
    ranks, raw = _ranks(world, slot, dtype, device)
    g = torch.Generator().manual_seed(0)
    for numel in (1, 37, BLOCK, 3 * BLOCK + 5, (GROUP + 2) * BLOCK + 1, 4097):
        xs = [torch.randn(numel, generator=g).to(device, dtype) for _ in range(world)]
        xs[0][0] = -0.0  # travels as +0.0: the sum is unchanged
        outs = _call(ranks, xs)
        want = push_all_reduce_reference(xs)
        for out in outs:
            assert out.dtype == dtype and out.shape == xs[0].shape
            # bf16: the interpreter rounds fp32 -> bf16 toward zero, the GPU to nearest
            tol = {"atol": 0, "rtol": 2 ** -7} if dtype == torch.bfloat16 else {"atol": 0, "rtol": 0}
            torch.testing.assert_close(out, want, **tol)
            assert torch.equal(out.view(BITS[dtype]), outs[0].view(BITS[dtype]))
        for r in raw:
            assert (r == SENTINEL[BITS[dtype]]).all(), f"a slot left full after {numel}"
    used = ranks[0].epochs
    assert used[0] == 6 and used[GROUP - 1] == 1  # program 0 ran every call; the last one once


def test_consecutive_calls_alternate_buffer_halves(device) -> None:
    """A peer's push for the next call lands in the other parity: pushed before this rank
    summed, it neither corrupts this sum nor is lost for the next."""
    ranks, _ = _ranks(2, 2 * BLOCK, torch.float32, device)
    a = [torch.full((5,), float(r + 1), device=device) for r in range(2)]
    b = [torch.full((5,), 10.0 * (r + 1), device=device) for r in range(2)]
    push_all_reduce(a[0], ranks[0], phases=(True, False))
    push_all_reduce(a[1], ranks[1])  # rank 1 done with call 1 (its sum: rank 0 pushed)...
    push_all_reduce(b[1], ranks[1], phases=(True, False))  # ...and pushed call 2 early
    three, thirty = (torch.full((5,), v, device=device) for v in (3.0, 30.0))
    assert torch.equal(push_all_reduce(a[0], ranks[0], phases=(False, True)), three)
    push_all_reduce(b[0], ranks[0], phases=(True, False))
    assert torch.equal(push_all_reduce(b[0], ranks[0], phases=(False, True)), thirty)
    assert torch.equal(push_all_reduce(b[1], ranks[1], phases=(False, True)), thirty)


def test_bad_arguments_are_refused_naming_the_field() -> None:
    ranks, _ = _ranks(2, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="^x: .* elements, the buffers hold 64"):
        push_all_reduce(torch.zeros(65, dtype=torch.bfloat16), ranks[0])
    with pytest.raises(TypeError, match="^x: dtype torch.float32"):
        push_all_reduce(torch.zeros(8, dtype=torch.float32), ranks[0])
    with pytest.raises(ValueError, match="^x: must be contiguous"):
        push_all_reduce(torch.zeros(8, 8, dtype=torch.bfloat16).t(), ranks[0])
    with pytest.raises(ValueError, match="^dtype:"):
        PushBuffers(torch.float16, ranks[0].bufs, 64, 0)
    with pytest.raises(ValueError, match="^bufs: 2 buffers .* for rank 2"):
        PushBuffers(torch.bfloat16, ranks[0].bufs, 64, 2)
    with pytest.raises(ValueError, match=r"^bufs\[0\]: 256 elements .* expected 512"):
        PushBuffers(torch.bfloat16, ranks[0].bufs, 128, 0)
    with pytest.raises(TypeError, match=r"^bufs\[0\]: dtype"):
        PushBuffers(torch.bfloat16, [b.view(torch.bfloat16) for b in ranks[0].bufs], 64, 0)


def test_the_tp_group_imports_the_kernel_only_when_it_joins() -> None:
    """engine/dist keeps its copies of the kernel's constants in step, and importing the TP
    group does not import triton (a process without peer memory never needs it; importing
    triton first would also pin the interpreter choice, kernels/triton_mode.py)."""
    from pdserve.engine.dist import peer_all_reduce as peer
    from pdserve.kernels import push_all_reduce as kernel

    assert peer.DTYPES == tuple(kernel.BITS) and peer.MAX_WORLD == kernel.MAX_WORLD
    code = ("import sys, pdserve.engine.dist.group, pdserve.engine.dist.parallel, "
            "pdserve.engine.dist.lockstep; print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.gpu
def test_compiled_on_one_gpu_alone_and_in_a_pdl_chained_graph() -> None:
    """The compiled kernel on one GPU as a group of one (its own buffer is every buffer):
    odd sizes give x back exactly, eagerly and replayed in a CUDA graph of PDL-chained calls
    (the parity counters advance on the device between replays). Two GPUs:
    tests/dist/test_peer_all_reduce_gpu.py."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    slot = (GROUP + 2) * BLOCK
    buf = PushBuffers.empty(torch.empty(PushBuffers.elements(slot, 1), dtype=torch.int16,
                                        device=dev))
    ranks = PushBuffers(torch.bfloat16, [buf], slot, 0)
    xs = [torch.randn(n, device=dev).to(torch.bfloat16) for n in (1, 37, 4096, slot - 3)]
    for x in xs:
        assert torch.equal(push_all_reduce(x, ranks), x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [push_all_reduce(x, ranks, pdl=i > 0) for i, x in enumerate(xs)]
    for replay in range(3):
        for x in xs:
            x.copy_(torch.randn(x.numel(), device=dev).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(o, x) for o, x in zip(outs, xs)), replay
    assert (buf == SENTINEL[torch.int16]).all()
