"""OpenAI's Responses API (POST /v1/responses), request side: a Responses body becomes the chat
request it means, checked by the chat parser, with every error naming the Responses field.

    instructions                     -> a system message first
    input (text, or items)           -> messages: message items (input_text / output_text
                                        parts), function_call items -> the assistant's
                                        tool_calls, function_call_output -> tool messages;
                                        reasoning items are dropped (as chat templates drop
                                        past reasoning)
    tools [{type: function, name}]   -> chat tools; tool_choice {type: function, name}
    text.format                      -> response_format (text, json_object, json_schema)
    max_output_tokens                -> max_tokens; reasoning.effort -> reasoning_effort

Stateless: pdserve stores no responses, so previous_response_id, conversation, background,
reusable prompts and item references are refused by name; `store` is taken and the response
says store false. Text only: image, file and audio parts, and built-in tools (web search, file
search, MCP, ...), are refused by name. router/responses_output.py renders the output.
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.router.errors import BadRequest
from pdserve.router.frontend import Frontend
from pdserve.router.protocol import ParsedRequest, parse_chat

_STATELESS = "not supported: pdserve stores no responses (send the whole conversation as input)"
# field -> (values taken, why others are refused)
_REFUSED: dict[str, tuple[tuple[object, ...], str]] = {
    "previous_response_id": ((None,), _STATELESS),
    "conversation": ((None,), _STATELESS),
    "prompt": ((None,), "not supported: pdserve stores no reusable prompts"),
    "background": ((None, False), "not supported: responses run while the request waits"),
    "truncation": ((None, "disabled"), 'only "disabled" is supported (prompts are never '
                                       "truncated; one too long is refused)"),
    "top_logprobs": ((None, 0), "not supported on /v1/responses (use /v1/chat/completions)"),
    "max_tool_calls": ((None,), "not supported"),
    "return_token_ids": ((None, False), "not supported on /v1/responses (use "
                                        "/v1/chat/completions)"),
    # the chat API's names: refused, never silently dropped (what they ask would not happen)
    "messages": ((None,), "not a Responses field: use input"),
    "max_tokens": ((None,), "not a Responses field: use max_output_tokens"),
    "response_format": ((None,), "not a Responses field: use text.format"),
    "structured_outputs": ((None,), "not supported on /v1/responses: use text.format"),
    "stop": ((None,), "not supported on /v1/responses (use /v1/chat/completions)"),
    "n": ((None, 1), "not supported on /v1/responses: one output per response"),
}
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# include values taken: pdserve makes no reasoning items, so there is nothing to include
_INCLUDE_OK = ("reasoning.encrypted_content",)
# vLLM's sampling extensions passed through to the chat parser as they are
_PASSED = ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty",
           "presence_penalty", "frequency_penalty", "logit_bias", "parallel_tool_calls",
           "stream", "request_id", "model", "cache_salt", "priority")
_TEXT_PARTS = ("input_text", "output_text")


@dataclass(frozen=True)
class ResponsesRequest:
    """A checked Responses request: the chat request it runs as, and the request fields the
    response object repeats (instructions, tools, text, sampling, metadata)."""

    parsed: ParsedRequest
    echo: dict


_bad = BadRequest.naming


def parse_responses(body: dict, fe: Frontend,
                    default_max_tokens: Callable[[int], int]) -> ResponsesRequest:
    """The Responses body as a chat request (ParsedRequest kind "response"), or BadRequest
    naming the Responses field at fault."""
    for name, (ok, why) in _REFUSED.items():
        if body.get(name) not in ok:
            raise _bad(name, why)
    _check_include(body.get("include"))
    messages, origin = input_messages(body)
    chat: dict = {k: body[k] for k in _PASSED if k in body}
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    chat.update(_tools(body))
    chat.update(_text_format(body.get("text")))
    effort = _reasoning_effort(body.get("reasoning"))
    if effort is not None:
        chat["reasoning_effort"] = effort
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
            isinstance(v, str) for v in metadata.values())):
        raise _bad("metadata", "must be an object of at most 16 string values")
    try:
        parsed = parse_chat(chat, fe, default_max_tokens)
    except BadRequest as e:
        raise renamed(e, origin) from e
    return ResponsesRequest(dataclasses.replace(parsed, kind="response"), response_echo(body))


def response_echo(body: dict) -> dict:
    """The request fields a response object repeats, OpenAI's defaults where absent (body
    already checked by parse_responses)."""
    return {"instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "text": body.get("text") or {"format": {"type": "text"}},
            "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"),
                          "summary": None},
            "store": False, "truncation": "disabled", "background": False,
            "previous_response_id": None,
            "user": body.get("user") if isinstance(body.get("user"), str) else None}


def _check_include(include: object) -> None:
    if include is None:
        return
    if not isinstance(include, list):
        raise _bad("include", "must be a list")
    for i, value in enumerate(include):
        if value not in _INCLUDE_OK:
            raise _bad(f"include[{i}]", f"{value!r} is not supported"[:200])


# -- input ------------------------------------------------------------------------------------

def input_messages(body: dict) -> tuple[list[dict], list[str]]:
    """Chat messages from instructions + input, and each message's Responses field (for
    errors): origin[i] names where messages[i] came from."""
    messages: list[dict] = []
    origin: list[str] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("instructions", "must be a string")
        messages.append({"role": "system", "content": instructions})
        origin.append("instructions")
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
        origin.append("input")
    elif isinstance(given, list) and given:
        names: dict[str, str] = {}  # call_id -> function name, for the tool messages
        for i, item in enumerate(given):
            _add_item(item, f"input[{i}]", messages, origin, names)
    elif given is None:
        raise _bad("input", "is required")
    else:
        raise _bad("input", "must be a string or a non-empty list of input items")
    return messages, origin


def _add_item(item: object, where: str, messages: list[dict], origin: list[str],
              names: dict[str, str]) -> None:
    if not isinstance(item, dict):
        raise _bad(where, "must be an object")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise _bad(f"{where}.role", f"must be user, system, developer or assistant, got "
                                        f"{role!r}"[:200])
        # developer instructions are what chat templates call system (few know "developer")
        messages.append({"role": "system" if role == "developer" else role,
                         "content": _text(item.get("content"), f"{where}.content")})
        origin.append(where)
    elif kind == "function_call":
        call_id, name = _string(item, "call_id", where), _string(item, "name", where)
        arguments = _string(item, "arguments", where)
        try:
            json.loads(arguments)
        except ValueError as e:
            raise _bad(f"{where}.arguments", f"not valid JSON: {e}") from e
        names[call_id] = name
        call = {"id": call_id, "type": "function",
                "function": {"name": name, "arguments": arguments}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)  # the turn's text, then its calls
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            origin.append(where)
    elif kind == "function_call_output":
        call_id = _string(item, "call_id", where)
        if call_id not in names:  # as OpenAI: an output answers a call made before it
            raise _bad(f"{where}.call_id", f"no function_call item before it has call_id "
                                           f"{call_id!r}"[:200])
        messages.append({"role": "tool", "tool_call_id": call_id, "name": names[call_id],
                         "content": _text(item.get("output"), f"{where}.output")})
        origin.append(where)
    elif kind != "reasoning":  # past reasoning is dropped, as chat templates drop it
        why = "not supported: pdserve stores no items" if kind == "item_reference" else \
            "must be message, function_call, function_call_output or reasoning"
        raise _bad(f"{where}.type", f"{why}, got {kind!r}"[:300])


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _bad(f"{where}.{key}", "must be a string")
    return value


def _text(content: object, where: str) -> str:
    """A message's text: a string, or text parts (input_text, output_text) joined by
    newlines as the chat API joins its text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "must be a string or a list of input_text parts")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else None
            raise _bad(f"{at}.type", f"only input_text and output_text parts are supported "
                                     f"(text models), got {kind!r}"[:200])
        if not isinstance(part.get("text"), str):
            raise _bad(f"{at}.text", "must be a string")
        texts.append(part["text"])
    return "\n".join(texts)


# -- tools, text format, reasoning --------------------------------------------------------------

def _tools(body: dict) -> dict:
    out: dict = {}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("tools", "must be a list of tools")
        out["tools"] = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise _bad(f"tools[{i}].type", "only function tools are supported (no built-in "
                                               f"web, file or MCP tools), got {kind!r}"[:200])
            fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
            out["tools"].append({"type": "function", "function": fn})
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        names = [t["function"].get("name") for t in out.get("tools", [])]
        if choice.get("type") != "function" or choice.get("name") not in names:
            raise _bad("tool_choice", 'must be "none", "auto", "required" or {"type": '
                                      '"function", "name": <one of the tools>}')
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        out["tool_choice"] = choice
    return out


def _text_format(text: object) -> dict:
    if text is None:
        return {}
    if not isinstance(text, dict):
        raise _bad("text", "must be an object")
    fmt = text.get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict):
        raise _bad("text.format", "must be an object")
    kind = fmt.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"response_format": {"type": "json_schema", "json_schema": spec}}
    raise _bad("text.format.type", f"must be text, json_object or json_schema, got {kind!r}"[:200])


def _reasoning_effort(reasoning: object) -> str | None:
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise _bad("reasoning", "must be an object")
    effort = reasoning.get("effort")
    if effort is not None and effort not in _EFFORTS:
        raise _bad("reasoning.effort", f"must be one of {', '.join(_EFFORTS)}, got "
                                       f"{effort!r}"[:200])
    return effort


# -- errors --------------------------------------------------------------------------------------

# chat field -> the Responses field it came from (longest first where one prefixes another)
_RENAMES = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
            ("max_tokens", "max_output_tokens"), ("reasoning_effort", "reasoning.effort"))
_MESSAGE = re.compile(r"messages\[(\d+)\]")
_TOOL_FN = re.compile(r"(tools\[\d+\])\.function")


def rename_param(param: str, origin: list[str]) -> str:
    """The Responses field for a chat field the chat parser named."""
    m = _MESSAGE.match(param)
    if m:
        i = int(m.group(1))
        return (origin[i] if i < len(origin) else "input") + param[m.end():]
    if param == "messages":
        return "input"
    for old, new in _RENAMES:
        if param == old or param.startswith(old + "."):
            return new + param[len(old):]
    param = _TOOL_FN.sub(r"\1", param)
    return "tool_choice.name" if param == "tool_choice.function.name" else param


def renamed(e: BadRequest, origin: list[str]) -> BadRequest:
    """e naming the Responses field (its param, and the message that starts with it)."""
    if not e.param:
        return e
    new = rename_param(e.param, origin)
    message = e.message
    if message.startswith(e.param):
        message = new + message[len(e.param):]
    return BadRequest(message, param=new, code=e.code)
