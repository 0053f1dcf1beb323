"""A serving tensor-parallel worker with CUDA graphs on two GPUs (worker/tp_worker.py, a real
local Ray instance, NCCL between the ranks): greedy decoding through gRPC equals the offline
engine at TP 1, and both ranks serve decode steps from their graphs, whose all-reduces go
through the peer kernel (engine/dist/peer_all_reduce.py). Then its follower rank
is stopped (SIGSTOP: alive, never in the next collective) in the middle of a long decode: the
stream ends with an error well before its gRPC deadline, and the worker's process ends (the
GPU watchdog or torch's NCCL watchdog, whichever collective is waiting), so the router can
relaunch it. Needs 2 CUDA devices."""
from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
import ray
import torch

from pdserve.proto import pdserve_pb2 as pb

from tests.workers.cluster import decode_stream, start_ray, tokens_of
from tests.workers.tp_cluster import start_tp_worker, stop

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [11, 3, 50, 2, 9], [99, 1, 2, 3, 4, 5, 6, 7, 8, 12, 13]]
ENGINE = dict(device="cuda", dtype="float32", use_triton=True, use_cuda_graphs=True,
              block_size=16, num_blocks=64, max_num_seqs=4)
TP_TIMEOUT_S = 6.0


def _offline(model: str) -> list[list[int]]:
    from pdserve.engine.core.sampling_params import SamplingParams
    from pdserve.engine.llm import LLM

    with LLM(model, **ENGINE) as llm:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        return [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]


def _dead(actor) -> bool:
    try:
        ray.get(actor.ping.remote(), timeout=5)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return True
    return False


def test_tp2_serves_from_graphs_and_a_stopped_rank_ends_the_worker(tmp_path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    from tests.dist.tp_models import save_tiny

    model = str(save_tiny("qwen3", tmp_path / "qwen3"))
    want = _offline(model)
    torch.cuda.empty_cache()
    start_ray()
    d = start_tp_worker("decode", "graphs-d2", model, 2, num_gpus=1,
                        tp_timeout_s=TP_TIMEOUT_S, **ENGINE)
    [follower] = ray.get(d.actor.follower_handles.remote(), timeout=30)
    pid = ray.get(follower.pid.remote(), timeout=30)
    try:
        greedy = pb.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            got = tokens_of(decode_stream(d, f"g-{i}", prompt, greedy))
            assert got == (want[i], "length"), i
        replays = (ray.get(d.actor.graph_replays.remote(), timeout=30),
                   ray.get(follower.graph_replays.remote(), timeout=30))
        assert min(replays) > 0, replays  # both ranks decoded from their graphs
        # their all-reduces went through the peer kernel (every rank joined, or none): each
        # rank actor sees its peer's GPU (worker/rank_gpu.py)
        assert ray.get(d.actor.peer_all_reduce.remote(), timeout=30)

        long = pb.SamplingParams(max_tokens=240, temperature=0.0, ignore_eos=True)
        stream = decode_stream(d, "stalled", PROMPTS[0], long, timeout_s=120)
        tokens, error, start = 0, None, time.monotonic()
        try:
            for out in stream:
                if tokens == 0:
                    os.kill(pid, signal.SIGSTOP)  # mid-decode: the next collective waits
                tokens += len(out.token_ids)
        except grpc.RpcError as e:  # the worker's error, or its process gone
            error = e.code()
        ended_s = time.monotonic() - start
        assert tokens < 240 and error is not None, (tokens, error)
        assert error != grpc.StatusCode.DEADLINE_EXCEEDED, error
        assert ended_s < 10 * TP_TIMEOUT_S, ended_s
        deadline = time.monotonic() + 10 * TP_TIMEOUT_S
        while not _dead(d.actor):  # rank 0 ended its process
            assert time.monotonic() < deadline, "rank 0 still alive"
            time.sleep(1)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        stop(d)
