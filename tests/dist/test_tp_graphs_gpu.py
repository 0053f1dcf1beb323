"""Tensor parallelism on two GPUs (NCCL): every rank captures its decode CUDA graphs while
rank 0 captures its own, and replays them in lockstep when rank 0 does (protocol GRAPHED);
overlapped decode launches the next step's graphs on both ranks. Greedy tokens at TP 2, with
graphs and eagerly, equal TP 1's on tiny transformers checkpoints (float32: the ranks' sums
differ from TP 1's only by rounding). The graphs' all-reduces go through peer memory in the
first TP engine with graphs of the pytest process, through NCCL in a later one
(PeerAllReduce.fresh_process). Needs 2 CUDA devices."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.dist.peer_all_reduce import PeerAllReduce
from pdserve.engine.llm import LLM

from tests.dist.tp_models import VOCAB, save_tiny

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def _generate(path: Path, tp: int, graphs: bool) -> tuple[list[list[int]], dict]:
    fresh = PeerAllReduce.fresh_process()  # this process (rank 0) never joined peer memory
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 19, 33)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(str(path), device="cuda", dtype="float32", tensor_parallel_size=tp,
             use_triton=True, use_cuda_graphs=graphs,
             block_size=16, num_blocks=64,
             max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128) as llm:
        tokens = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
        runner = llm.engine.runner
        stats = {"replays": runner.cuda_graphs.replays if runner.cuda_graphs else 0,
                 "ahead_hits": runner.ahead.hits if runner.ahead else 0,
                 "fresh": fresh, "peer": runner.model.tp is not None
                 and runner.model.tp.group.peer is not None}
    return tokens, stats


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_tp2_cuda_graphs_greedy_equals_tp1(tmp_path: Path, family: str) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    path = save_tiny(family, tmp_path / family)
    ref, _ = _generate(path, 1, graphs=True)
    got, stats = _generate(path, 2, graphs=True)
    assert got == ref
    # decode steps replayed graphs on both ranks, and launched-ahead steps were taken
    assert stats["replays"] > 0 and stats["ahead_hits"] > 0, stats
    # the graphs' all-reduces went through peer memory in a process that had not joined it
    # before; in one that had (the second case of this file), through NCCL
    assert stats["peer"] == stats["fresh"], stats
    eager, _ = _generate(path, 2, graphs=False)  # NCCL without graphs: stream-ordered waits
    assert eager == ref
