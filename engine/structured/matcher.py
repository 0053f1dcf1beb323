"""Per-request grammar state, and the token bitmask applied to the logits on the device.

GrammarState wraps one xgrammar GrammarMatcher. It lives in the request's SamplerState
(engine/exec/sampler.py), next to the penalty counts, and moves only by accepted tokens
(SamplerState.observe): never by drafts or rejected samples. Anywhere a request resumes --
the decode worker after the prefill worker's first token, a stream continued on another decode
worker, a preempted request -- the state is rebuilt by replaying the output tokens it already
has (`replay`), so nothing but the spec crosses the wire.

The bitmask is xgrammar's: int32 [rows, W], W = ceil(V / 32), bit b of word w set = token
32 w + b allowed. The matcher fills it on the host (microseconds per row); `apply_bitmask`
copies it to the logits' device and expands it there into -inf for every forbidden token.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pdserve.engine.core.sampling_params import InvalidRequestError
from pdserve.engine.structured.compiler import xgrammar

if TYPE_CHECKING:
    import xgrammar as xgr


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def host_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """int32 [rows, W] on the host, every token allowed (rows without a grammar stay so)."""
    return torch.full((rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (any float dtype) with every token bitmask [B, W] forbids at -inf; out
    of place (the caller's logits also feed the raw logprobs).

    Fixed shapes, no host read: with a static device buffer for the bitmask this is what a
    CUDA graph would capture (today the sampler runs eagerly after the graphed forward)."""
    mask = bitmask.to(logits.device, non_blocking=True)  # [B, W]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((mask[:, :, None] >> shifts) & 1).bool()  # [B, W, 32]
    allowed = allowed.reshape(mask.shape[0], -1)[:, :logits.shape[-1]]  # [B, V]
    return logits.masked_fill(~allowed, float("-inf"))


def batch_bitmask(grammars: Sequence[GrammarState | None], vocab_size: int) -> torch.Tensor | None:
    """The next token's bitmask for each row (all allowed where the row has no grammar), or
    None when no row has one: requests without a grammar pay nothing."""
    if all(g is None for g in grammars):
        return None
    bitmask = host_bitmask(len(grammars), vocab_size)
    for row, g in enumerate(grammars):
        if g is not None:
            g.fill(bitmask, row)
    return bitmask


class GrammarState:
    def __init__(self, compiled: xgr.CompiledGrammar, stop_ids: Sequence[int]) -> None:
        self.matcher = xgrammar().GrammarMatcher(compiled)
        self.stop_ids = tuple(stop_ids)

    def replay(self, tokens: Sequence[int], param: str) -> None:
        """Advance over tokens the request already has; InvalidRequestError naming `param`
        when one of them does not match (or the grammar had already ended)."""
        for i, token in enumerate(tokens):
            if not self.matcher.accept_token(token):
                raise InvalidRequestError(param, f"token {token} at output position {i} does "
                                                 "not match the request's grammar")
        if self.terminated:
            raise InvalidRequestError(param, "the request's grammar already ended")

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token: the request must end ("stop")."""
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """bitmask[row] = the tokens allowed next. A terminated matcher (the engine finishes
        its request first; defensive) allows the stop tokens only."""
        if not self.terminated:
            self.matcher.fill_next_token_bitmask(bitmask, row)
            return
        bitmask[row] = 0
        for t in self.stop_ids:
            word = int(bitmask[row, t // 32]) | (1 << (t % 32))
            bitmask[row, t // 32] = word - (1 << 32) if word >= 1 << 31 else word

    def fill_drafts(self, bitmask: torch.Tensor, row: int, drafts: Sequence[int]
                    ) -> tuple[int, bool]:
        """Masks of a verify step's k + 1 rows (row + j: the state after drafts[:j]) while the
        drafts match; the matcher is back where it was afterwards. Returns (n, ends): the
        leading drafts the grammar accepts, and whether the n-th of them ends it (a stop
        token: nothing may follow). Rows past them stay as they were: greedy verification
        cannot accept a forbidden draft (it is not its row's masked argmax), nor can rejection
        sampling (its target probability is 0), so what follows them is never emitted."""
        n = 0
        try:
            for j in range(len(drafts) + 1):
                self.fill(bitmask, row + j)
                if j == len(drafts) or not self.matcher.accept_token(drafts[j]):
                    break
                n += 1
                if self.terminated:
                    break
            return n, self.terminated
        finally:
            if n:
                self.matcher.rollback(n)
