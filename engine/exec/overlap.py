"""Overlapped decode: launch step N+1's forward before step N's tokens reach the host.

Between two decode steps the host reads the sampled tokens, updates the requests, detokenizes,
schedules, stages the inputs and launches the next forward. At batch 1 on an H100 that left
the GPU idle ~0.3 ms of every ~6 ms step. So when a decode-only step has sampled on the
device, the runner launches the next forward at once, before it reads the tokens:

    step N:   forward N -> logits -> sample (device ids [B]) -> launch forward N+1 -> .tolist()
    step N+1: scheduler's batch == the launched one? use forward N+1 : discard it, run normally

The launched batch is the same requests in the same order, each at position + 1, its input
token copied on the device from the sampler's output. The next step uses it only if the
scheduler's batch matches it exactly: positions, slots, context lengths, block tables, and
input tokens equal to the sampled ones (compared on the host once they are known).

Discarding is safe: the forward wrote K/V only at each request's next position, in a block the
request already owned, beyond its computed length. That slot is either written again with the
same values (the request goes on), or left behind a freed block whose next owner writes before
it reads (stream order puts every later write after this one). Prefix caching shares only
full computed blocks, so no other request reads that slot.

With MTP speculation the runner launches ahead only from plain decode steps that draft nothing
(k = 0): drafts would make the next step a verify, which a launched decode forward cannot serve.
When the MTP KV is kept current, that step's catch-up is queued first, from the same device ids
(engine/spec/draft_graphs.py catch_up_from_device), since it reads the hidden rows that the launched
replay overwrites; if it cannot run there, nothing is launched.

Launching costs a wasted forward when the batch changes (a request ends on EOS or a stop
string, a new one arrives), so it is skipped when the runner can see a change coming: a
request at its max_tokens or context limit, a request missing the block for its next
position, or (the engine's hint) requests waiting to join.

MTP verify steps use the same mechanism (engine/exec/runner.py _ahead_verify): after a uniform
greedy verify, the next verify forward [last emitted token, k drafts] is launched from the
drafts still on the device, through the verify graphs, and taken or discarded the same way.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.core.scheduler_output import ScheduledRequest
from pdserve.engine.exec.cuda_graphs import DecodeGraphs
from pdserve.engine.model.attention import HostBatch
from pdserve.engine.model.decoder import Model


@dataclass
class _Launched:
    batch: HostBatch  # the inputs of the forward already launched (input ids unknown: -1)
    hidden: torch.Tensor  # [B, H] after the final norm
    prenorm: torch.Tensor  # [B, H]
    expected: list[int] | None = None  # the sampled input tokens, once the host has them


class DecodeAhead:
    """Launches the next decode forward early and hands it to the next step if it matches."""

    def __init__(self, model: Model, kv_cache: torch.Tensor, graphs: DecodeGraphs | None,
                 block_size: int, max_model_len: int) -> None:
        self.model, self.kv_cache, self.graphs = model, kv_cache, graphs
        self.block_size, self.max_model_len = block_size, max_model_len
        self._launched: _Launched | None = None
        self.hits = 0  # steps served by a forward launched ahead
        self.discards = 0  # launched forwards the next step could not use

    def next_batch(self, scheduled: list[ScheduledRequest]) -> HostBatch | None:
        """The decode batch that follows this decode-only step if every request goes on, or
        None when one may not (limits reached, no block for its next position)."""
        bs = self.block_size
        pos, slots, seq_lens, tables = [], [], [], []
        for s in scheduled:
            req, p = s.request, s.start_pos + 1
            params = req.sampling_params
            if (len(req.output_token_ids) + 1 >= params.max_tokens or p + 1 >= self.max_model_len
                    or p // bs >= len(req.block_table) or req.hold_blocks_on_finish):
                return None
            pos.append(p)
            slots.append(req.block_table[p // bs] * bs + p % bs)
            seq_lens.append(p + 1)
            tables.append(req.block_table[: p // bs + 1])
        B = len(scheduled)
        return HostBatch([-1] * B, pos, slots, [1] * B, seq_lens, tables, bs)

    def launch(self, batch: HostBatch, input_ids: torch.Tensor,
               graphs: DecodeGraphs | None = None) -> bool:
        """Run the forward of `batch` with input ids taken from the device (sampled or
        drafted, not yet read): all of them [T], or the last c of each sequence's tokens
        [B, c] with the others from batch.input_ids (DecodeGraphs.run_host), through `graphs`
        (default: the decode graphs; an MTP verify batch passes its VerifyGraphs). Returns
        False when no graph fits (nothing launched)."""
        self._launched = None
        graphs = graphs if graphs is not None else self.graphs
        if graphs is not None:
            out = graphs.run_host(batch, input_ids=input_ids)
            if out is None:
                return False
            hidden, prenorm = out
        else:  # eager (CPU tests): the same logic, without the overlap
            host_ids, positions, meta = batch.to_device(self.kv_cache.device)
            if input_ids.dim() == 2:  # the last c ids of each row from the device
                rows = host_ids.view(input_ids.shape[0], -1)
                rows[:, rows.shape[1] - input_ids.shape[1]:] = input_ids
                input_ids = rows.reshape(-1)
            hidden, prenorm = self.model(input_ids, positions, meta, self.kv_cache,
                                         return_prenorm=True)
        self._launched = _Launched(batch, hidden, prenorm)
        return True

    @property
    def in_flight(self) -> bool:
        """A forward launched ahead that no step has taken or dropped yet."""
        return self._launched is not None

    def confirm(self, token_ids: list[int] | None) -> None:
        """The launched forward's input tokens, now read on the host (None: they are not
        what the next step will bring; the launch will be discarded)."""
        if self._launched is not None:
            self._launched.expected = token_ids

    def take(self, batch: HostBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden, prenorm) of the launched forward if `batch` is exactly what it computed;
        None otherwise (the launched work is dropped)."""
        launched, self._launched = self._launched, None
        if launched is None:
            return None
        got = launched.batch
        if (launched.expected == batch.input_ids and got.positions == batch.positions
                and got.slots == batch.slots and got.seq_lens == batch.seq_lens
                and got.query_lens == batch.query_lens and got.block_tables == batch.block_tables):
            self.hits += 1
            return launched.hidden, launched.prenorm
        self.discards += 1
        return None

    def drop(self) -> None:
        """Forget a launched forward (the next step is not a plain decode)."""
        if self._launched is not None:
            self._launched = None
            self.discards += 1
