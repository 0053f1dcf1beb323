"""Can a persistent FP8 GEMV that streams its weight through shared memory with TMA beat the
one-row Triton GEMV in a batch-1 decode chain? (GPU, Hopper)

    python -m bench.lab.probe_fp8_gluon [--layers 36] [--out F.json]

Session 18 found the FP8 GEMVs stream at ~3.55 TB/s where bf16 ones reach ~4.2: a
register-tiled program keeps half the bytes in flight at FP8. Here each CTA (one or two per
SM, a persistent grid) owns a ring of STAGES weight tiles in shared memory that TMA fills; the
bytes in flight no longer cost registers, and before the PDL wait each CTA already has its
first STAGES tiles in flight while the kernel before it drains. Timed: 36 layers of Qwen3-8B's
four projections (FP8 weights, 128 x 128 block scales, prologue "none"), each layer its own
weights, one CUDA graph of PDL launches, against the same chain of the one-row Triton GEMV.

Variants (--variants, comma-separated):
  BNxBKxSTAGESxCTAS_PER_SMxWARPS[xKIND[xREGS]]   bench/lab/gluon_gemv_cuda_core.py; KIND ws,
      wsnoact, wsstream (the stream alone), wscompute, wss (activation in shared memory),
      wsspair; without KIND the ring refilled behind a CTA barrier
  mmb-Sq-So-Sg-Sd-STAGES-CTAS_PER_SM[-REGS][-a][-p|-q][-e]   bench/lab/gluon_gemv_wgmma.py
      (tensor cores; K splits per projection; -a: fp32 RED atomics instead of per-split
      partials; -p / -q: two / four tiles' wgmmas in flight; -e: the next launch let go before the
      PDL wait)
  swab-RING_KB[-REGS[-PER_SM[-STAGE_BYTES]]][-n]   bench/lab/gluon_gemv_swab.py (tensor cores,
      weights as B: whole rows per CTA, no K split)
Results: bench/results/probe_fp8_gluon_h200_2026-11-29.json.
"""
from __future__ import annotations

import argparse
import sys

import torch

from bench.lab.gluon_gemv_cuda_core import gemv_tma
from bench.lab.gluon_gemv_wgmma import gemv_mmb, quantize_act

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)]


def _layers(n_layers: int, dev) -> list:
    from pdserve.kernels.fp8_scales import FP8_DTYPE
    out = []
    for _ in range(n_layers):
        layer = []
        for _name, N, K in SHAPES:
            w = (torch.randn(N, K, device=dev) * 64).clamp(-448, 448).to(FP8_DTYPE)
            s = (torch.rand(N // 128, K // 128, device=dev) + 0.5) / (64 * K ** 0.5)
            x = torch.randn(K, device=dev, dtype=torch.bfloat16)
            layer.append((w, s, x, torch.empty(N, device=dev, dtype=torch.bfloat16)))
        out.append(layer)
    return out


def _graph_us(fn) -> float:
    from triton.testing import do_bench_cudagraph
    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=100) * 1e3


def _mmb_variant(v: str, layers: list, sms: int, nbytes: int, n_layers: int) -> dict:
    """"mmb-Sq-So-Sg-Sd-STAGES-PER_SM[-REGS][-a]": the tensor-core GEMV, K splits per shape (q/k/v, o,
    gate_up, down). Activations quantized beforehand (untimed); times the GEMVs alone (their
    fp32 partials over the K splits are left for the next kernel to add)."""
    from pdserve.kernels.reference import fp8_dequant_ref
    fields = v.split("-")[1:]
    nums = [int(t) for t in fields if t.isdigit()]
    flags = {t for t in fields if not t.isdigit()}
    atomic, early = "a" in flags, "e" in flags
    group = 4 if "q" in flags else 2 if "p" in flags else 1
    splits, (stages, per_sm), regs = nums[:4], nums[4:6], (nums[6:] or [128])[0]
    grid = sms * per_sm
    try:
        calls = []
        for layer in layers:
            row = []
            for (w, s, x, _y), split in zip(layer, splits):
                xq, sx = quantize_act(x)
                part = torch.zeros(1 if atomic else split, w.shape[0], device=w.device,
                                   dtype=torch.float32)
                row.append((xq, sx, w, s, part, split))
            calls.append(row)
        errs = {}
        for (xq, sx, w, s, part, split), (name, _n, _k) in zip(calls[0], SHAPES):
            gemv_mmb(xq, sx, w, s, part, grid, split, stages, atomic, regs, group, early)
            wd = fp8_dequant_ref(w, s, (128, 128)).float()
            xd = (xq.float().view(-1, 128) * sx[:, None]).view(-1)
            got = part.sum(0)
            ref_q = wd @ xd
            ref = wd @ layers[0][[n for n, _, _ in SHAPES].index(name)][2].float()
            errs[name] = [round(float((got - ref_q).norm() / ref_q.norm()), 6),
                          round(float((got - ref).norm() / ref.norm()), 6)]

        def chain(idx=None):
            for row in calls:
                for i, (xq, sx, w, s, part, split) in enumerate(row):
                    if idx is None or i == idx:
                        gemv_mmb(xq, sx, w, s, part, grid, split, stages, atomic, regs, group, early)
        us = _graph_us(chain) / n_layers
        return {"us_per_layer": round(us, 2), "TBps": round(nbytes / us / 1e6, 3),
                "rel_err_vs_quantized_act_and_vs_bf16_act": errs,
                "us_alone": {name: round(_graph_us(lambda i=i: chain(i)) / n_layers, 2)
                             for i, (name, _n, _k) in enumerate(SHAPES)}}
    except Exception as exc:  # noqa: BLE001 - a probe records what failed and goes on
        return {"error": f"{type(exc).__name__}: {exc}"[:800]}


def _swab_variant(v: str, layers: list, sms: int, nbytes: int, n_layers: int) -> dict:
    """"swab-RING_KB[-REGS[-PER_SM[-STAGE_BYTES]]][-n]": the swapped tensor-core GEMV (weights as
    B, whole rows per CTA, bf16 y; -n: the next launch let go after the PDL wait, not before).
    Activations quantized beforehand (untimed), as for mmb."""
    from pdserve.kernels.reference import fp8_dequant_ref

    from bench.lab.gluon_gemv_swab import gemv_swab, swab_tile
    fields = v.split("-")[1:]
    nums = [int(t) for t in fields if t.isdigit()]
    ring_kb, regs, per_sm, stage_bytes = nums + [64, 128, 2, 8192][len(nums):]
    early = "n" not in fields
    try:
        calls = [[(*quantize_act(x), w, s, y) for (w, s, x, y) in layer] for layer in layers]
        errs, tiles = {}, {}
        for (xq, sx, w, s, y), (name, N, K) in zip(calls[0], SHAPES):
            gemv_swab(xq, sx, w, s, y, sms, ring_kb, regs, early, per_sm, stage_bytes)
            wd = fp8_dequant_ref(w, s, (128, 128)).float()
            xd = (xq.float().view(-1, 128) * sx[:, None]).view(-1)
            ref_q = wd @ xd
            errs[name] = round(float((y.float() - ref_q).norm() / ref_q.norm()), 6)
            tiles[name] = swab_tile(N, K, sms, per_sm, stage_bytes)

        def chain(idx=None):
            for row in calls:
                for i, (xq, sx, w, s, y) in enumerate(row):
                    if idx is None or i == idx:
                        gemv_swab(xq, sx, w, s, y, sms, ring_kb, regs, early, per_sm,
                                  stage_bytes)
        us = _graph_us(chain) / n_layers
        return {"us_per_layer": round(us, 2), "TBps": round(nbytes / us / 1e6, 3),
                "rel_err_vs_quantized_act": errs, "bn_gps": tiles,
                "us_alone": {name: round(_graph_us(lambda i=i: chain(i)) / n_layers, 2)
                             for i, (name, _n, _k) in enumerate(SHAPES)}}
    except Exception as exc:  # noqa: BLE001 - a probe records what failed and goes on
        return {"error": f"{type(exc).__name__}: {exc}"[-1500:]}


def _once(shape: str, variant: str) -> None:
    """Shape's kernel, a few launches: "triton" or a variant of main's --variants."""
    from pdserve.kernels.ops import gemv
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    (w, s, x, y), = [lay for n, lay in zip([n for n, _, _ in SHAPES], _layers(1, dev)[0])
                     if n == shape]
    for _ in range(3):
        if variant == "triton":
            gemv(x[None], w, "none", scales=s, block=(128, 128))
        else:
            parts = variant.split("x")
            bn, bk, stages, per_sm, warps = (int(t) for t in parts[:5])
            regs = int(parts[6]) if len(parts) > 6 else 128
            gemv_tma(x, w, s, y, sms * per_sm, bn, bk, stages, warps, parts[5], regs)
    torch.cuda.synchronize()


def main() -> None:
    from pdserve.kernels.gemv_configs import pick_config
    from pdserve.kernels.ops import gemv
    from pdserve.kernels.reference import fp8_dequant_ref

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--variants", default="16x256x4x2x4,16x256x6x2x8,32x256x4x2x4,"
                    "32x256x4x2x8,32x256x6x1x8,64x256x3x1x8,16x256x4x3x4,16x256x8x1x8")
    ap.add_argument("--out", default=None)
    ap.add_argument("--once", default=None, metavar="SHAPE:VARIANT",
                    help="run one kernel a few times, no graph (a target for ncu), and exit")
    args = ap.parse_args()
    if args.once:
        _once(*args.once.split(":"))
        return
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    layers = _layers(args.layers, dev)
    nbytes = sum(N * K for _n, N, K in SHAPES)
    out: dict = {"what": __doc__.split("\n")[0], "layers": args.layers, "sms": sms,
                 "bytes_per_layer": nbytes, "variants": {}}

    def triton_chain():
        for layer in layers:
            for w, s, x, _y in layer:
                gemv(x[None], w, "none", scales=s, block=(128, 128))
    us = _graph_us(triton_chain) / args.layers
    out["triton_one_row"] = {"us_per_layer": round(us, 2), "TBps": round(nbytes / us / 1e6, 3),
                             "us_alone": {n: round(_graph_us(lambda i=i: [gemv(
                                 lay[i][2][None], lay[i][0], "none", scales=lay[i][1],
                                 block=(128, 128)) for lay in layers]) / args.layers, 2)
                                 for i, (n, _, _) in enumerate(SHAPES)}}
    print("triton", out["triton_one_row"], file=sys.stderr, flush=True)
    cfgs = {n: pick_config(N, K, 1, 1, None, dev) for n, N, K in SHAPES}
    out["triton_tiles"] = {n: [c.block_n, c.block_k, c.num_warps] for n, c in cfgs.items()}

    w, s, x, y = layers[0][2]
    ref = (fp8_dequant_ref(w, s, (128, 128)).float() @ x.float())
    for v in args.variants.split(","):
        if v.startswith("swab"):
            out["variants"][v] = _swab_variant(v, layers, sms, nbytes, args.layers)
            print(v, out["variants"][v], file=sys.stderr, flush=True)
            continue
        if v.startswith("mmb"):
            out["variants"][v] = _mmb_variant(v, layers, sms, nbytes, args.layers)
            print(v, out["variants"][v], file=sys.stderr, flush=True)
            continue
        parts = v.split("x")
        bn, bk, stages, per_sm, warps = (int(t) for t in parts[:5])
        ws = parts[5] if len(parts) > 5 else ""
        regs = int(parts[6]) if len(parts) > 6 else 128
        try:
            gemv_tma(x, w, s, y, sms * per_sm, bn, bk, stages, warps, ws, regs)
            err = float((y.float() - ref).norm() / ref.norm())

            def chain(bn=bn, bk=bk, stages=stages, per_sm=per_sm, warps=warps, ws=ws,
                      regs=regs):
                for layer in layers:
                    for w, s, x, y in layer:
                        gemv_tma(x, w, s, y, sms * per_sm, bn, bk, stages, warps, ws, regs)
            us = _graph_us(chain) / args.layers
            row = {"us_per_layer": round(us, 2), "TBps": round(nbytes / us / 1e6, 3),
                   "rel_err": err}
            per = {}
            for i, (name, _n, _k) in enumerate(SHAPES):
                per[name] = round(_graph_us(lambda i=i: [gemv_tma(
                    lay[i][2], lay[i][0], lay[i][1], lay[i][3], sms * per_sm, bn, bk, stages,
                    warps, ws, regs) for lay in layers]) / args.layers, 2)  # noqa: B023
            row["us_alone"] = per
        except Exception as exc:  # noqa: BLE001 - a probe records what failed and goes on
            row = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        out["variants"][v] = row
        print(v, row, file=sys.stderr, flush=True)
    from bench.lab.probe_fp8_vec import write_result
    write_result(out, "bench.lab.probe_fp8_gluon", args.out)


if __name__ == "__main__":
    main()
