"""Cost of the grammar mask per decode step (issue 25, GPU line), one GPU.

    python -m bench.lab.bench_structured --out $OUT/structured.json
    python -m bench.lab.bench_structured --tiny --out /tmp/structured_tiny.json   # CPU smoke

A Qwen3-8B-shaped model (36 layers, bf16, random weights, Triton kernels, CUDA graphs and the
overlapped decode, as bench/lab/bench_engine.py builds it) decodes at batch 1 and 64, every
sequence under a JSON-schema response format, against the same batch without one. The preset
has no tokenizer and none of Qwen3's is on the device: the grammar uses the real SmolLM2
tokenizer shipped with the package (49,152 ids) over the model's 151,936 logits (ids past the
tokenizer are never allowed), and the host fill is also measured for a synthetic byte-level
vocabulary of 151,936 pieces (SmolLM2's plus generated pairs of its pieces).

Reported: the end-to-end decode step (median over the steps with the whole batch decoding)
with and without the grammar, and the mask's share of the step; then the parts: the host
work (xgrammar: each row's accept of its last token and its fill; one row after another on
the engine thread before, now BitmaskFiller's threads), the copy to the device (how long the
host is blocked while GPU work is queued: pageable vs pinned), and the mask's kernels on the
device (the earlier unpack-and-fill formulation vs the fused kernel; outputs compared).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from pdserve.kernels.triton_mode import select_triton_mode

select_triton_mode()  # first: compiled (GPU) or interpreted (CPU) Triton
from pdserve.engine.core.sampling_params import SamplingParams, StructuredOutput
from pdserve.engine.llm import build_engine
from pdserve.engine.model.loader import load_tokenizer
from pdserve.engine.model.tokenizer import Tokenizer
from pdserve.engine.structured.compiler import tokenizer_info, xgrammar
from pdserve.engine.structured.matcher import (
    BitmaskFiller,
    GrammarState,
    apply_bitmask,
    bitmask_width,
    host_bitmask,
)

from bench.lab.engine_probes import log, random_prompts, sync, time_ms

# A JSON document that never ends within the run (minItems): every decode step of every
# sequence is under the mask, through objects, keys, enums, bounded integers, numbers,
# booleans, free strings and an optional field.
ITEM = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 100000},
    "kind": {"enum": ["create", "update", "delete", "noop"]},
    "name": {"type": "string"},
    "ok": {"type": "boolean"},
    "score": {"type": "number"},
    "owner": {"type": "object", "properties": {"user": {"type": "string"},
                                               "team": {"type": "integer"}},
              "required": ["user"]}},
    "required": ["id", "kind", "name", "ok", "score"]}
SCHEMA = {"type": "object", "properties": {"events": {"type": "array", "items": ITEM,
                                                      "minItems": 1000}},
          "required": ["events"]}
# the same with length-bounded strings: xgrammar's fill is far slower inside them
BOUNDED = json.loads(json.dumps(SCHEMA).replace('"name": {"type": "string"}',
                                                '"name": {"type": "string", "maxLength": 12}'))


@dataclass(frozen=True)
class Plan:
    preset: str = "qwen3-8b"
    device: str = "cuda"
    batches: tuple[int, ...] = (1, 64)
    prompt_len: int = 128
    decode_tokens: int = 96
    warmup_tokens: int = 12
    fill_steps: int = 40  # host-fill walk: steps of `batch` matchers
    max_model_len: int = 1024
    block_size: int = 16
    use_cuda_graphs: bool = True


TINY = Plan(preset="tiny-qwen3", device="cpu", batches=(1, 4), prompt_len=8, decode_tokens=6,
            warmup_tokens=2, fill_steps=3, max_model_len=256, block_size=4,
            use_cuda_graphs=False)


# -- end to end --------------------------------------------------------------------------------

def drive(engine, prompts: list[list[int]], params: SamplingParams) -> list[float]:
    """Run prompts to completion; seconds of each step in which the whole batch decoded."""
    rids = [engine.add_request(p, params)[0] for p in prompts]
    started: set[str] = set()
    full: list[float] = []
    t = time.perf_counter()
    while engine.has_unfinished():
        all_in = len(started) == len(rids)
        outs = engine.step()  # ends in the sampler's host copy: the GPU work is done
        now = time.perf_counter()
        if all_in and sum(len(o.new_token_ids) for o in outs) == len(rids):
            full.append(now - t)
        started.update(o.request_id for o in outs if o.new_token_ids)
        t = now
    return full


def end_to_end(engine, plan: Plan, batch: int, tokenizer_vocab: int) -> dict:
    """Median full-batch decode step, plain and under SCHEMA (same prompts, greedy)."""
    spec = StructuredOutput(json=json.dumps(SCHEMA))
    plain = SamplingParams(max_tokens=plan.decode_tokens, temperature=0.0, ignore_eos=True)
    grammar = dataclasses.replace(plain, structured=spec)
    prompts = random_prompts(batch, plan.prompt_len, tokenizer_vocab, 7 + batch)
    warm = dataclasses.replace(grammar, max_tokens=plan.warmup_tokens)
    drive(engine, prompts, dataclasses.replace(plain, max_tokens=plan.warmup_tokens))
    drive(engine, prompts, warm)  # compiles the grammar, JITs the mask kernel
    out: dict = {"batch": batch}
    filler: BitmaskFiller = engine.runner.sampler.masks
    for name, params in (("plain", plain), ("grammar", grammar), ("plain_again", plain)):
        f0, s0, h0 = filler.fills, filler.seconds, dict(engine.stats.host_s)
        steps0 = engine.stats.steps
        full = drive(engine, prompts, params)
        n = max(1, engine.stats.steps - steps0)
        out[name] = {"full_decode_steps": len(full),
                     "step_ms_median": 1e3 * statistics.median(full),
                     "step_ms_mean": 1e3 * statistics.fmean(full),
                     "host_phase_ms_per_step": {k: round(1e3 * (v - h0.get(k, 0.0)) / n, 4)
                                                for k, v in engine.stats.host_s.items()}}
        if filler.fills > f0:
            out[name]["host_fill_ms_per_step"] = 1e3 * (filler.seconds - s0) / (filler.fills - f0)
        log(f"batch {batch} {name}: step {out[name]['step_ms_median']:.3f} ms median "
            f"({len(full)} full steps)")
    base = min(out["plain"]["step_ms_median"], out["plain_again"]["step_ms_median"])
    g = out["grammar"]["step_ms_median"]
    out["mask_ms_per_step"] = g - base
    out["mask_share_of_step_pct"] = 100 * (g - base) / g
    out["plain_noise_ms"] = abs(out["plain"]["step_ms_median"]
                                - out["plain_again"]["step_ms_median"])
    return out


# -- parts -------------------------------------------------------------------------------------

def synthetic_tokenizer(tokenizer: Tokenizer, vocab: int, first_special: int) -> Tokenizer:
    """A byte-level tokenizer of `vocab` pieces, as large as Qwen3's: SmolLM2's, then
    distinct pairs of its pieces (merges a larger BPE vocabulary would have), ids from
    first_special on special tokens (Qwen3's <|endoftext|>, <|im_end|>... sit there). Only
    for the grammar (xgrammar reads the pieces) and decoding; it has no merges to encode."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    base = tokenizer.backend.get_vocab(with_added_tokens=True)
    n0 = tokenizer.backend.get_vocab_size()
    special = {i: t.content for i, t in tokenizer.backend.get_added_tokens_decoder().items()
               if t.special}
    pieces = [""] * vocab
    for piece, i in base.items():
        pieces[i] = piece
    normal = [p for i, p in enumerate(pieces[:n0]) if p and i not in special]
    seen, rng = set(pieces), random.Random(0)
    for i in range(n0, vocab):
        piece = f"<|extra_{i}|>"
        while i < first_special and (piece in seen or piece.startswith("<|extra_")):
            piece = rng.choice(normal) + rng.choice(normal)
        seen.add(piece)
        pieces[i] = piece
    backend = Backend(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(pieces[i], special=True, normalized=False)
                                for i in [*special, *range(first_special, vocab)]])
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=(), chat_template=None,
                     source="synthetic")


def fill_walk(info, schema: dict, batch: int, steps: int, threads: int) -> dict:
    """Host work per step of `batch` grammar rows walking the grammar by the argmax of random
    logits under their masks: before (each row accepts its token, then one row after another
    fills) vs now (BitmaskFiller: queued accepts and fills on `threads` threads); masks
    compared every step; per-row accept and fill us distributions of the sequential path."""
    xgr = xgrammar()
    compiled = xgr.GrammarCompiler(info, max_threads=4, cache_enabled=False) \
        .compile_json_schema(json.dumps(schema), any_whitespace=False)
    stop = list(info.stop_token_ids)
    before = [GrammarState(compiled, stop) for _ in range(batch)]
    now = [GrammarState(compiled, stop) for _ in range(batch)]
    filler = BitmaskFiller(threads)
    vocab = info.vocab_size
    bm = host_bitmask(batch, vocab)
    gen = torch.Generator().manual_seed(batch)
    seq, new, acc_rows, fill_rows = [], [], [], []
    tokens: list[int] = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for i, g in enumerate(before):
            if tokens:
                r0 = time.perf_counter()
                g.accept(tokens[i])
                g.flush()
                acc_rows.append(time.perf_counter() - r0)
            r0 = time.perf_counter()
            g.fill(bm, i)
            fill_rows.append(time.perf_counter() - r0)
        seq.append(time.perf_counter() - t0)
        for g, t in zip(now, tokens):
            g.accept(t)
        t0 = time.perf_counter()
        got = filler.fill(now, vocab, torch.device("cpu"))
        new.append(time.perf_counter() - t0)
        assert torch.equal(bm, got), "the threaded fill differs from the sequential one"
        logits = torch.randn(batch, vocab, generator=gen)
        xgr.apply_token_bitmask_inplace(logits, bm)
        tokens = logits.argmax(-1).tolist()

    def dist(xs: list[float]) -> dict:
        xs = sorted(xs) or [0.0]
        return {"median": 1e6 * xs[len(xs) // 2], "mean": 1e6 * statistics.fmean(xs),
                "p90": 1e6 * xs[int(0.9 * len(xs))], "max": 1e6 * xs[-1]}

    return {"batch": batch, "steps": steps, "threads": threads,
            "before_ms_median": 1e3 * statistics.median(seq),
            "before_ms_mean": 1e3 * statistics.fmean(seq), "before_ms_max": 1e3 * max(seq),
            "now_ms_median": 1e3 * statistics.median(new),
            "now_ms_mean": 1e3 * statistics.fmean(new), "now_ms_max": 1e3 * max(new),
            "accept_row_us": dist(acc_rows), "fill_row_us": dist(fill_rows)}


def apply_before(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The mask as the sampler applied it before (a pageable copy, then an int32 [B, W, 32]
    unpack and a masked_fill): the reference the fused kernel is compared with."""
    mask = bitmask.to(logits.device, non_blocking=True)  # [B, W]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((mask[:, :, None] >> shifts) & 1).bool()  # [B, W, 32]
    allowed = allowed.reshape(mask.shape[0], -1)[:, :logits.shape[-1]]  # [B, V]
    return logits.masked_fill(~allowed, float("-inf"))


def device_parts(engine, batch: int, dev: torch.device) -> dict:
    """Device time of the mask's kernels (before vs now, results compared), and how long the
    host is held by the bitmask copy while GPU work is queued (pageable vs pinned)."""
    model = engine.runner.model
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(batch)
    logits = torch.randn(batch, vocab, generator=gen).to(dev, torch.bfloat16)
    words = torch.randint(-(1 << 31), 1 << 31, (batch, bitmask_width(vocab)), generator=gen,
                          dtype=torch.int64).to(torch.int32)
    words[:, 0] = 0  # a row that forbids a run of tokens outright
    mask_dev = words.to(dev)
    same = torch.equal(apply_before(logits, mask_dev), apply_bitmask(logits, mask_dev))
    out = {"batch": batch, "results_equal": same,
           "apply_before_ms": time_ms(lambda: apply_before(logits, mask_dev), dev, reps=50),
           "apply_now_ms": time_ms(lambda: apply_bitmask(logits, mask_dev), dev, reps=50)}
    if dev.type != "cuda":
        return out
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def busy() -> None:  # queued GPU work (~65 ms on an H200), longer than any copy
        for _ in range(40):
            a @ a

    pinned = words.pin_memory()
    dst = torch.empty_like(mask_dev)
    busy_ms = time_ms(busy, dev, reps=5)
    for name, copy in (("pageable", lambda: words.to(dev, non_blocking=True)),
                       ("pinned", lambda: dst.copy_(pinned, non_blocking=True))):
        held = []
        for _ in range(10):
            busy()  # queued: the copy is issued while the GPU runs it
            t0 = time.perf_counter()
            copy()
            held.append(time.perf_counter() - t0)
            sync(dev)
        out[f"copy_{name}_host_held_ms"] = 1e3 * statistics.median(held)
    out["queued_gpu_work_ms"] = busy_ms
    out["copy_pinned_device_ms"] = time_ms(lambda: dst.copy_(pinned, non_blocking=True), dev)
    out["bitmask_bytes"] = words.numel() * 4
    return out


# -- main --------------------------------------------------------------------------------------

def run(plan: Plan, result: dict, save, tokenizer_dir: str | None = None) -> None:
    dev = torch.device(plan.device)
    # SmolLM2-135M-Instruct's: the embedded GGUF's, or the same saved as tokenizer.json (a
    # host without the embedded package)
    tok = Tokenizer.from_hf_dir(tokenizer_dir) if tokenizer_dir else load_tokenizer(None)
    t0 = time.perf_counter()
    need = max(plan.batches) * (plan.prompt_len + plan.decode_tokens + 32)
    engine = build_engine(
        plan.preset, device=plan.device, dtype="bfloat16" if dev.type == "cuda" else "float32",
        num_blocks=need // plan.block_size + 64, block_size=plan.block_size,
        max_num_seqs=max(plan.batches), max_model_len=plan.max_model_len,
        enable_prefix_caching=False, use_triton=True, use_cuda_graphs=plan.use_cuda_graphs)
    engine.tokenizer = tok  # presets ship none; the grammar needs one (module docstring)
    cfg = engine.config.model
    runner = engine.runner
    result["model"] = {"preset": plan.preset, "layers": cfg.num_layers, "vocab_size":
                       cfg.vocab_size, "dtype": str(runner.kv_cache.dtype),
                       "cuda_graphs": runner.cuda_graphs is not None,
                       "overlap_decode": runner.ahead is not None,
                       "fill_threads": runner.sampler.masks.threads,
                       "build_s": time.perf_counter() - t0}
    result["tokenizer"] = {"grammar": "SmolLM2-135M-Instruct (the embedded GGUF's"
                           f"{', saved to ' + tokenizer_dir if tokenizer_dir else ''}), "
                           f"{tok.backend.get_vocab_size()} ids, over the model's "
                           f"{cfg.vocab_size} logits: ids past the tokenizer are never allowed",
                           "prompts": "random ids below the tokenizer's size"}
    log(f"engine built in {result['model']['build_s']:.1f} s")
    save()
    prompt_vocab = min(tok.backend.get_vocab_size(), cfg.vocab_size)
    result["end_to_end"] = [end_to_end(engine, plan, b, prompt_vocab) for b in plan.batches]
    save()
    synth = None
    if cfg.vocab_size > tok.backend.get_vocab_size():  # the same under a Qwen3-sized vocab
        synth = synthetic_tokenizer(tok, cfg.vocab_size, min(cfg.eos_token_ids))
        engine.tokenizer = synth
        engine._grammars = None  # the compiler is per tokenizer: made again on first use
        result["end_to_end_synthetic_vocab"] = [end_to_end(engine, plan, b, prompt_vocab)
                                                for b in plan.batches]
        save()
    result["device_parts"] = [device_parts(engine, b, dev) for b in plan.batches]
    save()
    stop = list(cfg.eos_token_ids)
    threads = runner.sampler.masks.threads
    vocabs = {"smollm2_padded": tokenizer_info(tok, cfg.vocab_size, stop)}
    if synth is not None:
        vocabs[f"synthetic_{cfg.vocab_size}"] = tokenizer_info(synth, cfg.vocab_size, stop)
    result["host_fill"] = {}
    for vname, info in vocabs.items():
        for sname, schema in (("schema", SCHEMA), ("bounded_strings", BOUNDED)):
            rows = [fill_walk(info, schema, b, plan.fill_steps, threads) for b in plan.batches]
            result["host_fill"][f"{vname}/{sname}"] = rows
            log(f"fill {vname}/{sname}: " + ", ".join(
                f"B={r['batch']} before {r['before_ms_mean']:.2f} ms, now "
                f"{r['now_ms_mean']:.2f} ms" for r in rows))
            save()


def summary(result: dict) -> dict:
    s = {}
    for key, tag in (("end_to_end", ""), ("end_to_end_synthetic_vocab", "_synthetic_vocab")):
        for row in result.get(key, []):
            s[f"batch{row['batch']}{tag}"] = {
                "plain_step_ms": row["plain"]["step_ms_median"],
                "grammar_step_ms": row["grammar"]["step_ms_median"],
                "mask_share_of_step_pct": row["mask_share_of_step_pct"],
                "host_fill_ms_per_step": row["grammar"].get("host_fill_ms_per_step")}
    big = [r for r in result.get("end_to_end", []) if r["batch"] == 64]
    if big:
        s["target"] = {"value_pct": big[0]["mask_share_of_step_pct"], "target": "<= 5% at batch 64",
                       "met": big[0]["mask_share_of_step_pct"] <= 5.0}
    return s


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="JSON file to write")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny-qwen3")
    ap.add_argument("--tokenizer", default=None, help="a folder with SmolLM2's tokenizer.json "
                    "(default: the embedded GGUF's tokenizer)")
    args = ap.parse_args(argv)
    plan = TINY if args.tiny or not torch.cuda.is_available() else Plan()
    dev = torch.device(plan.device)
    result: dict = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "command": " ".join([sys.executable, "-m", "bench.lab.bench_structured"] + sys.argv[1:]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": {"torch": torch.__version__, "xgrammar": _xgr_version()},
        "plan": dataclasses.asdict(plan), "schema": SCHEMA}

    def save() -> None:
        result["summary"] = summary(result)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2, default=str)

    try:
        run(plan, result, save, args.tokenizer)
    except Exception as e:  # keep what was measured
        result["error"] = f"{type(e).__name__}: {e}"
        log(f"failed: {result['error']}")
        raise
    finally:
        save()
    print(json.dumps(result["summary"], indent=2))


def _xgr_version() -> str | None:
    try:
        from importlib.metadata import version
        return version("xgrammar")
    except Exception:
        return None


if __name__ == "__main__":
    main()
