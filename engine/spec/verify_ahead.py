"""A greedy verify step whose acceptance and next drafts never wait for the host.

The general path (SpecDecoder.verify, then SpecDecoder.propose) reads the target's argmax on
the host before it stages the MTP drafting, so the GPU sits idle for one host round trip in
every speculative step (~0.2-0.5 ms on an H100 at batch 1, bench/results/diag_spec_*). When a
step is uniform -- every request greedy without a grammar, verifying the same k drafts in
q = k + 1 rows laid out in order -- and static drafting fits, everything is queued behind the
verify forward instead:

    GPU   verify forward -> LM head, argmax [B, q] (copied to the host on a side stream)
          -> acceptance: accepted n [B] and the drafting's inputs derived from it, one kernel
             (kernels/spec_accept.py; pdserve.engine.spec.draft_graphs.accept_ref in torch)
          -> MTP catch-up over the q rows + chain (engine/spec/draft_graphs.py) -> copy drafts
    host  reads the argmax while the drafting runs, emits the tokens (the same greedy rule as
          SpecDecoder.verify), launches the next verify forward from the drafts still on the
          device (the runner's _launch_verify), then reads the drafts.

The draft graph is sized for the worst case (all q rows accepted, k_next drafts); requests
whose cap_k turns out smaller once the tokens are known keep only that many drafts (what the
chain wrote past them lies beyond their accepted length, the rollback rule of spec_decode).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.core.request import Request
from pdserve.engine.core.scheduler_output import SchedulerOutput
from pdserve.engine.exec.device_io import HostCopy
from pdserve.engine.exec.sampler import SAMPLING_EPS
from pdserve.engine.spec.draft_graphs import DraftRow
from pdserve.engine.spec.spec_decoder import SpecDecoder, greedy_accept


@dataclass
class LaunchedVerify:
    """A verify step queued on the device with its drafting; read it in this order."""

    spec: SpecDecoder
    items: list[tuple[Request, list[int], int]]
    k_next: int
    argmax: HostCopy  # [B * q] the target's argmax at every verify row
    drafts_dev: torch.Tensor  # [B, k_next] int64 on the device (the next verify's input)

    def emitted(self) -> dict[str, list[int]]:
        """Tokens each request emits this step (waits for the argmax copy only); records the
        acceptance counters."""
        am = self.argmax.wait()
        q = len(self.items[0][1]) + 1
        out: dict[str, list[int]] = {}
        for i, (req, drafts, _) in enumerate(self.items):
            rows = am[i * q:(i + 1) * q]
            tokens = (drafts + [rows[-1]] if self.spec.spec.forced_acceptance
                      else greedy_accept(drafts, rows))
            self.spec.stats.record(len(drafts), len(tokens) - 1)
            out[req.request_id] = tokens
        return out

    def drafts(self, emitted: dict[str, list[int]]) -> dict[str, list[int]]:
        """Next step's drafts per request (waits for the drafting), cut to what cap_k allows
        now that the emitted tokens are known."""
        flat = self.spec.draft_graphs.read_drafts()
        k, out = self.k_next, {}
        for i, (req, _, _) in enumerate(self.items):
            cap = self.spec.cap_k(req, k, emitted[req.request_id])
            if cap > 0:
                out[req.request_id] = flat[i * k:i * k + cap]
        return out


class VerifyAhead:
    """Launches uniform greedy verify steps with device-side acceptance (module docstring)."""

    def __init__(self, spec: SpecDecoder) -> None:
        self.spec = spec
        self._argmax = HostCopy()
        self.launched = 0

    def launch(self, items: list[tuple[Request, list[int], int]], starts: list[int],
               hidden: torch.Tensor, k_next: int) -> LaunchedVerify | None:
        """items: (request, its k drafts, index of its last verify row), in row order;
        starts: each request's first verify position; hidden [B * q, H]: the verify forward's
        normed rows. None when the step is not uniform greedy or the drafting does not fit
        (the caller takes the general path; nothing was launched)."""
        graphs = self.spec.draft_graphs
        if graphs is None or k_next < 1 or not items:
            return None
        B, k = len(items), len(items[0][1])
        q = k + 1
        if k < 1 or hidden.shape[0] != B * q or any(
                len(d) != k or last != i * q + k or r.sampling_params.temperature >= SAMPLING_EPS
                or r.sampling_params.has_grammar  # its argmax is unmasked: spec.verify masks
                for i, (r, d, last) in enumerate(items)):
            return None
        rows = [DraftRow(r, start, [0] * q) for (r, _, _), start in zip(items, starts)]
        bucket = graphs.fits(rows, q, k_next)  # worst case: every row accepted
        if bucket is None:
            return None
        argmax = self.spec.model.greedy(hidden)  # [B * q]
        self._argmax.start(argmax)  # queued before the drafting: the host reads it first
        out = graphs.launch_after_verify(rows, hidden, bucket, q, k_next, argmax,
                                         [d for _, d, _ in items],
                                         forced=self.spec.spec.forced_acceptance)
        for r, _, _ in items:
            self.spec.free_request_drafts(r.request_id)
        self.launched += 1
        return LaunchedVerify(self.spec, items, k_next, self._argmax, out)


def verify_ids(out: SchedulerOutput, last: list[int], drafts: dict[str, list[int]],
                k: int) -> list[int] | None:
    """The input ids the next verify step will bring ([last, k drafts] per request), or None
    when some request did not get k drafts (the launched verify is then discarded)."""
    ids: list[int] = []
    for s, t in zip(out.scheduled, last):
        d = drafts.get(s.request.request_id, [])
        if len(d) != k:
            return None
        ids += [t] + d
    return ids
