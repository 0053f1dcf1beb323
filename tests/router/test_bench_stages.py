"""`pdserve bench` against a pdserve router (fake workers over real gRPC, the real HTTP
face): its results say where the server spent the time, stage by stage (ANCHORS #11), from
the router's own stage histograms over the measured requests (warm-up excluded)."""
from __future__ import annotations

import json

import pytest

from pdserve.router.cli import main as pdserve_main
from pdserve.router.core import RouterConfig
from pdserve.router.metrics import STAGES

from tests.router.fake_worker import FakeRef, FakeWorker
from tests.router.harness import RouterThread


@pytest.fixture(scope="module")
def router(frontend):
    ws = [FakeWorker("bp0", "prefill").start(), FakeWorker("bd0", "decode").start()]
    ws[0].prefill_delay_s, ws[1].token_delay_s = 0.02, 0.005
    rt = RouterThread([FakeRef(w) for w in ws], frontend, RouterConfig(router_id="router-bench"))
    yield rt
    rt.stop()
    for w in ws:
        w.stop()


def test_bench_reports_server_time_by_stage(router, tmp_path, capsys):
    out = tmp_path / "run.json"
    code = pdserve_main(["bench", "--base-url", router.url, "--num-prompts", "5", "--warmup",
                         "2", "--input-len", "8:12", "--output-len", "4", "--ignore-eos",
                         "--out", str(out), "--no-progress"])
    assert code == 0
    stages = json.loads(out.read_text())["runs"][0]["summary"]["server_stages"]
    assert set(stages) == {*STAGES, "e2e"}
    assert all(st["count"] == 5 for st in stages.values())  # the measured requests only
    # P sleeps 20 ms per Prefill (the fake reports 1 ms of it as prefill, the rest queueing)
    assert stages["prefill_queue"]["mean_ms"] + stages["prefill"]["mean_ms"] >= 20
    assert stages["decode"]["mean_ms"] > 0
    # the router's stages partition each request's end-to-end time (ANCHORS #10)
    total = sum(st["mean_ms"] for name, st in stages.items() if name != "e2e")
    assert total == pytest.approx(stages["e2e"]["mean_ms"], rel=1e-6)
    assert "Server time by stage" in capsys.readouterr().out
