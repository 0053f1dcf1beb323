"""Head, KV-head, MLP and vocabulary splits over TP ranks, and the KV pull plan between
prefill and decode workers of different TP sizes (engine/core/tp.py, pure functions;
engine/dist/heads.py re-exports them)."""
from __future__ import annotations

import pytest

from pdserve.engine.core.config import ConfigError, ModelConfig, MoEConfig
from pdserve.engine.core.tp import (
    HeadPull,
    HeadSplit,
    TPKVInfo,
    check_model_split,
    local_shapes,
    pull_plan,
    slice_ranges,
    tp_pair_problems,
    vocab_shard,
)


def _cfg(heads: int, kv: int, inter: int = 96, vocab: int = 100, **kw: object) -> ModelConfig:
    return ModelConfig(arch="qwen3", vocab_size=vocab, hidden_size=64, num_layers=2,
                       num_heads=heads, num_kv_heads=kv, head_dim=16, intermediate_size=inter,
                       **kw)


def test_sharded_kv_heads_follow_their_q_heads() -> None:
    s = HeadSplit(4, 2, 2)
    assert not s.replicated and s.kv_per_rank == 1
    assert [list(s.q_heads(r)) for r in range(2)] == [[0, 1], [2, 3]]
    assert [list(s.kv_heads(r)) for r in range(2)] == [[0], [1]]
    # every q head's KV head (GQA group = 2) is in its rank's cache
    for r in range(2):
        assert {q // 2 for q in s.q_heads(r)} <= set(s.kv_heads(r))


def test_fewer_kv_heads_than_ranks_replicate_the_one_the_q_heads_use() -> None:
    s = HeadSplit(8, 2, 4)  # 2 KV heads over 4 ranks: 2 copies each
    assert s.replicated and s.kv_per_rank == 1
    assert [list(s.kv_heads(r)) for r in range(4)] == [[0], [0], [1], [1]]
    for r in range(4):
        assert {q // 4 for q in s.q_heads(r)} == set(s.kv_heads(r))
    assert s.ranks_holding(1) == [2, 3]
    one = HeadSplit(4, 1, 2)
    assert [list(one.kv_heads(r)) for r in range(2)] == [[0], [0]]


def test_smollm2_at_tp3_splits_and_at_tp2_is_refused_naming_the_field() -> None:
    s = HeadSplit(9, 3, 3)  # SmolLM2-135M: 9 heads, 3 KV heads
    assert [list(s.q_heads(r)) for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert [list(s.kv_heads(r)) for r in range(3)] == [[0], [1], [2]]
    with pytest.raises(ConfigError, match="^num_heads: 9 attention heads .*tensor_parallel_size=2"):
        HeadSplit(9, 3, 2)
    with pytest.raises(ConfigError, match="^num_kv_heads: 6 KV heads do not split"):
        HeadSplit(12, 6, 4)
    with pytest.raises(ConfigError, match="^num_kv_heads: 2 KV heads cannot be replicated"):
        HeadSplit(6, 2, 3)


def test_model_split_names_mlp_and_moe_fields() -> None:
    with pytest.raises(ConfigError, match="^intermediate_size: 96 does not split .*=5"):
        check_model_split(_cfg(5, 5, 96), 5)
    moe = MoEConfig(num_experts=4, top_k=2, intermediate_size=30)
    with pytest.raises(ConfigError, match="^moe_intermediate_size: 30 does not split"):
        check_model_split(_cfg(4, 2, 96, moe=moe), 4)
    assert local_shapes(_cfg(4, 2, 96, vocab=101), 2) == {
        "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 48, "vocab_size": 51}


def test_vocab_rows_pad_the_last_rank() -> None:
    assert [vocab_shard(10, 3, r) for r in range(3)] == [(0, 4, 4), (4, 4, 4), (8, 2, 4)]
    assert [vocab_shard(5, 4, r) for r in range(4)] == [(0, 2, 2), (2, 2, 2), (4, 1, 2),
                                                      (6, 0, 2)]


def test_pull_plan_p2_to_d1_and_p1_to_d2() -> None:
    # 2 KV heads: D TP 1 reads one head from each prefill rank
    assert pull_plan(2, 2, 1) == [[HeadPull(0, 0, 0, 1), HeadPull(1, 0, 1, 1)]]
    # D TP 2 from P TP 1: each decode rank reads its head out of the one prefill cache
    assert pull_plan(2, 1, 2) == [[HeadPull(0, 0, 0, 1)], [HeadPull(0, 1, 0, 1)]]
    # same TP: whole caches, rank to rank
    assert pull_plan(4, 2, 2) == [[HeadPull(0, 0, 0, 2)], [HeadPull(1, 0, 0, 2)]]
    # 8 KV heads, P TP 4 -> D TP 2: two prefill ranks per decode rank
    assert pull_plan(8, 4, 2) == [[HeadPull(0, 0, 0, 2), HeadPull(1, 0, 2, 2)],
                                  [HeadPull(2, 0, 0, 2), HeadPull(3, 0, 2, 2)]]


def test_pull_plan_replicated_heads_both_ways() -> None:
    # 1 KV head. P TP 2 holds it twice: D TP 1 reads one copy
    assert pull_plan(1, 2, 1) == [[HeadPull(0, 0, 0, 1)]]
    # P TP 1 -> D TP 2: both decode ranks read the same (only) head
    assert pull_plan(1, 1, 2) == [[HeadPull(0, 0, 0, 1)], [HeadPull(0, 0, 0, 1)]]
    # replicas on both sides: decode rank r reads the replica r % copies (spreads the reads)
    assert pull_plan(1, 2, 2) == [[HeadPull(0, 0, 0, 1)], [HeadPull(1, 0, 0, 1)]]
    # 2 KV heads over P TP 4 (2 copies each) -> D TP 1
    assert pull_plan(2, 4, 1) == [[HeadPull(0, 0, 0, 1), HeadPull(2, 0, 1, 1)]]


def test_every_decode_head_comes_from_a_prefill_rank_that_holds_it() -> None:
    for kv in (1, 2, 3, 4, 6, 8):
        for p in (1, 2, 3, 4, 6, 8):
            for d in (1, 2, 3, 4, 6, 8):
                try:
                    ps, ds = HeadSplit(kv * p, kv, p), HeadSplit(kv * d, kv, d)
                except ConfigError:
                    continue
                for rank, pulls in enumerate(pull_plan(kv, p, d)):
                    got = []
                    for pl in pulls:
                        for i in range(pl.count):
                            g = ps.kv_heads(pl.src_rank)[pl.src_head + i]
                            assert ds.kv_heads(rank)[pl.dst_head + i] == g
                            got.append(g)
                    assert got == list(ds.kv_heads(rank))


def test_pair_check_refuses_naming_the_field() -> None:
    p2, d1 = TPKVInfo.of(4, 2, 2), TPKVInfo.of(4, 2, 1)
    assert tp_pair_problems(p2, d1) == []
    assert tp_pair_problems(TPKVInfo.of(8, 4, 2), d1) == ["tp.num_kv_heads: 2 != 4"]
    inner = TPKVInfo.of(4, 2, 1, heads_outer=False)
    assert tp_pair_problems(p2, inner)[0].startswith("tp.heads_outer (decode)")
    # same TP with heads inner is fine: whole blocks move
    assert tp_pair_problems(TPKVInfo.of(4, 2, 2, False), TPKVInfo.of(4, 2, 2, False)) == []
    forged = TPKVInfo(2, 2, ((0, 1), (0, 1)), True)
    assert tp_pair_problems(forged, d1)[0].startswith("tp.head_map (prefill)")
    with pytest.raises(ConfigError, match=r"^tp.head_map\[1\]"):
        TPKVInfo.from_dict({**p2.to_dict(), "head_map": [[0, 1], "x"]})
    with pytest.raises(ConfigError, match="^tp.heads_outer: missing"):
        TPKVInfo.from_dict({k: v for k, v in p2.to_dict().items() if k != "heads_outer"})
    assert TPKVInfo.from_dict(p2.to_dict()) == p2


def test_slice_ranges_coalesce_whole_blocks_and_cut_slices_per_block() -> None:
    hb = 100  # bytes of one head in one block
    pairs = [(3, 10), (4, 11), (5, 12), (9, 20)]
    whole = slice_ranges(HeadPull(0, 0, 0, 2), pairs, 2, 2, hb)
    assert whole == [(600, 2000, 600), (1800, 4000, 200)]
    # P TP 1 (2 heads) -> decode rank 1 (1 head): head 1 of each prefill block, per block
    half = slice_ranges(HeadPull(0, 1, 0, 1), pairs, 2, 1, hb)
    assert half == [(700, 1000, 100), (900, 1100, 100), (1100, 1200, 100), (1900, 2000, 100)]


def test_dist_heads_re_exports_core_tp() -> None:
    from pdserve.engine.core import tp
    from pdserve.engine.dist import heads

    assert heads.pull_plan is tp.pull_plan and heads.TPKVInfo is tp.TPKVInfo
    assert set(heads.__all__) <= set(dir(tp))
