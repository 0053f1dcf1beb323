"""Structured outputs and tools at the router (fake workers: validation is the router's):
every bad schema, grammar or tool is a 400 naming its field before any worker sees it, a
schema too slow to compile is a 400 at the deadline (not a hang), gRPC names the field too,
and good requests carry the grammar to the workers and tools into the chat template. What the
grammar does to real tokens is tested in tests/engine/test_structured.py,
tests/workers/test_structured_disagg.py and tests/router/test_e2e_serve.py."""
from __future__ import annotations

import json

import grpc
import httpx
import pytest

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pbg
from pdserve.proto.convert import params_to_proto
from pdserve.proto.rpc import make_channel
from pdserve.router.core import RouterConfig
from pdserve.router.protocol import parse_chat, parse_completion

from tests.engine.test_structured import SLOW_SCHEMA
from tests.router.fake_worker import FakeRef, FakeWorker
from tests.router.harness import RouterThread

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
BROKEN = {"type": "function", "function": {"name": "broken",
                                           "parameters": {"type": "objectx"}}}


def schema_format(schema: object, **extra: object) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, **extra}}


BAD_STRUCTURED = [
    # (path, body, param)
    (CHAT, {"response_format": "json"}, "response_format"),
    (CHAT, {"response_format": {"type": "xml"}}, "response_format.type"),
    (CHAT, {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (CHAT, {"response_format": schema_format("nope")}, "response_format.json_schema.schema"),
    (CHAT, {"response_format": schema_format({"type": "objectx"})},
     "response_format.json_schema.schema"),  # xgrammar refuses it
    (CHAT, {"response_format": schema_format({"type": "string", "pattern": "(("})},
     "response_format.json_schema.schema"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "bad name!", "schema": {}}}}, "response_format.json_schema.name"),
    (CHAT, {"response_format": schema_format({}, strict="yes")},
     "response_format.json_schema.strict"),
    (CHAT, {"structured_outputs": {"regex": "(("}}, "structured_outputs.regex"),
    (CHAT, {"structured_outputs": {"grammar": "root ::= undefined_rule"}},
     "structured_outputs.grammar"),
    (CHAT, {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    (CHAT, {"structured_outputs": {"choice": ["a", 5]}}, "structured_outputs.choice"),
    (CHAT, {"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    (CHAT, {"structured_outputs": {"json": {"type": 5}}}, "structured_outputs.json"),
    (CHAT, {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    (CHAT, {"structured_outputs": {}}, "structured_outputs"),
    (CHAT, {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "[a-"}},
     "structured_outputs.regex"),
    ("/v1/completions", {"prompt": "hi", "tools": [WEATHER]}, "tools"),
    (CHAT, {"tools": "get_weather"}, "tools"),
    (CHAT, {"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "has space"}}]},
     "tools[0].function.name"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools[0].function.parameters"),
    (CHAT, {"tools": [WEATHER, WEATHER]}, "tools"),
    (CHAT, {"tools": [WEATHER, BROKEN], "tool_choice": "required"},
     "tools[1].function.parameters"),  # the grammar compiles each tool's schema
    (CHAT, {"tools": [BROKEN], "tool_choice": {"type": "function",
                                               "function": {"name": "broken"}}},
     "tools[0].function.parameters"),
    (CHAT, {"tool_choice": "required"}, "tool_choice"),
    (CHAT, {"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    (CHAT, {"tools": [WEATHER], "tool_choice": {"type": "function",
                                                "function": {"name": "nope"}}}, "tool_choice"),
    (CHAT, {"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    (CHAT, {"tools": [WEATHER], "tool_choice": "required",
            "response_format": {"type": "json_object"}}, "response_format"),
    (CHAT, {"messages": [*MSGS, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
]


@pytest.fixture(scope="module")
def cluster(frontend):
    ws = [FakeWorker(wid, role).start() for wid, role in (("sp0", "prefill"), ("sd0", "decode"))]
    rt = RouterThread([FakeRef(w) for w in ws], frontend, RouterConfig(router_id="router-so"))
    client = httpx.Client(base_url=rt.url, timeout=60)
    yield rt, ws, client
    client.close()
    rt.stop()
    for w in ws:
        w.stop()


@pytest.mark.parametrize("path,body,param", BAD_STRUCTURED)
def test_bad_structured_output_or_tools_is_400_naming_the_field(cluster, path, body, param):
    _, ws, client = cluster
    prefills = sum(len(w.prefills) for w in ws)
    body = {"messages": MSGS, **body} if path == CHAT else body
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param + ": "), err
    assert sum(len(w.prefills) for w in ws) == prefills  # refused before dispatch


def test_schema_too_slow_to_compile_is_a_400_at_the_deadline(cluster):
    rt, _, client = cluster
    fe = rt.core.frontend
    fe.grammar_timeout_s = 0.05
    try:
        r = client.post(CHAT, json={"messages": MSGS, "response_format": schema_format(
            {**SLOW_SCHEMA, "title": "slow"})})
    finally:
        fe.grammar_timeout_s = 10.0
    assert r.status_code == 400 and r.elapsed.total_seconds() < 5, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format.json_schema.schema"
    assert "took longer than 0.05 s to compile" in err["message"]


def test_good_requests_carry_the_grammar_and_tools(cluster, frontend):
    _, _, client = cluster
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    parsed = parse_chat({"messages": MSGS, "response_format": schema_format(schema)},
                        frontend, lambda n: 8)
    msg = params_to_proto(parsed.params).structured_output  # what P and D get
    assert json.loads(msg.json_schema) == schema
    assert parse_completion({"prompt": "x", "structured_outputs": {"choice": ["y", "n"]}},
                            frontend).params.structured.choice == ("y", "n")
    forced = parse_chat({"messages": MSGS, "tools": [WEATHER], "tool_choice": "required"},
                        frontend, lambda n: 8)
    tag = json.loads(forced.params.structured.structural_tag)
    assert tag["format"]["at_least_one"] and forced.tool_format is not None
    # SmolLM2's template renders neither tools nor tool_calls: a system prompt offers them
    text = frontend.tokenizer.decode(forced.prompts[0], skip_special_tokens=False)
    assert "<tools>" in text and '"get_weather"' in text
    auto = parse_chat({"messages": MSGS, "tools": [WEATHER]}, frontend, lambda n: 8)
    assert auto.params.structured is None and auto.tool_format is not None
    none = parse_chat({"messages": MSGS, "tools": [WEATHER], "tool_choice": "none"},
                      frontend, lambda n: 8)
    assert none.tool_format is None and "<tools>" not in frontend.tokenizer.decode(
        none.prompts[0], skip_special_tokens=False)
    for body in ({"response_format": {"type": "json_object"}},
                 {"response_format": schema_format(schema)},
                 {"structured_outputs": {"regex": "[0-9]+"}},
                 {"tools": [WEATHER], "tool_choice": {"type": "function",
                                                      "function": {"name": "get_weather"}}}):
        r = client.post(CHAT, json={"messages": MSGS, "max_tokens": 3, **body})
        assert r.status_code == 200, (body, r.text)


def test_grpc_names_the_structured_output_field(cluster):
    rt, _, _ = cluster
    with make_channel(rt.grpc_address) as ch:
        stub = pbg.PdserveStub(ch)
        for so, field in ((pb.StructuredOutput(regex="(("), "regex"),
                          (pb.StructuredOutput(json_schema='{"type": "objectx"}'), "json_schema"),
                          (pb.StructuredOutput(choice=pb.ChoiceList()), "choice"),
                          (pb.StructuredOutput(regex=""), "regex")):
            req = pb.GenerateRequest(prompt="hi", params=pb.SamplingParams(structured_output=so))
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # the proto's field, not HTTP's structured_outputs.*
            assert e.value.details().split(":")[0] == f"params.structured_output.{field}", \
                e.value.details()
        ok = pb.GenerateRequest(prompt="hi", params=pb.SamplingParams(
            max_tokens=2, structured_output=pb.StructuredOutput(regex="[0-9]+")))
        assert list(stub.Generate(ok, timeout=30))[-1].finish_reason == "length"
