"""bench_moe's kernel sweeps (--sweep, --apply-sweep) and MoE path timings (--paths): the
decode kernels' tiles timed on this device inside CUDA graphs (one-row GEMV, router +
alignment, gate_up, down; over enough layer copies that L2 cannot serve them), the fused MoE
path checked against the torch reference, and the winners installed in the kernels'
per-device tables (see bench_moe's docstring)."""
from __future__ import annotations

import dataclasses
import json
import re
from typing import TYPE_CHECKING

import torch

from bench.lab.bench_mtp import free
from bench.lab.engine_probes import log, sync, time_ms

if TYPE_CHECKING:
    from bench.lab.bench_moe import Plan

GEMV_TILES = ((4, 1024, 4), (8, 1024, 4), (4, 2048, 4), (8, 2048, 4), (4, 2048, 8),
              (8, 2048, 8), (16, 1024, 8))
ROUTE_TILES = ((1, 2, 512, 4), (1, 2, 512, 2), (1, 2, 512, 1), (1, 2, 1024, 1),
               (1, 1, 1024, 1), (1, 1, 2048, 1), (1, 4, 512, 1), (1, 1, 2048, 2))
UP_TILES = ((32, 128, 4, 4), (16, 128, 4, 4), (16, 256, 4, 3), (32, 256, 4, 3),
            (64, 128, 4, 4), (32, 128, 8, 4))
DOWN_TILES = ((64, 128, 4, 4), (32, 128, 4, 4), (16, 128, 4, 4), (32, 256, 4, 3),
              (64, 256, 4, 3), (32, 128, 2, 4))


def graph_us(calls, dev: torch.device, reps: int = 30) -> float:
    """Median microseconds per call of a CUDA graph that runs every thunk in calls once."""
    for c in calls:  # compiles; allocates scratch before capture
        c()
    sync(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return 1e3 * time_ms(graph.replay, dev, reps=reps) / len(calls)


def _best(rows: dict) -> str:
    """The fastest tile's key (reference rows, named "..._launches", are not tiles)."""
    ok = {k: v for k, v in rows.items()
          if isinstance(v, dict) and "us" in v and not k.endswith("launches")}
    return min(ok, key=lambda k: ok[k]["us"]) if ok else ""


def _timed(rows: dict, key: str, fn) -> None:
    """rows[key] = fn() (a dict with "us"), or the error: one failing tile spoils nothing."""
    try:
        rows[key] = fn()
    except Exception as e:  # e.g. a tile beyond shared memory
        rows[key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    log(f"  {key}: {rows[key]}")


def sweep_gemv(cfg, dev: torch.device) -> dict:
    """One-row GEMV tiles at the model's attention and LM-head shapes, each over enough
    weight copies (> 4x L2) that L2 cannot serve them; error vs an fp32 matmul."""
    from dataclasses import replace as dc_replace

    from pdserve.kernels.gemv import PREFETCH_SHARE, GemvConfig, gemv, pick_config

    H, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    shapes = {"qkv": (q + 2 * cfg.num_kv_heads * cfg.head_dim, H, "norm"),
              "o": (H, q, "add"), "lm_head": (cfg.vocab_size, H, "none")}
    out = {}
    for name, (N, K, kind) in shapes.items():
        copies = min(64, max(2, -(-(200 << 20) // (2 * N * K))))
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        res, nw = torch.randn_like(x), torch.rand(K, device=dev, dtype=torch.bfloat16) + 0.5
        add = torch.randn(1, N, device=dev, dtype=torch.bfloat16)
        kw = ({"prologue": "norm", "residual": res, "norm_weight": nw} if kind == "norm" else
              {"add": add, "prefetch": True} if kind == "add" else {})
        a = x.float() + res.float() if kind == "norm" else x.float()
        if kind == "norm":
            a = a * torch.rsqrt(a.pow(2).mean() + 1e-6) * nw.float()
        ref = a @ ws[0].float().T + (add.float() if kind == "add" else 0)
        rows: dict = {"N": N, "K": K, "copies": copies,
                      "default": list(dataclasses.astuple(pick_config(N, K, 1, 2, False)))[:3]}
        for bn, bk, warps in GEMV_TILES:
            tile = GemvConfig(bn, bk, num_warps=warps)
            if kind == "add":
                tile = dc_replace(tile, l2_prefetch=PREFETCH_SHARE)

            def one(tile=tile) -> dict:
                first = gemv(x, ws[0], config=tile, **kw)
                y = first[0] if kind == "norm" else first
                err = float((y.float() - ref).norm() / ref.norm())
                us = graph_us([lambda w=w: gemv(x, w, config=tile, **kw) for w in ws], dev)
                return {"us": us, "GBps": 2 * N * K / us / 1e3, "rel_err": err}

            _timed(rows, f"{bn}x{bk}w{warps}", one)
        rows["best"] = _best(rows)
        out[name] = rows
        free(ws)
    return out


def _moe_layers(cfg, dev: torch.device, n: int = 8) -> list[dict]:
    """n MoE layers' random weights and one decode token each (distinct experts per layer)."""
    moe, H = cfg.moe, cfg.hidden_size
    E, inter = moe.num_experts, moe.intermediate_size
    bf = torch.bfloat16
    return [{"x": torch.randn(1, H, device=dev, dtype=bf),
             "router": torch.randn(E, H, device=dev) / H ** 0.5,
             "w13": torch.randn(E, 2 * inter, H, device=dev, dtype=bf) / H ** 0.5,
             "w2": torch.randn(E, H, inter, device=dev, dtype=bf) / inter ** 0.5}
            for _ in range(n)]


def sweep_route(layers: list[dict], top_k: int, dev: torch.device) -> dict:
    """Router + alignment (one launch) per router tile; the two-launch path for reference."""
    from pdserve.kernels.fused_moe import down_counters
    from pdserve.kernels.moe_gemm import pick_moe_config
    from pdserve.kernels.moe_route import RouteConfig, moe_route_align
    from pdserve.kernels.ops import moe_align, moe_route

    E, H = layers[0]["router"].shape
    mc = pick_moe_config(top_k, E, H, layers[0]["w2"].shape[2])
    zero = torch.empty(down_counters(1, H, mc), dtype=torch.int32, device=dev)
    rows: dict = {}
    _timed(rows, "route+align_2_launches", lambda: {"us": graph_us(
        [lambda l=l: moe_align(moe_route(l["x"], l["router"], top_k)[1], E, 16, zero=zero)
         for l in layers], dev)})
    for bt, be, bk, warps in ROUTE_TILES:
        rc = RouteConfig(bt, be, bk, num_warps=warps)
        _timed(rows, f"{bt}x{be}x{bk}w{warps}", lambda rc=rc: {"us": graph_us(
            [lambda l=l: moe_route_align(l["x"], l["router"], top_k, 16, zero=zero, config=rc)
             for l in layers], dev)})
    rows["best"] = _best(rows)
    return rows


def sweep_experts(layers: list[dict], top_k: int, dev: torch.device) -> dict:
    """gate_up and down alone per tile, over the layers' own blocks (16-row, one pair each)."""
    from pdserve.kernels.moe_gemm import MoeConfig, moe_down, moe_gate_up
    from pdserve.kernels.moe_route import moe_route_align

    E = layers[0]["router"].shape[0]
    for l in layers:
        l["wts"], _, l["sorted"], l["experts"], _ = moe_route_align(
            l["x"], l["router"], top_k, 16)
    up: dict = {}
    for bn, bk, warps, stages in UP_TILES:
        mc = MoeConfig(16, bn, bk, 64, 128, num_warps=warps, num_stages=stages)
        _timed(up, f"{bn}x{bk}w{warps}s{stages}", lambda mc=mc: {"us": graph_us(
            [lambda l=l: moe_gate_up(l["x"], l["w13"], l["sorted"], l["experts"], top_k, mc)
             for l in layers], dev)})
    up["best"] = _best(up)
    base = MoeConfig(16, 32, 128, 64, 128, num_warps=4, num_stages=4)
    for l in layers:
        l["act"] = moe_gate_up(l["x"], l["w13"], l["sorted"], l["experts"], top_k, base)
    down: dict = {"note": "each call also zero-fills its counters (torch.zeros)"}
    for bn, bk, warps, stages in DOWN_TILES:
        mc = MoeConfig(16, 32, 128, bn, bk, num_warps=warps, num_stages=stages)
        _timed(down, f"{bn}x{bk}w{warps}s{stages}", lambda mc=mc: {"us": graph_us(
            [lambda l=l: moe_down(l["act"], l["w2"], l["wts"], l["sorted"], l["experts"], mc)
             for l in layers], dev)})
    down["best"] = _best(down)
    return {"gate_up": up, "down": down, "experts": E}


# kernels.moe_gemv tiles (block_n, block_k, num_warps); down's programs load all top_k slots
# and num_stages. An earlier sweep (num_stages 1; moe_h200_2026-11-25_b1.json, after.
# moe_paths): bf16 gate_up 16x256w4 16.9 us, 32x256w8 17.7, 8x1024w8 18.0, 16x512w8 18.5,
# 32x128w4 25.6; down 4x128w4 10.5, 2x256w4 11.1, 8x128w8 11.2, 4x256w8 11.3, 2x512w8 12.3.
# The fastest tiles here are not always the fastest in the decode step (kernels.moe_gemv's
# pick_gemv_config): compare the engine runs too.
GEMV_UP_TILES = ((16, 256, 4, 1), (16, 256, 4, 3), (16, 128, 4, 3), (8, 256, 4, 3),
                 (16, 256, 2, 1))
GEMV_DOWN_TILES = ((4, 128, 4, 1), (4, 128, 4, 3), (4, 256, 8, 3), (2, 128, 4, 3),
                   (4, 128, 2, 1))


def _quantize_layers(layers: list[dict]) -> None:
    from pdserve.engine.model.fp8 import DEFAULT_BLOCK, quantize_blockwise
    from pdserve.kernels.fused_moe import Fp8Experts

    for l in layers:
        (l["w13"], s13), (l["w2"], s2) = (quantize_blockwise(l["w13"]),
                                          quantize_blockwise(l["w2"]))
        l["fp8"] = Fp8Experts(s13, s2, (DEFAULT_BLOCK, DEFAULT_BLOCK))


def _path_kernels(layers: list[dict], top_k: int, dev: torch.device) -> dict:
    """Per-kernel and whole-block times of the grouped tensor-core path (route + align,
    gate_up, down; the decode path before kernels.moe_gemv) and the one-row GEMV path (route,
    gate_up, down), plus GEMV tiles, and fused_moe's default path against the reference."""
    from pdserve.kernels.fused_moe import Fp8Experts, fused_moe
    from pdserve.kernels.moe_gemm import moe_down, moe_gate_up, pick_moe_config
    from pdserve.kernels.moe_gemv import GemvMoeConfig, moe_down_gemv, moe_gate_up_gemv, pick_gemv_config
    from pdserve.kernels.moe_route import moe_route, moe_route_align
    from pdserve.kernels.reference import fp8_dequant_ref, moe_experts_ref, moe_route_ref

    E, H = layers[0]["router"].shape
    w13 = layers[0]["w13"]
    inter, size = layers[0]["w2"].shape[2], w13.element_size()
    mc, gc = pick_moe_config(top_k, E, H, inter, size, dev), pick_gemv_config(E, H, inter, size)
    for l in layers:
        f = l.get("fp8") or Fp8Experts()
        l["s"] = (f.w13_scale, f.w2_scale, (f.blocks or (None, None))[0])
        l["wts"], l["ids"], l["sorted"], l["experts"], _ = moe_route_align(
            l["x"], l["router"], top_k, mc.block_m)
        l["act"] = moe_gate_up_gemv(l["x"], l["w13"], l["ids"], gc, w13_scale=l["s"][0],
                                    block=l["s"][2])

    def g(fn) -> dict:
        return {"us": graph_us([lambda l=l: fn(l) for l in layers], dev)}

    rows: dict = {"grouped_tiles": dataclasses.asdict(mc), "gemv_tiles": dataclasses.asdict(gc)}
    _timed(rows, "before_route_align", lambda: g(lambda l: moe_route_align(
        l["x"], l["router"], top_k, mc.block_m)))
    _timed(rows, "before_gate_up", lambda: g(lambda l: moe_gate_up(
        l["x"], l["w13"], l["sorted"], l["experts"], top_k, mc, w13_scale=l["s"][0],
        block=l["s"][2])))
    _timed(rows, "before_down_incl_counter_zeroing", lambda: g(lambda l: moe_down(
        l["act"], l["w2"], l["wts"], l["sorted"], l["experts"], mc, w2_scale=l["s"][1],
        block=l["s"][2])))
    _timed(rows, "after_route", lambda: g(lambda l: moe_route(l["x"], l["router"], top_k)))
    for bn, bk, w, st in GEMV_UP_TILES:
        c = GemvMoeConfig(bn, bk, gc.block_n_down, gc.block_k_down, num_warps_up=w,
                          num_stages_up=st)
        _timed(rows, f"after_gate_up_{bn}x{bk}w{w}s{st}", lambda c=c: g(lambda l: moe_gate_up_gemv(
            l["x"], l["w13"], l["ids"], c, w13_scale=l["s"][0], block=l["s"][2])))
    for bn, bk, w, st in GEMV_DOWN_TILES:
        c = GemvMoeConfig(gc.block_n_up, gc.block_k_up, bn, bk, num_warps_down=w,
                          num_stages_down=st)
        _timed(rows, f"after_down_{bn}x{bk}w{w}s{st}", lambda c=c: g(lambda l: moe_down_gemv(
            l["act"], l["w2"], l["wts"], l["ids"], c, w2_scale=l["s"][1], block=l["s"][2])))
    _timed(rows, "before_block_fused_moe_grouped", lambda: g(lambda l: fused_moe(
        l["x"], l["router"], l["w13"], l["w2"], top_k, config=mc, fp8=l.get("fp8"))))
    _timed(rows, "after_block_fused_moe_default_tiles", lambda: g(lambda l: fused_moe(
        l["x"], l["router"], l["w13"], l["w2"], top_k, fp8=l.get("fp8"))))
    best = _best_gemv(rows)
    rows["best_gemv"] = dataclasses.asdict(best)
    _timed(rows, "after_block_fused_moe_best_tiles", lambda: g(lambda l: fused_moe(
        l["x"], l["router"], l["w13"], l["w2"], top_k, config=best, fp8=l.get("fp8"))))
    l0, f0 = layers[0], layers[0].get("fp8")
    d13, d2 = ((fp8_dequant_ref(l0["w13"], f0.w13_scale, f0.blocks[0]).to(torch.bfloat16),
                fp8_dequant_ref(l0["w2"], f0.w2_scale, f0.blocks[1]).to(torch.bfloat16))
               if f0 is not None else (l0["w13"], l0["w2"]))
    wts, ids = moe_route_ref(l0["x"], l0["router"], top_k)
    ref = moe_experts_ref(l0["x"], d13, d2, wts, ids).float()
    got = fused_moe(l0["x"], l0["router"], l0["w13"], l0["w2"], top_k, fp8=f0).float()
    rows["rel_err_vs_reference"] = float((got - ref).norm() / ref.norm())
    rows["expert_bytes_per_layer"] = top_k * (w13[0].numel() + layers[0]["w2"][0].numel()) * size
    return rows


def _best_gemv(rows: dict):
    """The fastest gate_up and down GEMV tiles of _path_kernels' rows, as one config."""
    from pdserve.kernels.moe_gemv import GemvMoeConfig

    def pick(prefix: str) -> list[int]:
        ok = {k: v["us"] for k, v in rows.items() if k.startswith(prefix) and "us" in v}
        return _tile(min(ok, key=ok.get)[len(prefix):])

    (un, uk, uw, us_), (dn, dk, dw, ds) = pick("after_gate_up_"), pick("after_down_")
    return GemvMoeConfig(un, uk, dn, dk, num_warps_up=uw, num_warps_down=dw,
                         num_stages_up=us_, num_stages_down=ds)


def run_paths(plan: Plan, dev: torch.device, result: dict, save) -> None:
    """--paths: _path_kernels for bf16 experts, then the same layers quantized to FP8; the
    fastest GEMV tiles of each are installed in kernels.moe_gemv.DEVICE_TILES for the engine
    runs after (as --apply-sweep does for the other tables)."""
    from pdserve.engine.model.presets import get_preset
    from pdserve.kernels import moe_gemv

    cfg = get_preset(plan.preset)
    layers = _moe_layers(cfg, dev)
    out = result["moe_paths"] = {"method": "CUDA-graph replay of 8 layers' launches (distinct "
                                           "weights, one decode token each), median of 30"}
    moe = cfg.moe
    for kind, size in (("bf16", 2), ("fp8", 1)):
        if kind == "fp8":
            _quantize_layers(layers)
        out[kind] = rows = _path_kernels(layers, moe.top_k, dev)
        key = (moe.num_experts, cfg.hidden_size, moe.intermediate_size, size)
        try:
            moe_gemv.DEVICE_TILES.setdefault("H200", {})[key] = _best_gemv(rows)
            out.setdefault("applied", {})[str(key)] = rows["best_gemv"]
        except (KeyError, ValueError) as e:
            out[f"{kind}_apply_error"] = str(e)
        save()
    free(layers)


def _tile(key: str) -> list[int]:
    return [int(v) for v in re.findall(r"\d+", key)]


def sweep_layer(layers: list[dict], top_k: int, picks: dict, dev: torch.device) -> dict:
    """The whole routed-experts block per layer: the 4-launch path (route; align; gate_up;
    down), fused_moe as configured now, and fused_moe with the sweep's best tiles."""
    from pdserve.kernels.moe_gemm import MoeConfig
    from pdserve.kernels.moe_route import RouteConfig
    from pdserve.kernels.ops import fused_experts, fused_moe, moe_route

    def four(l: dict) -> torch.Tensor:
        wts, ids = moe_route(l["x"], l["router"], top_k)
        return fused_experts(l["x"], l["w13"], l["w2"], wts, ids)

    rows: dict = {}
    _timed(rows, "4_launches", lambda: {"us": graph_us([lambda l=l: four(l) for l in layers],
                                                       dev)})
    _timed(rows, "fused_moe", lambda: {"us": graph_us(
        [lambda l=l: fused_moe(l["x"], l["router"], l["w13"], l["w2"], top_k) for l in layers],
        dev)})
    try:
        (ub, uk, uw, us_), (db, dk, dw, ds) = _tile(picks["gate_up"]), _tile(picks["down"])
        mc = MoeConfig(16, ub, uk, db, dk, num_warps=uw, num_stages=us_, num_warps_down=dw,
                       num_stages_down=ds)
        bt, be, bk, rw = _tile(picks["route"])
        rc = RouteConfig(bt, be, bk, num_warps=rw)
    except (KeyError, ValueError) as e:
        rows["best_tiles"] = {"error": f"no complete pick: {e}"}
        return rows
    rows["best_tiles"] = {"moe": dataclasses.asdict(mc), "route": dataclasses.asdict(rc)}
    _timed(rows, "fused_moe_best_tiles", lambda: {"us": graph_us(
        [lambda l=l: fused_moe(l["x"], l["router"], l["w13"], l["w2"], top_k, config=mc,
                               route_config=rc) for l in layers], dev)})
    return rows


def check_moe(layers: list[dict], top_k: int, dev: torch.device) -> dict:
    """Correctness on the device: fused_moe against the torch reference, and the router's
    in-launch alignment against moe_route + moe_align, at decode batch sizes."""
    from pdserve.kernels.moe_route import moe_route_align
    from pdserve.kernels.ops import fused_moe, moe_align, moe_route
    from pdserve.kernels.reference import moe_experts_ref, moe_route_ref

    l0, out = layers[0], {}
    E, H = l0["router"].shape
    for T in (1, 2, 4, 8):
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        got = fused_moe(x, l0["router"], l0["w13"], l0["w2"], top_k).float()
        wts, ids = moe_route_ref(x, l0["router"], top_k)
        ref = moe_experts_ref(x, l0["w13"], l0["w2"], wts, ids).float()
        _, ids_k, *aligned = moe_route_align(x, l0["router"], top_k, 16)
        want = moe_align(moe_route(x, l0["router"], top_k)[1], E, 16)
        out[f"T{T}"] = {"rel_err": float((got - ref).norm() / ref.norm()),
                        "ids_equal_ref": bool(torch.equal(ids_k, ids)),
                        "align_equal": all(torch.equal(a, b) for a, b in zip(aligned, want))}
        log(f"  check T={T}: {out[f'T{T}']}")
    return out


SWEEP_MARGIN = 0.97  # a swept tile replaces the rule's only when >= 3% faster


def _winner(rows: dict, default_key: str) -> str | None:
    """The sweep's best tile where it beats the default tile by SWEEP_MARGIN, else None."""
    best, base = rows.get("best"), rows.get(default_key, {})
    if not best or best == default_key or "us" not in base:
        return None
    return best if rows[best]["us"] < SWEEP_MARGIN * base["us"] else None


def apply_sweep(sw: dict, cfg, dev: torch.device) -> dict:
    """Install the sweep's winners in this process's per-device tile tables (kernels.gemv,
    moe_route, moe_gemm DEVICE_TILES), so that the benchmark after the sweep runs them;
    returns what was installed: the entries the committed tables should hold."""
    from pdserve.kernels import gemv, moe_gemm, moe_route

    name = torch.cuda.get_device_name(dev)
    frag = "H200" if "H200" in name else name
    H, E, inter = cfg.hidden_size, cfg.moe.num_experts, cfg.moe.intermediate_size
    applied: dict = {"device_fragment": frag}
    for shape, rows in sw.get("gemv", {}).items():
        win = _winner(rows, "{}x{}w{}".format(*rows["default"]))
        if win:
            gemv.DEVICE_TILES.setdefault(frag, {})[(rows["N"], rows["K"])] = tuple(_tile(win))
            applied[f"gemv {shape} (N, K) = ({rows['N']}, {rows['K']})"] = _tile(win)
    rc = moe_route.pick_route_config(1, E, H)
    win = _winner(sw.get("route", {}), f"{rc.block_t}x{rc.block_e}x{rc.block_k}w{rc.num_warps}")
    if win:
        moe_route.DEVICE_TILES.setdefault(frag, {})[(E, H)] = tuple(_tile(win))
        applied[f"route (E, H) = ({E}, {H})"] = _tile(win)
    mc = moe_gemm.pick_moe_config(cfg.moe.top_k, E, H, inter)
    up = _winner(sw.get("gate_up", {}), f"{mc.block_n_up}x{mc.block_k_up}w{mc.num_warps}s"
                                        f"{mc.num_stages}")
    down = _winner(sw.get("down", {}), f"{mc.block_n_down}x{mc.block_k_down}w{mc.num_warps}s"
                                       f"{mc.num_stages}")
    if up or down:
        un, uk, uw, us_ = _tile(up) if up else (mc.block_n_up, mc.block_k_up, mc.num_warps,
                                                 mc.num_stages)
        dn, dk, dw, ds = _tile(down) if down else (mc.block_n_down, mc.block_k_down,
                                                   mc.num_warps, mc.num_stages)
        tile = moe_gemm.MoeConfig(16, un, uk, dn, dk, num_warps=uw, num_stages=us_,
                                  num_warps_down=dw, num_stages_down=ds)
        moe_gemm.DEVICE_TILES.setdefault(frag, {})[(E, H, inter)] = tile
        applied[f"moe (E, H, I) = ({E}, {H}, {inter})"] = dataclasses.asdict(tile)
    log(f"sweep tiles installed for the benchmark: {applied}")
    return applied


def run_sweep(plan: Plan, dev: torch.device, result: dict, save, apply: bool = False) -> None:
    from pdserve.engine.model.presets import get_preset

    cfg = get_preset(plan.preset)
    top_k = cfg.moe.top_k
    sw = result["sweep"] = {"method": "CUDA-graph replay of 8 layers' launches (distinct "
                                      "weights, one decode token each), median of 30 replays"}
    layers = _moe_layers(cfg, dev)
    sw["checks"] = check_moe(layers, top_k, dev)
    save()
    sw["route"] = sweep_route(layers, top_k, dev)
    sw.update(sweep_experts(layers, top_k, dev))
    picks = {"route": sw["route"]["best"], "gate_up": sw["gate_up"]["best"],
             "down": sw["down"]["best"]}
    sw["layer"] = sweep_layer(layers, top_k, picks, dev)
    save()
    free(layers)
    sw["gemv"] = sweep_gemv(cfg, dev)
    save()
    summary = {k: {"best": v.get("best"), "best_us": v.get(v.get("best"), {}).get("us")}
               for k, v in sw.items() if isinstance(v, dict) and "best" in v}
    summary.update({f"gemv_{k}": {"best": v["best"], "default": v["default"],
                                  "best_us": v.get(v["best"], {}).get("us")}
                    for k, v in sw["gemv"].items()})
    sw["summary"] = summary
    log(f"sweep summary: {json.dumps(summary)}; layer: {json.dumps(sw['layer'])}")
    if apply:
        sw["applied"] = apply_sweep(sw, cfg, dev)
        save()
