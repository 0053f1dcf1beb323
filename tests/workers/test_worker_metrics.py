"""worker/metrics.py's per-request latencies against a real (tiny, CPU) engine: each step's
outputs go through observe_step as the worker services pass them, and the histograms'
counts and sums follow from the requests' own token counts."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from pdserve.engine.core.config import SpecConfig
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM
from pdserve.worker.metrics import WorkerMetrics

LABELS = {"role": "decode", "worker": "d0"}


def _count_sum(reg: CollectorRegistry, name: str) -> tuple[float, float]:
    return (reg.get_sample_value(f"pdserve:{name}_count", LABELS),
            reg.get_sample_value(f"pdserve:{name}_sum", LABELS))


@pytest.mark.parametrize("speculative", [False, True])
def test_decode_time_and_tpot_follow_the_tokens(speculative: bool) -> None:
    """A 6-token request: one decode-time sample (its first token to its last) and one TPOT
    sample equal to it over 5; a 1-token request: decode time 0 and no TPOT. With MTP
    (forced acceptance, several tokens per step) TPOT still divides by the tokens."""
    kw = dict(speculative=SpecConfig(num_speculative_tokens=2, batch_k_caps=(),
                                     forced_acceptance=True)) if speculative else {}
    llm = LLM("tiny-qwen3", device="cpu", block_size=4, num_blocks=64, **kw)
    engine, reg = llm.engine, CollectorRegistry()
    m = WorkerMetrics(reg, "decode", "d0")
    assert _count_sum(reg, "request_time_per_output_token_seconds") == (0.0, 0.0)
    params = {"long": 6, "short": 1}
    for rid, n in params.items():
        engine.add_request([5, 17, 99, 3, 42], SamplingParams(max_tokens=n, temperature=0.0,
                                                             ignore_eos=True), request_id=rid)
        m.track(engine, 0.0, [rid])
    emitted, most = {rid: 0 for rid in params}, 0
    while engine.has_unfinished():
        outs = engine.step()
        m.observe_step(outs)
        for o in outs:
            emitted[o.request_id] += len(o.new_token_ids)
            most = max(most, len(o.new_token_ids))
    assert emitted == params and (most > 1) == speculative
    dec_n, dec_sum = _count_sum(reg, "request_decode_time_seconds")
    tpot_n, tpot_sum = _count_sum(reg, "request_time_per_output_token_seconds")
    assert dec_n == 2 and tpot_n == 1  # the 1-token request has no per-token time
    assert dec_sum > 0 and tpot_sum == pytest.approx(dec_sum / 5)


def test_quarantined_blocks_are_exported_and_missing_from_the_free_pool() -> None:
    """A request whose remote read could not be cancelled is quarantined: its blocks leave
    the pool for good, and the gauge says how many (the free count alone would look like a
    leak)."""
    llm = LLM("tiny-qwen3", device="cpu", block_size=4, num_blocks=64)
    engine, reg = llm.engine, CollectorRegistry()
    m = WorkerMetrics(reg, "decode", "d0")
    bm = engine.scheduler.block_manager
    free = bm.num_free_blocks
    engine.add_request(list(range(5, 30)), SamplingParams(max_tokens=8), request_id="q")
    engine.step()  # prefill: the request now owns blocks
    assert engine.quarantine_request("q")
    m.refresh(engine)
    lost = reg.get_sample_value("pdserve:kv_quarantined_blocks", LABELS)
    assert lost > 0 and bm.num_free_blocks == free - lost
