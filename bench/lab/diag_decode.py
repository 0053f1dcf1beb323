"""Where a batch-1 decode step's time goes, per kernel of a layer, for GEMV variants (GPU).

    python -m bench.lab.diag_decode [--preset qwen3-30b-a3b] [--quantization fp8]
        [--variants preload,o_8x2k] [--rounds 7] [--no-engine] [--out F.json]

Builds the preset's engine (default Qwen3-8B's shape; random weights, Triton, CUDA graphs),
captures the batch-1 decode graph once per variant (VARIANTS: one-row GEMV and expert GEMV
tiles and options), times the variants round-robin (the replay with the LM head and argmax,
median of the rounds' medians) and, for Qwen3-8B, reports the critical path by kernel
position in the layer (qkv, attn, o, gate_up, down): the wall time by which each pushed the
end of the step. Last (without --no-engine), the engine's own decode loop with overlapped
decode off and on. Prints a table; writes JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter

import torch

import pdserve.kernels.decode_attention as attn_mod
import pdserve.kernels.fp8_gemv_tc  # noqa: F401  (tc_mod below)
import pdserve.kernels.gemv  # noqa: F401  (kernels/__init__ exports the function under this name)
import pdserve.kernels.moe_gemv as moe_gemv
from pdserve.engine.exec.cuda_graphs import DecodeGraphs
from pdserve.engine.llm import build_engine

from bench.lab.bench_engine import Plan, drive, fill_static, graph_for
from bench.lab.engine_probes import random_prompts, time_ms

LAYER = ["qkv", "attn", "o", "gate_up", "down"]
# one row / 1..4 rows / tensor cores (kernels/gemv_row.py, gemv.py, fp8_gemv_tc.py)
GEMV = ("_gemv_row_kernel", "_gemv_kernel", "_fp8_gemv_tc_kernel")
# kernel name prefixes per layer position (str.startswith takes a tuple)
NAMES = {"qkv": GEMV, "attn": "_decode_kernel", "o": GEMV, "gate_up": GEMV, "down": GEMV}
QKV, O_PROJ = (6144, 4096), (4096, 4096)  # Qwen3-8B's (N, K) of q/k/v and o_proj


def critical_by_position(fn) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA
                     and not e.name.startswith(("Memcpy", "Memset"))),
                    key=lambda e: e.time_range.start)
    crit, dur = Counter(), Counter()
    pos, done = 0, events[0].time_range.start
    for e in events:
        label = "other"
        if e.name.startswith(NAMES[LAYER[pos]]):
            label, pos = LAYER[pos], (pos + 1) % len(LAYER)
        crit[label] += max(0, e.time_range.end - done) / 1e3
        dur[label] += (e.time_range.end - e.time_range.start) / 1e3
        done = max(done, e.time_range.end)
    return {"critical_ms": dict(crit), "duration_ms": dict(dur)}


gemv_mod = sys.modules["pdserve.kernels.gemv"]
ORIGINAL_PICK = gemv_mod.pick_config
ORIGINAL_PICK_MOE = moe_gemv.pick_gemv_config
tc_mod = sys.modules["pdserve.kernels.fp8_gemv_tc"]
ORIGINAL_TC_PLAN = tc_mod.tc_plan
ORIGINAL_TILES = attn_mod.decode_tiles


def kernel_footprints(cubins: str | None = None) -> list[dict]:
    """Registers, spills, shared memory and warps of every compiled decode attention and
    tensor-core GEMV specialisation: what decides how many CTAs of neighbouring PDL launches
    share an SM. cubins: a folder to write each one's cubin to (its SASS, read offline:
    cuobjdump -sass)."""
    rows = []
    for fn in (attn_mod._decode_kernel, tc_mod._fp8_gemv_tc_kernel):
        for caches in fn.device_caches.values():
            for i, kernel in enumerate(caches[0].values()):
                kernel._init_handles()
                rows.append({"kernel": fn.__name__, "n_regs": kernel.n_regs,
                             "n_spills": kernel.n_spills, "shared": kernel.metadata.shared,
                             "num_warps": kernel.metadata.num_warps})
                if cubins:
                    with open(f"{cubins}/{fn.__name__}_{i}.cubin", "wb") as f:
                        f.write(kernel.asm["cubin"])
    return rows


def kernel_trace(step) -> list[dict]:
    """Every kernel and copy of one step (graph replay, LM head, argmax) with its start and
    duration in us from the first: the gaps at each boundary, read offline."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    t0 = ev[0].time_range.start
    return [{"name": e.name[:48], "start_us": round(e.time_range.start - t0, 3),
             "dur_us": round(e.time_range.end - e.time_range.start, 3)} for e in ev]  # us


def replay_probe(g: DecodeGraphs) -> dict:
    """Host microseconds of graph.replay(), GPU idle and the same graph still running (it
    does not block: an overlapped step can queue the next replay behind the running one)."""
    a = g.graphs[1][0]
    out = {}
    for label, first, second in (("idle", None, a), ("same_in_flight", a, a)):
        times = []
        for _ in range(10):
            torch.cuda.synchronize()
            if first is not None:
                first.replay()
            t = time.perf_counter()
            second.replay()
            times.append(1e6 * (time.perf_counter() - t))
        torch.cuda.synchronize()
        out[label] = sorted(times)[len(times) // 2]
    print("replay host us:", out, flush=True)
    return out


def engine_timeline(engine, vocab: int) -> dict:
    """GPU activity over 8 decode steps of the engine itself: busy vs idle time, and the
    kernels/copies outside the decode graph (with their total durations)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from pdserve.engine.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    engine.add_request(random_prompts(1, 512, vocab, 5)[0], params)
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            engine.step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    while engine.has_unfinished():
        engine.step()
    ev = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    busy, idle, end = 0.0, [], ev[0].time_range.start
    for e in ev:
        if e.time_range.start > end:
            idle.append((e.time_range.start - end) / 1e3)
        busy += max(0, e.time_range.end - max(end, e.time_range.start)) / 1e3
        end = max(end, e.time_range.end)
    span = (ev[-1].time_range.end - ev[0].time_range.start) / 1e3
    layer = set(NAMES.values())
    extra = Counter()
    for e in ev:
        if not any(e.name.startswith(n) for n in layer):
            extra[e.name[:60]] += (e.time_range.end - e.time_range.start) / 1e3
    host = Counter()
    for e in prof.events():
        if e.device_type == DeviceType.CPU and e.name.startswith(("cuda", "aten::")):
            host[e.name[:40]] += e.cpu_time_total / 1e3
    out = {"steps": 8, "wall_ms": 1e3 * wall, "gpu_span_ms": span, "gpu_busy_ms": busy,
           "idle_gaps_ms_top": sorted(idle, reverse=True)[:12], "idle_total_ms": sum(idle),
           "non_layer_kernels_ms": dict(extra.most_common(15)),
           "host_top_ms": dict(host.most_common(12))}
    print(json.dumps(out, indent=1), flush=True)
    return out


# whether the variant being captured takes the tensor-core FP8 GEMV where the model fits it
# (Model.use_tc_gemv; set by a variant's setup, read by capture)
TC = {"on": True, "merge": True}
# whether the variant's graphs include the short-context one (DecodeGraphs.short_context)
SHORT = {"on": True}


def variant(name: str, tiles: dict | None = None, splits: int | None = None,
            every: dict | None = None, moe: dict | None = None, tc: bool = True,
            tc_plans: dict | None = None, attn: dict | None = None, short: bool = True,
            merge: bool = True):
    """A configuration to measure: GemvConfig fields to override per (N, K) of a projection
    (batch 1), or for every batch-1 projection (`every`), GemvMoeConfig fields of the expert
    GEMVs (`moe`), the decode attention's split count (None: the kernel's own choice), and
    whether block-FP8 models take the tensor-core GEMV (kernels/fp8_gemv_tc.py), with TcPlan
    fields to override per (N, K) (`tc_plans`), DecodeTiles fields of the decode
    attention (`attn`), and whether o_proj merges the attention's splits (`merge`,
    Model.use_tc_gemv's merge; off: the attention's last split merges them)."""
    import dataclasses

    def pick(N: int, K: int, T: int, *args, **kwargs):
        cfg = ORIGINAL_PICK(N, K, T, *args, **kwargs)
        if T != 1:
            return cfg
        return dataclasses.replace(cfg, **(every or {}), **(tiles or {}).get((N, K), {}))

    def pick_moe(*args, **kwargs):
        return dataclasses.replace(ORIGINAL_PICK_MOE(*args, **kwargs), **(moe or {}))

    def plan(N: int, K: int, sms: int, *args, **kwargs):
        return dataclasses.replace(ORIGINAL_TC_PLAN(N, K, sms, *args, **kwargs),
                                   **(tc_plans or {}).get((N, K), {}))

    def attn_tiles(*args, **kwargs):
        return dataclasses.replace(ORIGINAL_TILES(*args, **kwargs), **(attn or {}))

    def setup() -> None:
        attn_mod.decode_tiles = attn_tiles
        gemv_mod.pick_config = pick
        moe_gemv.pick_gemv_config = pick_moe
        tc_mod.tc_plan = plan
        TC["on"] = tc
        SHORT["on"] = short
        TC["merge"] = merge
    return name, setup, splits


def tile(block_n: int, block_k: int, num_warps: int) -> dict:
    return {"block_n": block_n, "block_k": block_k, "num_warps": num_warps}


QKV_MOE, O_MOE = (5120, 2048), (2048, 4096)  # Qwen3-30B-A3B's
GATE_UP, DOWN, LM_HEAD = (24576, 4096), (4096, 12288), (151936, 4096)  # Qwen3-8B's
SHAPES = (QKV, O_PROJ, GATE_UP, DOWN, LM_HEAD)
VARIANTS = [variant("no_tc", tc=False),  # FP8: the one-row Triton GEMVs at batch 1
            # the whole table's graph at every context (DecodeGraphs.short_context 0)
            variant("no_short", short=False),
            # the attention merges its own splits (last to arrive), o_proj loads the result
            variant("no_merge", merge=False),
            # o_proj in 4 K splits (8 heads a CTA) with the merge; in 8 without it
            variant("merge_s4", tc_plans={O_PROJ: {"split": 4}}),
            variant("no_merge_s8", merge=False, tc_plans={O_PROJ: {"split": 8}}),
            # K splits per projection other than tc_plan's (q/k/v 8, gate_up 4, down 12)
            variant("qkv_s4", tc_plans={QKV: {"split": 4}}),
            variant("gu_s8", tc_plans={GATE_UP: {"split": 8}}),
            variant("gu_s2", tc_plans={GATE_UP: {"split": 2}}),
            variant("dn_s6", tc_plans={DOWN: {"split": 6}}),
            # the tensor-core GEMV's plans (kernels/fp8_gemv_tc.py TcPlan): o_proj's ring
            # filled only after the attention (which it slowed), ring depths, registers (96:
            # o_proj's and gate_up's CTAs fit an SM together)
            variant("tc_o_nopre", tc_plans={O_PROJ: {"prefill": 0}}),
            # part of a ring filled before the PDL wait: less traffic beside the launch before
            *[variant(f"tc_{name}_pre{k}", tc_plans={shape: {"prefill": k}})
              for name, shape in (("o", O_PROJ), ("gu", GATE_UP), ("qkv", QKV), ("dn", DOWN))
              for k in (2, 4)],
            *[variant(f"tc_o_pre{k}", tc_plans={O_PROJ: {"prefill": k}}) for k in (3, 5, 6)],
            variant("tc_o4_qkv4", tc_plans={O_PROJ: {"prefill": 4}, QKV: {"prefill": 4}}),
            variant("tc_o_full", tc_plans={O_PROJ: {"prefill": None}}),  # before light_prefill
            # the attention and o_proj's CTAs sharing SMs (fewer registers each)
            variant("attn_r96", attn={"max_regs": 96}),
            variant("attn_r96_o64", attn={"max_regs": 96}, tc_plans={O_PROJ: {"maxnreg": 64}}),
            variant("attn_r80_o64", attn={"max_regs": 80}, tc_plans={O_PROJ: {"maxnreg": 64}}),
            variant("o64", tc_plans={O_PROJ: {"maxnreg": 64}}),
            variant("split16", splits=16),
            variant("split64", splits=64),
            variant("split8", splits=8),
            # the decode attention's key loop at long contexts (tiles ahead, tile size)
            variant("attn_st3", attn={"num_stages": 3}),
            variant("attn_st4", attn={"num_stages": 4}),
            variant("attn_bn128", attn={"block_n": 128}),
            variant("attn_bn32", attn={"block_n": 32}),
            variant("attn_w4", attn={"num_warps": 4}),
            variant("split16_o64", splits=16, tc_plans={O_PROJ: {"maxnreg": 64}}),
            # every tensor-core GEMV's CTA at half the registers (and a shorter ring), so that
            # the next launch's CTAs fit beside it and fill their rings while it streams
            *[variant(f"tc_r64_s{st}{'_split16' if sp else ''}", splits=sp,
                      tc_plans={s: {"maxnreg": 64, **({"stages": st} if st else {})}
                                for s in (QKV, O_PROJ, GATE_UP, DOWN)})
              for st in (0, 8, 6) for sp in (None, 16)],
            variant("tc_s6", tc_plans={s: {"stages": 6} for s in (QKV, O_PROJ, GATE_UP, DOWN)}),
            # one CTA per SM (grid 132) for a projection: the next kernel's CTAs (the
            # attention's after q/k/v) fit beside it and start before it ends
            variant("tc_qkv_g132", tc_plans={QKV: {"grid": 132, "split": 4, "stages": 12}}),
            variant("tc_gu_g132", tc_plans={GATE_UP: {"grid": 132, "split": 4, "stages": 16}}),
            variant("tc_dn_g132", tc_plans={DOWN: {"grid": 132, "split": 6, "stages": 16}}),
            variant("tc_mlp_g132", tc_plans={GATE_UP: {"grid": 132, "split": 4, "stages": 16},
                                             DOWN: {"grid": 132, "split": 6, "stages": 16}}),
            variant("tc_qkv_dn_g132", tc_plans={QKV: {"grid": 132, "split": 4, "stages": 12},
                                                DOWN: {"grid": 132, "split": 6, "stages": 16}}),
            variant("tc_o_s4", tc_plans={O_PROJ: {"stages": 4}}),
            variant("tc_mlp_s8", tc_plans={GATE_UP: {"stages": 8}, DOWN: {"stages": 8}}),
            variant("tc_qkv_s12", tc_plans={QKV: {"stages": 12}}),
            variant("tc_r96", tc_plans={s: {"maxnreg": 96} for s in (QKV, O_PROJ, GATE_UP, DOWN)}),
            variant("tc_cores", tc_plans={O_PROJ: {"stages": 4, "maxnreg": 96},
                                          GATE_UP: {"stages": 8, "maxnreg": 96}}),
            variant("no_evict", {shape: {"stream_weights": False} for shape in SHAPES}),
            # o_proj without its L2 prefetch during the attention (gemv(prefetch=True))
            variant("o_pf_off", {O_PROJ: {"l2_prefetch": 0.0}}),
            # every one-row GEMV with / without its first weight tile loaded before the wait
            variant("preload", every={"preload": True}),
            variant("no_preload", every={"preload": False}, moe={"preload_down": False}),
            # q/k/v and o_proj in one K step each (all of a program's weights preloaded)
            variant("qkv_1step", {QKV: tile(4, 4096, 8), QKV_MOE: tile(4, 2048, 4)}),
            variant("o_1step", {O_PROJ: tile(4, 4096, 8), O_MOE: tile(2, 4096, 4)}),
            variant("o_8x2k", {O_PROJ: tile(8, 2048, 8), O_MOE: tile(8, 2048, 8)}),
            # FP8 (no preload by default): preload per projection, and wider o / q/k/v tiles
            variant("pre_o", {O_PROJ: {"preload": True}}),
            variant("pre_qkv", {QKV: {"preload": True}}),
            variant("pre_mlp", {GATE_UP: {"preload": True}, DOWN: {"preload": True}}),
            variant("o_8x2k_pre", {O_PROJ: {**tile(8, 2048, 8), "preload": True}}),
            variant("qkv_8x2k", {QKV: tile(8, 2048, 8)}),
            variant("qkv_8x2k_pre", {QKV: {**tile(8, 2048, 8), "preload": True}}),
            # FP8: 16 K columns per thread (16-byte weight loads; bench.lab.probe_fp8_vec)
            variant("vec16", {s: {"vec": 16} for s in (QKV, O_PROJ, GATE_UP, DOWN)}),
            # register caps (more programs resident per SM)
            *[variant(f"reg{r}", {s: {"maxnreg": r} for s in (QKV, O_PROJ, GATE_UP, DOWN)})
              for r in (64, 56, 48)],
            variant("reg64_qkv", {QKV: {"maxnreg": 64}}),
            # FP8 preload capped at the registers of the kernel without it (64: 8 programs
            # of 4 warps per SM; uncapped the preload takes 70-72)
            variant("pre64", {**{s: {"preload": True, "maxnreg": 64}
                                 for s in (QKV, O_PROJ, GATE_UP)}, DOWN: {"preload": True}}),
            variant("pre64_nodown", {s: {"preload": True, "maxnreg": 64}
                                     for s in (QKV, O_PROJ, GATE_UP)}),
            variant("pre64_qkv_gu", {s: {"preload": True, "maxnreg": 64} for s in (QKV, GATE_UP)}),
            variant("pre64_o", {O_PROJ: {"preload": True, "maxnreg": 64}}),
            # FP8 as before the capped preload (pick_config's _with_preload)
            variant("fp8_uncapped_no_preload", every={"preload": False, "maxnreg": 0}),
            # Qwen3-8B FP8 tiles with the first tile preloaded (registers capped at 64 where
            # the uncapped kernel takes more; no spills at these tiles)
            *[variant(f"f8{name}_{bn}x{bk}w{w}", {shape: {**tile(bn, bk, w), "preload": True,
                                                        "maxnreg": cap}})
              for name, shape, tiles in (
                  ("qkv", QKV, ((8, 1024, 4, 64), (4, 1024, 4, 0), (8, 2048, 8, 64))),
                  # 4 x 4096: o_proj's whole weight requested before the PDL wait, while
                  # the latency-bound attention leaves HBM idle (not yet measured)
                  ("o", O_PROJ, ((8, 1024, 4, 0), (4, 1024, 4, 0), (2, 2048, 4, 0),
                                 (4, 4096, 4, 64), (4, 4096, 8, 0))),
                  ("gu", GATE_UP, ((4, 2048, 4, 64), (4, 1024, 4, 0), (16, 1024, 8, 64))),
                  ("dn", DOWN, ((8, 1024, 4, 64), (4, 2048, 4, 64), (16, 1024, 8, 64))))
              for bn, bk, w, cap in tiles],
            variant("moe_qkv_no_preload", {QKV_MOE: {"preload": False, "maxnreg": 0}}),
            # the decode attention's split count fixed (None: its own choice per shape)
            *[variant(f"split{n}", splits=n) for n in (1, 2, 4, 8, 16)],
            variant("moe_o_no_preload", {O_MOE: {"preload": False, "maxnreg": 0}}),
            # Qwen3-8B's MLP and LM head tiles with the preload (16-bit)
            *[variant(f"{name}_{bn}x{bk}w{w}", {shape: tile(bn, bk, w)})
              for name, shape, tiles in (
                  ("gu8b", GATE_UP, ((8, 2048, 8), (16, 1024, 8), (4, 2048, 4), (8, 1024, 8))),
                  ("dn8b", DOWN, ((8, 2048, 8), (4, 4096, 8), (2, 4096, 4), (8, 1024, 4))),
                  ("lm8b", LM_HEAD, ((8, 2048, 8), (16, 1024, 8), (4, 1024, 4))))
              for bn, bk, w in tiles],
            # the expert down GEMV reads its ids and first tile before its PDL wait
            variant("down_preload", moe={"preload_down": True}),
            variant("down_no_preload", moe={"preload_down": False}),
            # expert GEMV tiles (kernels/moe_gemv.py GemvMoeConfig)
            *[variant(f"gu_{bn}x{bk}w{w}s{st}", moe={"block_n_up": bn, "block_k_up": bk,
                                                   "num_warps_up": w, "num_stages_up": st})
              for bn, bk, w, st in ((8, 1024, 4, 1), (4, 1024, 4, 1), (2, 1024, 4, 1),
                                    (4, 2048, 4, 1), (8, 2048, 8, 1), (4, 512, 4, 1),
                                    (4, 1024, 2, 1), (16, 256, 4, 1), (8, 1024, 4, 3),
                                    (4, 2048, 2, 1), (2, 2048, 2, 1), (8, 1024, 2, 1),
                                    (2, 1024, 2, 1))],
            *[variant(f"dn_{bn}x{bk}w{w}s{st}", moe={"block_n_down": bn, "block_k_down": bk,
                                                   "num_warps_down": w, "num_stages_down": st})
              for bn, bk, w, st in ((2, 256, 4, 1), (1, 256, 4, 1), (2, 128, 4, 1),
                                    (2, 512, 4, 1), (4, 256, 4, 1), (2, 256, 2, 1),
                                    (1, 512, 4, 1), (4, 128, 4, 1))],
            variant("default_again")]  # the spread between two captures of one variant


def capture(engine, setup, splits, vocab: int, context: int):
    """The batch-1 decode graph captured under a variant: (step fn, graph)."""
    runner = engine.runner
    model = runner.model
    setup()
    model.backend.num_splits = splits
    model.use_tc_gemv(TC["on"], TC["merge"])
    buffers = model.layers[0].tc  # this graph's: a later capture's use_tc_gemv makes new ones
    g = DecodeGraphs(engine.config, model, runner.kv_cache)
    g.buckets = [1]
    if not SHORT["on"]:
        g.short_context = 0
    g.capture([1])
    fill_static(g, 1, context, vocab)
    graph, hidden, _ = graph_for(g, 1, context)  # what a step replays

    def step() -> None:
        assert buffers is None or buffers.qkv.is_cuda  # held for the graph's lifetime
        graph.replay()
        model.compute_logits(hidden[:1]).argmax(-1)
    return step, g


def round_robin(engine, variants: list, vocab: int, rounds: int, by_position: bool,
                context: int = 640) -> dict:
    """Each variant's step time, the variants timed in turn `rounds` times (median of the
    rounds' medians), so that clock and thermal drift spread over all of them."""
    captured = {name: capture(engine, setup, splits, vocab, context)
                for name, setup, splits in variants}
    times: dict[str, list[float]] = {name: [] for name in captured}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, (step, _) in captured.items():
                times[name].append(time_ms(step, torch.device("cuda"), reps=30))
    results = {}
    for name, (_, g) in captured.items():
        ms = sorted(times[name])[len(times[name]) // 2]
        crit = critical_by_position(g.graphs[1][0].replay) if by_position else {}
        results[name] = {"step_ms": ms, "rounds_ms": times[name], **crit}
        print(f"{name:14s} {ms:.4f} ms  rounds " + " ".join(f"{t:.4f}" for t in times[name])
              + "  " + " ".join(f"{k}={v:.3f}" for k, v in
                                sorted(crit.get("critical_ms", {}).items())), flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="the default tiles only")
    ap.add_argument("--variants", default="", help="only these VARIANTS (comma-separated)")
    ap.add_argument("--preset", default=Plan().preset)
    ap.add_argument("--quantization", default=None, choices=(None, "fp8"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--context", type=int, default=640, help="tokens in the sequence's KV")
    ap.add_argument("--cubins", default=None, help="write every specialisation's cubin here")
    ap.add_argument("--trace", action="store_true",
                    help="save every kernel of one default step (kernel_trace)")
    ap.add_argument("--no-engine", action="store_true",
                    help="skip the engine-loop measurements after the variants")
    args = ap.parse_args()
    plan = Plan()
    engine = build_engine(args.preset, device="cuda", dtype="bfloat16", num_blocks=2048,
                          block_size=16, max_num_seqs=4, max_model_len=plan.max_model_len,
                          enable_prefix_caching=False, use_triton=True, use_cuda_graphs=True,
                          quantization=args.quantization)
    runner = engine.runner
    model, vocab = runner.model, engine.config.model.vocab_size
    drive(engine, random_prompts(1, 700, vocab, 0), 4)  # real KV in the first blocks
    only = set(filter(None, args.variants.split(",")))
    variants = [variant("default")] + ([] if args.quick else
                                       [v for v in VARIANTS if not only or v[0] in only])
    # the by-position table knows Qwen3-8B's five kernels per layer only
    results = round_robin(engine, variants, vocab, args.rounds,
                          by_position=args.preset == Plan().preset, context=args.context)
    if args.trace:
        with torch.inference_mode():
            results["trace"] = kernel_trace(capture(engine, variants[0][1], variants[0][2],
                                                    vocab, args.context)[0])
    results["footprints"] = kernel_footprints(args.cubins)
    print(json.dumps(results["footprints"]), flush=True)
    if args.no_engine:
        return finish(results, args)
    best = min(variants, key=lambda v: results[v[0]]["step_ms"])
    # the engine loop with the best variant's graphs: overlapped decode off / on
    name, setup, splits = best
    setup()
    model.backend.num_splits = splits
    ahead = runner.ahead
    for label, a in (("overlap_off", None), ("overlap_on", ahead)):
        g = DecodeGraphs(engine.config, model, runner.kv_cache)
        g.capture([1, 2])
        g.buckets = [1, 2]
        runner.cuda_graphs = g
        runner.ahead = a
        if a is not None:
            a.graphs = g
        drive(engine, random_prompts(1, 512, vocab, 1), 8)
        steps = drive(engine, random_prompts(1, 512, vocab, 2), 257)
        dec = [s for s in steps if s["decode"]]
        tok_s = sum(s["tokens"] for s in dec) / sum(s["s"] for s in dec)
        results[label] = {"variant": name, "tok_s": tok_s}
        print(f"{label}: {tok_s:.1f} tok/s ({name})", flush=True)
    results["replay_host_us"] = replay_probe(g)
    results["engine_timeline"] = engine_timeline(engine, vocab)
    finish(results, args)


def finish(results: dict, args: argparse.Namespace) -> None:
    results["device"] = torch.cuda.get_device_name()
    results["command"] = "PYTHONPATH=. python3 -m bench.lab.diag_decode " + " ".join(sys.argv[1:])
    results["date"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    if args.out:
        json.dump(results, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
