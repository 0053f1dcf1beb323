"""Load side of bench_payoff: token-id prompts over the router's gRPC Generate, timed here.

A preset model has random weights and no tokenizer, so prompts are token ids (exact
lengths) and outputs are exact too (ignore_eos with max_tokens). Times are the client's
time.perf_counter, from the moment a call is started:
  TTFT = first message that carries tokens,    E2E = the message with finish_reason,
  TPOT = (E2E - TTFT) / (tokens - 1)           (a request's mean time per output token),
  ITL  = gaps between token-carrying messages; a message with k tokens (speculative
         decoding) counts as k gaps of gap / k, as the router's own histogram does.
Stdlib + grpc + the repo's proto only (no httpx/numpy), so it runs on a bare GPU host.
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field

import grpc

from pdserve.bench.workload import LengthRange, poisson_arrivals
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pbg
from pdserve.proto.rpc import MAX_MESSAGE_BYTES

CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
PERCENTILES = (50, 90, 99)


@dataclass
class Spec:
    arrival: float  # s from the start of the run
    prompt: list[int]
    output_len: int


@dataclass
class Result:
    arrival: float
    prompt_len: int
    output_len: int  # requested (exact with ignore_eos)
    sent: float = 0.0  # s from the start of the run
    tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    times: list[tuple[float, int]] = field(default_factory=list)  # (s since sent, tokens)
    finish: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.e2e is not None and self.ttft is not None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.tokens - 1)

    def itl(self, lo: float = -math.inf, hi: float = math.inf) -> list[float]:
        """Inter-token gaps; with lo/hi (s from the run's start) only those of messages
        that arrived in [lo, hi]."""
        out = []
        for (a, _), (b, k) in zip(self.times, self.times[1:]):
            if lo <= self.sent + b <= hi:
                out += [(b - a) / k] * k
        return out


# -- workloads ---------------------------------------------------------------------------
def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def poisson_specs(rate: float, duration_s: float, in_len: LengthRange, out_len: LengthRange,
                  vocab: int, seed: int) -> list[Spec]:
    """Poisson arrivals at `rate` req/s during [0, duration_s); uniform lengths."""
    n = int(rate * duration_s * 2 + 20)  # more than enough; cut at the window's end
    times = [t for t in poisson_arrivals(n, rate, seed) if t < duration_s]
    rng = random.Random(seed + 7)
    return [Spec(t, random_prompt(rng, in_len.sample(rng), vocab), out_len.sample(rng))
            for t in times]


def burst_specs(n: int, in_len: LengthRange, output_len: int, vocab: int,
                seed: int) -> list[Spec]:
    rng = random.Random(seed)
    return [Spec(0.0, random_prompt(rng, in_len.sample(rng), vocab), output_len)
            for _ in range(n)]


# -- the client --------------------------------------------------------------------------
def _request(spec: Spec, timeout_s: float) -> pb.GenerateRequest:
    params = pb.SamplingParams(max_tokens=spec.output_len, temperature=0.0, ignore_eos=True)
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=spec.prompt), params=params,
                              timeout_s=timeout_s)


async def _one(stub: pbg.PdserveStub, spec: Spec, start: float, timeout_s: float) -> Result:
    res = Result(spec.arrival, len(spec.prompt), spec.output_len)
    delay = start + spec.arrival - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    sent = time.perf_counter()
    res.sent = sent - start
    call = stub.Generate(_request(spec, timeout_s), timeout=timeout_s + 5)
    try:
        async for msg in call:
            now = time.perf_counter() - sent
            if msg.token_ids:
                if res.ttft is None:
                    res.ttft = now
                res.times.append((now, len(msg.token_ids)))
                res.tokens += len(msg.token_ids)
            if msg.finish_reason:
                res.finish, res.e2e = msg.finish_reason, now
        if res.e2e is None:
            res.error = "stream ended without a finish_reason"
    except grpc.aio.AioRpcError as e:
        res.error = f"{e.code().name}: {e.details()}"[:300]
    except asyncio.CancelledError:  # cut off at the run's drain deadline (ours to swallow)
        call.cancel()
        res.error = "cut off at the drain deadline"
    return res


async def run_specs(address: str, specs: list[Spec], drain_s: float,
                    timeout_s: float = 600.0, channels: int = 4) -> list[Result]:
    """Send each spec at its arrival time; wait for all up to last arrival + drain_s, then
    cancel what is left (those count as failed: cancelling frees their blocks)."""
    chans = [grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) for _ in range(channels)]
    try:
        stubs = [pbg.PdserveStub(c) for c in chans]
        start = time.perf_counter() + 0.2  # room to create the tasks before the first send
        tasks = [asyncio.create_task(_one(stubs[i % channels], s, start, timeout_s))
                 for i, s in enumerate(specs)]
        last = max((s.arrival for s in specs), default=0.0)
        left = start + last + drain_s - time.perf_counter()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.1, left))
            for t in pending:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return [t.result() for t in tasks]
    finally:
        for c in chans:
            await c.close()


async def wait_idle(address: str, timeout_s: float) -> bool:
    """Poll the router's Health until nothing runs or waits (True), or the deadline."""
    end = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = pbg.PdserveStub(ch)
        while time.monotonic() < end:
            try:
                h = await stub.Health(pb.HealthRequest(), timeout=5)
                if h.num_running == 0 and h.num_waiting == 0:
                    return True
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.25)
    return False


# -- statistics --------------------------------------------------------------------------
def percentile(sorted_vals: list[float], q: float) -> float:
    """numpy's default (linear interpolation) percentile of an already sorted list."""
    pos = (len(sorted_vals) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def dist_ms(values) -> dict:
    vals = sorted(v * 1000.0 for v in values)
    if not vals:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None, "count": 0}
    out = {"mean": sum(vals) / len(vals)}
    out.update({f"p{p}": percentile(vals, p) for p in PERCENTILES})
    out.update({"max": vals[-1], "count": len(vals)})
    return out


def meets(r: Result, slo: dict[str, float]) -> bool:
    return r.ok and r.ttft <= slo["ttft"] and (r.tpot or 0.0) <= slo["tpot"]


def mean_decode_concurrency(results: list[Result], t_lo: float, t_hi: float) -> float:
    """Time-weighted mean number of requests between first token and finish in [t_lo, t_hi]."""
    if t_hi <= t_lo:
        return 0.0
    busy = 0.0
    for r in results:
        if r.ttft is None:
            continue
        end = r.sent + (r.e2e if r.e2e is not None else r.times[-1][0])
        a, b = max(t_lo, r.sent + r.ttft), min(t_hi, end)
        busy += max(0.0, b - a)
    return busy / (t_hi - t_lo)


def summarize(results: list[Result], slo: dict[str, float], duration_s: float,
              ramp_s: float = 0.0) -> dict:
    """SLO attainment and goodput over the requests that arrived in [ramp_s, duration_s)."""
    measured = [r for r in results if r.arrival >= ramp_s]
    ok = [r for r in measured if r.ok]
    good = sum(meets(r, slo) for r in measured)
    window = max(1e-9, duration_s - ramp_s)
    errors: dict[str, int] = {}
    for r in measured:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    ends = [r.sent + r.e2e for r in ok]
    return {
        "requests": len(measured), "completed": len(ok), "failed": len(measured) - len(ok),
        "sent_total": len(results), "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5]),
        "good": good, "slo_attainment": good / len(measured) if measured else 0.0,
        "goodput_rps": good / window, "offered_rps": len(measured) / window,
        "throughput_rps": len(ok) / max(1e-9, max(ends, default=0.0) - ramp_s) if ok else 0.0,
        "output_tokens": sum(r.tokens for r in ok),
        "prompt_tokens": sum(r.prompt_len for r in ok),
        "ttft_ms": dist_ms(r.ttft for r in ok),
        "tpot_ms": dist_ms(t for r in ok if (t := r.tpot) is not None),
        "itl_ms": dist_ms(x for r in ok for x in r.itl()),
        "e2e_ms": dist_ms(r.e2e for r in ok),
        "mean_decode_concurrency": mean_decode_concurrency(results, max(ramp_s, duration_s / 4),
                                                           duration_s),
    }


def request_records(results: list[Result], slo: dict[str, float]) -> list[dict]:
    def r6(x: float | None) -> float | None:
        return None if x is None else round(x, 6)
    return [{"arrival_s": r6(r.arrival), "sent_s": r6(r.sent), "prompt_len": r.prompt_len,
             "output_len": r.output_len, "tokens": r.tokens, "ttft_s": r6(r.ttft),
             "tpot_s": r6(r.tpot), "e2e_s": r6(r.e2e), "meets_slo": meets(r, slo),
             "error": r.error or None} for r in results]
