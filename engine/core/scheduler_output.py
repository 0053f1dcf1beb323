"""What one scheduling step hands the model runner (engine/core/scheduler.py builds it):
which requests compute which token range this step, and who was preempted. No torch."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.core.request import Request


@dataclass
class ScheduledRequest:
    """Compute tokens all_token_ids[start_pos : start_pos + num_new_tokens] of `request`;
    with speculation the last len(spec_token_ids) of the num_new_tokens are those drafts."""

    request: Request
    num_new_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)
    start_pos: int = field(init=False)  # num_computed_tokens when scheduled
    _samples: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # frozen at schedule time: update_from_output moves num_computed_tokens and num_tokens
        self.start_pos = self.request.num_computed_tokens
        num_real = self.num_new_tokens - len(self.spec_token_ids)
        self._samples = self.start_pos + num_real == self.request.num_tokens

    @property
    def samples(self) -> bool:
        """True iff this step reaches the request's last token, so its logits are sampled."""
        return self._samples

    @property
    def token_ids(self) -> list[int]:
        """The tokens to compute, drafts last (valid until update_from_output appends)."""
        num_real = self.num_new_tokens - len(self.spec_token_ids)
        # sliced from the two lists, not from all_token_ids: that would copy the whole
        # context (thousands of ids) for every request on every decode step
        req, lo = self.request, self.start_pos
        hi, n_prompt = lo + num_real, len(self.request.prompt_token_ids)
        if lo >= n_prompt:
            real = req.output_token_ids[lo - n_prompt:hi - n_prompt]
        elif hi <= n_prompt:
            real = req.prompt_token_ids[lo:hi]
        else:
            real = req.prompt_token_ids[lo:] + req.output_token_ids[:hi - n_prompt]
        return real + self.spec_token_ids


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
