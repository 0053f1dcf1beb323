"""KVLayout from the engine's cache tensor, and run coalescing over (local, remote) pairs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.kv_transfer.layout import (
    KVLayout,
    Run,
    block_descriptors,
    coalesce,
    coalesce_pairs,
    run_descriptors,
)


def test_layout_from_cache_block_bytes_match_one_contiguous_block():
    kv = torch.zeros(64, 3, 2, 4, 2, 8, dtype=torch.bfloat16)
    layout = KVLayout.from_cache(kv)
    assert (layout.num_blocks, layout.num_kv_layers, layout.block_size) == (64, 3, 4)
    assert layout.dtype == "bfloat16" and layout.element_size == 2
    assert layout.block_bytes == kv[0].numel() * kv.element_size()
    # block b really starts at base + b * block_bytes
    assert kv[5].data_ptr() - kv.data_ptr() == 5 * layout.block_bytes
    assert KVLayout.from_dict(layout.to_dict()) == layout


@pytest.mark.parametrize("tensor, field", [
    (torch.zeros(4, 3, 2, 4, 2), "6 dims"),
    (torch.zeros(4, 3, 3, 4, 2, 8), "dim 2"),
    (torch.zeros(3, 4, 2, 4, 2, 8).transpose(0, 1), "contiguous"),
])
def test_layout_refuses_bad_tensors(tensor, field):
    with pytest.raises(ValueError, match=field):
        KVLayout.from_cache(tensor)


def test_layout_mismatch_ignores_num_blocks_and_names_fields():
    a = KVLayout.from_cache(torch.zeros(64, 3, 2, 4, 2, 8))
    b = KVLayout.from_cache(torch.zeros(10, 3, 2, 8, 2, 8))
    assert a.mismatch(KVLayout.from_cache(torch.zeros(10, 3, 2, 4, 2, 8))) == []
    assert a.mismatch(b) == ["layout.block_size: 4 != 8"]


def test_layout_from_dict_names_missing_field():
    d = KVLayout.from_cache(torch.zeros(4, 1, 2, 1, 1, 1)).to_dict()
    del d["head_dim"]
    with pytest.raises(ValueError, match="layout.head_dim: missing"):
        KVLayout.from_dict(d)


def test_coalesce_single_list():
    assert coalesce([3, 4, 5, 9, 10, 2]) == [(3, 3), (9, 2), (2, 1)]
    assert coalesce([]) == []
    assert coalesce([7, 6, 5]) == [(7, 1), (6, 1), (5, 1)]  # descending is not a run
    assert coalesce(list(range(10)), max_blocks=4) == [(0, 4), (4, 4), (8, 2)]


def test_coalesce_pairs_needs_both_sides_adjacent():
    local = [0, 1, 2, 10, 11, 20]
    remote = [5, 6, 9, 10, 11, 12]
    # (0,5)(1,6) run; (2,9) breaks remote; (10,10)(11,11) run; (20,12) breaks local
    assert coalesce_pairs(local, remote) == [Run(0, 5, 2), Run(2, 9, 1), Run(10, 10, 2),
                                              Run(20, 12, 1)]
    pairs = [(r.local_start + i, r.remote_start + i)
             for r in coalesce_pairs(local, remote) for i in range(r.count)]
    assert pairs == list(zip(local, remote))  # order and pairing survive


def test_coalesce_pairs_errors():
    with pytest.raises(ValueError, match="local_block_ids"):
        coalesce_pairs([1, 2], [1])
    with pytest.raises(ValueError, match="max_blocks"):
        coalesce_pairs([1], [1], max_blocks=0)


def test_descriptors_addresses_and_lengths():
    d = run_descriptors(1000, 64, [0, 5], [2, 1], device_id=3)
    assert d.dtype == np.uint64
    assert d.tolist() == [[1000, 128, 3], [1320, 64, 3]]
    layout = KVLayout.from_cache(torch.zeros(4, 1, 2, 1, 1, 2))
    assert block_descriptors(0, layout, 0)[:, 0].tolist() == [0, 16, 32, 48]


def test_heads_outer_layout_puts_each_head_of_a_block_in_one_range():
    kv = torch.zeros(6, 3, 4, 2, 4, 8, dtype=torch.float16)  # [NB, Hkv, L, 2, BS, D]
    layout = KVLayout.from_cache(kv, heads_outer=True)
    assert (layout.num_kv_heads, layout.num_kv_layers, layout.block_size) == (3, 4, 4)
    assert layout.heads_outer and layout.head_bytes == kv[0, 0].numel() * 2
    assert layout.block_bytes == 3 * layout.head_bytes
    assert kv[5, 2].data_ptr() - kv.data_ptr() == 5 * layout.block_bytes + 2 * layout.head_bytes
    assert KVLayout.from_dict(layout.to_dict()) == layout
    assert layout.mismatch(KVLayout.from_cache(torch.zeros(6, 4, 2, 4, 3, 8, dtype=torch.float16)))
    with pytest.raises(ValueError, match="dim 3"):
        KVLayout.from_cache(torch.zeros(6, 3, 2, 4, 4, 8), heads_outer=True)
