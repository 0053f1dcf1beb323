"""Delta: what the router streams back per completion (router/dispatch.py makes them from
the workers' messages; router/responses.py and router/grpc_server.py render them)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.engine.core.outputs import PromptLogprob
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto.convert import logprob_from_proto


@dataclass
class Delta:
    """New output of one completion: text and tokens since the previous delta."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # per token: (token id, logprob, [(alternative id, logprob), ...]); an echoed prompt's
    # first token has logprob None
    logprobs: list[tuple[int, float | None, list[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0  # set on the last delta
    cached_tokens: int = 0
    # on the first delta, with prompt_logprobs: prompt token i + 1's given tokens 0..i
    prompt_logprobs: list[PromptLogprob] | None = None


def logprobs_of(msgs: Sequence[pb.TokenLogprob]) -> list[tuple[int, float, list[tuple[int, float]]]]:
    return [(lp.token_id, *logprob_from_proto(lp)) for lp in msgs]
