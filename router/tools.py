"""Tool calls in the model's own format: parsing them out of the text (whole or streamed), the
grammar that forces them, and rendering past calls back into a prompt.

    hermes       Hermes / Qwen: <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>,
                 parallel calls one after another (newline between)
    llama3_json  Llama 3.x: the whole reply is {"name": "f", "parameters": {...}}, parallel
                 calls separated by "; " (an optional <|python_tag|> first)

The parser is a state machine over the detokenized text, fed delta by delta: text outside calls
is content (a possible start of a call is held back until it is decided), a call's header
yields one delta (index, id, name), its arguments stream as they come (the raw JSON text the
model wrote, so the streamed pieces concatenate to exactly the non-streamed arguments: the
non-streamed parse is the same machine fed the whole text at once).

`structural_tag` is what tool_choice "required" or a named function compiles to (router/
structured.py): the call format above with each tool's parameters as the arguments' JSON
schema, at least one call, one only unless parallel_tool_calls. The call then always parses.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

PARSERS = ("hermes", "llama3_json")
_STRING = r'"((?:[^"\\]|\\.)*)"'


@dataclass
class CallDelta:
    """Part of tool call `index`: its header (id and name, arguments "") or arguments text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class Parsed:
    """What the whole text held: content (None when only whitespace surrounds the calls) and
    the calls in OpenAI's message shape."""

    content: str | None
    tool_calls: list[dict] = field(default_factory=list)


class _ValueEnd:
    """Where one JSON value ends, in text fed piece by piece (depth outside strings)."""

    def __init__(self) -> None:
        self.depth, self.in_str, self.esc, self.started, self.done = 0, False, False, False, False
        self.scalar = False

    def feed(self, text: str) -> int:
        """How many leading chars of text belong to the value (all of them while it goes on)."""
        for i, ch in enumerate(text):
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
                    if self.depth == 0:
                        self.done = True
                        return i + 1
            elif self.scalar and (ch in ",}]" or ch.isspace()):
                self.done = True  # a number / true / null ends before its terminator
                return i
            elif ch == '"':
                self.in_str = self.started = True
            elif ch in "{[":
                self.depth += 1
                self.started = True
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.done = True
                    return i + 1
            elif not self.started and not ch.isspace():
                self.scalar = self.started = True
        return len(text)


def _held(buf: str, marker: str) -> int:
    """Length of the longest end of buf that may begin `marker` (held back until decided)."""
    for n in range(min(len(marker) - 1, len(buf)), 0, -1):
        if marker.startswith(buf[-n:]):
            return n
    return 0


class ToolStream:
    """The parser of one completion; feed() the text deltas, then finish()."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt, self.buf, self.mode = fmt, "", fmt.first_mode
        self.calls = 0  # call headers emitted; the current call's index is calls - 1
        self.ws = ""  # whitespace-only content, held: next to a call it is dropped
        self.value = _ValueEnd()
        self.out: list[str | CallDelta] = []

    def feed(self, text: str) -> list[str | CallDelta]:
        self.buf += text
        while self.buf and getattr(self, f"_{self.mode}")():
            pass
        return self._take()

    def finish(self) -> list[str | CallDelta]:
        """The end of the text: release what was held (an unfinished call header is text;
        under a forced tool_choice it is the call so far: the named function with the
        arguments written, or nothing)."""
        held = self.mode in ("text", "start", "head")
        dropped_call = self.fmt.single and self.calls and self.mode == "head"  # a 2nd, cut
        if held and self.fmt.named and not self.calls:
            self._header(self.fmt.named)
        elif held and not self.fmt.forced and not dropped_call:
            opener = (self.fmt.opener or "") if self.mode == "head" else ""
            self._content(opener + self.buf)
        if not self.calls and self.ws:
            self.out.append(self.ws)
        self.buf, self.ws = "", ""
        return self._take()

    def _take(self) -> list[str | CallDelta]:
        out, self.out = self.out, []
        if self.fmt.single:  # one call: the ones after the first are dropped
            out = [e for e in out if not isinstance(e, CallDelta) or e.index == 0]
        return out

    def _content(self, text: str) -> None:
        """Text out, but trailing whitespace held (however the text was cut into pieces, the
        whitespace before a call or at the end of a reply with calls is dropped)."""
        body = text.rstrip()
        if body:
            self.out.append(self.ws + body)
            self.ws = ""
        self.ws += text[len(body):]

    def _header(self, name: str) -> None:
        self.ws = ""
        self.out.append(CallDelta(self.calls, "", f"call_{uuid.uuid4().hex[:24]}", name))
        self.calls += 1
        self.value, self.mode = _ValueEnd(), "args"

    # -- states: each returns whether it consumed something and the machine may go on ------
    def _start(self) -> bool:
        """llama3_json: the reply is calls only if it opens with "{" (after whitespace)."""
        stripped, tag = self.buf.lstrip(), "<|python_tag|>"
        if not stripped or (tag.startswith(stripped) and stripped != tag):
            return False  # undecided yet
        rest = stripped.removeprefix(tag).lstrip()
        if not rest:
            return False
        self.mode = "head" if rest[0] == "{" else "text"
        if self.mode == "head":  # leading whitespace is held: dropped if a call follows
            self._content(self.buf[:len(self.buf) - len(self.buf.lstrip())])
            self.buf = rest
        return True

    def _text(self) -> bool:
        opener = self.fmt.opener
        if opener is None:  # llama3_json: a reply that did not open with a call is text
            self._content(self.buf)
            self.buf = ""
            return False
        at = self.buf.find(opener)
        if at < 0:
            keep = _held(self.buf, opener)
            self._content(self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        self._content(self.buf[:at])
        self.buf, self.mode = self.buf[at + len(opener):], "head"
        return True

    def _head(self) -> bool:
        m = self.fmt.head.match(self.buf)
        if m is not None:
            self.buf = self.buf[m.end():]
            self._header(json.loads(f'"{m.group(1)}"'))
            return True
        whole = self.fmt.whole_call(self.buf)  # other key orders, or no call at all
        if whole is None:
            return False  # incomplete: wait
        n, call = whole
        if call is None:
            self.mode = "text"
            self._content((self.fmt.opener or "") + self.buf[:n])
        else:
            self._header(call[0])
            self.out.append(CallDelta(self.calls - 1, call[1]))
            self.mode = self.fmt.after_call
        self.buf = self.buf[n:]
        return True

    def _args(self) -> bool:
        if not self.value.started:  # whitespace before the value is not part of it
            self.buf = self.buf.lstrip()
            if not self.buf:
                return False
        n = self.value.feed(self.buf)
        if n:
            self.out.append(CallDelta(self.calls - 1, self.buf[:n]))
        self.buf = self.buf[n:]
        if self.value.done:
            self.mode = "tail"
        return self.value.done

    def _tail(self) -> bool:
        n = self.fmt.tail_end(self.buf)
        if n is None:
            return False
        self.buf, self.mode = self.buf[n:], self.fmt.after_call
        return True

    def _between(self) -> bool:
        """llama3_json after a call: "; " or whitespace, then the next call or text."""
        rest = self.buf.lstrip().removeprefix(";").lstrip()
        if not rest:
            return False
        self.buf, self.mode = rest, "head" if rest[0] == "{" else "text"
        return True


@dataclass(frozen=True)
class ToolFormat:
    name: str
    opener: str | None  # what starts a call inside text (hermes); None: the reply opens with one
    head: re.Pattern  # a call up to its arguments' value
    close: str  # what ends a call after its arguments
    begin: str  # the grammar's call prefix, with {name} for the JSON-quoted name
    end: str
    separator: str
    args_key: str
    # one request's reading of its calls (router/protocol.py parse_chat): single = no
    # parallel_tool_calls (calls after the first are dropped, as vLLM does); forced =
    # tool_choice "required" or named (`named`): a call cut short by max_tokens is the
    # call so far, never text
    single: bool = False
    forced: bool = False
    named: str | None = None

    @property
    def first_mode(self) -> str:
        return "text" if self.opener is not None else "start"

    @property
    def after_call(self) -> str:
        return "text" if self.opener is not None else "between"

    def stream(self) -> ToolStream:
        return ToolStream(self)

    def parse(self, text: str) -> Parsed:
        """The whole text at once (the same machine as streaming)."""
        s = self.stream()
        return assemble(s.feed(text) + s.finish())

    def tail_end(self, buf: str) -> int | None:
        """Chars of buf up to the end of the call after its arguments, or None (wait)."""
        at = buf.find(self.close)
        if self.opener is None:  # llama3_json: the object's "}" (whitespace before it)
            stripped = buf.lstrip()
            return None if not stripped else len(buf) - len(stripped) + 1
        return None if at < 0 else at + len(self.close)

    def whole_call(self, buf: str) -> tuple[int, tuple[str, str] | None] | None:
        """When the head pattern does not match: once the call's text is complete, (chars,
        (name, arguments JSON)) or (chars, None) if it is no call; None while incomplete."""
        if self.opener is not None:
            at = buf.find(self.close)
            if at < 0:
                return None
            body, n = buf[:at], at + len(self.close)
        else:
            scan = _ValueEnd()
            n = scan.feed(buf)
            if not scan.done:
                return None
            body = buf[:n]
        try:
            obj = json.loads(body)
            name, args = obj["name"], obj.get(self.args_key, obj.get("arguments"))
            if not isinstance(name, str):
                raise TypeError("name")
            return n, (name, json.dumps({} if args is None else args, ensure_ascii=False))
        except (ValueError, KeyError, TypeError, AttributeError):
            return n, None

    def structural_tag(self, tools: list[dict], parallel: bool) -> str:
        """xgrammar structural tag: >= 1 call of these tools (function objects), in this
        format, each call's arguments under its parameters' schema."""
        tags = [{"type": "tag", "begin": self.begin.format(name=json.dumps(t["name"])),
                 "content": {"type": "json_schema", "json_schema": parameters_schema(t),
                             "max_whitespace_cnt": 1},
                 "end": self.end} for t in tools]
        return json.dumps({"type": "structural_tag", "format": {
            "type": "tags_with_separator", "tags": tags, "separator": self.separator,
            "at_least_one": True, "stop_after_first": not parallel}}, ensure_ascii=False)

    def instructions(self, functions: list[dict]) -> str:
        """A system prompt offering the tools in this format, for chat templates that do not
        render `tools` themselves (the wording of Qwen2.5's and Llama 3.1's templates)."""
        listed = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False)
                           for f in functions)
        if self.opener is not None:
            return ("# Tools\n\nYou may call one or more functions to assist with the user "
                    "query.\n\nYou are provided with function signatures within <tools></tools> "
                    f"XML tags:\n<tools>\n{listed}\n</tools>\n\nFor each function call, return a "
                    "json object with function name and arguments within <tool_call></tool_call> "
                    'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
                    "<args-json-object>}\n</tool_call>")
        return ("Given the following functions, please respond with a JSON for a function call "
                "with its proper arguments that best answers the given prompt.\n\nRespond in the "
                'format {"name": function name, "parameters": dictionary of argument name and '
                f"its value}}. Do not use variables.\n\n{listed}")

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        """Past calls (name, arguments JSON) as the model writes them, for templates that
        do not render assistant tool_calls themselves."""
        return self.separator.join(self.begin.format(name=json.dumps(n)) + a + self.end
                                   for n, a in calls)


def parameters_schema(function: dict) -> dict:
    """A function's parameters schema; none given means it takes no arguments (OpenAI)."""
    params = function.get("parameters")
    return params if params is not None else {"type": "object", "properties": {}}


HERMES = ToolFormat("hermes", "<tool_call>",
                    re.compile(r'\s*\{\s*"name"\s*:\s*' + _STRING + r'\s*,\s*"arguments"\s*:\s*'),
                    "</tool_call>", '<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>",
                    "\n", "arguments")
LLAMA3_JSON = ToolFormat("llama3_json", None,
                         re.compile(r'\{\s*"name"\s*:\s*' + _STRING
                                    + r'\s*,\s*"(?:parameters|arguments)"\s*:\s*'),
                         "}", '{{"name": {name}, "parameters": ', "}", "; ", "parameters")
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON)}


def pick_format(parser: str, chat_template: str | None) -> ToolFormat:
    """The format a flag names, or (parser "" / "auto") the one the chat template writes:
    Llama 3's ipython / python_tag templates take llama3_json, everything else hermes."""
    if parser and parser != "auto":
        return FORMATS[parser]
    template = chat_template or ""
    if "<tool_call>" not in template and ("<|python_tag|>" in template or "ipython" in template):
        return LLAMA3_JSON
    return HERMES


def assemble(events: list[str | CallDelta]) -> Parsed:
    """Content and calls from a parser's output (what a client's stream accumulation does)."""
    text = "".join(e for e in events if isinstance(e, str))
    calls: dict[int, dict] = {}
    for e in events:
        if isinstance(e, CallDelta):
            call = calls.setdefault(e.index, {"id": e.id, "type": "function",
                                              "function": {"name": e.name, "arguments": ""}})
            call["function"]["arguments"] += e.arguments
    content = None if calls and not text.strip() else text
    return Parsed(content, [calls[i] for i in sorted(calls)])


def chunk_delta(events: list[str | CallDelta]) -> dict:
    """One SSE chunk's `delta` from a parser's output: content and OpenAI tool_calls deltas
    (a header brings index, id, type and name; later pieces only index and arguments)."""
    delta: dict = {}
    text = "".join(e for e in events if isinstance(e, str))
    if text:
        delta["content"] = text
    calls: list[dict] = []
    for e in events:
        if not isinstance(e, CallDelta):
            continue
        if e.id is None and calls and calls[-1]["index"] == e.index:
            calls[-1]["function"]["arguments"] += e.arguments  # merge pieces of one call
            continue
        item: dict = {"index": e.index, "function": {"arguments": e.arguments}}
        if e.id is not None:
            item.update(id=e.id, type="function")
            item["function"]["name"] = e.name
        calls.append(item)
    if calls:
        delta["tool_calls"] = calls
    return delta
