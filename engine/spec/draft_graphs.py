"""Static-shape MTP drafting, replayed as CUDA graphs: catch-up + chain in one launch.

Eager drafting costs ~20 kernel launches per MTP step from Python, plus the LM head each time;
at batch 1 that made a k=1 speculative step slower than no speculation at all (bench_mtp on an
H100). Here the whole proposal for a uniform greedy step is one captured function over static
buffers, keyed by (batch bucket, q, k):

    catch-up   the MTP layer over q rows per sequence: every row the target computed this step
               (q = 1 after a plain decode, q = k_prev + 1 after a verify, accepted or not),
               token t+1 and target hidden at t, positions start .. start + q - 1
    select     each sequence's row at its last accepted position (sel), then k times:
    draft      logits -> argmax -> the next chain step's input (positions start + m - 1 + s)
    out        drafts [bucket, k] int64: one host read for the whole proposal

Rows past a sequence's accepted prefix (m = accepted + 1 <= q) see rejected draft tokens: their
outputs are never selected, and the MTP KV they write lies beyond the accepted length, where
the chain and the next catch-up write again before anything reads it (the same rollback
argument as the target's KV in engine/spec/spec_decoder.py). Padding rows write nothing (slot -1).

Only greedy requests draft here (argmax drafts need no draft distribution); k = 0 replays the
catch-up alone (the MTP KV kept current at batch sizes that no longer draft).

After a plain decode step that drafts nothing, catch_up_from_device launches that k = 0 catch-up
from the sampler's device ids, before the host reads them and before overlapped decode launches
the next forward (engine/exec/overlap.py), which overwrites the hidden rows the catch-up reads:

    decode graph N -> logits, sample -> stage + ids copy + catch-up -> decode graph N+1
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.core.config import EngineConfig, SpecConfig
from pdserve.engine.core.request import Request
from pdserve.engine.exec.cuda_graphs import bucket_for, decode_buckets
from pdserve.engine.exec.device_io import HostCopy
from pdserve.engine.model.attention import AttentionMetadata
from pdserve.engine.model.layers import fused_kernels


@dataclass
class DraftRow:
    """One request's share of a static-shape proposal."""

    request: Request
    start: int  # position of the first of its q rows
    next_tokens: list[int]  # m <= q known next tokens (the rest of the q rows are padding)


class DraftGraphs:
    """Buffers and captured graphs of static-shape proposals (see the module docstring).
    With use_graphs=False the same function runs eagerly (CPU tests of the logic)."""

    def __init__(self, model: torch.nn.Module, head: torch.nn.Module, kv_cache: torch.Tensor,
                 block_size: int, max_model_len: int, max_k: int, max_batch: int,
                 use_graphs: bool) -> None:
        self.model, self.head, self.kv_cache = model, head, kv_cache
        self.block_size, self.max_k, self.use_graphs = block_size, max_k, use_graphs
        self.width = -(-max_model_len // block_size)
        self.buckets = decode_buckets(max_batch)
        n, Q, C, dev = self.buckets[-1], max_k + 1, max(max_k - 1, 1), kv_cache.device
        # one flat int64 and one int32 buffer per side
        self._i64 = {"ids": n * Q, "pos": n * Q, "slots": n * Q, "sel": n,
                     "cpos": C * n, "cslots": C * n, "drafts": n * max_k}
        self._i32 = {"seq": n, "cseq": C * n, "tables": n * self.width}
        pin = dev.type == "cuda"
        # both flat buffers live in one byte buffer per side: a step stages in one copy
        n64, n32 = sum(self._i64.values()), sum(self._i32.values())
        self.hraw = torch.zeros(8 * n64 + 4 * n32, dtype=torch.uint8, pin_memory=pin)
        self.draw = self.hraw.to(dev)
        self.h64, self.h32 = _int_views(self.hraw, n64)
        self.d64, self.d32 = _int_views(self.draw, n64)
        # named views of the flat buffers, made once: device tensors for the captured
        # function, numpy arrays of the pinned host side for staging
        self.dv64, self.dv32 = _views(self.d64, self._i64), _views(self.d32, self._i32)
        self.hv32 = _views(self.h32, self._i32)
        self.np64 = {k: t.numpy() for k, t in _views(self.h64, self._i64).items()}
        self.np32 = {k: t.numpy() for k, t in self.hv32.items()}
        self.hid = torch.zeros(n * Q, model.config.hidden_size, device=dev,
                               dtype=model.embed_tokens.weight.dtype)
        self.qsl = {q: torch.arange(n + 1, dtype=torch.int32, device=dev) * q
                    for q in range(1, Q + 1)}
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        # the host buffers' last copy has left them: with catch-ups launched before the host
        # sync (catch_up_from_device), nothing else orders the next stage() after that copy
        self._copied = torch.cuda.Event() if pin else None
        self._accept = accept_ref  # the Triton kernel on the fused path (use_accept_kernel)
        self._host_copy = HostCopy()
        self.replays = 0  # graph replays
        self.served = 0  # proposals made here (graph or eager)
        self.device_catch_ups = 0  # k = 0 catch-ups launched from device ids (of served)

    # -- the captured function ---------------------------------------------------------------
    def _meta(self, B: int, q: int, slots: torch.Tensor, seq: torch.Tensor,
              tables: torch.Tensor, seq_cpu: list[int]) -> AttentionMetadata:
        """seq_cpu: the staged lengths on the host, read only by the torch attention path
        (CPU); the Triton kernels read `seq` on the device, so a graph never bakes them in."""
        return AttentionMetadata(slot_mapping=slots, query_start_loc=self.qsl[q][:B + 1],
                                 seq_lens=seq, block_tables=tables, max_query_len=q,
                                 max_seq_len=self.width * self.block_size,
                                 query_lens_cpu=[q] * B, seq_lens_cpu=seq_cpu,
                                 block_size=self.block_size)

    def forward(self, B: int, q: int, k: int) -> torch.Tensor | None:
        """The proposal over the first B (a bucket) rows of the static buffers: drafts
        [B, k] int64, or None for k = 0 (catch-up only)."""
        v64, v32, host32 = self.dv64, self.dv32, self.hv32
        n = B * q
        tables = v32["tables"].view(-1, self.width)[:B]
        meta = self._meta(B, q, v64["slots"][:n], v32["seq"][:B], tables,
                          host32["seq"][:B].tolist())
        # [B, H] at each last accepted position (k = 0: all n rows, unused)
        g = self.head(self.model, v64["ids"][:n], self.hid[:n], v64["pos"][:n], meta,
                      self.kv_cache, step=0, select=v64["sel"][:B] if k > 0 else None)
        if k == 0:
            return None
        cpos, cslots = v64["cpos"].view(-1, self.buckets[-1]), v64["cslots"].view(-1, self.buckets[-1])
        cseq = v32["cseq"].view(-1, self.buckets[-1])
        drafts = []
        for s in range(k):
            tok = self.head.draft_greedy(self.model, g)  # [B]
            drafts.append(tok)
            if s + 1 < k:
                meta_s = self._meta(B, 1, cslots[s, :B], cseq[s, :B], tables,
                                    host32["cseq"].view(-1, self.buckets[-1])[s, :B].tolist())
                g = self.head(self.model, tok, g, cpos[s, :B], meta_s, self.kv_cache,
                              step=s + 1)
        return drafts[0][:, None] if k == 1 else torch.stack(drafts, dim=1)  # [B, k]

    # -- a step --------------------------------------------------------------------------------
    def fits(self, rows: list[DraftRow], q: int, k: int) -> int | None:
        """The bucket for this proposal, or None when it must run the dynamic path."""
        if not 1 <= q <= self.max_k + 1 or not 0 <= k <= self.max_k:
            return None
        bucket = bucket_for(len(rows), self.buckets)
        if bucket is None:
            return None
        bs = self.block_size
        for r in rows:
            last = r.start + max(q, len(r.next_tokens) + k - 1) - 1  # the last slot written
            if last // bs >= len(r.request.block_table) or -(-(last + 1) // bs) > self.width:
                return None
        return bucket

    def use_accept_kernel(self, kernel: Callable[..., None]) -> None:
        """Run launch_after_verify's acceptance as `kernel` (kernels.spec_accept on the fused
        path) instead of accept_ref's torch ops."""
        self._accept = kernel

    def stage(self, rows: list[DraftRow], hidden: torch.Tensor, B: int, q: int, k: int,
              verified: list[list[int]] | None = None) -> None:
        """Fill the host buffers for rows (bucket B), copy them and the hidden rows over.
        verified: each row's drafts of the verify step before (launch_after_verify), staged
        with the rest, [len(rows), q - 1]."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the buffers
        v64, v32 = self.np64, self.np32
        bs, nmax = self.block_size, self.buckets[-1]
        ids, pos, slots = v64["ids"][:B * q], v64["pos"][:B * q], v64["slots"][:B * q]
        ids[:], pos[:], slots[:] = 0, 0, -1
        v32["seq"][:B] = q if q > 1 else 0  # padding: the prefill kernel needs seq >= q
        v64["sel"][:B] = np.arange(B) * q
        cpos, cslots = v64["cpos"].reshape(-1, nmax), v64["cslots"].reshape(-1, nmax)
        cseq = v32["cseq"].reshape(-1, nmax)
        cpos[:, :B], cslots[:, :B], cseq[:, :B] = 0, -1, 0
        tables = v32["tables"].reshape(nmax, self.width)
        tables[:B] = 0
        for i, r in enumerate(rows):
            table, m = r.request.block_table, len(r.next_tokens)
            p = np.arange(r.start, r.start + q)
            ids[i * q:i * q + m] = r.next_tokens
            pos[i * q:(i + 1) * q] = p
            slots[i * q:(i + 1) * q] = [table[x // bs] * bs + x % bs for x in p]
            v32["seq"][i] = r.start + q
            v64["sel"][i] = i * q + m - 1
            for s in range(k - 1):  # chain step s + 1 at position start + m - 1 + s + 1
                x = r.start + m + s
                cpos[s, i], cslots[s, i], cseq[s, i] = x, table[x // bs] * bs + x % bs, x + 1
            used = -(-(r.start + max(q, m + k - 1)) // bs)
            tables[i, :used] = table[:used]
        if verified is not None:
            v64["drafts"][:len(rows) * (q - 1)] = np.asarray(verified, dtype=np.int64).reshape(-1)
        self.draw.copy_(self.hraw, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self.hid[:len(rows) * q].copy_(hidden[:len(rows) * q])

    @torch.inference_mode()
    def propose(self, rows: list[DraftRow], hidden: torch.Tensor, q: int, k: int,
                before_sync: Callable[[torch.Tensor], object] | None = None
                ) -> list[list[int]] | None:
        """Drafts per row (k each; [] for k = 0), or None when the step does not fit.
        before_sync gets the drafts [len(rows), k] on the device before the host reads them
        (the runner launches the next verify from them)."""
        B = self.fits(rows, q, k)
        if B is None or hidden.shape[0] != len(rows) * q:
            return None
        self.stage(rows, hidden, B, q, k)
        out = self._run(B, q, k)
        if out is None:
            return [[] for _ in rows]
        drafts = out[:len(rows)]
        self._host_copy.start(drafts)  # queued before whatever before_sync launches
        if before_sync is not None:
            before_sync(drafts)
        flat = self.read_drafts()
        return [flat[i * k:(i + 1) * k] for i in range(len(rows))]

    @torch.inference_mode()
    def launch_after_verify(self, rows: list[DraftRow], hidden: torch.Tensor, B: int, q: int,
                            k: int, argmax: torch.Tensor, verified: list[list[int]],
                            forced: bool = False) -> torch.Tensor:
        """The proposal after a verify step whose acceptance is still on the device
        (engine/spec/verify_ahead.py): rows staged as if all q rows were accepted (each row's
        next_tokens has q placeholders; B = fits(rows, q, k)), with verified [len(rows),
        q - 1] (the drafts that step checked); then the acceptance (self._accept) compares
        them with argmax [len(rows) * q] (the target's, on the device) and moves the input
        ids, the selected rows and the chain's positions to each accepted prefix. Returns
        the drafts [len(rows), k] on the device; their copy to the host is queued
        (read_drafts)."""
        n, nmax = len(rows), self.buckets[-1]
        self.stage(rows, hidden, B, q, k, verified)  # queues the host -> device copies
        v64, v32 = self.dv64, self.dv32
        chain = max(k - 1, 0)
        self._accept(argmax, v64["drafts"][:n * (q - 1)].view(n, q - 1), v64["ids"][:n * q],
                     v64["sel"][:n], v64["cpos"].view(-1, nmax)[:chain],
                     v64["cslots"].view(-1, nmax)[:chain], v32["cseq"].view(-1, nmax)[:chain],
                     v32["tables"].view(nmax, self.width), self.block_size, forced=forced)
        drafts = self._run(B, q, k)[:n]
        self._host_copy.start(drafts)
        return drafts

    def read_drafts(self) -> list[int]:
        """The drafts of the last proposal, flat (waits for their copy)."""
        return self._host_copy.wait()

    @torch.inference_mode()
    def catch_up_from_device(self, requests: list[Request], starts: list[int],
                             hidden: torch.Tensor, ids: torch.Tensor) -> bool:
        """The k = 0 catch-up after a plain decode step: request i's hidden row i at position
        starts[i], with input token ids[i], the token sampled for it, still on the device (the
        host has not read it). Returns False when it does not fit (nothing launched; the
        caller catches up after the sync instead)."""
        rows = [DraftRow(r, start, [0]) for r, start in zip(requests, starts)]  # 0: placeholder
        B = self.fits(rows, 1, 0)
        if B is None or hidden.shape[0] != len(rows) or ids.shape != (len(rows),):
            return False
        self.stage(rows, hidden, B, 1, 0)
        # queued after stage()'s host -> device copy, so the sampled ids overwrite the
        # placeholders (padding rows keep id 0 and slot -1: they write no KV)
        self.dv64["ids"][:len(rows)].copy_(ids)
        self._run(B, 1, 0)
        self.device_catch_ups += 1
        return True

    def _run(self, B: int, q: int, k: int) -> torch.Tensor | None:
        """Run the staged proposal: replay (capturing on first use) or, eagerly, forward()."""
        if not self.use_graphs:
            out = self.forward(B, q, k)
        else:
            if (B, q, k) not in self.graphs:
                self._capture(B, q, k)
            graph, out = self.graphs[(B, q, k)]
            graph.replay()
            self.replays += 1
        self.served += 1
        return out

    def _capture(self, B: int, q: int, k: int) -> None:
        """Capture on first use, with this step's inputs staged: the warm-up run writes the
        same MTP KV the replay will (padding rows write none)."""
        self.forward(B, q, k)  # compile and pick kernels outside the capture
        torch.cuda.synchronize(self.kv_cache.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.forward(B, q, k)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[(B, q, k)] = (graph, out)


def accept_ref(argmax: torch.Tensor, drafts: torch.Tensor, ids: torch.Tensor, sel: torch.Tensor,
               cpos: torch.Tensor, cslots: torch.Tensor, cseq: torch.Tensor,
               tables: torch.Tensor, block_size: int, forced: bool = False) -> None:
    """Greedy acceptance on the device for launch_after_verify, in torch ops: the reference
    of kernels.spec_accept.spec_accept (same arguments, same in-place writes), which the
    fused path runs instead (one kernel where these are ~10).
    n = the leading drafts equal to the target's argmax (k if forced); ids = drafts before n,
    the argmax from n on; sel = i * q + n; chain positions back by k - n, with their slots
    and lengths."""
    B, k = drafts.shape
    q = k + 1
    amv = argmax.view(B, q)
    if forced:
        n = torch.full((B,), k, dtype=torch.int64, device=drafts.device)
    else:
        n = (drafts == amv[:, :k]).to(torch.int64).cumprod(dim=1).sum(dim=1)
    cols = torch.arange(q, device=drafts.device)
    padded = torch.cat([drafts, amv[:, k:]], dim=1)
    ids.copy_(torch.where(cols[None, :] < n[:, None], padded, amv).reshape(-1))
    sel.copy_(torch.arange(B, device=drafts.device) * q + n)
    if cpos.shape[0] > 0 and B > 0:
        p = cpos[:, :B] - (k - n)[None, :]  # [C, B]
        blocks = tables[:B].to(torch.int64).gather(1, (p // block_size).t()).t()
        cpos[:, :B].copy_(p)
        cslots[:, :B].copy_(blocks * block_size + p % block_size)
        cseq[:, :B].copy_(p + 1)


def _int_views(raw: torch.Tensor, n64: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The int64 [n64] and int32 [rest] views of one byte buffer (int64 first: aligned)."""
    return raw[:8 * n64].view(torch.int64), raw[8 * n64:].view(torch.int32)


def _views(flat: torch.Tensor, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    """Consecutive named slices of a flat buffer, in the order of `sizes`."""
    out, at = {}, 0
    for name, size in sizes.items():
        out[name] = flat[at:at + size]
        at += size
    return out


def maybe_draft_graphs(config: EngineConfig, spec: SpecConfig, model: torch.nn.Module,
                       head: torch.nn.Module, kv_cache: torch.Tensor) -> DraftGraphs | None:
    """Static-shape drafting per spec.draft_graphs: replayed as CUDA graphs when the engine
    captures graphs on CUDA ("auto" or "on"), run eagerly elsewhere ("on" only)."""
    graphs = config.use_cuda_graphs and kv_cache.device.type == "cuda"
    if spec.draft_graphs == "off" or (spec.draft_graphs == "auto" and not graphs):
        return None
    draft = DraftGraphs(model, head, kv_cache, config.cache.block_size,
                        config.scheduler.max_model_len, spec.num_speculative_tokens,
                        config.scheduler.max_num_seqs, use_graphs=graphs)
    if config.use_triton:
        draft.use_accept_kernel(fused_kernels().spec_accept)
    return draft
