"""The one request object. Its status only moves forward, and only the scheduler moves it.

Lifecycle:  WAITING -> RUNNING <-> PREEMPTED(back to WAITING queue) -> FINISHED_*
A decode worker admits a disaggregated request as WAITING_FOR_KV: its prompt blocks are
allocated but filled by a remote read, not computed; once the read lands the scheduler
moves it to RUNNING with num_computed_tokens = prompt length.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.engine.core.outputs import PromptLogprob
from pdserve.engine.core.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_KV = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 10  # EOS, stop token or stop string
    FINISHED_LENGTH = 11  # max_tokens or context length
    FINISHED_ABORTED = 12  # cancelled by the caller or failed

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in block_table
    num_cached_tokens: int = 0  # of those, tokens that came from the prefix cache
    num_preemptions: int = 0
    parent_id: str | None = None  # n > 1: siblings wait for the leader's prompt, then hit its cached blocks
    hold_blocks_on_finish: bool = False  # prefill role: keep blocks pinned for a remote reader
    stop_reason: str | int | None = None  # the stop string or token that ended it
    # per-request sampler state kept incrementally (token id -> count in the output)
    output_token_counts: dict[int, int] = field(default_factory=dict)
    # logprobs per output token: (chosen logprob, [(token, logprob), ...top-N])
    output_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # with sampling_params.prompt_logprobs: entry i is prompt token i + 1's given the tokens
    # before it, filled chunk by chunk during prefill
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt: must contain at least one token")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def is_prefill(self) -> bool:
        """True while the prompt (or a recompute after preemption) is still being computed."""
        return self.num_computed_tokens < self.num_tokens - 1

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.output_token_counts[token_id] = self.output_token_counts.get(token_id, 0) + 1
