"""The cluster's own Prometheus metrics around each bench_payoff run: scrape, delta, stages.

Every process exports /metrics (router: its HTTP port; workers: the metrics address they
publish). A run is bracketed by two scrapes; the per-run delta of every counter and
histogram (sum, count, cumulative buckets) goes into the JSON, and the router's per-stage
histograms (router queue, prefill queue, prefill, KV transfer, decode queue, decode) give
the mean time a request spent in each stage, next to the router's mean TTFT and E2E.
"""
from __future__ import annotations

import math
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

STAGES = ("router_queue", "prefill_queue", "prefill", "kv_transfer", "decode_queue", "decode")
PRE_TOKEN_STAGES = STAGES[:-1]  # what a request waits before its first decode step
P = "pdserve:"


def scrape(address: str, timeout_s: float = 10.0) -> dict:
    """{family: {"type": ..., "samples": {(sample name, labels): value}}} of one endpoint."""
    url = address if address.startswith("http") else f"http://{address}/metrics"
    if not url.rstrip("/").endswith("/metrics"):
        url = url.rstrip("/") + "/metrics"
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - loopback
        text = resp.read().decode("utf-8", errors="replace")
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        if fam.type not in ("counter", "histogram"):
            continue
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in fam.samples
                   if not s.name.endswith("_created")}
        out[fam.name] = {"type": fam.type, "samples": samples}
    return out


def snapshot(endpoints: dict[str, str]) -> dict[str, dict]:
    """Scrape every process ({source name: address}); a failed scrape is recorded, not raised."""
    snap = {}
    for name, address in endpoints.items():
        try:
            snap[name] = scrape(address)
        except OSError as e:
            snap[name] = {"__error__": f"{type(e).__name__}: {e}"}
    return snap


def _label_key(labels: tuple) -> str:
    return ",".join(f"{k}={v}" for k, v in labels if k != "le") or "-"


def _hist_delta(before: dict, after: dict) -> dict:
    out: dict[str, dict] = {}
    for (name, labels), value in after.items():
        d = value - before.get((name, labels), 0.0)
        entry = out.setdefault(_label_key(labels), {"sum": 0.0, "count": 0.0, "buckets": {}})
        if name.endswith("_bucket"):
            le = dict(labels)["le"]
            entry["buckets"][le] = d
        elif name.endswith("_sum"):
            entry["sum"] = d
        elif name.endswith("_count"):
            entry["count"] = d
    return out


def delta(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict]:
    """Per source: {"histograms": {family: {labels: {sum, count, buckets}}},
    "counters": {family: {labels: increase}}} between two snapshots."""
    out: dict[str, dict] = {}
    for source, fams in after.items():
        if "__error__" in fams or "__error__" in before.get(source, {}):
            out[source] = {"error": fams.get("__error__") or before[source]["__error__"]}
            continue
        hists, counters = {}, {}
        for fam, data in fams.items():
            prev = before.get(source, {}).get(fam, {"samples": {}})["samples"]
            if data["type"] == "histogram":
                hists[fam] = _hist_delta(prev, data["samples"])
            else:
                counters[fam] = {_label_key(lb): v - prev.get((n, lb), 0.0)
                                 for (n, lb), v in data["samples"].items()}
        out[source] = {"histograms": hists, "counters": counters}
    return out


def hist_quantile(buckets: dict[str, float], q: float) -> float | None:
    """Prometheus' histogram_quantile (linear within the bucket) of cumulative buckets."""
    edges = sorted(((math.inf if le == "+Inf" else float(le)), c) for le, c in buckets.items())
    if not edges or edges[-1][1] <= 0:
        return None
    rank, prev_le, prev_c = q * edges[-1][1], 0.0, 0.0
    for le, c in edges:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_c) / max(c - prev_c, 1e-12))
        prev_le, prev_c = le, c
    return prev_le


def _one(dl: dict, family: str) -> dict | None:
    """The single labelled series of a histogram family (router: one series per family)."""
    series = (dl.get("histograms") or {}).get(P + family) or {}
    return next(iter(series.values()), None)


def _mean_ms(h: dict | None) -> float | None:
    return None if not h or not h["count"] else 1000.0 * h["sum"] / h["count"]


def stage_summary(dl: dict[str, dict]) -> dict:
    """Mean per stage from the router's histograms (ms), the router's mean TTFT/E2E, and the
    workers' own stage histograms, so a request's time across the split adds up."""
    router = next((v for k, v in dl.items() if k == "router"), {})
    stages = {s: _mean_ms(_one(router, f"stage_{s}_seconds")) for s in STAGES}
    counts = {s: (_one(router, f"stage_{s}_seconds") or {}).get("count", 0) for s in STAGES}
    pre = [stages[s] for s in PRE_TOKEN_STAGES]
    out = {"router_stage_mean_ms": stages, "router_stage_count": counts,
           "router_pre_token_stages_sum_ms": sum(pre) if all(v is not None for v in pre) else None,
           "router_all_stages_sum_ms": sum(v for v in stages.values() if v is not None),
           "router_ttft_mean_ms": _mean_ms(_one(router, "time_to_first_token_seconds")),
           "router_e2e_mean_ms": _mean_ms(_one(router, "e2e_request_latency_seconds")),
           "router_itl_p99_ms_from_buckets": None, "workers": {}}
    itl = _one(router, "inter_token_latency_seconds")
    if itl and itl["count"]:
        q = hist_quantile(itl["buckets"], 0.99)
        out["router_itl_p99_ms_from_buckets"] = None if q is None else 1000.0 * q
    for name, wd in dl.items():
        if name == "router" or "histograms" not in wd:
            continue
        out["workers"][name] = {fam[len(P):]: _mean_ms(_one(wd, fam[len(P):]))
                                for fam in ("pdserve:request_queue_time_seconds",
                                            "pdserve:request_prefill_time_seconds",
                                            "pdserve:stage_kv_transfer_seconds",
                                            "pdserve:stage_decode_queue_seconds",
                                            "pdserve:kv_transfer_seconds",
                                            "pdserve:time_to_first_token_seconds")}
    return out
