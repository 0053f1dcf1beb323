"""What the engine hands back: a request's incremental output after each step, and the
engine's running counters (engine/llm_engine.py fills both)."""
from __future__ import annotations

from dataclasses import dataclass, field

# (token id, logprob) of the top N at a position
TopLogprobs = list[tuple[int, float]]
# prompt token i + 1 given tokens 0..i: (its id, its logprob, the top N there, its rank = 1 +
# how many vocabulary entries score higher)
PromptLogprob = tuple[int, float, TopLogprobs, int]


@dataclass
class RequestOutput:
    """Incremental output of one request after a step."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    new_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    hidden: object | None = None  # torch.Tensor [hidden] pre-norm, when the step kept it
    # on a request's first output, with prompt_logprobs: one entry per prompt token after the
    # first
    prompt_logprobs: list[PromptLogprob] | None = None
    # on the last output: the stop string or stop token that ended it (vLLM's stop_reason;
    # None for EOS, length or abort)
    stop_reason: str | int | None = None


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    # seconds per step phase, summed: schedule, launch (inputs + forward launch), sample
    # (logits + sampling, incl. waiting for the GPU), draft, update, postprocess
    host_s: dict[str, float] = field(default_factory=dict)

    def add_time(self, phase: str, seconds: float) -> None:
        self.host_s[phase] = self.host_s.get(phase, 0.0) + seconds
