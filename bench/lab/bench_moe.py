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
from bench.lab.engine_probes import count_kernels, kernel_times, log, random_prompts, sync
from bench.lab.moe_sweeps import run_paths, run_sweep


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
