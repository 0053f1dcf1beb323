"""OpenAI request bodies -> validated core jobs (router/responses.py renders the answers).

Validation is explicit: every field is type-checked by hand and a bad one raises BadRequest
naming it (`param`), so wrong types give 400, never a 500. Sampling ranges are checked by
engine.core.sampling_params.SamplingParams, whose errors name the field too. Fields that
constrain the output (response_format, structured_outputs, tools) are router/structured.py's;
tool calls are parsed out of the text by router/tools.py.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.engine.core.sampling_params import (
    LOGIT_BIAS_MAX,
    LOGIT_BIAS_MAX_ENTRIES,
    InvalidRequestError,
    SamplingParams,
)
from pdserve.router.errors import BadRequest
from pdserve.router.frontend import CHAT_ROLES, Frontend, TemplateOptions
from pdserve.router.structured import (
    Check,
    ToolRequest,
    output_constraint,
    parse_tools,
    template_inputs,
    tool_calls_of,
)
from pdserve.router.tools import ToolFormat

MAX_N = 64
# a client's request id (HTTP X-Request-Id, gRPC request_id): logged, echoed, and part of the
# workers' request ids
REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
MAX_LOGPROBS = 20
_INT, _NUM, _STR, _BOOL = "an integer", "a number", "a string", "a boolean"
# a logit_bias key: a decimal token id, ASCII digits only ("-1", "1.5", " 1", "١" are not);
# ten digits bound int()'s work before the vocabulary check
_TOKEN_KEY = re.compile(r"[0-9]{1,10}")


@dataclass
class ParsedRequest:
    kind: str  # "completion" | "chat"
    model: str
    prompts: list[list[int]]  # token ids; completions may batch several prompts
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    # grammars to compile before dispatch, each with the field it came from (400 naming it)
    checks: list[Check] = field(default_factory=list)
    tool_format: ToolFormat | None = None  # chat with tools offered: parse calls out of text
    echo: bool = False  # completions: the prompt leads each choice's text (and logprobs)
    # completions, max_tokens 0 with echo (scoring a prompt: lm-eval's loglikelihood): the
    # engine makes one token, which the response leaves out (responses.py without_output)
    prompt_only: bool = False
    # vLLM's stream_options.continuous_usage_stats (with include_usage): usage in every chunk
    continuous_usage: bool = False
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs' "token_id:N"
    # vLLM's return_token_ids: each choice's output token ids and the prompt's, beside the text
    token_ids: bool = False
    # vLLM's prompt_logprobs field: the top N per prompt token, rendered in vLLM's shape
    prompt_logprobs: int | None = None
    # completions: each prompt as the client wrote it (None: sent as token ids), for echo
    prompt_texts: list[str | None] = field(default_factory=list)
    request_id: str | None = None  # vLLM's body field (X-Request-Id, when sent, wins)


def _get(body: dict, name: str, what: str, default: object = None) -> object:
    """body[name] checked against `what` (None / missing -> default)."""
    v = body.get(name)
    if v is None:
        return default
    if what == _INT and isinstance(v, float) and v.is_integer():
        v = int(v)  # 64.0 from a client's arithmetic: an integer, as vLLM's pydantic takes it
    ok = {_INT: isinstance(v, int) and not isinstance(v, bool),
          _NUM: isinstance(v, (int, float)) and not isinstance(v, bool)
          and math.isfinite(v),
          _STR: isinstance(v, str), _BOOL: isinstance(v, bool)}[what]
    if not ok:
        raise BadRequest(f"{name}: must be {what}, got {v!r}"[:300], param=name)
    return v


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's logit_bias: a JSON object whose keys are token ids as strings ("123") and
    whose values are biases in [-100, 100]. Each bad entry is a 400 naming logit_bias."""
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise BadRequest("logit_bias: must be an object mapping token ids to biases, got "
                         f"{type(bias).__name__}", param="logit_bias")
    if len(bias) > LOGIT_BIAS_MAX_ENTRIES:
        raise BadRequest(f"logit_bias: at most {LOGIT_BIAS_MAX_ENTRIES} entries, got {len(bias)}",
                         param="logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        where = f"logit_bias[{json.dumps(key[:40])}]"  # the key as the client sent it, cut short
        if not _TOKEN_KEY.fullmatch(key) or int(key) >= vocab_size:
            raise BadRequest(f"{where}: keys must be token ids, integers in [0, {vocab_size})",
                             param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not -LOGIT_BIAS_MAX <= value <= LOGIT_BIAS_MAX:  # NaN fails this too
            raise BadRequest(f"{where}: must be a number in [-100, 100], got {value!r}"[:300],
                             param="logit_bias")
        out[int(key)] = float(value)
    return out


def _sampling_kwargs(body: dict, vocab_size: int) -> dict:
    kw: dict[str, object] = {}
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        if body.get(name) is not None:
            kw[name] = _get(body, name, _NUM)
    for name in ("n", "top_k", "seed", "min_tokens", "priority"):
        if body.get(name) is not None:
            kw[name] = _get(body, name, _INT)
    if kw.get("n", 1) > MAX_N:
        raise BadRequest(f"n: must be <= {MAX_N}, got {kw['n']}", param="n")
    stop = body.get("stop")
    if isinstance(stop, str):
        kw["stop"] = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        kw["stop"] = tuple(stop)
    elif stop is not None:
        raise BadRequest("stop: must be a string or a list of strings", param="stop")
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise BadRequest("stop_token_ids: must be a list of integers", param="stop_token_ids")
        kw["stop_token_ids"] = tuple(ids)
    kw["ignore_eos"] = _get(body, "ignore_eos", _BOOL, False)
    kw["skip_special_tokens"] = _get(body, "skip_special_tokens", _BOOL, True)
    kw["include_stop_str_in_output"] = _get(body, "include_stop_str_in_output", _BOOL, False)
    bias = _logit_bias(body, vocab_size)
    if bias:
        kw["logit_bias"] = bias
    # vLLM's lists (their items: SamplingParams' checks; bad_words tokenized in _build_params)
    for name, items in (("bad_words", "non-empty strings"), ("allowed_token_ids", "token ids")):
        value = body.get(name)
        if value is not None:
            if not isinstance(value, list):
                raise BadRequest(f"{name}: must be a list of {items}", param=name)
            kw[name] = tuple(value)
    salt = _get(body, "cache_salt", _STR)  # non-empty, bounded: SamplingParams' check
    if salt is not None:
        kw["cache_salt"] = salt
    policy = _get(body, "transfer_failure_policy", _STR)
    if policy is not None:
        kw["transfer_failure_policy"] = policy
    return kw


def _stream_flags(body: dict) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous usage): vLLM's continuous_usage_stats counts only
    with include_usage, as vLLM reads it."""
    stream = _get(body, "stream", _BOOL, False)
    opts = body.get("stream_options")
    if opts is None:
        return stream, False, False
    if not isinstance(opts, dict):
        raise BadRequest("stream_options: must be an object", param="stream_options")
    if not stream:
        raise BadRequest("stream_options: only allowed when stream is true", param="stream_options")
    usage = _get(opts, "include_usage", _BOOL, False)
    continuous = _get(opts, "continuous_usage_stats", _BOOL, False)
    return stream, usage, usage and continuous


def _logprob_count(body: dict, name: str) -> int | None:
    """body[name]: None or a count of alternatives in [0, MAX_LOGPROBS]."""
    n = _get(body, name, _INT)
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise BadRequest(f"{name}: must be in [0, {MAX_LOGPROBS}], got {n}", param=name)
    return n


def _prompt_logprobs(body: dict, stream: bool) -> int | None:
    """vLLM's prompt_logprobs: N in [0, MAX_LOGPROBS]; not with stream (as vLLM refuses it)."""
    n = _logprob_count(body, "prompt_logprobs")
    if n is not None and stream:
        raise BadRequest("prompt_logprobs: not available with stream", param="prompt_logprobs")
    return n


def _truncated(body: dict, prompts: list[list[int]], max_model_len: int) -> list[list[int]]:
    """vLLM's truncate_prompt_tokens: k keeps each prompt's last k tokens, -1 the last
    max_model_len; absent, prompts are never cut."""
    k = _get(body, "truncate_prompt_tokens", _INT)
    if k is None:
        return prompts
    if k == -1:
        k = max_model_len
    if not 1 <= k <= max_model_len:
        raise BadRequest(f"truncate_prompt_tokens: must be -1 or in [1, {max_model_len}] (the "
                         f"context length), got {k}", param="truncate_prompt_tokens")
    return [p[-k:] for p in prompts]


def _build_params(kw: dict, max_tokens: int, fe: Frontend) -> SamplingParams:
    """SamplingParams, bad_words as token sequences (what travels on the wire), checked
    against the model's vocabulary; InvalidRequestError becomes a BadRequest naming it."""
    try:
        params = SamplingParams(max_tokens=max_tokens, **kw)  # type: ignore[arg-type]
        params = params.with_bad_words_tokenized(fe.tokenizer)
        params.check_vocab(fe.config.vocab_size)  # allowed_token_ids, bad_words
        return params
    except InvalidRequestError as e:
        raise BadRequest.from_invalid(e) from e


# Fields other OpenAI-compatible servers (OpenAI, vLLM) take that pdserve does not: refused by
# name, because ignoring them would change what the client gets. field -> (values that mean
# "off", why).
_UNSUPPORTED: dict[str, tuple[tuple[object, ...], str]] = {
    "suffix": ((None, ""), "not supported"),
    "use_beam_search": ((None, False), "not supported"),
    "chat_template": ((None,), "not supported: the model's own chat template is used"),
    "functions": ((None,), "not supported: use tools"),
    "function_call": ((None,), "not supported: use tool_choice"),
    # vLLM's sampling and output extensions pdserve does not implement
    "spaces_between_special_tokens": ((None, True), "not supported"),
    "length_penalty": ((None, 1, 1.0), "not supported (a beam-search parameter)"),
    "logits_processors": ((None, []), "not supported"),
    "vllm_xargs": ((None, {}), "not supported"),
    "kv_transfer_params": ((None, {}), "not supported: pdserve moves the KV itself"),
    "mm_processor_kwargs": ((None, {}), "not supported: text models only"),
    "documents": ((None, []), "not supported"),
    **{f"guided_{kind}": ((None,), f"not supported: use structured_outputs.{kind}")
       for kind in ("json", "regex", "choice", "grammar")},
}
# apply_chat_template's own arguments and what the renderer sets: not template variables
_TEMPLATE_ARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                            "continue_final_message", "bos_token", "eos_token",
                            "chat_template", "tokenize"})


def _check_unsupported(body: dict) -> None:
    for name, (off, why) in _UNSUPPORTED.items():
        if body.get(name) not in off:
            raise BadRequest(f"{name}: {why}", param=name)
    if body.get("best_of") not in (None, 1, body.get("n", 1)):
        raise BadRequest("best_of: not supported (use n)", param="best_of")


def _request_id(body: dict) -> str | None:
    rid = _get(body, "request_id", _STR)
    if rid is not None and not REQUEST_ID.fullmatch(rid):
        raise BadRequest("request_id: 1-128 characters of A-Z a-z 0-9 . _ : - (as the "
                         "X-Request-Id header)", param="request_id")
    return rid


def _check_default(body: dict, name: str, default: bool, what: str) -> None:
    """A vLLM switch pdserve takes only at its default (`what` it then does)."""
    if body.get(name) not in (None, default):
        raise BadRequest(f"{name}: only {str(default).lower()} is supported ({what})",
                         param=name)


def _template_options(body: dict, messages: list[dict]) -> TemplateOptions:
    """vLLM's chat extensions: add_generation_prompt, continue_final_message (an assistant
    prefill the model continues), chat_template_kwargs and reasoning_effort (passed to the
    template, as vLLM does)."""
    gen = _get(body, "add_generation_prompt", _BOOL, True)
    cont = _get(body, "continue_final_message", _BOOL, False)
    if cont and gen:
        raise BadRequest("continue_final_message: set add_generation_prompt to false with it",
                         param="continue_final_message")
    if cont and messages[-1]["role"] != "assistant":
        raise BadRequest("continue_final_message: the last message must be the assistant's",
                         param="continue_final_message")
    variables = body.get("chat_template_kwargs") or {}
    if not isinstance(variables, dict):
        raise BadRequest("chat_template_kwargs: must be an object", param="chat_template_kwargs")
    for key in variables:
        if key in _TEMPLATE_ARGS:
            raise BadRequest(f"chat_template_kwargs: {key!r} is not a template variable (it is "
                             "the request's own)", param="chat_template_kwargs")
    effort = _get(body, "reasoning_effort", _STR)
    if effort is not None:  # as vLLM: a template variable (templates that read it use it)
        variables = {"reasoning_effort": effort, **variables}
    return TemplateOptions(gen, cont, tuple(sorted(variables.items())))


def _model(body: dict, fe: Frontend) -> str:
    name = body.get("model")
    fe.check_model(name)
    return name if isinstance(name, str) else fe.model_id


# -- completions ------------------------------------------------------------------------------

def _prompts(body: dict, fe: Frontend) -> tuple[list[list[int]], list[str | None]]:
    """Each prompt's token ids, and its text as sent (None for token ids)."""
    if "prompt" not in body or body["prompt"] is None:
        raise BadRequest("prompt: is required", param="prompt")
    special = _get(body, "add_special_tokens", _BOOL, True)
    p = body["prompt"]
    if isinstance(p, str):
        return [fe.encode_prompt(p, add_special_tokens=special)], [p]
    if not isinstance(p, list) or not p:
        raise BadRequest("prompt: must be a non-empty string, a list of strings, a list of token "
                         "ids or a list of lists of token ids", param="prompt")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return [fe.encode_prompt(p)], [None]
    if all(isinstance(x, (str, list)) for x in p):
        return ([fe.encode_prompt(x, add_special_tokens=special) for x in p],
                [x if isinstance(x, str) else None for x in p])
    raise BadRequest("prompt: must be a string, a list of strings or token ids", param="prompt")


def parse_completion(body: dict, fe: Frontend) -> ParsedRequest:
    model = _model(body, fe)
    _check_unsupported(body)
    if body.get("top_logprobs") is not None:
        raise BadRequest("top_logprobs: /v1/completions takes the count as logprobs",
                         param="top_logprobs")
    prompts, texts = _prompts(body, fe)
    cut = _truncated(body, prompts, fe.max_model_len)
    # echo shows the prompt the model read: a cut one as its tokens decoded
    texts = [t if len(c) == len(p) else None for t, c, p in zip(texts, cut, prompts)]
    prompts = cut
    kw = _sampling_kwargs(body, fe.config.vocab_size)
    lp = _logprob_count(body, "logprobs")
    if lp is not None:
        kw["logprobs"] = lp
    echo = _get(body, "echo", _BOOL, False)
    stream, usage, continuous = _stream_flags(body)
    want_prompt = _prompt_logprobs(body, stream)
    # echo with logprobs: the prompt's logprobs lead the choice's (lm-eval's scoring)
    tops = [n for n in (lp if echo else None, want_prompt) if n is not None]
    if tops:
        kw["prompt_logprobs"] = max(tops)
    max_tokens = _get(body, "max_tokens", _INT, 16)
    prompt_only = max_tokens == 0 and echo
    if prompt_only:  # the engine runs the prompt and one token, which the reply leaves out
        if kw.get("min_tokens"):
            raise BadRequest("min_tokens: must be 0 when max_tokens is 0", param="min_tokens")
        max_tokens = 1
    elif max_tokens == 0:
        raise BadRequest("max_tokens: 0 only scores the prompt, which needs echo: true",
                         param="max_tokens")
    if body.get("tools"):
        raise BadRequest("tools: only /v1/chat/completions takes tools", param="tools")
    kw["structured"], checks = output_constraint(body)  # response_format, structured_outputs
    params = _build_params(kw, max_tokens, fe)
    return ParsedRequest("completion", model, prompts, params, stream, usage, lp is not None,
                         checks, echo=echo, prompt_only=prompt_only,
                         continuous_usage=continuous,
                         tokens_as_ids=_get(body, "return_tokens_as_token_ids", _BOOL, False),
                         token_ids=_get(body, "return_token_ids", _BOOL, False),
                         prompt_logprobs=want_prompt, prompt_texts=texts,
                         request_id=_request_id(body))


# -- chat -------------------------------------------------------------------------------------

def _messages(body: dict) -> list[dict]:
    """role + content (text), an assistant's past tool calls ("calls": (id, name, arguments))
    and a tool result's tool_call_id / name (router/structured.py renders them)."""
    msgs = body.get("messages")
    if msgs is None:
        raise BadRequest("messages: is required", param="messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages: must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where}: must be an object", param=where)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise BadRequest(f"{where}.role: must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                             param=f"{where}.role")
        msg: dict = {"role": role, "content": content_text(m.get("content"), f"{where}.content",
                                                           role)}
        if role == "assistant":
            msg["calls"] = tool_calls_of(m, where)
        for key in ("tool_call_id", "name") if role == "tool" else ():
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        out.append(msg)
    return out


def content_text(c: object, where: str, role: str) -> str:
    if isinstance(c, str):
        return c
    if c is None and role == "assistant":
        return ""
    if isinstance(c, list):
        texts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                 "are supported", param=where)
            texts.append(part["text"])
        return "\n".join(texts)  # as vLLM joins them
    raise BadRequest(f"{where}: must be a string or a list of text parts", param=where)


def chat_prompt_ids(body: dict, fe: Frontend, tools: ToolRequest | None,
                    fmt: ToolFormat) -> list[int]:
    """The prompt a chat body renders to: its messages, the tools offered, the template
    options (/v1/chat/completions and /tokenize alike)."""
    template = (fe.tokenizer.chat_template or "") if fe.tokenizer is not None else ""
    messages, offered = template_inputs(_messages(body), tools, fmt, template)
    return fe.encode_chat(messages, tools=offered, options=_template_options(body, messages))


def parse_chat(body: dict, fe: Frontend, default_max_tokens: Callable[[int], int]) -> ParsedRequest:
    model = _model(body, fe)
    _check_unsupported(body)
    if body.get("echo") not in (None, False):
        raise BadRequest("echo: only /v1/completions echoes the prompt", param="echo")
    _check_default(body, "add_special_tokens", False, "the chat template writes them")
    tools = parse_tools(body)
    fmt = fe.tool_format()
    [ids] = _truncated(body, [chat_prompt_ids(body, fe, tools, fmt)], fe.max_model_len)
    kw = _sampling_kwargs(body, fe.config.vocab_size)
    kw["structured"], checks = output_constraint(body, tools, fmt)
    want = _get(body, "logprobs", _BOOL, False)
    top = _get(body, "top_logprobs", _INT)
    if top is not None and not want:
        raise BadRequest("top_logprobs: requires logprobs to be true", param="top_logprobs")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise BadRequest(f"top_logprobs: must be in [0, {MAX_LOGPROBS}], got {top}",
                         param="top_logprobs")
    if want:
        kw["logprobs"] = top or 0
    stream, usage, continuous = _stream_flags(body)
    want_prompt = _prompt_logprobs(body, stream)
    if want_prompt is not None:
        kw["prompt_logprobs"] = want_prompt
    max_tokens = _get(body, "max_completion_tokens", _INT)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", _INT)
    if max_tokens is None:
        max_tokens = default_max_tokens(len(ids))
    params = _build_params(kw, max_tokens, fe)
    # how this request's calls are read: one only without parallel_tool_calls; under a
    # forced tool_choice, call markup cut by max_tokens is never turned into content
    parsing = dataclasses.replace(fmt, single=not tools.parallel, forced=tools.forced,
                                  named=tools.named) \
        if tools is not None and tools.choice != "none" else None
    return ParsedRequest("chat", model, [ids], params, stream, usage, bool(want), checks, parsing,
                         prompt_logprobs=want_prompt, request_id=_request_id(body),
                         continuous_usage=continuous,
                         tokens_as_ids=_get(body, "return_tokens_as_token_ids", _BOOL, False),
                         token_ids=_get(body, "return_token_ids", _BOOL, False))
