"""ModelRunner: the torch half of an engine step.

It turns a SchedulerOutput (which requests, how many new tokens each) into flat varlen
tensors, runs the model over the paged KV cache, and samples one token for every request
that reached its end this step. It owns the KV cache tensor and per-request sampler state.

With MTP speculation (engine/spec/spec_decoder.py) a request may bring drafts: its k+1 rows are
verified instead of sampled (1 to k+1 tokens come back), and after sampling the MTP head
catches up on this step's positions and drafts the next step's tokens (StepResult.drafts).
A plain decode step that drafts nothing (k = 0, large batches) instead launches its catch-up
from the sampled ids on the device, before the host reads them, and may then overlap the next
decode forward (engine/exec/overlap.py) like a step without speculation.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdserve.engine.core.config import ConfigError, EngineConfig, SpecConfig
from pdserve.engine.core.outputs import PromptLogprob
from pdserve.engine.core.request import Request
from pdserve.engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from pdserve.engine.dist import parallel
from pdserve.engine.dist.lockstep import Leader
from pdserve.engine.exec.cuda_graphs import DecodeGraphs, maybe_decode_graphs
from pdserve.engine.exec.device_io import rows_of
from pdserve.engine.exec.kv_cache import engine_kv_cache
from pdserve.engine.exec.overlap import DecodeAhead
from pdserve.engine.exec.prompt_logprobs import logits_slices, plan_prompt_logprobs, score_prompt_logprobs
from pdserve.engine.exec.sampler import Sampler, SamplerState
from pdserve.engine.model.attention import HostBatch
from pdserve.engine.model.decoder import Model
from pdserve.engine.spec.draft_graphs import maybe_draft_graphs
from pdserve.engine.spec.mtp_head import tp_mtp_head
from pdserve.engine.spec.spec_decoder import DraftJob, SpecDecoder
from pdserve.engine.spec.verify_ahead import VerifyAhead, verify_ids
from pdserve.engine.spec.verify_graphs import VerifyGraphs, maybe_verify_graphs


@dataclass
class StepResult:
    """What one model step produced for the requests that sample."""

    sampled: dict[str, list[int]]
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]]
    hidden: dict[str, torch.Tensor]  # pre-norm last hidden state, [hidden] (prefill role / MTP)
    drafts: dict[str, list[int]] = field(default_factory=dict)  # next step's drafts (MTP)
    prompt_logprobs: dict[str, list[PromptLogprob]] = field(default_factory=dict)


class ModelRunner:
    """leader (tensor parallelism, rank 0): every forward and block copy is announced to the
    follower ranks first (engine/dist/lockstep.py), which run the same on their shards; the
    model's collectives meet theirs. config.model is the full model, model.config the
    rank's shard (its KV heads size the cache)."""

    def __init__(self, config: EngineConfig, model: Model, kv_cache: torch.Tensor | None = None,
                 spec: SpecConfig | None = None, mtp_head: torch.nn.Module | None = None,
                 leader: Leader | None = None):
        self.config = config
        self.model = model
        self.leader = leader
        self.device = torch.device(config.device)
        cache = config.cache
        self.block_size = cache.block_size
        self.kv_cache = kv_cache if kv_cache is not None else engine_kv_cache(
            config, model.config.num_kv_heads)
        self.sampler = Sampler(config.seed, model.argmax, config.model.eos_token_ids)
        self._states: dict[str, SamplerState] = {}
        self.cuda_graphs = maybe_decode_graphs(config, model, self.kv_cache)  # decode steps
        overlap = config.overlap_decode == "on" or (
            config.overlap_decode == "auto" and self.cuda_graphs is not None)
        if leader is not None and spec is None and config.model.num_mtp_layers > 0:
            # the ranks loaded an MTP head for speculative, but this engine was built without
            # it (every builder passes load_rank's spec and mtp_head: engine/llm.py,
            # worker/tp_worker.py, worker/tp_group.py)
            raise ConfigError("speculative: the ranks loaded MTP layers but the engine has no "
                              "SpecConfig (build it with load_rank's spec and mtp_head)")
        self.ahead = DecodeAhead(model, self.kv_cache, self.cuda_graphs, self.block_size,
                                 config.scheduler.max_model_len) if overlap else None
        self.timing: dict[str, float] = {}  # the last step's host phases (see run)
        self.spec: SpecDecoder | None = None
        if spec is not None:
            if mtp_head is None or config.model.num_mtp_layers < 1:
                raise ValueError("speculative: MTP needs an MTP head and num_mtp_layers >= 1")
            # with TP: the rank's shard of the head; every drafting pass is announced (the
            # followers run it too, engine/spec/mtp_plan.py); no static drafting (yet)
            mtp_head = tp_mtp_head(mtp_head, model)
            self.spec = SpecDecoder(spec, mtp_head, model, self.kv_cache, self.block_size,
                                    self.sampler, config.scheduler.max_model_len,
                                    config.model.eos_token_ids,
                                    announce=leader.mtp if leader is not None else None)
            if leader is None:
                self.spec.draft_graphs = maybe_draft_graphs(config, spec, model, mtp_head,
                                                            self.kv_cache)
        self.verify_ahead = VerifyAhead(self.spec) if self.spec is not None else None
        # verify steps (k+1 tokens per sequence) replay graphs too, up to the largest batch
        # that still drafts; with TP each follower captures the same (RankParts.follower)
        self.verify_graphs = maybe_verify_graphs(config, model, self.kv_cache, spec)

    def release_graphs(self) -> None:
        """Drop every captured graph (the engine is closing); later steps run eagerly. No
        host wait: a replay still queued keeps its graph alive, and one stuck in a
        collective must not hold up the close."""
        self.cuda_graphs, self.verify_graphs, self.ahead = None, {}, None
        if self.spec is not None:
            self.spec.draft_graphs = None

    # -- per-request sampler state -------------------------------------------------------
    def _state(self, req: Request) -> SamplerState:
        state = self._states.get(req.request_id)
        if state is None:
            state = self.sampler.new_state(req, self.config.model.vocab_size, self.device)
            self._states[req.request_id] = state
        return state

    def state_of(self, req: Request) -> SamplerState:
        """The request's sampler state, made on first use (the engine attaches grammars)."""
        return self._state(req)

    def free_request(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        if self.spec is not None:
            self.spec.free_request(request_id)

    def observe(self, req: Request, token_ids: list[int]) -> None:
        """Feed accepted tokens to the request's incremental penalty state."""
        state = self._states.get(req.request_id)
        if state is not None:
            for t in token_ids:
                state.observe(t)

    # -- one step ------------------------------------------------------------------------
    def flatten(self, out: SchedulerOutput) -> HostBatch:
        """The scheduled tokens as host lists: ids and positions [T], slots, per-sequence
        lengths and block tables (drafts, when verifying, follow each sequence's token)."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qlens: list[int] = []
        slens: list[int] = []
        tables: list[list[int]] = []
        bs = self.block_size
        for s in out.scheduled:
            req, start = s.request, s.request.num_computed_tokens
            end = start + s.num_new_tokens
            ids += s.token_ids  # drafts last
            pos += range(start, end)
            table = req.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            qlens.append(s.num_new_tokens)
            slens.append(end)
            tables.append(table[: (end + bs - 1) // bs])
        return HostBatch(ids, pos, slots, qlens, slens, tables, bs)

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, want_hidden: bool = False,
            num_spec: int = 0, may_overlap: bool = False) -> StepResult:
        """One step. num_spec: drafts to make per request for the next step (MTP only).
        may_overlap: the engine expects the same batch next step (no request waiting to
        join), so a decode step may launch the next forward early (engine/exec/overlap.py)."""
        t0 = time.perf_counter()
        batch = self.flatten(out)
        # last row of each sequence that samples this step
        ends = list(itertools.accumulate(batch.query_lens))  # host-side: no device reads
        plain = [(s, ends[i] - 1) for i, s in enumerate(out.scheduled)
                 if s.samples and not s.spec_token_ids]
        verify = [(s, ends[i] - 1) for i, s in enumerate(out.scheduled)
                  if s.samples and s.spec_token_ids]
        # the LM head's rows, in the order run() computes them (a leader announces them)
        verify_rows = [r for s, last in verify
                       for r in range(last - len(s.spec_token_ids), last + 1)]
        jobs = plan_prompt_logprobs(out, ends)
        hidden, prenorm = self._forward(out, batch, [row for _, row in plain], verify_rows,
                                        logits_slices(jobs))
        t1 = time.perf_counter()
        result = StepResult({}, {}, {}, {}, score_prompt_logprobs(self.model, hidden, jobs))
        caught_up = False  # the MTP catch-up already ran, from the sampler's device ids
        if plain:
            catch_up = self._may_catch_up_early(out, num_spec)
            ahead = None
            if may_overlap and not want_hidden and len(plain) == len(out.scheduled):
                ahead = self._ahead_batch(out, num_spec, catch_up)
            caught_up = self._sample(plain, hidden, result, ahead, catch_up)
        if verify and not plain and not want_hidden and num_spec > 0:
            caught_up = self._verify_ahead(out, verify, hidden, result, num_spec, may_overlap)
        if verify and not caught_up:
            items = [(s.request, s.spec_token_ids, last) for s, last in verify]
            states = [self._state(s.request) for s, _ in verify]
            result.sampled.update(self.spec.verify(items, hidden, states))
        # host seconds: inputs + launch (the GPU runs on), then logits + sampling, which
        # waits for the GPU (the engine adds these up in EngineStats.host_s)
        self.timing = {"launch": t1 - t0, "sample": time.perf_counter() - t1}
        if want_hidden:  # the last computed position's state (the last accepted row)
            for s, last in plain + verify:
                rid = s.request.request_id
                row = last - len(s.spec_token_ids) + len(result.sampled[rid]) - 1
                result.hidden[rid] = prenorm[row].float().cpu()
        if self.spec is not None and not caught_up and (
                num_spec > 0 or self.spec.spec.maintain_mtp_kv):
            jobs = self._draft_jobs(out, ends, result.sampled, num_spec)
            states = {j.request.request_id: self._state(j.request) for j in jobs if j.k > 0}
            nxt = None
            if may_overlap and not want_hidden and not plain:
                nxt = self._ahead_verify(out, result.sampled, num_spec)
            hook = None if nxt is None else (lambda d: self._launch_verify(nxt, num_spec, d))
            result.drafts = self.spec.propose(jobs, hidden, states, before_sync=hook)
            if nxt is not None:
                self.ahead.confirm(verify_ids(out, nxt[1], result.drafts, num_spec))
        return result

    def _forward(self, out: SchedulerOutput, batch: HostBatch, logits_rows: list[int],
                 verify_rows: list[int], prompt_slices: list[list[int]]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, prenorm) [T, H]: a captured graph for a decode step or a uniform verify
        step (every request verifying the same k drafts), else the eager model. With a
        leader, the followers are told first (they join the LM head for each of
        prompt_slices, logits_rows, then verify_rows: SpecDecoder.verify's rows), and
        whether the forward each of them launched ahead serves this step (no graphs with TP
        yet)."""
        # with speculation too: a launched forward is a plain decode batch, whose hidden rows
        # (graph outputs, valid until the next replay) the sampler and the catch-up read
        # before any replay; its prenorm is an uncopied view, but run() reads prenorm only
        # for want_hidden, and nothing is launched ahead then
        launched = self.ahead.take(batch) if self.ahead is not None else None
        graphs, bucket = self._step_graphs(out, batch) if launched is None else (None, None)
        if self.leader is not None:
            self.leader.forward(batch, logits_rows, return_prenorm=True,
                                verify_rows=verify_rows, launched=launched is not None,
                                prompt_slices=prompt_slices, graphed=graphs is not None)
        if launched is not None:
            return launched
        if graphs is not None:
            return graphs.run_host(batch, keep_prenorm=self.spec is not None, bucket=bucket)
        input_ids, positions, meta = batch.to_device(self.device)
        return self.model(input_ids, positions, meta, self.kv_cache, return_prenorm=True)

    def _step_graphs(self, out: SchedulerOutput, batch: HostBatch
                     ) -> tuple[DecodeGraphs | VerifyGraphs | None, int | None]:
        """(graphs, bucket) that replay this step: the decode graphs for a decode step, a
        verify step's (every request verifying the same k drafts), if a bucket fits it;
        (None, None) when the step runs eagerly."""
        k = max(batch.query_lens) - 1
        graphs = self.cuda_graphs if k == 0 else self.verify_graphs.get(k)
        if graphs is None or (k > 0 and not all(len(s.spec_token_ids) == k
                                                for s in out.scheduled)):
            return None, None
        bucket = graphs.fits(batch)
        return (graphs, bucket) if bucket is not None else (None, None)

    def _verify_ahead(self, out: SchedulerOutput, verify: list[tuple[ScheduledRequest, int]],
                      hidden: torch.Tensor, result: StepResult, k: int,
                      may_overlap: bool) -> bool:
        """A uniform greedy verify step with acceptance and drafting queued on the device
        (engine/spec/verify_ahead.py); the next verify forward is launched from the device drafts
        as soon as the emitted tokens are known. False (nothing launched) when it does not
        apply; the general verify + propose path runs then."""
        items = [(s.request, s.spec_token_ids, last) for s, last in verify]
        launched = self.verify_ahead.launch(items, [s.start_pos for s, _ in verify], hidden, k)
        if launched is None:
            return False
        result.sampled.update(launched.emitted())
        nxt = self._ahead_verify(out, result.sampled, k) if may_overlap else None
        if nxt is not None:
            self._launch_verify(nxt, k, launched.drafts_dev)
        result.drafts = launched.drafts(result.sampled)
        if nxt is not None:
            self.ahead.confirm(verify_ids(out, nxt[1], result.drafts, k))
        return True

    def _ahead_batch(self, out: SchedulerOutput, num_spec: int = 0,
                     catch_up: bool = False) -> HostBatch | None:
        """The next decode batch to launch early, when this is a plain decode step. With
        speculation only if it drafts nothing (drafts make the next step a verify) and its MTP
        catch-up, if kept, runs before the launch (catch_up): a catch-up after the host sync
        would read hidden rows that the launched graph overwrote."""
        if self.ahead is None:
            return None
        if self.spec is not None and (num_spec > 0 or (self.spec.spec.maintain_mtp_kv
                                                       and not catch_up)):
            return None
        if any(s.num_new_tokens != 1 or s.spec_token_ids for s in out.scheduled):
            return None
        return self.ahead.next_batch(out.scheduled)

    def _ahead_verify(self, out: SchedulerOutput, sampled: dict[str, list[int]], k: int
                      ) -> tuple[HostBatch, list[int]] | None:
        """After a uniform verify step: the next step's verify batch if every request goes on
        with k drafts (same batch, each at its new length, [last emitted token, k drafts]),
        and the last emitted tokens; None when a request may not (cap_k, missing blocks)."""
        if self.ahead is None or k <= 0 or not all(s.spec_token_ids for s in out.scheduled):
            return None
        if self.leader is not None:  # launched from the draft graphs' device drafts: not TP
            return None
        bs, q = self.block_size, k + 1
        pos, slots, seqs, tables, last = [], [], [], [], []
        for s in out.scheduled:
            req, emitted = s.request, sampled[s.request.request_id]
            start = s.start_pos + len(emitted)
            if self.spec.cap_k(req, k, emitted) != k or (start + k) // bs >= len(req.block_table):
                return None
            pos += range(start, start + q)
            slots += [req.block_table[p // bs] * bs + p % bs for p in range(start, start + q)]
            seqs.append(start + q)
            tables.append(req.block_table[:-(-(start + q) // bs)])
            last.append(emitted[-1])
        B = len(out.scheduled)
        ids = [-1] * (B * q)  # the drafts come from the device (_launch_verify)
        ids[::q] = last
        return HostBatch(ids, pos, slots, [q] * B, seqs, tables, bs), last

    def _launch_verify(self, nxt: tuple[HostBatch, list[int]], k: int,
                       drafts: torch.Tensor) -> None:
        """The next verify forward: its input ids [B, k + 1] are each request's last emitted
        token (staged from the host with the other inputs: no sync) then its drafts [B, k],
        still on the device (copied into the graph's input buffer)."""
        self.ahead.launch(nxt[0], drafts, self.verify_graphs.get(k))

    def _may_catch_up_early(self, out: SchedulerOutput, num_spec: int) -> bool:
        """Whether this step's MTP catch-up can run from the sampler's device ids: a plain
        decode step (every request samples its one token, the next token of its position)
        that drafts nothing, with the MTP KV kept and static drafting there to run it."""
        spec = self.spec
        if spec is None or num_spec > 0 or not spec.spec.maintain_mtp_kv:
            return False
        return spec.draft_graphs is not None and all(
            s.num_new_tokens == 1 and not s.spec_token_ids and s.samples for s in out.scheduled)

    def _sample(self, plain: list[tuple[ScheduledRequest, int]], hidden: torch.Tensor,
                result: StepResult, ahead: HostBatch | None = None,
                catch_up: bool = False) -> bool:
        """One token per request from its last row's logits (no drafts to verify). Before
        the host reads the sampled ids, from the device ids: with `catch_up` the MTP catch-up,
        then with `ahead` the next decode forward (see _before_sync). Returns whether the
        catch-up ran (the caller then skips its own)."""
        # a decode step where every row samples takes hidden as is (no gather)
        # in the weights' dtype: the sampler converts only what it must (greedy rows take
        # the argmax as is; float32 [B, V] copies cost a kernel per step)
        logits = self.model.compute_logits(rows_of(hidden, [row for _, row in plain]),
                                           as_float=False)
        sampling = [s.request for s, _ in plain]
        states = [self._state(r) for r in sampling]
        hook, caught_up = self._before_sync(plain, hidden, ahead, catch_up)
        sample = self.sampler(logits, sampling, states, before_sync=hook)
        if ahead is not None:
            self.ahead.confirm(sample.token_ids)
        for i, req in enumerate(sampling):
            result.sampled[req.request_id] = [sample.token_ids[i]]
            if sample.logprobs[i] is not None:
                result.logprobs[req.request_id] = sample.logprobs[i]
        return bool(caught_up)

    def _before_sync(self, plain: list[tuple[ScheduledRequest, int]], hidden: torch.Tensor,
                     ahead: HostBatch | None, catch_up: bool
                     ) -> tuple[Callable[[torch.Tensor], None] | None, list[bool]]:
        """The sampler's before_sync hook and a list it marks once the catch-up ran. Stream
        order matters: the catch-up copies this step's hidden rows (a decode graph's output
        buffer) before the forward launched ahead replays that graph and overwrites them. If
        the catch-up does not fit, nothing is launched ahead: the late catch-up reads them."""
        caught_up: list[bool] = []
        if ahead is None and not catch_up:
            return None, caught_up
        requests = [s.request for s, _ in plain]
        starts = [s.start_pos for s, _ in plain]  # each request's position this step

        def hook(ids: torch.Tensor) -> None:
            if catch_up and self.spec.catch_up_on_device(requests, starts, hidden, ids):
                caught_up.append(True)
            if ahead is None or (catch_up and not caught_up):
                return
            if self.leader is not None:  # the followers launch it too, with rank 0's ids
                graphs = self.cuda_graphs
                if graphs is not None and graphs.fits(ahead) is None:
                    return  # DecodeAhead.launch would launch nothing, while they ran it
                self.leader.launch_ahead(ahead, graphed=graphs is not None)
                ids = parallel.ids_from_rank0(ids, self.model.tp)
            self.ahead.launch(ahead, ids)

        return hook, caught_up

    def _draft_jobs(self, out: SchedulerOutput, ends: list[int],
                    sampled: dict[str, list[int]], k: int) -> list[DraftJob]:
        """MTP catch-up rows of every scheduled request: each computed position whose next
        token is known now (the accepted prefix of a verify, all of a prefill chunk)."""
        jobs: list[DraftJob] = []
        for i, s in enumerate(out.scheduled):
            req = s.request
            first_row = ends[i] - s.num_new_tokens
            if not s.samples:  # a prefill chunk: the next tokens are prompt tokens
                nxt = req.all_token_ids[s.start_pos + 1:s.start_pos + s.num_new_tokens + 1]
                jobs.append(DraftJob(req, s.start_pos, nxt, 0, first_row, s.num_new_tokens))
                continue
            emitted = sampled[req.request_id]
            nxt = emitted if s.spec_token_ids else s.token_ids[1:] + emitted[:1]
            jobs.append(DraftJob(req, s.start_pos, nxt, self.spec.cap_k(req, k, emitted),
                                 first_row, s.num_new_tokens))
        return jobs

    @torch.inference_mode()
    def propose_remote(self, req: Request, prenorm: torch.Tensor, k: int) -> list[int]:
        """Decode role, when a prefilled request's KV has landed: draft from the prefill
        worker's last hidden state (pre-norm, [H]) and the first token, at position L - 1."""
        if self.spec is None or not req.output_token_ids:
            return []
        h = self.model.norm(prenorm.to(self.device, self.model.embed_tokens.weight.dtype)[None])
        job = DraftJob(req, req.num_prompt_tokens - 1, [req.output_token_ids[0]],
                       self.spec.cap_k(req, k, []), 0)
        if job.k == 0:
            return []
        return self.spec.propose([job], h, {req.request_id: self._state(req)},
                                 share_hidden=True).get(req.request_id, [])

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (all layers, K and V) src -> dst; one region each (every rank in
        its own cache with TP)."""
        if self.leader is not None:
            self.leader.copy_blocks(pairs)
        for src, dst in pairs:
            self.kv_cache[dst].copy_(self.kv_cache[src])
