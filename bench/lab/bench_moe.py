"""MoE benchmark on one GPU (issue 21): Qwen3-30B-A3B shape with random bf16 weights, then a
GLM-4.5-Air shape cut to fewer layers with its MTP layer.

    python -m bench.lab.bench_moe --out bench/results/moe_h200_<date>.json
    python -m bench.lab.bench_moe --tiny --out /tmp/moe_tiny.json        # CPU smoke test
    python -m bench.lab.bench_moe --sweep --apply-sweep --skip reference,hf,mtp --out ...

--sweep first times the decode kernels' tiles on this device (one-row GEMV at the attention
and LM-head shapes, router + alignment, gate_up, down; each over enough copies that L2
cannot serve them) and checks the fused MoE path against the torch reference; --apply-sweep
then runs the benchmark with the tiles that beat the rules by >= 3% installed in the
kernels' per-device tables (DEVICE_TILES of kernels/gemv.py, moe_route.py, moe_gemm.py),
which is what those tables should then hold ("sweep" -> "applied" in the JSON).

In one run: the device's copy bandwidth; pdserve's fast path (Triton kernels, fused MoE,
CUDA graphs) on qwen3-30b-a3b: batch-1 decode tok/s against the roofline (the bytes one token
really reads: attention, norms, router, its top_k experts per layer and the LM head, over the
measured copy bandwidth), kernels per MoE layer per decode step, decode throughput at 64 and
256 sequences of 1K context against the bandwidth bound (the experts the step's tokens touch,
expected E(1 - (1 - k/E)^n) per layer for n tokens of uniform routing, plus the KV read), and
TTFT of a 10K-token prompt. Peers in the same run: pdserve's torch reference path and
transformers' eager generate() on the same shape. Then glm-4.5-air:Nl (the real layer shapes,
N decoder layers and the MTP layer): batch-1 forced-acceptance MTP speedup at k=1 and k=3.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import re
import sys
import time
from dataclasses import dataclass

import torch

from pdserve.kernels.triton_mode import select_triton_mode  # noqa: E402

select_triton_mode()  # first: compiled (GPU) or interpreted (CPU) Triton
from pdserve.engine.exec.cuda_graphs import DecodeGraphs
from pdserve.engine.llm import build_engine
from pdserve.engine.model.moe import MoEBlock

from bench.lab.bench_engine import (
    bench_ttft,
    device_rates,
    drive,
    fill_static,
    gpu_step_ms,
    kv_bytes_per_token,
)
from bench.lab.bench_mtp import Plan as MtpPlan
from bench.lab.bench_mtp import ceiling, free
from bench.lab.engine_probes import count_kernels, kernel_times, log, random_prompts, sync, time_ms


@dataclass(frozen=True)
class Plan:
    preset: str = "qwen3-30b-a3b"
    device: str = "cuda"
    decode_prompt: int = 512
    decode_tokens: int = 128
    ttft_lens: tuple[int, ...] = (10240,)
    ttft_reps: int = 3
    batch_sizes: tuple[int, ...] = (64, 256)
    batch_context: int = 1024
    batch_tokens: int = 32
    max_model_len: int = 12288
    max_num_batched_tokens: int = 16384
    block_size: int = 16
    copy_bytes: int = 1 << 30
    matmul_n: int = 8192
    ref_tokens: int = 12  # torch reference path: batch-1 decode tokens
    hf_tokens: int = 12
    mtp_preset: str = "glm-4.5-air:12l"
    mtp_ks: tuple[int, ...] = (1, 3)
    quantization: str | None = None  # "fp8" (--fp8): block-FP8 weights, experts included


TINY = Plan(preset="tiny-qwen3-moe", device="cpu", decode_prompt=16, decode_tokens=6,
            ttft_lens=(64,), ttft_reps=1, batch_sizes=(2, 4), batch_context=24, batch_tokens=3,
            max_model_len=256, max_num_batched_tokens=64, copy_bytes=1 << 24, matmul_n=256,
            ref_tokens=4, hf_tokens=4, mtp_preset="tiny-glm4-moe", mtp_ks=(1,))


# -- bytes a decode step reads -------------------------------------------------------------------

def moe_bytes(model) -> tuple[int, int, int]:
    """(bytes every token reads apart from routed experts, bytes of one routed expert, MoE
    layers). The untied embedding is read one row per token, so it is left out."""
    dense, expert, layers = 0, 0, 0
    for m in model.modules():
        if isinstance(m, MoEBlock):
            w13, w2 = m.experts.w13, m.experts.w2
            expert = (w13[0].numel() + w2[0].numel()) * w13.element_size()
            layers += 1
    routed = {id(p) for m in model.modules() if isinstance(m, MoEBlock)
              for p in (m.experts.w13, m.experts.w2)}
    for p in model.parameters():
        if id(p) not in routed:
            dense += p.numel() * p.element_size()
    if not model.config.tie_word_embeddings:
        emb = model.embed_tokens.weight
        dense -= emb.numel() * emb.element_size()
    return dense, expert, layers


def experts_touched(n: int, num_experts: int, top_k: int) -> float:
    """Expected distinct experts of one layer that n tokens of uniform routing touch."""
    return num_experts * (1 - (1 - top_k / num_experts) ** n)


# -- measurements --------------------------------------------------------------------------------

def batch1(engine, graphs, plan: Plan, bw: float, per_token: int) -> dict:
    vocab = engine.config.model.vocab_size
    drive(engine, random_prompts(1, plan.decode_prompt, vocab, 1), 8)  # warm-up
    steps = drive(engine, random_prompts(1, plan.decode_prompt, vocab, 2), plan.decode_tokens + 1)
    dec = [s for s in steps if s["decode"]]
    tok_s = sum(s["tokens"] for s in dec) / sum(s["s"] for s in dec)
    gpu_ms, how = gpu_step_ms(engine, graphs, 1, plan.decode_prompt + plan.decode_tokens // 2)
    roof = bw * 1e9 / per_token
    return {"tok_s": tok_s, "roofline_tok_s": roof, "pct_of_roofline": 100 * tok_s / roof,
            "gpu_only_tok_s": 1e3 / gpu_ms, "gpu_only_pct_of_roofline": 100e3 / gpu_ms / roof,
            "gpu_only_mode": how, "bytes_per_token": per_token, "target_pct": 65}


def throughput(engine, graphs, plan: Plan, bw: float, sizes: tuple[int, int, int],
               kvb: int) -> list[dict]:
    dense, expert, layers = sizes
    moe = engine.config.model.moe
    vocab = engine.config.model.vocab_size
    rows = []
    for n in plan.batch_sizes:
        pre = -(-n * plan.batch_context // plan.max_num_batched_tokens)
        steps = drive(engine, random_prompts(n, plan.batch_context, vocab, 300 + n),
                      plan.batch_tokens + pre + 1)
        full = [s for s in steps if s["decode"] and s["tokens"] == n]
        tok_s = sum(s["tokens"] for s in full) / sum(s["s"] for s in full)
        ctx = plan.batch_context + pre + plan.batch_tokens // 2
        touched = experts_touched(n, moe.num_experts, moe.top_k)
        step_bytes = dense + touched * expert * layers + n * ctx * kvb
        bound = n * bw * 1e9 / step_bytes
        gpu_ms, how = gpu_step_ms(engine, graphs, n, ctx)
        rows.append({"batch": n, "context": plan.batch_context, "tok_s": tok_s,
                     "experts_touched_per_layer": touched, "bytes_per_step": step_bytes,
                     "bound_tok_s": bound, "pct_of_bound": 100 * tok_s / bound,
                     "gpu_only_tok_s": n * 1e3 / gpu_ms, "gpu_only_mode": how})
        log(f"batch {n}: {tok_s:.0f} tok/s = {100 * tok_s / bound:.0f}% of bound {bound:.0f}")
    return rows


def kernels_per_moe_layer(engine, graphs: DecodeGraphs, plan: Plan) -> dict:
    model = engine.runner.model
    cfg, dev = model.config, graphs.device
    fill_static(graphs, 1, plan.decode_prompt, cfg.vocab_size)
    meta = graphs.meta(1)
    idx = next(i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoEBlock))
    layer = model.layers[idx]
    with torch.inference_mode():
        x = torch.randn(1, cfg.hidden_size, device=dev, dtype=model.embed_tokens.weight.dtype)
        res = torch.randn_like(x)
        cos, sin, meta = model.rope(graphs.positions[:1], meta)
        whole = count_kernels(lambda: layer(x, res, cos, sin, meta, engine.runner.kv_cache), dev)
        moe_only = count_kernels(lambda: layer.mlp(x), dev)
    out = {"layer": idx, "per_layer": whole["kernels"], "moe_block": moe_only["kernels"],
           "detail": whole, "target_per_layer": 8,
           "method": "torch.profiler CUDA kernel events of one MoE decoder layer (attention + "
                     "norms + MoE) and of its MoE block alone at batch 1, run eagerly"}
    if 1 in graphs.graphs:
        out["batch1_step_time_breakdown"] = kernel_times(graphs.graphs[1][0].replay, dev)
    return out


def run_fast(plan: Plan, dev: torch.device, bw: float, tflops: float, result: dict, save,
             skip: frozenset[str] = frozenset()) -> None:
    need = max(max(plan.batch_sizes) * (plan.batch_context + plan.batch_tokens + 64),
               max(plan.ttft_lens) + 64)
    t0 = time.perf_counter()
    engine = build_engine(
        plan.preset, device=plan.device, num_blocks=need // plan.block_size + 64,
        block_size=plan.block_size, max_num_seqs=max(plan.batch_sizes),
        max_num_batched_tokens=plan.max_num_batched_tokens, max_model_len=plan.max_model_len,
        enable_prefix_caching=False, use_triton=True, use_cuda_graphs=dev.type == "cuda",
        quantization=plan.quantization)
    runner, cfg = engine.runner, engine.config.model
    graphs = runner.cuda_graphs or DecodeGraphs(engine.config, runner.model, runner.kv_cache)
    sizes = moe_bytes(runner.model)
    dense, expert, layers = sizes
    per_token = dense + cfg.moe.top_k * expert * layers
    kvb = kv_bytes_per_token(cfg, runner.kv_cache.element_size())
    result["model"] = {"preset": plan.preset, "build_s": time.perf_counter() - t0,
                       "dense_bytes": dense, "expert_bytes": expert, "moe_layers": layers,
                       "bytes_per_token_batch1": per_token, "graph_buckets": sorted(graphs.graphs)}
    log(f"engine built in {time.perf_counter() - t0:.0f} s; {per_token / 1e9:.2f} GB per token")
    result["decode_batch1"] = b1 = batch1(engine, graphs, plan, bw, per_token)
    log(f"batch 1: {b1['tok_s']:.1f} tok/s = {b1['pct_of_roofline']:.0f}% of {b1['roofline_tok_s']:.0f}")
    save()
    result["kernels_per_moe_layer"] = kernels_per_moe_layer(engine, graphs, plan)
    log(f"kernels per MoE layer: {result['kernels_per_moe_layer']['per_layer']} "
        f"(MoE block {result['kernels_per_moe_layer']['moe_block']})")
    save()
    if "throughput" not in skip:
        result["decode_throughput"] = throughput(engine, graphs, plan, bw, sizes, kvb)
        save()
    if "ttft" in skip:
        free(engine)
        return
    # prefill FLOPs per token: 2 per active weight (top_k experts), attention on top
    flops_tok = 2 * (per_token - cfg.vocab_size * cfg.hidden_size * 2) / 2

    def attn_flops(n: int) -> float:
        return 4 * n * n / 2 * cfg.num_heads * cfg.head_dim * cfg.num_layers

    result["ttft"] = bench_ttft(engine, plan, flops_tok, attn_flops, tflops)
    save()
    free(engine)


def run_reference(plan: Plan, result: dict) -> None:
    """pdserve's torch path (no Triton, no graphs) at batch 1: the peer the kernels replace."""
    engine = build_engine(plan.preset, device=plan.device, num_blocks=256,
                          block_size=plan.block_size, max_num_seqs=4,
                          max_model_len=plan.max_model_len, enable_prefix_caching=False)
    vocab = engine.config.model.vocab_size
    drive(engine, random_prompts(1, plan.decode_prompt, vocab, 1), 3)
    steps = drive(engine, random_prompts(1, plan.decode_prompt, vocab, 2), plan.ref_tokens + 1)
    dec = [s for s in steps if s["decode"]]
    result["torch_reference_batch1"] = {
        "tok_s": sum(s["tokens"] for s in dec) / sum(s["s"] for s in dec),
        "note": "engine with use_triton=False: kernels/reference.py MoE (host reads expert ids)"}
    log(f"torch reference batch 1: {result['torch_reference_batch1']['tok_s']:.2f} tok/s")
    free(engine)


def run_hf(plan: Plan, dev: torch.device, result: dict) -> None:
    import transformers

    from pdserve.engine.model.presets import get_preset

    cfg = get_preset(plan.preset)
    moe = cfg.moe
    config = transformers.Qwen3MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=moe.intermediate_size, num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k, norm_topk_prob=moe.norm_topk_prob,
        rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=cfg.max_position_embeddings)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    with torch.device(dev):
        model = transformers.Qwen3MoeForCausalLM._from_config(config, dtype=dtype).eval()
    ids = torch.tensor(random_prompts(1, plan.decode_prompt, cfg.vocab_size, 7), device=dev)

    @torch.inference_mode()
    def gen_s(n: int) -> float:
        t = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                       min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync(dev)
        return time.perf_counter() - t

    gen_s(2)
    t1, tn = gen_s(1), gen_s(plan.hf_tokens)
    result["transformers_batch1"] = {"tok_s": (plan.hf_tokens - 1) / (tn - t1),
                                     "build_s": time.perf_counter() - t0,
                                     "attn_implementation": model.config._attn_implementation,
                                     "mode": "eager generate(), greedy"}
    log(f"transformers batch 1: {result['transformers_batch1']['tok_s']:.2f} tok/s")
    free(model)


def run_mtp(plan: Plan, result: dict) -> None:
    cuda = plan.device.startswith("cuda")
    mplan = MtpPlan(preset=plan.mtp_preset, device=plan.device, ks=plan.mtp_ks, draft_vocab=0,
                    use_triton=True, use_cuda_graphs=cuda, prompt_len=512 if cuda else 16,
                    decode_tokens=256 if cuda else 8, max_model_len=2048 if cuda else 256)
    out = ceiling(mplan)
    result["mtp_forced_batch1"] = {
        "preset": plan.mtp_preset, "cases": out,
        "speedups": {k: v["speedup"] for k, v in out.items() if "speedup" in v}}
    log(f"MTP forced acceptance speedups: {result['mtp_forced_batch1']['speedups']}")


# -- decode-kernel sweep (--sweep): one-row tiles per device -------------------------------------

# (block_n, block_k, num_warps) of the one-row GEMV; (block_t, block_e, block_k, num_warps) of
# the router; (block_n, block_k, num_warps, num_stages) of the grouped GEMMs at 16-row blocks
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test on tiny MoE presets")
    ap.add_argument("--skip", default="",
                    help="comma list of: fast,fast_fp8,reference,hf,mtp (parts); throughput,"
                         "ttft (of fast)")
    ap.add_argument("--sweep", action="store_true",
                    help="first: decode-kernel tiles on this device (GEMV, router, MoE GEMMs)")
    ap.add_argument("--apply-sweep", action="store_true",
                    help="run the benchmark with the sweep's winning tiles installed")
    ap.add_argument("--paths", action="store_true",
                    help="first: per-kernel times of the grouped-GEMM and one-row GEMV MoE "
                         "paths at batch 1, bf16 and FP8 experts")
    ap.add_argument("--fp8", action="store_true",
                    help="after the bf16 engine, the same with block-FP8 weights "
                         "(--quantization fp8), its results under fp8_engine")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    plan = TINY if device == "cpu" else Plan()
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    skip = set(filter(None, args.skip.split(",")))
    if not args.fp8:
        skip.add("fast_fp8")
    result: dict = {"device": name, "command": " ".join([sys.executable] + sys.argv),
                    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    "plan": dataclasses.asdict(plan), "torch": torch.__version__}

    def save() -> None:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2, default=str)

    result["device_rates"] = rates = device_rates(plan, dev)
    log(f"device {name}: copy {rates['copy_GBps']:.0f} GB/s")
    if args.sweep and dev.type == "cuda":
        try:
            run_sweep(plan, dev, result, save, apply=args.apply_sweep)
        except Exception as e:  # keep what was measured; the benchmark still runs
            result["sweep_error"] = f"{type(e).__name__}: {e}"
            log(f"sweep failed: {result['sweep_error']}")
        free()
        save()
    if args.paths and dev.type == "cuda":
        try:
            run_paths(plan, dev, result, save)
        except Exception as e:  # keep what was measured; the benchmark still runs
            result["paths_error"] = f"{type(e).__name__}: {e}"
            log(f"paths failed: {result['paths_error']}")
        free()
        save()
    for part, run in (("fast", lambda: run_fast(plan, dev, rates["copy_GBps"],
                                                rates["matmul_bf16_TFLOPs"], result, save,
                                                frozenset(skip))),
                      ("fast_fp8", lambda: run_fast(
                          dataclasses.replace(plan, quantization="fp8"), dev,
                          rates["copy_GBps"], rates["matmul_bf16_TFLOPs"],
                          result.setdefault("fp8_engine", {}), save, frozenset(skip))),
                      ("reference", lambda: run_reference(plan, result)),
                      ("hf", lambda: run_hf(plan, dev, result)),
                      ("mtp", lambda: run_mtp(plan, result))):
        if part in skip:
            continue
        try:
            run()
        except Exception as e:  # keep what was measured; the next part still runs
            result[f"{part}_error"] = f"{type(e).__name__}: {e}"
            log(f"{part} failed: {result[f'{part}_error']}")
        free()
        save()
    print(json.dumps({k: result.get(k) for k in ("decode_batch1", "kernels_per_moe_layer")},
                     indent=1, default=str)[:4000])


if __name__ == "__main__":
    main()
