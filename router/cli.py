"""`pdserve` command line: generate | serve | bench | train-mtp.

Each subcommand lives in its own module; this file only parses arguments and dispatches,
so `pdserve --help` stays cheap (heavy imports happen inside the chosen command).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys


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
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine.llm import LLM
    from engine.sampling_params import InvalidRequestError, SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    except InvalidRequestError as e:
        print(f"pdserve generate: {e}", file=sys.stderr)
        return 2
    llm = LLM(args.model, device=args.device)
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
    sys.stdout.write("\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    for name, module in _EXTRA_COMMANDS.items():
        if importlib.util.find_spec(module) is None:
            continue  # a command whose module is not part of this build
        importlib.import_module(module).add_parser(sub)
    return parser


# subcommands contributed by other modules: each exposes add_parser(sub) -> sets func
_EXTRA_COMMANDS = {"serve": "router.serve", "bench": "bench.cli", "train-mtp": "engine.train_mtp"}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
