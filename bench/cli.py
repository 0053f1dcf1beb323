"""`pdserve bench`: load-test any OpenAI-compatible endpoint and write JSON + PNG results.

Examples:
  pdserve bench --num-prompts 200 --request-rate 4 --input-len 256:1024 --output-len 128
  pdserve bench --rates 1,2,4,8,inf --slo ttft=1.0,tpot=0.05 --out results/sweep.json
  pdserve bench --trace mooncake_trace.jsonl --num-prompts 500 --max-concurrency 64
"""
from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import shlex
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="load-test an OpenAI-compatible endpoint (TTFT, ITL, goodput)",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server root (default: pdserve serve's HTTP address)")
    p.add_argument("--endpoint", default="/v1/completions",
                   choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY")
                   or os.environ.get("OPENAI_API_KEY"),
                   help="bearer token (default: $PDSERVE_API_KEY or $OPENAI_API_KEY)")
    p.add_argument("--num-prompts", type=int, default=100,
                   help="measured requests per rate (with --trace: its first N lines)")
    p.add_argument("--warmup", type=int, default=0, help="unmeasured requests sent first")
    p.add_argument("--input-len", default="256", help="prompt words (~tokens): N or LO:HI")
    p.add_argument("--output-len", default="128", help="max_tokens: N or LO:HI")
    p.add_argument("--shared-prefix-ratio", type=float, default=0.0,
                   help="fraction of each prompt that is a prefix shared by all requests")
    p.add_argument("--trace", default=None,
                   help="Mooncake JSONL trace to replay at its timestamps (ms)")
    p.add_argument("--trace-block-size", type=int, default=512,
                   help="tokens per trace hash id (Mooncake: 512)")
    p.add_argument("--sharegpt", default=None, metavar="JSON",
                   help="a ShareGPT file: first turns as prompts, second turns' lengths as "
                        "max_tokens, filtered as vllm bench serve does")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer.json (or its folder) that counts ShareGPT tokens "
                        "(default: ~4 characters per token)")
    p.add_argument("--trace-time-scale", type=float, default=1.0,
                   help="multiply trace timestamps (0.5 = replay twice as fast)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrival rate in req/s; inf = all at once (default)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps between arrivals, as vllm bench serve's: 1 "
                        "is Poisson (default), below 1 burstier, above 1 more even")
    p.add_argument("--rates", default=None, help="sweep: comma-separated rates, e.g. 1,2,4,inf")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--slo", default=None, help="goodput SLOs in seconds: ttft=1.0,tpot=0.025")
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos=true (vLLM/SGLang/pdserve field, not OpenAI's)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="results JSON; plots go beside it (default: ./pdserve-bench-DATE.json)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run)


def _parse_rates(args: argparse.Namespace) -> list[float]:
    if not args.rates:
        rates = [args.request_rate]
    else:
        try:
            rates = [float(r) for r in args.rates.split(",") if r.strip()]
        except ValueError as e:
            raise ValueError(f"--rates: expected numbers or inf, got {args.rates!r}") from e
    for r in rates:
        if not r > 0:
            raise ValueError(f"--rates/--request-rate: each rate must be > 0, got {r}")
    if not (args.burstiness > 0 and math.isfinite(args.burstiness)):
        raise ValueError(f"--burstiness: must be a finite number > 0, got {args.burstiness}")
    return rates


def _workloads(args: argparse.Namespace, n_runs: int) -> tuple[list[list], list]:
    """One workload per run (a different seed each, so a later rate doesn't hit the prefix
    cache the earlier one filled), plus the warm-up requests."""
    from pdserve.bench.workload import (
        LengthRange,
        approx_tokens,
        random_workload,
        read_trace,
        sharegpt_workload,
        tokenizer_counter,
        trace_workload,
    )

    if args.sharegpt:
        count = tokenizer_counter(args.tokenizer) if args.tokenizer else approx_tokens
        runs = [sharegpt_workload(args.sharegpt, args.num_prompts, args.seed + i, count)
                for i in range(n_runs)]
        in_len = LengthRange(1, max(s.input_len for s in runs[0]))
        out_len = LengthRange(1, max(s.output_len for s in runs[0]))
    elif args.trace:
        entries = read_trace(args.trace, limit=args.num_prompts)
        specs = trace_workload(entries, args.trace_block_size, args.seed)
        if args.trace_time_scale != 1.0:
            from dataclasses import replace
            specs = [replace(s, arrival_s=s.arrival_s * args.trace_time_scale) for s in specs]
        runs = [specs]
        in_len = LengthRange(1, max(s.input_len for s in specs))
        out_len = LengthRange(1, max(s.output_len for s in specs))
    else:
        in_len = LengthRange.parse(args.input_len, "--input-len")
        out_len = LengthRange.parse(args.output_len, "--output-len")
        runs = [random_workload(args.num_prompts, in_len, out_len, args.shared_prefix_ratio,
                                seed=args.seed + i) for i in range(n_runs)]
    warmup = []
    if args.warmup > 0:
        warmup = random_workload(args.warmup, in_len, out_len, 0.0, seed=args.seed + 10_000)
    return runs, warmup


def _out_path(args: argparse.Namespace, now: dt.datetime) -> Path:
    if args.out:
        return Path(args.out)
    return Path(f"pdserve-bench-{now.strftime('%Y%m%d-%H%M%S')}.json")


def _validate(args: argparse.Namespace) -> tuple[list[float], dict[str, float]]:
    from pdserve.bench import report

    rates = _parse_rates(args)
    slo = report.parse_slo(args.slo)
    if args.trace and args.sharegpt:
        raise ValueError("--sharegpt: one workload at a time (--trace names another)")
    if args.tokenizer and not args.sharegpt:
        raise ValueError("--tokenizer: counts ShareGPT tokens; it needs --sharegpt")
    if args.trace and args.rates:
        raise ValueError("--rates: a trace replays at its own timestamps; use --trace-time-scale")
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts: must be >= 1, got {args.num_prompts}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency: must be >= 1, got {args.max_concurrency}")
    return rates, slo


def _run_rates(args: argparse.Namespace, model: str, rates: list[float], runs: list[list],
               warmup: list, slo: dict[str, float]) -> tuple[list[dict], list, list]:
    """One load run per rate; returns JSON records, CDF inputs and sweep points."""
    from pdserve.bench import loadgen, report, stages

    records, cdf_runs, sweep = [], [], []
    for i, rate in enumerate(rates if not args.trace else [math.inf]):
        cfg = loadgen.LoadConfig(
            base_url=args.base_url, model=model, endpoint=args.endpoint, api_key=args.api_key,
            request_rate=rate, burstiness=args.burstiness,
            max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos,
            temperature=args.temperature, timeout_s=args.timeout, seed=args.seed + i,
            progress=not args.no_progress)
        before: list = []  # the server's stage histograms once the warm-up is over
        load = loadgen.run_load(runs[i], cfg, warmup if i == 0 else None,
                                measured=lambda: before.append(
                                    stages.scrape(args.base_url, args.api_key)))
        summary = report.summarize(load.results, load.duration_s, slo)
        summary["server_stages"] = stages.breakdown(before[0] if before else None,
                                                    stages.scrape(args.base_url, args.api_key))
        label = "trace" if args.trace else str(report.rate_label(rate))
        print(report.format_summary(summary, f"request rate {label}"))
        if summary["server_stages"]:
            print("\n".join(stages.format_breakdown(summary["server_stages"])))
        records.append({"request_rate": "trace" if args.trace else report.rate_label(rate),
                        "max_concurrency": args.max_concurrency,
                        "warmup_failures": load.warmup_failures, "summary": summary,
                        "requests": report.request_records(load.results)})
        cdf_runs.append((f"rate={label}", load.results))
        sweep.append((label, summary))
    return records, cdf_runs, sweep


def run(args: argparse.Namespace) -> int:
    from pdserve.bench import loadgen, report

    try:
        rates, slo = _validate(args)
        runs, warmup = _workloads(args, len(rates))
    except (ValueError, OSError) as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 2
    now = dt.datetime.now(dt.UTC)
    try:
        server_models = loadgen.fetch_models(args.base_url, args.api_key)
    except OSError as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 2
    model = args.model or (server_models[0] if server_models else None)
    if model is None:
        print(f"pdserve bench: --model: {args.base_url}/v1/models lists no model; name one",
              file=sys.stderr)
        return 2

    records, cdf_runs, sweep = _run_rates(args, model, rates, runs, warmup, slo)
    out = _out_path(args, now)
    plots = {"latency_cdf": str(report.plot_cdfs(cdf_runs, out.with_name(out.stem + "_cdf.png")))}
    if len(sweep) > 1:
        plots["throughput_vs_rate"] = str(report.plot_sweep(
            sweep, out.with_name(out.stem + "_throughput.png")))
    config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
    config["request_rate"] = report.rate_label(args.request_rate)
    report.write_json(out, {
        "command": shlex.join(["pdserve", *sys.argv[1:]]), "date": now.isoformat(),
        "endpoint": args.base_url.rstrip("/") + args.endpoint, "model": model,
        "server_models": server_models, "config": config, "runs": records, "plots": plots})
    print(f"results: {out}\nplots: {', '.join(plots.values())}")
    failed = sum(r["summary"]["failed"] for r in records)
    return 1 if failed == sum(len(r["requests"]) for r in records) else 0
