"""Summary (issue #8's Done-when lines), progress lines and the PNG of bench_payoff.

    python -m bench.lab.bench_payoff --plot results.json    # (re)draw the PNG from a JSON

Only the plot needs matplotlib; it is imported when drawing, so a GPU host without it still
writes the JSON, and the PNG can be made afterwards anywhere.
"""
from __future__ import annotations

import json
from pathlib import Path

GOODPUT_TARGET = 1.5  # disaggregated goodput >= 1.5x colocated's
ITL_TARGET = 1.2  # loaded p99 ITL within 1.2x of the no-prefill-traffic value
ATTAINMENT = 0.9  # "keeps >= 90% SLO attainment"
LABELS = {"disagg": "disaggregated (1 P + 1 D)", "colocated": "colocated (2 replicas)"}


def progress_line(setup: str, rate: float, s: dict, elapsed_s: float) -> str:
    def ms(d: dict, key: str) -> str:
        v = d.get(key)
        return "n/a" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"
    st = s.get("stages", {}).get("router_stage_mean_ms", {})
    return (f"[{elapsed_s:6.0f} s] {setup:<9} rate {rate:>5g}/s: {s['requests']:>4} req, "
            f"attain {100 * s['slo_attainment']:5.1f}%, goodput {s['goodput_rps']:.2f}/s | "
            f"TTFT p50/p99 {ms(s['ttft_ms'], 'p50')}/{ms(s['ttft_ms'], 'p99')} ms, "
            f"TPOT p50/p99 {ms(s['tpot_ms'], 'p50')}/{ms(s['tpot_ms'], 'p99')} ms, "
            f"ITL p50/p99 {ms(s['itl_ms'], 'p50')}/{ms(s['itl_ms'], 'p99')} ms | "
            f"stages ms: prefill {ms(st, 'prefill')}, kv {ms(st, 'kv_transfer')}, "
            f"dq {ms(st, 'decode_queue')}, conc {s['mean_decode_concurrency']:.1f}"
            + (f" | {s['failed']} failed" if s["failed"] else ""))


def measured(runs: list[dict]) -> list[dict]:
    return [r for r in runs if "summary" in r]


def knee(runs: list[dict]) -> dict | None:
    """The run at the highest rate that keeps >= 90% SLO attainment (None if none does)."""
    ok = [r for r in measured(runs) if r["summary"]["slo_attainment"] >= ATTAINMENT]
    return max(ok, key=lambda r: r["rate"], default=None)


def _at_rate(runs: list[dict], rate: float) -> dict | None:
    return next((r for r in measured(runs) if r["rate"] == rate), None)


def _stages_present(run: dict | None) -> bool:
    if not run:
        return False
    counts = run["summary"].get("stages", {}).get("router_stage_count", {})
    return all(counts.get(s, 0) > 0 for s in ("prefill", "kv_transfer", "decode_queue"))


def summarize(results: dict, baseline: dict | None) -> dict:
    """Issue #8's Done-when lines, computed from the runs of both setups."""
    dis, col = results.get("disagg", {}).get("runs", []), results.get("colocated", {}).get("runs", [])
    kd, kc = knee(dis), knee(col)
    out: dict = {"attainment_threshold": ATTAINMENT,
                 "highest_rate_ge_90pct": {"disagg": kd and kd["rate"], "colocated": kc and kc["rate"]},
                 "goodput_at_that_rate": {"disagg": kd and kd["summary"]["goodput_rps"],
                                          "colocated": kc and kc["summary"]["goodput_rps"]}}
    gd, gc = out["goodput_at_that_rate"]["disagg"], out["goodput_at_that_rate"]["colocated"]
    # colocated measured but never at >= 90%: its knee lies below the sweep, so the ratio is
    # unknown (not infinite); the sweep must reach lower rates. Not measured at all: no ratio
    if kc is None and measured(col):
        out["note"] = ("colocated never kept >= 90% SLO attainment in this sweep: its knee is "
                       "below the lowest rate, so no goodput ratio can be claimed")
    ratio = gd / gc if gd and gc else None
    same = _at_rate(col, kd["rate"]) if kd else None
    out["goodput_ratio_disagg_over_colocated"] = ratio
    out["goodput_ratio_at_disagg_rate"] = (gd / same["summary"]["goodput_rps"]
                                          if same and gd and same["summary"]["goodput_rps"] else None)
    out["goodput_met"] = ratio is not None and ratio >= GOODPUT_TARGET
    base_p99 = baseline and baseline.get("summary", {}).get("itl_ms", {}).get("p99")
    ref = _at_rate(dis, baseline["reference_rate"]) if baseline else None
    loaded_p99 = ref and ref["summary"]["itl_ms"]["p99"]
    out["itl"] = {"reference_rate": baseline and baseline["reference_rate"],
                  "loaded_p99_ms": loaded_p99, "no_prefill_p99_ms": base_p99,
                  "ratio": loaded_p99 / base_p99 if loaded_p99 and base_p99 else None,
                  "per_rate_ratio": {str(r["rate"]): (r["summary"]["itl_ms"]["p99"] / base_p99
                                                      if base_p99 and r["summary"]["itl_ms"]["p99"]
                                                      else None) for r in measured(dis)}}
    out["itl_met"] = out["itl"]["ratio"] is not None and out["itl"]["ratio"] <= ITL_TARGET
    out["stage_histograms_met"] = _stages_present(kd or ref)
    out["done_when"] = [
        f"disagg goodput at its highest >=90% rate ({_fmt(kd and kd['rate'])}/s): "
        f"{_fmt(gd)} req/s vs colocated at its own ({_fmt(kc and kc['rate'])}/s): {_fmt(gc)} "
        f"-> {_fmt(ratio)}x (target >= {GOODPUT_TARGET}x): {'met' if out['goodput_met'] else 'NOT met'}",
        f"disagg p99 ITL at {_fmt(out['itl']['reference_rate'])}/s: {_fmt(loaded_p99)} ms vs "
        f"{_fmt(base_p99)} ms without prefill traffic -> {_fmt(out['itl']['ratio'])}x "
        f"(target <= {ITL_TARGET}x): {'met' if out['itl_met'] else 'NOT met'}",
        f"KV transfer / prefill / decode-queue stage histograms in the JSON: "
        f"{'met' if out['stage_histograms_met'] else 'NOT met'}"]
    out["met"] = out["goodput_met"] and out["itl_met"] and out["stage_histograms_met"]
    return out


def _fmt(v) -> str:
    if v is None:
        return "n/a"
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def plot(payload: dict, path: str | Path) -> Path:
    """Goodput vs rate and p99 ITL vs rate, both setups (plus the no-prefill ITL line)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    for setup, data in payload.get("results", {}).items():
        runs = measured(data.get("runs", []))
        rates = [r["rate"] for r in runs]
        label = LABELS.get(setup, setup)
        ax1.plot(rates, [r["summary"]["goodput_rps"] for r in runs], "o-", label=label)
        ax2.plot(rates, [r["summary"]["itl_ms"]["p99"] or float("nan") for r in runs], "o-",
                 label=label)
    all_rates = sorted({r["rate"] for d in payload.get("results", {}).values()
                        for r in measured(d.get("runs", []))})
    if all_rates:
        ax1.plot(all_rates, all_rates, ":", color="gray", label="offered (nominal) rate")
    base = (payload.get("baseline") or {}).get("summary", {}).get("itl_ms", {}).get("p99")
    if base:
        ax2.axhline(base, color="gray", ls="--", label="disagg, no prefill traffic")
        ax2.axhline(base * ITL_TARGET, color="gray", ls=":", label=f"{ITL_TARGET}x that")
    slo = payload.get("plan", {}).get("slo", {})
    ax1.set_title(f"Goodput (TTFT <= {slo.get('ttft', '?')} s, TPOT <= "
                  f"{1000 * slo['tpot'] if 'tpot' in slo else '?'} ms)")
    ax1.set_ylabel("requests / s meeting both SLOs")
    ax2.set_title("p99 inter-token latency")
    ax2.set_ylabel("ms")
    for ax in (ax1, ax2):
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{payload.get('plan', {}).get('model', '')} on {payload.get('device', '')}",
                 fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_from_json(json_path: str | Path) -> Path:
    payload = json.loads(Path(json_path).read_text())
    return plot(payload, Path(json_path).with_suffix(".png"))
