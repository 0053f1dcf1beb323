"""Routing policies, prefix index, breaker and admission checks: plain Python, no servers."""
from __future__ import annotations

import time
from dataclasses import dataclass

import grpc
import pytest

from pdserve.engine.core.block_manager import compute_block_hashes
from pdserve.router.errors import BadRequest, NotFound, param_of
from pdserve.router.policies import (
    DecodePolicy,
    PrefillPolicy,
    PrefixIndex,
    blocks_needed,
    straight_to_decode,
)
from pdserve.router.pool import HARD_CODES, Breaker


@dataclass
class W:
    worker_id: str
    load: int = 0
    free_blocks: int = 100


def hashes(tokens: list[int]) -> list[int]:
    return compute_block_hashes(tokens, 4)


def test_prefix_index_matches_chained_prefix_per_worker():
    idx = PrefixIndex()
    a = hashes(list(range(16)))  # 4 blocks
    idx.record(a[:3], "p0")
    idx.record(a, "p1")
    assert idx.match(a, ["p0", "p1", "p2"]) == {"p0": 3, "p1": 4, "p2": 0}
    other = hashes([99] + list(range(1, 16)))  # differs in block 0 -> nothing matches
    assert idx.match(other, ["p0", "p1"]) == {"p0": 0, "p1": 0}


def test_prefix_index_is_bounded_and_forgets_restarted_workers():
    idx = PrefixIndex(max_entries=5)
    idx.record(hashes(list(range(40))), "p0")  # 10 blocks
    assert len(idx) == 5
    idx.forget("p0")
    assert len(idx) == 0


def test_prefix_aware_prefers_cache_hit_unless_much_busier():
    pol = PrefillPolicy("prefix_aware", balance_slack=2)
    h = hashes(list(range(32)))
    pol.prefilled(h, "p1")
    p0, p1 = W("p0", load=0), W("p1", load=2)
    w, cached = pol.choose([p0, p1], h)
    assert (w.worker_id, cached) == ("p1", 8)
    p1.load = 3  # beyond the slack: balance wins over the hit
    w, cached = pol.choose([p0, p1], h)
    assert (w.worker_id, cached) == ("p0", 0)


def test_least_loaded_and_round_robin():
    ws = [W("a", load=3), W("b", load=1), W("c", load=2)]
    assert PrefillPolicy("least_loaded").choose(ws, [])[0].worker_id == "b"
    rr = PrefillPolicy("round_robin")
    assert [rr.choose(ws, [])[0].worker_id for _ in range(4)] == ["a", "b", "c", "a"]
    with pytest.raises(ValueError, match="routing"):
        PrefillPolicy("random")


def test_decode_policy_needs_room_and_prefers_most_free():
    pol = DecodePolicy()
    ws = [W("d0", free_blocks=10), W("d1", free_blocks=50, load=5), W("d2", free_blocks=50, load=1)]
    assert pol.choose(ws, 20).worker_id == "d2"
    assert pol.choose(ws, 51) is None


def test_selective_disaggregation_threshold():
    assert not straight_to_decode(100, 0, 16, threshold=0)  # 0 = always disaggregate
    assert straight_to_decode(10, 0, 16, threshold=32)
    assert straight_to_decode(100, 5, 16, threshold=32)  # 80 cached -> 20 uncached
    assert not straight_to_decode(100, 2, 16, threshold=32)
    assert blocks_needed(17, 16) == 2


def test_breaker_soft_failures_open_after_a_run_and_probe_recovers():
    b = Breaker(base_s=0.01, soft_threshold=3)
    b.failure(hard=False)
    b.probe_ok()  # a good Health answer does not end a run of failed requests
    b.failure(hard=False)
    assert not b.open
    b.failure(hard=False)
    assert b.open and not b.probe_due()
    time.sleep(0.02)
    assert b.probe_due()
    b.failure(hard=True)  # probe failed: longer backoff
    assert b.backoff_s == pytest.approx(0.02)
    b.probe_ok()  # a good probe: on trial
    assert not b.open and b.trial
    b.failure(hard=False)  # one soft failure on trial opens it, backoff doubled
    assert b.open and b.backoff_s == pytest.approx(0.04)
    b.probe_ok()
    b.served()  # a request served there: closed, backoff back to its base
    assert not b.open and not b.trial and b.backoff_s == 0.01 and b.soft_failures == 0
    b.failure(hard=False)
    assert not b.open
    assert grpc.StatusCode.UNAVAILABLE in HARD_CODES


def test_frontend_checks_model_prompt_and_length(frontend):
    frontend.check_model(None)
    frontend.check_model(frontend.model_id)
    with pytest.raises(NotFound) as e:
        frontend.check_model("gpt-4")
    assert e.value.status == 404 and e.value.param == "model"
    with pytest.raises(BadRequest, match="prompt"):
        frontend.encode_prompt("")
    with pytest.raises(BadRequest, match="token ids"):
        frontend.encode_prompt([1, -5])
    with pytest.raises(BadRequest) as e:
        frontend.check_length(10, frontend.max_model_len, None)
    assert e.value.param == "max_tokens"
    with pytest.raises(BadRequest) as e:
        frontend.check_length(100, 10, pool_tokens=64)
    assert e.value.param == "prompt" and "KV cache pool" in e.value.message
    ids = frontend.encode_chat([{"role": "user", "content": "hi"}])
    assert frontend.tokenizer.decode(ids, skip_special_tokens=False).endswith("assistant\n")


def test_param_of_reads_worker_details():
    assert param_of("max_tokens: must be an integer >= 1") == "max_tokens"
    assert param_of("something went wrong") is None
