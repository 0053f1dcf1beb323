"""Kernel tests run compiled on CUDA when present, else in Triton's CPU interpreter.

The interpreter must be chosen before triton is first imported; tests/conftest.py does that
(kernels/triton_mode.py) when no GPU is visible. If something imported triton earlier in this
process without TRITON_INTERPRET=1, the kernel tests are skipped with that reason -- run them
with TRITON_INTERPRET=1 in the environment (CI does: `TRITON_INTERPRET=1 pytest tests/kernels`).
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable

import pytest
import torch

_HAS_TRITON = importlib.util.find_spec("triton") is not None
if _HAS_TRITON:  # tests/conftest.py chose compiled or interpreted mode before this import
    from pdserve.kernels._triton import interpreter_problem

# (rtol, atol) against the fp32 references; low precision pays for its rounding of inputs/P.
TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.float16: (5e-3, 5e-3),
             torch.bfloat16: (2e-2, 2e-2)}


@pytest.fixture(autouse=True)
def _kernels_runnable() -> None:
    if not _HAS_TRITON:
        pytest.skip("triton is not installed (pip install pdserve[triton])")
    problem = interpreter_problem()
    if problem is not None:
        pytest.skip(problem)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)


@pytest.fixture
def close() -> Callable[[torch.Tensor, torch.Tensor, torch.dtype], None]:
    """close(actual, expected, dtype): assert_close with the dtype's tolerance."""
    return assert_close


class PagedCache:
    """A whole multi-layer KV cache with randomly scattered blocks (permuted block tables).

    Every slot holds random data, including slots past each sequence's end, so a kernel that
    reads beyond seq_len or through a wrong block id produces a visible error.
    """

    def __init__(self, seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, num_layers: int = 3,
                 layer: int = 1, spare_blocks: int = 5, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        need = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(need) + spare_blocks
        shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
        self.kv = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
        self.k = self.kv[:, layer, 0]  # [NB, BS, Hkv, D] views with a big block stride
        self.v = self.kv[:, layer, 1]
        order = torch.randperm(num_blocks, generator=gen).tolist()
        width = max(need, default=0) + 2  # padded, as the engine pads tables
        rows, used = [], 0
        for n in need:
            blocks = order[used:used + n]
            used += n
            rows.append(blocks + [0] * (width - n))
        self.block_tables = torch.tensor(rows, dtype=torch.int32, device=device)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        self.block_size = block_size


@pytest.fixture
def paged_cache(device: torch.device) -> Callable[..., PagedCache]:
    def build(seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
              dtype: torch.dtype, **kw: object) -> PagedCache:
        return PagedCache(seq_lens, block_size, num_kv_heads, head_dim, dtype, device, **kw)
    return build
