"""Continuous-batching scheduler: token budget, chunked prefill, preemption by recompute.

Plain Python, no torch. Each step:
  1. running requests, decodes first (1 token each), then running chunked prefills, each cut
     to the remaining token budget. When one cannot get a block, a running request is
     preempted (recompute): under the fcfs policy the most recently admitted, under
     priority the largest priority value (engine/core/request_queue.py); its blocks are freed, it
     goes back to the waiting queue with its outputs kept, and is re-prefilled later.
  2. if nobody was preempted, waiting requests in the policy's order (arrival, or priority
     then arrival) while budget, max_num_seqs and blocks allow; the head waits for blocks,
     nobody overtakes it; a prompt longer than the remaining budget is split into chunks.
A scheduled request computes tokens all_token_ids[start : start + num_new_tokens] and
samples iff that reaches its last token.

A request admitted with output tokens already (a stream continued after its decode worker
died) is scheduled like a preempted one: prompt + those outputs are prefilled (prefix cache
permitting), then it samples its next token.

n > 1: siblings (parent_id = leader's id) wait until the leader's prompt KV is computed and
in the prefix cache, then hit its full blocks, so those are allocated once.

Speculative decoding: the engine hands each running request its drafts (set_spec_tokens); a
decode step then computes [last token, d1..dk] (k + 1 tokens, capped by budget, context and
max_tokens) and reserves `num_lookahead_tokens` more slots for the next drafts' MTP KV.
update_from_output counts only the accepted positions (1 + accepted drafts): rejected
positions stay beyond num_computed_tokens and are overwritten later (KV rollback).

Disaggregation: a decode worker parks a prefilled request as WAITING_FOR_KV (blocks
allocated, filled by a remote read) until kv_arrived / kv_failed; a prefill worker keeps a
finished request's blocks (hold_blocks_on_finish) until release_held.

Only this module changes Request.status.
"""
from __future__ import annotations

import time

from pdserve.engine.core.block_manager import BlockManager, NoFreeBlocksError
from pdserve.engine.core.config import CacheConfig, SchedulerConfig
from pdserve.engine.core.request import Request, RequestStatus
from pdserve.engine.core.request_queue import make_queue
from pdserve.engine.core.sampling_params import DuplicateRequestError, InvalidRequestError
from pdserve.engine.core.scheduler_output import ScheduledRequest, SchedulerOutput

__all__ = ["NoFreeBlocksError", "ScheduledRequest", "Scheduler", "SchedulerOutput"]


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 eos_token_ids: tuple[int, ...] = (), num_lookahead_tokens: int = 0) -> None:
        self.config = scheduler_config
        self.block_manager = BlockManager(cache_config)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting = make_queue(scheduler_config.policy)
        self.running: list[Request] = []  # admission order (fcfs preempts the last first)
        self.waiting_for_kv: dict[str, Request] = {}  # decode role: remote read in flight
        self.held: dict[str, Request] = {}  # prefill role: finished, blocks pinned for a reader
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.num_preemptions = 0
        self.num_kv_recomputes = 0
        self._quarantine: set[str] = set()
        self.num_quarantined_blocks = 0
        self.spec_tokens: dict[str, list[int]] = {}  # drafts for each request's next step
        self.num_lookahead_tokens = num_lookahead_tokens  # slots reserved for drafting

    # -- stats ----------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_waiting_for_kv(self) -> int:
        return len(self.waiting_for_kv)

    def set_spec_tokens(self, request_id: str, token_ids: list[int]) -> None:
        """Drafts to verify in the request's next step (dropped if it stops running)."""
        req = self.requests.get(request_id)
        if req is not None and req.status == RequestStatus.RUNNING and token_ids:
            self.spec_tokens[request_id] = list(token_ids)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id) or self.held.get(request_id)

    # -- admission --------------------------------------------------------------------------
    def _check_admissible(self, req: Request) -> None:
        """Reject what could never finish (over the context length or the whole KV pool),
        and a priority that the fcfs policy would ignore."""
        rid = req.request_id
        if rid in self.requests or rid in self.held:
            raise DuplicateRequestError(rid)
        if req.sampling_params.priority and self.config.policy != "priority":
            raise InvalidRequestError("priority", f"{req.sampling_params.priority}: requests "
                                      f"are served first come, first served; priorities need "
                                      f"scheduling_policy='priority' (--scheduling-policy)")
        prompt, max_tokens = req.num_prompt_tokens, req.sampling_params.max_tokens
        for limit, what in ((self.config.max_model_len, "the context length (max_model_len)"),
                            (self.block_manager.num_blocks * self.block_manager.block_size,
                             "the KV cache pool")):
            if prompt + max_tokens > limit:
                param = "prompt" if prompt >= limit else "max_tokens"
                raise InvalidRequestError(
                    param, f"prompt ({prompt} tokens) + max_tokens ({max_tokens}) = "
                           f"{prompt + max_tokens} exceeds {what} of {limit} tokens")

    def add_request(self, req: Request) -> None:
        """Queue a request (raises InvalidRequestError naming the field if it can never fit)."""
        self._check_admissible(req)
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.add(req)

    def add_remote_request(self, req: Request) -> list[int]:
        """Decode role: allocate blocks for a request prefilled elsewhere and park it as
        WAITING_FOR_KV. `req` carries its first output token (sampled by the prefill worker).

        Returns the block table; block i receives the remote side's block i. Raises
        NoFreeBlocksError when the pool is short (the caller retries later or elsewhere).
        """
        self._check_admissible(req)
        if not req.output_token_ids:
            raise InvalidRequestError("output_token_ids",
                                      "a remote request carries its first sampled token")
        blocks = self.block_manager.allocate_for_remote(req, req.num_prompt_tokens)
        req.status = RequestStatus.WAITING_FOR_KV
        self.requests[req.request_id] = req
        self.waiting_for_kv[req.request_id] = req
        return blocks

    def kv_arrived(self, request_id: str) -> bool:
        """The remote read landed: the prompt's KV is in place; decode from the next step."""
        req = self.waiting_for_kv.pop(request_id, None)
        if req is None:
            return False  # aborted meanwhile, or unknown
        req.num_computed_tokens = req.num_prompt_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.block_manager.cache_full_blocks(req)
        return True

    def kv_failed(self, request_id: str) -> bool:
        """The remote read failed: free the blocks and prefill locally (counted)."""
        req = self.waiting_for_kv.pop(request_id, None)
        if req is None:
            return False
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.num_cached_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.put_back([req])  # it has waited already
        self.num_kv_recomputes += 1
        return True

    # -- finishing ----------------------------------------------------------------------------
    def _finish(self, req: Request, status: RequestStatus, stop_reason: str | int | None) -> None:
        rid = req.request_id
        req.status = status
        req.stop_reason = stop_reason
        self.requests.pop(rid, None)
        self.spec_tokens.pop(rid, None)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.waiting_for_kv.pop(rid, None)
        keep = (req.hold_blocks_on_finish and status != RequestStatus.FINISHED_ABORTED
                and self.block_manager.holds_blocks(req))
        if rid in self._quarantine:  # never freed: a transfer may still write into them
            self.num_quarantined_blocks += len(req.block_table)
        elif keep:
            self.held[rid] = req
        else:
            self.block_manager.free(req)

    def finish_request(self, request_id: str, status: RequestStatus,
                       stop_reason: str | int | None = None) -> bool:
        """Finish a request from outside (e.g. a stop string matched in detokenized text)."""
        if not status.finished:
            raise ValueError(f"status: {status.name} is not a finished status")
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._finish(req, status, stop_reason)
        return True

    def quarantine_request(self, request_id: str) -> bool:
        """Abort a request whose blocks a remote read that NIXL could not cancel may still
        write: they leave the pool for good (counted in num_quarantined_blocks) rather than
        reach another request."""
        if request_id not in self.requests:
            return False
        self._quarantine.add(request_id)
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def abort_request(self, request_id: str) -> bool:
        """Cancel a request and free its blocks now; a held (finished) request is released.

        Decode role: a request still WAITING_FOR_KV may have a read in flight into its
        blocks; the caller must cancel or wait for that read before aborting.
        """
        if request_id in self.held:
            return self.release_held(request_id)
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def release_held(self, request_id: str) -> bool:
        """Prefill role: free the blocks kept for a remote reader (False: unknown or freed)."""
        req = self.held.pop(request_id, None)
        if req is None:
            return False
        return self.block_manager.release(req)

    def held_request_ids(self) -> list[str]:
        return list(self.held)

    # -- scheduling ---------------------------------------------------------------------------
    def schedule(self, defer_new: bool = False) -> SchedulerOutput:
        """The next step's batch. defer_new: leave requests that would join the batch now
        (waiting ones, remote ones whose KV just landed) for the step after, so the step
        matches a decode forward that was launched ahead (engine/exec/overlap.py); they join one
        step later instead of the launched work being thrown away."""
        out = SchedulerOutput()
        scheduled: dict[str, ScheduledRequest] = {}  # insertion order = batch order
        budget = self._schedule_running(scheduled, out.preempted, defer_new)
        if not out.preempted and not defer_new:  # memory tight: admitting would thrash
            self._schedule_waiting(scheduled, budget)
        out.scheduled = list(scheduled.values())
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        return out

    def has_new_work(self) -> bool:
        """Whether a request would join the batch at the next step (see schedule)."""
        return bool(self.waiting) or any(r.first_scheduled_time is None for r in self.running)

    def _schedule_running(self, scheduled: dict[str, ScheduledRequest],
                          preempted: list[Request], defer_new: bool = False) -> int:
        """Decodes, then chunked prefills; returns the token budget left."""
        budget = self.config.max_num_batched_tokens
        decodes = [r for r in self.running if not r.is_prefill]
        prefills = [r for r in self.running if r.is_prefill]
        for req in decodes + prefills:
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            if defer_new and req.first_scheduled_time is None:
                continue  # remote KV just landed: joins next step
            if budget == 0 or len(scheduled) >= self.config.max_num_seqs:
                break
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            samples = req.num_computed_tokens + num_new == req.num_tokens
            spec = self._spec_for(req, budget - num_new) if samples else []
            num_new += len(spec)
            lookahead = self.num_lookahead_tokens if samples else 0
            ok, refund = self._append_or_preempt(req, num_new, scheduled, preempted, lookahead)
            budget += refund
            if ok:
                if req.first_scheduled_time is None:  # remote KV: its first decode step
                    req.first_scheduled_time = time.monotonic()
                scheduled[req.request_id] = ScheduledRequest(req, num_new, spec)
                budget -= num_new
        return budget

    def _spec_for(self, req: Request, budget_left: int) -> list[int]:
        """The request's drafts that fit the budget, the context and its max_tokens."""
        drafts = self.spec_tokens.get(req.request_id)
        if not drafts:
            return []
        cap = min(len(drafts), budget_left, self.config.max_model_len - req.num_tokens,
                  req.sampling_params.max_tokens - len(req.output_token_ids) - 1)
        return drafts[:max(0, cap)]

    def _append_or_preempt(self, req: Request, num_new: int,
                           scheduled: dict[str, ScheduledRequest],
                           preempted: list[Request], lookahead: int = 0) -> tuple[bool, int]:
        """Get blocks for `req`, preempting from the newest end until it fits or is itself
        preempted. Returns (scheduled?, budget refunded by unscheduling victims).
        Lookahead slots (for drafting) are taken only when free: they never preempt."""
        if lookahead and self.block_manager.append_slots(req, num_new + lookahead):
            return True, 0
        refund = 0
        while not self.block_manager.append_slots(req, num_new):
            victim = self.waiting.victim(self.running)  # fcfs: the most recently admitted
            victim_slot = scheduled.pop(victim.request_id, None)
            if victim_slot is not None:
                refund += victim_slot.num_new_tokens
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return False, refund
        return True, refund

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.spec_tokens.pop(req.request_id, None)
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.num_cached_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        # fcfs: victims go newest first, so each older one lands in front (admission order)
        self.waiting.put_back([req])

    def _schedule_waiting(self, scheduled: dict[str, ScheduledRequest], budget: int) -> None:
        bm = self.block_manager
        limit = self.config.max_num_seqs
        skipped: list[Request] = []  # siblings waiting for their leader; they keep their place
        while (self.waiting and budget > 0 and len(self.running) < limit
               and len(scheduled) < limit):
            req = self.waiting.peek()
            if self._waits_for_leader(req):
                skipped.append(self.waiting.pop())
                continue
            # prompt logprobs need every prompt position computed: no cached prefix
            computed = [] if req.sampling_params.prompt_logprobs is not None else \
                bm.get_computed_blocks(req)
            num_new = min(req.num_tokens - len(computed) * bm.block_size, budget)
            completes = len(computed) * bm.block_size + num_new == req.num_tokens
            lookahead = self.num_lookahead_tokens if completes else 0
            if not (lookahead and bm.allocate(req, num_new + lookahead, computed)) \
                    and not bm.allocate(req, num_new, computed):
                break  # the head waits for blocks, nobody overtakes it
            self.waiting.pop()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            scheduled[req.request_id] = ScheduledRequest(req, num_new)
            budget -= num_new
        self.waiting.put_back(skipped)

    def _waits_for_leader(self, req: Request) -> bool:
        """A sibling waits until its leader's prompt KV is computed (then in the cache)."""
        if req.parent_id is None or not self.block_manager.enable_prefix_caching:
            return False
        leader = self.requests.get(req.parent_id)
        if leader is None or leader is req:
            return False  # the leader finished or was aborted: nothing to wait for
        # output tokens mean the prompt was computed once (a later preemption keeps them)
        return not leader.output_token_ids and leader.num_computed_tokens < leader.num_prompt_tokens

    # -- after the model ran ----------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput,
                           sampled: dict[str, list[int]]) -> list[Request]:
        """Advance computed tokens, append sampled tokens, apply stop checks.

        `sampled[request_id]` lists the accepted tokens of each request that samples (more
        than one with speculative decoding). Returns the requests that got new tokens or
        finished, in batch order.
        """
        live = [s for s in out.scheduled if s.request.status == RequestStatus.RUNNING]
        for s in live:  # check before mutating anything
            if s.samples and not sampled.get(s.request.request_id):
                raise ValueError(f"sampled: no token for request {s.request.request_id!r}, "
                                 "which samples this step")
        changed: list[Request] = []
        for s in live:  # requests aborted or finished since schedule() are skipped
            req = s.request
            self.spec_tokens.pop(req.request_id, None)  # consumed; the engine sets new ones
            if s.spec_token_ids:  # only the accepted drafts count (rollback of the rest)
                emitted = sampled[req.request_id]
                req.num_computed_tokens += s.num_new_tokens - len(s.spec_token_ids) \
                    + len(emitted) - 1
                # the accepted drafts must be appended before their blocks can be hashed;
                # a request that stops inside them finishes (and its blocks go) right here
                self._append_tokens(req, emitted)
                self.block_manager.cache_full_blocks(req)
                changed.append(req)
                continue
            req.num_computed_tokens += s.num_new_tokens
            self.block_manager.cache_full_blocks(req)
            if s.samples:
                self._append_tokens(req, sampled[req.request_id])
                changed.append(req)
        return changed

    def _append_tokens(self, req: Request, tokens: list[int]) -> None:
        for token in tokens:
            req.append_token(token)
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            status, reason = self._check_stop(req, token)
            if status is not None:
                self._finish(req, status, reason)
                return  # tokens after a stop are dropped

    def _check_stop(self, req: Request, token: int) -> tuple[RequestStatus | None, int | None]:
        params = req.sampling_params
        if len(req.output_token_ids) > params.min_tokens:  # the token is already appended
            if not params.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
            if token in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
        if (len(req.output_token_ids) >= params.max_tokens
                or req.num_tokens >= self.config.max_model_len):
            return RequestStatus.FINISHED_LENGTH, None
        return None, None
