"""A collective inside a CUDA graph that a peer rank never joins (engine/dist/watchdog.py):
torch's NCCL watchdog does not see it, the group's GpuWatchdog does. Two ranks on two GPUs
capture a graph holding the group's all-reduce and replay it together once; then rank 1 stays
alive but away (as a stopped or stuck process would), rank 0 replays again and its GPU waits
in the all-reduce. The watchdog reports the stall, naming the step it followed, within a few
group timeouts. Needs 2 CUDA devices."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.dist.tp_harness import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

TIMEOUT_S = 4.0  # the group's deadline, hence the watchdog's


def _stall(group, timeout_s: float) -> dict:
    x = torch.full((4, 256), float(group.rank + 1), device=group.cfg.device)
    group.all_reduce(x.clone())  # eager first: the communicator and peer buffers are warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = group.all_reduce(x.clone())
    graph.replay()
    torch.cuda.synchronize()
    first = float(y[0, 0])  # 1 + 2 on both ranks
    seen, messages = threading.Event(), []
    wd = group.watchdog
    wd.on_stall = lambda why: (messages.append(why), seen.set())
    wd.start()
    wd.mark("step message 1 (FORWARD)")  # the first replay's work: completes
    if group.rank == 1:
        time.sleep(6 * timeout_s)  # alive, never in the next all-reduce
        return {"first": first}
    graph.replay()  # waits for rank 1 inside the graph
    wd.mark("step message 2 (FORWARD)")
    stalled = seen.wait(6 * timeout_s)
    return {"first": first, "stalled": stalled, "messages": messages,
            "peer": group.peer is not None}


def test_a_graph_collective_a_peer_never_joins_is_reported_as_a_gpu_stall() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    res = run_ranks(_stall, 2, TIMEOUT_S, timeout_s=TIMEOUT_S, deadline_s=120, cuda=True)
    assert res[1] == {"first": 3.0}, res
    r0 = res[0]
    assert r0["first"] == 3.0 and r0["stalled"], r0
    [why] = r0["messages"]
    # the mark before the stalled replay completed; the one after it never did
    assert "tensor-parallel rank 0" in why and "step message 2 (FORWARD)" in why, why
