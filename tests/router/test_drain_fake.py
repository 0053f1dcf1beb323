"""The router's shutdown drain (router/launch.py stop_stack) against in-process fake
workers: a second SIGINT/SIGTERM (Stack.hurry) stops waiting for the requests in flight, which
end with an error chunk and [DONE] instead of running on to the drain timeout."""
from __future__ import annotations

import json
import threading

import httpx

from pdserve.router.core import RouterConfig
from pdserve.router.launch import stop_stack

from tests.router.fake_worker import FakeRef, FakeWorker
from tests.router.harness import RouterThread, wait_until


def test_a_second_signal_cuts_the_drain_short(frontend) -> None:
    ws = [FakeWorker("dp0", "prefill").start(), FakeWorker("dd0", "decode").start()]
    ws[1].token_delay_s = 0.2  # 100 tokens: 20 s, well inside the drain's 120 s
    rt = RouterThread([FakeRef(w) for w in ws], frontend,
                      RouterConfig(block_size=16, router_id="router-drain"))
    events: list = []
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", rt.url + "/v1/completions", timeout=120,
                          json={"prompt": "drain me", "max_tokens": 100, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    events.append(data if data == "[DONE]" else json.loads(data))
                    started.set()
    t = threading.Thread(target=stream)
    try:
        t.start()
        assert started.wait(30), "the stream did not start"
        stopping = rt.call_soon(stop_stack(rt.stack, drain_timeout_s=120, shutdown_workers=False))
        wait_until(lambda: rt.core.draining, 10, "the drain to start")
        rt.loop.call_soon_threadsafe(rt.stack.hurry.set)  # what a second signal does
        stopping.result(60)
        t.join(60)
        assert events[-1] == "[DONE]" and "error" in events[-2], events[-2:]
        assert not any(e != "[DONE]" and e.get("choices") and e["choices"][0]["finish_reason"]
                       for e in events)  # cut, not finished
    finally:
        rt.loop.call_soon_threadsafe(rt.loop.stop)
        for w in ws:
            w.stop()
