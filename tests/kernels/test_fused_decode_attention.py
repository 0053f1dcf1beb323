"""fused_decode_attention (prologue + split-K attention + in-kernel merge, one kernel) against
the two references it replaces: qk_norm_rope_cache_ref, then paged_attention_ref."""
from __future__ import annotations

import math

import pytest
import torch

from pdserve.kernels.decode_attention import (
    Prologue,
    SplitPartials,
    active_splits,
    fused_decode_attention,
)
from pdserve.kernels.reference import (
    merge_partials_ref,
    paged_attention_ref,
    qk_norm_rope_cache_ref,
)


def _slots(cache, R: int) -> torch.Tensor:
    """Cache slot of each new token (the last R positions of every sequence); -1 for a
    padding row (seq_len 0)."""
    bs, slots = cache.block_size, []
    for b, seq_len in enumerate(cache.seq_lens.tolist()):
        for pos in range(seq_len - R, seq_len):
            slots.append(-1 if pos < 0 else
                         int(cache.block_tables[b, pos // bs]) * bs + pos % bs)
    return torch.tensor(slots, dtype=torch.int64, device=cache.seq_lens.device)


def _case(cache, R, hq, d, dtype, device, qk_norm, seed=0):
    """q/k/v as strided views of one qkv projection output, per-token cos/sin, norms."""
    B, hkv = cache.seq_lens.shape[0], cache.k.shape[2]
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B * R, (hq + 2 * hkv) * d, generator=gen).to(device, dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d)
    angles = torch.rand(B * R, d // 2, generator=gen) * 6.0
    norms = [(torch.rand(d, generator=gen) + 0.5).to(device, dtype) if qk_norm else None
             for _ in range(2)]
    p = Prologue(k, v, angles.cos().to(device), angles.sin().to(device), _slots(cache, R),
                 norms[0], norms[1], eps=1e-6)
    return q, p


def _reference(q, p: Prologue, cache, R):
    """The unfused layer: prologue into a copy of the cache, then attention over it."""
    kv = cache.kv.clone()
    k_ref, v_ref = kv[:, 1, 0], kv[:, 1, 1]
    q_rot = qk_norm_rope_cache_ref(q, p.k, p.v, None, p.cos, p.sin, k_ref, v_ref,
                                   p.slot_mapping, p.q_norm, p.k_norm, p.eps)
    B = cache.seq_lens.shape[0]
    qsl = torch.arange(B + 1, dtype=torch.int32, device=q.device) * R
    out = paged_attention_ref(q_rot, k_ref, v_ref, qsl, cache.seq_lens, cache.block_tables,
                              q.shape[-1] ** -0.5)
    return out, kv


@pytest.mark.parametrize("R,group,bs,seq_lens,splits,qk_norm", [
    (1, 4, 16, [1, 33, 64, 65], 4, True),     # decode; new token first / last of a tile
    (1, 3, 8, [40, 0, 7], 3, False),          # odd GQA ratio; a padding row (seq_len 0)
    (2, 4, 16, [33, 32, 2], 4, True),         # the 2 new tokens straddle a split boundary
    (3, 2, 4, [66, 31, 97], 16, False),       # most splits empty; tiny blocks
    (4, 4, 32, [70, 9], 1, True),             # one split: stored directly, no merge
])
def test_matches_prologue_then_attention(R, group, bs, seq_lens, splits, qk_norm, device,
                                         paged_cache, close):
    hkv, d = 2, 64
    cache = paged_cache(seq_lens, bs, hkv, d, torch.float32)
    q, p = _case(cache, R, group * hkv, d, torch.float32, device, qk_norm)
    want, kv_want = _reference(q, p, cache, R)
    out = fused_decode_attention(q, p, cache.k, cache.v, cache.block_tables, cache.seq_lens,
                                 d ** -0.5, num_splits=splits, rows_per_seq=R)
    close(out, want, torch.float32)
    close(cache.kv, kv_want, torch.float32)  # new k/v written, nothing else touched


def test_bf16_head_dim_128_repeated_launches(device, paged_cache, close):
    """Repeated launches reuse the arrival counters (each launch leaves them at zero)."""
    cache = paged_cache([300, 47, 129], 16, 2, 128, torch.bfloat16)
    for seed in range(3):
        q, p = _case(cache, 1, 8, 128, torch.bfloat16, device, True, seed=seed)
        want, kv_want = _reference(q, p, cache, 1)
        out = fused_decode_attention(q, p, cache.k, cache.v, cache.block_tables,
                                     cache.seq_lens, 128 ** -0.5, num_splits=8)
        close(out, want, torch.bfloat16)
        close(cache.kv, kv_want, torch.bfloat16)


@pytest.mark.parametrize("seq_lens,splits", [([1, 33, 64, 65], 4), ([40, 0, 7], 16),
                                             ([70, 9], 1)])
def test_partials_left_for_the_reader_merge_to_the_attention(seq_lens, splits, device,
                                                            paged_cache, close):
    """partials=True (kernels/fp8_gemv_tc.py's "merge" reads them): the kernel stores every
    active split's result and its log-sum-exp, merges nothing, and the reader's merge
    (merge_partials_ref, over active_splits of each sequence) is the attention."""
    hkv, d = 2, 128
    cache = paged_cache(seq_lens, 16, hkv, d, torch.bfloat16)
    q, p = _case(cache, 1, 4 * hkv, d, torch.bfloat16, device, True)
    want, kv_want = _reference(q, p, cache, 1)
    got = fused_decode_attention(q, p, cache.k, cache.v, cache.block_tables, cache.seq_lens,
                                 d ** -0.5, num_splits=splits, partials=True)
    assert isinstance(got, SplitPartials) and got.num_splits == splits
    assert got.o.shape == (len(seq_lens), 4 * hkv, splits, d)
    close(merge_partials_ref(got.o, got.lse, got.seq_lens, got.block_n), want, torch.bfloat16)
    close(cache.kv, kv_want, torch.bfloat16)
    for b, n in enumerate(seq_lens):  # the reader's count: the splits that hold the keys
        k = active_splits(n, got.block_n, splits)
        tiles = math.ceil(n / got.block_n)
        keys = max(math.ceil(tiles / splits), 1) * got.block_n  # keys per split
        assert torch.isfinite(got.lse[b, :, :k]).all()
        assert (k - 1) * keys < n <= k * keys or n == k == 0


def test_prologue_arguments_name_the_field(device, paged_cache):
    cache = paged_cache([16, 16], 16, 2, 64, torch.float32)
    q, p = _case(cache, 1, 4, 64, torch.float32, device, False)
    args = (cache.k, cache.v, cache.block_tables, cache.seq_lens, 0.125)
    bad = {"k": Prologue(p.k[:1], p.v, p.cos, p.sin, p.slot_mapping),
           "cos": Prologue(p.k, p.v, p.cos[:, :8], p.sin, p.slot_mapping),
           "slot_mapping": Prologue(p.k, p.v, p.cos, p.sin, p.slot_mapping.float()),
           "q_norm": Prologue(p.k, p.v, p.cos, p.sin, p.slot_mapping, torch.ones(3)),
           "eps": Prologue(p.k, p.v, p.cos, p.sin, p.slot_mapping, eps=0.0)}
    for field, prologue in bad.items():
        with pytest.raises((ValueError, TypeError), match=field):
            fused_decode_attention(q, prologue, *args)


@pytest.mark.parametrize("R,splits", [(1, 4), (3, 16), (2, 1)])
def test_rope_tables_indexed_by_positions_equal_per_token_rows(R, splits, device, paged_cache,
                                                               close):
    """Prologue(positions=...): cos/sin are tables [max_pos, D/2] (strided views of one
    [max_pos, 2, D/2] table, as pdserve.engine.model.layers.RotaryEmbedding keeps it) that the kernel
    indexes by position, for the q rows and for the new k rows it caches; the result equals
    the same kernel given the gathered per-token rows. Positions are shuffled table rows
    (not the context index), so a kernel that ignored them would differ."""
    hkv, d, group = 2, 64, 3
    cache = paged_cache([40, 0, 17], 8, hkv, d, torch.float32)
    q, p = _case(cache, R, group * hkv, d, torch.float32, device, True, seed=R)
    gen = torch.Generator().manual_seed(11)
    angles = torch.rand(97, d // 2, generator=gen) * 6.0
    table = torch.stack((angles.cos(), angles.sin()), dim=1).to(device)  # [max_pos, 2, D/2]
    positions = torch.randperm(97, generator=gen)[:q.shape[0]].to(device)
    rows = Prologue(p.k, p.v, table[positions, 0], table[positions, 1], p.slot_mapping,
                    p.q_norm, p.k_norm, p.eps)
    tables = Prologue(p.k, p.v, table[:, 0], table[:, 1], p.slot_mapping, p.q_norm, p.k_norm,
                      p.eps, positions=positions)
    kv_before = cache.kv.clone()
    want = fused_decode_attention(q, rows, cache.k, cache.v, cache.block_tables,
                                  cache.seq_lens, d ** -0.5, num_splits=splits, rows_per_seq=R)
    kv_want = cache.kv.clone()
    cache.kv.copy_(kv_before)
    got = fused_decode_attention(q, tables, cache.k, cache.v, cache.block_tables,
                                 cache.seq_lens, d ** -0.5, num_splits=splits, rows_per_seq=R)
    close(got, want, torch.float32)
    close(cache.kv, kv_want, torch.float32)
    with pytest.raises(ValueError, match="positions"):
        fused_decode_attention(q, Prologue(p.k, p.v, table[:, 0], table[:, 1], p.slot_mapping,
                                           positions=positions[:-1]),
                               cache.k, cache.v, cache.block_tables, cache.seq_lens, 1.0,
                               rows_per_seq=R)


@pytest.mark.parametrize("R,splits", [(1, 4), (2, 1)])
def test_heads_outer_views_write_and_read_the_same(R, splits, device, paged_cache):
    """A heads-outer copy [NB, Hkv, L, 2, BS, D] of the cache (docs/tensor_parallel.md): its
    views [NB, BS, Hkv, D] have a head stride of a whole head region; same output and the
    same new rows written, bitwise."""
    hkv, group, d = 3, 2, 64
    cache = paged_cache([33, 9, 64], 8, hkv, d, torch.bfloat16)
    ho = cache.kv.permute(0, 4, 1, 2, 3, 5).contiguous()
    q, p = _case(cache, R, group * hkv, d, torch.bfloat16, device, qk_norm=True)
    args = (cache.block_tables, cache.seq_lens, d ** -0.5)
    want = fused_decode_attention(q, p, cache.k, cache.v, *args, num_splits=splits,
                                  rows_per_seq=R)
    out = fused_decode_attention(q, p, ho[:, :, 1, 0].transpose(1, 2),
                                 ho[:, :, 1, 1].transpose(1, 2), *args, num_splits=splits,
                                 rows_per_seq=R)
    assert torch.equal(out, want)
    assert torch.equal(ho, cache.kv.permute(0, 4, 1, 2, 3, 5))
