"""bench_payoff (issue #8): helpers as plain functions, and one end-to-end CPU smoke run of
both setups (disagg: 1 prefill + 1 decode actor; colocated: 2 replicas) on a tiny preset,
through the real Ray workers, router and NIXL path, with the JSON and PNG checked."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.lab import payoff_load as load
from bench.lab import payoff_metrics as pm
from bench.lab import payoff_report as report
from bench.lab.payoff_driver import parse_worker_opts, write_json

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_percentiles_match_numpy():
    vals = sorted([0.3, 0.1, 0.7, 0.2, 0.9, 0.4, 0.05])
    for q in (0, 50, 90, 99, 100):
        assert load.percentile(vals, q) == pytest.approx(np.percentile(vals, q))
    d = load.dist_ms([0.01, 0.02, 0.03])
    assert d["p50"] == pytest.approx(20.0) and d["count"] == 3 and d["max"] == pytest.approx(30.0)
    assert load.dist_ms([])["p99"] is None


def test_result_itl_tpot_and_slo():
    r = load.Result(arrival=0.0, prompt_len=10, output_len=4, sent=1.0, tokens=4, ttft=0.5,
                    e2e=0.8, times=[(0.5, 1), (0.6, 1), (0.8, 2)])
    assert r.itl() == pytest.approx([0.1, 0.1, 0.1])  # a 2-token message = 2 gaps
    assert r.itl(lo=1.65) == pytest.approx([0.1, 0.1])  # only the message at 1.0 + 0.8
    assert r.tpot == pytest.approx(0.1)
    assert load.meets(r, {"ttft": 1.0, "tpot": 0.11})
    assert not load.meets(r, {"ttft": 0.4, "tpot": 0.11})
    assert not load.meets(r, {"ttft": 1.0, "tpot": 0.09})
    r.error = "cut off"
    assert not load.meets(r, {"ttft": 1.0, "tpot": 1.0})


def test_poisson_specs_and_summary():
    from pdserve.bench.workload import LengthRange

    specs = load.poisson_specs(20.0, 5.0, LengthRange(3, 9), LengthRange(2, 4), 50, seed=1)
    assert 50 < len(specs) < 160 and all(s.arrival < 5.0 for s in specs)
    assert all(3 <= len(s.prompt) <= 9 and 2 <= s.output_len <= 4 for s in specs)
    assert all(0 <= t < 50 for s in specs for t in s.prompt)
    res = [load.Result(s.arrival, len(s.prompt), s.output_len, sent=s.arrival, tokens=2,
                       ttft=0.1, e2e=0.2, times=[(0.1, 1), (0.2, 1)]) for s in specs]
    res[-1].error = "x"
    s = load.summarize(res, {"ttft": 1.0, "tpot": 1.0}, 5.0, ramp_s=1.0)
    measured = [r for r in res if r.arrival >= 1.0]
    assert s["requests"] == len(measured) and s["good"] == len(measured) - 1
    assert s["goodput_rps"] == pytest.approx(s["good"] / 4.0)
    assert s["errors"] == {"x": 1} and s["itl_ms"]["p50"] == pytest.approx(100.0)


def test_metrics_delta_and_histogram_quantile():
    lb = (("role", "router"), ("worker", "r"))

    def snap(count, total, b1):
        name = "pdserve:stage_prefill_seconds"
        return {"router": {name: {"type": "histogram", "samples": {
            (name + "_bucket", lb + (("le", "0.1"),)): b1,
            (name + "_bucket", lb + (("le", "+Inf"),)): count,
            (name + "_sum", lb): total, (name + "_count", lb): count}}}}
    d = pm.delta(snap(2, 0.1, 2), snap(6, 0.5, 4))
    h = d["router"]["histograms"]["pdserve:stage_prefill_seconds"]["role=router,worker=r"]
    assert h == {"sum": pytest.approx(0.4), "count": 4, "buckets": {"0.1": 2, "+Inf": 4}}
    assert pm.stage_summary(d)["router_stage_mean_ms"]["prefill"] == pytest.approx(100.0)
    assert pm.hist_quantile({"0.1": 2, "1.0": 4, "+Inf": 4}, 0.5) == pytest.approx(0.1)
    assert pm.hist_quantile({"0.1": 0, "+Inf": 0}, 0.5) is None


def test_worker_opts():
    assert parse_worker_opts(["prefill:max_num_batched_tokens=8192", "seed=3"]) == {
        "prefill": {"max_num_batched_tokens": 8192}, "all": {"seed": 3}}
    for bad in ("nope=1", "sideways:seed=1", "seed"):
        with pytest.raises(ValueError, match="--worker-opt"):
            parse_worker_opts([bad])


def _run(rate, attain, goodput, itl_p99=10.0, stages=True):
    counts = {s: (3 if stages else 0) for s in pm.STAGES}
    return {"rate": rate, "summary": {"slo_attainment": attain, "goodput_rps": goodput,
                                      "itl_ms": {"p99": itl_p99},
                                      "stages": {"router_stage_count": counts}}}


def test_summary_done_when_lines(tmp_path):
    results = {"disagg": {"runs": [_run(2, 1.0, 2.0), _run(4, 0.95, 3.8, 11.0), _run(6, 0.5, 3),
                                   {"rate": 8, "skipped": "x"}]},
               "colocated": {"runs": [_run(2, 0.92, 1.8), _run(4, 0.6, 2.4)]}}
    baseline = {"reference_rate": 4, "summary": {"itl_ms": {"p99": 10.0}}}
    s = report.summarize(results, baseline)
    assert s["highest_rate_ge_90pct"] == {"disagg": 4, "colocated": 2}
    assert s["goodput_ratio_disagg_over_colocated"] == pytest.approx(3.8 / 1.8)
    assert s["goodput_ratio_at_disagg_rate"] == pytest.approx(3.8 / 2.4)
    assert s["itl"]["ratio"] == pytest.approx(1.1) and s["itl_met"] and s["goodput_met"]
    assert s["stage_histograms_met"] and s["met"] and len(s["done_when"]) == 3
    s = report.summarize({"disagg": {"runs": [_run(2, 0.95, 1.9)]},
                          "colocated": {"runs": [_run(2, 0.1, 0.2)]}}, None)
    # colocated's knee is below the sweep: no ratio can be claimed (never an infinite "met")
    assert s["goodput_ratio_disagg_over_colocated"] is None and not s["goodput_met"]
    assert "below the lowest rate" in s["note"]
    assert not s["itl_met"] and not s["met"]  # no baseline
    infinite = dict(s, goodput_ratio_disagg_over_colocated=float("inf"))
    s = report.summarize({"disagg": {"runs": [_run(2, 0.95, 1.9)]}}, None)  # no colocated
    assert s["goodput_ratio_disagg_over_colocated"] is None and not s["goodput_met"]
    payload = {"results": results, "baseline": baseline, "summary": infinite,
               "plan": {"slo": {"ttft": 1.0, "tpot": 0.025}, "model": "m"}, "device": "d"}
    write_json(tmp_path / "r.json", payload)  # infinities become strings
    assert json.loads((tmp_path / "r.json").read_text())["summary"][
        "goodput_ratio_disagg_over_colocated"] == "inf"


@pytest.mark.slow
def test_cpu_smoke_both_setups(tmp_path):
    out = tmp_path / "payoff.json"
    cmd = [sys.executable, "-m", "bench.lab.bench_payoff", "--device", "cpu", "--model", "tiny-qwen3",
           "--rates", "4,8", "--duration", "2", "--ramp", "0.25", "--drain", "30",
           "--input-len", "16:32", "--output-len", "4:8", "--slo", "ttft=30,tpot=10",
           "--warmup-requests", "2", "--time-budget", "0", "--startup-timeout", "120",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # one progress line per rate per setup
    assert len(re.findall(r"(disagg|colocated) +rate +[\d.]+/s: ", proc.stdout)) == 4
    res = json.loads(out.read_text())
    assert res["date"] and "bench.lab.bench_payoff" in res["command"] and res["versions"]["torch"]
    assert set(res["results"]) == {"disagg", "colocated"}
    for setup, data in res["results"].items():
        runs = data["runs"]
        assert [r["rate"] for r in runs] == [4.0, 8.0]
        roles = sorted(w["role"] for w in data["workers"].values())
        for w in data["workers"].values():  # the worker processes got the multi-GPU env
            assert w["process"]["env"]["NCCL_NVLS_ENABLE"] == "0", w
        # the published JSON names each worker's config but not the run's cluster secret
        assert {c["cluster_secret"] for c in data["worker_configs"].values()} == {"<redacted>"}
        assert roles == (["decode", "prefill"] if setup == "disagg" else ["colocated"] * 2)
        for r in runs:
            s = r["summary"]
            assert s["requests"] > 0 and s["failed"] == 0 and s["slo_attainment"] == 1.0
            for key in ("ttft_ms", "tpot_ms", "itl_ms"):
                assert s[key]["p50"] is not None and s[key]["p99"] is not None
            assert all(q["tokens"] == q["output_len"] for q in r["requests"])  # exact lengths
            assert r["idle_after"] and set(r["metrics_delta"]) == {"router", *data["workers"]}
            counts = s["stages"]["router_stage_count"]
            assert counts["prefill"] >= s["completed"] and s["stages"]["router_ttft_mean_ms"] > 0
            if setup == "disagg":  # the split is visible in the cluster's own histograms
                assert counts["kv_transfer"] > 0 and counts["decode_queue"] > 0
                kv = r["metrics_delta"]["decode-0"]["histograms"]["pdserve:stage_kv_transfer_seconds"]
                assert next(iter(kv.values()))["count"] > 0
                assert r["metrics_delta"]["decode-0"]["counters"]["pdserve:kv_transfer_bytes"]
    base = res["baseline"]
    assert base["concurrency"] >= 1 and base["summary"]["itl_ms"]["p99"] is not None
    s = res["summary"]
    for key in ("highest_rate_ge_90pct", "goodput_ratio_disagg_over_colocated", "itl",
                "goodput_met", "itl_met", "stage_histograms_met", "met", "done_when"):
        assert key in s
    assert s["highest_rate_ge_90pct"] == {"disagg": 8.0, "colocated": 8.0}
    assert s["stage_histograms_met"] and s["itl"]["ratio"] is not None
    png = out.with_suffix(".png")
    assert png.read_bytes().startswith(PNG_MAGIC)
    png.unlink()  # --plot redraws it from the JSON alone
    subprocess.run([sys.executable, "-m", "bench.lab.bench_payoff", "--plot", str(out)], cwd=REPO,
                   check=True, timeout=120, capture_output=True)
    assert png.read_bytes().startswith(PNG_MAGIC)
