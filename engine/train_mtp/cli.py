"""train-mtp command line: `pdserve train-mtp` flags with their [CPU / CUDA] defaults, and
the run itself: corpus, training, outputs (head, JSON report, loss plot), evaluation."""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from pdserve.engine.train_mtp.corpus import Sample, generate_corpus, generation_engine
from pdserve.engine.train_mtp.evaluation import measure_acceptance
from pdserve.engine.train_mtp.plots import plot_losses
from pdserve.engine.train_mtp.prompts import (
    HELDOUT_TEMPLATES,
    HELDOUT_TOPICS,
    TRAIN_TEMPLATES,
    TRAIN_TOPICS,
    ChatPrompts,
    corpus_prompts,
    heldout_prompts,
    temperature_for,
)
from pdserve.engine.train_mtp.training import INITS, train_head
from pdserve.kernels.triton_mode import select_triton_mode

# defaults per device: (CPU, CUDA). The CUDA ones fit one H100 run of ~7.5 minutes in all:
# model load + Triton compile + graph capture (~40 s), 4 minutes generating (the data:
# millions of tokens), <= 2 minutes training (time-bound: the planned epochs are more than
# fit), ~30 s evaluation; --deadline-s trims training when the rest ran long
DEFAULTS = {
    "num_prompts": (512, 65536), "max_tokens": (128, 256), "epochs": (5.0, 10.0),
    "vocab_subset": (4096, 0), "batch_size": (16, 64), "chain_weight": (0.0, 0.3),
    "train_time_s": (420.0, 120.0), "gen_time_s": (None, 240.0), "gen_batch": (128, 512),
    "deadline_s": (None, 470.0), "hard_weight": (0.5, 0.5), "feature_weight": (0.0, 0.0),
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train-mtp", help="train an MTP head by self-distillation (CPU or one GPU)",
        description="Train an MTP draft head for a model on its own generations (no data "
                    "set, no downloads), then measure its acceptance on held-out prompts. "
                    "Defaults in brackets are [CPU / CUDA].")
    a = p.add_argument
    a("--model", default=None, help="HF folder or .gguf (a copy of the embedded SmolLM2 GGUF "
                                    "counts as the default model; default: the embedded "
                                    "SmolLM2-135M-Instruct)")
    a("--out", required=True, help="output .safetensors (plus .json and .png next to it)")
    a("--device", default=None, help="cpu | cuda (default: cuda if available)")
    _add_data_args(p)
    _add_training_args(p)
    _add_eval_args(p)
    a("--seed", type=int, default=0, help="prompt order, sampling and initialisation (default 0)")
    p.set_defaults(func=_cmd_train)


def _add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data (self-distillation corpus)")
    g.add_argument("--num-prompts", type=int, default=None,
                   help="prompts at most [512 / 65536: CUDA stops at --gen-time-s]")
    g.add_argument("--max-tokens", type=int, default=None, help="tokens per answer [128 / 256]")
    g.add_argument("--gen-time-s", type=float, default=None,
                   help="generation time budget [none / 240]")
    g.add_argument("--gen-batch", type=int, default=None,
                   help="sequences generated at once [128 / 512]")
    g.add_argument("--task-fraction", type=float, default=0.15,
                   help="share of generated tasks (arithmetic, code, letters) among the prompts "
                        "(default 0.15)")
    g.add_argument("--top-k", type=int, default=32,
                   help="teacher tokens kept per position (default 32)")
    g.add_argument("--no-gen-cuda-graphs", dest="gen_cuda_graphs", action="store_false",
                   help="generate with eager CUDA steps (CUDA graphs are on by default)")


def _add_training_args(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("training")
    t.add_argument("--init", choices=INITS, default="random",
                   help="decoder block start: random (default), or a copy of the target's last "
                        "layer")
    t.add_argument("--epochs", type=float, default=None,
                   help="planned passes over the corpus [5 / 10: CUDA stops at --train-time-s]")
    t.add_argument("--batch-size", type=int, default=None, help="sequences per step [16 / 64]")
    t.add_argument("--lr", type=float, default=2e-3,
                   help="peak learning rate, AdamW (default 2e-3)")
    t.add_argument("--warmup-frac", type=float, default=0.05,
                   help="warm-up share of the run (default 0.05)")
    t.add_argument("--min-lr-frac", type=float, default=0.1,
                   help="cosine decay ends at this fraction of --lr (default 0.1)")
    t.add_argument("--hard-weight", type=float, default=None,
                   help="weight of the cross-entropy on the target's argmax [0.5 / 0.5]")
    t.add_argument("--chain-weight", type=float, default=None,
                   help="weight of the draft-2 loss, the head reading its own output [0 / 0.3]")
    t.add_argument("--feature-weight", type=float, default=None,
                   help="weight of the smooth-L1 pull towards the target's next hidden state "
                        "[0 / 0]")
    t.add_argument("--vocab-subset", type=int, default=None,
                   help="softmax over this many candidate tokens, 0 = full vocabulary [4096 / 0]")
    t.add_argument("--train-time-s", "--time-budget-s", dest="train_time_s", type=float,
                   default=None, help="training time cap [420 / 120]")
    t.add_argument("--val-fraction", type=float, default=0.03,
                   help="share of the corpus held out for the top-1 curves (default 0.03)")


def _add_eval_args(p: argparse.ArgumentParser) -> None:
    e = p.add_argument_group("evaluation and budget")
    e.add_argument("--eval-prompts", type=int, default=16,
                   help="held-out prompts measured (default 16)")
    e.add_argument("--eval-tokens", type=int, default=64,
                   help="tokens per held-out answer (default 64)")
    e.add_argument("--deadline-s", type=float, default=None,
                   help="whole-run wall-clock cap: training is shortened to keep evaluation "
                        "inside it [none / 470]")


def _default(args: argparse.Namespace, name: str, gpu: bool):
    value = getattr(args, name)
    return DEFAULTS[name][1 if gpu else 0] if value is None else value




def _settings(args: argparse.Namespace, gpu: bool) -> dict:
    """The run's settings: the flags, unset ones at their [CPU / CUDA] default."""
    cfg = {name: _default(args, name, gpu) for name in DEFAULTS}
    cfg.update(task_fraction=args.task_fraction, top_k=args.top_k, init=args.init, lr=args.lr,
               warmup_frac=args.warmup_frac, min_lr_frac=args.min_lr_frac,
               val_fraction=args.val_fraction, gen_cuda_graphs=args.gen_cuda_graphs,
               seed=args.seed)
    return cfg


def _cmd_train(args: argparse.Namespace) -> int:
    select_triton_mode()  # an entry point: before anything imports triton
    from pdserve.engine.llm import default_device
    from pdserve.engine.model.loader import resolve_model
    from pdserve.engine.spec.mtp_head import save_mtp_head

    t0 = time.monotonic()
    device = args.device or default_device()
    gpu = device.startswith("cuda")
    cfg = _settings(args, gpu)
    deadline = None if cfg["deadline_s"] is None else t0 + cfg["deadline_s"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    source = resolve_model(args.model)
    print(f"train-mtp: model {source.name!r} ({source.path or source.kind}) on {device}; "
          f"settings {json.dumps(cfg)}", file=sys.stderr)
    torch.manual_seed(args.seed)

    # 1-3. the corpus
    samples, model, gen_info, t_load = _build_corpus(args, cfg, source, device, gpu, t0)
    if not samples:
        print("train-mtp: no sequences were generated (raise --gen-time-s)", file=sys.stderr)
        return 1
    t_gen = time.monotonic() - t0 - t_load
    train, val = _split(samples, cfg["val_fraction"], args.seed)
    train_tokens = sum(len(s.tokens) for s in train)
    learn_tokens = sum(len(s.hidden) - s.loss_from for s in train)
    print(f"train-mtp: corpus {len(samples)} sequences, {train_tokens} tokens in training "
          f"({learn_tokens} positions to learn at), {len(val)} sequences held out",
          file=sys.stderr)

    # 4. training
    history: dict = {}
    head, losses = _train(model, train, val, cfg, device, gpu, deadline, args.seed, history)
    t_train = time.monotonic() - t0 - t_load - t_gen
    save_mtp_head(head, out, extra={
        "base_model": source.name, "base_model_file": Path(source.path).name if source.path
        else source.kind, "recipe": "pdserve train-mtp self-distillation",
        "train_tokens": str(train_tokens)})
    curve = history.get("curve", [])
    plot_losses(losses, out.with_suffix(".png"), curve)
    report = _report(source, device, gpu, cfg, gen_info, samples, val, losses, curve,
                     tokens=(train_tokens, learn_tokens), seconds=(t_load, t_gen, t_train))

    def write() -> None:
        out.with_suffix(".json").write_text(json.dumps(report, indent=1))

    write()  # the head, its curve and numbers are on disk before the evaluation starts
    print(f"train-mtp: wrote {out}, {out.with_suffix('.png')}, {out.with_suffix('.json')}",
          file=sys.stderr)

    # 5. acceptance on held-out prompts
    _evaluate(args, out, device, deadline, report, write)
    report["total_s"] = round(time.monotonic() - t0, 1)
    write()
    print(json.dumps({k: v for k, v in report.items() if k not in ("losses", "top1_curve")},
                     indent=1))
    return 0


def _build_corpus(args: argparse.Namespace, cfg: dict, source, device: str, gpu: bool,
                  t0: float) -> tuple[list[Sample], object, dict, float]:
    """Prompts (checked not to overlap the held-out ones), the generation engine, and the
    generated samples. Returns (samples, the target model, generation info, load seconds);
    the engine itself is released (its KV cache and CUDA graphs are not needed any more)."""
    from pdserve.engine.model.loader import load_tokenizer

    n_prompts = cfg["num_prompts"]
    messages = corpus_prompts(n_prompts, args.seed, cfg["task_fraction"])
    held = set(heldout_prompts(len(HELDOUT_TEMPLATES) * len(HELDOUT_TOPICS)))
    if held & set(messages):
        raise AssertionError("train-mtp: held-out prompts leaked into the training prompts")
    prompts = ChatPrompts(load_tokenizer(source), messages)
    longest = max(len(prompts[i]) for i in range(min(len(prompts), 2000)))
    max_len = -(-(longest + 32 + cfg["max_tokens"]) // 64) * 64  # room for longer prompts
    engine = generation_engine(args.model, device, args.seed, max_num_seqs=cfg["gen_batch"],
                               max_model_len=max_len, cuda_graphs=cfg["gen_cuda_graphs"])
    t_load = time.monotonic() - t0
    distinct = len(TRAIN_TEMPLATES) * len(TRAIN_TOPICS)
    temps = [temperature_for(i, distinct) for i in range(n_prompts)]
    store = engine.runner.model.embed_tokens.weight
    gen_info: dict = {"cuda_graphs": getattr(engine.runner, "cuda_graphs", None) is not None}
    samples = generate_corpus(engine, prompts, cfg["max_tokens"], temps, args.seed, cfg["top_k"],
                              time_budget_s=cfg["gen_time_s"], store_device=store.device,
                              store_dtype=store.dtype if gpu else torch.float32, info=gen_info)
    if not samples:
        return samples, None, gen_info, t_load
    model = engine.runner.model
    engine = None  # its KV cache and CUDA graphs are not needed any more
    import gc

    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
    return samples, model, gen_info, t_load


def _split(samples: list[Sample], val_fraction: float,
           seed: int) -> tuple[list[Sample], list[Sample]]:
    """(train, val): a seeded shuffle; val is a val_fraction slice (at most a quarter of the
    corpus, at most 256 sequences) for the top-1 curves."""
    rng = random.Random(seed + 17)
    order = list(range(len(samples)))
    rng.shuffle(order)
    n_val = min(len(samples) // 4, max(1, int(len(samples) * val_fraction))) \
        if len(samples) >= 4 else 0
    val = [samples[i] for i in order[:n_val]][:256]
    train = [samples[i] for i in order[n_val:]]
    return train, val


def _train(model, train: list[Sample], val: list[Sample], cfg: dict, device: str, gpu: bool,
           deadline: float | None, seed: int, history: dict) -> tuple[object, list[float]]:
    """train_head with the run's settings, its time budget shortened to keep the evaluation
    inside --deadline-s."""
    train_budget = cfg["train_time_s"]
    eval_reserve = 60.0 if gpu else 0.0
    if deadline is not None:
        train_budget = max(10.0, min(train_budget, deadline - time.monotonic() - eval_reserve))
    return train_head(
        model, train, torch.device(device), epochs=cfg["epochs"], batch_size=cfg["batch_size"],
        lr=cfg["lr"], time_budget_s=train_budget, chain_weight=cfg["chain_weight"],
        seed=seed, vocab_subset=cfg["vocab_subset"], hard_weight=cfg["hard_weight"],
        feature_weight=cfg["feature_weight"], init=cfg["init"], val_samples=val,
        warmup_frac=cfg["warmup_frac"], min_lr_frac=cfg["min_lr_frac"], history=history)


def _report(source, device: str, gpu: bool, cfg: dict, gen_info: dict, samples: list[Sample],
            val: list[Sample], losses: list[float], curve: list[dict], *,
            tokens: tuple[int, int], seconds: tuple[float, float, float]) -> dict:
    """The run's <out>.json: settings, versions, corpus and training numbers, timings
    (load, generate, train), the top-1 curves and the losses."""
    train_tokens, learn_tokens = tokens
    t_load, t_gen, t_train = seconds
    return {"model": source.name, "model_path": source.path, "device": device,
            "device_name": torch.cuda.get_device_name() if gpu else "cpu",
            "command": " ".join(["pdserve train-mtp"] + sys.argv[2:]) if len(sys.argv) > 1
            else "pdserve train-mtp",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "settings": cfg,
            "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
            "generation": gen_info, "num_sequences": len(samples),
            "train_tokens": train_tokens, "train_positions": learn_tokens,
            "val_sequences": len(val), "steps": len(losses),
            "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
            "load_s": round(t_load, 1), "generate_s": round(t_gen, 1),
            "train_s": round(t_train, 1), "top1_curve": curve,
            "peak_gpu_memory_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1)
            if gpu else None,
            "val_top1": curve[-1].get("top1") if curve else None,
            "train_top1": curve[-1].get("train_top1") if curve else None,
            "losses": losses}


def _evaluate(args: argparse.Namespace, out: Path, device: str, deadline: float | None,
              report: dict, write) -> None:
    """First-draft acceptance at k=1 and accepted length at k=3 on held-out prompts, into
    report (written after each); k=3 is skipped when --deadline-s is near."""
    held_msgs = heldout_prompts(args.eval_prompts)
    for k in (1, 3):
        if deadline is not None and k > 1 and time.monotonic() > deadline - 15:
            report[f"eval_k{k}"] = "skipped: --deadline-s reached"
            continue
        t = time.monotonic()
        report[f"eval_k{k}"] = measure_acceptance(args.model, str(out), held_msgs, k,
                                                  args.eval_tokens, device)
        report[f"eval_k{k}"]["seconds"] = round(time.monotonic() - t, 1)
        write()
