"""End to end: `pdserve serve` (1 prefill + 1 decode CPU workers on a local Ray) as a
subprocess, driven by the official `openai` client, raw HTTP and a gRPC client from proto/.

One cluster for the whole file (a start loads the model three times on 2 cores).
"""
from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import grpc
import httpx
import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel, Field

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pbg
from pdserve.proto.rpc import auth_metadata, make_channel

from tests.cluster_secret import SECRET
from tests.router.harness import (
    ServeProcess,
    listeners_of,
    pid_listening_on,
    wait_until,
    worker_rpcs_refused,
)
from tests.router.test_http_fake import BAD

pytestmark = pytest.mark.slow
KEY = "e2e-key"
# every name DESIGN.md (Observability) lists, prefixed pdserve:
DESIGN_NAMES = (
    "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "num_requests_running", "num_requests_waiting",
    "kv_cache_usage_perc", "prefix_cache_queries", "prefix_cache_hits",
    "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos", "stage_router_queue_seconds",
    "stage_prefill_queue_seconds", "stage_prefill_seconds", "stage_kv_transfer_seconds",
    "stage_decode_queue_seconds", "kv_transfer_bytes", "kv_transfer_failures", "kv_lease_expired",
    "router_retries",
    # and the rest of vLLM's per-request names (ANCHORS.md), from the workers
    "request_prefill_time_seconds", "request_decode_time_seconds",
    "request_time_per_output_token_seconds")
ROUTER_NAMES = ("time_to_first_token_seconds", "inter_token_latency_seconds",
                "e2e_request_latency_seconds", "request_queue_time_seconds", "num_requests_running",
                "num_requests_waiting", "stage_router_queue_seconds", "stage_prefill_queue_seconds",
                "stage_prefill_seconds", "stage_kv_transfer_seconds", "stage_decode_queue_seconds",
                "router_retries", "request_success", "prompt_tokens", "generation_tokens")


@pytest.fixture(scope="module")
def server():
    # MTP on (SmolLM2's shipped head, k=2): every test here runs the speculative path across
    # the split; test_e2e_failover.py's server runs without it
    srv = ServeProcess(["--prefill", "1", "--decode", "1", "--max-num-seqs", "64",
                        "--speculative", "mtp", "--num-speculative-tokens", "2"], api_key=KEY,
                       cluster_secret=SECRET)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def workers(server) -> dict[str, dict]:
    """worker id -> {role, grpc, metrics} as printed by `pdserve serve`, refreshed by /health."""
    out = {}
    for m in re.finditer(r"worker (\S+)\s+(\w+)\s+grpc (\S+)\s+metrics http://(\S+)/metrics",
                         server.output()):
        out[m.group(1)] = {"role": m.group(2), "grpc": m.group(3), "metrics": m.group(4)}
    return out


def worker_health(address: str) -> pb.HealthResponse:
    with make_channel(address, cluster_secret=SECRET) as ch:
        return pbg.WorkerStub(ch).Health(pb.HealthRequest(), timeout=10)


def idle(server) -> bool:
    """Nothing running, nothing pinned or held, every KV block free (cached counts as free)."""
    for w in workers(server).values():
        h = worker_health(w["grpc"])
        if h.num_running or h.num_waiting or h.num_pinned_blocks or h.num_held_requests \
                or h.num_free_blocks != h.num_total_blocks:
            return False
    return True


def test_openai_completions_and_chat(client):
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=48, temperature=0)
    assert "Paris" in chat.choices[0].message.content
    assert chat.usage.completion_tokens == chat.usage.total_tokens - chat.usage.prompt_tokens > 0
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=48, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content  # greedy: streamed == not streamed
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    comp = client.completions.create(model=model, prompt="The capital of France is",
                                     max_tokens=12, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=12, temperature=0, stream=True))
    assert comp.choices[0].text == streamed and comp.usage.completion_tokens <= 12


def test_assistant_prefill_continues_through_the_split(client, frontend):
    """vLLM's continue_final_message: the answer continues the assistant's own words, the
    same greedy text as /v1/completions on the prompt rendered that way."""
    from pdserve.router.frontend import TemplateOptions

    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is"}]
    chat = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=8, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    ids = frontend.encode_chat(msgs, options=TemplateOptions(add_generation_prompt=False,
                                                             continue_final_message=True))
    comp = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0)
    assert chat.usage.prompt_tokens == len(ids)
    assert chat.choices[0].message.content == comp.choices[0].text
    assert "Paris" in comp.choices[0].text


def test_min_tokens_holds_eos_back_on_both_sides_of_the_split(client):
    """P samples token 0 and D the rest: both ban EOS until min_tokens."""
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    plain = client.chat.completions.create(model=model, messages=msgs, max_tokens=40,
                                           temperature=0)
    n = plain.usage.completion_tokens
    assert plain.choices[0].finish_reason == "stop"
    held = client.chat.completions.create(model=model, messages=msgs, max_tokens=40,
                                          temperature=0, extra_body={"min_tokens": n + 4})
    assert held.usage.completion_tokens >= n + 4
    assert held.choices[0].message.content.startswith(plain.choices[0].message.content)


SCORED = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def offline_scored(frontend):
    """The offline engine's prompt logprobs (top 3, with ranks) of SCORED: the reference."""
    from pdserve.engine.core.sampling_params import SamplingParams
    from pdserve.engine.llm import LLM

    ids = frontend.encode_prompt(SCORED)
    [out] = LLM(None, device="cpu", dtype="float32").generate(
        [ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3))
    return ids, out.prompt_logprobs


def test_echo_with_logprobs_scores_the_prompt_through_the_split(server, client, offline_scored):
    """lm-eval-harness's loglikelihood request (echo, logprobs, max_tokens 1, or 0 for the
    prompt alone): the prompt leads the text and the logprobs, its first token without one;
    the prefill worker's prompt logprobs equal the offline engine's; streamed equals not
    streamed."""
    model = client.models.list().data[0].id
    ids, offline = offline_scored
    kw = dict(model=model, prompt=SCORED, max_tokens=1, temperature=0, echo=True, logprobs=2)
    comp = client.completions.create(**kw)
    lp = comp.choices[0].logprobs
    assert comp.choices[0].text.startswith(SCORED)
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and all(len(t) <= 3 for t in lp.top_logprobs[1:])
    assert all(top[tok] == v for tok, v, top in zip(lp.tokens[1:], lp.token_logprobs[1:],
                                                     lp.top_logprobs[1:]))  # the token's own
    assert lp.token_logprobs[1:len(ids)] == pytest.approx([c for _, c, *_ in offline], abs=1e-3)
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == comp.choices[0].text
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None
    plain = client.completions.create(model=model, prompt=SCORED, max_tokens=1, echo=True,
                                      temperature=0)
    assert plain.choices[0].text == comp.choices[0].text and plain.choices[0].logprobs is None
    zero = client.completions.create(**{**kw, "max_tokens": 0})  # the prompt alone
    assert zero.choices[0].text == SCORED and zero.usage.completion_tokens == 0
    assert zero.choices[0].logprobs.token_logprobs == lp.token_logprobs[:len(ids)]
    with make_channel(server.grpc_address) as ch:  # the gRPC face: prompt_logprobs as asked
        req = pb.GenerateRequest(prompt=SCORED, params=pb.SamplingParams(
            max_tokens=1, temperature=0, prompt_logprobs=2))
        [msg] = pbg.PdserveStub(ch).Generate(req, metadata=auth_metadata(KEY), timeout=120)
    assert [p.token_id for p in msg.prompt_logprobs] == ids[1:]
    assert [p.logprob for p in msg.prompt_logprobs] == pytest.approx(lp.token_logprobs[1:len(ids)],
                                                                     abs=1e-5)
    assert [p.rank for p in msg.prompt_logprobs] == [r for *_, r in offline]


def test_vllm_prompt_logprobs_field_through_the_split(client, frontend, offline_scored):
    """vLLM's prompt_logprobs (extra_body): per completion choice, and per chat response,
    None for the first prompt token, then {token id: {logprob, rank, decoded_token}} for the
    token itself and the top N, ranks as the offline engine's; echo's own top stays at its
    logprobs count (plus the token itself)."""
    model = client.models.list().data[0].id
    ids, offline = offline_scored
    comp = client.completions.create(model=model, prompt=SCORED, max_tokens=1, temperature=0,
                                     echo=True, logprobs=1, extra_body={"prompt_logprobs": 3})
    choice = comp.model_dump()["choices"][0]
    got = choice["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for pos, tok, (_, lp, alts, rank) in zip(got[1:], ids[1:], offline):
        assert pos[str(tok)]["logprob"] == pytest.approx(lp, abs=1e-3)
        assert pos[str(tok)]["rank"] == rank
        assert pos[str(tok)]["decoded_token"] == frontend.token_text(tok)
        assert {str(t) for t, _ in alts} <= set(pos) and len(pos) <= 4
        assert min(e["rank"] for e in pos.values()) == 1  # the top 3 were asked for
    assert all(len(t) <= 2 for t in choice["logprobs"]["top_logprobs"][1:])  # top 1 + own
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=model, messages=msgs, max_tokens=1,
                                          temperature=0, extra_body={"prompt_logprobs": 0})
    body = chat.model_dump()
    assert len(body["prompt_logprobs"]) == chat.usage.prompt_tokens
    assert body["prompt_logprobs"][0] is None
    assert all(len(pos) == 1 and next(iter(pos.values()))["rank"] >= 1
               for pos in body["prompt_logprobs"][1:])


def test_openai_n_stop_and_logprobs(client, frontend):
    model = client.models.list().data[0].id
    two = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, n=2,
                                    temperature=1.0, seed=3)
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert 2 <= two.usage.completion_tokens <= 16
    full = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=16,
                                     temperature=0).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    cut = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=16,
                                    temperature=0, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop)]
    assert cut.stop_reason == stop  # vLLM's field: the stop string that matched
    kept = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=16,
                                     temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == full[:full.index(stop) + len(stop)]  # through the split
    special = 1  # SmolLM2's <|im_start|>: a special token, not an end of output
    assert frontend.token_text(special) == "<|im_start|>"
    forced = dict(model=model, prompt="Hi", max_tokens=3, temperature=0,
                  logit_bias={str(special): 100})
    assert client.completions.create(**forced).choices[0].text == ""  # skipped by default
    shown = client.completions.create(**forced, extra_body={"skip_special_tokens": False})
    assert shown.choices[0].text == "<|im_start|>" * 3  # the prefill's token and decode's
    listed = client.completions.create(  # vLLM's allow-list, on both halves of the split
        model=model, prompt="Hi", max_tokens=6, temperature=1.0, seed=2, logprobs=0,
        extra_body={"allowed_token_ids": [28, 29, 30], "return_tokens_as_token_ids": True})
    assert {t for t in listed.choices[0].logprobs.tokens} <= {f"token_id:{i}" for i in (28, 29, 30)}
    # vLLM's bad_words, on both halves of the split: "5" is the greedy next word, and banned
    # it never comes, neither from the prefill worker (token 0) nor from decode
    [five] = frontend.tokenizer.encode("5", add_special_tokens=False)
    assert full.lstrip().startswith("5")
    banned = client.completions.create(
        model=model, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, logprobs=0,
        extra_body={"bad_words": ["5"], "return_tokens_as_token_ids": True}).choices[0]
    assert f"token_id:{five}" not in banned.logprobs.tokens and banned.text != full
    lp = client.completions.create(model=model, prompt="Hello", max_tokens=5, temperature=0,
                                   logprobs=2).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) <= 3 for t in lp.top_logprobs)
    hot = client.completions.create(model=model, prompt="Hello", max_tokens=12, temperature=1.5,
                                    seed=3, logprobs=1).choices[0].logprobs
    # OpenAI's legacy shape: the sampled token is always in its position's top_logprobs,
    # also where it is not the most likely (up to logprobs + 1 entries)
    assert all(top[tok] == v for tok, v, top in zip(hot.tokens, hot.token_logprobs,
                                                     hot.top_logprobs))
    assert any(len(top) == 2 for top in hot.top_logprobs)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and len(content[0].top_logprobs) <= 2


def test_grpc_streams_the_same_greedy_tokens(server, client):
    model = client.models.list().data[0].id
    http = client.completions.create(model=model, prompt="The capital of France is",
                                     max_tokens=10, temperature=0)
    with make_channel(server.grpc_address) as ch:
        stub = pbg.PdserveStub(ch)
        req = pb.GenerateRequest(prompt="The capital of France is",
                                 params=pb.SamplingParams(max_tokens=10, temperature=0))
        msgs = list(stub.Generate(req, metadata=auth_metadata(KEY), timeout=120))
        again = list(stub.Generate(req, metadata=auth_metadata(KEY), timeout=120))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, timeout=30))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "".join(m.text for m in msgs) == http.choices[0].text
    ids = [t for m in msgs for t in m.token_ids]
    assert ids == [t for m in again for t in m.token_ids]
    assert len(ids) == msgs[-1].usage.completion_tokens == http.usage.completion_tokens


def test_logit_bias_forces_and_bans_tokens_on_both_sides_of_the_split(server, client, frontend):
    """The prefill worker samples token 0 and the decode worker the rest: +100 makes every
    token the biased id, -100 bans the plain run's token 0 (P) and a later token (D). HTTP
    (the openai client's string keys) and gRPC (uint32 keys) give the same tokens."""
    model, prompt = client.models.list().data[0].id, "The capital of France is"
    forced = frontend.tokenizer.encode(" banana")[0]
    text = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0,
                                     logit_bias={str(forced): 100}).choices[0].text
    assert text == frontend.tokenizer.decode([forced] * 5)
    with make_channel(server.grpc_address) as ch:
        stub = pbg.PdserveStub(ch)

        def generate(bias: dict[int, float]) -> tuple[list[int], str]:
            req = pb.GenerateRequest(prompt=prompt, params=pb.SamplingParams(
                max_tokens=8, temperature=0, ignore_eos=True, logit_bias=bias))
            msgs = list(stub.Generate(req, metadata=auth_metadata(KEY), timeout=120))
            return [t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs)

        plain, _ = generate({})
        banned = {plain[0]: -100.0, plain[3]: -100.0}
        biased, biased_text = generate(banned)
    assert len(biased) == 8 and biased[0] != plain[0] and not set(biased) & set(banned)
    http = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True},
                                     logit_bias={str(t): b for t, b in banned.items()})
    assert http.choices[0].text == biased_text


class Pick(BaseModel):
    color: Literal["red", "green", "blue"]
    count: int = Field(ge=0, le=100)


class Item(BaseModel):
    name: str = Field(max_length=12)
    qty: int = Field(ge=1, le=9)


class Order(BaseModel):
    """Nested objects, an array, an enum, bounded numbers and a nullable field."""
    kind: Literal["pickup", "delivery"]
    items: list[Item] = Field(min_length=1, max_length=2)
    total: float = Field(ge=0, le=1000)
    note: str | None = Field(max_length=16)


# an optional property (not in "required"), for the raw json_schema path
ORDER_SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["pickup", "delivery"]},
    "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["name", "qty"], "additionalProperties": False}},
    "total": {"type": "integer", "minimum": 0, "maximum": 1000},
    "note": {"type": "string", "maxLength": 16}},
    "required": ["kind", "items", "total"], "additionalProperties": False}


def test_nested_schemas_validate_streamed_or_not(client):
    """chat.completions.parse with a nested pydantic model, and a raw json_schema with an
    optional property, streamed and not: every output validates against its schema."""
    import jsonschema

    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "Order two pizzas as JSON."}]
    done = client.chat.completions.parse(model=model, messages=msgs, response_format=Order,
                                         max_tokens=160, temperature=0)
    order = done.choices[0].message.parsed
    assert isinstance(order, Order) and done.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(done.choices[0].message.content), Order.model_json_schema())
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER_SCHEMA}}
    plain = client.chat.completions.create(model=model, messages=msgs, response_format=fmt,
                                           max_tokens=160, temperature=0)
    chunks = client.chat.completions.create(model=model, messages=msgs, response_format=fmt,
                                            max_tokens=160, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == plain.choices[0].message.content
    jsonschema.validate(json.loads(streamed), ORDER_SCHEMA)


def test_structured_outputs_through_the_split(server, client):
    """response_format (the openai client's parse with a pydantic model) and vLLM's
    structured_outputs: P samples token 0 under the grammar, D replays it and goes on."""
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "Pick a color and a count as JSON."}]
    done = client.chat.completions.parse(model=model, messages=msgs, response_format=Pick,
                                         max_tokens=48, temperature=0)
    assert isinstance(done.choices[0].message.parsed, Pick)
    assert done.choices[0].finish_reason == "stop"
    choice = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=16, temperature=0.7, seed=1,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe so"]}})
    assert choice.choices[0].message.content in ("yes", "no", "maybe so")
    with make_channel(server.grpc_address) as ch:
        req = pb.GenerateRequest(prompt="My phone number is", params=pb.SamplingParams(
            max_tokens=24, temperature=0, structured_output=pb.StructuredOutput(
                regex=r" [0-9]{3}-[0-9]{4}")))
        msgs_ = list(pbg.PdserveStub(ch).Generate(req, metadata=auth_metadata(KEY), timeout=120))
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", "".join(m.text for m in msgs_))


def test_responses_api_calls_tools_and_follows_a_schema(client):
    """/v1/responses on the real model: a forced call is a function_call item with arguments
    matching the tool's schema, streamed (the client's stream helper) to the same item; the
    call and its output go back as input items; text.format's schema holds (responses.parse)."""
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "name": "get_weather", "parameters": params}]
    model = client.models.list().data[0].id
    kw = dict(model=model, input="What is the weather in Paris?", tools=tools,
              tool_choice="required", parallel_tool_calls=False, max_output_tokens=48,
              temperature=0)
    r = client.responses.create(**kw)
    [call] = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), params)
    with client.responses.stream(**kw) as stream:
        final = stream.get_final_response()
    [streamed] = [item for item in final.output if item.type == "function_call"]
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)
    follow = client.responses.create(model=model, tools=tools, max_output_tokens=8,
                                     temperature=0, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert follow.status in ("completed", "incomplete") and follow.output

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)  # bounded: a tiny model may not stop by itself

    parsed = client.responses.parse(model=model, input="Describe Paris as JSON.",
                                    text_format=City, max_output_tokens=64, temperature=0)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, City)


def test_forced_tool_calls_parse_and_stream(client):
    """tool_choice "required" and a named function: the call's arguments are JSON matching
    the tool's schema (the grammar forced them), finish_reason "tool_calls" ("stop" for a
    named function, as OpenAI and vLLM say), and the streamed tool-call deltas assemble into
    the same call."""
    params = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}},
             {"type": "function", "function": {"name": "get_time", "parameters": {
                 "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                 "required": ["zone"]}}}]
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kw = dict(model=model, messages=msgs, tools=tools, tool_choice=choice, max_tokens=64,
                  temperature=0, parallel_tool_calls=False)
        out = client.chat.completions.create(**kw).choices[0]
        [call] = out.message.tool_calls
        want_finish = "tool_calls" if choice == "required" else "stop"
        assert out.finish_reason == want_finish and call.id.startswith("call_")
        if choice != "required":
            assert call.function.name == "get_weather"
        schema = next(t["function"]["parameters"] for t in tools
                      if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), schema)
        streamed: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(**kw, stream=True):
            delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
            for tc in delta.tool_calls or []:
                acc = streamed.setdefault(tc.index, {"name": "", "arguments": ""})
                acc["name"] += tc.function.name or ""
                acc["arguments"] += tc.function.arguments or ""
        assert streamed == {0: {"name": call.function.name,
                                "arguments": call.function.arguments}}
        assert finish == want_finish
    # the call and its result go back through the chat template (SmolLM2's renders neither
    # tools nor tool_calls: they are rendered in the call format)
    follow = client.chat.completions.create(model=model, tools=tools, max_tokens=8,
                                            temperature=0, messages=[
        *msgs, {"role": "assistant", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("path,body,status,param", BAD)
def test_bad_input_statuses(server, path, body, status, param):
    headers = {**server.headers(), "Content-Type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, headers=headers, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_size_limit_auth_and_still_serving(server, client):
    big = json.dumps({"prompt": "x" * (9 << 20)}).encode()
    r = httpx.post(server.url + "/v1/completions", content=big, headers=server.headers(), timeout=60)
    assert r.status_code == 413
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    out = client.completions.create(model=client.models.list().data[0].id, prompt="hi",
                                    max_tokens=2)
    assert out.choices[0].finish_reason in ("length", "stop")


def test_disconnect_mid_stream_frees_both_sides(server):
    wait_until(lambda: idle(server), 60, "cluster idle before the test")
    d = next(w for w in workers(server).values() if w["role"] == "decode")
    body = {"prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=120) as c:
        with c.stream("POST", server.url + "/v1/completions", json=body,
                      headers=server.headers()) as r:
            seen = []
            for line in r.iter_lines():  # leaving this loop closes the connection
                seen += [line] if line else []
                if len(seen) >= 3:
                    assert all('"error"' not in x for x in seen), seen
                    assert worker_health(d["grpc"]).num_running == 1, seen
                    break
    # the abort reached the decode worker: its 2000-token run (a minute and more on CPU)
    # stops within the deadline (a bound, not a speed claim: loaded CI machines vary)
    wait_until(lambda: worker_health(d["grpc"]).num_running == 0, 10, "decode to stop")
    wait_until(lambda: idle(server), 10, "pinned/used blocks back to idle on both sides")


def test_200_concurrent_streams_complete(server):
    async def one(c: httpx.AsyncClient, i: int) -> tuple[str, str]:
        body = {"prompt": f"Count to {i}:", "max_tokens": 6, "temperature": 0, "stream": True}
        reason, done = "", False
        async with c.stream("POST", server.url + "/v1/completions", json=body,
                            headers=server.headers()) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    reason = event["choices"][0]["finish_reason"] or reason
        return reason, "done" if done else "no [DONE]"

    async def main():
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        async with httpx.AsyncClient(timeout=600, limits=limits) as c:
            return await asyncio.gather(*(one(c, i) for i in range(200)))

    results = asyncio.run(main())
    assert len(results) == 200
    assert all(reason in ("length", "stop") and done == "done" for reason, done in results), results
    wait_until(lambda: idle(server), 30, "no blocks left after the burst")


def test_metrics_expose_every_design_name(server):
    def names(url: str) -> set[str]:
        text = httpx.get(url, timeout=10).text
        # counters are typed under their sample name (x_total); compare base names
        return {re.sub(r"_total$", "", m.group(1))
                for m in re.finditer(r"^# TYPE pdserve:(\S+)", text, re.M)}
    router = names(server.url + "/metrics")
    assert not set(ROUTER_NAMES) - router, f"router lacks {set(ROUTER_NAMES) - router}"
    seen = set(router)
    for wid, w in workers(server).items():
        got = names(f"http://{w['metrics']}/metrics")
        seen |= got
        need = {"time_to_first_token_seconds", "num_requests_running", "kv_cache_usage_perc",
                "prefix_cache_queries", "prefix_cache_hits", "kv_lease_expired"}
        assert not need - got, f"{wid} lacks {need - got}"
    missing = set(DESIGN_NAMES) - seen
    assert not missing, f"no process exports {sorted(missing)}"


def test_worker_rpcs_need_the_cluster_secret(server, client):
    """Every worker RPC, Health included, refuses a caller without the cluster credential
    (none, a wrong one, the client API key); the router, which has it, still serves."""
    ws = workers(server)
    assert {w["role"] for w in ws.values()} == {"prefill", "decode"}
    wrong = ("x-pdserve-cluster-secret", "not-the-secret-but-long-enough")
    for w in ws.values():
        for metadata in ((), (wrong,), auth_metadata(KEY)):
            codes = worker_rpcs_refused(w["grpc"], metadata)
            assert set(codes) == {"Prefill", "Decode", "GetPeerInfo", "AddPeer", "Release",
                                  "Abort", "Health"}
            assert set(codes.values()) == {"UNAUTHENTICATED"}, (w["role"], metadata, codes)
    assert worker_health(ws["prefill-0"]["grpc"]).status == "ok"  # with the secret: answered
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="The capital of France is",
                                    max_tokens=4, temperature=0)
    assert out.usage.completion_tokens >= 1


def test_kv_memory_needs_the_metadata_only_peers_get(server):
    """A NIXL agent built from scratch cannot get the prefill worker's NIXL metadata without
    the cluster secret; with it (as a peer the router introduced), the same agent can READ
    the worker's KV memory -- which is what the secret keeps from everyone else."""
    from nixl._api import nixl_agent, nixl_agent_config

    from pdserve.kv_transfer.handshake import PeerInfo

    address = workers(server)["prefill-0"]["grpc"]
    agent = nixl_agent("intruder", nixl_agent_config(backends=["UCX"]))
    with make_channel(address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pbg.WorkerStub(ch).GetPeerInfo(pb.GetPeerInfoRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # the positive control: the metadata is all the agent needs
    with make_channel(address, cluster_secret=SECRET) as ch:
        msg = pbg.WorkerStub(ch).GetPeerInfo(pb.GetPeerInfoRequest(), timeout=10)
    info = PeerInfo.from_bytes(msg.transport_info)
    name = agent.add_remote_agent(info.agent_metadata)
    local = torch.zeros(info.layout.block_bytes, dtype=torch.uint8)
    reg = agent.register_memory(local)
    src = agent.get_xfer_descs(local)
    dst = agent.get_xfer_descs([(info.kv_base_addr, local.numel(), 0)], "DRAM")
    handle = agent.initialize_xfer("READ", src, dst, name)
    assert agent.transfer(handle) in ("PROC", "DONE")
    wait_until(lambda: agent.check_xfer_state(handle) == "DONE", 30, "the READ to finish")
    agent.release_xfer_handle(handle)
    agent.remove_remote_agent(name)
    agent.deregister_memory(reg)


def test_ucx_listens_only_on_the_worker_interface(server):
    """Each worker process listens on 127.0.0.1 (its gRPC, metrics and UCX/NIXL sockets);
    the only other listener is Ray's core-worker port on the wildcard address, guarded by
    Ray's token. Before, UCX also listened on the machine's external address."""
    for wid, w in workers(server).items():
        pid = pid_listening_on(w["grpc"])
        addrs = listeners_of(pid)
        ours = {w["grpc"], w["metrics"]}
        ucx = [a for a in addrs if a.startswith("127.0.0.1:") and a not in ours]
        assert ucx, f"{wid}: no UCX listener on 127.0.0.1 among {addrs}"
        outside = [a for a in addrs if not a.startswith("127.0.0.1:")
                   and not a.startswith(("*:", "0.0.0.0:", "[::]:"))]
        assert not outside, f"{wid} listens outside 127.0.0.1: {outside} (all: {addrs})"
        wildcard = [a for a in addrs if a.startswith(("*:", "0.0.0.0:", "[::]:"))]
        assert len(wildcard) <= 1, f"{wid}: more than Ray's own port on the wildcard: {addrs}"


def test_sigterm_drains_then_exits(server):
    """Last test: a request in flight at SIGTERM finishes; new ones get 503; exit code 0."""
    body = {"prompt": "Write a poem.", "max_tokens": 40, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as c:
        with c.stream("POST", server.url + "/v1/completions", json=body,
                      headers=server.headers()) as r:
            lines = r.iter_lines()
            next(lines)
            server.proc.send_signal(15)
            wait_until(lambda: httpx.get(server.url + "/health", timeout=5).status_code == 503, 10,
                       "/health to report draining")
            late = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"},
                              headers=server.headers(), timeout=10)
            assert late.status_code == 503 and "retry-after" in late.headers
            rest = [x for x in lines if x]
    assert rest[-1] == "data: [DONE]" and not any('"error"' in x for x in rest)
    assert server.proc.wait(120) == 0
    assert "draining" in server.output()
