"""Delta: what the router streams back per completion (router/dispatch.py makes them from
the workers' messages; router/responses.py and router/grpc_server.py render them)."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.engine.core.outputs import PromptLogprob
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto.convert import logprob_from_proto
from pdserve.router.metrics import StageTimes


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
    stop_reason: str | int | None = None  # vLLM's: the stop string or token that ended it
    completion_tokens: int = 0  # set on the last delta
    cached_tokens: int = 0
    # on the first delta, with prompt_logprobs: prompt token i + 1's given tokens 0..i
    prompt_logprobs: list[PromptLogprob] | None = None
    trace: Trace | None = None  # on the last delta

    def absorb(self, later: Delta) -> None:
        """Take the same completion's next delta in (self is not its last): one delta, so one
        chunk to the client, where the router had fallen behind its workers."""
        self.text += later.text
        self.token_ids += later.token_ids
        self.logprobs += later.logprobs
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        self.finish_reason, self.stop_reason, self.trace = \
            later.finish_reason, later.stop_reason, later.trace
        self.completion_tokens, self.cached_tokens = later.completion_tokens, later.cached_tokens


def coalesced(items: list[object]) -> list[object]:
    """Queue items (deltas, and anything else kept in place) with each run of adjacent deltas
    of one completion folded into its first: a router busier than its workers sends fewer,
    larger chunks rather than falling behind (vLLM's stream interval, chosen by load)."""
    if len(items) < 2:  # the usual case, once per token: nothing to fold
        return items
    out: list[object] = []
    for item in items:
        last = out[-1] if out else None
        if isinstance(item, Delta) and isinstance(last, Delta) and last.index == item.index \
                and not last.finish_reason:
            last.absorb(item)
        else:
            out.append(item)
    return out


@dataclass(frozen=True)
class Trace:
    """One completion's path and time across the split (the router's view; its stages add
    up to e2e): the gRPC face returns it, --log-requests logs it as a JSON line."""

    request_id: str
    index: int
    prefill_worker: str  # "" when the decode worker prefilled it
    decode_worker: str
    retries: int
    stages: StageTimes
    e2e: float

    def to_json(self) -> dict:
        ms = {k: round(v * 1e3, 3) for k, v in dataclasses.asdict(self.stages).items()}
        return {"request_id": self.request_id, "index": self.index,
                "prefill_worker": self.prefill_worker, "decode_worker": self.decode_worker,
                "retries": self.retries, "stages_ms": ms, "e2e_ms": round(self.e2e * 1e3, 3)}

    def to_proto(self) -> pb.RequestTrace:
        return pb.RequestTrace(prefill_worker=self.prefill_worker,
                               decode_worker=self.decode_worker, retries=self.retries,
                               e2e=self.e2e, **dataclasses.asdict(self.stages))


def logprobs_of(msgs: Sequence[pb.TokenLogprob]) -> list[tuple[int, float, list[tuple[int, float]]]]:
    return [(lp.token_id, *logprob_from_proto(lp)) for lp in msgs]
