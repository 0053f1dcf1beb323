"""Request fields that constrain the output, and chat messages that carry tool calls.

    response_format      {"type": "text" | "json_object" | "json_schema",
                          "json_schema": {"name", "schema", "strict", "description"}}
    structured_outputs   vLLM's: exactly one of json (a schema), regex, choice, grammar,
                         json_object, structural_tag
    tools, tool_choice, parallel_tool_calls   (chat) tool_choice "required" or a named
                         function becomes the call format's structural tag (router/tools.py)

Every spec comes with the request field it came from (`Check`): the frontend compiles each
one before dispatch (Frontend.check_grammars), and a bad one is a 400 naming that field --
`response_format.json_schema.schema`, `structured_outputs.regex`,
`tools[0].function.parameters`. Shape errors are 400s naming their field here already.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pdserve.engine.core.sampling_params import InvalidRequestError, StructuredOutput
from pdserve.router.errors import BadRequest
from pdserve.router.tools import ToolFormat, parameters_schema

Check = tuple[StructuredOutput, str]  # a spec and the request field it came from
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # OpenAI's function / schema names
_SO_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


_bad = BadRequest.naming


@dataclass
class ToolRequest:
    functions: list[dict]  # each tool's function object: name, description, parameters
    choice: str  # "auto" | "none" | "required" | "function" (a named one)
    named: str | None  # the function tool_choice names
    parallel: bool

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")


# -- tools ---------------------------------------------------------------------------------------

def parse_tools(body: dict) -> ToolRequest | None:
    """tools, tool_choice and parallel_tool_calls, checked (None: no tools)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", f"must be a boolean, got {parallel!r}"[:200])
    if not tools:
        if choice not in (None, "none", "auto"):
            raise _bad("tool_choice", "needs tools")
        if tools is not None and not isinstance(tools, list):
            raise _bad("tools", "must be a list of tools")
        return None
    if not isinstance(tools, list):
        raise _bad("tools", "must be a list of tools")
    functions = [_function(t, f"tools[{i}]") for i, t in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise _bad("tools", "function names must be distinct")
    named = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        named = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or named not in names:
            raise _bad("tool_choice", 'must be "none", "auto", "required" or {"type": '
                       '"function", "function": {"name": <one of the tools>}}')
    elif choice not in (None, "none", "auto", "required"):
        raise _bad("tool_choice", f'must be "none", "auto", "required" or a named function, '
                                  f"got {choice!r}"[:200])
    kind = "function" if named else (choice or "auto")
    return ToolRequest(functions, kind, named, parallel is not False)


def _function(tool: object, where: str) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise _bad(f"{where}.type", 'only {"type": "function", "function": {...}} tools are '
                                    "supported")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise _bad(f"{where}.function", "must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _bad(f"{where}.function.name", "must be 1-64 letters, digits, _, . or -")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise _bad(f"{where}.function.description", "must be a string")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise _bad(f"{where}.function.parameters", "must be a JSON schema object")
    return {k: fn[k] for k in ("name", "description", "parameters") if fn.get(k) is not None}


def tool_grammar(req: ToolRequest, fmt: ToolFormat) -> tuple[StructuredOutput, list[Check]]:
    """tool_choice required / named: the structural tag forcing a call (parallel ones only
    for required with parallel_tool_calls), and the checks naming each tool's parameters."""
    chosen = [(i, f) for i, f in enumerate(req.functions)
              if req.named is None or f["name"] == req.named]
    checks = [(StructuredOutput(json=json.dumps(parameters_schema(f), ensure_ascii=False)),
               f"tools[{i}].function.parameters") for i, f in chosen]
    tag = _spec("tool_choice", structural_tag=fmt.structural_tag(
        [f for _, f in chosen], parallel=req.parallel and req.named is None))
    return tag, [*checks, (tag, "tool_choice")]


# -- response_format / structured_outputs -------------------------------------------------------

def output_constraint(body: dict, tools: ToolRequest | None = None,
                      fmt: ToolFormat | None = None) -> tuple[StructuredOutput | None, list[Check]]:
    """The request's one grammar (or None) and the checks the frontend compiles."""
    given = [c for c in (response_format(body), structured_outputs(body)) if c is not None]
    if len(given) > 1:
        raise _bad("structured_outputs", "set it or response_format, not both")
    if tools is not None and tools.forced and fmt is not None:
        if given:
            field = given[0][1].split(".")[0]
            raise _bad(field, f"cannot be combined with tool_choice {tools.choice!r}")
        return tool_grammar(tools, fmt)
    return (given[0][0], given) if given else (None, [])


def response_format(body: dict) -> Check | None:
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise _bad("response_format", "must be an object")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True), "response_format"
    if kind != "json_schema":
        raise _bad("response_format.type", "must be text, json_object or json_schema, got "
                                           f"{kind!r}"[:200])
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise _bad("response_format.json_schema", "must be an object with a schema")
    name, strict = js.get("name"), js.get("strict")
    if name is not None and (not isinstance(name, str) or not _NAME.fullmatch(name)):
        raise _bad("response_format.json_schema.name", "must be 1-64 letters, digits, _, . or -")
    if strict is not None and not isinstance(strict, bool):
        raise _bad("response_format.json_schema.strict", "must be a boolean")
    schema = js.get("schema")
    if not isinstance(schema, (dict, bool)):
        raise _bad("response_format.json_schema.schema", "must be a JSON schema object")
    # the grammar is enforced whatever `strict` says: the output always matches the schema
    where = "response_format.json_schema.schema"
    return _spec(where, json=json.dumps(schema, ensure_ascii=False)), where


def structured_outputs(body: dict) -> Check | None:
    so = body.get("structured_outputs")
    if so is None:
        return None
    if not isinstance(so, dict):
        raise _bad("structured_outputs", "must be an object")
    given = [k for k in _SO_KEYS if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise _bad("structured_outputs", f"exactly one of {', '.join(_SO_KEYS)} must be set, "
                                         f"got {given or 'none'}")
    key, value = given[0], so[given[0]]
    where = f"structured_outputs.{key}"
    if key == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise _bad(where, f"not valid JSON: {e}") from e
    if key in ("json", "structural_tag") and isinstance(value, (dict, bool)):
        value = json.dumps(value, ensure_ascii=False)
    if key == "json_object" and value is not True:
        raise _bad(where, "must be true")
    if key == "choice" and (not isinstance(value, list) or not all(isinstance(c, str)
                                                                    for c in value)):
        raise _bad(where, "must be a list of strings")
    if key not in ("json_object", "choice") and not isinstance(value, str):
        raise _bad(where, "must be a string" + (" or a JSON schema object"
                                                if key == "json" else ""))
    return _spec(where, **{key: value}), where


def _spec(param: str, **kind: object) -> StructuredOutput:
    try:
        return StructuredOutput(**kind)  # type: ignore[arg-type]
    except InvalidRequestError as e:
        raise _bad(param, e.message) from e


# -- chat messages with tool calls ---------------------------------------------------------------

def tool_calls_of(message: dict, where: str) -> list[tuple[str, str, str]]:
    """An assistant message's tool_calls as (id, name, arguments JSON), checked."""
    calls = message.get("tool_calls")
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise _bad(f"{where}.tool_calls", "must be a list")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{at}.function", "must be an object with a name")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            raise _bad(f"{at}.function.arguments", "must be a JSON string")
        try:
            json.loads(args)
        except ValueError as e:
            raise _bad(f"{at}.function.arguments", f"not valid JSON: {e}") from e
        call_id = call.get("id", "")
        out.append((call_id if isinstance(call_id, str) else "", fn["name"], args))
    return out


def template_inputs(messages: list[dict], tools: ToolRequest | None, fmt: ToolFormat,
                    template: str) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for the chat template. Past calls go as `tool_calls` (arguments as
    objects, as the templates of Qwen, Llama and Hermes expect) where the template renders
    them, else into the content in the model's call format; tools go as `tools` where the
    template renders them, else as a system prompt in that format (tool_choice "none": not
    offered at all)."""
    offered = tools is not None and tools.choice != "none"
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("calls", [])
        if calls and "tool_calls" in template:
            m["tool_calls"] = [{"id": i, "type": "function",
                                "function": {"name": n, "arguments": json.loads(a)}}
                               for i, n, a in calls]
        elif calls:
            sep = "\n" if m["content"] else ""
            m["content"] += sep + fmt.render_calls([(n, a) for _, n, a in calls])
        out.append(m)
    if not offered:
        return out, None
    wrapped = [{"type": "function", "function": f} for f in tools.functions]
    if "tools" in template:
        return out, wrapped
    prompt = fmt.instructions(tools.functions)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None
