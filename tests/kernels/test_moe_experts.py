"""The fused MoE path (kernels.fused_moe: route, align, grouped gate_up and down GEMMs) against
kernels.reference.moe_route_ref + moe_experts_ref."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels import fused_moe as fused_moe_module
from pdserve.kernels.moe_gemm import MoeConfig
from pdserve.kernels.moe_route import RouteConfig
from pdserve.kernels.ops import fused_experts, fused_moe, moe_align, moe_down, moe_gate_up
from pdserve.kernels.reference import moe_experts_ref, moe_route_ref

H, I = 32, 24  # tiny: the interpreter runs every program one by one


def _moe(T: int, E: int, dtype: torch.dtype, device, h: int = H, inter: int = I, seed: int = 0,
         stride_pad: int = 0):
    gen = torch.Generator().manual_seed(seed * 7919 + T * 131 + E)
    x = torch.randn(T, h + stride_pad, generator=gen)[:, :h].to(device, dtype)
    router = (torch.randn(E, h, generator=gen) / h ** 0.5).to(device, dtype)
    w13 = (torch.randn(E, 2 * inter, h, generator=gen) / h ** 0.5).to(device, dtype)
    w2 = (torch.randn(E, h, inter, generator=gen) / inter ** 0.5).to(device, dtype)
    bias = (0.04 * torch.rand(E, generator=gen) - 0.02).to(device)
    return x, router, w13, w2, bias


# (T, E, top_k, dtype, routing): every expert count, top_k and batch size of the issue, both
# dtypes and both scorings, without running all 144 combinations in the interpreter
CASES = [(1, 6, 1, torch.float32, "softmax"), (1, 60, 8, torch.bfloat16, "sigmoid"),
         (3, 12, 2, torch.bfloat16, "softmax"), (3, 6, 2, torch.float32, "sigmoid"),
         (17, 60, 2, torch.float32, "softmax"), (17, 12, 8, torch.bfloat16, "sigmoid"),
         (300, 12, 1, torch.bfloat16, "softmax"), (300, 12, 8, torch.float32, "sigmoid")]


@pytest.mark.parametrize("T,E,top_k,dtype,routing", CASES)
def test_fused_moe_matches_reference(T, E, top_k, dtype, routing, device, close):
    x, router, w13, w2, bias = _moe(T, E, dtype, device, stride_pad=5)
    groups = {6: (3, 2), 12: (4, 3), 60: (6, 3)}[E]  # (n_group, topk_group): >= top_k experts
    route = {"scoring": "softmax", "renormalize": top_k > 1} if routing == "softmax" else {
        "scoring": "sigmoid", "correction_bias": bias, "n_group": groups[0],
        "topk_group": groups[1], "routed_scaling": 2.5}
    out = fused_moe(x, router, w13, w2, top_k, **route)
    assert out.shape == (T, H) and out.dtype == dtype and out.is_contiguous()
    weights, ids = moe_route_ref(x, router, top_k, **route)
    close(out, moe_experts_ref(x, w13, w2, weights, ids), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 2])
def test_experts_without_tokens(dtype, top_k, device, close):
    """A router that strongly prefers experts 2, 5 and 9 of 12: the other nine get no blocks,
    and the result still equals the reference."""
    x, router, w13, w2, _ = _moe(17, 12, dtype, device)
    x[:, 0] = 4.0
    router[:, 0] = -2.0
    router[[2, 5, 9], 0] = torch.tensor([2.0, 2.2, 2.4], dtype=dtype, device=device)
    weights, ids = moe_route_ref(x, router, top_k)
    assert set(ids.flatten().tolist()) <= {2, 5, 9}
    _, expert_ids, _ = moe_align(ids, 12, 16)
    assert set(expert_ids.tolist()) <= {-1, 2, 5, 9}
    close(fused_moe(x, router, w13, w2, top_k), moe_experts_ref(x, w13, w2, weights, ids), dtype)


@pytest.mark.parametrize("cfg", [MoeConfig(16, 16, 16, 16, 16), MoeConfig(32, 16, 32, 32, 16),
                                 MoeConfig(64, 32, 16, 16, 32)])
def test_tiles_cover_ragged_edges(cfg, device, close):
    """H = 40 and I = 24 are not multiples of the tiles: several column tiles and K steps with
    masked tails, 16- to 64-row blocks; precomputed routing (bf16 weights, int64 ids)."""
    T, E, top_k = 9, 6, 3
    x, router, w13, w2, _ = _moe(T, E, torch.float32, device, h=40)
    weights, ids = moe_route_ref(x, router, top_k)
    ref = moe_experts_ref(x, w13, w2, weights, ids)
    out = fused_experts(x, w13, w2, weights.bfloat16(), ids.long(), config=cfg)
    close(out, moe_experts_ref(x, w13, w2, weights.bfloat16(), ids), torch.float32)
    close(out, ref, torch.bfloat16)


def test_token_chunks_and_repeatable(device, close):
    """Batches beyond max_chunk run in chunks (each its own align and GEMMs); the top-k sum
    adds in slot order, so a repeated call is bitwise equal."""
    x, router, w13, w2, _ = _moe(17, 12, torch.bfloat16, device)
    weights, ids = moe_route_ref(x, router, 4)
    ref = moe_experts_ref(x, w13, w2, weights, ids)
    whole = fused_experts(x, w13, w2, weights, ids)
    close(whole, ref, torch.bfloat16)
    chunked = fused_experts(x, w13, w2, weights, ids, max_chunk=5)
    close(chunked, ref, torch.bfloat16)
    assert torch.equal(fused_experts(x, w13, w2, weights, ids), whole)


def test_gemms_one_by_one(device, close):
    """The launchers behind fused_experts, moe_down allocating (zeroed) counters itself."""
    x, router, w13, w2, _ = _moe(5, 6, torch.float32, device)
    weights, ids = moe_route_ref(x, router, 2)
    cfg = MoeConfig(16, 32, 32, 32, 32)
    sorted_ids, expert_ids, _ = moe_align(ids, 6, cfg.block_m)
    act = moe_gate_up(x, w13, sorted_ids, expert_ids, 2, cfg)
    # act in pair order: row p = t * top_k + j is token t through expert ids[t, j]
    gate_up = torch.einsum("ph,pnh->pn", x.repeat_interleave(2, 0), w13[ids.long().flatten()])
    want = torch.nn.functional.silu(gate_up[:, :I]) * gate_up[:, I:]
    close(act, want, torch.float32)
    out = moe_down(act, w2, weights, sorted_ids, expert_ids, cfg)
    close(out, moe_experts_ref(x, w13, w2, weights, ids), torch.float32)


@pytest.mark.parametrize("T,kernels", [
    (3, ["_route_kernel", "_gate_up_kernel", "_down_kernel"]),
    (17, ["_route_kernel", "_align_kernel", "_gate_up_kernel", "_down_kernel"])])
def test_three_or_four_launches_and_no_host_sync(T, kernels, device, monkeypatch):
    """fused_moe launches route, align, gate_up and down and nothing else: no torch compute
    (zero-fill, copies, casts) and no .item() between them (TorchDispatchMode sees every aten
    op); the kernels themselves are stubbed, so only the launches are counted. A decode-sized
    batch (one row block of the router) is aligned in the router's launch: 3 launches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from pdserve.kernels import moe_align as align_mod
    from pdserve.kernels import moe_gemm, moe_route

    launched: list[str] = []

    class Stub:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(self.name)

    for mod, name in ((moe_route, "_route_kernel"), (align_mod, "_align_kernel"),
                      (moe_gemm, "_gate_up_kernel"), (moe_gemm, "_down_kernel")):
        monkeypatch.setattr(mod, name, Stub(name))
    ops: set[str] = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    x, router, w13, w2, bias = _moe(T, 12, torch.bfloat16, device)
    route_cfg = RouteConfig(16, 16, 16)  # the interpreter's tiles (16 rows), on a GPU too
    with Record():
        fused_moe(x, router, w13, w2, 8, "sigmoid", bias, n_group=4, topk_group=3,
                  route_config=route_cfg)
    assert launched == kernels
    assert "empty" in ops and ops <= {"empty", "slice", "alias", "view", "as_strided", "detach"}, ops
    assert fused_moe_module.chunk_tokens(H, 8) >= 3


@pytest.mark.parametrize("route_cfg", [None, RouteConfig(4, 4, 16)])
def test_decode_path_repeatable(route_cfg, device, close):
    """Batches of up to one router row block take the 3-launch path (alignment and counter
    zeroing in the router's launch), with all experts in one program or in slices of 4
    (last-arriving program); repeated calls reuse the counters and are bitwise equal."""
    for T, top_k in ((1, 8), (3, 5), (4, 2)):
        x, router, w13, w2, _ = _moe(T, 60, torch.bfloat16, device, h=40, seed=T)
        weights, ids = moe_route_ref(x, router, top_k)
        first = fused_moe(x, router, w13, w2, top_k, route_config=route_cfg)
        close(first, moe_experts_ref(x, w13, w2, weights, ids), torch.bfloat16)
        assert torch.equal(fused_moe(x, router, w13, w2, top_k, route_config=route_cfg), first)


def test_no_tokens(device):
    x, router, w13, w2, _ = _moe(0, 6, torch.float32, device)
    assert fused_moe(x, router, w13, w2, 2).shape == (0, H)


def test_bad_arguments_name_the_field(device):
    x, router, w13, w2, _ = _moe(3, 6, torch.float32, device)
    weights, ids = moe_route_ref(x, router, 2)
    cases = [((x, w13[:, :, :16], w2, weights, ids), ValueError, "w13: expected shape"),
             ((x, w13[:, :47], w2, weights, ids), ValueError, "w13: expected"),
             ((x, w13, w2[:, :, :8], weights, ids), ValueError, "w2: expected shape"),
             ((x, w13, w2[:5], weights, ids), ValueError, "w2: expected shape"),
             ((x, w13.bfloat16(), w2, weights, ids), TypeError, "w13: dtype"),
             ((x, w13, w2, weights, ids.float()), TypeError, "topk_ids: dtype"),
             ((x, w13, w2, weights[:, :1], ids), ValueError, "topk_weights: expected shape"),
             ((x, w13, w2, weights[:2], ids[:2]), ValueError, "topk_ids: expected \\[3"),
             ((x, w13, w2, weights.t().contiguous().t(), ids), ValueError,
              "topk_weights: must be contiguous"),
             ((x.int(), w13, w2, weights, ids), TypeError, "x: dtype")]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            fused_experts(*args)
    with pytest.raises(ValueError, match="router_weight: 5 experts"):
        fused_moe(x, router[:5], w13, w2, 2)
    with pytest.raises(ValueError, match="config: tile sizes"):
        fused_experts(x, w13, w2, weights, ids, config=MoeConfig(8, 16, 16, 16, 16))
    sorted_ids, expert_ids, _ = moe_align(ids, 6, 16)
    cfg = MoeConfig(16, 16, 16, 16, 16)
    with pytest.raises(ValueError, match="sorted_ids: expected shape"):
        moe_gate_up(x, w13, sorted_ids[:-1], expert_ids, 2, cfg)
    act = moe_gate_up(x, w13, sorted_ids, expert_ids, 2, cfg)
    with pytest.raises(ValueError, match="topk_weights: expected a contiguous"):
        moe_down(act, w2, weights[:2], sorted_ids, expert_ids, cfg)
    with pytest.raises(ValueError, match="counters: 1 elements"):
        moe_down(act, w2, weights, sorted_ids, expert_ids, cfg,
                 counters=torch.zeros(1, dtype=torch.int32, device=device))
