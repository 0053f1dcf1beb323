"""bench/lab/bench_kv_transfer.py end to end on CPU with a tiny shape (two real processes)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(400)
def test_bench_runs_on_cpu_and_writes_json(tmp_path):
    out = tmp_path / "kv.json"
    cmd = [sys.executable, str(ROOT / "bench" / "lab" / "bench_kv_transfer.py"), "--device", "cpu",
           "--preset", "tiny", "--tokens", "200", "--block-size", "8", "--reps", "2",
           "--warmup", "1", "--frag-run", "3", "--timeout", "120", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=360, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "rep 3/3" in proc.stderr  # progress output
    report = json.loads(out.read_text())
    assert {"device", "command", "date", "env", "config", "results"} <= set(report)
    n = math.ceil(200 / 8)
    by_name = {r["scenario"]: r for r in report["results"]["scenarios"]}
    assert by_name["contiguous"]["descriptors"] == 1
    assert by_name["contiguous_prepped"]["descriptors"] == 1
    assert by_name["per_block"]["descriptors"] == n
    assert by_name["fragmented"]["descriptors"] == math.ceil(n / 3)
    assert by_name["fragmented_prepped"]["descriptors"] == math.ceil(n / 3)
    for r in by_name.values():
        assert r["verified"] and r["bytes"] == n * 3 * 2 * 8 * 2 * 8 * 4
        assert len(r["reps_s"]) == 2 and r["gb_per_s"] > 0
    assert report["results"]["peer_copy"]["bytes"] == n * 3 * 2 * 8 * 2 * 8 * 4
