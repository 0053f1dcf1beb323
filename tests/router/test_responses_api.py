"""/v1/responses (OpenAI's Responses API): the request translated to chat (input items, tools,
text.format, errors naming the Responses field), the output builder (message and function_call
items, streamed events equal to the whole response), and the route against in-process fake
workers with the real openai client (tests/router/test_e2e_serve.py runs it on a real model)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.responses import Response

from pdserve.router.core import RouterConfig
from pdserve.router.deltas import Delta
from pdserve.router.errors import BadRequest
from pdserve.router.responses_api import (
    input_messages,
    parse_responses,
    rename_param,
    response_echo,
)
from pdserve.router.responses_output import ResponseBuilder, response_head, whole_response
from pdserve.router.tools import HERMES

from tests.router.fake_worker import FakeRef, FakeWorker
from tests.router.harness import RouterThread

KEY = "responses-key"


def _max(n_prompt: int) -> int:
    return 64


# -- request ------------------------------------------------------------------------------------

def test_input_items_become_chat_messages():
    """instructions first; message items with text parts; a turn's text and its calls in one
    assistant message; call outputs as tool messages named after their call; reasoning
    dropped."""
    body = {"instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in"},
                                     {"type": "input_text", "text": "Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"c": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c2", "output": "noon"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]}
    messages, origin = input_messages(body)
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in\nParis?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"c": 1}'}},
            {"id": "c2", "type": "function", "function": {"name": "time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "noon", "name": "time"},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny", "name": "weather"}]
    assert origin == ["instructions", "input[0]", "input[2]", "input[5]", "input[6]"]
    developer = {"input": [{"role": "developer", "content": "Answer in French."}]}
    assert input_messages(developer)[0] == [{"role": "system", "content": "Answer in French."}]
    assert input_messages({"input": "hi"}) == ([{"role": "user", "content": "hi"}], ["input"])


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}],
      "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "reasoning": {"effort": 3}}, "reasoning.effort"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata"),
    ({"input": ["x", {"role": "user", "content": 5}]}, "input[0]"),
    ({"input": "x", "max_tokens": 5}, "max_tokens"),  # chat's names: refused, not dropped
    ({"input": "x", "response_format": {"type": "json_object"}}, "response_format"),
    ({"input": "x", "stop": ["."]}, "stop"),
    ({"input": [{"role": "user", "content": "x"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{bad"}]},
     "input[1].arguments"),
    ({"input": [{"role": "user", "content": "x"},
                {"type": "function_call_output", "call_id": "c9", "output": "y"}]},
     "input[1].call_id"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "x", "return_token_ids": True}, "return_token_ids"),
])
def test_bad_requests_name_the_responses_field(frontend, body, param):
    with pytest.raises(BadRequest) as e:
        parse_responses(body, frontend, _max)
    assert e.value.param == param, e.value.message
    assert e.value.message.startswith(param), e.value.message


def test_chat_parser_errors_are_renamed():
    origin = ["instructions", "input[1]"]
    assert rename_param("messages[1].content", origin) == "input[1].content"
    assert rename_param("messages", origin) == "input"
    assert rename_param("response_format.json_schema.schema", origin) == "text.format.schema"
    assert rename_param("tools[2].function.parameters", origin) == "tools[2].parameters"
    assert rename_param("tool_choice.function.name", origin) == "tool_choice.name"
    assert rename_param("max_tokens", origin) == "max_output_tokens"
    assert rename_param("seed", origin) == "seed"


def test_tools_text_format_and_sampling_reach_the_chat_request(frontend):
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    req = parse_responses({"input": "x", "tools": tools, "tool_choice": "required",
                           "parallel_tool_calls": False, "max_output_tokens": 7,
                           "temperature": 0.5, "seed": 3, "store": True, "cache_salt": "t1",
                           "include": ["reasoning.encrypted_content"]}, frontend, _max)
    p = req.parsed
    assert p.params.cache_salt == "t1"
    assert p.kind == "response" and p.tool_format is not None
    assert p.tool_format.forced and p.tool_format.single and p.params.structured is not None
    assert (p.params.max_tokens, p.params.temperature, p.params.seed) == (7, 0.5, 3)
    assert req.echo["tools"] == tools and req.echo["store"] is False
    req = parse_responses({"input": "x", "tool_choice": None, "parallel_tool_calls": None},
                          frontend, _max)
    assert (req.echo["tool_choice"], req.echo["parallel_tool_calls"]) == ("auto", True)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    req = parse_responses({"input": "x", "text": {"format": {
        "type": "json_schema", "name": "s", "schema": schema}}}, frontend, _max)
    assert req.parsed.params.structured is not None and req.parsed.tool_format is None
    assert req.parsed.params.max_tokens == 64  # the router's default for the prompt


# -- output -------------------------------------------------------------------------------------

CALLS_TEXT = ('Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>')


def _events(chunks: list[str]) -> list[dict]:
    out = []
    for chunk in chunks:
        kind, data = chunk.split("\n", 1)
        body = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {body['type']}"
        out.append(body)
    return out


def _streamed(text: str, step: int, finish: str = "stop") -> tuple[list[dict], dict]:
    """The events of `text` streamed `step` characters a delta, and the whole response."""
    head = response_head("x", "m", response_echo({"input": "x"}))
    b = ResponseBuilder(head, HERMES, 5)
    chunks = b.start()
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        chunks += b.feed(Delta(0, piece, [1], finish_reason=finish if last else None))
    chunks += b.finish(Delta(0, "", finish_reason=finish, completion_tokens=len(pieces)))
    whole = whole_response(ResponseBuilder(head, HERMES, 5),
                           Delta(0, text, [1] * len(pieces), finish_reason=finish,
                                 completion_tokens=len(pieces)))
    return _events(chunks), whole


def _no_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_streamed_items_add_up_to_the_whole_response(step):
    """Text then two calls, streamed a few characters at a time: a message item and two
    function_call items whose deltas concatenate to the whole response's; sequence numbers
    count up; the last event holds the final response."""
    events, whole = _streamed(CALLS_TEXT, step)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    final = events[-1]["response"]
    assert _no_ids(final["output"]) == _no_ids(whole["output"])
    assert final["status"] == whole["status"] == "completed"
    msg, c1, c2 = final["output"]
    assert msg["type"] == "message" and msg["content"][0]["text"] == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in (c1, c2)] == \
        [("weather", {"city": "Paris"}), ("time", {})]
    assert c1["call_id"] != c2["call_id"] and all(c["status"] == "completed" for c in (c1, c2))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == msg["content"][0]["text"]
    for i, call in ((1, c1), (2, c2)):
        args = [e["delta"] for e in events
                if e["type"] == "response.function_call_arguments.delta" and e["output_index"] == i]
        assert "".join(args) == call["arguments"]
    Response.model_validate(final)  # the openai client's own type, strictly
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == ["message", "function_call", "function_call"] and done == [0, 1, 2]
    assert whole["usage"]["input_tokens"] == 5 and whole["usage"]["total_tokens"] == \
        5 + whole["usage"]["output_tokens"]


def test_a_cut_response_is_incomplete_and_whitespace_opens_no_message():
    events, whole = _streamed("\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": ", 4,
                              finish="length")
    assert whole["status"] == "incomplete"
    assert whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [item["type"] for item in whole["output"]] == ["function_call"]
    assert whole["output"][0]["status"] == "incomplete"
    assert events[-1]["type"] == "response.incomplete"


def test_text_after_a_call_drops_its_whitespace_and_a_blank_reply_is_a_message():
    text = ('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n\nDone.')
    _, whole = _streamed(text, 5)
    assert [i["type"] for i in whole["output"]] == ["function_call", "message"]
    assert whole["output"][1]["content"][0]["text"] == "Done."
    _, blank = _streamed(" \n", 1)
    assert [c["text"] for c in blank["output"][0]["content"]] == [" \n"]


# -- the route, fake workers, the real openai client ----------------------------------------------

@pytest.fixture(scope="module")
def served(frontend):
    ws = [FakeWorker("rp0", "prefill").start(), FakeWorker("rd0", "decode").start()]
    cfg = RouterConfig(block_size=16, retry_budget=2, router_id="router-responses")
    rt = RouterThread([FakeRef(w) for w in ws], frontend, cfg, api_key=KEY)
    client = openai.OpenAI(base_url=f"{rt.url}/v1", api_key=KEY, max_retries=0)
    yield rt, ws, client
    client.close()
    rt.stop()
    for w in ws:
        w.stop()


def test_openai_client_creates_and_streams_a_response(served, frontend):
    """The same prompt and text as the chat API's; 5 tokens of a longer answer: incomplete."""
    rt, ws, client = served
    chat = client.chat.completions.create(model=frontend.model_id, max_tokens=5, temperature=0,
                                          messages=[{"role": "user", "content": "Hello there"}])
    r = client.responses.create(model=frontend.model_id, input="Hello there",
                                max_output_tokens=5, temperature=0, metadata={"run": "1"})
    assert r.id.startswith("resp_") and r.object == "response" and r.model == frontend.model_id
    assert r.output_text == chat.choices[0].message.content and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens" and r.metadata == {"run": "1"}
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, 5)
    [item] = r.output
    assert item.type == "message" and item.status == "incomplete" and item.role == "assistant"
    # streamed: what OpenAI sends when max_output_tokens ends it (response.incomplete last;
    # the client's stream helper keeps get_final_response for response.completed)
    events = list(client.responses.create(model=frontend.model_id, input="Hello there",
                                          max_output_tokens=5, temperature=0, stream=True))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    final = events[-1]
    assert final.type == "response.incomplete" and final.response.status == "incomplete"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == final.response.output_text == r.output_text
    assert final.response.usage.output_tokens == 5
    assert all(not w.held for w in ws)  # prefill blocks released


def test_route_refuses_by_field_and_guards_the_key(served, frontend):
    rt, _, client = served
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=frontend.model_id, input="x", previous_response_id="r1")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:  # the prompt over the context
        client.responses.create(model=frontend.model_id, input="word " * 20_000)
    assert e.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as e:  # found by the router's length check
        client.responses.create(model=frontend.model_id, input="x", max_output_tokens=10**7)
    assert e.value.body["param"] == "max_output_tokens"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="x")
    r = httpx.post(f"{rt.url}/v1/responses", json={"input": "x"})
    assert r.status_code == 401


def test_a_failure_after_the_stream_began_ends_it_with_response_failed(served):
    """The decode worker fails after two tokens: an error event, then response.failed."""
    rt, ws, _ = served
    ws[1].fail_after_tokens = 2
    try:
        with httpx.stream("POST", f"{rt.url}/v1/responses", timeout=30,
                          headers={"Authorization": f"Bearer {KEY}"},
                          json={"input": "Hello", "stream": True, "max_output_tokens": 6}) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ")]
    finally:
        ws[1].fail_after_tokens = 0
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "worker_unavailable"
    assert events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"]["code"] == "server_error"  # OpenAI's codes only
    assert any(e["type"] == "response.output_text.delta" for e in events)
