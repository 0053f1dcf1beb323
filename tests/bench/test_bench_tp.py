"""bench/lab/bench_tp.py end to end on CPU: --tiny at TP 1 and TP 2 (gloo, a spawned follower
process), the JSON it writes, and the refusal of a TP size without GPUs for it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # two engines, one with a follower process: ~40 s on 2 loaded cores
def test_tiny_tp1_and_tp2(tmp_path):
    out = tmp_path / "tp.json"
    cmd = [sys.executable, "-m", "bench.lab.bench_tp", "--tiny", "--tp", "1", "2", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and res["date"] and "bench.lab.bench_tp" in res["command"]
    assert res["tp_sizes"] == [1, 2] and set(res["runs"]) == {"tp1_eager", "tp2_eager"}
    features = res["engine_features_at_tp_gt_1"]  # probed through check_tp_args
    assert features["use_cuda_graphs"] == "accepted at TP 2"
    assert features["rank_load"] and features["this_run"]
    layers = 2  # tiny-qwen3
    for name, tp in (("tp1_eager", 1), ("tp2_eager", 2)):
        run = res["runs"][name]
        assert "error" not in run, run.get("error")
        assert run["tp"] == tp and not run["cuda_graphs"] and run["rank_devices"] == ["cpu"] * tp
        load = run["load"]
        assert (load["rank0_shard_bytes"] < load["full_model_bytes"]) == (tp > 1)
        b1 = run["decode_batch1"]
        assert b1["tok_s"] > 0 and b1["decode_tokens"] > 0
        prof = b1["profile"]
        assert prof["steps"] == 4 and prof["layer_calls"] == 4 * layers
        calls = prof["collectives_by_name_per_step"]
        if tp == 1:  # no group: no collective, no step message
            assert calls == {} and prof["step_messages_per_step"] == 0
            assert prof["per_layer"]["collective_calls"] == 0
        else:  # embedding + 2 per layer all-reduces, one logits all-gather, one FORWARD message
            assert calls == {"gloo:all_reduce": 1 + 2 * layers, "gloo:all_gather": 1}
            assert prof["per_layer"]["collective_calls"] == 2
            assert prof["collective_ms_per_step"] > 0 and prof["step_messages_per_step"] >= 1
        [ttft] = run["ttft"]
        assert ttft["ttft_s"] > 0
        [row] = run["decode_throughput"]
        assert row["batch"] == 3 and row["tok_s"] > 0 and row["profile"]["steps"] >= 1
    ratio = res["summary"]["tp2_eager_over_tp1_eager_batch1"]
    assert ratio["target"] == ">= 1.6" and ratio["value"] > 0
    assert res["followers_host_peak_rss_bytes"] > 0


def test_bad_tp_size_is_refused_by_flag():
    proc = subprocess.run([sys.executable, "-m", "bench.lab.bench_tp", "--tp", "0"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--tp: sizes must be >= 1" in proc.stderr
