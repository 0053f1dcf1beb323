"""`pdserve` command line: generate | serve | bench | train-mtp.

Each subcommand lives in its own module; this file only parses arguments and dispatches,
so `pdserve --help` stays cheap (heavy imports happen inside the chosen command).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

from pdserve.engine.core.config import MAX_SPECULATIVE_TOKENS, ConfigError
from pdserve.engine.core.engine_args import EngineArgs
from pdserve.kernels.triton_mode import select_triton_mode


def _int_arg(text: str, lo: int, hi: int | None = None) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if n < lo or (hi is not None and n > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise argparse.ArgumentTypeError(f"must be {bound}, got {n}")
    return n


def _speculative_tokens(text: str) -> int:
    return _int_arg(text, 1, MAX_SPECULATIVE_TOKENS)


def _draft_vocab(text: str) -> int:
    return _int_arg(text, 0)  # 0 = the full vocabulary


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """--speculative / --num-speculative-tokens / --mtp-head (vLLM/SGLang-style names),
    shared by `generate` and `serve`."""
    p.add_argument("--speculative", choices=("mtp", "none"), default="none",
                   help="speculative decoding: 'mtp' drafts with the model's MTP head (the "
                        "checkpoint's MTP layers, --mtp-head, or the trained head shipped for "
                        "the default model); greedy output is unchanged (default: none)")
    p.add_argument("--num-speculative-tokens", type=_speculative_tokens, default=None,
                   metavar="K", help="draft tokens per step with --speculative mtp, 1..16 "
                                     "(default 1; larger batches draft fewer, none above 48)")
    p.add_argument("--mtp-head", default=None, metavar="PATH",
                   help="MTP head file from `pdserve train-mtp` (with --speculative mtp)")
    p.add_argument("--draft-vocab", type=_draft_vocab, default=None, metavar="N",
                   help="draft over the lowest N token ids (+ EOS) only, as SGLang's "
                        "--speculative-token-map: a cheaper draft LM head, verification "
                        "unchanged (with --speculative mtp; default: the full vocabulary)")
    p.add_argument("--quantization", choices=("fp8",), default=None,
                   help="fp8: quantize a float checkpoint's linear layers block-wise (128x128 "
                        "e4m3) at load; FP8 checkpoints load as FP8 without it (default: none)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="fp8: the KV cache holds e4m3 values with a scale per block, layer "
                        "and KV head (half the bytes of bf16); auto: the model dtype")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="on CUDA, take requests without first running serving's step shapes "
                        "(Triton then compiles inside the first served steps)")


def check_speculative(args: argparse.Namespace, check_files: bool = True) -> str | None:
    """The first bad speculative flag, as a message naming it; None when fine. The rules are
    EngineArgs' (the one place they live); its field names come back as flags. Turns
    --speculative none into None and --mtp-head into an absolute path."""
    if args.speculative == "none":
        args.speculative = None
    try:
        EngineArgs(speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
                   mtp_head=args.mtp_head, draft_vocab=args.draft_vocab)
    except ConfigError as e:
        field, _, rest = str(e).partition(":")  # "draft_vocab: needs speculative='mtp'"
        flag = "--" + field.replace("_", "-")
        return flag + ":" + rest.replace("speculative='mtp'", "--speculative mtp")
    if args.mtp_head is not None and check_files:
        if not os.path.isfile(args.mtp_head):
            return f"--mtp-head: no such file: {args.mtp_head!r}"
        args.mtp_head = os.path.abspath(args.mtp_head)  # Ray workers have their own cwd
    return None


def engine_args(args: argparse.Namespace, **fields: object) -> EngineArgs:
    """The EngineArgs of a command: --model and the speculative flags, plus `fields`
    (after check_speculative). EngineArgs validates and names a bad field."""
    return EngineArgs(model=args.model, speculative=args.speculative,
                      num_speculative_tokens=args.num_speculative_tokens,
                      mtp_head=args.mtp_head, draft_vocab=args.draft_vocab,
                      quantization=getattr(args, "quantization", None),
                      kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                      warmup=getattr(args, "warmup", True),
                      **fields)  # type: ignore[arg-type]


def worker_roles(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(role, workers of it) that `serve` launches."""
    if args.colocated:
        return [("colocated", args.replicas)]
    return [("prefill", args.prefill), ("decode", args.decode)]


def role_tp(args: argparse.Namespace) -> dict[str, int]:
    """The tensor-parallel size of each role's workers (colocated ones take --decode-tp)."""
    return {"prefill": args.prefill_tp, "decode": args.decode_tp, "colocated": args.decode_tp}


def check_tp(args: argparse.Namespace, model_config: object) -> str | None:
    """The first TP flag the model or the other flags cannot run with, naming it: the heads,
    KV heads, MLP and vocabulary must split (engine/core/tp.py), and what TP does not run yet
    (engine/dist/rank.py check_tp_args) is refused here rather than in every worker."""
    from pdserve.engine.dist.heads import check_model_split
    from pdserve.engine.dist.rank import check_tp_args
    from pdserve.engine.dist.shard import fp8_split_problem
    block = _fp8_source_block(args)
    for role, _ in worker_roles(args):
        tp = role_tp(args)[role]
        flag = "--prefill-tp" if role == "prefill" else "--decode-tp"
        try:
            check_model_split(model_config, tp)
            check_tp_args(engine_args(args, tensor_parallel_size=tp))
        except ConfigError as e:
            return f"{flag} {tp}: {e}"
        problem = fp8_split_problem(model_config, tp, block) if block and tp > 1 else None
        if problem:
            return f"{flag} {tp}: {problem}"
    return None


def _fp8_source_block(args: argparse.Namespace) -> tuple[int, int] | None:
    """The scale block of weights that are FP8 before they are sharded: a block-FP8
    checkpoint's, or a preset drawn in FP8 (--quantization fp8). A float checkpoint with
    --quantization fp8 quantizes each rank's shard after the split, so nothing to check."""
    from pdserve.engine.model.fp8 import DEFAULT_BLOCK
    from pdserve.engine.model.loader import resolve_model
    from pdserve.engine.model.weights import read_hf_config_quant

    source = resolve_model(args.model)
    if source.kind == "preset":
        return DEFAULT_BLOCK if getattr(args, "quantization", None) == "fp8" else None
    if source.kind != "hf":
        return None
    quant = read_hf_config_quant(source.path)[1]
    return quant.block if quant is not None and quant.strategy == "block" else None


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream one completion to stdout (offline engine)")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", default=None,
                   help="HF folder, .gguf file or preset name (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    p.add_argument("--tensor-parallel-size", type=lambda t: _int_arg(t, 1), default=1,
                   metavar="N", help="run the model across N devices (ranks) (default 1)")
    add_speculative_args(p)
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    select_triton_mode()  # an entry point: before anything imports triton
    problem = check_speculative(args)
    if problem:
        print(f"pdserve generate: {problem}", file=sys.stderr)
        return 2
    from pdserve.engine.core.config import ConfigError
    from pdserve.engine.core.sampling_params import InvalidRequestError, SamplingParams
    from pdserve.engine.dist.group import GroupError
    from pdserve.engine.llm import LLM
    from pdserve.engine.model.weights import WeightsError

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    except InvalidRequestError as e:
        print(f"pdserve generate: {e}", file=sys.stderr)
        return 2
    if args.device is not None and not (args.device == "cpu" or args.device.startswith("cuda")):
        print(f"pdserve generate: --device: must be cpu or cuda, got {args.device!r}",
              file=sys.stderr)
        return 2
    if args.device is not None and args.device.startswith("cuda") and not torch_has_cuda():
        print(f"pdserve generate: --device: {args.device!r}, but this torch sees no CUDA "
              "device (use --device cpu)", file=sys.stderr)
        return 2
    try:
        llm = LLM(engine_args(args, device=args.device,
                              tensor_parallel_size=args.tensor_parallel_size))
    except (ConfigError, WeightsError) as e:  # a missing model or weights, a head trained
        # for another model, a model without one
        print(f"pdserve generate: {e}", file=sys.stderr)
        return 2
    except GroupError as e:  # tensor parallel ranks that did not join in time
        print(f"pdserve generate: {e}", file=sys.stderr)
        return 1
    try:
        return _stream(llm, args, params)
    finally:
        llm.close()  # the follower ranks of --tensor-parallel-size N


def _stream(llm: object, args: argparse.Namespace, params: object) -> int:
    from pdserve.engine.core.sampling_params import InvalidRequestError
    from pdserve.engine.dist.group import GroupError

    prompt = args.prompt
    if args.chat:
        prompt = llm.chat_prompt([{"role": "user", "content": prompt}])
    try:
        for delta in llm.stream(prompt, params):
            sys.stdout.write(delta)
            sys.stdout.flush()
    except InvalidRequestError as e:
        print(f"\npdserve generate: {e}", file=sys.stderr)
        return 2
    except GroupError as e:  # a rank died mid-generation
        print(f"\npdserve generate: {e}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    for module in _EXTRA_COMMANDS.values():
        if importlib.util.find_spec(module) is None:
            continue  # a command whose module is not part of this build
        importlib.import_module(module).add_parser(sub)
    return parser


# subcommands contributed by other modules: each exposes add_parser(sub) -> sets func
_EXTRA_COMMANDS = {"serve": "pdserve.router.launch", "bench": "pdserve.bench.cli",
                   "train-mtp": "pdserve.engine.train_mtp"}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())


def torch_has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
