"""Statistics, JSON results and PNG plots for `pdserve bench`.

Latency distributions are reported in milliseconds (mean, p50, p90, p99), as `vllm bench
serve` and `sglang.bench_serving` do. Goodput counts only requests that meet every given
SLO (seconds): ttft, tpot, e2e, itl (the request's worst inter-token gap).
"""
from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.loadgen import RequestResult

SLO_KEYS = ("ttft", "tpot", "e2e", "itl")
PERCENTILES = (50, 90, 99)


def parse_slo(text: str | None) -> dict[str, float]:
    """"ttft=1.0,tpot=0.025" -> {"ttft": 1.0, "tpot": 0.025} (seconds)."""
    slo: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"slo: expected KEY=SECONDS with KEY in {SLO_KEYS}, got {part!r}")
        try:
            slo[key] = float(value)
        except ValueError as e:
            raise ValueError(f"slo: {key} must be a number of seconds, got {value!r}") from e
        if not slo[key] > 0:
            raise ValueError(f"slo: {key} must be > 0, got {value!r}")
    return slo


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    if not r.success:
        return False
    measured = {"ttft": r.ttft, "e2e": r.e2e, "tpot": r.tpot or 0.0,
                "itl": max(r.itl, default=0.0)}
    return all(measured[k] <= limit for k, limit in slo.items())


def distribution_ms(values: Iterable[float]) -> dict[str, float | None]:
    """mean / p50 / p90 / p99 in ms of values given in seconds (None when empty)."""
    arr = np.asarray(list(values), dtype=np.float64) * 1000.0
    if arr.size == 0:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}, "count": 0}
    out: dict[str, float | None] = {"mean": float(arr.mean())}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(arr, p))
    out["count"] = int(arr.size)
    return out


def summarize(results: list[RequestResult], duration_s: float,
              slo: dict[str, float] | None = None) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    errors = Counter(r.error for r in results if not r.success)
    in_tok = sum(r.prompt_tokens for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    dur = max(duration_s, 1e-9)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(errors.most_common(5)),
        "duration_s": duration_s,
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "usage_reported": all(r.usage_reported for r in ok) if ok else False,
        "request_throughput": len(ok) / dur,
        "output_token_throughput": out_tok / dur,
        "total_token_throughput": (in_tok + out_tok) / dur,
        "ttft_ms": distribution_ms(r.ttft for r in ok),
        "tpot_ms": distribution_ms(t for r in ok if (t := r.tpot) is not None),
        "itl_ms": distribution_ms(x for r in ok for x in r.itl),
        "e2e_ms": distribution_ms(r.e2e for r in ok),
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in results)
        summary["slo"] = dict(slo)
        summary["goodput"] = good / dur  # requests/s meeting every SLO
        summary["slo_attainment"] = good / len(results) if results else 0.0
    return summary


def request_records(results: list[RequestResult]) -> list[dict[str, Any]]:
    """Per-request measurements for the JSON file (seconds, rounded to microseconds)."""
    def r6(x: float | None) -> float | None:
        return None if x is None else round(x, 6)

    return [{"success": r.success, "error": r.error or None, "input_len": r.input_len,
             "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
             "ttft_s": r6(r.ttft), "e2e_s": r6(r.e2e), "tpot_s": r6(r.tpot),
             "itl_s": [round(x, 6) for x in r.itl]} for r in results]


def rate_label(rate: float | str) -> str | float:
    """JSON has no infinity: an infinite rate is written as "inf"."""
    return "inf" if isinstance(rate, float) and math.isinf(rate) else rate


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path


def format_summary(summary: dict[str, Any], title: str) -> str:
    """A plain-text table like vLLM's, for the terminal."""
    lines = [f"{'=' * 20} {title} {'=' * 20}",
             f"{'Successful requests:':<36}{summary['completed']}",
             f"{'Failed requests:':<36}{summary['failed']}",
             f"{'Duration (s):':<36}{summary['duration_s']:.2f}",
             f"{'Total input tokens:':<36}{summary['total_input_tokens']}",
             f"{'Total output tokens:':<36}{summary['total_output_tokens']}",
             f"{'Request throughput (req/s):':<36}{summary['request_throughput']:.2f}",
             f"{'Output token throughput (tok/s):':<36}{summary['output_token_throughput']:.2f}",
             f"{'Total token throughput (tok/s):':<36}{summary['total_token_throughput']:.2f}"]
    if "goodput" in summary:
        lines.append(f"{'Goodput (req/s):':<36}{summary['goodput']:.2f}")
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                      ("e2e_ms", "E2E")):
        d = summary[key]
        if d["mean"] is None:
            lines.append(f"{name + ' (ms):':<36}n/a")
            continue
        stats = "  ".join(f"{k}={d[k]:.2f}" for k in ("mean", "p50", "p90", "p99"))
        lines.append(f"{name + ' (ms):':<36}{stats}")
    for err, n in summary["errors"].items():
        lines.append(f"  error x{n}: {err}")
    return "\n".join(lines)


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt
    return plt


def plot_cdfs(runs: list[tuple[str, list[RequestResult]]], path: str | Path) -> Path:
    """Empirical CDFs of TTFT, TPOT, ITL and E2E (ms), one line per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    metrics = (("TTFT", lambda ok: [r.ttft for r in ok]),
               ("TPOT", lambda ok: [t for r in ok if (t := r.tpot) is not None]),
               ("ITL", lambda ok: [x for r in ok for x in r.itl]),
               ("E2E latency", lambda ok: [r.e2e for r in ok]))
    for ax, (name, pick) in zip(axes.flat, metrics):
        for label, results in runs:
            vals = np.sort(np.asarray(pick([r for r in results if r.success]))) * 1000.0
            if vals.size:
                ax.step(vals, np.arange(1, vals.size + 1) / vals.size, where="post", label=label)
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path, plt)


def plot_sweep(summaries: list[tuple[str, dict[str, Any]]], path: str | Path) -> Path:
    """Throughput and goodput against request rate (categorical x: "inf" is a rate too)."""
    plt = _pyplot()
    labels = [lab for lab, _ in summaries]
    x = np.arange(len(labels))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.plot(x, [s["request_throughput"] for _, s in summaries], "o-", label="throughput")
    if all("goodput" in s for _, s in summaries):
        ax1.plot(x, [s["goodput"] for _, s in summaries], "s--", label="goodput (SLO met)")
    ax1.set_ylabel("requests / s")
    ax2.plot(x, [s["output_token_throughput"] for _, s in summaries], "o-", label="output")
    ax2.plot(x, [s["total_token_throughput"] for _, s in summaries], "s--", label="input + output")
    ax2.set_ylabel("tokens / s")
    for ax, title in ((ax1, "Request throughput"), (ax2, "Token throughput")):
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path, plt)


def _save(fig, path: str | Path, plt) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
