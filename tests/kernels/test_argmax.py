"""kernels.argmax against kernels.reference.argmax_ref (torch.argmax): first index of the
maximum, chunked rows."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels.argmax import argmax
from pdserve.kernels.reference import argmax_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,V,chunks", [(1, 1, 1), (3, 1000, 1), (2, 5003, 4), (5, 2049, 2),
                                        (1, 151936, 8), (7, 3, 2)])
def test_matches_torch_argmax(dtype, B, V, chunks, device):
    """Odd vocabularies, chunks of different sizes (the last ragged; with V = 3 and 2 chunks
    the second chunk is empty), strided rows."""
    gen = torch.Generator().manual_seed(B * 131 + V)
    x = torch.randn(B, V + 5, generator=gen)[:, :V].to(device, dtype)
    got = argmax(x, chunks=chunks)
    assert got.dtype == torch.int64 and got.shape == (B,)
    assert torch.equal(got, argmax_ref(x))


@pytest.mark.parametrize("chunks", [1, 4])
def test_ties_pick_the_first_index_across_chunks(chunks, device):
    """Equal maxima in several chunks and within one: the first wins, as in torch; rows of
    -inf give 0; a row whose only maximum is the last entry."""
    V = 4 * 1024 + 17
    x = torch.zeros(4, V)
    x[0, [3000, 50, 4100]] = 7.0  # first max at 50 (chunk 0), later equal ones ignored
    x[1, [2048, 2049, 887]] = 2.0  # 887: the first, in chunk 0
    x[2] = float("-inf")
    x[3, V - 1] = 1.0
    x = x.to(device, torch.bfloat16)
    got = argmax(x, chunks=chunks)
    assert got.tolist() == argmax_ref(x).tolist() == [50, 887, 0, V - 1]


def test_repeated_launches_reuse_the_counters(device):
    """The last program of each row resets its arrival counter: launches of different
    shapes back to back all agree with torch."""
    for B, V in ((2, 3000), (1, 7000), (2, 3000), (6, 1500)):
        x = torch.randn(B, V, device=device)
        assert torch.equal(argmax(x, chunks=2), argmax_ref(x))


def test_bad_arguments_name_the_field(device):
    with pytest.raises(ValueError, match="logits: expected 2 dims"):
        argmax(torch.randn(3, device=device))
    with pytest.raises(TypeError, match="logits: dtype"):
        argmax(torch.zeros(2, 3, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="chunks: must be a power of 2"):
        argmax(torch.randn(2, 30, device=device), chunks=3)
    with pytest.raises(ValueError, match="logits: vocabulary of 0"):
        argmax(torch.randn(2, 0, device=device))
    with pytest.raises(ValueError, match="logits: last dim must be contiguous"):
        argmax(torch.randn(30, 2, device=device).t())
