"""Tensor parallelism on two GPUs (NCCL): every rank captures its decode CUDA graphs while
rank 0 captures its own, and replays them in lockstep when rank 0 does (protocol GRAPHED);
overlapped decode launches the next step's graphs on both ranks. Greedy tokens at TP 2, with
graphs and eagerly, equal TP 1's on tiny transformers checkpoints (float32: the ranks' sums
differ from TP 1's only by rounding). The graphs' all-reduces go through peer memory in the
first TP engine with graphs of the pytest process, through NCCL in a later one
(PeerAllReduce.fresh_process). With MTP each follower captures rank 0's verify graphs too and
replays them with it. Needs 2 CUDA devices."""
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


def _mtp(folder: Path, tp: int, k: int | None) -> tuple[list[list[int]], tuple, int]:
    """(greedy tokens, (drafts, accepted), verify steps rank 0 replayed from graphs)."""
    from pdserve.engine.core.config import SpecConfig

    from tests.engine.hf_families import prompt

    spec = None if k is None else SpecConfig(num_speculative_tokens=k, batch_k_caps=())
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = [prompt(n, 50 + n) for n in (6, 13, 9)]
    with LLM(str(folder), device="cuda", dtype="float32", tensor_parallel_size=tp,
             speculative=spec, use_triton=True, use_cuda_graphs=True, block_size=16,
             num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
             max_model_len=128) as llm:
        tokens = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
        s = llm.engine.spec_stats
        stats = () if s is None else (s.num_draft_tokens, s.num_accepted_tokens)
        replays = sum(g.replays for g in llm.engine.runner.verify_graphs.values())
    return tokens, stats, replays


@pytest.mark.parametrize("family", ["mimo", "glm4_moe"])
def test_tp2_mtp_verify_steps_replay_graphs_on_every_rank(tmp_path: Path, family: str) -> None:
    """MTP at TP 2 with CUDA graphs: each follower captures the verify graphs rank 0 does
    (RankParts.follower) and replays one when rank 0 does (a rank without one would end with
    a ProtocolError); greedy tokens equal TP 1 without MTP."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    from tests.dist.test_tp_spec import drafting_mtp_layer
    from tests.engine.hf_families import save_checkpoint

    folder = tmp_path / family
    save_checkpoint(family, folder, mtp=True)
    drafting_mtp_layer(family, folder)
    want, _, _ = _mtp(folder, 1, None)
    got, stats, replays = _mtp(folder, 2, 2)
    assert got == want
    assert stats[0] > 0 and stats[1] > 0, stats  # drafts made and accepted
    assert replays > 0  # verify steps ran from graphs at TP 2
