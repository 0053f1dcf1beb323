"""Does one kernel for a batch-1 MLP (gate_up, SiLU-and-mul, down) beat the two PDL-chained
one-row GEMVs, when down is split over the intermediate rows and summed with fp32 atomics?
(GPU, Hopper; FP8 block-scaled weights)

    python -m bench.lab.probe_fused_mlp [--layers 36] [--variants B-BK-BH-WARPS,...] [--out F]

Today a decoder layer's MLP at batch 1 is two launches: gate_up (x -> [gate | up], 2I rows)
and down (silu(gate) * up -> H rows). The boundary between them drains the whole GPU, and
down, H = 4096 rows deep in K = I = 12288, streams at ~3.3 TB/s where gate_up reaches ~3.8.
Here program p owns B intermediate rows j: it streams their gate and up rows (2B x H), makes
a_j = silu(g_j) * u_j, then streams W2^T's rows j (B x H, contiguous: the down weight is
stored transposed) and adds a_j * W2^T[j, :] into an fp32 output with atomics (RED, no
return). No stage boundary: while one program is in its down phase its neighbours on the SM
are in their gate_up phase, and the launch's single tail replaces two. Costs: one fp32 atomic
per output per program (H * I / B adds), an fp32 output to zero beforehand, and summation in
an order that varies run to run (not bitwise reproducible).
Timed: --layers layers of Qwen3-8B's MLP (H 4096, I 12288), each its own weights, one CUDA
graph, against gemv(x, W13, "none") -> gemv(gu, W2, "silu") (kernels/gemv.py, one-row).
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton.language as tl

from pdserve.kernels._triton import jit, pdl_enter, pdl_launch

H, I_SIZE, SB = 4096, 12288, 128  # Qwen3-8B; FP8 scale blocks 128 x 128


@jit
def _fused_mlp_kernel(x_ptr, w13_ptr, s13_ptr, w2t_ptr, s2t_ptr, out_ptr, K, I, NH,
                      stride_s13, stride_s2t, B: tl.constexpr, BK: tl.constexpr,
                      BH: tl.constexpr, VEC: tl.constexpr, SBLK: tl.constexpr,
                      MODE: tl.constexpr, BLOCKED: tl.constexpr, USE_PDL: tl.constexpr):
    """Program p: intermediate rows j = p*B ..; x [K] bf16; w13 [2I, K] e4m3 (as int8),
    gate rows then up rows, s13 [2I/SBLK, K/SBLK]; w2t [I, NH] e4m3 = W2^T, s2t [I/SBLK,
    NH/SBLK]; out [NH] fp32 += W2 @ (silu(gate) * up). B and BH divide SBLK's multiples, so
    a program's rows share one scale row. MODE (a diagnosis): 0 atomics into out; 1 each
    program stores its partial to out[p, :] ([I/B, NH], summed by nobody: the atomics'
    cost); 2 gate_up only (a stored to out[j]). BLOCKED: w2t is W2 blocked by programs
    instead, [I/B, NH, B] (program p's columns of W2 contiguous, rows of B bytes: the sum
    over j within a thread, as in the one-row GEMV), and s2t is W2's own scales [NH/SBLK,
    I/SBLK]."""
    pid = tl.program_id(0)
    j0 = pid * B
    offs_b = tl.arange(0, B)
    offs_k = tl.arange(0, BK)
    g_rows = w13_ptr + (j0 + offs_b)[:, None].to(tl.int64) * K
    u_rows = w13_ptr + (I + j0 + offs_b)[:, None].to(tl.int64) * K
    sg_row = s13_ptr + (j0 // SBLK) * stride_s13
    su_row = s13_ptr + ((I + j0) // SBLK) * stride_s13
    acc_g = tl.zeros([B, BK // VEC], tl.float32)
    acc_u = tl.zeros([B, BK // VEC], tl.float32)
    pdl_enter(USE_PDL)
    for k0 in range(0, K, BK):
        cols = tl.max_contiguous(tl.multiple_of(k0 + offs_k, VEC), VEC)
        wg = tl.load(g_rows + cols[None, :], eviction_policy="evict_first")
        wu = tl.load(u_rows + cols[None, :], eviction_policy="evict_first")
        xk = tl.load(x_ptr + cols).to(tl.float32)
        ag = xk * tl.load(sg_row + cols // SBLK)
        au = xk * tl.load(su_row + cols // SBLK)
        fg = wg.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        fu = wu.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        acc_g += tl.sum(tl.reshape(fg * ag[None, :], [B, BK // VEC, VEC]), axis=2)
        acc_u += tl.sum(tl.reshape(fu * au[None, :], [B, BK // VEC, VEC]), axis=2)
    # rounded as the two-kernel path stores them: gate_up's output, then silu_and_mul's
    g = tl.sum(acc_g, axis=1).to(tl.bfloat16).to(tl.float32)
    u = tl.sum(acc_u, axis=1).to(tl.bfloat16).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g)) * u).to(tl.bfloat16).to(tl.float32)  # [B]
    if MODE == 2:
        tl.store(out_ptr + j0 + offs_b, a)
        return
    offs_h = tl.arange(0, BH)
    if BLOCKED:
        _down_blocked(a, w2t_ptr, s2t_ptr, out_ptr, pid, j0, NH, stride_s2t, offs_b, offs_h,
                      B, BH, SBLK, MODE)
        return
    d_rows = w2t_ptr + (j0 + offs_b)[:, None].to(tl.int64) * NH
    s2_row = s2t_ptr + (j0 // SBLK) * stride_s2t
    for h0 in range(0, NH, BH):
        cols = tl.max_contiguous(tl.multiple_of(h0 + offs_h, 16), 16)
        wd = tl.load(d_rows + cols[None, :], eviction_policy="evict_first")
        fd = wd.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        part = tl.sum(fd * a[:, None], axis=0) * tl.load(s2_row + cols // SBLK)
        if MODE == 0:
            tl.atomic_add(out_ptr + cols, part, sem="relaxed")
        else:
            tl.store(out_ptr + pid * NH + cols, part)


@jit
def _down_blocked(a, w2b_ptr, s2_ptr, out_ptr, pid, j0, NH, stride_s2, offs_b, offs_h,
                  B: tl.constexpr, BH: tl.constexpr, SBLK: tl.constexpr, MODE: tl.constexpr):
    """out[h] += sum_j W2[h, j] a_j over program p's B columns j, W2 blocked [I/B, NH, B]."""
    base = w2b_ptr + pid.to(tl.int64) * NH * B
    for h0 in range(0, NH, BH):
        rows = h0 + offs_h
        cols = tl.max_contiguous(tl.multiple_of(offs_b, 16), 16)
        wd = tl.load(base + rows[:, None] * B + cols[None, :], eviction_policy="evict_first")
        fd = wd.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        scale = tl.load(s2_ptr + (rows // SBLK) * stride_s2 + j0 // SBLK)
        part = tl.sum(fd * a[None, :], axis=1) * scale
        if MODE == 0:
            tl.atomic_add(out_ptr + rows, part, sem="relaxed")
        else:
            tl.store(out_ptr + pid * NH + rows, part)


def fused_mlp(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2t: torch.Tensor,
              s2t: torch.Tensor, out: torch.Tensor, b: int, bk: int, bh: int, warps: int,
              mode: int = 0) -> None:
    """out [H] fp32 += W2 @ (silu(x W1^T) * x W3^T) for x [H] bf16 (see the kernel); w2t
    [I, H] (W2^T, s2t its scales) or [I/b, H, b] (W2 blocked, s2t W2's scales)."""
    blocked = w2t.dim() == 3
    K = x.shape[-1]
    I, NH = (w2t.shape[0] * w2t.shape[2], w2t.shape[1]) if blocked else tuple(w2t.shape)
    if I % b or K % bk or NH % bh or SB % b:
        raise ValueError(f"B {b}, BK {bk}, BH {bh}: must divide I {I}, K {K}, H {NH}, {SB}")
    _fused_mlp_kernel[(I // b,)](
        x, w13.view(torch.int8), s13, w2t.view(torch.int8), s2t, out, K, I, NH,
        s13.stride(0), s2t.stride(0), B=b, BK=bk, BH=bh, VEC=16, SBLK=SB, MODE=mode,
        BLOCKED=blocked,
        num_warps=warps,
        **pdl_launch(x))


def _quant(n: int, k: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    from pdserve.kernels.fp8_scales import FP8_DTYPE
    w = (torch.randn(n, k, device=dev) * 64).clamp(-448, 448).to(FP8_DTYPE)
    s = (torch.rand(n // SB, k // SB, device=dev) + 0.5) / (64 * k ** 0.5)
    return w, s


def _layers(n: int, dev) -> list[dict]:
    out = []
    for _ in range(n):
        w13, s13 = _quant(2 * I_SIZE, H, dev)
        w2, s2 = _quant(H, I_SIZE, dev)
        out.append({"x": torch.randn(1, H, device=dev, dtype=torch.bfloat16), "w13": w13,
                    "s13": s13, "w2": w2, "s2": s2, "w2t": w2.t().contiguous(),
                    "s2t": s2.t().contiguous(), "out": torch.zeros(H, device=dev),
                    "parts": torch.zeros(I_SIZE // 8 * H, device=dev)})
    return out


def _graph_us(fn) -> float:
    from triton.testing import do_bench_cudagraph
    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=200) * 1e3


def main() -> None:
    from pdserve.kernels.ops import gemv

    from bench.lab.probe_fp8_vec import write_result

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--variants", default="32-256-256-4,32-512-256-4,16-512-256-4,"
                    "16-256-512-4,64-256-256-8,32-256-512-8,16-1024-256-4,32-512-128-4",
                    help="B-BK-BH-WARPS[-MODE][-t] (MODE 0 atomics, 1 partials stored, 2 "
                    "gate_up only; -t: W2 transposed, else blocked; see the kernel)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    layers = _layers(args.layers, dev)
    nbytes = 3 * H * I_SIZE
    out: dict = {"what": __doc__.split("\n")[0], "layers": args.layers,
                 "bytes_per_layer": nbytes, "variants": {}}

    def two_gemvs() -> None:
        for L in layers:
            gu = gemv(L["x"], L["w13"], "none", scales=L["s13"], block=(SB, SB))
            gemv(gu, L["w2"], "silu", scales=L["s2"], block=(SB, SB))
    us = _graph_us(two_gemvs) / args.layers
    out["two_gemvs"] = {"us_per_layer": round(us, 2), "TBps": round(nbytes / us / 1e6, 3)}
    print("two_gemvs", out["two_gemvs"], file=sys.stderr, flush=True)
    us = _graph_us(lambda: [gemv(L["x"], L["w13"], "none", scales=L["s13"], block=(SB, SB))
                            for L in layers]) / args.layers
    out["gate_up_gemv"] = {"us_per_layer": round(us, 2),
                           "TBps": round(nbytes * 2 / 3 / us / 1e6, 3)}
    print("gate_up_gemv", out["gate_up_gemv"], file=sys.stderr, flush=True)
    L0 = layers[0]
    gu = gemv(L0["x"], L0["w13"], "none", scales=L0["s13"], block=(SB, SB))
    ref = gemv(gu, L0["w2"], "silu", scales=L0["s2"], block=(SB, SB)).float()[0]
    for v in args.variants.split(","):
        blocked = not v.endswith("-t")
        nums = [int(t) for t in v.removesuffix("-t").split("-")]
        b, bk, bh, warps, mode = (nums + [0])[:5]
        key = "out" if mode == 0 else "parts"
        try:
            for L in layers:
                L["w2b"] = L["w2"].view(H, I_SIZE // b, b).permute(1, 0, 2).contiguous() \
                    if blocked else L["w2t"]
                L["s2b"] = L["s2"] if blocked else L["s2t"]
            L0["out"].zero_()
            fused_mlp(L0["x"][0], L0["w13"], L0["s13"], L0["w2b"], L0["s2b"], L0[key],
                      b, bk, bh, warps, mode)
            err = float((L0["out"] - ref).norm() / ref.norm()) if mode == 0 else None

            def chain(b=b, bk=bk, bh=bh, warps=warps, mode=mode, key=key) -> None:
                for L in layers:  # the outputs accumulate over replays: timing only
                    fused_mlp(L["x"][0], L["w13"], L["s13"], L["w2b"], L["s2b"], L[key],
                              b, bk, bh, warps, mode)
            us = _graph_us(chain) / args.layers
            moved = nbytes if mode != 2 else nbytes * 2 // 3
            row = {"us_per_layer": round(us, 2), "TBps": round(moved / us / 1e6, 3),
                   "rel_err_vs_two_gemvs": err}
        except Exception as exc:  # noqa: BLE001 - a probe records what failed and goes on
            row = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        out["variants"][v] = row
        print(v, row, file=sys.stderr, flush=True)
    write_result(out, "bench.lab.probe_fused_mlp", args.out)


if __name__ == "__main__":
    main()
