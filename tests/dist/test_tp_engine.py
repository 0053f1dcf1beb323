"""The offline engine at tensor_parallel_size N (this process rank 0, N - 1 spawned follower
processes on a real gloo group) generates the same greedy tokens as at TP 1: tiny
transformers checkpoints of Qwen3 (4 heads, 2 KV heads), Llama with 1 KV head (replicated on
both ranks) and Qwen3-MoE (TP inside each expert) at TP 2, and SmolLM2-135M (9 heads, 3 KV
heads) at TP 3 on 8 prompts x 32 tokens; prompt logprobs at TP 2 equal TP 1's. What TP
does not run yet is refused by field (MTP speculation at TP 2: tests/dist/test_tp_spec.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.engine.core.config import ConfigError
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM
from pdserve.worker.config import WorkerConfig

from tests.cluster_secret import SECRET
from tests.dist.tp_models import VOCAB, save_tiny
from tests.router.harness import REPO


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp_models")
    return {f: save_tiny(f, root / f) for f in ("qwen3", "llama_1kv", "qwen3_moe")}


def _prompts(n: int, lengths: tuple[int, ...] = (5, 9, 3, 12)) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (lengths[i % len(lengths)],), generator=g).tolist()
            for i in range(n)]


def greedy(model: str | Path | None, tp: int, prompts: list, max_tokens: int,
           **args: object) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    with LLM(None if model is None else str(model), device="cpu", dtype="float32",
             tensor_parallel_size=tp, **args) as llm:
        return [r.outputs[0].token_ids for r in llm.generate(prompts, params)]


@pytest.mark.parametrize("family", ["qwen3", "llama_1kv", "qwen3_moe"])
def test_tp2_greedy_equals_tp1(tiny_models: dict[str, Path], family: str) -> None:
    prompts = _prompts(4)
    # block_size 4: prompts and outputs cross blocks; max_num_batched_tokens 16 chunks the
    # prefill, so steps mix prefill chunks (no logits rows) with decodes
    args = dict(block_size=4, num_blocks=64, max_num_batched_tokens=16)
    ref = greedy(tiny_models[family], 1, prompts, 10, **args)
    assert greedy(tiny_models[family], 2, prompts, 10, **args) == ref
    assert all(len(t) == 10 for t in ref)


def test_tp2_overlapped_decode_equals_tp1(tiny_models: dict[str, Path]) -> None:
    """overlap_decode='on': rank 0 launches each next decode forward from its sampled ids on
    the device, the follower launches the same with those ids (shared by an all-reduce), and
    the next step takes both launched forwards (or both drop them when the batch changed)."""
    prompts = _prompts(3)
    args = dict(block_size=4, num_blocks=64, max_num_batched_tokens=16)
    ref = greedy(tiny_models["qwen3"], 1, prompts, 10, **args)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    with LLM(str(tiny_models["qwen3"]), device="cpu", dtype="float32", tensor_parallel_size=2,
             overlap_decode="on", **args) as llm:
        got = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
        ahead = llm.engine.runner.ahead
        assert ahead.hits > 0, (ahead.hits, ahead.discards)
        # a request joining mid-decode changes the batch: the launched forward is dropped
        more = llm.generate(prompts[:1], params)[0].outputs[0].token_ids
    assert got == ref and more == ref[0]


def test_tp3_smollm2_135m_greedy_equals_tp1() -> None:
    """The embedded SmolLM2-135M (9 heads, 3 KV heads: one per rank), 5 prompts x 24."""
    prompts = ["The capital of France is", "def fib(n):", "Once upon a time",
               "import numpy as np\n", "1, 2, 3, 5, 8,"]
    ref = greedy(None, 1, prompts, 24, max_model_len=256)
    assert greedy(None, 3, prompts, 24, max_model_len=256) == ref


def test_tp2_prompt_logprobs_equal_tp1(tiny_models: dict[str, Path]) -> None:
    """Prompt logprobs at TP 2: the follower joins each of the leader's LM head calls for
    the prompt rows (two requests' prompts in one step: two calls), then the sampled rows of
    the same step; logprobs, ranks and top ids equal TP 1's, beside a plain request."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (150, 40, 7)]
    params = [SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2),
              SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=0),
              SamplingParams(max_tokens=3, temperature=0)]
    runs = []
    for tp in (1, 2):
        with LLM(str(tiny_models["qwen3"]), device="cpu", dtype="float32", block_size=4,
                 num_blocks=128, max_num_batched_tokens=256, tensor_parallel_size=tp) as llm:
            runs.append(llm.generate(prompts, params))
    ref, got = runs
    assert [len(r.prompt_logprobs or []) for r in got] == [149, 39, 0]
    for a, b in zip(got[:2], ref[:2]):
        assert [lp for _, lp, *_ in a.prompt_logprobs] == pytest.approx(
            [lp for _, lp, *_ in b.prompt_logprobs], abs=1e-4)
        assert [(t, [i for i, _ in top], r) for t, _, top, r in a.prompt_logprobs] == \
            [(t, [i for i, _ in top], r) for t, _, top, r in b.prompt_logprobs]
    assert [r.outputs[0].token_ids for r in got] == [r.outputs[0].token_ids for r in ref]


def test_tp_refuses_what_it_does_not_run_yet(tiny_models: dict[str, Path]) -> None:
    path = str(tiny_models["qwen3"])
    with pytest.raises(ConfigError, match="num_heads"):  # 4 heads over 3 ranks
        LLM(path, device="cpu", tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="draft_vocab"):  # MTP runs (test_tp_spec.py)
        LLM(path, device="cpu", tensor_parallel_size=2, speculative="mtp", draft_vocab=16)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "pdserve.router.cli", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)


def test_generate_cli_runs_tensor_parallel_and_names_a_bad_split() -> None:
    common = ("generate", "The capital of France is", "--max-tokens", "3", "--device", "cpu")
    ok = _cli(*common, "--tensor-parallel-size", "3")
    assert ok.returncode == 0, ok.stderr
    assert "Paris" in ok.stdout
    bad = _cli(*common, "--tensor-parallel-size", "2")  # SmolLM2's 9 heads
    assert bad.returncode == 2 and "num_heads" in bad.stderr, bad.stderr


def test_a_tp_serving_worker_is_launched_by_tp_worker_with_nixl() -> None:
    """A serving worker of TP 2 is N processes with a transport each (worker/tp_worker.py):
    its config takes NIXL, refuses the in-process transport naming kv_transport, and the
    one-process WorkerRuntime refuses to build it, naming the field and the launcher."""
    from pdserve.worker.runtime import build_worker_engine

    cfg = WorkerConfig.of("decode", "d0", SECRET, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="kv_transport: 'inproc'"):
        WorkerConfig.of("decode", "d0", SECRET, tensor_parallel_size=2, kv_transport="inproc")
    with pytest.raises(ValueError, match="engine.tensor_parallel_size: .*launch_tp_worker"):
        build_worker_engine(cfg)


def test_serve_refuses_tp_flags_by_name(tiny_models: dict[str, Path]) -> None:
    """`pdserve serve` checks --prefill-tp / --decode-tp before starting Ray: a size the
    model's heads do not split, a size below 1, --prefill-tp with --colocated."""
    model = str(tiny_models["qwen3"])  # 4 heads, 2 KV heads
    for flags, want in ((["--decode-tp", "3"], "--decode-tp 3: num_heads"),
                        (["--prefill-tp", "0"], "--prefill-tp: must be >= 1"),
                        (["--colocated", "--prefill-tp", "2"], "--prefill-tp: --colocated"),
                        (["--tp-timeout", "0"], "--tp-timeout: must be > 0")):
        r = _cli("serve", "--model", model, "--port", "0", "--grpc-port", "0", *flags)
        assert r.returncode == 2 and want in r.stderr, (flags, r.stderr)


def test_a_killed_follower_fails_generate_with_a_clear_error(tiny_models: dict[str, Path]) -> None:
    """The offline engine's rank 1 process killed between two generate calls: the next
    step's collective fails at once (the peer's socket closed) with a GroupError naming the
    failed collective, instead of hanging; close() still returns."""
    import psutil

    from pdserve.engine.dist.group import GroupError

    llm = LLM(str(tiny_models["qwen3"]), device="cpu", dtype="float32", tensor_parallel_size=2)
    try:
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        assert len(llm.generate([[1, 2, 3]], params)[0].outputs[0].token_ids) == 4
        [follower] = [p for p in psutil.Process().children()
                      if "pdserve.engine.dist.follower" in " ".join(p.cmdline())]
        follower.kill()
        follower.wait(timeout=30)
        with pytest.raises(GroupError, match="rank 0: .* failed"):
            llm.generate([[4, 5, 6]], params)
    finally:
        llm.close()
