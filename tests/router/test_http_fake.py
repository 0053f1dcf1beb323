"""The HTTP face against in-process fake workers (real gRPC, real HTTP, fake model):
OpenAI shapes, streaming, n, logprobs, usage, request ids, auth, bad input, overload, drain."""
from __future__ import annotations

import dataclasses
import json
import re
import threading
import time

import grpc
import httpx
import pytest

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pbg
from pdserve.proto.convert import params_to_proto
from pdserve.proto.rpc import auth_metadata, make_channel
from pdserve.router.core import RouterConfig
from pdserve.router.protocol import parse_chat, parse_completion

from tests.router.fake_worker import FakeRef, FakeWorker
from tests.router.harness import RouterThread, wait_until

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def cluster(frontend):
    ws = {wid: FakeWorker(wid, role).start()
          for wid, role in (("hp0", "prefill"), ("hp1", "prefill"), ("hd0", "decode"))}
    cfg = RouterConfig(block_size=16, retry_budget=2, router_id="router-http")
    rt = RouterThread([FakeRef(w) for w in ws.values()], frontend, cfg, api_key=KEY,
                      max_body_bytes=64 * 1024)
    client = httpx.Client(base_url=rt.url, headers=AUTH, timeout=30)
    yield rt, ws, client
    client.close()
    rt.stop()
    for w in ws.values():
        w.stop()


def expected_text(frontend, prompt: str, n: int) -> str:
    last = frontend.encode_prompt(prompt)[-1]
    return "".join(f" t{last + 1 + i}" for i in range(n))


def sse_events(resp: httpx.Response) -> list:
    events = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_completion_shape_usage_and_request_id(cluster, frontend):
    rt, ws, client = cluster
    r = client.post("/v1/completions", headers={"X-Request-Id": "my-req-1"},
                    json={"model": frontend.model_id, "prompt": "Hello there", "max_tokens": 5,
                          "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "my-req-1"
    body = r.json()
    assert body["object"] == "text_completion" and body["id"] == "cmpl-my-req-1"
    [choice] = body["choices"]
    assert choice["text"] == expected_text(frontend, "Hello there", 5)
    assert choice["finish_reason"] == "length"
    n_prompt = len(frontend.encode_prompt("Hello there"))
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 5,
                             "total_tokens": n_prompt + 5, "prompt_tokens_details": {"cached_tokens": 0}}
    assert r2_id(client) != r2_id(client)  # assigned ids are unique
    assert all(not w.held for w in ws.values())  # prefill blocks released


def test_integral_floats_are_integers(cluster, frontend):
    """max_tokens 5.0 (a client's arithmetic) is 5, as vLLM's pydantic models take it."""
    _, _, client = cluster
    r = client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 5.0,
                                             "n": 1.0, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected_text(frontend, "Hello there", 5)
    assert r.json()["usage"]["completion_tokens"] == 5


def test_body_request_id_names_the_request_unless_the_header_does(cluster, frontend):
    """vLLM's request_id field: the completion's id and X-Request-Id, when no header came;
    and the other vLLM switches taken now (add_special_tokens, reasoning_effort)."""
    _, _, client = cluster
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2,
                                             "request_id": "from-body-1"})
    assert r.headers["x-request-id"] == "from-body-1" and r.json()["id"] == "cmpl-from-body-1"
    r = client.post("/v1/completions", headers={"X-Request-Id": "from-header"},
                    json={"prompt": "Hi", "max_tokens": 2, "request_id": "from-body-2"})
    assert r.headers["x-request-id"] == "from-header" and r.json()["id"] == "cmpl-from-header"
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2,
                                             "add_special_tokens": False, "echo": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("Hi")
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        "reasoning_effort": "low"})
    assert r.status_code == 200, r.text


def test_echo_with_max_tokens_zero_returns_the_prompt_alone(cluster, frontend):
    """lm-eval-harness's loglikelihood request (echo, max_tokens 0): the prompt alone, no
    completion tokens, finish_reason length; streamed the same; max_tokens 0 without echo, or
    with min_tokens, is refused naming the field."""
    _, _, client = cluster
    body = {"prompt": "Hello there", "max_tokens": 0, "echo": True,
            "stream_options": None}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    assert choice["text"] == "Hello there" and choice["finish_reason"] == "length"
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] > 0
    with client.stream("POST", "/v1/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True}}) as s:
        events = sse_events(s)
    chunks = [e for e in events[:-1] if e["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello there"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == 0 and events[-1] == "[DONE]"
    for bad, field in (({"echo": False}, "max_tokens"), ({"min_tokens": 1}, "min_tokens")):
        r = client.post("/v1/completions", json={**body, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    # a prompt of the whole context leaves no room for the token scoring runs past it: the
    # prompt is named, not the max_tokens the router runs it with (1)
    full = {**body, "prompt": [1] * frontend.max_model_len}
    r = client.post("/v1/completions", json=full)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt", r.text
    assert "max_tokens (1)" not in err["message"] and "max_tokens 0" in err["message"]


def r2_id(client) -> str:
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    return r.headers["x-request-id"]


def test_streaming_completion_ends_with_done_and_usage(cluster, frontend):
    _, _, client = cluster
    body = {"prompt": "Hello there", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    text = "".join(e["choices"][0]["text"] for e in events[:-2])
    assert text == expected_text(frontend, "Hello there", 4)
    assert events[-3]["choices"][0]["finish_reason"] == "length"


def test_continuous_usage_stats_put_usage_so_far_in_every_chunk(cluster):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): each chunk's usage
    counts its choice's tokens so far (n = 2: per choice); the last chunk still sums all."""
    _, _, client = cluster
    body = {"prompt": "Hello there", "max_tokens": 4, "n": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        events = sse_events(r)
    per_choice: dict[int, list[int]] = {0: [], 1: []}
    for e in events[:-2]:
        u = e["usage"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] > 0
        per_choice[e["choices"][0]["index"]].append(u["completion_tokens"])
    assert all(c == sorted(c) and c[-1] == 4 for c in per_choice.values()), per_choice
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 8
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with client.stream("POST", "/v1/chat/completions", json=chat) as r:
        events = sse_events(r)
    assert events[0]["usage"]["completion_tokens"] == 0  # the role chunk
    assert events[-3]["usage"]["completion_tokens"] == 3
    body["stream_options"] = {"continuous_usage_stats": True}  # without include_usage: none
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert all("usage" not in e for e in sse_events(r)[:-1])


def test_return_tokens_as_token_ids_names_logprobs_tokens_by_id(cluster, frontend):
    """vLLM's return_tokens_as_token_ids: logprobs' tokens (and top keys) read "token_id:N",
    in completions and chat, whole and streamed; the text itself is unchanged."""
    _, _, client = cluster
    body = {"prompt": "Hello there", "max_tokens": 3, "logprobs": 1,
            "return_tokens_as_token_ids": True}
    r = client.post("/v1/completions", json=body).json()
    last = frontend.encode_prompt("Hello there")[-1]
    want = [f"token_id:{last + 1 + i}" for i in range(3)]
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"] == want and r["choices"][0]["text"] == expected_text(
        frontend, "Hello there", 3)
    assert all(set(top) == {tok} for tok, top in zip(want, lp["top_logprobs"]))
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        streamed = [t for e in sse_events(s)[:-1] for t in e["choices"][0]["logprobs"]["tokens"]]
    assert streamed == want
    chat = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
        "top_logprobs": 1, "return_tokens_as_token_ids": True}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert all(c["token"].startswith("token_id:") and
               c["bytes"] == list(c["token"].encode()) for c in content)


def test_return_token_ids_gives_output_and_prompt_ids_whole_and_streamed(cluster, frontend):
    """vLLM's return_token_ids: completions put prompt_token_ids and token_ids in each choice;
    chat puts prompt_token_ids in the response and token_ids in each choice. Streamed, the
    prompt's ids come once (a completion choice's first chunk, a chat stream's first chunk),
    each chunk's token_ids are its own. Without the field, none of them."""
    _, _, client = cluster
    prompt = frontend.encode_prompt("Hello there")
    want = [prompt[-1] + 1 + i for i in range(3)]
    body = {"prompt": "Hello there", "max_tokens": 3, "n": 2, "return_token_ids": True}
    r = client.post("/v1/completions", json=body).json()
    for c in r["choices"]:
        assert c["token_ids"] == want and c["prompt_token_ids"] == prompt
    plain = client.post("/v1/completions", json={**body, "return_token_ids": False}).json()
    assert all("token_ids" not in c and "prompt_token_ids" not in c for c in plain["choices"])
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as st:
        events = sse_events(st)[:-1]
    for i in (0, 1):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == i]
        assert [c.get("prompt_token_ids") for c in mine] == [prompt] + [None] * (len(mine) - 1)
        assert [t for c in mine for t in c["token_ids"]] == want
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "return_token_ids": True}
    whole = client.post("/v1/chat/completions", json=chat).json()
    assert len(whole["prompt_token_ids"]) == whole["usage"]["prompt_tokens"]
    ids = whole["choices"][0]["token_ids"]
    assert len(ids) == 2 and ids[0] == whole["prompt_token_ids"][-1] + 1
    with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as st:
        events = sse_events(st)[:-1]
    assert events[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in e for e in events[1:])
    assert [t for e in events for t in e["choices"][0].get("token_ids", [])] == ids


def test_truncate_prompt_tokens_keeps_the_last_k(cluster, frontend):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens are what the model reads
    (usage counts them; echo shows them); -1 keeps up to the context length."""
    _, _, client = cluster
    prompt = "one two three four five six seven eight"
    ids = frontend.encode_prompt(prompt)
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "echo": True,
                                             "truncate_prompt_tokens": 3}).json()
    assert r["usage"]["prompt_tokens"] == 3
    assert r["choices"][0]["text"].startswith(frontend.tokenizer.decode(ids[-3:]))
    whole = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1,
                                                 "truncate_prompt_tokens": -1}).json()
    assert whole["usage"]["prompt_tokens"] == len(ids)
    chat = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 1,
        "truncate_prompt_tokens": 4}).json()
    assert chat["usage"]["prompt_tokens"] == 4


def test_chat_stream_role_first_then_content(cluster):
    _, _, client = cluster
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = sse_events(r)
    assert events[0]["object"] == "chat.completion.chunk"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "usage" not in events[0]  # only with stream_options.include_usage
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1])
    assert content.count(" t") == 3 and events[-1] == "[DONE]"


def test_stop_reason_names_the_stop_token_on_every_face(cluster, frontend):
    """vLLM's stop_reason: the stop token (or string) that ended a choice, null otherwise;
    in completions, chat, the last chunk of a chat stream, and gRPC's last message. (Stop
    strings through real workers: tests/router/test_e2e_serve.py.)"""
    _, _, client = cluster
    stop = frontend.encode_prompt("Hello there")[-1] + 2  # the second token the fake makes
    done = client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 6,
                                                "stop_token_ids": [stop]}).json()["choices"][0]
    assert done["finish_reason"] == "stop" and done["stop_reason"] == stop
    assert done["text"] == expected_text(frontend, "Hello there", 2)
    plain = client.post("/v1/completions", json={"prompt": "Hello there",
                                                 "max_tokens": 3}).json()["choices"][0]
    assert plain["finish_reason"] == "length" and plain["stop_reason"] is None
    msgs = [{"role": "user", "content": "hi"}]
    stop = client.post("/tokenize", json={"messages": msgs}).json()["tokens"][-1] + 2
    body = {"messages": msgs, "max_tokens": 6, "stop_token_ids": [stop]}
    chat = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert chat["finish_reason"] == "stop" and chat["stop_reason"] == stop
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        events = sse_events(r)
    final = events[-2]["choices"][0]
    assert final["finish_reason"] == "stop" and final["stop_reason"] == stop
    stop = frontend.encode_prompt("Hello there")[-1] + 2
    with make_channel(cluster[0].grpc_address) as ch:
        req = pb.GenerateRequest(prompt="Hello there", params=pb.SamplingParams(
            max_tokens=6, stop_token_ids=[stop]))
        msgs = list(pbg.PdserveStub(ch).Generate(req, metadata=auth_metadata(KEY), timeout=30))
    assert msgs[-1].finish_reason == "stop" and msgs[-1].stop_token_id == stop


def test_grpc_refusals_count_as_failures_once(cluster):
    """Refused while parsing (no prompt) or at admission (a bad timeout_s): counted once."""
    rt, _, _ = cluster
    with make_channel(rt.grpc_address) as ch:
        stub = pbg.PdserveStub(ch)
        for req, field in ((pb.GenerateRequest(), "prompt"),
                           (pb.GenerateRequest(prompt="hi", timeout_s=-1), "timeout_s")):
            before = _failures(rt)
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, metadata=auth_metadata(KEY), timeout=10))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith(field), e.value.details()
            assert _failures(rt) == before + 1


def test_n2_seeded_choices_differ_and_logprobs(cluster):
    _, _, client = cluster
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "n": 2,
                                             "seed": 7, "logprobs": 1})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    texts = [c["text"] for c in body["choices"]]
    assert texts[0] != texts[1] and texts[0] == " t8 t9 t10"
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 3 and lp["token_logprobs"] == [-0.5] * 3
    assert lp["text_offset"] == [0, len(lp["tokens"][0]), len(lp["tokens"][0]) + len(lp["tokens"][1])]
    assert body["usage"]["completion_tokens"] == 6
    chat = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
        "top_logprobs": 1}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and content[0]["top_logprobs"][0]["logprob"] == -0.5


def nested(depth: int) -> list:
    value: list = ["x"]
    for _ in range(depth - 1):
        value = [value]
    return value


BAD = [
    # (path, body or raw bytes, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b"\xff\xfe{}", 400, None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/chat/completions", {"max_tokens": 3}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10_000_000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    # a prompt over the context: named as the client sent it
    ("/v1/completions", {"prompt": "hello " * 9000}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 9000}]}, 400,
     "messages"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "seed": 1e300}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    # integers the wire cannot carry (proto uint32 / int32 / int64): 400, not a 500
    ("/v1/completions", {"prompt": "hi", "seed": 2**63}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": -(2**63) - 1}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2**40]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "top_k": 2**31}, 400, "top_k"),
    # nesting beyond the decoder's recursion limit, and beyond the router's bound
    ("/v1/completions", b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", 400, None),
    ("/v1/completions", {"prompt": "hi", "user": nested(34)}, 400, "user"),
    # lone surrogates (JSON \ud800 escapes) in the prompt, a message's content, a stop string
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400, "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400,
     "messages[0].content"),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["ok", "\\ud83d"]}', 400, "stop[1]"),
    # logit_bias: keys are token ids as decimal strings, values biases in [-100, 100]
    *[("/v1/completions", {"prompt": "hi", "logit_bias": bias}, 400, "logit_bias") for bias in (
        {"abc": 1}, {"-1": 1}, {"1.5": 1}, {"": 1}, {" 5": 1}, {"\u0661": 1},  # Arabic-Indic 1
        {str(2**20): 1}, {"4294967296": 1}, {"123456789012345": 1},  # past the vocabulary
        {"5": "x"}, {"5": None}, {"5": True}, {"5": [1]}, {"5": 100.5}, {"5": -101},
        [5], "5", 5, {str(i): 1 for i in range(301)})],
    # Python's JSON decoder reads these non-standard literals as floats
    *[("/v1/completions", b'{"prompt": "hi", "logit_bias": {"5": %s}}' % v, 400, "logit_bias")
      for v in (b"NaN", b"Infinity", b"-Infinity")],
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "logit_bias": {"7": -100.01}}, 400, "logit_bias"),
    # fields other servers take and pdserve does not: refused by name, never ignored
    *[("/v1/completions", {"prompt": "hi", name: value}, 400, name) for name, value in (
        ("echo", "yes"), ("suffix", "x"),
        ("prompt_logprobs", -1), ("prompt_logprobs", 21), ("prompt_logprobs", "2"),
        ("min_tokens", 17), ("min_tokens", -1),  # above the default max_tokens (16), negative
        ("use_beam_search", True), ("include_stop_str_in_output", "yes"),
        ("guided_json", {"type": "object"}), ("guided_regex", "a+"), ("guided_choice", ["a"]),
        ("guided_grammar", "root ::= 'a'"), ("best_of", 3),
        ("allowed_token_ids", "28"), ("allowed_token_ids", [10 ** 9]), ("bad_words", "5"),
        ("bad_words", [""]), ("bad_words", [5]), ("bad_words", [f"w{i}" for i in range(200)]),
        ("truncate_prompt_tokens", 0),
        ("truncate_prompt_tokens", -2), ("truncate_prompt_tokens", 10 ** 9),
        ("return_tokens_as_token_ids", "yes"), ("skip_special_tokens", 0),
        ("spaces_between_special_tokens", False), ("length_penalty", 0.5), ("priority", 1),
        ("cache_salt", ""), ("cache_salt", 7), ("cache_salt", "s" * 1025),
        ("return_token_ids", "yes"), ("request_id", "a b"),
        ("request_id", 7), ("logits_processors", ["x"]),
        ("kv_transfer_params", {"do_remote_decode": True}), ("add_special_tokens", "no"),
        ("top_logprobs", 2))],
    ("/v1/completions", {"prompt": "hi", "stream": True,
                         "stream_options": {"continuous_usage_stats": "yes"}}, 400,
     "continuous_usage_stats"),
    *[("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], name: value},
       400, name) for name, value in (
        ("chat_template", "{{ messages }}"), ("functions", [{"name": "f"}]),
        ("function_call", "auto"), ("add_generation_prompt", "no"), ("echo", True),
        ("chat_template_kwargs", ["x"]), ("chat_template_kwargs", {"messages": []}),
        # continue_final_message: with the generation prompt on, or after a user message
        ("continue_final_message", True), ("add_special_tokens", True),
        ("documents", [{"text": "d"}]), ("reasoning_effort", 3))],
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "continue_final_message": True, "add_generation_prompt": False},
     400, "continue_final_message"),
    # vLLM's prompt_logprobs: not with stream (vLLM refuses it too)
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, 400,
     "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "prompt_logprobs": 0, "stream": True}, 400, "prompt_logprobs"),
]


@pytest.mark.parametrize("path,body,status,param", BAD)
def test_bad_input_gets_4xx_naming_the_field(cluster, path, body, status, param):
    rt, _, client = cluster
    before, client_errors = _failures(rt), _failures(rt, "invalid_request")
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    assert _failures(rt) == before + 1  # refused before dispatch, still counted once
    # as the client's (a 404 too), which the error-rate alert leaves out
    assert _failures(rt, "invalid_request") == client_errors + 1
    ok = client.post("/v1/completions", json={"prompt": "still serving", "max_tokens": 2})
    assert ok.status_code == 200


def _failures(rt, code: str | None = None) -> float:
    """pdserve:request_failures_total over all its codes (or one)."""
    text = httpx.get(rt.url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve:request_failures_total{")
               and (code is None or f'code="{code}"' in line))


def test_logit_bias_parsed_served_and_errors_name_the_key(cluster, frontend):
    """Good logit_bias bodies parse to {int: float} and are served on both endpoints; a bad
    one's message names the offending key. (The fake model ignores the bias: that it changes
    tokens is shown on the real engine, tests/engine/test_logit_bias.py and
    tests/workers/test_logit_bias_disagg.py.)"""
    _, _, client = cluster
    bias = {"5": 10, "0017": -100, str(frontend.config.vocab_size - 1): 0.5}
    want = {5: 10.0, 17: -100.0, frontend.config.vocab_size - 1: 0.5}
    parsed = parse_completion({"prompt": "hi", "logit_bias": bias}, frontend)
    assert parsed.params.logit_bias == want
    assert dict(params_to_proto(parsed.params).logit_bias) == want  # what the workers get
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}], "logit_bias": bias},
                      frontend, lambda n: 8)
    assert chat.params.logit_bias == want
    assert parse_completion({"prompt": "hi", "logit_bias": {}}, frontend).params.logit_bias is None
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "logit_bias": bias})
    assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                  "max_tokens": 3, "logit_bias": bias})
    assert r.status_code == 200, r.text
    for bad, says in (({"abc": 1}, 'logit_bias["abc"]: keys must be token ids'),
                      ({"99999999": 1}, f'logit_bias["99999999"]: keys must be token ids, '
                                        f'integers in [0, {frontend.config.vocab_size})'),
                      ({"3": 250}, 'logit_bias["3"]: must be a number in [-100, 100], got 250'),
                      ({str(i): 1 for i in range(301)}, "logit_bias: at most 300 entries")):
        r = client.post("/v1/completions", json={"prompt": "hi", "logit_bias": bad})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(says), r.text


def test_bad_words_become_token_sequences_with_and_without_a_leading_space(frontend):
    """vLLM's bad_words: each word tokenized as written and after a space, duplicates
    dropped, on the wire as sequences for both halves of the split."""
    tok = frontend.tokenizer
    parsed = parse_completion({"prompt": "hi", "bad_words": ["hello", " hello", "big cat"]},
                              frontend)
    want = {tuple(tok.encode(t, add_special_tokens=False))
            for t in ("hello", " hello", "big cat", " big cat")}
    got = parsed.params.bad_words_token_ids
    assert set(got) == want and len(got) == len(want)
    wire = params_to_proto(parsed.params).bad_words
    assert {tuple(q.token_ids) for q in wire} == want
    assert parse_completion({"prompt": "hi", "bad_words": []},
                            frontend).params.bad_words_token_ids is None


def test_grpc_refuses_what_http_refuses_and_reports_health_alike(cluster):
    """n over HTTP's limit and request ids HTTP would not take are refused naming the field;
    Health's status is /health's: "unavailable" once no decode worker is up."""
    rt, ws, _ = cluster
    with make_channel(rt.grpc_address) as ch:
        stub = pbg.PdserveStub(ch)
        for req, param in ((pb.GenerateRequest(prompt="hi", params=pb.SamplingParams(n=65)),
                            "n"),
                           (pb.GenerateRequest(prompt="hi", request_id="a b\nc"), "request_id"),
                           (pb.GenerateRequest(prompt="hi", request_id="x" * 129), "request_id")):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, metadata=auth_metadata(KEY), timeout=10))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith(f"{param}: "), e.value.details()
        ok = pb.GenerateRequest(prompt="hi", request_id="client-7.a:b",
                                params=pb.SamplingParams(max_tokens=2))
        assert list(stub.Generate(ok, metadata=auth_metadata(KEY), timeout=30))[0].request_id \
            == "client-7.a:b"
        health = stub.Health(pb.HealthRequest(), timeout=10)
        assert health.status == "ok"
        # the pool's KV as the workers' last health polls say it (3 fake workers)
        polled = [w.health for w in rt.core.pool.workers.values()]
        assert health.num_total_blocks == sum(h.num_total_blocks for h in polled) > 0
        assert health.num_free_blocks == sum(h.num_free_blocks for h in polled)
        decode = rt.core.pool.workers["hd0"]
        # as the pool marks a dead decode worker (no probe for a minute: its health polls
        # would close the breaker again)
        decode.breaker.open, decode.breaker.retry_at = True, time.monotonic() + 60
        try:
            assert not decode.up
            assert stub.Health(pb.HealthRequest(), timeout=10).status == "unavailable"
            assert httpx.get(rt.url + "/health").json()["status"] == "unavailable"
        finally:
            decode.breaker.open = False


def test_grpc_face_validates_logit_bias_like_http(cluster, frontend):
    """INVALID_ARGUMENT naming logit_bias, decided by the router: the fake workers check no
    vocabulary, and no prefill is even sent."""
    rt, ws, _ = cluster
    vocab = frontend.config.vocab_size
    with make_channel(rt.grpc_address) as ch:
        stub = pbg.PdserveStub(ch)
        prefills = sum(len(w.prefills) for w in ws.values())
        for bias in ({vocab: 1.0}, {5: float("nan")}, {5: 101.0},
                     {i: 1.0 for i in range(301)}):
            req = pb.GenerateRequest(prompt="hi", params=pb.SamplingParams(logit_bias=bias))
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, metadata=auth_metadata(KEY), timeout=10))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith("logit_bias: "), e.value.details()
        assert sum(len(w.prefills) for w in ws.values()) == prefills
        ok = pb.GenerateRequest(prompt="hi", params=pb.SamplingParams(
            max_tokens=2, logit_bias={5: 100.0, vocab - 1: -100.0}))
        msgs = list(stub.Generate(ok, metadata=auth_metadata(KEY), timeout=30))
        assert msgs[-1].finish_reason == "length"


def test_oversized_bodies_get_413_by_header_and_by_stream(cluster):
    _, _, client = cluster
    big = json.dumps({"prompt": "x" * 100_000}).encode()
    assert client.post("/v1/completions", content=big).status_code == 413

    def chunks():
        for _ in range(100):
            yield b" " * 1024
    r = client.post("/v1/completions", content=chunks())  # chunked: no Content-Length
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_api_key_guards_all_but_health_and_metrics(cluster):
    rt, _, _ = cluster
    from pdserve.router.http_app import OPEN_PATHS, create_app

    # every route the app has (a new one is guarded without this test knowing it)
    routes = [(re.sub(r"\{[^}]+\}", "x", r.path), m) for r in create_app(rt.core, "k").app.routes
              if getattr(r, "methods", None) for m in r.methods if m != "HEAD"]
    assert ("/v1/responses", "POST") in routes and len(routes) >= 8
    for path, method in routes:
        if path in OPEN_PATHS:
            continue
        r = httpx.request(method, rt.url + path, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
        assert httpx.request(method, rt.url + path).status_code == 401, path
    assert httpx.get(rt.url + "/health").status_code == 200
    metrics = httpx.get(rt.url + "/metrics").text
    assert "pdserve:time_to_first_token_seconds" in metrics
    listed = httpx.get(rt.url + "/v1/models", headers=AUTH).json()["data"][0]
    # the openai client's models.retrieve; unknown ones and unknown routes as OpenAI says
    assert httpx.get(rt.url + f"/v1/models/{listed['id']}", headers=AUTH).json() == listed
    assert httpx.get(rt.url + f"/v1/models/{listed['id']}").status_code == 401
    # the embedded model also answers to its Hub id, as clients configured for vLLM ask
    hub = httpx.get(rt.url + "/v1/models/HuggingFaceTB/SmolLM2-135M-Instruct", headers=AUTH)
    assert hub.status_code == 200 and hub.json()["id"] == listed["id"]
    gone = httpx.get(rt.url + "/v1/models/no-such-model", headers=AUTH)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    nowhere = httpx.get(rt.url + "/v1/no-such-route", headers=AUTH)
    assert nowhere.status_code == 404 and nowhere.json()["error"]["type"] == "invalid_request_error"


def test_tokenize_counts_what_a_completion_reports_and_detokenize_inverts_it(cluster, frontend):
    _, _, client = cluster
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2}).json()
    tok = client.post("/tokenize", json={"messages": msgs, "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == chat["usage"]["prompt_tokens"]
    assert tok["max_model_len"] == frontend.max_model_len
    assert "".join(tok["token_strs"]) == frontend.tokenizer.decode(tok["tokens"],
                                                                   skip_special_tokens=False)
    plain = client.post("/tokenize", json={"prompt": "Hello there"}).json()
    assert plain["tokens"] == frontend.encode_prompt("Hello there") and plain["token_strs"] is None
    back = client.post("/detokenize", json={"tokens": plain["tokens"]}).json()
    assert back == {"prompt": "Hello there"}
    for path, body, param in (
            ("/tokenize", {"prompt": "a", "messages": msgs}, "prompt"),
            ("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": 5}, "prompt"),
            ("/tokenize", {"prompt": "a", "return_token_strs": "yes"}, "return_token_strs"),
            ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                           "continue_final_message": True}, "continue_final_message"),
            ("/detokenize", {"tokens": "abc"}, "tokens"),
            ("/detokenize", {"tokens": [2**31]}, "tokens")):
        r = client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
    assert client.post("/tokenize", json={"prompt": "a", "model": "nope"}).status_code == 404


def test_overload_429_and_drain_503_with_retry_after(cluster):
    rt, ws, client = cluster
    core = rt.core
    ws["hd0"].token_delay_s = 0.1
    core.cfg = dataclasses.replace(core.cfg, max_inflight=1)
    try:
        started = threading.Event()

        def slow():
            with client.stream("POST", "/v1/completions",
                               json={"prompt": "slow", "max_tokens": 20, "stream": True}) as r:
                for _ in r.iter_lines():
                    started.set()
        t = threading.Thread(target=slow)
        t.start()
        started.wait(10)
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
        with make_channel(rt.grpc_address) as ch:  # gRPC: the same, as trailing metadata
            with pytest.raises(grpc.RpcError) as e:
                list(pbg.PdserveStub(ch).Generate(pb.GenerateRequest(prompt="hi"),
                                                  metadata=auth_metadata(KEY), timeout=10))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert dict(e.value.trailing_metadata())["retry-after"] == "1"
        t.join(30)
    finally:
        core.cfg = dataclasses.replace(core.cfg, max_inflight=1024)
        ws["hd0"].token_delay_s = 0.0
    core.draining = True
    try:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and "retry-after" in r.headers
        h = httpx.get(rt.url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "draining"
    finally:
        core.draining = False
    wait_until(lambda: core.inflight == 0, 10, "in-flight count back to 0")


def test_stage_histograms_add_up_to_end_to_end(cluster):
    rt, _, client = cluster
    for i in range(3):
        client.post("/v1/completions", json={"prompt": f"stages {i}", "max_tokens": 3})
    text = httpx.get(rt.url + "/metrics").text

    def total(name: str) -> float:
        m = re.search(rf'^pdserve:{name}_sum\{{[^}}]*\}} (\S+)$', text, re.M)
        return float(m.group(1))
    stages = sum(total(f"stage_{s}_seconds") for s in
                 ("router_queue", "prefill_queue", "prefill", "kv_transfer", "decode_queue", "decode"))
    assert total("stage_kv_transfer_seconds") > 0 and total("stage_prefill_seconds") > 0
    assert stages == pytest.approx(total("e2e_request_latency_seconds"), rel=1e-6)
    assert re.search(r'^pdserve:num_requests_running\{[^}]*\} 0\.0$', text, re.M)


def test_batched_prompts_return_every_completion(cluster):
    """prompts x n completions, each with its index, streamed or not (the merge once stopped
    after the first finished completion when n=1)."""
    _, _, client = cluster
    body = {"prompt": ["one", "two", "three"], "max_tokens": 3, "n": 2, "seed": 5}
    out = client.post("/v1/completions", json=body)
    assert out.status_code == 200, out.text
    assert sorted(c["index"] for c in out.json()["choices"]) == list(range(6))
    one = client.post("/v1/completions", json={**body, "n": 1})
    assert sorted(c["index"] for c in one.json()["choices"]) == [0, 1, 2]
    with client.stream("POST", "/v1/completions", json={**body, "n": 1, "stream": True}) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines()
                  if x.startswith("data: {")]
    finished = sorted(c["index"] for e in events for c in e["choices"] if c["finish_reason"])
    assert finished == [0, 1, 2]
    too_many = client.post("/v1/completions", json={"prompt": ["hi"] * 200, "n": 2})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt"


def test_cache_salt_reaches_the_params_and_the_wire(frontend):
    """vLLM's cache_salt: taken on both chat and completions, and sent to the workers, whose
    block hashes (and the router's prefix affinity) it seeds."""
    from pdserve.proto.convert import params_from_proto

    for parsed in (parse_completion({"prompt": "hi", "cache_salt": "tenant-a"}, frontend),
                   parse_chat({"messages": [{"role": "user", "content": "x"}],
                               "cache_salt": "tenant-a"}, frontend, lambda n: 8)):
        assert parsed.params.cache_salt == "tenant-a"
        assert params_from_proto(params_to_proto(parsed.params)).cache_salt == "tenant-a"
    unsalted = parse_completion({"prompt": "hi"}, frontend).params
    assert params_from_proto(params_to_proto(unsalted)).cache_salt is None


def test_priority_policy_takes_vllms_priority_to_both_workers(frontend):
    """A router started with --scheduling-policy priority takes vLLM's priority field (the
    fcfs one refuses it, see the bad-input cases) and sends it, with cache_salt, to the
    prefill and the decode worker, whose engines order their queues by it."""
    ws = {wid: FakeWorker(wid, role).start() for wid, role in (("pp0", "prefill"),
                                                                ("pd0", "decode"))}
    cfg = RouterConfig(block_size=16, router_id="router-prio", scheduling_policy="priority")
    rt = RouterThread([FakeRef(w) for w in ws.values()], frontend, cfg, api_key=KEY)
    try:
        with httpx.Client(base_url=rt.url, headers=AUTH, timeout=30) as client:
            r = client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 2,
                                                     "priority": -3, "cache_salt": "t"})
            assert r.status_code == 200, r.text
            bad = client.post("/v1/completions", json={"prompt": "hi", "priority": 0.5})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
        seen = ws["pp0"].params_seen + ws["pd0"].params_seen
        assert len(seen) == 2 and all(p.priority == -3 and p.cache_salt == "t" for p in seen)
    finally:
        rt.stop()
        for w in ws.values():
            w.stop()
