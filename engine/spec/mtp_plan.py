"""One MTP drafting pass as plain data, run the same way by every rank of a tensor-parallel
engine (and by the one rank without TP).

SpecDecoder.propose (engine/spec/spec_decoder.py) turns its DraftJobs into an MTPPlan; with TP,
rank 0 announces the plan to the followers (engine/dist/protocol.py Kind.MTP) before running
it, and each follower runs the same plan over its shard (engine/dist/lockstep.py Follower), so
the MTP layer's collectives (the embedding's and the decoder block's all-reduces, the LM
head's all-gather or cross-rank argmax) meet in the same order on every rank:

    catch-up  the MTP layer over all jobs' rows: (token t+1, target hidden at t) at t
    chain     per step, the drafts of the jobs still drafting from their last output, then
              the MTP layer at the next position for those that want more

Drafts of a chain step: greedy jobs only -> the cross-rank argmax (Model.greedy: every rank
gets the ids); otherwise every rank joins the logits' all-gather and rank 0 draws (its
sampler state, its generators), then shares the ids (parallel.from_rank0).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.dist import parallel
from pdserve.engine.model.attention import make_metadata
from pdserve.engine.model.decoder import Model

# (drafting job indices, their draft ids [n] on the device), per chain step
ChainSteps = list[tuple[list[int], torch.Tensor]]
# rank 0's draw: (draft logits [n, V], indices of the jobs drafting) -> ids [n]
Draw = Callable[[torch.Tensor, list[int]], torch.Tensor]


@dataclass(frozen=True)
class MTPPlan:
    """Jobs j = 0..J-1: catch-up rows at positions starts[j] .. starts[j] + lens[j] - 1 whose
    next tokens are ids (concatenated, [T = sum(lens)]) and whose target hidden states are
    `rows` [T] of the hidden tensor; then ks[j] drafts (0: only the MTP KV is written)."""

    ids: list[int]
    rows: list[int]
    starts: list[int]
    lens: list[int]
    tables: list[list[int]]  # each job's block table (the same blocks on every rank)
    ks: list[int]
    greedy: list[bool]  # job j drafts by argmax (else rank 0 samples its drafts)
    block_size: int

    def positions(self) -> list[int]:
        return [p for s, m in zip(self.starts, self.lens) for p in range(s, s + m)]

    def catch_up(self, head: torch.nn.Module, model: Model, hidden: torch.Tensor,
                 kv_cache: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] (the plan's rows) -> the MTP layer's normed output [T, H]."""
        dev = kv_cache.device
        meta = make_metadata(self.lens, [s + m for s, m in zip(self.starts, self.lens)],
                             self.tables, self.block_size, dev)
        return head(model, torch.tensor(self.ids, device=dev), hidden,
                    torch.tensor(self.positions(), device=dev), meta, kv_cache, step=0)

    def chain_step(self, head: torch.nn.Module, model: Model, kv_cache: torch.Tensor,
                   active: list[int], g: torch.Tensor, ids: torch.Tensor, step: int
                   ) -> torch.Tensor:
        """One token per active job: (its last draft ids [n], g [n, H]) at position
        last + step -> g [n, H]."""
        pos = [self.starts[a] + self.lens[a] - 1 + step for a in active]
        meta = make_metadata([1] * len(active), [p + 1 for p in pos],
                             [self.tables[a] for a in active], self.block_size, kv_cache.device)
        return head(model, ids, g, torch.tensor(pos, device=kv_cache.device), meta, kv_cache,
                    step=step)

    def run(self, head: torch.nn.Module, model: Model, kv_cache: torch.Tensor,
            hidden: torch.Tensor, draft: Callable[[torch.Tensor, list[int]], torch.Tensor]
            ) -> ChainSteps:
        """Catch-up over hidden [T, H], then the chain; draft(g [n, H], active jobs) -> ids
        [n] makes one step's drafts. Returns each step's (active jobs, ids)."""
        g = self.catch_up(head, model, hidden, kv_cache)
        want = [j for j, k in enumerate(self.ks) if k > 0]
        if not want:
            return []
        ends = torch.tensor(self.lens).cumsum(0) - 1
        g = g[ends[want].to(g.device)]
        active, steps, step = want, [], 0
        while True:
            tokens = draft(g, active)
            steps.append((active, tokens))
            step += 1
            keep = [i for i, a in enumerate(active) if self.ks[a] > step]
            if not keep:
                return steps
            active = [active[i] for i in keep]
            g = self.chain_step(head, model, kv_cache, active, g[keep], tokens[keep], step)


def tp_draft(head: torch.nn.Module, model: Model, g: torch.Tensor, greedy: bool,
             draw: Draw | None, active: list[int]) -> torch.Tensor:
    """One chain step's drafts [n] on every rank of a tensor-parallel model: the cross-rank
    argmax when every drafting job is greedy; else the logits' all-gather, rank 0's draw
    (`draw`; None on a follower) and its ids shared with every rank."""
    if greedy:
        return head.draft_greedy(model, g)
    logits = head.draft_logits(model, g)  # [n, V] on every rank (all-gathered)
    if draw is not None:
        tokens = draw(logits, active)
    else:
        tokens = torch.zeros(g.shape[0], dtype=torch.int64, device=g.device)
    return parallel.ids_from_rank0(tokens, model.tp) if model.tp is not None else tokens


def follow_plan(plan: MTPPlan, head: torch.nn.Module, model: Model, kv_cache: torch.Tensor,
                hidden: torch.Tensor) -> ChainSteps:
    """A follower's run of rank 0's plan (its drafts come from the same collectives)."""
    def draft(g: torch.Tensor, active: list[int]) -> torch.Tensor:
        return tp_draft(head, model, g, all(plan.greedy[a] for a in active), None, active)
    return plan.run(head, model, kv_cache, hidden, draft)
