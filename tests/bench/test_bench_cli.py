"""`pdserve bench` end to end: a real process against a real server, JSON and PNGs on disk."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from sse_server import TokenStreamServer

from pdserve.bench.workload import approx_tokens
from pdserve.router.cli import main as pdserve_main

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def server():
    srv = TokenStreamServer(model="served-model", first_token_delay=0.02, token_delay=0.005)
    srv.start()
    yield srv
    srv.stop()


def _assert_png(path: str | Path) -> None:
    import matplotlib.image as mpimg

    data = Path(path).read_bytes()
    assert data.startswith(PNG_MAGIC)
    img = mpimg.imread(path)
    assert img.shape[0] > 200 and img.shape[1] > 200
    assert img.std() > 0.01  # something was drawn


def test_rate_sweep_writes_json_and_plots(server, tmp_path):
    server.reset()
    out = tmp_path / "res" / "sweep.json"
    cmd = [sys.executable, "-m", "pdserve.router.cli", "bench", "--base-url", server.base_url,
           "--num-prompts", "6", "--warmup", "2", "--rates", "8,inf", "--input-len", "8:16",
           "--output-len", "3:5", "--slo", "ttft=30,tpot=30", "--out", str(out), "--no-progress"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "TTFT (ms):" in proc.stdout and "Goodput (req/s):" in proc.stdout
    res = json.loads(out.read_text())
    assert res["model"] == "served-model" and res["server_models"] == ["served-model"]
    assert res["endpoint"] == server.base_url + "/v1/completions"
    assert "--rates 8,inf" in res["command"] and res["date"]
    assert [r["request_rate"] for r in res["runs"]] == [8.0, "inf"]
    served = {r.rid: r for r in server.records}
    assert len(served) == 2 + 6 + 6  # warm-up once, then each rate
    for run in res["runs"]:
        s = run["summary"]
        assert s["completed"] == 6 and s["failed"] == 0 and s["usage_reported"]
        assert s["server_stages"] is None  # a server without pdserve's stage histograms
        assert s["goodput"] == pytest.approx(s["request_throughput"])
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(s[key]) >= {"mean", "p50", "p90", "p99"}
        assert s["total_output_tokens"] == sum(r["output_tokens"] for r in run["requests"])
        assert all(3 <= r["output_tokens"] <= 5 and 8 <= r["prompt_tokens"] <= 16
                   for r in run["requests"])
    # each rate used fresh prompts (a second rate must not replay the first one's cache)
    prompts = [r.body["prompt"] for r in server.records]
    assert len(set(prompts)) == len(prompts)
    assert set(res["plots"]) == {"latency_cdf", "throughput_vs_rate"}
    for png in res["plots"].values():
        assert Path(png).parent == out.parent
        _assert_png(png)


def test_trace_replay_from_cli(server, tmp_path, capsys):
    server.reset()
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": 12, "output_length": 2,
                                         "hash_ids": [1]}) + "\n" for t in (0, 50, 100)))
    out = tmp_path / "trace.json"
    rc = pdserve_main(["bench", "--base-url", server.base_url, "--trace", str(trace),
                       "--trace-block-size", "8", "--out", str(out), "--no-progress"])
    assert rc == 0
    res = json.loads(out.read_text())
    [run] = res["runs"]
    assert run["request_rate"] == "trace" and run["summary"]["completed"] == 3
    assert list(res["plots"]) == ["latency_cdf"]
    _assert_png(res["plots"]["latency_cdf"])
    bodies = [r.body["prompt"].split() for r in server.records]
    assert bodies[0][:8] == bodies[1][:8] == bodies[2][:8]


def test_sharegpt_from_cli_sends_first_turns_with_the_reply_lengths(server, tmp_path):
    """--sharegpt: the first turns are the prompts and each reply's length (here ~4
    characters per token, no --tokenizer) the request's max_tokens, at a --burstiness rate."""
    server.reset()
    convs = [[{"from": "human", "value": f"question number {i} " * (i + 2)},
              {"from": "gpt", "value": "answer " * (3 * i + 4)}] for i in range(3)]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([{"conversations": c} for c in convs]))
    out = tmp_path / "sg_out.json"
    rc = pdserve_main(["bench", "--base-url", server.base_url, "--sharegpt", str(path),
                       "--num-prompts", "3", "--request-rate", "50", "--burstiness", "0.5",
                       "--out", str(out), "--no-progress"])
    assert rc == 0
    [run] = json.loads(out.read_text())["runs"]
    assert run["summary"]["completed"] == 3
    want = {c[0]["value"]: approx_tokens(c[1]["value"]) for c in convs}
    assert {r.body["prompt"]: r.body["max_tokens"] for r in server.records} == want


@pytest.mark.parametrize("args, field", [
    (["--tokenizer", "tok.json"], "--tokenizer"),
    (["--sharegpt", "a.json", "--trace", "b.jsonl"], "--sharegpt"),
    (["--burstiness", "0"], "--burstiness"),
    (["--rates", "1,x"], "--rates"),
    (["--slo", "ttfb=1"], "slo"),
    (["--input-len", "5:2"], "--input-len"),
    (["--num-prompts", "0"], "--num-prompts"),
])
def test_bad_arguments_name_the_field(args, field, capsys):
    rc = pdserve_main(["bench", "--base-url", "http://127.0.0.1:9", *args])
    assert rc == 2
    assert field in capsys.readouterr().err


def test_an_unreachable_server_is_named_before_any_request(capsys):
    rc = pdserve_main(["bench", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "--base-url: cannot reach http://127.0.0.1:9/v1/models" in err, err
    rc = pdserve_main(["bench", "--base-url", "localhost:9", "--num-prompts", "1"])  # no scheme
    assert rc == 2 and "--base-url" in capsys.readouterr().err
