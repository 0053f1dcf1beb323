"""Workload generation and statistics: pure functions, no server."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from pdserve.bench import report
from pdserve.bench.loadgen import RequestResult
from pdserve.bench.workload import (
    WORDS,
    LengthRange,
    PrefixBlocks,
    TraceEntry,
    approx_tokens,
    poisson_arrivals,
    random_workload,
    read_trace,
    sharegpt_workload,
    trace_workload,
)


def test_length_range_parse():
    assert LengthRange.parse("128", "--input-len") == LengthRange(128, 128)
    assert LengthRange.parse("8:64", "--input-len") == LengthRange(8, 64)
    for bad in ("0", "9:3", "a", "1:2:3", ""):
        with pytest.raises(ValueError, match="--input-len"):
            LengthRange.parse(bad, "--input-len")


def test_random_prompts_lengths_and_vocabulary():
    specs = random_workload(50, LengthRange(10, 40), LengthRange(3, 7), seed=1)
    assert len(specs) == 50
    for s in specs:
        words = s.prompt.split()
        assert len(words) == s.input_len and 10 <= s.input_len <= 40
        assert 3 <= s.output_len <= 7 and s.arrival_s is None
        assert set(words) <= set(WORDS)
    assert len({s.prompt for s in specs}) == 50
    assert random_workload(5, LengthRange(10, 40), LengthRange(3, 7), seed=1) == specs[:5]


def test_shared_prefix_ratio():
    specs = random_workload(20, LengthRange(40, 80), LengthRange(4, 4), 0.5, seed=2)
    longest = max(specs, key=lambda s: s.input_len).prompt.split()
    for s in specs:
        n_shared = math.floor(0.5 * s.input_len)
        assert len(s.prompt.split()) == s.input_len
        assert s.prompt.split()[:n_shared] == longest[:n_shared]
    tails = {tuple(s.prompt.split()[math.floor(0.5 * s.input_len):]) for s in specs}
    assert len(tails) == 20
    with pytest.raises(ValueError, match="shared_prefix_ratio"):
        random_workload(2, LengthRange(4, 4), LengthRange(4, 4), 1.5)


def test_trace_blocks_share_text_by_hash_id(tmp_path):
    path = tmp_path / "trace.jsonl"
    lines = [{"timestamp": 500, "input_length": 20, "output_length": 4, "hash_ids": [7, 8]},
             {"timestamp": 2500, "input_length": 14, "output_length": 2, "hash_ids": [7, 9]},
             {"timestamp": 1000, "input_length": 30, "output_length": 3, "hash_ids": [5]}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    entries = read_trace(path)
    assert entries[0] == TraceEntry(500.0, 20, 4, (7, 8))
    specs = trace_workload(entries, block_size=8)
    assert [s.arrival_s for s in specs] == [0.0, 0.5, 2.0]  # sorted, relative, seconds
    a, c, b = specs
    blocks = PrefixBlocks(8)
    assert a.prompt.split()[:16] == blocks.block(7) + blocks.block(8)
    assert b.prompt.split()[:8] == blocks.block(7)
    assert b.prompt.split()[8:14] == blocks.block(9)[:6]
    # 30 words wanted, one 8-word block given: the rest is unique filler
    assert c.prompt.split()[:8] == blocks.block(5) and len(c.prompt.split()) == 30
    assert read_trace(path, limit=2) == entries[:2]


def test_bad_trace_line_names_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 3, "output_length": 1}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        read_trace(path)


def test_poisson_arrivals_rate():
    times = poisson_arrivals(5000, rate=20.0, seed=3)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(1 / 20.0, rel=0.05)
    # exponential gaps: standard deviation equals the mean
    assert statistics.stdev(gaps) == pytest.approx(statistics.mean(gaps), rel=0.1)
    assert poisson_arrivals(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="request_rate"):
        poisson_arrivals(3, 0.0)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_keeps_the_rate_and_shapes_the_gaps(burstiness):
    """vllm bench serve's --burstiness: gamma gaps of shape b and mean 1 / rate, so the
    coefficient of variation is 1 / sqrt(b) (Poisson: b = 1, CV 1)."""
    times = poisson_arrivals(8000, rate=20.0, seed=5, burstiness=burstiness)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.mean(gaps) == pytest.approx(1 / 20.0, rel=0.06)
    cv = statistics.stdev(gaps) / statistics.mean(gaps)
    assert cv == pytest.approx(burstiness ** -0.5, rel=0.1)
    with pytest.raises(ValueError, match="burstiness"):
        poisson_arrivals(3, 1.0, burstiness=0.0)


def _result(ttft: float, e2e: float, n: int, ok: bool = True) -> RequestResult:
    step = (e2e - ttft) / max(n - 1, 1)
    return RequestResult(input_len=10, success=ok, prompt_tokens=10, output_tokens=n,
                         usage_reported=True, ttft=ttft, e2e=e2e,
                         chunk_times=[ttft + i * step for i in range(n)],
                         error="" if ok else "HTTP 503: busy")


def test_summary_percentiles_tpot_and_goodput():
    results = [_result(0.1 * (i + 1), 0.1 * (i + 1) + 0.9, 10) for i in range(10)]
    results.append(_result(0, 0, 0, ok=False))
    s = report.summarize(results, duration_s=2.0, slo={"ttft": 0.5, "tpot": 0.2})
    assert s["completed"] == 10 and s["failed"] == 1 and s["errors"] == {"HTTP 503: busy": 1}
    assert s["total_output_tokens"] == 100 and s["total_input_tokens"] == 100
    assert s["request_throughput"] == pytest.approx(5.0)
    assert s["total_token_throughput"] == pytest.approx(100.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(550.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(550.0)
    assert s["ttft_ms"]["p90"] == pytest.approx(910.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(100.0)  # 0.9 s over 9 gaps
    assert s["itl_ms"]["count"] == 90 and s["itl_ms"]["p99"] == pytest.approx(100.0)
    assert s["goodput"] == pytest.approx(5 / 2.0)  # ttft <= 0.5 s: five requests
    assert s["slo_attainment"] == pytest.approx(5 / 11)
    json.dumps(s, allow_nan=False)


def test_parse_slo():
    assert report.parse_slo("ttft=1.0, tpot=0.025") == {"ttft": 1.0, "tpot": 0.025}
    assert report.parse_slo(None) == {}
    for bad in ("ttft", "foo=1", "ttft=x", "e2e=-1"):
        with pytest.raises(ValueError, match="slo"):
            report.parse_slo(bad)


def _sharegpt(tmp_path, convs: list) -> Path:
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([{"id": str(i), "conversations": c} for i, c in enumerate(convs)]))
    return path


def test_sharegpt_samples_first_turns_and_filters_as_vllm(tmp_path):
    """First turn = prompt, second turn's token count = max_tokens; conversations under 2
    turns, or with either side under 4 tokens, a prompt over 1024 or a total over 2048, are
    skipped; the seed shuffles which ones come first."""
    def turn(who: str, n: int) -> dict:
        return {"from": who, "value": " ".join(["w"] * n)}

    words = lambda text: len(text.split())  # noqa: E731 - a word per token, for the test
    convs = [[turn("human", 10), turn("gpt", 20)], [turn("human", 3), turn("gpt", 20)],
             [turn("human", 10), turn("gpt", 3)], [turn("human", 1025), turn("gpt", 8)],
             [turn("human", 1000), turn("gpt", 1049)], [turn("human", 6)],
             [turn("human", 12), turn("gpt", 7), turn("human", 5)], "not a conversation"]
    path = _sharegpt(tmp_path, convs)
    specs = sharegpt_workload(path, num_prompts=10, seed=1, count_tokens=words)
    assert sorted((s.input_len, s.output_len) for s in specs) == [(10, 20), (12, 7)]
    assert all(len(s.prompt.split()) == s.input_len and s.arrival_s is None for s in specs)
    assert len(sharegpt_workload(path, num_prompts=1, seed=1, count_tokens=words)) == 1
    assert approx_tokens("abcdefgh") == 2
    with pytest.raises(ValueError, match="no conversation passed"):
        sharegpt_workload(_sharegpt(tmp_path, [[turn("human", 2), turn("gpt", 2)]]), 5)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not a ShareGPT JSON"):
        sharegpt_workload(tmp_path / "bad.json", 5)
