"""Issue #8: does disaggregation pay? Goodput under SLO, disaggregated vs colocated, same GPUs.

One run serves the same model two ways on the same two GPUs through the real serving path
(Ray worker actors, the router's gRPC front door, NIXL KV pulls; bench/lab/payoff_cluster.py):
  disagg     one prefill worker (GPU 0) + one decode worker (GPU 1)
  colocated  two replicas that each prefill and decode (one per GPU), behind the router
and sweeps Poisson request rates over each (prompts 2K-8K tokens, outputs 128-512 tokens,
exact lengths), then measures the disaggregated decode worker without prefill traffic
(a burst of requests at the loaded run's decode concurrency, timed once all have their
first token) for the p99 ITL ratio. SLO: TTFT <= 1 s and TPOT <= 25 ms; goodput =
requests/s meeting both. Around every rate the router's and workers' /metrics are scraped
and the deltas of every histogram and counter (stage histograms included) go into the JSON.

    PYTHONPATH=/tmp/site python3 -m bench.lab.bench_payoff --out bench/results/payoff_h200x2.json
    python -m bench.lab.bench_payoff --plot bench/results/payoff_h200x2.json   # PNG afterwards
    python -m bench.lab.bench_payoff --device cpu --model tiny-qwen3 --rates 4,8 --duration 2 \\
        --ramp 0.5 --input-len 16:32 --output-len 4:8 --slo ttft=30,tpot=10 --out /tmp/p.json  # smoke

The JSON is rewritten after every rate, so an interrupted run keeps what it measured:
  device, command, date, versions, git, env, plan
  results.<setup>.workers            role, addresses, env and GPU each worker process saw
  results.<setup>.runs[i].summary    requests, slo_attainment, goodput_rps, ttft/tpot/itl/e2e_ms
                                     (mean p50 p90 p99 max), mean_decode_concurrency, stages
                                     (router stage means next to the router's mean TTFT/E2E)
  results.<setup>.runs[i].metrics_delta   per process: every histogram (sum, count, buckets)
                                     and counter, after minus before the rate
  results.<setup>.runs[i].requests   one record per request (skipped rates: {rate, skipped})
  baseline                           disagg ITL without prefill traffic (+ its metrics delta)
  summary                            issue #8's Done-when lines, computed; met true/false
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

from pdserve.bench.workload import LengthRange  # noqa: E402

from bench.lab import payoff_load as load  # noqa: E402
from bench.lab import payoff_metrics as pm  # noqa: E402
from bench.lab import payoff_report as report  # noqa: E402
from bench.lab.payoff_driver import MULTI_GPU_ENV, ClusterProcess, header, write_json  # noqa: E402

SETUPS = ("disagg", "colocated")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--plot", metavar="JSON", help="only draw the PNG of an existing results JSON")
    a("--out", default=None, help="results JSON (PNG beside it); default "
      "bench/results/payoff_<date>.json")
    a("--model", default="qwen3-8b", help="preset or model path (default qwen3-8b, random bf16)")
    a("--device", default=None, help="cuda | cpu (default: cuda when available)")
    a("--setups", default=",".join(SETUPS), help="which setups, in order (default disagg,colocated)")
    a("--rates", default="2,4,6,8", help="Poisson request rates, req/s (default 2,4,6,8)")
    a("--duration", type=float, default=20.0, help="seconds of arrivals per rate (default 20)")
    a("--ramp", type=float, default=4.0, help="requests arriving in the first RAMP s are sent "
      "but not scored (the batch fills up); default 4")
    a("--drain", type=float, default=20.0, help="after the last arrival, wait this long for "
      "requests still running, then cancel them (counted as failed); default 20")
    a("--input-len", default="2048:8192", help="prompt tokens, N or LO:HI uniform")
    a("--output-len", default="128:512", help="output tokens (exact), N or LO:HI uniform")
    a("--slo", default="ttft=1.0,tpot=0.025", help="seconds: ttft=..,tpot=..")
    a("--stop-below", type=float, default=0.5, help="skip a setup's higher rates once its "
      "SLO attainment falls below this (default 0.5; 0 = never)")
    a("--time-budget", type=float, default=460.0, help="seconds for the whole run: rates that "
      "would not fit in a setup's share are skipped and marked so (default 460; 0 = none)")
    a("--warmup-requests", type=int, default=4, help="unscored requests per setup first")
    a("--baseline", choices=["on", "off"], default="on",
      help="disagg no-prefill-traffic ITL phase (default on)")
    a("--baseline-concurrency", type=int, default=None,
      help="requests in the baseline (default: the loaded run's mean decode concurrency)")
    a("--seed", type=int, default=0)
    # serving knobs (a second sweep can vary them)
    a("--max-num-batched-tokens", type=int, default=2048, help="chunk size / token budget "
      "per engine step, every worker (default 2048)")
    a("--max-num-seqs", type=int, default=64)
    a("--num-blocks", type=int, default=None, help="KV blocks per worker (default: engine's)")
    a("--block-size", type=int, default=16)
    a("--max-model-len", type=int, default=None, help="default: longest prompt + output + 16")
    a("--disagg-threshold", type=int, default=0, help="router: prompts with fewer uncached "
      "tokens prefill on the decode worker (selective disaggregation; 0 = never)")
    a("--routing", default="prefix_aware")
    a("--lease-ttl", type=float, default=60.0)
    a("--no-triton", action="store_true", help="GPU: torch ops instead of the Triton kernels")
    a("--no-cuda-graphs", action="store_true", help="GPU: eager decode steps")
    a("--speculative", choices=["mtp", "none"], default="none",
      help="MTP speculative decoding on every worker (needs WorkerConfig.speculative)")
    a("--num-speculative-tokens", type=int, default=None, metavar="K", help="MTP k")
    a("--worker-opt", action="append", default=[], metavar="[ROLE:]KEY=VALUE",
      help="any other WorkerConfig field, for every worker or one role (prefill, decode, "
           "colocated), e.g. prefill:max_num_batched_tokens=8192 or, where WorkerConfig has "
           "them, MTP fields; repeatable")
    a("--startup-timeout", type=float, default=300.0, help="seconds for a setup's workers")
    return p.parse_args(argv)


def parse_slo(text: str) -> dict[str, float]:
    slo = {}
    for part in filter(None, (x.strip() for x in text.split(","))):
        key, _, value = part.partition("=")
        if key not in ("ttft", "tpot"):
            raise ValueError(f"--slo: keys are ttft and tpot (seconds), got {part!r}")
        slo[key] = float(value)
    if set(slo) != {"ttft", "tpot"}:
        raise ValueError(f"--slo: give both ttft and tpot, got {text!r}")
    return slo


def make_plan(args: argparse.Namespace) -> dict:
    from bench.lab.payoff_driver import detect_device, parse_worker_opts

    in_len = LengthRange.parse(args.input_len, "--input-len")
    out_len = LengthRange.parse(args.output_len, "--output-len")
    setups = [s for s in args.setups.split(",") if s]
    if not setups or set(setups) - set(SETUPS):
        raise ValueError(f"--setups: choose from {SETUPS}, got {args.setups!r}")
    rates = sorted(float(r) for r in args.rates.split(",") if r.strip())
    if not rates or min(rates) <= 0:
        raise ValueError(f"--rates: positive numbers, got {args.rates!r}")
    if args.ramp >= args.duration:
        raise ValueError("--ramp: must be shorter than --duration")
    opts = list(args.worker_opt)
    if args.speculative == "mtp":
        opts.append("speculative=mtp")
        if args.num_speculative_tokens is not None:
            opts.append(f"num_speculative_tokens={args.num_speculative_tokens}")
    elif args.num_speculative_tokens is not None:
        raise ValueError("--num-speculative-tokens: needs --speculative mtp")
    device = args.device or detect_device()
    max_len = args.max_model_len or in_len.hi + out_len.hi + 16
    return {"model": args.model, "device": device, "setups": setups, "rates": rates,
            "duration_s": args.duration, "ramp_s": args.ramp, "drain_s": args.drain,
            "input_len": [in_len.lo, in_len.hi], "output_len": [out_len.lo, out_len.hi],
            "slo": parse_slo(args.slo), "stop_below": args.stop_below,
            "time_budget_s": args.time_budget, "warmup_requests": args.warmup_requests,
            "baseline": args.baseline == "on", "baseline_concurrency": args.baseline_concurrency,
            "seed": args.seed, "replicas": 2, "block_size": args.block_size,
            "num_blocks": args.num_blocks, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": max_len,
            "disagg_threshold": args.disagg_threshold, "routing": args.routing,
            "lease_ttl_s": args.lease_ttl, "triton": not args.no_triton,
            "cuda_graphs": not args.no_cuda_graphs, "worker_opts": parse_worker_opts(opts),
            "startup_timeout_s": args.startup_timeout, "request_timeout_s": 600.0}


def estimate_s(plan: dict) -> float:
    """Rough wall time: start-up + warm-up per setup, arrivals + drain per rate, baseline."""
    cuda = plan["device"].startswith("cuda")
    per_rate = plan["duration_s"] + min(plan["drain_s"], plan["slo"]["ttft"]
                                        + plan["output_len"][1] * plan["slo"]["tpot"]) + 3
    per_setup = (50 if cuda else 25) + 10 + per_rate * len(plan["rates"])
    base = 25 if plan["baseline"] and "disagg" in plan["setups"] else 0
    return per_setup * len(plan["setups"]) + base


class Run:
    """One bench run: the plan, the cluster process, the results payload."""

    def __init__(self, plan: dict, out: Path, argv: list[str]) -> None:
        self.plan, self.out, self.t0 = plan, out, time.monotonic()
        self.payload = {**header(plan, argv), "results": {}, "baseline": None, "summary": None}
        self.in_len = LengthRange(*plan["input_len"])
        self.out_len = LengthRange(*plan["output_len"])
        self.vocab = 0

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def save(self) -> None:
        write_json(self.out, self.payload)

    def setup_deadline(self, k: int) -> float:
        """A fair share of what is left of the time budget for setup k (of those left)."""
        budget = self.plan["time_budget_s"]
        if budget <= 0:
            return float("inf")
        left = budget - self.elapsed()
        return self.elapsed() + left / (len(self.plan["setups"]) - k)

    def rate_cost(self) -> float:
        p = self.plan
        return p["duration_s"] + min(p["drain_s"], p["slo"]["ttft"] + p["output_len"][1] *
                                     p["slo"]["tpot"]) + 3


def sweep_setup(run: Run, setup: str, info: dict, deadline: float) -> None:
    plan = run.plan
    endpoints = {"router": info["http"], **{w: v["metrics"] for w, v in info["workers"].items()}}
    data = {"startup_s": info["startup_s"], "workers": info["workers"],
            "worker_configs": info["worker_configs"], "runs": []}
    run.payload["results"][setup] = data
    warm = load.burst_specs(plan["warmup_requests"], run.in_len, min(16, run.out_len.hi),
                            run.vocab, plan["seed"] + 99)
    warmed = asyncio.run(load.run_specs(info["grpc"], warm, drain_s=180.0))
    asyncio.run(load.wait_idle(info["grpc"], 60))
    data["warmup_errors"] = [r.error for r in warmed if not r.ok]
    if warmed and len(data["warmup_errors"]) == len(warmed):
        raise RuntimeError(f"{setup}: every warm-up request failed: {data['warmup_errors'][0]}")
    reserve = 25 if setup == "disagg" and plan["baseline"] else 0
    stopped = None
    for i, rate in enumerate(plan["rates"]):
        if stopped is None and run.elapsed() + run.rate_cost() + reserve > deadline:
            stopped = "skipped: time budget"
        if stopped:
            data["runs"].append({"rate": rate, "skipped": stopped})
            continue
        rec = measure_rate(run, setup, info, endpoints, rate, plan["seed"] + 1000 * i)
        data["runs"].append(rec)
        print(report.progress_line(setup, rate, rec["summary"], run.elapsed()), flush=True)
        run.save()
        if rec["summary"]["slo_attainment"] < plan["stop_below"]:
            stopped = f"skipped: attainment below {plan['stop_below']} at {rate}/s"


def measure_rate(run: Run, setup: str, info: dict, endpoints: dict, rate: float,
                 seed: int) -> dict:
    plan = run.plan
    specs = load.poisson_specs(rate, plan["duration_s"], run.in_len, run.out_len, run.vocab, seed)
    before = pm.snapshot(endpoints)
    results = asyncio.run(load.run_specs(info["grpc"], specs, drain_s=plan["drain_s"]))
    idle = asyncio.run(load.wait_idle(info["grpc"], 60))
    delta = pm.delta(before, pm.snapshot(endpoints))
    summary = load.summarize(results, plan["slo"], plan["duration_s"], plan["ramp_s"])
    summary["stages"] = pm.stage_summary(delta)
    return {"rate": rate, "summary": summary, "idle_after": idle, "metrics_delta": delta,
            "requests": load.request_records(results, plan["slo"])}


def run_baseline(run: Run, info: dict) -> dict:
    """Disagg decode without prefill traffic: N requests at once, ITL timed only while all N
    decode (after the last first token, before the first finish)."""
    plan, runs = run.plan, run.payload["results"]["disagg"]["runs"]
    ref = report.knee(runs) or next(iter(report.measured(runs)), None)
    conc = ref["summary"]["mean_decode_concurrency"] if ref else 1.0
    n = plan["baseline_concurrency"] or max(1, min(round(conc), plan["max_num_seqs"], 56))
    specs = load.burst_specs(n, run.in_len, run.out_len.hi, run.vocab, plan["seed"] + 777)
    endpoints = {"router": info["http"], **{w: v["metrics"] for w, v in info["workers"].items()}}
    before = pm.snapshot(endpoints)
    results = asyncio.run(load.run_specs(info["grpc"], specs, drain_s=max(60.0, plan["drain_s"])))
    asyncio.run(load.wait_idle(info["grpc"], 60))
    delta = pm.delta(before, pm.snapshot(endpoints))
    ok = [r for r in results if r.ok]
    lo = max((r.sent + r.ttft for r in ok), default=0.0)
    hi = min((r.sent + r.e2e for r in ok), default=0.0)
    gaps = [g for r in ok for g in r.itl(lo, hi)]
    window = "all decoding"
    if len(gaps) < 100:  # too short a window: every gap after the last first token
        gaps = [g for r in ok for g in r.itl(lo)]
        window = "after the last first token"
    return {"reference_rate": ref and ref["rate"], "reference_concurrency": conc,
            "concurrency": n, "output_len": run.out_len.hi, "window": window,
            "window_s": [lo, hi], "failed": len(results) - len(ok),
            "summary": {"itl_ms": load.dist_ms(gaps),
                        "stages": pm.stage_summary(delta)}, "metrics_delta": delta}


def execute(run: Run) -> None:
    plan = run.plan
    cluster = ClusterProcess(plan, run.out.with_name(run.out.stem + "_cluster.log"))
    try:
        for k, setup in enumerate(plan["setups"]):
            deadline = run.setup_deadline(k)
            print(f"[{run.elapsed():6.0f} s] {setup}: starting workers", flush=True)
            info = cluster.wait_ready(setup, plan["startup_timeout_s"])
            run.vocab = info["vocab_size"]
            roles = ", ".join(f"{w} {v['role']} CUDA_VISIBLE_DEVICES="
                              f"{v.get('process', {}).get('env', {}).get('CUDA_VISIBLE_DEVICES')}"
                              for w, v in info["workers"].items())
            print(f"[{run.elapsed():6.0f} s] {setup}: ready in {info['startup_s']:.0f} s "
                  f"({roles})", flush=True)
            sweep_setup(run, setup, info, deadline)
            if setup == "disagg" and plan["baseline"]:
                run.payload["baseline"] = run_baseline(run, info)
                b = run.payload["baseline"]
                print(f"[{run.elapsed():6.0f} s] disagg baseline: {b['concurrency']} requests, "
                      f"no prefill traffic: ITL p99 {b['summary']['itl_ms']['p99']} ms", flush=True)
            run.save()
            cluster.next_setup(last=k == len(plan["setups"]) - 1)
    finally:
        cluster.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    for key, value in MULTI_GPU_ENV.items():
        os.environ.setdefault(key, value)
    # a SIGTERM (e.g. a wall-clock limit) still saves the JSON and stops the cluster
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.plot:
        print(f"plot: {report.plot_from_json(args.plot)}")
        return 0
    try:
        plan = make_plan(args)
    except ValueError as e:
        print(f"bench_payoff: {e}", file=sys.stderr)
        return 2
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    out = Path(args.out or f"bench/results/payoff_{date}.json")
    run = Run(plan, out, argv)
    print(f"bench_payoff: {plan['model']} on {run.payload['device']}; setups {plan['setups']}, "
          f"rates {plan['rates']} x {plan['duration_s']:g} s; expected ~{estimate_s(plan):.0f} s "
          f"(budget {plan['time_budget_s']:g} s); results -> {out}", flush=True)
    try:
        execute(run)
    finally:
        run.payload["summary"] = report.summarize(run.payload["results"], run.payload["baseline"])
        run.payload["wall_s"] = run.elapsed()
        run.save()
    for line in run.payload["summary"]["done_when"]:
        print(line)
    try:
        print(f"results: {out}\nplot: {report.plot(run.payload, out.with_suffix('.png'))}")
    except ImportError as e:
        print(f"results: {out}\nplot: not drawn ({e}); run python -m bench.lab.bench_payoff --plot {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
