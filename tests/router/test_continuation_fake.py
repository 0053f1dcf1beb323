"""Mid-stream continuation in the router, against in-process fake workers: a decode worker
that fails after output started hands the stream to the other one with the tokens already
sent (resume_output_ids); the client sees one seamless stream, counted as ok. With no other
decode worker left the stream ends with an error chunk, counted as failed."""
from __future__ import annotations

import json

import grpc
import httpx
import pytest

from pdserve.proto import pdserve_pb2 as pb
from pdserve.router.core import RouterConfig

from tests.router.fake_worker import FakeRef, FakeWorker
from tests.router.harness import RouterThread, wait_until

CONTINUED = "pdserve:stream_continuations_total"


class ResumingFake(FakeWorker):
    """A fake decode worker that honours resume_output_ids (its "model" counts the last token
    upwards, so prompt + sent tokens continue the stream exactly). While `crashes_left` (shared
    by all instances) lasts, a stream dies (UNAVAILABLE) after `crash_after` tokens; a
    continued one only with `crash_resumed`."""

    crashes_left = 0

    def __init__(self, worker_id: str) -> None:
        super().__init__(worker_id, "decode")
        self.crash_after, self.crash_resumed = 0, False
        self.resumed: list[list[int]] = []

    def Decode(self, req: pb.DecodeRequest, context):
        sent = list(req.resume_output_ids)
        if sent:
            self.resumed.append(sent)
            req = pb.DecodeRequest(request_id=req.request_id, params=req.params,
                                   prompt_token_ids=list(req.prompt_token_ids) + sent,
                                   timeout_s=req.timeout_s)
            req.params.max_tokens -= len(sent)
        crash = self.crash_after if (self.crash_resumed or not sent) else 0
        n = 0
        for msg in super().Decode(req, context):
            if crash and n >= crash and ResumingFake.crashes_left > 0:
                ResumingFake.crashes_left -= 1
                context.abort(grpc.StatusCode.UNAVAILABLE, "injected: worker process died")
            n += len(msg.token_ids)
            yield msg


@pytest.fixture(scope="module")
def cluster(frontend):
    ws = {"cp0": FakeWorker("cp0", "prefill").start(),
          "cd0": ResumingFake("cd0").start(), "cd1": ResumingFake("cd1").start()}
    rt = RouterThread([FakeRef(w) for w in ws.values()], frontend,
                      RouterConfig(block_size=16, retry_budget=2, router_id="router-cont"))
    client = httpx.Client(base_url=rt.url, timeout=30)
    yield rt, ws, client
    client.close()
    rt.stop()
    for w in ws.values():
        w.stop()


@pytest.fixture(autouse=True)
def healthy(cluster):
    rt, ws, _ = cluster
    wait_until(lambda: all(w.up for w in rt.core.pool.workers.values()), 30, "workers up")
    yield
    ResumingFake.crashes_left = 0
    for w in ws.values():
        w.crash_after, w.crash_resumed = 0, False
        if isinstance(w, ResumingFake):
            w.resumed.clear()
    wait_until(lambda: all(not w.held and not w.active for w in ws.values()), 10,
               "no held blocks and no running decode on any worker")


def continued(rt, result: str) -> float:
    text = httpx.get(rt.url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(CONTINUED) and f'result="{result}"' in line)


def stream(client, body: dict) -> tuple[dict[int, str], list[dict]]:
    """Text per choice index, and the events (the error one included)."""
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(line) for line in lines[:-1]]
    texts: dict[int, str] = {}
    for e in events:
        for c in e.get("choices", []):
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    return texts, events


def test_stream_continues_on_the_other_decode_worker(cluster, frontend):
    rt, ws, client = cluster
    ok = continued(rt, "ok")
    for w in ("cd0", "cd1"):
        ws[w].crash_after = 3  # whichever serves a stream first dies after 3 tokens of it
    ResumingFake.crashes_left = 1
    texts, events = stream(client, {"prompt": "Hello there", "max_tokens": 8, "n": 2})
    assert not [e for e in events if "error" in e]
    last = frontend.encode_prompt("Hello there")[-1]
    whole = "".join(f" t{last + 1 + i}" for i in range(8))
    assert texts == {0: whole, 1: whole}  # nothing lost, nothing repeated
    # the broken choice went on, on the other worker, from exactly the 3 tokens sent
    assert ws["cd0"].resumed + ws["cd1"].resumed == [[last + 1, last + 2, last + 3]]
    assert continued(rt, "ok") == ok + 1


def test_no_other_decode_worker_left_ends_with_an_error_chunk(cluster):
    rt, ws, client = cluster
    failed = continued(rt, "failed")
    for w in ("cd0", "cd1"):
        ws[w].crash_after, ws[w].crash_resumed = 2, True  # the continuation dies too
    ResumingFake.crashes_left = 2
    texts, events = stream(client, {"prompt": "x", "max_tokens": 12})
    err = events[-1]["error"]
    assert err["code"] == "worker_unavailable" and "output had started" in err["message"]
    assert len(texts[0].split()) == 4  # 2 tokens from each worker, none repeated
    assert continued(rt, "failed") == failed + 1
