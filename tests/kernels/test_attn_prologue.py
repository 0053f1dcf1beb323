"""fused_qk_norm_rope_kv and write_kv against the torch references and the engine's layers."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels.ops import fused_qk_norm_rope_kv, write_kv
from pdserve.kernels.reference import qk_norm_rope_cache_ref, rope_cos_sin, write_kv_ref

MAX_POS = 300


def _qkv_views(T, hq, hkv, d, dtype, device, seed):
    """q/k/v as strided views of one fused projection output [T, (Hq + 2 Hkv) * D]."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=gen).to(device, dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return qkv, q.view(T, hq, d), k.view(T, hkv, d), v.view(T, hkv, d)


def _tables(d, device):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    cos, sin = rope_cos_sin(inv_freq, MAX_POS)
    return cos.to(device), sin.to(device)


def _slots(T, num_slots, device, seed):
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))[:T]
    if T > 2:
        slots[T // 2] = -1  # a padding token: must not be written
    return slots.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,hq,hkv,d,qk_norm", [
    (1, 4, 4, 64, False), (3, 12, 4, 128, True), (37, 24, 3, 64, True), (5, 8, 1, 128, False)])
def test_matches_reference(dtype, T, hq, hkv, d, qk_norm, device, paged_cache, close):
    qkv, q, k, v = _qkv_views(T, hq, hkv, d, dtype, device, seed=T * hq)
    cache = paged_cache([16 * 4], 16, hkv, d, dtype)
    want = cache.kv.clone()
    cos, sin = _tables(d, device)
    positions = torch.randint(0, MAX_POS, (T,), generator=torch.Generator().manual_seed(1))
    positions = positions.to(device)
    slots = _slots(T, cache.kv.shape[0] * 16, device, seed=T)
    q_norm = (torch.rand(d) + 0.5).to(device, dtype) if qk_norm else None
    k_norm = (torch.rand(d) + 0.5).to(device, dtype) if qk_norm else None
    before = qkv.clone()

    q_out = fused_qk_norm_rope_kv(q, k, v, positions, cos, sin, cache.k, cache.v, slots,
                                  q_norm, k_norm, eps=1e-6)
    q_ref = qk_norm_rope_cache_ref(q, k, v, positions, cos, sin, want[:, 1, 0], want[:, 1, 1],
                                   slots, q_norm, k_norm, eps=1e-6)
    assert q_out.shape == (T, hq, d) and q_out.is_contiguous()
    close(q_out, q_ref, dtype)
    close(cache.kv, want, dtype)  # written slots match, every other slot/layer untouched
    assert torch.equal(qkv, before)


def test_per_token_cos_sin_matches_engine_rope(device, paged_cache, close):
    """positions=None takes pdserve.engine.model.layers.RotaryEmbedding.cos_sin rows; same as apply_rope."""
    from pdserve.engine.model.layers import RMSNorm, RotaryEmbedding, apply_rope

    T, hq, hkv, d = 6, 8, 2, 64
    _, q, k, v = _qkv_views(T, hq, hkv, d, torch.float32, device, seed=7)
    rope = RotaryEmbedding(d, 1e6, None)
    positions = torch.tensor([0, 1, 2, 50, 51, 257], device=device)
    cos, sin = rope.cos_sin(positions)
    q_norm, k_norm = RMSNorm(d, 1e-6).to(device), RMSNorm(d, 1e-6).to(device)
    with torch.no_grad():
        q_norm.weight.uniform_(0.5, 1.5)
        k_norm.weight.uniform_(0.5, 1.5)
    cache = paged_cache([32], 8, hkv, d, torch.float32)
    slots = torch.arange(T, device=device) + 8
    q_out = fused_qk_norm_rope_kv(q, k, v, None, cos, sin, cache.k, cache.v, slots,
                                  q_norm.weight.detach(), k_norm.weight.detach(), eps=1e-6)
    with torch.no_grad():
        q_want = apply_rope(q_norm(q), cos, sin)
        k_want = apply_rope(k_norm(k), cos, sin)
    close(q_out, q_want, torch.float32)
    close(cache.k[1:2].flatten(0, 1)[:T], k_want, torch.float32)  # slots 8..13 = block 1
    close(cache.v[1:2].flatten(0, 1)[:T], v, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,hkv,d,bs", [(1, 1, 64, 4), (37, 3, 64, 16), (9, 8, 128, 32)])
def test_write_kv_matches_reference(dtype, T, hkv, d, bs, device, paged_cache):
    _, _, k, v = _qkv_views(T, 2 * hkv, hkv, d, dtype, device, seed=T + hkv)
    cache = paged_cache([bs * 3, bs * 2], bs, hkv, d, dtype)
    want = cache.kv.clone()
    slots = _slots(T, cache.kv.shape[0] * bs, device, seed=d + T)
    write_kv(k, v, cache.k, cache.v, slots)
    write_kv_ref(k, v, want[:, 1, 0], want[:, 1, 1], slots)
    assert torch.equal(cache.kv, want)  # a copy: bit exact, other layers untouched


def test_bad_arguments_name_the_field(device, paged_cache):
    _, q, k, v = _qkv_views(4, 4, 2, 64, torch.float32, device, seed=0)
    cache = paged_cache([16], 16, 2, 64, torch.float32)
    cos, sin = _tables(64, device)
    pos = torch.zeros(4, dtype=torch.int64, device=device)
    slots = torch.arange(4, device=device)
    args = dict(positions=pos, cos=cos, sin=sin, k_cache=cache.k, v_cache=cache.v,
                slot_mapping=slots)
    with pytest.raises(ValueError, match="k_cache: has 2 kv heads, the keys have 1"):
        fused_qk_norm_rope_kv(q, k[:, :1], v[:, :1], **args)
    with pytest.raises(ValueError, match="cos"):
        fused_qk_norm_rope_kv(q, k, v, **{**args, "cos": cos[:, :16]})
    with pytest.raises(ValueError, match="slot_mapping"):
        fused_qk_norm_rope_kv(q, k, v, **{**args, "slot_mapping": slots[:3]})
    with pytest.raises(ValueError, match="q_norm"):
        fused_qk_norm_rope_kv(q, k, v, **args, q_norm=torch.ones(32, device=device))
    with pytest.raises(ValueError, match="head_dim 48 must be a power of 2"):
        fused_qk_norm_rope_kv(q[..., :48], k[..., :48], v[..., :48], **args)
    with pytest.raises(TypeError, match="positions"):
        fused_qk_norm_rope_kv(q, k, v, **{**args, "positions": pos.float()})
    with pytest.raises(ValueError, match="v_cache"):
        write_kv(k, v, cache.k, cache.v[:, :8], slots)


@pytest.mark.parametrize("T,hkv,bs", [(7, 3, 8), (1, 1, 16)])
def test_heads_outer_views_are_written_the_same(T, hkv, bs, device, paged_cache):
    """A heads-outer copy [NB, Hkv, L, 2, BS, D] of the cache (docs/tensor_parallel.md): the
    prologue and write_kv through its views [NB, BS, Hkv, D] (head stride: a whole head
    region) write the same bytes as through the engine's views."""
    d = 64
    _, q, k, v = _qkv_views(T, 2 * hkv, hkv, d, torch.bfloat16, device, seed=T)
    cache = paged_cache([bs * 3], bs, hkv, d, torch.bfloat16)
    ho = cache.kv.permute(0, 4, 1, 2, 3, 5).contiguous()
    kh, vh = ho[:, :, 1, 0].transpose(1, 2), ho[:, :, 1, 1].transpose(1, 2)
    cos, sin = _tables(d, device)
    pos = torch.arange(T, device=device) * 7
    slots = _slots(T, cache.kv.shape[0] * bs, device, seed=T)
    want = fused_qk_norm_rope_kv(q, k, v, pos, cos, sin, cache.k, cache.v, slots)
    out = fused_qk_norm_rope_kv(q, k, v, pos, cos, sin, kh, vh, slots)
    assert torch.equal(out, want)
    slots2 = _slots(T, cache.kv.shape[0] * bs, device, seed=T + 1)
    write_kv(v, k, cache.k, cache.v, slots2)
    write_kv(v, k, kh, vh, slots2)
    assert torch.equal(ho, cache.kv.permute(0, 4, 1, 2, 3, 5))
