"""Prompt logprobs (SamplingParams.prompt_logprobs): in each prefill chunk, the logprob of
every prompt token given the tokens before it, its rank there (vLLM's: 1 + how many
vocabulary entries score higher) and the top N at its position -- what lm-eval-harness's
loglikelihood tasks read through /v1/completions with echo, and vLLM's prompt_logprobs.

A chunk of `q` rows at positions start..start+q-1 scores the prompt tokens at positions
start+1..start+q (those inside the prompt): row j's logits predict token start+j+1. The
first prompt token has no logprob. Such requests skip the prefix cache (the scheduler), so
every position is computed here once. Logits are made a slice of rows at a time: a 2,048-
token chunk over a 152K vocabulary would be 1.2 GB of float32 at once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.core.outputs import PromptLogprob
from pdserve.engine.core.scheduler_output import SchedulerOutput
from pdserve.engine.exec.device_io import rows_of

ROWS_PER_SLICE = 256


@dataclass(frozen=True)
class PromptJob:
    """One request's prompt rows to score this step: rows of the step's hidden states,
    targets[i] the prompt token row i predicts, top the N alternatives asked for."""

    request_id: str
    rows: list[int]
    targets: list[int]
    top: int


def plan_prompt_logprobs(out: SchedulerOutput, ends: list[int]) -> list[PromptJob]:
    """The scheduled requests with prompt_logprobs whose rows predict prompt tokens;
    ends[i]: one past the last row of scheduled request i."""
    jobs = []
    for i, s in enumerate(out.scheduled):
        req = s.request
        top = req.sampling_params.prompt_logprobs
        if top is None:
            continue
        prompt, start, q = req.prompt_token_ids, s.start_pos, s.num_new_tokens
        n = max(0, min(q, len(prompt) - 1 - start))  # rows whose next token is a prompt token
        if n:
            first = ends[i] - q
            jobs.append(PromptJob(req.request_id, list(range(first, first + n)),
                                  prompt[start + 1:start + 1 + n], top))
    return jobs


def _slices(job: PromptJob) -> list[tuple[list[int], list[int]]]:
    """(rows, targets) of each LM head call scoring `job`."""
    return [(job.rows[a:a + ROWS_PER_SLICE], job.targets[a:a + ROWS_PER_SLICE])
            for a in range(0, len(job.rows), ROWS_PER_SLICE)]


def logits_slices(jobs: list[PromptJob]) -> list[list[int]]:
    """The rows of each LM head call score_prompt_logprobs makes, in order (with tensor
    parallelism the followers join each call: engine/dist/lockstep.py)."""
    return [rows for job in jobs for rows, _ in _slices(job)]


def score_prompt_logprobs(model: torch.nn.Module, hidden: torch.Tensor,
                          jobs: list[PromptJob]) -> dict[str, list[PromptLogprob]]:
    """request id -> this step's prompt logprobs, in prompt order. hidden [T, H] (normed)."""
    return {job.request_id: [e for rows, targets in _slices(job)
                             for e in _score(model, hidden, rows, targets, job.top)]
            for job in jobs}


def _score(model: torch.nn.Module, hidden: torch.Tensor, rows: list[int], targets: list[int],
           top: int) -> list[PromptLogprob]:
    """One LM head call: rows' logprobs of their targets, ranks and top N."""
    logp = torch.log_softmax(model.compute_logits(rows_of(hidden, rows)), dim=-1)  # [R, V]
    want = torch.tensor(targets, dtype=torch.int64, device=logp.device)
    chosen = logp.gather(1, want[:, None])  # [R, 1]
    ranks = ((logp > chosen).sum(dim=-1) + 1).tolist()  # vLLM's rank: 1 = the top
    top_lp, top_ids = logp.topk(top, dim=-1) if top else (logp[:, :0], logp[:, :0].long())
    return [(t, c, [(int(i), v) for i, v in zip(ids, lps)], int(r))
            for t, c, lps, ids, r in zip(targets, chosen[:, 0].tolist(), top_lp.tolist(),
                                         top_ids.tolist(), ranks)]
