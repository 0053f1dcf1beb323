"""Where the server spent a load run's time, stage by stage (ANCHORS #11): the difference of
a pdserve router's stage histograms (GET /metrics, open without the API key) between the
start and the end of the run. Any other server has no such series: the breakdown is None.

The router's stages (router/metrics.py STAGES: router queue, prefill queue, prefill, KV
transfer, decode queue, decode) add up to its end-to-end latency per request, so their means
add up to the mean end-to-end time the router saw.
"""
from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.loadgen import auth_headers

PREFIX = "pdserve:"
STAGE = PREFIX + "stage_"
E2E = PREFIX + "e2e_request_latency_seconds"


def scrape(base_url: str, api_key: str | None = None,
           timeout_s: float = 10.0) -> dict[str, float] | None:
    """{histogram name: (sum, count)} as flat "name_sum" / "name_count" keys, summed over label
    sets, for the router's stage and e2e histograms; None when the server exports none.
    The key goes along for a gateway in front (pdserve's own /metrics is open)."""
    try:
        resp = httpx.get(base_url.rstrip("/") + "/metrics", headers=auth_headers(api_key),
                         timeout=timeout_s)
        resp.raise_for_status()
        families = list(text_string_to_metric_families(resp.text))
    except (httpx.HTTPError, ValueError):
        return None
    out: dict[str, float] = {}
    for fam in families:
        if fam.type != "histogram" or not (fam.name.startswith(STAGE) or fam.name == E2E):
            continue
        for s in fam.samples:
            if s.labels.get("role") == "router" and s.name.endswith(("_sum", "_count")):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out or None


def breakdown(before: dict[str, float] | None, after: dict[str, float] | None
              ) -> dict[str, dict[str, float]] | None:
    """Per stage: requests observed in the run and their mean (ms); "e2e" the same for the
    router's end-to-end latency. None without both scrapes, or when a count went down (the
    router restarted in between: the difference would mean nothing)."""
    if before is None or after is None:
        return None
    result = {}
    for key in sorted(after):
        if not key.endswith("_count"):
            continue
        base = key[: -len("_count")]
        n = after[key] - before.get(key, 0.0)
        if n < 0:
            return None
        total = after.get(base + "_sum", 0.0) - before.get(base + "_sum", 0.0)
        name = "e2e" if base == E2E else base[len(STAGE):].removesuffix("_seconds")
        result[name] = {"count": n, "mean_ms": total / n * 1e3 if n else 0.0}
    return result


def format_breakdown(stages: dict[str, dict[str, float]]) -> list[str]:
    """Terminal lines: each stage's mean and share of the mean end-to-end time."""
    e2e = stages.get("e2e", {}).get("mean_ms", 0.0)
    lines = ["Server time by stage (router, mean ms):"]
    for name, st in stages.items():
        if name == "e2e":
            continue
        share = f"  {st['mean_ms'] / e2e:6.1%}" if e2e else ""
        lines.append(f"  {name:<34}{st['mean_ms']:10.2f}{share}")
    lines.append(f"  {'end to end':<34}{e2e:10.2f}")
    return lines
