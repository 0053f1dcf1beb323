"""Tool-call parsers (router/tools.py): Hermes / Qwen and Llama-3 JSON, whole and streamed in
arbitrary pieces (the pieces assemble to the whole parse), parallel calls, OpenAI's delta
shapes, the forcing grammar accepting what the parser reads, and the chat template inputs."""
from __future__ import annotations

import dataclasses
import json
import random

import pytest
import xgrammar as xgr

from pdserve.engine.structured.compiler import GrammarCompiler
from pdserve.router.structured import ToolRequest, template_inputs
from pdserve.router.tools import HERMES, LLAMA3_JSON, ToolFormat, assemble, chunk_delta, pick_format

WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string"}, "days": {"type": "integer"}},
               "required": ["city"]}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}

CASES = [
    # (format, text, content, [(name, arguments)])
    (HERMES, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",'
             ' "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
             "</tool_call>", "Let me check.",
     [("get_weather", '{"city": "Paris", "days": 2}'), ("get_time", "{}")]),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"s": "a \\"}\\" b", "l": [1, {"x": "]"}]}}'
             "\n</tool_call>", None, [("f", '{"s": "a \\"}\\" b", "l": [1, {"x": "]"}]}')]),
    (HERMES, '<tool_call>{"arguments": {"x": 1}, "name": "rev"}</tool_call>', None,
     [("rev", '{"x": 1}')]),  # other key order: parsed once the call is complete
    (HERMES, "1 < 2 and <tool_ is no call", "1 < 2 and <tool_ is no call", []),
    (HERMES, "<tool_call>not json</tool_call> so text", "<tool_call>not json</tool_call> so text",
     []),
    (HERMES, "Plain answer.  ", "Plain answer.  ", []),
    (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                  '{"name": "get_time", "parameters": {}}', None,
     [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]),
    (LLAMA3_JSON, '<|python_tag|>{"name": "f", "parameters": {"n": 1.5e3}}', None,
     [("f", '{"n": 1.5e3}')]),
    (LLAMA3_JSON, "The weather is {\"a\": 1}", 'The weather is {"a": 1}', []),
    (LLAMA3_JSON, '  {"result": 1}', '  {"result": 1}', []),  # JSON, but no call
]


def summary(parsed) -> tuple:
    return parsed.content, [(c["function"]["name"], c["function"]["arguments"])
                            for c in parsed.tool_calls]


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_whole_and_streamed_parses_agree(fmt: ToolFormat, text: str, content: str | None,
                                         calls: list) -> None:
    whole = fmt.parse(text)
    assert summary(whole) == (content, calls)
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in whole.tool_calls)
    for seed in range(25):  # pieces of 1-6 characters, as a detokenizer hands them over
        rng, stream, events, i = random.Random(seed), fmt.stream(), [], 0
        while i < len(text):
            n = rng.randint(1, 6)
            events += stream.feed(text[i:i + n])
            i += n
        events += stream.finish()
        assert summary(assemble(events)) == (content, calls), seed


def test_stream_deltas_have_openai_shape_and_stream_arguments() -> None:
    s = HERMES.stream()
    first = chunk_delta(s.feed('Sure.<tool_call>\n{"name": "get_weather", "arguments": {"ci'))
    [call] = first["tool_calls"]
    assert first["content"] == "Sure."
    assert call["index"] == 0 and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"ci'}
    more = chunk_delta(s.feed('ty": "Rome"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '))
    assert more == {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Rome"}'}}]}
    last = chunk_delta(s.feed('"arguments": {}}\n</tool_call>') + s.finish())
    [call] = last["tool_calls"]  # header and arguments of one call in one piece
    assert call["index"] == 1 and call["function"] == {"name": "get_time", "arguments": "{}"}
    assert "content" not in last
    assert chunk_delta(HERMES.stream().feed("<tool")) == {}  # held back: maybe a call


TWO_CALLS = CASES[0][1]


def test_without_parallel_tool_calls_only_the_first_call_is_kept() -> None:
    one = dataclasses.replace(HERMES, single=True)
    assert summary(one.parse(TWO_CALLS)) == ("Let me check.",
                                             [("get_weather", '{"city": "Paris", "days": 2}')])
    s, events = one.stream(), []
    for i in range(0, len(TWO_CALLS), 5):  # streamed: no delta of the second call either
        events += s.feed(TWO_CALLS[i:i + 5])
    events += s.finish()
    assert [e.index for e in events if not isinstance(e, str)] == [0] * len(
        [e for e in events if not isinstance(e, str)])
    assert summary(assemble(events)) == summary(one.parse(TWO_CALLS))
    cut = TWO_CALLS[:TWO_CALLS.rindex('{"name"') + 5]  # the second call cut in its header
    assert summary(one.parse(cut)) == summary(one.parse(TWO_CALLS))


@pytest.mark.parametrize("text", ['<tool_call>\n{"name": "get_wea', "<tool_call>\n", "<tool_c"])
def test_a_forced_call_cut_by_max_tokens_is_never_content(text: str) -> None:
    # auto: an unfinished call is text, as the model wrote it
    assert HERMES.parse(text).content == text
    # required: the markup is not content, and there is no call to show yet
    required = dataclasses.replace(HERMES, forced=True)
    assert summary(required.parse(text)) == (None, []) or required.parse(text).content == ""
    # a named function: the call so far (vLLM too answers a named tool_choice with a call)
    named = dataclasses.replace(HERMES, forced=True, named="get_weather")
    parsed = named.parse(text)
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_weather"]
    assert not parsed.content


def test_format_from_the_template_and_the_flag() -> None:
    assert pick_format("", "{% if tools %}<tool_call>{% endif %}") is HERMES
    assert pick_format("auto", "<|start_header_id|>ipython<|end_header_id|>") is LLAMA3_JSON
    assert pick_format("", None) is HERMES
    assert pick_format("llama3_json", "<tool_call>") is LLAMA3_JSON


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON])
@pytest.mark.parametrize("parallel", [True, False])
def test_forcing_grammar_accepts_what_the_parser_reads(fmt: ToolFormat, parallel: bool,
                                                       frontend) -> None:
    """The structural tag for tool_choice required accepts the format's own rendering of one
    call and, only with parallel_tool_calls, of two; arguments follow the schema."""
    compiler = GrammarCompiler(frontend.tokenizer, frontend.config.vocab_size,
                               frontend.config.eos_token_ids)
    grammar = compiler._xgr.compile_structural_tag(fmt.structural_tag([WEATHER, TIME], parallel))
    one = fmt.render_calls([("get_weather", '{"city": "Paris", "days": 3}')])
    two = fmt.render_calls([("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])

    def accepts(text: str) -> bool:
        m = xgr.GrammarMatcher(grammar)
        return m.accept_string(text) and m.is_completed()

    assert accepts(one) and accepts(two) == parallel
    assert not accepts(fmt.render_calls([("get_weather", '{"days": 3}')]))  # city required
    assert not accepts(fmt.render_calls([("nope", "{}")])) and not accepts("Sure!")
    assert summary(fmt.parse(two))[1] == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]


def test_template_inputs_offer_tools_and_render_past_calls() -> None:
    tools = ToolRequest([WEATHER], "auto", None, True)
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "",
                "calls": [("call_1", "get_weather", '{"city": "Paris"}')]},
               {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    # a template that renders tools and tool_calls itself gets them, arguments as objects
    msgs, offered = template_inputs(history, tools, HERMES, "{{ tools }} {{ m.tool_calls }}")
    assert offered == [{"type": "function", "function": WEATHER}]
    assert msgs[1]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert msgs[2] == history[2]
    # one that does not (SmolLM2's): the calls go into the content in the model's format,
    # the tools into a system prompt; tool_choice "none" offers none
    msgs, offered = template_inputs(history, tools, HERMES, "{{ message['content'] }}")
    assert offered is None and msgs[0]["role"] == "system" and "<tools>" in msgs[0]["content"]
    assert json.dumps(WEATHER) in msgs[0]["content"].replace("\n", "")
    assert HERMES.parse(msgs[2]["content"]).tool_calls[0]["function"]["name"] == "get_weather"
    msgs, offered = template_inputs(history, ToolRequest([WEATHER], "none", None, True),
                                    HERMES, "{{ tools }}")
    assert offered is None and len(msgs) == 3
