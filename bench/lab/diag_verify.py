"""MTP verify steps (2..4 rows per layer GEMV): CUDA-core kernel with the prologue fused vs the
tensor-core kernel with the prologue as its own kernel (GPU).

    python -m bench.lab.diag_verify [--out F.json] [--ks 1,3]

Part 1 times every Qwen3-8B projection at T = 1..4 rows as the model calls it (norm prologue
without residual, residual-add epilogues on o/down) for the tensor-core path and a grid of
CUDA-core tiles (CUDA graph replays over enough weight copies to defeat L2). Part 2 runs the
forced-acceptance batch-1 ceiling of bench_mtp per tile variant (VARIANTS), alternating, so the
JSON shows what a verify step gains in the model and how much repeats of one variant differ.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time

import torch

import pdserve.kernels.gemv  # noqa: F401
from pdserve.engine.model.decoder import DecoderLayer

from bench.lab.bench_gemv import SHAPES, _graph_us, _setup
from bench.lab.kernel_bench import emit

gemv_mod = sys.modules["pdserve.kernels.gemv"]
ORIGINAL_PICK = gemv_mod.pick_config
ORIGINAL_LAYER = DecoderLayer._forward_gemv


def _call(ws, x, add, nw, prologue: str, cfg) -> float:
    gemv = gemv_mod.gemv
    if prologue == "norm":
        fn = lambda: [gemv(x, w, "norm", None, nw, 1e-6, config=cfg) for w in ws]  # noqa: E731
    else:
        fn = lambda: [gemv(x, w, prologue, add=add, config=cfg) for w in ws]  # noqa: E731
    return _graph_us(fn, len(ws))


def _cuda_core_grid(T: int) -> list:
    tp = 1 << (T - 1).bit_length()
    out = []
    for bn, bk, w in itertools.product((1, 2, 4, 8), (512, 1024), (4, 8)):
        if tp * bn * bk <= 128 * 32 * w and bn * bk >= 1024:
            out.append(gemv_mod.GemvConfig(bn, bk, w, 1))
    return out


def sweep(rows: list[int]) -> tuple[list[dict], dict]:
    results, best = [], {}
    for name, N, K, prologue in SHAPES:
        for T in rows:
            ws, x, _, nw = _setup(N, K, T, prologue)
            add = None if prologue == "norm" else torch.randn(T, N, device="cuda",
                                                             dtype=torch.bfloat16)
            nbytes = N * K * 2
            timed = []
            if T > 1:
                dot = ORIGINAL_PICK(N, K, T)
                timed.append((_call(ws, x, add, nw, prologue, dot), dot))
            for cfg in _cuda_core_grid(T):
                if -(-N // cfg.block_n) >= 132:
                    timed.append((_call(ws, x, add, nw, prologue, cfg), cfg))
            timed.sort(key=lambda r: r[0])
            us, cfg = timed[0]
            dot_us = next((u for u, c in timed if c.tensor_cores), None)
            row = {"name": name, "N": N, "K": K, "T": T, "best": vars(cfg) | {
                "us": round(us, 2), "GBps": round(nbytes / us / 1e3)},
                "tensor_core_us": dot_us and round(dot_us, 2),
                "top5": [vars(c) | {"us": round(u, 2)} for u, c in timed[:5]]}
            results.append(row)
            best[(N, K, T)] = cfg
            print(f"T={T} {name:12s} best {us:7.2f} us {nbytes / us / 1e3:5.0f} GB/s "
                  f"{'TC' if cfg.tensor_cores else 'CC'} bn={cfg.block_n} bk={cfg.block_k} "
                  f"w={cfg.num_warps}; tensor-core path {dot_us}", flush=True)
            del ws
            torch.cuda.empty_cache()
    return results, best


def _cc(only: tuple[tuple[int, int], ...] | None = None):
    """pick_config with the CUDA-core kernel (prologue fused) at 2 rows, for every matrix or
    only the (N, K) in `only`."""
    def pick(N: int, K: int, T: int, elem_size: int = 2, prefetch: bool = False):
        if T == 2 and (only is None or (N, K) in only):
            return gemv_mod.GemvConfig(4 if N * K < (32 << 20) else 8, 512, 4, 1)
        return ORIGINAL_PICK(N, K, T, elem_size, prefetch)
    return pick


def _dot_before_split(N: int, K: int, T: int, elem_size: int = 2, prefetch: bool = False):
    """pick_config with the tensor-core tiles of 2026-11-23 (32/16 columns, no K split)."""
    if T == 1:
        return ORIGINAL_PICK(N, K, T, elem_size, prefetch)
    return gemv_mod.GemvConfig(32 if -(-N // 32) >= 132 else 16,
                               min(256, 1 << (K - 1).bit_length()), 4, 4, tensor_cores=True)


def _without_small_kernels(self, x, residual, cos, sin, meta, kv_cache):
    """TIMING ONLY (wrong numbers; forced acceptance hides it): the 2+-row layer without its
    two norm kernels and the SiLU-and-mul kernel, the most that fusing them could save."""
    gemv = gemv_mod.gemv
    if x.shape[0] == 1:
        return ORIGINAL_LAYER(self, x, residual, cos, sin, meta, kv_cache)
    attn, mlp = self.self_attn, self.mlp
    h = x if residual is None else x + residual
    qkv = gemv(h, attn.qkv_proj.weight)
    h = gemv(attn.attend_qkv(qkv, cos, sin, meta, kv_cache), attn.o_proj.weight, add=h)
    gate_up = gemv(h, mlp.gate_up_proj.weight)
    return gemv(gate_up[:, :gate_up.shape[1] // 2], mlp.down_proj.weight, add=h), None


def _l2(shares: dict[tuple[int, int], float], rows: tuple[int, ...] = (1, 2, 3, 4)):
    """pick_config with the L2 prefetch share set per (N, K) at these row counts."""
    def pick(N: int, K: int, T: int, elem_size: int = 2, prefetch: bool = False):
        cfg = ORIGINAL_PICK(N, K, T, elem_size, prefetch)
        if (N, K) in shares and T in rows:
            cfg = dataclasses.replace(cfg, l2_prefetch=shares[(N, K)])
        return cfg
    return pick


def _tiles(tiles: dict[tuple[int, int], gemv_mod.GemvConfig]):
    """pick_config with these tensor-core tiles per (N, K) at 2+ rows (occupancy experiments:
    fewer stages / narrower tiles let a waiting PDL dependent share an SM with the running
    GEMV, which a 160 KB-shared-memory gate_up tile does not)."""
    def pick(N: int, K: int, T: int, elem_size: int = 2, prefetch: bool = False):
        cfg = ORIGINAL_PICK(N, K, T, elem_size, prefetch)
        if T > 1 and (N, K) in tiles:
            cfg = dataclasses.replace(tiles[(N, K)], l2_prefetch=cfg.l2_prefetch)
        return cfg
    return pick


def _tc(block_n: int, block_k: int, stages: int, split: int = 1) -> gemv_mod.GemvConfig:
    return gemv_mod.GemvConfig(block_n, block_k, 4, stages, tensor_cores=True, split_k=split)


QKV, GATE_UP, DOWN = (6144, 4096), (24576, 4096), (4096, 12288)  # Qwen3-8B (N, K)
O_PROJ, LM_HEAD, EH_PROJ = (4096, 4096), (151936, 4096), (4096, 8192)
LAYER_FORWARDS = {"no_small_kernels": _without_small_kernels}  # DecoderLayer._forward_gemv
VARIANTS = {"default": ORIGINAL_PICK, "no_small_kernels": ORIGINAL_PICK,
            # L2 prefetch before a PDL wait for the verify GEMVs behind the small norm / SiLU
            # kernels; the two LM heads (behind the final norms) and eh_proj (behind the
            # enorm / hnorm kernels)
            "small_pf": _l2({QKV: 1 / 16, GATE_UP: 1 / 16, DOWN: 1 / 8}, (2, 3, 4)),
            "head_pf": _l2({LM_HEAD: 1 / 32, EH_PROJ: 1 / 8}),
            # o_proj without its L2 prefetch during the attention
            "o_pf_off": _l2({O_PROJ: 0.0}),
            "dot_before_split": _dot_before_split, "cc_qkv_down": _cc((QKV, DOWN)),
            "cc_all": _cc(), "cc_norm": _cc((QKV, GATE_UP)),
            "cc_norm_down": _cc((QKV, GATE_UP, DOWN)),
            "gu_n32": _tiles({GATE_UP: _tc(32, 256, 4)}),
            "gu_k128": _tiles({GATE_UP: _tc(64, 128, 4)}),
            "gu_s3": _tiles({GATE_UP: _tc(64, 256, 3)}),
            "qkv_n16": _tiles({QKV: _tc(16, 256, 4)}),
            "qkv_split2": _tiles({QKV: _tc(32, 128, 4, 2)}),
            "qkv_k128": _tiles({QKV: _tc(32, 128, 4)}),
            "lm_n32": _tiles({LM_HEAD: _tc(32, 256, 4)}),
            "small_smem": _tiles({GATE_UP: _tc(64, 128, 4), QKV: _tc(32, 128, 4),
                                  LM_HEAD: _tc(64, 128, 4)})}


def in_model(names: list[str], ks: list[int], repeats: int) -> dict:
    """Batch-1 forced-acceptance steps per GEMV variant, variants alternating `repeats`
    times (the spread between repeats of one variant is the noise to beat)."""
    from pdserve.engine.core.config import SpecConfig
    from pdserve.engine.model.presets import get_preset

    from bench.lab.bench_mtp import Plan, random_prompts, run_case

    plan = Plan(decode_tokens=128)
    [prompt] = random_prompts(1, plan.prompt_len, get_preset(plan.preset).vocab_size, 0)
    out: dict = {name: {} for name in names}
    for rep in range(repeats):
        for name in names:
            gemv_mod.pick_config = VARIANTS[name]
            DecoderLayer._forward_gemv = LAYER_FORWARDS.get(name, ORIGINAL_LAYER)
            for k in ks:
                spec = SpecConfig(num_speculative_tokens=k, batch_k_caps=(),
                                  forced_acceptance=True)
                r = run_case(plan, plan.preset, spec, [[prompt]], 128, f"{name} k={k} #{rep}")
                out[name].setdefault(f"k{k}_ms_per_step", []).append(round(r["ms_per_step"], 4))
    gemv_mod.pick_config = ORIGINAL_PICK
    DecoderLayer._forward_gemv = ORIGINAL_LAYER
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", default="1,2,3,4")
    ap.add_argument("--ks", default="1,3")
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    t0 = time.time()
    out = {"device": torch.cuda.get_device_name(), "command": " ".join(sys.argv),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if not args.skip_sweep:
        results, best = sweep([int(t) for t in args.rows.split(",")])
        out.update(sweep=results, best={f"{n}x{k}xT{t}": dataclasses.asdict(c)
                                        for (n, k, t), c in best.items()})
    if not args.skip_model:
        out["in_model"] = in_model(args.variants.split(","),
                                   [int(k) for k in args.ks.split(",")], args.repeats)
    out["seconds"] = round(time.time() - t0, 1)
    emit(out, args.out)


if __name__ == "__main__":
    main()
