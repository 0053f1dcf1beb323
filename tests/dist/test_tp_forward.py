"""A sharded model computed across real ranks (spawned processes, a gloo group on loopback)
equals the unsharded model: tiny Qwen3 (4 heads, 2 KV heads), a model with 1 KV head
(replicated), a tiny Qwen3-MoE (TP inside each expert) at TP=2, and SmolLM2-135M's head
shape (9 heads, 3 KV heads) at TP=3; the vocabulary (101) never divides, so the last rank's
rows are padding. Then lockstep stepping, and a dead or hung rank failing its peers by the
group's deadline instead of hanging them."""
from __future__ import annotations

import pytest

from tests.dist import tp_ranks
from tests.dist.tp_harness import run_ranks

TOL = 1e-4


def _check_equal(results: dict, tp: int) -> None:
    errors = {r: v for r, v in results.items() if isinstance(v, tuple)}
    assert not errors, errors
    r0 = results[0]
    assert r0["first_diff"] < TOL  # logits of the first (prefill) step
    assert r0["tokens"] == r0["full_tokens"]  # greedy: 3 prompts x 6 tokens
    assert r0["gemv_diff"] < TOL  # batch-1 GEMV path: the residual added once
    assert r0["next"] == r0["full_next"]  # cross-rank argmax
    for r in range(1, tp):  # every rank saw the same (all-gathered) logits
        assert results[r]["tokens"] == r0["tokens"] and results[r]["next"] == r0["next"]


@pytest.mark.parametrize("name,cfg", [
    ("qwen3_4h_2kv", tp_ranks.tiny("qwen3", 4, 2)),
    ("llama_1kv_replicated", tp_ranks.tiny("llama", 4, 1)),
    ("qwen3_moe", tp_ranks.tiny("qwen3_moe", 4, 2, moe=True)),
])
def test_tp2_equals_unsharded(name: str, cfg) -> None:
    results = run_ranks(tp_ranks.sharded_equals_full, 2, cfg)
    _check_equal(results, 2)
    heads = results[0]["shapes"]["heads"]
    assert heads == (2, 1)  # 2 q heads and one KV head per rank (sharded or replicated)
    assert results[0]["shapes"]["embed"] == (51, cfg.hidden_size)  # ceil(101 / 2) rows


def test_tp3_smollm2_head_shape_equals_unsharded() -> None:
    cfg = tp_ranks.tiny("llama", 9, 3, head_dim=8)  # SmolLM2-135M: 9 heads, 3 KV heads
    results = run_ranks(tp_ranks.sharded_equals_full, 3, cfg)
    _check_equal(results, 3)
    assert results[2]["shapes"]["heads"] == (3, 1)
    assert results[2]["shapes"]["qkv"] == (5 * 8, 72)  # 3 q + 1 k + 1 v heads of 8


def test_lockstep_leader_and_follower_equal_unsharded() -> None:
    results = run_ranks(tp_ranks.lockstep_equals_full, 2, tp_ranks.tiny("qwen3", 4, 2))
    assert not any(isinstance(v, tuple) for v in results.values()), results
    assert results[0]["tokens"] == results[0]["full_tokens"]
    assert results[0]["copied"] and results[1]["copied"]
    assert results[1]["steps"] == tp_ranks.NEW_TOKENS  # one follower forward per step


def test_dead_follower_fails_the_leader_instead_of_hanging() -> None:
    results = run_ranks(tp_ranks.dead_follower, 2, tp_ranks.tiny("qwen3", 4, 2), timeout_s=10)
    assert results[1] == {"left": True}
    err = results[0]["error"]
    assert err is not None and "rank 0:" in err and "failed" in err


def test_silent_leader_fails_the_follower_at_the_deadline() -> None:
    results = run_ranks(tp_ranks.silent_leader, 2, tp_ranks.tiny("qwen3", 4, 2), timeout_s=3)
    assert results[1]["error"] is not None and "step broadcast failed" in results[1]["error"]
