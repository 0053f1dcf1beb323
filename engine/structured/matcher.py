"""Per-request grammar state, and the token bitmask applied to the logits on the device.

GrammarState wraps one xgrammar GrammarMatcher. It lives in the request's SamplerState
(engine/exec/sampler.py), next to the penalty counts, and moves only by accepted tokens
(SamplerState.observe): never by drafts or rejected samples. Anywhere a request resumes --
the decode worker after the prefill worker's first token, a stream continued on another decode
worker, a preempted request -- the state is rebuilt by replaying the output tokens it already
has (`replay`), so nothing but the spec crosses the wire.

The bitmask is xgrammar's: int32 [rows, W], W = ceil(V / 32), bit b of word w set = token
32 w + b allowed. A decode step's is made by `BitmaskFiller` on the host, while the GPU runs
the step's forward (the sampler fills after the forward is launched). Each row costs two
xgrammar calls: accepting the row's last token (deferred from observe(), below) and the fill
(~8 us median, ~0.3 ms at p90 on an H200's host, far more inside a length-bounded string).
The fills run on xgrammar's C++ threads (BatchGrammarMatcher; Python threads do not help:
the calls hold the GIL), into a reused pinned buffer whose copy to the device is queued, not
waited for; `apply_bitmask` then sets every forbidden logit to -inf in one kernel
(xgrammar's). bench/lab/bench_structured.py measures each part.

Deferred accept: GrammarState.accept only queues the token; the filler's threads (or any read
of the state: fill, fill_drafts, replay, and `terminated` when a stop token is queued -- the
only token that can end a grammar) accept it first. A token the grammar refuses (a bug: every
token is drawn under the mask) raises there.
"""
from __future__ import annotations

import os
import time
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

    A bitmask on the host is staged through pinned memory (a queued copy: the host does not
    wait for the forward); on the logits' device already (BitmaskFiller) it is used as is. The
    mask itself is one kernel over a copy of the logits (xgrammar's: Triton on CUDA)."""
    if bitmask.device != logits.device:
        staged = bitmask.pin_memory() if logits.device.type == "cuda" else bitmask
        bitmask = staged.to(logits.device, non_blocking=True)
    out = logits.clone()
    xgrammar().apply_token_bitmask_inplace(out, bitmask, vocab_size=logits.shape[-1])
    return out


def batch_bitmask(grammars: Sequence[GrammarState | None], vocab_size: int) -> torch.Tensor | None:
    """The next token's bitmask for each row (all allowed where the row has no grammar), or
    None when no row has one: one row after another on the calling thread. Reference for
    BitmaskFiller (tests), and what the MTP verify path's rows are built like."""
    if all(g is None for g in grammars):
        return None
    bitmask = host_bitmask(len(grammars), vocab_size)
    for row, g in enumerate(grammars):
        if g is not None:
            g.fill(bitmask, row)
    return bitmask


def fill_threads() -> int:
    """Threads for the batch fill: half the CPUs this process may run on, at most 8 (the
    engine loop and the host's other workers keep the rest)."""
    return max(1, min(8, len(os.sched_getaffinity(0)) // 2))


class BitmaskFiller:
    """A decode step's bitmask [B, W] on the logits' device: each grammar row accepts its
    queued tokens, then xgrammar's batch fill fills every row on `threads` C++ threads, into
    a reused pinned host buffer, copied with a queued (non-blocking) copy into a reused device
    buffer: the host never waits for the GPU here.

    Reuse is safe: before the host buffer is written again, the event recorded after the last
    copy is waited for (by then long done: the host has read that step's sampled ids, which
    the GPU made after the copy); the device buffer's next copy is queued on the same stream
    behind the kernels that read it."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads if threads is not None else fill_threads()
        self._batch: xgr.BatchGrammarMatcher | None = None  # made on the first grammar
        self._host: torch.Tensor | None = None  # int32 [rows, W], pinned on CUDA
        self._dev: torch.Tensor | None = None  # int32 [rows, W] on the device
        self._copied: torch.cuda.Event | None = None
        self.fills, self.rows, self.seconds = 0, 0, 0.0  # host time in fill() (benchmarks)

    def fill(self, grammars: Sequence[GrammarState | None], vocab_size: int,
             device: torch.device) -> torch.Tensor | None:
        """The bitmask of every row (all allowed without a grammar) on `device`, or None when
        no row has a grammar (requests without one pay nothing). On CUDA the result is this
        filler's buffer: valid until the next fill."""
        if all(g is None for g in grammars):
            return None
        t0 = time.perf_counter()
        rows, cuda = len(grammars), device.type == "cuda"
        host = self._host_rows(rows, bitmask_width(vocab_size), cuda)
        live = []
        for i, g in enumerate(grammars):
            if g is None:
                host[i] = -1
                continue
            g.flush()  # the queued accepts (RuntimeError for a refused token)
            if g.terminated:
                g.fill(host, i)  # stop tokens only
            else:
                live.append(i)
        if len(live) == 1:  # a thread hand-off costs more than one row (~0.35 ms, H200 host)
            grammars[live[0]].matcher.fill_next_token_bitmask(host, live[0])
        elif live:  # xgrammar's C++ threads: Python threads would hold the GIL
            if self._batch is None:
                self._batch = xgrammar().BatchGrammarMatcher(self.threads)
            self._batch.batch_fill_next_token_bitmask([grammars[i].matcher for i in live],
                                                      host, live)
        out = self._to_device(host, device) if cuda else host.clone().to(device)
        self.fills, self.rows = self.fills + 1, self.rows + rows
        self.seconds += time.perf_counter() - t0
        return out

    def _host_rows(self, rows: int, width: int, pinned: bool) -> torch.Tensor:
        if self._copied is not None:
            self._copied.synchronize()  # the last copy read this buffer
        buf = self._host
        if buf is None or buf.shape[0] < rows or buf.shape[1] != width or buf.is_pinned() != pinned:
            buf = torch.empty((max(rows, 8), width), dtype=torch.int32, pin_memory=pinned)
            self._host = buf
        return buf[:rows]

    def _to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        dev = self._dev
        if dev is None or dev.device != device or dev.shape[0] < host.shape[0] \
                or dev.shape[1] != host.shape[1]:
            dev = torch.empty(self._host.shape, dtype=torch.int32, device=device)
            self._dev = dev
            self._copied = torch.cuda.Event()
        out = dev[:host.shape[0]]
        out.copy_(host, non_blocking=True)
        self._copied.record()
        return out


class GrammarState:
    def __init__(self, compiled: xgr.CompiledGrammar, stop_ids: Sequence[int]) -> None:
        self.matcher = xgrammar().GrammarMatcher(compiled)
        self.stop_ids = tuple(stop_ids)
        self._pending: list[int] = []  # accepted by the engine, not yet by the matcher

    def replay(self, tokens: Sequence[int], param: str) -> None:
        """Advance over tokens the request already has; InvalidRequestError naming `param`
        when one of them does not match (or the grammar had already ended)."""
        self.flush()
        for i, token in enumerate(tokens):
            if not self.matcher.accept_token(token):
                raise InvalidRequestError(param, f"token {token} at output position {i} does "
                                                 "not match the request's grammar")
        if self.terminated:
            raise InvalidRequestError(param, "the request's grammar already ended")

    def accept(self, token: int) -> None:
        """Queue the next output token; the matcher takes it at the next flush (module
        docstring: off the engine thread, on the filler's)."""
        self._pending.append(token)

    def flush(self) -> None:
        """Advance the matcher over the queued tokens; RuntimeError for one it refuses."""
        pending, self._pending = self._pending, []
        for token in pending:
            if not self.matcher.accept_token(token):
                # every token is drawn under the mask: a bug, never the client's input
                raise RuntimeError(f"token_id: {token} does not match the request's grammar")

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token: the request must end ("stop"). Only a stop
        token can end it (xgrammar's matcher, terminate_without_stop_token off), so queued
        tokens are accepted here only when one of them is a stop token."""
        if any(t in self.stop_ids for t in self._pending):
            self.flush()
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """bitmask[row] = the tokens allowed next. A terminated matcher (the engine finishes
        its request first; defensive) allows the stop tokens only."""
        self.flush()
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
        self.flush()
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
