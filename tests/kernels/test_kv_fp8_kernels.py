"""FP8 KV cache kernels against kernels/kv_quant.py's references: quantize-on-write (kv_write,
the attention prologue, the fused decode kernel's write) and the attention kernels that read
e4m3 values with their per-(block, head) scales. Odd sizes, runs that start mid-block and
cross block boundaries, padding tokens, a block whose scale was set by an earlier write.
Each runs on the engine's cache layout and on a heads-outer one built here (docs/
tensor_parallel.md: [NB, Hkv, L + S, 2, BS, D], each head's scales in its own region), whose
K/V and scale views have head strides of a whole head region."""
from __future__ import annotations

import pytest
import torch
import triton.language as tl

from pdserve.engine.core.config import ModelConfig
from pdserve.engine.exec.kv_cache import LayerKV, allocate_kv_cache, layer_views
from pdserve.kernels.attn_prologue import fused_qk_norm_rope_kv
from pdserve.kernels.decode_attention import (
    Prologue,
    _word_loads,
    fused_decode_attention,
    paged_decode_attention,
)
from pdserve.kernels.decode_attention_config import FP8_LOADS, DecodeTiles
from pdserve.kernels.kv_quant import FP8, KVScales, check_scales, write_kv_fp8_ref
from pdserve.kernels.kv_write import write_kv
from pdserve.kernels.prefill_attention import paged_prefill_attention
from pdserve.kernels.reference import paged_attention_ref, qk_norm_rope_cache_ref

LAYER = 1
LAYERS = 2  # data layers of the test caches
LAYOUTS = ("engine", "heads_outer")


def _views(kv: torch.Tensor, layout: str) -> LayerKV:
    """Layer LAYER's views of a cache built by _cache: K/V [NB, BS, Hkv, D], scales [NB, Hkv].
    heads_outer: kv [NB, Hkv, L + 1, 2, BS, D]; head h's fp32 scales [L, 2] open its scale
    layer, so the scale views' head stride is a head region / 4 (never 1)."""
    if layout == "engine":
        return layer_views(kv, LAYER)
    k, v = kv[:, :, LAYER, 0].transpose(1, 2), kv[:, :, LAYER, 1].transpose(1, 2)
    sc = kv[:, :, LAYERS:].flatten(2).view(torch.float32)  # [NB, Hkv, 2 * BS * D / 4]
    return LayerKV(k, v, KVScales(sc[:, :, 2 * LAYER], sc[:, :, 2 * LAYER + 1]))


def _cache(nb: int, bs: int, hkv: int, d: int, device, seed: int = 0,
           layout: str = "engine"):
    """An fp8 cache (2 layers + scale layers) in `layout`, every block filled by one
    whole-block write of random rows whose magnitude varies per block; layer LAYER's views."""
    if layout == "engine":
        cfg = ModelConfig(arch="llama", vocab_size=8, hidden_size=8, num_layers=LAYERS,
                          num_heads=hkv, num_kv_heads=hkv, head_dim=d, intermediate_size=8)
        kv = allocate_kv_cache(cfg, nb, bs, FP8, device)
    else:
        kv = torch.zeros(nb, hkv, LAYERS + 1, 2, bs, d, dtype=FP8, device=device)
    views = _views(kv, layout)
    gen = torch.Generator().manual_seed(seed)
    mag = torch.rand(nb, 1, 1, 1, generator=gen) * 20 + 0.1
    rows = (torch.randn(nb, bs, hkv, d, generator=gen) * mag).flatten(0, 1).to(device)
    slots = torch.arange(nb * bs, device=device)
    write_kv_fp8_ref(rows, rows.flip(-1) * 0.5, views.k, views.v, slots, views.scales)
    return kv, views


def _dequant(views) -> tuple[torch.Tensor, torch.Tensor]:
    s = views.scales
    return (views.k.float() * s.k[:, None, :, None], views.v.float() * s.v[:, None, :, None])


def _runs_slots(bs: int, device) -> torch.Tensor:
    """Runs of consecutive slots: mid-block start crossing into the next block, a fresh block,
    a padding token, single tokens, a run ending exactly at a block boundary."""
    s = [bs + 1, bs + 2, bs + 3, 2 * bs, 2 * bs + 1, -1, 5 * bs + bs - 1, 3 * bs,
         7 * bs + 2, 7 * bs + 3, 6 * bs, 6 * bs + 1, 6 * bs + 2]
    return torch.tensor(s, dtype=torch.int64, device=device)


def _assert_fp8_close(kv_a: torch.Tensor, kv_b: torch.Tensor, exact: bool,
                      layout: str = "engine") -> None:
    """Two fp8 caches (values and scales): bitwise, or (inputs rounded differently before
    quantizing) scales within 1e-5 and values within one e4m3 step."""
    if exact:
        assert torch.equal(kv_a.view(torch.uint8), kv_b.view(torch.uint8))
        return
    va, vb = _views(kv_a, layout), _views(kv_b, layout)
    for sa, sb in ((va.scales.k, vb.scales.k), (va.scales.v, vb.scales.v)):
        torch.testing.assert_close(sa, sb, rtol=1e-5, atol=0)
    for a, b in ((va.k, vb.k), (va.v, vb.v)):
        a, b = a.float(), b.float()
        assert ((a - b).abs() <= b.abs() / 8 + 2 ** -9).all()
        assert (a == b).float().mean() > 0.97


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bs,hkv,d,static", [(4, 3, 32, 0.0), (16, 2, 64, 0.0),
                                             (8, 1, 16, 0.05)])
def test_write_kv_fp8_matches_reference(bs, hkv, d, static, layout, device) -> None:
    kv, views = _cache(9, bs, hkv, d, device, layout=layout)
    slots = _runs_slots(bs, device)
    gen = torch.Generator().manual_seed(bs)
    k = (torch.randn(len(slots), hkv, d, generator=gen) * 4).to(device)
    v = torch.randn(len(slots), hkv, d, generator=gen).to(device)
    want = kv.clone()
    wv = _views(want, layout)
    sc = KVScales(views.scales.k, views.scales.v, static, static)
    write_kv(k, v, views.k, views.v, slots, sc)
    write_kv_fp8_ref(k, v, wv.k, wv.v, slots, KVScales(wv.scales.k, wv.scales.v, static, static))
    _assert_fp8_close(kv, want, exact=True)
    # block 1 was filled before and the run starts at offset 1: its scale is kept
    before = _views(_cache(9, bs, hkv, d, device, layout=layout)[0], layout)
    assert torch.equal(views.scales.k[1], before.scales.k[1])
    if static:  # fresh blocks take the checkpoint's scale
        assert (views.scales.k[[2, 3, 6]] == static).all()


@pytest.mark.parametrize("dtype,layout", [(torch.float32, "engine"),
                                          (torch.bfloat16, "engine"),
                                          (torch.bfloat16, "heads_outer")])
def test_prologue_quantizes_in_kernel(dtype, layout, device) -> None:
    bs, hq, hkv, d = 4, 6, 3, 32
    kv, views = _cache(9, bs, hkv, d, device, layout=layout)
    slots = _runs_slots(bs, device)
    T = len(slots)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(T, h, d, generator=gen).to(device, dtype) for h in (hq, hkv, hkv))
    angles = torch.rand(300, d // 2, generator=gen) * 6
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    pos = torch.randint(0, 300, (T,), generator=gen).to(device)
    qn, kn = ((torch.rand(d, generator=gen) + 0.5).to(device, dtype) for _ in range(2))
    want = kv.clone()
    q_out = fused_qk_norm_rope_kv(q, k, v, pos, cos, sin, views.k, views.v, slots, qn, kn,
                                  1e-6, views.scales)
    # reference: rotate into a float scratch cache, read the rows back, quantize them
    scratch = torch.zeros(9, bs, hkv, d, device=device)
    scratch_v = torch.zeros_like(scratch)
    q_ref = qk_norm_rope_cache_ref(q.float(), k.float(), v.float(), pos, cos, sin, scratch,
                                   scratch_v, slots, qn.float(), kn.float(), 1e-6)
    keep = slots >= 0
    s = slots[keep]
    k_rot = torch.zeros(T, hkv, d, device=device)
    k_rot[keep] = scratch[s // bs, s % bs]
    wv = _views(want, layout)
    write_kv_fp8_ref(k_rot, v.float(), wv.k, wv.v, slots, wv.scales)
    torch.testing.assert_close(q_out.float(), q_ref, rtol=2e-2, atol=2e-2)
    _assert_fp8_close(kv, want, exact=False, layout=layout)  # RoPE rounds differently


def _tables(seq_lens: list[int], bs: int, nb: int, device) -> torch.Tensor:
    order = torch.randperm(nb, generator=torch.Generator().manual_seed(7)).tolist()
    need = [-(-s // bs) for s in seq_lens]
    width, rows, used = max(need) + 1, [], 0
    for n in need:
        rows.append(order[used:used + n] + [0] * (width - n))
        used += n
    return torch.tensor(rows, dtype=torch.int32, device=device)


@pytest.mark.parametrize("d", [32, 64])  # 64: kv_quarters when compiled (and interpreted)
@pytest.mark.parametrize("R,seq_lens,splits,layout", [
    (1, [1, 17, 33, 65], 4, "engine"), (3, [9, 31], 2, "engine"), (2, [40, 5], 1, "engine"),
    (1, [1, 17, 33, 65], 4, "heads_outer"), (3, [9, 31], 2, "heads_outer")])
def test_decode_reads_fp8(R, seq_lens, splits, layout, d, device) -> None:
    bs, hkv, group = 8, 2, 3
    kv, views = _cache(24, bs, hkv, d, device, layout=layout)
    bt = _tables(seq_lens, bs, 24, device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(len(seq_lens) * R, hkv * group, d,
                    generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
    out = paged_decode_attention(q, views.k, views.v, bt, lens, d ** -0.5, num_splits=splits,
                                 rows_per_seq=R, kv_scales=views.scales)
    k, v = _dequant(views)
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=device) * R
    ref = paged_attention_ref(q.float(), k, v, qsl, lens, bt, d ** -0.5)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("R,seq_lens,splits", [
    (1, [1, 9, 16, 33], 4),   # fresh blocks (offset 0) and appends, one fresh at a split
    (3, [10, 23, 7], 2),      # 3 new rows crossing into a fresh block
    (3, [10, 23, 7], 1),      # one split: no prefetched tile (kv_quarters' loop at d = 64)
])
def test_fused_decode_writes_and_reads_fp8(R, seq_lens, splits, layout, d, device) -> None:
    bs, hkv, group = 8, 2, 2
    kv, views = _cache(24, bs, hkv, d, device, layout=layout)
    bt = _tables(seq_lens, bs, 24, device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    B, gen = len(seq_lens), torch.Generator().manual_seed(5)
    slots = torch.tensor([int(bt[b, p // bs]) * bs + p % bs for b, n in enumerate(seq_lens)
                          for p in range(n - R, n)], device=device)
    q = torch.randn(B * R, hkv * group, d, generator=gen).to(device)
    k, v = (torch.randn(B * R, hkv, d, generator=gen).to(device) * 3 for _ in range(2))
    ang = torch.rand(B * R, d // 2, generator=gen) * 6
    p = Prologue(k, v, ang.cos().to(device), ang.sin().to(device), slots)
    want = kv.clone()
    # fp32 q takes the cast tiles by default; kv_quarters named (interpreted at d = 64: the
    # write, then the per-quarter loop; compiled, fp32 operands take the cast)
    out = fused_decode_attention(q, p, views.k, views.v, bt, lens, d ** -0.5,
                                 num_splits=splits, rows_per_seq=R, kv_scales=views.scales,
                                 tiles=DecodeTiles(16, 4, 1, fp8_loads="kv_quarters"))
    scratch, scratch_v = (torch.zeros(24, bs, hkv, d, device=device) for _ in range(2))
    q_rot = qk_norm_rope_cache_ref(q, k, v, None, p.cos, p.sin, scratch, scratch_v, slots,
                                   None, None, 1e-6)
    wv = _views(want, layout)
    write_kv_fp8_ref(scratch[slots // bs, slots % bs], v, wv.k, wv.v, slots, wv.scales)
    _assert_fp8_close(kv, want, exact=device.type == "cpu", layout=layout)
    kd, vd = _dequant(wv)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=device) * R
    ref = paged_attention_ref(q_rot, kd, vd, qsl, lens, bt, d ** -0.5)
    torch.testing.assert_close(out.float(), ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("q_lens,seq_lens", [([5, 1, 13], [5, 20, 30]), ([17], [17])])
def test_prefill_reads_fp8(q_lens, seq_lens, layout, device) -> None:
    bs, hkv, group, d = 4, 3, 2, 32
    kv, views = _cache(24, bs, hkv, d, device, layout=layout)
    bt = _tables(seq_lens, bs, 24, device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                       device=device)
    q = torch.randn(sum(q_lens), hkv * group, d,
                    generator=torch.Generator().manual_seed(2)).to(device)
    out = paged_prefill_attention(q, views.k, views.v, qsl, lens, bt, max(q_lens), d ** -0.5,
                                  views.scales)
    k, v = _dequant(views)
    ref = paged_attention_ref(q, k, v, qsl, lens, bt, d ** -0.5)
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)


def test_fp8_cache_without_scales_is_refused(device) -> None:
    _, views = _cache(4, 4, 1, 16, device)
    k = torch.zeros(1, 1, 16, device=device)
    with pytest.raises(ValueError, match="kv_scales"):
        write_kv(k, k, views.k, views.v, torch.zeros(1, dtype=torch.int64, device=device))


@pytest.mark.parametrize("loads", FP8_LOADS)
@pytest.mark.parametrize("block_n,warps,stages,regs,splits,layout", [
    (128, 4, 1, 128, 3, "engine"), (64, 2, 2, None, 1, "engine"), (16, 4, 2, None, 5, "engine"),
    (128, 4, 3, None, 3, "heads_outer"), (16, 4, 1, 128, 5, "heads_outer")])
def test_decode_fp8_tile_loads(loads, block_n, warps, stages, regs, splits, layout,
                               device) -> None:
    """Every way of reading fp8 tiles (decode_attention_tiles.py: tl's cast, V or K and V as
    int32 words converted by PTX) and tile shape gives the reference's result: odd lengths,
    tiles that cross blocks, splits. Values of 1e-4 in some blocks next to 20 in others: the
    fp16 weights are normalised per tile, so the small blocks keep their precision. On CPU
    every variant is the cast (the interpreter has no PTX)."""
    bs, hkv, group, d = 8, 2, 4, 64
    kv, views = _cache(64, bs, hkv, d, device, seed=3, layout=layout)
    small = torch.arange(64, device=device) % 3 == 0
    views.scales.v[small] *= 1e-5  # those blocks' values ~1e-4
    seq_lens = [1, 130, 77, 203]
    bt = _tables(seq_lens, bs, 64, device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(len(seq_lens), hkv * group, d,
                    generator=torch.Generator().manual_seed(4)).to(device, torch.bfloat16)
    tiles = DecodeTiles(block_n, warps, stages, fp8_loads=loads, max_regs=regs)
    out = paged_decode_attention(q, views.k, views.v, bt, lens, d ** -0.5, num_splits=splits,
                                 kv_scales=views.scales, tiles=tiles)
    k, v = _dequant(views)
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=device)
    ref = paged_attention_ref(q.float(), k, v, qsl, lens, bt, d ** -0.5)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    rel = (out.float() - ref).norm() / ref.norm()
    assert rel < 8e-3  # bf16 output rounding, not fp16 weights underflowing


def test_quarters_need_head_dim_64(device) -> None:
    """kv_quarters splits head_dim in four tl.dot reduction dims of >= 16: below D = 64 the
    launcher takes the joined words (compiled) or the cast (interpreter) instead."""
    tiles = DecodeTiles(64, fp8_loads="kv_quarters")
    for d, want in ((64, {3}), (128, {3}), (32, {0, 2})):
        _, views = _cache(4, 8, 2, d, device)
        assert _word_loads(tiles, True, tl.float16, views.k, views.v) in want


def test_decode_tiles_are_checked() -> None:
    with pytest.raises(ValueError, match="tiles.block_n"):
        DecodeTiles(48)
    with pytest.raises(ValueError, match="tiles.fp8_loads"):
        DecodeTiles(64, fp8_loads="bytes")
    with pytest.raises(ValueError, match="tiles.num_stages"):
        DecodeTiles(64, 4, 0)
    with pytest.raises(ValueError, match="tiles.max_regs"):
        DecodeTiles(64, max_regs=32)


def test_heads_outer_scale_views_pass_the_checks(device) -> None:
    """Scale views with a head stride of a whole head region are taken (they were refused
    for a non-contiguous head dim); shape and dtype are still checked, by field."""
    kv, views = _cache(5, 4, 3, 16, device, layout="heads_outer")
    assert views.scales.k.stride(1) == (LAYERS + 1) * 2 * 4 * 16 // 4
    check_scales(views.scales, views.k)
    with pytest.raises(ValueError, match="kv_scales.v: expected shape"):
        check_scales(KVScales(views.scales.k, views.scales.v[:, :2]), views.k)
    with pytest.raises(TypeError, match="kv_scales.k: expected a float32"):
        check_scales(KVScales(views.scales.k.double(), views.scales.v), views.k)
