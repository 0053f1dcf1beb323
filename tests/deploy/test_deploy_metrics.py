"""Grafana dashboard, Prometheus config and alert rules: names, structure, PromQL, firing.

promtool (Debian package `prometheus`) checks the PromQL and runs rule unit tests; those
tests skip where it is not installed.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import deploy_checks as dc
import pytest
import yaml

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None,
                                    reason="promtool missing (Debian package `prometheus`)")
STAGES = ("router_queue", "prefill_queue", "prefill", "kv_transfer", "decode_queue", "decode")


@pytest.mark.parametrize("expr, names", [
    ('histogram_quantile(0.9, sum by (le, worker) (rate(pdserve:a_bucket{role="router",'
     'x=~"b|c"}[$__rate_interval]))) > 2', {"pdserve:a_bucket"}),
    ("sum(rate(a:b_total[5m] offset 1h)) / ignoring(pos) group_left sum(c) and on(x) up == 0",
     {"a:b_total", "c", "up"}),
    ("sum without(x) (y) / max(z) by (q)", {"y", "z"}),
    ("1 + 2e3 * scalar(foo)", {"foo"}),
    ('label_replace(m, "dst", "$1", "src", "(.*)")', {"m"}),
])
def test_promql_metric_names(expr, names):
    assert dc.promql_metric_names(expr) == names


def test_dashboard_and_alerts_use_only_names_pdserve_defines():
    used = dc.used_metric_names()
    known, modules = dc.source_metric_names()
    assert "pdserve.worker.metrics" in modules
    if dc.DESIGN.exists():
        known |= dc.design_metric_names()
    assert dc.missing_metric_names(used, known) == set()
    assert {n for n in used if not n.startswith("pdserve:")} <= dc.PROMETHEUS_BUILTINS


def test_design_names_expand_shorthand():
    if not dc.DESIGN.exists():
        pytest.skip(f"{dc.DESIGN} not present")
    names = dc.design_metric_names()
    for n in ("time_to_first_token_seconds_bucket", "prefix_cache_hits_total",
              "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_per_pos_total",
              "kv_transfer_bytes_total", "kv_lease_expired_total", "router_retries_total"):
        assert "pdserve:" + n in names


def test_missing_names_against_an_exposition():
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    reg = CollectorRegistry()
    Counter("pdserve:kv_transfer_bytes", "b", ["worker"], registry=reg).labels(worker="d0").inc(3)
    Histogram("pdserve:time_to_first_token_seconds", "t", registry=reg).observe(0.1)
    exported = dc.names_from_exposition(generate_latest(reg).decode())
    used = {"pdserve:kv_transfer_bytes_total", "pdserve:time_to_first_token_seconds_bucket",
            "pdserve:kv_lease_expired_total", "up"}
    assert dc.missing_metric_names(used, exported) == {"pdserve:kv_lease_expired_total"}


def test_dashboard_covers_the_operator_questions():
    dash = json.loads(dc.DASHBOARD.read_text())
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["h"] > 0
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource"]
    exprs = " ".join(dc.dashboard_exprs())
    for metric in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                   "e2e_request_latency_seconds"):
        for q in ("0.5", "0.9", "0.99"):
            assert f"histogram_quantile({q}, sum by (le) (rate(pdserve:{metric}_bucket" in exprs
    for stage in STAGES:
        assert f"pdserve:stage_{stage}_seconds_sum" in exprs
        assert f"pdserve:stage_{stage}_seconds_bucket" in exprs
    for name in ("kv_transfer_bytes_total", "kv_transfer_failures_total", "kv_lease_expired_total",
                 "kv_cache_usage_perc", "prefix_cache_hits_total",
                 "spec_decode_num_accepted_tokens_total"):
        assert f"pdserve:{name}" in exprs


def _rules_file(exprs: list[str], path: Path) -> Path:
    rules = [{"record": f"pdserve_check:expr_{i}",
              "expr": e.replace("$__rate_interval", "1m").replace("${datasource}", "")}
             for i, e in enumerate(exprs)]
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    return path


def _promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


@needs_promtool
def test_dashboard_queries_are_valid_promql(tmp_path):
    exprs = dc.dashboard_exprs()
    proc = _promtool("check", "rules", str(_rules_file(exprs, tmp_path / "dash.yml")))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in proc.stdout


@needs_promtool
def test_prometheus_config_and_alert_rules_check():
    proc = _promtool("check", "config", str(dc.DEPLOY / "prometheus" / "prometheus.yml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 rule files found" in proc.stdout
    proc = _promtool("check", "rules", str(dc.ALERTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr



@needs_promtool
def test_alert_rules_fire_on_synthetic_series(tmp_path):
    shutil.copy(dc.ALERTS, tmp_path / "alerts.yml")
    ttft = 'pdserve:time_to_first_token_seconds_bucket{role="router",worker="r0",le="%s"}'
    series = [
        {"series": 'pdserve:kv_transfer_failures_total{role="decode",worker="d0"}',
         "values": "0+1x30"},  # one failed read a minute
        {"series": 'pdserve:kv_transfer_failures_total{role="decode",worker="d1"}',
         "values": "4+0x30"},  # failed once, long ago: flat
        {"series": 'pdserve:router_worker_up{role="decode",worker="d0"}', "values": "1 1 0x20"},
        {"series": 'pdserve:router_worker_up{role="prefill",worker="p0"}', "values": "1x22"},
        {"series": ttft % "1", "values": "0+0x30"},
        {"series": ttft % "2.5", "values": "0+10x30"},  # every request 1 s < TTFT <= 2.5 s
        {"series": ttft % "+Inf", "values": "0+10x30"},
    ]
    tests = [{"interval": "1m", "input_series": series, "alert_rule_test": [
        {"eval_time": "15m", "alertname": "PdserveKVTransferFailures", "exp_alerts": [
            {"exp_labels": {"severity": "warning", "worker": "d0"},
             "exp_annotations": {"summary": "KV reads fail on decode worker d0"}}]},
        {"eval_time": "15m", "alertname": "PdserveNoDecodeWorker", "exp_alerts": [
            {"exp_labels": {"severity": "critical"}, "exp_annotations": {
                "summary": "No decode worker is usable: the router cannot serve requests"}}]},
        {"eval_time": "2m", "alertname": "PdserveNoDecodeWorker", "exp_alerts": []},
        {"eval_time": "15m", "alertname": "PdserveWorkerDown", "exp_alerts": [
            {"exp_labels": {"severity": "warning", "role": "decode", "worker": "d0"},
             "exp_annotations": {"summary": "decode worker d0 is out of rotation"}}]},
        {"eval_time": "20m", "alertname": "PdserveHighTTFT", "exp_alerts": [
            {"exp_labels": {"severity": "warning"}, "exp_annotations": {
                "summary": "p90 time to first token is 2.35s",
                "description": "Check the per-stage panels: router queue, prefill queue, "
                               "prefill, KV transfer or decode queue."}}]},
        {"eval_time": "8m", "alertname": "PdserveHighTTFT", "exp_alerts": []},  # `for: 10m`
        {"eval_time": "15m", "alertname": "PdserveKVLeaseExpiries", "exp_alerts": []},
    ]}]
    test_file = tmp_path / "alerts_test.yml"
    test_file.write_text(yaml.safe_dump({"rule_files": ["alerts.yml"], "evaluation_interval": "1m",
                                         "tests": tests}, sort_keys=False))
    proc = _promtool("test", "rules", test_file.name, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr

