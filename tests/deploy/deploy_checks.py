"""Helpers that check deploy/ against what pdserve exports.

Metric names are compared as Prometheus *sample* names (what PromQL queries name):
a Counter `x` is exported as `x_total`, a Histogram as `x_bucket` / `x_sum` / `x_count`.

For the cluster-based test: `missing_metric_names(used_metric_names(), exported)` where
`exported` is `names_from_exposition(text)` over every /metrics endpoint of the running
cluster (or Prometheus's /api/v1/label/__name__/values) must be empty.
"""
from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "pdserve-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
DESIGN = REPO / "docs" / "design.md"

# series Prometheus makes itself (not exported by any pdserve process)
PROMETHEUS_BUILTINS = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped",
                                 "scrape_samples_post_metric_relabeling", "scrape_series_added"})
_PROMQL_WORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right",
                           "bool", "offset", "and", "or", "unless", "inf", "nan", "atan2"})
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
             "summary": ("", "_sum", "_count"), "gauge": ("",), "info": ("_info",),
             "stateset": ("",), "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
             "unknown": ("",)}


# --- names used by the dashboard and the alert rules -------------------------------------

def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (functions, keywords, labels and durations are
    not names). Grafana variables ($__rate_interval, ${datasource}) are ignored."""
    e = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`', '""', expr)  # strings
    e = re.sub(r"\{[^{}]*\}", "{}", e)  # label matchers
    e = re.sub(r"\[[^\[\]]*\]", "[]", e)  # ranges, subqueries
    # grouping and matching clauses name labels, not metrics: drop them with their keyword
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w:.$])[A-Za-z_:][\w:]*", e):
        rest = e[m.end():].lstrip()
        if rest.startswith("(") or m.group().lower() in _PROMQL_WORDS:
            continue  # a function call or a keyword
        names.add(m.group())
    return names


def _find_key(node: Any, key: str) -> Iterable[Any]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                yield v
            yield from _find_key(v, key)
    elif isinstance(node, list):
        for v in node:
            yield from _find_key(v, key)


def dashboard_exprs(path: Path = DASHBOARD) -> list[str]:
    return [e for e in _find_key(json.loads(path.read_text()), "expr") if isinstance(e, str)]


def alert_exprs(path: Path = ALERTS) -> list[str]:
    doc = yaml.safe_load(path.read_text())
    return [str(r["expr"]) for g in doc["groups"] for r in g["rules"]]


def used_metric_names() -> set[str]:
    """Every metric name the dashboard and the alert rules query."""
    out: set[str] = set()
    for expr in dashboard_exprs() + alert_exprs():
        out |= promql_metric_names(expr)
    return out


def missing_metric_names(used: Iterable[str], exported: Iterable[str]) -> set[str]:
    """Used names that nothing exports (Prometheus's own series such as `up` excepted)."""
    return set(used) - set(exported) - PROMETHEUS_BUILTINS


# --- names pdserve exports -----------------------------------------------------------------

def names_from_exposition(text: str) -> set[str]:
    """Sample names in a /metrics response (Prometheus text format)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def registry_sample_names(registry) -> set[str]:
    """Sample names a CollectorRegistry's families export, children created or not."""
    names = set()
    for fam in registry.collect():
        for suffix in _SUFFIXES.get(fam.type, ("",)):
            names.add(fam.name + suffix)
    return names


def _worker_registry(reg) -> None:
    importlib.import_module("pdserve.worker.metrics").WorkerMetrics(reg, "decode", "w0")


def _kv_registry(reg) -> None:
    importlib.import_module("pdserve.kv_transfer.metrics").KVTransferMetrics(reg)


def _router_registry(reg) -> None:
    importlib.import_module("pdserve.router.metrics").RouterMetrics("r0", reg)


# module -> how to build its metric families in a fresh registry
METRIC_SOURCES: dict[str, Callable[[Any], None]] = {
    "pdserve.worker.metrics": _worker_registry,
    "pdserve.kv_transfer.metrics": _kv_registry,
    "pdserve.router.metrics": _router_registry,
}


def source_metric_names() -> tuple[set[str], list[str]]:
    """Sample names the pdserve modules that exist define; and which modules were read."""
    from prometheus_client import CollectorRegistry

    names: set[str] = set()
    read = []
    for module, build in METRIC_SOURCES.items():
        if not (REPO / (module.removeprefix("pdserve.").replace(".", "/") + ".py")).exists():
            continue
        reg = CollectorRegistry()
        build(reg)
        names |= registry_sample_names(reg)
        read.append(module)
    return names, read


def design_metric_names(path: Path = DESIGN) -> set[str]:
    """Names DESIGN.md's Observability section lists, with the `pdserve:` prefix, in every
    sample form (the section does not say which are counters). "`a_b_c` / `_d`" means
    `a_b_d`: the suffix replaces the words from where its first word appears (or the last)."""
    text = path.read_text()
    m = re.search(r"^## Observability\n(.*?)(?=^## )", text, re.S | re.M)
    if m is None:
        raise ValueError(f"{path}: no '## Observability' section")
    names, last = set(), ""
    for tok in re.findall(r"`([A-Za-z_][\w]*)`", m.group(1)):
        if tok.startswith("_") and last:
            first = tok[1:].split("_")[0]
            cut = last.find("_" + first + "_")
            stem = last[:cut] if cut > 0 else last.rsplit("_", 1)[0]
            names.add(stem + tok)
        else:
            names.add(tok)
            last = tok
    forms = ("", "_total", "_bucket", "_sum", "_count")
    return {f"pdserve:{n}{s}" for n in names for s in forms}

