"""LLMEngine: scheduler + model runner + detokenizer, one step at a time.

    step():  out = scheduler.schedule()
             result = runner.run(out)
             updated = scheduler.update_from_output(out, result.sampled)
             return postprocess(updated)          # detokenize, stop strings, outputs

With MTP speculation (LLMEngine(..., spec=SpecConfig(), mtp_head=...)) the runner also
returns drafts for each running request; they go to the scheduler, which verifies them in
the request's next step (engine/spec/spec_decoder.py). k per step follows the batch size.

The engine is synchronous and owns no threads or sockets; workers drive it from a loop.
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Sequence

from pdserve.engine.core.config import EngineConfig, SpecConfig, compat_payload
from pdserve.engine.core.detokenizer import DetokResult, IncrementalDetokenizer
from pdserve.engine.core.outputs import EngineStats, RequestOutput
from pdserve.engine.core.request import Request, RequestStatus
from pdserve.engine.core.sampling_params import (
    DuplicateRequestError,
    InvalidRequestError,
    SamplingParams,
)
from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.dist.lockstep import Leader
from pdserve.engine.exec.runner import ModelRunner, StepResult
from pdserve.engine.model.decoder import Model
from pdserve.engine.spec.spec_decoder import SpecStats
from pdserve.engine.structured.compiler import GrammarCompiler
from pdserve.engine.structured.matcher import GrammarState


class LLMEngine:
    def __init__(self, config: EngineConfig, model: Model, tokenizer=None,
                 spec: SpecConfig | None = None, mtp_head: object | None = None,
                 mtp_head_id: str = "", leader: Leader | None = None) -> None:
        """spec + mtp_head (engine.spec.mtp_head.MTPHead; config.model.num_mtp_layers >= 1) turn MTP
        speculation on; mtp_head_id names the head's weights in the compatibility hash.
        leader: rank 0 of a tensor-parallel engine (engine/dist/lockstep.py); the model is
        then its shard and config.model the full model."""
        self.config = config
        self.tokenizer = tokenizer
        self.spec = spec
        self.mtp_head_id = mtp_head_id
        self.runner = ModelRunner(config, model, spec=spec, mtp_head=mtp_head, leader=leader)
        self._on_close: Callable[[], None] | None = None
        # slots reserved past a step's tokens: the MTP chain writes k - 1 ahead, and a verify
        # launched before the host read the drafts (runner._ahead_verify) reaches k + 1 ahead.
        # Overlapped decode launches the next step before the scheduler runs again, so the
        # next position's block must exist already: one slot. (Without it every request that
        # crosses a block boundary stops the launch for the whole batch; with requests at
        # mixed offsets, as in serving, that was nearly every step.)
        lookahead = (spec.num_speculative_tokens + 1 if spec is not None
                     else int(self.runner.ahead is not None))
        self.scheduler = Scheduler(config.scheduler, config.cache, config.model.eos_token_ids,
                                   num_lookahead_tokens=lookahead)
        self.stats = EngineStats()
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self._reported: dict[str, int] = {}  # output tokens already reported per request
        self.last_step: StepResult | None = None
        self.idle = True
        self.keep_hidden = False  # prefill role: ship the last hidden state (MTP drafting)
        self._remote_hidden: dict = {}  # decode role: request -> prefill's last hidden [H]
        self._grammars: GrammarCompiler | None = None  # made on the first grammar request
        self._grammars_lock = threading.Lock()  # worker services compile on their threads

    def on_close(self, fn: Callable[[], None] | None) -> None:
        """What close() runs once (the offline engine's follower ranks: stop and join)."""
        self._on_close = fn

    def close(self) -> None:
        fn, self._on_close = self._on_close, None
        if fn is not None:
            # the captured graphs go first: with TP their NCCL collectives hold the
            # communicator that the ranks' close then takes down
            self.runner.release_graphs()
            fn()

    @property
    def spec_stats(self) -> SpecStats | None:
        """Draft/acceptance counters (None without speculation)."""
        return self.runner.spec.stats if self.runner.spec is not None else None

    def compat_extra(self) -> dict:
        """The speculation part of the KV compatibility hash (MTP KV is in every block)."""
        if self.spec is None:
            return {}
        return {"speculative": self.spec.compat(self.mtp_head_id)}

    def kv_compat_payload(self) -> dict:
        """What the KV handshake compares (engine.core.config.compat_payload)."""
        return compat_payload(self.config.model, self.config.cache, self.compat_extra(),
                              self.config.identity)

    # -- structured outputs --------------------------------------------------------------
    @property
    def grammars(self) -> GrammarCompiler:
        """The engine's grammar compiler and cache (thread-safe: the worker services compile
        a request's grammar on their gRPC thread, so the engine loop finds it cached)."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise InvalidRequestError("structured_outputs", "this model has no "
                                              "tokenizer, which structured outputs need")
                self._grammars = GrammarCompiler(self.tokenizer, self.config.model.vocab_size,
                                                 self.config.model.eos_token_ids)
            return self._grammars

    def precompile(self, params: SamplingParams, timeout_s: float | None = None) -> None:
        """Compile a request's grammar into the cache from the caller's thread (a worker
        service's gRPC thread), so that admission on the engine loop finds it there and the
        loop never waits for a compile; InvalidRequestError naming the field, also past
        timeout_s."""
        if params.structured is not None:
            self.grammars.compile(params.structured, timeout_s)

    def _attach_grammar(self, req: Request, compiled: object | None, param: str) -> None:
        """The request's grammar state beside its sampler state, advanced over the output
        tokens it already has; InvalidRequestError naming `param` if they do not match."""
        if compiled is None:
            return
        grammar = GrammarState(compiled, self.config.model.eos_token_ids)
        grammar.replay(req.output_token_ids, param)
        self.runner.state_of(req).grammar = grammar

    def _compiled(self, params: SamplingParams) -> object | None:
        return None if params.structured is None else self.grammars.compile(params.structured)

    # -- admission -----------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            if self.tokenizer is None:
                raise InvalidRequestError("prompt", "text prompts need a tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        if not prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        vocab = self.config.model.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in prompt):
            raise InvalidRequestError("prompt", f"token ids must be integers in [0, {vocab})")
        return list(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None, hold_blocks: bool = False,
                    resume_output_ids: Sequence[int] = ()) -> list[str]:
        """Queue a request; n > 1 becomes n sibling requests sharing the prompt's blocks.

        resume_output_ids: output tokens this completion already produced elsewhere (a
        stream continued after its decode worker died). They become the request's first
        output tokens, so it prefills prompt + them like a preempted request, max_tokens and
        the penalties count them, a seeded sampler draws at their position on, and only the
        tokens after them are reported, their text continuing the already-sent text."""
        ids = self.tokenize(prompt)
        params = params.with_bad_words_tokenized(self.tokenizer)
        resume = self._check_resume(list(resume_output_ids), params)
        params.check_vocab(self.config.model.vocab_size)  # its token ids index the logits
        compiled = self._compiled(params)  # cached when a worker service compiled it first
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        rids = [rid] if params.n == 1 else [f"{rid}-{i}" for i in range(params.n)]
        self._check_unused(rids)
        reqs = [Request(r, ids, _sibling_params(params, i), parent_id=None if i == 0 else rids[0],
                        hold_blocks_on_finish=hold_blocks) for i, r in enumerate(rids)]
        for req in reqs:
            for token in resume:  # before admission, so the scheduler's checks see them
                req.append_token(token)
            detok = None
            if self.tokenizer is not None:
                detok = self._new_detok(ids, params)
                # their text was sent; keep held back what the stream held back
                if detok.prime(resume):
                    raise InvalidRequestError("resume_output_ids",
                                              "their text already contains a stop string")
            try:
                self._attach_grammar(req, compiled, "resume_output_ids")
                self.scheduler.add_request(req)
            except Exception:  # nothing of it stays behind (its sampler state)
                self.runner.free_request(req.request_id)
                raise
            if detok is not None:
                self._detok[req.request_id] = detok
            if resume:
                self._reported[req.request_id] = len(resume)
        self.stats.prompt_tokens += len(ids)
        return rids

    def _check_unused(self, rids: list[str]) -> None:
        """DuplicateRequestError before any state is built: the grammar and sampler state are
        keyed by id, so a second request would overwrite the first one's (and its cleanup
        free them)."""
        for rid in rids:
            if self.scheduler.get_request(rid) is not None:
                raise DuplicateRequestError(rid)

    def _check_resume(self, resume: list[int], params: SamplingParams) -> list[int]:
        """Validate the already-generated tokens of a continued stream (names the field)."""
        if not resume:
            return resume
        vocab = self.config.model.vocab_size
        if params.n != 1:
            raise InvalidRequestError("resume_output_ids", "a continued stream has n = 1")
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in resume):
            raise InvalidRequestError("resume_output_ids",
                                      f"token ids must be integers in [0, {vocab})")
        if len(resume) >= params.max_tokens:
            raise InvalidRequestError(
                "resume_output_ids", f"{len(resume)} tokens already reach max_tokens "
                                     f"({params.max_tokens}): nothing is left to generate")
        return resume

    # -- disaggregation (decode role): a request whose prompt KV comes from a remote read --
    def add_remote_request(self, request_id: str, prompt_ids: list[int], first_token: int,
                           params: SamplingParams, hidden: object | None = None,
                           ) -> tuple[list[int], RequestOutput]:
        """Admit a prefilled request: allocate blocks for its prompt KV (to be read into),
        park it WAITING_FOR_KV, and return those block ids plus the first token's output.
        hidden: the prefill worker's last pre-norm hidden state (torch [H]); with MTP the
        first drafts come from it once the KV has arrived."""
        ids = self.tokenize(prompt_ids)
        params.check_vocab(self.config.model.vocab_size)
        self._check_unused([request_id])
        req = Request(request_id, ids, params)
        req.append_token(first_token)
        # the grammar replays the prefill worker's first token (it was drawn under it there)
        self._attach_grammar(req, self._compiled(params), "prefill.first_token_id")
        try:
            blocks = self.scheduler.add_remote_request(req)
        except Exception:
            self.runner.free_request(request_id)
            raise
        if hidden is not None and self.spec is not None:
            self._remote_hidden[request_id] = hidden
        text = ""
        if self.tokenizer is not None:
            detok = self._new_detok(ids, params)
            self._detok[request_id] = detok
            text = detok.add([first_token]).new_text
        self._reported[request_id] = 1
        self.stats.prompt_tokens += len(ids)
        self.stats.generation_tokens += 1
        first = RequestOutput(request_id, [first_token], text, False, None, [],
                              len(ids), 1, 0)
        return blocks, first

    def kv_arrived(self, request_id: str) -> None:
        arrived = self.scheduler.kv_arrived(request_id)
        hidden = self._remote_hidden.pop(request_id, None)
        if arrived and hidden is not None:
            self._draft_remote(request_id, hidden)

    def _draft_remote(self, request_id: str, hidden: object) -> None:
        """Draft a just-arrived request's first verify from the shipped hidden state; the
        chain writes MTP KV up to position L + k - 2, so reserve those slots first."""
        req = self.scheduler.get_request(request_id)
        k = self.spec.k_for_batch(self.scheduler.num_running)
        if req is None or k == 0 or hidden.numel() != self.config.model.hidden_size:
            return  # (a malformed hidden state only costs the first drafts)
        if k > 1 and not self.scheduler.block_manager.append_slots(req, k - 1):
            return  # no room to draft now: the first step decodes plainly
        self.scheduler.set_spec_tokens(request_id, self.runner.propose_remote(req, hidden, k))

    def kv_failed(self, request_id: str) -> None:
        """Fall back to computing the prompt locally (counted by the scheduler)."""
        self.scheduler.kv_failed(request_id)

    def quarantine_request(self, request_id: str) -> bool:
        """Abort without returning the blocks to the pool (an uncancellable read targets them)."""
        self._forget(request_id)
        return self.scheduler.quarantine_request(request_id)

    def release_held(self, request_id: str) -> bool:
        """Prefill role: free blocks kept pinned for a remote reader."""
        return self.scheduler.release_held(request_id)

    def abort_request(self, request_id: str) -> bool:
        self._forget(request_id)
        return self.scheduler.abort_request(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        ahead = self.runner.ahead
        in_flight = ahead is not None and ahead.in_flight
        out = self.scheduler.schedule(defer_new=in_flight)
        if in_flight and not out.scheduled:  # only newcomers left: the launch is stale
            ahead.drop()
            out = self.scheduler.schedule()
        self.idle = not out.scheduled  # nothing runnable (e.g. all waiting for remote KV)
        if not out.scheduled:
            return []
        k = self.spec.k_for_batch(len(out.scheduled)) if self.spec is not None else 0
        t1 = time.perf_counter()
        result = self.runner.run(out, want_hidden=self.keep_hidden, num_spec=k,
                                 may_overlap=not self.scheduler.has_new_work())
        t2 = time.perf_counter()
        self.last_step = result
        for s in out.scheduled:  # prefill chunks: kept until the request's first output
            lps = result.prompt_logprobs.get(s.request.request_id)
            if lps:  # a recomputed (preempted) prefill scores positions it already has
                seen = len(s.request.prompt_logprobs) - s.start_pos
                s.request.prompt_logprobs += lps[max(0, seen):]
        updated = self.scheduler.update_from_output(out, result.sampled)
        for rid, drafts in result.drafts.items():  # verified in the request's next step
            self.scheduler.set_spec_tokens(rid, drafts)
        self.stats.steps += 1
        t3 = time.perf_counter()
        outputs = [self._postprocess(req, result) for req in updated]
        self._time_step(t0, t1, t2, t3)
        return outputs

    def _time_step(self, t0: float, t1: float, t2: float, t3: float) -> None:
        """Account the step's host phases (runner.timing splits the runner's share)."""
        add, runner = self.stats.add_time, self.runner.timing
        add("schedule", t1 - t0)
        for phase, seconds in runner.items():
            add(phase, seconds)
        add("draft", max(0.0, (t2 - t1) - sum(runner.values())))
        add("update", t3 - t2)
        add("postprocess", time.perf_counter() - t3)

    def _postprocess(self, req: Request, result: StepResult) -> RequestOutput:
        rid = req.request_id
        start = self._reported.get(rid, 0)
        new_ids = req.output_token_ids[start:]  # what the scheduler accepted this step
        detok = self._detok.get(rid)
        # a stop token ends the request but is not text, as in vLLM (EOS: special anyway)
        shown = new_ids[:-1] if new_ids and req.is_finished and \
            req.stop_reason == new_ids[-1] else new_ids
        res = (self._detokenize(req, detok, start, shown)
               if detok is not None and shown else None)
        new_ids = req.output_token_ids[start:]  # a stop string may have cut some
        text = res.new_text if res else ""
        self.runner.observe(req, new_ids)  # penalty counts, the grammar's matcher
        if res is not None and res.stopped:
            if not req.is_finished:
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED,
                                              res.stop_string)
        else:
            self._end_of_grammar(req)
            if req.is_finished and detok is not None:
                text += detok.flush()  # no stop string matched: release held-back text
        self._reported[rid] = len(req.output_token_ids)
        self.stats.generation_tokens += len(new_ids)
        lp = result.logprobs.get(rid)
        if lp is not None:
            req.output_logprobs.append(lp)
        output = RequestOutput(
            rid, new_ids, text, req.is_finished, req.status.finish_reason,
            [lp] if lp is not None else [], req.num_prompt_tokens, len(req.output_token_ids),
            req.num_cached_tokens, result.hidden.get(rid),
            req.prompt_logprobs if start == 0 and req.sampling_params.prompt_logprobs is not None
            else None, req.stop_reason if req.is_finished else None)
        if req.is_finished:
            self._forget(rid)
        return output

    def _end_of_grammar(self, req: Request) -> None:
        """A grammar that accepted a stop token ends its request ("stop") even under
        ignore_eos: nothing may follow it."""
        if req.is_finished or not req.sampling_params.has_grammar:
            return
        grammar = self.runner.state_of(req).grammar
        if grammar is not None and grammar.terminated:
            last = req.output_token_ids[-1]  # stop_reason: None for EOS, as vLLM says it
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED,
                                          None if last in self.scheduler.eos_token_ids else last)

    @staticmethod
    def _detokenize(req: Request, detok: IncrementalDetokenizer, start: int,
                    new_ids: list[int]) -> DetokResult:
        """Feed this step's tokens. Several at once (speculation) with stop strings go one by
        one, and tokens after the one that completes a stop string are dropped from the
        request, exactly as one-token steps would have stopped."""
        if len(new_ids) == 1 or not detok.stop:
            return detok.add(new_ids)
        parts: list[str] = []
        for n, token in enumerate(new_ids):
            res = detok.add([token])
            parts.append(res.new_text)
            if res.stopped:
                del req.output_token_ids[start + n + 1:]
                break
        return DetokResult("".join(parts), res.stopped, res.stop_string)

    def _forget(self, request_id: str) -> None:
        self._detok.pop(request_id, None)
        self._remote_hidden.pop(request_id, None)
        self._reported.pop(request_id, None)
        self.runner.free_request(request_id)

    def _new_detok(self, ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer.for_params(self.tokenizer, ids, params)

    def generate_until_done(self, deadline_s: float = 3600.0) -> list[RequestOutput]:
        """Run steps until every queued request finished (offline use)."""
        outputs: list[RequestOutput] = []
        end = time.monotonic() + deadline_s
        while self.has_unfinished():
            if time.monotonic() > end:
                raise TimeoutError(f"engine did not finish within {deadline_s} s")
            outputs += self.step()
        return outputs


def _sibling_params(params: SamplingParams, index: int) -> SamplingParams:
    """n > 1 siblings: one completion each; a seeded request seeds sibling i with seed + i
    so the n completions differ yet the whole request stays reproducible."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)
