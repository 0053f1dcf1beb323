"""MTP speculative decoding benchmark (issue 6), one GPU.

    python -m bench.lab.bench_mtp --out bench/results/mtp_h100_<date>.json
    python -m bench.lab.bench_mtp --smollm-model /tmp/smollm2.gguf --mtp-head /tmp/head.safetensors \
        --out bench/results/mtp_h100_<date>.json      # SmolLM2 from a copied GGUF, a new head
    python -m bench.lab.bench_mtp --tiny --out /tmp/mtp_tiny.json      # CPU smoke test

In one run:
  1. ceiling: a Qwen3-8B-shaped model + one MTP layer, random bf16 weights, FORCED acceptance
     (every draft accepted: wrong tokens, the upper bound of what speculation can give):
     batch-1 decode tok/s without speculation and with k = 1, 2, 3 (targets: >= 1.7x at k=1,
     >= 2.6x at k=3);
  2. concurrency: 64 sequences decoding at once, no speculation vs adaptive k (the default
     SpecConfig caps, real acceptance of the random head; target: within 5% or better);
  3. real acceptance: SmolLM2-135M-Instruct (--smollm-model, default the embedded one) with
     its trained head (--mtp-head, default the one shipped in engine/mtp_heads), batch 1,
     greedy, held-out chat prompts: tok/s without speculation and with k = 1, 2, 3, with the
     acceptance counters.
Decode tok/s counts the tokens of steps after every request had its first token, over those
steps' wall time (scheduler, sampling, drafting: what a user gets). On CUDA: Triton kernels,
and CUDA graphs for decode steps (overlapped with the host), verify steps and greedy drafting
(engine/spec/draft_graphs.py); each case's JSON keeps its host time by step phase.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import sys
import time
from dataclasses import dataclass

import torch

from pdserve.engine.core.config import SpecConfig
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import build_engine

from bench.lab.engine_probes import GcWatch, slow_steps


@dataclass(frozen=True)
class Plan:
    preset: str = "qwen3-8b"
    device: str = "cuda"
    prompt_len: int = 512
    decode_tokens: int = 256
    ks: tuple[int, ...] = (1, 2, 3)
    concurrency: int = 64
    concurrency_prompt: int = 512
    concurrency_tokens: int = 128
    smollm_prompts: int = 8
    smollm_tokens: int = 128
    max_model_len: int = 2048
    block_size: int = 16
    use_triton: bool = True
    use_cuda_graphs: bool = True
    smollm_model: str | None = None  # None = the embedded SmolLM2-135M-Instruct
    mtp_head: str | None = None  # None = the head shipped for it (engine/mtp_heads)
    # > 0: every k also runs drafting over this many token ids (SpecConfig.draft_vocab),
    # as cases k{k}_dv (ceiling) and k{k}_dv (SmolLM2, real acceptance)
    draft_vocab: int = 0
    smollm_draft_vocab: int = 0  # the same for part 3 (SmolLM2 has 49,152 ids)


TINY = Plan(preset="tiny-qwen3", device="cpu", prompt_len=16, decode_tokens=12, ks=(1, 3),
            concurrency=6, concurrency_prompt=12, concurrency_tokens=8, smollm_prompts=1,
            smollm_tokens=8, max_model_len=256, block_size=4, use_triton=False,
            use_cuda_graphs=False)


def log(msg: str) -> None:
    print(f"[bench_mtp] {msg}", file=sys.stderr, flush=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _quartiles(xs: list[float]) -> list[float]:
    if not xs:
        return []
    s = sorted(xs)
    return [round(s[int(q * (len(s) - 1))], 3) for q in (0.0, 0.25, 0.5, 0.75, 1.0)]


def _ends(xs: list[float]) -> list[float]:
    n = max(1, len(xs) // 8)
    return [round(sum(xs[:n]) / n, 3), round(sum(xs[-n:]) / n, 3)] if xs else []


def _timed_steps(engine, batches: list[list[list[int]]], params: SamplingParams,
                 device: str) -> tuple[int, list[float]]:
    """Each batch to completion; (tokens, ms of each step) over the steps after every request
    of its batch had its first token."""
    tokens, step_ms = 0, []
    for prompts in batches:
        rids = [engine.add_request(p, params)[0] for p in prompts]
        started: set[str] = set()
        sync(device)
        t = time.perf_counter()
        while engine.has_unfinished():
            all_in = len(started) == len(rids)
            outs = engine.step()
            now = time.perf_counter()
            if all_in:
                tokens += sum(len(o.new_token_ids) for o in outs)
                step_ms.append(1e3 * (now - t))
            started.update(o.request_id for o in outs if o.new_token_ids)
            t = now
    return tokens, step_ms


def decode_rate(engine, batches: list[list[list[int]]], max_tokens: int, device: str,
                ignore_eos: bool = True) -> dict:
    """Run each batch of prompts to completion, one batch after the other; decode tok/s over
    the steps after every request of the batch had its first token."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    engine.stats.host_s.clear()
    steps0 = engine.stats.steps
    with GcWatch() as gcw:
        tokens, step_ms = _timed_steps(engine, batches, params, device)
    seconds, steps = sum(step_ms) / 1e3, len(step_ms)
    n = max(1, engine.stats.steps - steps0)
    out = {"tok_s": tokens / max(seconds, 1e-9), "gc": gcw.report(), "tokens": tokens,
           "steps": steps, "ms_per_step": 1000 * seconds / max(steps, 1),
           # spread over the run (the context grows by max_tokens): quartiles and the means
           # of the first and last eighth of the steps
           "step_ms_quartiles": _quartiles(step_ms), "step_ms_first_last": _ends(step_ms),
           "slow_steps": slow_steps(step_ms),
           # host ms per engine step by phase; 'sample' waits for the GPU, 'draft' is MTP
           "step_phases_ms": {k: round(1e3 * v / n, 4) for k, v in engine.stats.host_s.items()}}
    stats = engine.spec_stats
    static = engine.runner.spec.draft_graphs if engine.runner.spec is not None else None
    if static is not None:
        out.update(static_drafts=static.served, draft_graph_replays=static.replays)
    if stats is not None:
        out.update(num_drafts=stats.num_drafts, num_draft_tokens=stats.num_draft_tokens,
                   num_accepted_tokens=stats.num_accepted_tokens,
                   acceptance_rate=stats.acceptance_rate,
                   mean_accepted_length=stats.mean_accepted_length,
                   accepted_per_pos=list(stats.num_accepted_tokens_per_pos))
    return out


def engine_for(plan: Plan, model: str | None, spec: SpecConfig | None, num_seqs: int,
               num_blocks: int, mtp_head: str | None = None):
    return build_engine(model, device=plan.device, block_size=plan.block_size,
                        num_blocks=num_blocks, max_num_seqs=max(num_seqs, 1),
                        max_num_batched_tokens=max(4096, num_seqs * plan.concurrency_prompt),
                        max_model_len=plan.max_model_len, use_triton=plan.use_triton,
                        use_cuda_graphs=plan.use_cuda_graphs, speculative=spec,
                        mtp_head=mtp_head if spec is not None else None)


def free(*objs: object) -> None:
    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_case(plan: Plan, model: str | None, spec: SpecConfig | None,
             batches: list[list[list[int]]], max_tokens: int, label: str,
             ignore_eos: bool = True, mtp_head: str | None = None) -> dict:
    """A fresh engine per case (the spec engine's KV has one more layer); one warm-up run
    (Triton compiles, graph capture of new shapes), then the measured batches in turn."""
    width = max(len(b) for b in batches)
    need = width * (max(len(p) for b in batches for p in b) + max_tokens + 8)
    t0 = time.perf_counter()
    engine = engine_for(plan, model, spec, width, -(-need // plan.block_size) + 64, mtp_head)
    build_s = time.perf_counter() - t0
    decode_rate(engine, [[p[:8] for p in batches[0][:2]]], 8, plan.device)
    if engine.spec_stats is not None:  # count only the measured runs
        engine.runner.spec.stats = type(engine.spec_stats)(
            num_accepted_tokens_per_pos=[0] * spec.num_speculative_tokens)
    res = decode_rate(engine, batches, max_tokens, plan.device, ignore_eos)
    res["case"] = label
    res["build_s"] = round(build_s, 1)
    log(f"{label}: {res['tok_s']:.1f} tok/s, {res['ms_per_step']:.2f} ms/step"
        + (f", accepted {res['acceptance_rate']:.2f}" if "acceptance_rate" in res else ""))
    free(engine)
    return res


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def ceiling(plan: Plan) -> dict:
    from pdserve.engine.model.presets import get_preset

    vocab = get_preset(plan.preset).vocab_size
    [prompt] = random_prompts(1, plan.prompt_len, vocab, 0)
    out = {"none": run_case(plan, plan.preset, None, [[prompt]], plan.decode_tokens,
                            "batch1 none")}
    for k in plan.ks:
        for name, dv in _draft_vocabs(k, plan.draft_vocab):
            spec = SpecConfig(num_speculative_tokens=k, batch_k_caps=(), forced_acceptance=True,
                              draft_vocab=dv)
            out[name] = run_case(plan, plan.preset, spec, [[prompt]], plan.decode_tokens,
                                 f"batch1 k={k} forced draft_vocab={dv or 'full'}")
            out[name]["speedup"] = out[name]["tok_s"] / out["none"]["tok_s"]
    return out


def _draft_vocabs(k: int, draft_vocab: int) -> list[tuple[str, int]]:
    """(case name, SpecConfig.draft_vocab) per k: the full vocabulary, and draft_vocab if > 0."""
    return [(f"k{k}", 0)] + ([(f"k{k}_dv", draft_vocab)] if draft_vocab else [])


def concurrency(plan: Plan) -> dict:
    from pdserve.engine.model.presets import get_preset

    vocab = get_preset(plan.preset).vocab_size
    prompts = random_prompts(plan.concurrency, plan.concurrency_prompt, vocab, 1)
    n = plan.concurrency
    out = {"none": run_case(plan, plan.preset, None, [prompts], plan.concurrency_tokens,
                            f"{n} seqs none")}
    spec = SpecConfig(num_speculative_tokens=max(plan.ks))  # default adaptive caps
    out["adaptive"] = run_case(plan, plan.preset, spec, [prompts], plan.concurrency_tokens,
                               f"{n} seqs adaptive k (k at this batch: {spec.k_for_batch(n)})")
    out["adaptive"]["ratio_to_none"] = out["adaptive"]["tok_s"] / out["none"]["tok_s"]
    out["adaptive"]["spec_config"] = dataclasses.asdict(spec)
    return out


def smollm(plan: Plan) -> dict:
    from pdserve.engine.model.loader import load_tokenizer
    from pdserve.engine.train_mtp import chat, heldout_prompts

    tok = load_tokenizer(plan.smollm_model)
    prompts = [chat(tok, m) for m in heldout_prompts(plan.smollm_prompts)]
    cases = {"none": None} | {name: SpecConfig(num_speculative_tokens=k, batch_k_caps=(),
                                               draft_vocab=dv)
                              for k in plan.ks
                              for name, dv in _draft_vocabs(k, plan.smollm_draft_vocab)}
    out: dict = {}
    for name, spec in cases.items():  # batch 1: one prompt after another; EOS ends a reply
        r = run_case(plan, plan.smollm_model, spec, [[p] for p in prompts], plan.smollm_tokens,
                     f"smollm2 {name}", ignore_eos=False, mtp_head=plan.mtp_head)
        out[name] = r
        if spec is not None:
            r.update(first_draft_acceptance=r["accepted_per_pos"][0] / max(r["num_drafts"], 1),
                     speedup=r["tok_s"] / out["none"]["tok_s"])
    out["model"] = plan.smollm_model or "smollm2-135m-instruct (embedded)"
    out["mtp_head"] = plan.mtp_head or "engine/mtp_heads/smollm2-135m-instruct.safetensors"
    return out


def summary(result: dict) -> dict:
    s: dict = {}
    c = result.get("ceiling", {})
    if "none" in c:
        s["ceiling_none_tok_s"] = c["none"]["tok_s"]
    for k, target in (("k1", 1.7), ("k2", None), ("k3", 2.6), ("k1_dv", 1.7), ("k2_dv", None),
                      ("k3_dv", 2.6)):
        if k in c:
            s[f"ceiling_{k}_speedup"] = {"value": c[k]["speedup"], "tok_s": c[k]["tok_s"]}
            if target is not None:
                s[f"ceiling_{k}_speedup"].update(target=f">= {target}",
                                                 met=c[k]["speedup"] >= target)
    if "adaptive" in result.get("concurrency", {}):
        r = result["concurrency"]["adaptive"]["ratio_to_none"]
        s["concurrency_ratio"] = {"value": r, "target": ">= 0.95", "met": r >= 0.95}
    if "none" in result.get("smollm2", {}):
        s["smollm2_none_tok_s"] = result["smollm2"]["none"]["tok_s"]
    for k in ("k1", "k2", "k3", "k1_dv", "k2_dv", "k3_dv"):
        if k in result.get("smollm2", {}):
            m = result["smollm2"][k]
            s[f"smollm2_{k}"] = {"speedup": m["speedup"], "acceptance_rate": m["acceptance_rate"],
                                 "first_draft_acceptance": m["first_draft_acceptance"],
                                 "mean_accepted_length": m["mean_accepted_length"]}
    return s


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="JSON file to write")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny sizes")
    ap.add_argument("--device", default=None)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: "
                                               "ceiling,concurrency,smollm2")
    ap.add_argument("--smollm-model", default=None,
                    help="SmolLM2 for part 3: a .gguf path, e.g. a copy of the embedded file "
                         "(default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--mtp-head", default=None,
                    help="MTP head for part 3, from `pdserve train-mtp` (default: the head "
                         "shipped in engine/mtp_heads)")
    ap.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                    help="also run every ceiling k drafting over N token ids "
                         "(SpecConfig.draft_vocab)")
    ap.add_argument("--smollm-draft-vocab", type=int, default=0, metavar="N",
                    help="the same for part 3 (SmolLM2, real acceptance)")
    args = ap.parse_args(argv)
    for flag, path in (("--smollm-model", args.smollm_model), ("--mtp-head", args.mtp_head)):
        if path is not None and not os.path.isfile(path):
            ap.error(f"{flag}: no such file: {path!r}")
    device = args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    plan = TINY if args.tiny or device == "cpu" else Plan()
    plan = dataclasses.replace(plan, device=device, smollm_model=args.smollm_model,
                               draft_vocab=args.draft_vocab,
                               smollm_draft_vocab=args.smollm_draft_vocab,
                               mtp_head=args.mtp_head and os.path.abspath(args.mtp_head))
    if plan.use_triton:
        from pdserve.kernels.triton_mode import select_triton_mode

        select_triton_mode()  # compiled Triton on a GPU, before anything imports triton
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    start = time.perf_counter()
    result: dict = {"device": name, "command": " ".join([sys.executable] + sys.argv),
                    "date": datetime.datetime.now(datetime.UTC).isoformat(
                        timespec="seconds"),
                    "torch": torch.__version__, "plan": dataclasses.asdict(plan)}
    skip = set(filter(None, args.skip.split(",")))

    def save() -> None:
        result["summary"] = summary(result)
        result["total_s"] = round(time.perf_counter() - start, 1)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2, default=str)

    for part, fn in (("ceiling", ceiling), ("concurrency", concurrency), ("smollm2", smollm)):
        if part in skip:
            continue
        t0 = time.perf_counter()
        try:
            result[part] = fn(plan)
            result[part]["seconds"] = round(time.perf_counter() - t0, 1)
        except Exception as e:  # keep what was measured
            result[f"{part}_error"] = f"{type(e).__name__}: {e}"
            log(f"{part} failed: {result[f'{part}_error']}")
        save()
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
