"""The collectives of a tensor-parallel forward, as functions over a rank's shard.

  * row-parallel layers (o_proj, down_proj, a MoE block): each rank's partial product, then an
    all-reduce. The residual add fused into the GEMV's epilogue (kernels/gemv.py `add`) is
    done by rank 0 only: the sum over ranks restores exactly one residual.
  * vocabulary-parallel embedding: each rank looks up the ids in its rows (others give zero
    rows), and an all-reduce sums them: exact, one rank contributes each row.
  * vocabulary-parallel LM head: each rank's logits over its rows, then either an all-gather
    of the logits (the sampler on rank 0 needs the full row: penalties, grammars, logprobs)
    or, for greedy (drafts, greedy rows), a cross-rank argmax that moves two values per row.
  * rank 0's values to every rank (sampled MTP drafts, a shipped hidden state): an all-reduce
    of them with the other ranks' zeros (from_rank0).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdserve.engine.dist.group import TPGroup
from pdserve.engine.dist.heads import vocab_shard


class VocabRange:
    """This rank's slice of the vocabulary: rows start..start + valid are real tokens; the
    shard has `rows` rows (padding after valid)."""

    def __init__(self, vocab_size: int, tp: int, rank: int) -> None:
        self.vocab_size = vocab_size
        self.start, self.valid, self.rows = vocab_shard(vocab_size, tp, rank)


class TPContext:
    """What a rank's Model needs beside its shard (engine/model/decoder.py Model(tp=...)):
    the group and its vocabulary rows."""

    def __init__(self, group: TPGroup, vocab_size: int) -> None:
        self.group = group
        self.vocab = VocabRange(vocab_size, group.size, group.rank)

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def size(self) -> int:
        return self.group.size


def row_parallel(partial: Callable[[torch.Tensor | None], torch.Tensor],
                 add: torch.Tensor | None, group: TPGroup) -> torch.Tensor:
    """all_reduce(partial(add on rank 0, None elsewhere)): partial(add) is this rank's
    x_r @ W_r.T (+ add, fused in its epilogue), [T, N]."""
    return group.all_reduce(partial(add if group.rank == 0 else None))


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, group: TPGroup,
                        add: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K/tp] @ weight [N, K/tp].T summed over ranks (+ add once) -> [T, N]."""
    def partial(a: torch.Tensor | None) -> torch.Tensor:
        y = F.linear(x, weight)
        return y if a is None else y + a
    return row_parallel(partial, add, group)


def embed(ids: torch.Tensor, weight: torch.Tensor, vocab: VocabRange,
          group: TPGroup) -> torch.Tensor:
    """ids [T] (global token ids) -> [T, H] from the rank's rows weight [rows, H]."""
    local = ids - vocab.start
    mine = (local >= 0) & (local < vocab.valid)
    x = F.embedding(torch.where(mine, local, torch.zeros_like(local)), weight)
    x = x * mine.unsqueeze(-1).to(x.dtype)  # [T, H]: other ranks' tokens are zero rows
    return group.all_reduce(x)


def gather_logits(local: torch.Tensor, vocab: VocabRange, group: TPGroup) -> torch.Tensor:
    """[N, rows] per rank -> [N, V] (rank order is vocabulary order; padding cut off)."""
    return group.all_gather(local, dim=-1, eager_peer=True)[:, :vocab.vocab_size]


def argmax(local: torch.Tensor, vocab: VocabRange, group: TPGroup) -> torch.Tensor:
    """Greedy over the whole vocabulary from [N, rows] per rank -> int64 [N] global ids,
    on every rank. Ties go to the lowest id, as torch.argmax over the full row."""
    n = local.shape[0]
    if vocab.valid == 0:  # a rank whose rows are all padding
        best = torch.full((n,), float("-inf"), dtype=torch.float64, device=local.device)
        idx = torch.zeros(n, dtype=torch.int64, device=local.device)
    else:
        val, idx = local[:, :vocab.valid].max(dim=-1)
        best, idx = val.double(), idx + vocab.start
    # [tp, N] values and ids in rank (= vocabulary) order
    vals = group.all_gather(best.unsqueeze(0), dim=0)
    ids = group.all_gather(idx.unsqueeze(0), dim=0)
    winner = vals.argmax(dim=0)  # first rank holding the maximum: the lowest id
    return ids.gather(0, winner.unsqueeze(0)).squeeze(0)


def from_rank0(t: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Rank 0's tensor on every rank (its hidden rows): rank 0 contributes t, the others
    zeros of the same shape and dtype, and an all-reduce sums them (exact: x + 0). Every
    rank passes a tensor of the same shape; the result is a new tensor."""
    out = t.clone() if group.rank == 0 else torch.zeros_like(t)
    return group.all_reduce(out, eager_peer=True)


def ids_from_rank0(ids: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """Rank 0's token ids (int64, each in [0, vocab)) on every rank: from_rank0, through the
    peer kernel as float32 where the group has it (exact: every id is below 2^24 when the
    vocabulary is), a decode step's one collective outside its graph."""
    if tp.group.peer is None or tp.vocab.vocab_size > 1 << 24:
        return from_rank0(ids, tp.group)
    return from_rank0(ids.float(), tp.group).long()
