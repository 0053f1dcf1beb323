"""A minimal greedy driver for a lockstep TP model without the scheduler: smoke checks of a
rank group (worker/tp_group.py) and the TP tests; serving goes through the engine's runner.

Sequence i keeps its KV in blocks [i * blocks_per_seq, (i + 1) * blocks_per_seq).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.engine.model.attention import HostBatch


def host_batch(seqs: list[list[int]], starts: list[int], block_size: int,
               blocks_per_seq: int) -> HostBatch:
    """The new tokens seqs[i] of sequence i at positions starts[i].. as one flat batch."""
    ids, pos, slots, qlens, slens, tables = [], [], [], [], [], []
    for i, (toks, start) in enumerate(zip(seqs, starts)):
        table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        end = start + len(toks)
        if -(-end // block_size) > blocks_per_seq:
            raise ValueError(f"new_tokens: sequence {i} needs more than {blocks_per_seq} blocks")
        ids += toks
        pos += range(start, end)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        qlens.append(len(toks))
        slens.append(end)
        tables.append(table[: -(-end // block_size)])
    return HostBatch(ids, pos, slots, qlens, slens, tables, block_size)


def greedy_batch(step: Callable[[HostBatch, list[int]], torch.Tensor], prompts: list[list[int]],
                 new_tokens: int, block_size: int, blocks_per_seq: int) -> list[list[int]]:
    """Greedy decoding of all prompts as one batch; step(batch, logits_rows) -> logits
    [len(logits_rows), V] (the last row of each sequence)."""
    out: list[list[int]] = [[] for _ in prompts]
    seqs, starts = [list(p) for p in prompts], [0] * len(prompts)
    for _ in range(new_tokens):
        b = host_batch(seqs, starts, block_size, blocks_per_seq)
        ends, at = [], 0
        for q in b.query_lens:
            at += q
            ends.append(at - 1)
        toks = step(b, ends).argmax(dim=-1).tolist()
        for i, t in enumerate(toks):
            out[i].append(t)
            starts[i] += len(seqs[i])
            seqs[i] = [t]
    return out
