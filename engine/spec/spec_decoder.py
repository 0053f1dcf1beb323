"""MTP speculative decoding: configuration, acceptance rules, and the draft/verify driver.

One engine step with speculation (the runner calls into SpecDecoder):

    verify   the target runs [last token, d1..dk] of each request as one varlen batch
             (query_len k+1, the chunked-prefill path) and decides, per request, how many
             drafts to accept: n in 0..k, plus one token of its own (the correction or bonus)
    catch up the MTP layer runs over every position the target computed this step whose
             next token is now known (accepted rows of a verify, a prefill chunk, a plain
             decode): input (target hidden at t, token t+1) at position t. This writes the
             MTP layer's KV for those positions, and the last row's output drafts d1 for the
             next step
    chain    k-1 more MTP steps, one token each: (previous MTP output, previous draft) at the
             next position -> the next draft

Rollback. Rejected positions are never counted: the scheduler advances num_computed_tokens
by 1 + n, so the target's KV slots of rejected drafts (and the MTP slots the chain wrote past
the accepted prefix) lie beyond the request's computed length. Nobody reads a slot beyond it
(attention reads positions < seq_len), and the next verify / catch-up overwrites them before
they are counted. A block enters the prefix cache only once all its positions are counted.

Acceptance. Greedy requests accept while draft == argmax of the target (exact: the output
equals non-speculative greedy decoding token for token). Random requests use rejection
sampling: draft x drawn from q is kept with probability min(1, p(x) / q(x)); on the first
rejection the token is drawn from norm(max(0, p - q)); after k acceptances a bonus token is
drawn from p. The emitted tokens are distributed exactly as the target's sampling (p is the
sampler's own processed distribution: temperature, top-k/p, min-p).

Grammars (structured outputs). Drafts are made without the grammar; verification masks each
verify row of a grammar request with the matcher's state after the drafts before it
(GrammarState.fill_drafts), so a forbidden draft is never its row's masked argmax (greedy) and
has target probability 0 (rejection sampling): the output is the non-speculative one. A draft
that ends the grammar (a stop token) is the last token emitted. The device-side verify of
verify_ahead.py takes no grammar request (its argmax is unmasked).

Known limits: requests with penalties, a logit_bias or logprobs are not drafted for (their
MTP KV is kept current, they decode one token per step); the MTP KV at the last position of a
prefix-cache hit was computed with the original request's next token (affects acceptance,
never output).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdserve.engine.core.config import SpecConfig
from pdserve.engine.core.request import Request
from pdserve.engine.dist import parallel
from pdserve.engine.exec.device_io import rows_of
from pdserve.engine.exec.sampler import SAMPLING_EPS, Sampler, SamplerState, mix_seed
from pdserve.engine.spec.draft_graphs import DraftGraphs, DraftRow
from pdserve.engine.spec.mtp_plan import ChainSteps, MTPPlan, tp_draft
from pdserve.engine.structured.matcher import apply_bitmask, host_bitmask

_DRAFT_SALT = 0x6D7470  # draft-sampling generator seed salt ("mtp")


@dataclass
class SpecStats:
    """Monotonic counters, exported as pdserve:spec_decode_* by worker/metrics.py."""

    num_drafts: int = 0  # verify events (a request with >= 1 draft in a step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos += [0] * (
                num_draft_tokens - len(self.num_accepted_tokens_per_pos))
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / max(1, self.num_draft_tokens)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify: accepted drafts + the target's own token."""
        return 1.0 + self.num_accepted_tokens / max(1, self.num_drafts)


# -- acceptance rules (pure functions) ------------------------------------------------------------

def greedy_accept(draft_ids: list[int], target_argmax: list[int]) -> list[int]:
    """Tokens emitted for drafts d[0..k) given the target's argmax at the k+1 verify rows."""
    n = 0
    while n < len(draft_ids) and draft_ids[n] == target_argmax[n]:
        n += 1
    return draft_ids[:n] + [target_argmax[n]]


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor,
                     draft_ids: torch.Tensor, uniforms: torch.Tensor,
                     noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling for B sequences with k drafts each (vectorised).

    target_probs [B, k+1, V] (p at each verify row), draft_probs [B, k, V] (the q each draft
    was drawn from), draft_ids [B, k] int64, uniforms [B, k] in [0, 1), noise [B, k+1, V]
    Exp(1). Returns num_accepted [B] (the leading run of accepted drafts) and tokens [B, k+1]:
    row b emits tokens[b, :num_accepted[b] + 1]. The recovered token at row j is an
    exponential race over the residual max(0, p_j - q_j) (row k: over p_k, the bonus).
    """
    B, k = draft_ids.shape
    p_x = target_probs[:, :k].gather(-1, draft_ids[..., None])[..., 0]  # [B, k]
    q_x = draft_probs.gather(-1, draft_ids[..., None])[..., 0]
    accept = uniforms * q_x < p_x  # P(accept) = min(1, p/q)
    num_accepted = accept.to(torch.int64).cumprod(dim=-1).sum(dim=-1)  # [B]
    residual = torch.cat([(target_probs[:, :k] - draft_probs).clamp_min(0.0),
                          target_probs[:, k:]], dim=1)  # [B, k+1, V]
    # p == q leaves no residual; such a row cannot reject (u * q < p always), so any
    # fallback is unreachable: use p to stay well defined
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, target_probs, residual)
    recovered = (residual / noise).argmax(dim=-1)  # [B, k+1]; scaling never moves argmax
    cols = torch.arange(k + 1, device=draft_ids.device)
    padded = torch.cat([draft_ids, recovered[:, k:]], dim=1)
    tokens = torch.where(cols[None, :] < num_accepted[:, None], padded, recovered)
    return num_accepted, tokens


# -- the driver ------------------------------------------------------------------------------------

@dataclass
class DraftJob:
    """MTP rows of one request: positions start..start+m-1, whose target hidden states are
    rows first_row..first_row+m-1 of the hidden tensor handed to propose(), and the tokens
    that follow each position (m = len(next_tokens))."""

    request: Request
    start: int
    next_tokens: list[int]
    k: int  # drafts wanted after this catch-up (0: only write the MTP KV)
    first_row: int = 0
    rows: int = 0  # its rows in the step's hidden tensor (>= m; 0: unknown)

    @property
    def m(self) -> int:
        return len(self.next_tokens)


def _speculable(req: Request) -> bool:
    """Whether a request may be drafted for. A logit_bias (or allowed_token_ids, bad_words)
    request may not: greedy verify (and the device-side verify of verify_ahead.py, and the
    draft graphs) take the argmax of the unbiased target logits, so its tokens would differ
    from non-speculative decoding. It decodes one token per step through the sampler, which
    applies the bias (cap_k does the same for a request still short of its min_tokens: the
    sampler bans its EOS)."""
    p = req.sampling_params
    return not p.has_penalties and not p.has_logit_bias and not p.has_allowed \
        and not p.has_bad_words and p.logprobs is None


class SpecDecoder:
    """Verifies drafts against the target and drafts the next ones with the MTP head."""

    def __init__(self, spec: SpecConfig, head: torch.nn.Module, model: torch.nn.Module,
                 kv_cache: torch.Tensor, block_size: int, sampler: Sampler,
                 max_model_len: int, eos_token_ids: tuple[int, ...] = (),
                 announce: Callable[[MTPPlan, bool], None] | None = None) -> None:
        """announce (tensor parallelism, rank 0: the Leader's mtp): called with each drafting
        pass's plan (and whether its hidden rows are rank 0's own) before running it, so
        the follower ranks run the same pass over their shards (engine/spec/mtp_plan.py)."""
        self.spec, self.head, self.model = spec, head, model
        self.announce = announce
        self.kv_cache, self.block_size, self.sampler = kv_cache, block_size, sampler
        self.max_model_len = max_model_len
        self.eos = frozenset(eos_token_ids)
        self.device = kv_cache.device
        head.use_draft_vocab(model, spec.draft_vocab, tuple(eos_token_ids))
        self.stats = SpecStats(num_accepted_tokens_per_pos=[0] * spec.num_speculative_tokens)
        self._q: dict[str, torch.Tensor] = {}  # request -> [k, V] draft distributions (random)
        self._gens: dict[str, torch.Generator] = {}
        self.draft_graphs: DraftGraphs | None = None  # set by the runner (static drafting)

    def free_request(self, request_id: str) -> None:
        self._q.pop(request_id, None)
        self._gens.pop(request_id, None)

    def free_request_drafts(self, request_id: str) -> None:
        """Its drafts are greedy from now on: no draft distribution to keep."""
        self._q.pop(request_id, None)

    # -- verify ------------------------------------------------------------------------------
    def verify(self, items: list[tuple[Request, list[int], int]], hidden: torch.Tensor,
               states: list[SamplerState]) -> dict[str, list[int]]:
        """items: (request, its scheduled drafts, index of its last row in hidden); the k+1
        verify rows end there. Returns the emitted tokens per request (1 to k+1 of them)."""
        rows = [r for _, drafts, last in items for r in range(last - len(drafts), last + 1)]
        logits = self.model.compute_logits(rows_of(hidden, rows))
        logits, limits = self._mask_grammars(items, states, logits)
        out: dict[str, list[int]] = {}
        greedy = [i for i, (req, _, _) in enumerate(items)
                  if req.sampling_params.temperature < SAMPLING_EPS]
        argmax = self.model.argmax(logits).tolist() if greedy else []
        offset = 0
        for i, (req, drafts, _) in enumerate(items):
            k = len(drafts)
            span = slice(offset, offset + k + 1)
            offset += k + 1
            if req.sampling_params.temperature < SAMPLING_EPS:
                tokens = (drafts + [argmax[span][k]] if self.spec.forced_acceptance
                          else greedy_accept(drafts, argmax[span]))
            else:
                tokens = self._verify_random(req, drafts, logits[span], states[i])
            accepted = len(tokens) - 1
            if limits[i] is not None and limits[i][1] and accepted >= limits[i][0]:
                accepted = limits[i][0]  # the grammar ended at this draft: nothing follows
                tokens = tokens[:accepted]
            self.stats.record(k, accepted)
            out[req.request_id] = tokens
        return out

    @staticmethod
    def _mask_grammars(items: list[tuple[Request, list[int], int]], states: list[SamplerState],
                       logits: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, bool] | None]]:
        """logits [R, V] of the verify rows, each grammar request's k + 1 rows masked by its
        matcher after the drafts before them; per item, (drafts the grammar accepts, whether
        the last of them ends it), or None without a grammar. Unchanged without grammars."""
        if all(st.grammar is None for st in states):
            return logits, [None] * len(items)
        bitmask = host_bitmask(logits.shape[0], logits.shape[-1])  # [R, W], all allowed
        limits: list[tuple[int, bool] | None] = []
        row = 0
        for (_, drafts, _), st in zip(items, states):
            limits.append(None if st.grammar is None else st.grammar.fill_drafts(bitmask, row,
                                                                                  drafts))
            row += len(drafts) + 1
        return apply_bitmask(logits, bitmask), limits

    def _verify_random(self, req: Request, drafts: list[int], logits: torch.Tensor,
                       state: SamplerState) -> list[int]:
        k = len(drafts)
        p = self.sampler.probs_after_processing(logits, [req] * (k + 1), [state] * (k + 1))
        q = self._q.get(req.request_id)
        if q is None or q.shape[0] < k:
            raise RuntimeError(f"request {req.request_id}: no draft distribution for its "
                               f"{k} drafts")
        base = len(req.output_token_ids)  # output position of the first emitted token
        uniforms, noise = [], []
        for j in range(k + 1):  # per-position generators: reproducible whatever the batch
            gen = state.generator_at(base + j)
            uniforms.append(torch.rand((), generator=gen, device=self.device))
            noise.append(torch.empty(p.shape[-1], device=self.device).exponential_(generator=gen))
        noise_t = torch.stack(noise).clamp_min_(torch.finfo(torch.float32).tiny)
        ids = torch.tensor([drafts], dtype=torch.int64, device=self.device)
        if self.spec.forced_acceptance:
            bonus = int((p[k] / noise_t[k]).argmax())
            return drafts + [bonus]
        n, tokens = rejection_sample(p[None], q[None, :k].to(p.dtype), ids,
                                     torch.stack(uniforms[:k])[None], noise_t[None])
        n = int(n[0])
        return tokens[0, :n + 1].tolist()

    # -- draft -------------------------------------------------------------------------------
    def cap_k(self, req: Request, k: int, emitted: list[int]) -> int:
        """Drafts worth making for `req` after it appends `emitted`: none for requests that
        cannot be verified exactly, that will finish, or past max_tokens / the context /
        the blocks the scheduler reserved (the chain writes MTP KV up to position N + k - 3)."""
        if k <= 0 or not _speculable(req):
            return 0
        p = req.sampling_params
        if p.has_grammar and self.spec.forced_acceptance:  # would emit what the grammar forbids
            return 0
        if not p.ignore_eos and any(t in self.eos for t in emitted):
            return 0
        if any(t in p.stop_token_ids for t in emitted):
            return 0
        n_tokens = req.num_tokens + len(emitted)
        n_out = len(req.output_token_ids) + len(emitted)
        if n_out < p.min_tokens:  # its next tokens go through the sampler's EOS ban
            return 0
        room = len(req.block_table) * self.block_size - n_tokens + 2
        return max(0, min(k, p.max_tokens - n_out - 1, self.max_model_len - n_tokens, room))

    def propose(self, jobs: list[DraftJob], hidden: torch.Tensor,
                states: dict[str, SamplerState],
                before_sync: Callable[[torch.Tensor], object] | None = None,
                share_hidden: bool = False) -> dict[str, list[int]]:
        """Catch-up pass over all jobs' rows (hidden: the target's normed hidden states),
        then the chain for jobs with k > 0. Returns drafts per request. before_sync: see
        DraftGraphs.propose (called only when the static path drafts). share_hidden (TP):
        `hidden` is rank 0's own (a shipped state), not the last forward's: the followers
        get its rows from rank 0."""
        jobs = [j for j in jobs if j.m > 0]
        if not jobs:
            return {}
        static = self._propose_static(jobs, hidden, before_sync)
        if static is not None:
            return static
        plan = self._plan(jobs)
        if self.announce is not None:
            self.announce(plan, share_hidden)
        rows = hidden[torch.tensor(plan.rows, device=hidden.device)]
        if share_hidden and self.model.tp is not None:
            rows = parallel.from_rank0(rows.to(self.model.embed_tokens.weight.dtype),
                                       self.model.tp.group)
        qs: dict[str, list[torch.Tensor]] = {j.request.request_id: [] for j in jobs if j.k > 0}

        def draft(g: torch.Tensor, active: list[int]) -> torch.Tensor:
            drafting = [jobs[a] for a in active]
            if self.model.tp is None:
                return self._draw(self.head.draft_logits(self.model, g), drafting, states, qs)
            return tp_draft(self.head, self.model, g, all(plan.greedy[a] for a in active),
                            lambda logits, _: self._draw(logits, drafting, states, qs), active)

        steps = plan.run(self.head, self.model, self.kv_cache, rows, draft)
        if not steps:
            return {}
        for rid, q in qs.items():  # the draft distributions of sampled drafts
            if q:
                self._q[rid] = torch.stack(q)
            else:
                self._q.pop(rid, None)
        return _drafts_of(jobs, steps)

    def _plan(self, jobs: list[DraftJob]) -> MTPPlan:
        """The drafting pass of `jobs` as data (what a TP leader announces)."""
        return MTPPlan(
            [t for j in jobs for t in j.next_tokens],
            [r for j in jobs for r in range(j.first_row, j.first_row + j.m)],
            [j.start for j in jobs], [j.m for j in jobs], [j.request.block_table for j in jobs],
            [j.k for j in jobs],
            [j.request.sampling_params.temperature < SAMPLING_EPS for j in jobs],
            self.block_size)

    def catch_up_on_device(self, requests: list[Request], starts: list[int],
                           hidden: torch.Tensor, ids: torch.Tensor) -> bool:
        """The k = 0 catch-up of a plain decode step from the sampler's device ids [B]
        (request i: hidden row i, position starts[i]), launched before the host reads them;
        the runner then skips propose() for the step. False when static drafting is off or
        does not fit, or the MTP KV is not maintained (then propose() runs as before)."""
        if self.draft_graphs is None or not self.spec.maintain_mtp_kv:
            return False
        if not self.draft_graphs.catch_up_from_device(requests, starts, hidden, ids):
            return False
        for req in requests:
            self._q.pop(req.request_id, None)  # as _propose_static: no drafts, no distribution
        return True

    def _propose_static(self, jobs: list[DraftJob], hidden: torch.Tensor,
                        before_sync: Callable[[torch.Tensor], object] | None = None
                        ) -> dict[str, list[int]] | None:
        """The same proposal through DraftGraphs when the step is uniform (every job has q
        rows laid out in order and wants the same k) and every drafting request is greedy;
        None otherwise (the dynamic path runs)."""
        if self.draft_graphs is None:
            return None
        q, k = jobs[0].rows, jobs[0].k
        if any(j.rows != q or j.k != k or j.first_row != i * q for i, j in enumerate(jobs)):
            return None
        if k > 0 and any(j.request.sampling_params.temperature >= SAMPLING_EPS for j in jobs):
            return None
        rows = [DraftRow(j.request, j.start, j.next_tokens) for j in jobs]
        drafts = self.draft_graphs.propose(rows, hidden, q, k, before_sync if k > 0 else None)
        if drafts is None:
            return None
        for j in jobs:
            self.free_request_drafts(j.request.request_id)
        return {j.request.request_id: d for j, d in zip(jobs, drafts) if d}

    def _draw(self, logits: torch.Tensor, jobs: list[DraftJob], states: dict[str, SamplerState],
              qs: dict[str, list[torch.Tensor]]) -> torch.Tensor:
        """One draft per row [n] (on the device): argmax for greedy requests; for random ones
        a draw from q, the request's processed MTP distribution (kept in qs for the
        acceptance test)."""
        tokens = self.model.argmax(logits)
        for i, job in enumerate(jobs):
            req = job.request
            if req.sampling_params.temperature < SAMPLING_EPS:
                continue
            state = states[req.request_id]
            q = self.sampler.probs_after_processing(logits[i:i + 1], [req], [state])[0]
            gen = self._gens.get(req.request_id)
            if gen is None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(mix_seed(state.base_seed, _DRAFT_SALT))
                self._gens[req.request_id] = gen
            tokens[i] = torch.multinomial(q, 1, generator=gen)[0]
            qs[req.request_id].append(q)
        return tokens


def _drafts_of(jobs: list[DraftJob], steps: ChainSteps) -> dict[str, list[int]]:
    """Drafts per request from the chain's steps (ids still on the device until here: one
    host sync for all k steps)."""
    host = torch.cat([t for _, t in steps]).tolist()
    drafts: dict[str, list[int]] = {jobs[a].request.request_id: [] for a in steps[0][0]}
    offset = 0
    for active, _ in steps:
        for i, a in enumerate(active):
            drafts[jobs[a].request.request_id].append(host[offset + i])
        offset += len(active)
    return drafts
