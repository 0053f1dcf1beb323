"""Conversions between wire messages (proto/pdserve.proto) and engine types."""
from __future__ import annotations

from pdserve.engine.core.outputs import PromptLogprob
from pdserve.engine.core.sampling_params import SamplingParams, StructuredOutput
from pdserve.proto import pdserve_pb2 as pb

_OPTIONAL = ("n", "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed",
             "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs", "min_tokens",
             "prompt_logprobs", "cache_salt")


def params_to_proto(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
                            ignore_eos=p.ignore_eos, transfer_failure_policy=p.transfer_failure_policy,
                            keep_special_tokens=not p.skip_special_tokens,
                            include_stop_str_in_output=p.include_stop_str_in_output,
                            priority=p.priority)
    for name in _OPTIONAL:
        value = getattr(p, name)
        if value is not None:
            setattr(msg, name, value)
    if p.logit_bias:  # both halves of the split sample (P token 0, D the rest): both need it
        msg.logit_bias.update(p.logit_bias)
    if p.structured is not None:  # so does the grammar
        msg.structured_output.CopyFrom(structured_to_proto(p.structured))
    if p.allowed_token_ids is not None:  # and the allow-list
        msg.allowed_token_ids.extend(p.allowed_token_ids)
    for seq in p.bad_words_token_ids or ():  # and the bad words
        msg.bad_words.add(token_ids=seq)
    return msg


def structured_to_proto(s: StructuredOutput) -> pb.StructuredOutput:
    kind = s.kind
    if kind == "choice":
        return pb.StructuredOutput(choice=pb.ChoiceList(choices=list(s.choice)))
    name = "json_schema" if kind == "json" else kind
    return pb.StructuredOutput(**{name: getattr(s, kind)})


def structured_from_proto(msg: pb.StructuredOutput) -> StructuredOutput | None:
    """None when no kind is set; raises InvalidRequestError naming the field when a set kind
    is empty (StructuredOutput's own checks)."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "choice":
        return StructuredOutput(choice=tuple(msg.choice.choices))
    if kind == "json_object" and not msg.json_object:
        return None  # json_object = false: off
    return StructuredOutput(**{"json" if kind == "json_schema" else kind: getattr(msg, kind)})


def params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Validates (raises InvalidRequestError naming the field)."""
    kwargs: dict[str, object] = {name: getattr(msg, name) for name in _OPTIONAL
                                 if msg.HasField(name)}
    # floats travel as float32: round-trip to the nearest short decimal so 0.9 stays 0.9
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        if name in kwargs:
            kwargs[name] = float(f"{kwargs[name]:.6g}")
    if msg.logit_bias:  # float32 on the wire too; NaN / range / count checks are SamplingParams'
        kwargs["logit_bias"] = {int(t): float(f"{b:.6g}") for t, b in msg.logit_bias.items()}
    if msg.HasField("structured_output"):
        kwargs["structured"] = structured_from_proto(msg.structured_output)
    if msg.allowed_token_ids:
        kwargs["allowed_token_ids"] = tuple(msg.allowed_token_ids)
    if msg.bad_words:
        kwargs["bad_words_token_ids"] = tuple(tuple(q.token_ids) for q in msg.bad_words)
    return SamplingParams(stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids),
                          ignore_eos=msg.ignore_eos,
                          skip_special_tokens=not msg.keep_special_tokens,
                          include_stop_str_in_output=msg.include_stop_str_in_output,
                          transfer_failure_policy=msg.transfer_failure_policy or "retry",
                          priority=msg.priority,
                          **kwargs)  # type: ignore[arg-type]


def logprob_to_proto(token_id: int, lp: tuple[float, list[tuple[int, float]]]) -> pb.TokenLogprob:
    chosen, top = lp
    return pb.TokenLogprob(token_id=token_id, logprob=chosen,
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in top])


def logprobs_to_proto(lps: list[tuple[int, float, list[tuple[int, float]]]]
                      ) -> list[pb.TokenLogprob]:
    """[(token id, logprob, [(top id, logprob), ...])] (the router's deltas)."""
    return [logprob_to_proto(token, (chosen, top)) for token, chosen, top in lps]


def logprob_from_proto(msg: pb.TokenLogprob) -> tuple[float, list[tuple[int, float]]]:
    return msg.logprob, [(t.token_id, t.logprob) for t in msg.top]


def prompt_logprobs_to_proto(lps: list[PromptLogprob]) -> list[pb.TokenLogprob]:
    """Prompt logprobs (engine/core/outputs.py PromptLogprob), each with its rank."""
    msgs = []
    for token, chosen, top, rank in lps:
        msg = logprob_to_proto(token, (chosen, top))
        msg.rank = rank
        msgs.append(msg)
    return msgs


def prompt_logprobs_from_proto(msgs) -> list[PromptLogprob]:
    """The inverse of prompt_logprobs_to_proto (msgs: a repeated TokenLogprob field)."""
    return [(m.token_id, *logprob_from_proto(m), m.rank) for m in msgs]


def set_stop_reason(msg: pb.DecodeOutput | pb.PrefillResult | pb.GenerateResponse,
                    reason: str | int | None) -> None:
    """The engine's stop reason (a stop string, a stop token id, or None) into msg's oneof."""
    if isinstance(reason, str):
        msg.stop_str = reason
    elif reason is not None:
        msg.stop_token_id = int(reason)


def stop_reason_from_proto(msg: pb.DecodeOutput | pb.PrefillResult) -> str | int | None:
    which = msg.WhichOneof("stop_reason")
    return None if which is None else getattr(msg, which)
