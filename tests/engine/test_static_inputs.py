"""StaticInputs: one host mirror, one copy; rows past the batch are padding again."""
from __future__ import annotations

import torch

from pdserve.engine.exec.static_inputs import StaticInputs
from pdserve.engine.model.attention import HostBatch


def _batch(seqs: list[tuple[int, list[int]]], q: int, bs: int = 4) -> HostBatch:
    ids, pos, slots, lens, tables = [], [], [], [], []
    for n, table in seqs:  # sequence of n tokens after this step, its last q new
        for p in range(n - q, n):
            ids.append(1000 + p)
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
        lens.append(n)
        tables.append(table)
    return HostBatch(ids, pos, slots, [q] * len(seqs), lens, tables, bs)


def test_stage_writes_the_batch_and_pads_the_rest_of_the_bucket() -> None:
    si = StaticInputs(n_seqs=8, q=1, width=5, seq_pad=0, device=torch.device("cpu"))
    si.stage(_batch([(9, [3, 4, 7]), (2, [5]), (13, [1, 2, 6, 8])], q=1), bucket=4)
    assert si.input_ids[:3].tolist() == [1008, 1001, 1012]
    assert si.positions[:3].tolist() == [8, 1, 12]
    assert si.slot_mapping[:4].tolist() == [7 * 4 + 0, 5 * 4 + 1, 8 * 4 + 0, -1]
    assert si.seq_lens[:4].tolist() == [9, 2, 13, 0]
    assert si.block_tables[0, :3].tolist() == [3, 4, 7]
    assert si.block_tables[2, :4].tolist() == [1, 2, 6, 8]
    # a smaller batch next: the rows it leaves are padding again (no stale slot writes KV)
    si.stage(_batch([(10, [3, 4, 7])], q=1), bucket=2)
    assert si.slot_mapping[:4].tolist() == [7 * 4 + 1, -1, -1, -1]
    assert si.seq_lens[:4].tolist() == [10, 0, 0, 0]
    assert si.block_tables[1].tolist() == [0] * 5


def test_verify_layout_pads_with_q_tokens_per_sequence() -> None:
    si = StaticInputs(n_seqs=4, q=3, width=4, seq_pad=3, device=torch.device("cpu"))
    assert si.seq_lens.tolist() == [3] * 4 and si.slot_mapping.tolist() == [-1] * 12
    si.stage(_batch([(6, [2, 9]), (3, [4])], q=3), bucket=2)
    assert si.positions[:6].tolist() == [3, 4, 5, 0, 1, 2]
    assert si.slot_mapping[:6].tolist() == [2 * 4 + 3, 9 * 4 + 0, 9 * 4 + 1, 16, 17, 18]
    assert si.seq_lens.tolist() == [6, 3, 3, 3]
    si.stage(_batch([(7, [2, 9])], q=3), bucket=1)
    assert si.positions[:3].tolist() == [4, 5, 6]
    # row 1 is past bucket 1 (its graph does not read it) but padding on the host, so the
    # next bigger bucket's copy brings padding, not the old sequence
    si.stage(_batch([(8, [2, 9])], q=3), bucket=2)
    assert si.slot_mapping[3:6].tolist() == [-1, -1, -1]
    assert si.seq_lens[:2].tolist() == [8, 3]
    assert si.block_tables[1].tolist() == [0] * 4


def test_reset_returns_every_row_to_padding() -> None:
    si = StaticInputs(n_seqs=2, q=1, width=3, seq_pad=0, device=torch.device("cpu"))
    si.stage(_batch([(5, [1, 2]), (1, [3])], q=1), bucket=2)
    si.reset()
    assert si.slot_mapping.tolist() == [-1, -1] and si.seq_lens.tolist() == [0, 0]
