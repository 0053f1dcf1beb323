"""Async load generator for any OpenAI-compatible server (streaming completions over SSE).

Measurements, all on the client's monotonic clock (time.perf_counter), from the moment
the request is handed to the HTTP client:
  TTFT = arrival of the first chunk that carries content (role-only or empty chunks don't
         count: a server that flushes headers or an empty chunk early gains nothing),
  ITL  = gaps between arrivals of successive content chunks,
  E2E  = arrival of the end of the stream ([DONE] or close),
  TPOT = (E2E - TTFT) / (output_tokens - 1), output_tokens from the server's usage.
Token counts come from `usage` (requested with stream_options.include_usage); when a
server sends none, output tokens fall back to the number of content chunks and the
result says so (usage_reported=False).
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from pdserve.bench.workload import RequestSpec, poisson_arrivals


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The bearer token header every request to the server carries (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@dataclass
class RequestResult:
    input_len: int  # intended prompt length in words
    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    usage_reported: bool = False
    ttft: float = 0.0  # s
    e2e: float = 0.0  # s
    chunk_times: list[float] = field(default_factory=list)  # s since send, content chunks
    text: str = ""

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class LoadConfig:
    base_url: str  # e.g. http://127.0.0.1:8000
    model: str
    endpoint: str = "/v1/completions"  # or /v1/chat/completions
    api_key: str | None = None
    request_rate: float = math.inf  # req/s of a Poisson process; inf = all at once
    burstiness: float = 1.0  # gamma shape of the gaps (vllm bench serve's): 1 = Poisson
    max_concurrency: int | None = None  # cap on requests in flight
    ignore_eos: bool = False  # send vLLM/SGLang's ignore_eos (not an OpenAI field)
    temperature: float = 0.0
    timeout_s: float = 600.0
    seed: int = 0
    progress: bool = True

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint

    @property
    def headers(self) -> dict[str, str]:
        return auth_headers(self.api_key)


@dataclass
class LoadRun:
    results: list[RequestResult]
    duration_s: float  # first send to last completion
    warmup_failures: int = 0


def build_payload(spec: RequestSpec, cfg: LoadConfig) -> dict:
    payload: dict = {"model": cfg.model, "max_tokens": spec.output_len,
                     "temperature": cfg.temperature, "stream": True,
                     "stream_options": {"include_usage": True}}
    if cfg.endpoint.endswith("/chat/completions"):
        payload["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        payload["prompt"] = spec.prompt
    if cfg.ignore_eos:
        payload["ignore_eos"] = True
    return payload


def _error_message(body: str) -> str:
    """The message of an OpenAI-shaped error body, else the body itself (shortened)."""
    try:
        err = json.loads(body).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
    except (ValueError, AttributeError):
        pass
    return body[:300]


def _chunk_text(obj: dict) -> str:
    text = ""
    for choice in obj.get("choices") or []:
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


async def send_request(client: httpx.AsyncClient, spec: RequestSpec,
                       cfg: LoadConfig) -> RequestResult:
    """Send one streaming request and time it; never raises for server or network errors."""
    res = RequestResult(input_len=spec.input_len)
    pieces: list[str] = []
    start = time.perf_counter()
    try:
        async with client.stream("POST", cfg.url, json=build_payload(spec, cfg),
                                 headers=cfg.headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {_error_message(body)}"
                return res
            async for line in resp.aiter_lines():
                now = time.perf_counter() - start
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event: lines
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = f"stream error: {_error_message(data)}"
                    return res
                text = _chunk_text(obj)
                if text:
                    res.chunk_times.append(now)
                    pieces.append(text)
                usage = obj.get("usage")
                if usage:
                    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    res.output_tokens = int(usage.get("completion_tokens") or 0)
                    res.usage_reported = True
    except (httpx.HTTPError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - start
    res.text = "".join(pieces)
    if not res.chunk_times:
        res.error = "stream ended without content"
        return res
    res.ttft = res.chunk_times[0]
    if not res.usage_reported:
        res.output_tokens = len(res.chunk_times)
    res.success = True
    return res


async def _run(specs: list[RequestSpec], arrivals: list[float], cfg: LoadConfig,
               client: httpx.AsyncClient, desc: str) -> tuple[list[RequestResult], float]:
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    pbar = tqdm(total=len(specs), desc=desc, unit="req", disable=not cfg.progress)
    t0 = time.perf_counter()

    async def one(spec: RequestSpec, at: float) -> RequestResult:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if sem is None:
            res = await send_request(client, spec, cfg)
        else:
            async with sem:  # arrival is on schedule; sending waits for a free slot
                res = await send_request(client, spec, cfg)
        pbar.update(1)
        return res

    try:
        results = await asyncio.gather(*(one(s, a) for s, a in zip(specs, arrivals)))
    finally:
        pbar.close()
    return list(results), time.perf_counter() - t0


def _client(cfg: LoadConfig) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=cfg.max_concurrency,
                          max_keepalive_connections=cfg.max_concurrency or 100)
    return httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s), limits=limits)


async def run_load_async(specs: list[RequestSpec], cfg: LoadConfig,
                         warmup: list[RequestSpec] | None = None,
                         measured: Callable[[], None] | None = None) -> LoadRun:
    """Send warm-up requests (not measured), then `specs` at their arrival times: the
    trace's when every spec has one, else a Poisson process at cfg.request_rate.
    measured: called once the warm-up is over, just before the measured requests start."""
    if all(s.arrival_s is not None for s in specs):
        arrivals = [float(s.arrival_s) for s in specs]  # type: ignore[arg-type]
    else:
        arrivals = poisson_arrivals(len(specs), cfg.request_rate, cfg.seed, cfg.burstiness)
    async with _client(cfg) as client:
        warmup_failures = 0
        if warmup:
            done, _ = await _run(warmup, [0.0] * len(warmup), cfg, client, "warm-up")
            warmup_failures = sum(not r.success for r in done)
        rate = "trace" if specs and specs[0].arrival_s is not None else cfg.request_rate
        if measured is not None:
            measured()
        results, duration = await _run(specs, arrivals, cfg, client, f"rate={rate}")
    return LoadRun(results, duration, warmup_failures)


def run_load(specs: list[RequestSpec], cfg: LoadConfig,
             warmup: list[RequestSpec] | None = None,
             measured: Callable[[], None] | None = None) -> LoadRun:
    return asyncio.run(run_load_async(specs, cfg, warmup, measured))


def fetch_models(base_url: str, api_key: str | None = None,
                 timeout_s: float = 30.0) -> list[str]:
    """Model ids the server lists at /v1/models ([] when it lists none or has no such route).
    OSError naming the URL when nothing answers there (no server, a bad address)."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        resp = httpx.get(url, headers=auth_headers(api_key), timeout=timeout_s)
    except (httpx.TransportError, httpx.UnsupportedProtocol) as e:
        raise OSError(f"--base-url: cannot reach {url}: {e}") from e
    try:
        resp.raise_for_status()
        return [str(m["id"]) for m in resp.json().get("data", [])]
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return []
