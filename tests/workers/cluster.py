"""Test helpers: a real local Ray instance, worker actors, gRPC stubs to them."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import ray

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pbg
from pdserve.proto.rpc import make_channel
from pdserve.router.pool import ADD_PEER_TIMEOUT_S
from pdserve.worker.actor import launch_worker
from pdserve.worker.config import WorkerConfig
from pdserve.worker.local_ray import start_local_ray

from tests.cluster_secret import SECRET


@dataclass
class Worker:
    actor: ray.actor.ActorHandle
    cfg: WorkerConfig
    address: str
    stub: pbg.WorkerStub
    channel: grpc.Channel

    def health(self) -> pb.HealthResponse:
        return self.stub.Health(pb.HealthRequest(), timeout=10)

    def refresh(self, timeout_s: float = 120) -> None:
        """Re-read endpoints (after a restart: new port, new incarnation)."""
        ep = ray.get(self.actor.endpoints.remote(), timeout=timeout_s)
        self.channel.close()
        self.address = ep["grpc_address"]
        self.channel = make_channel(self.address, cluster_secret=SECRET)
        self.stub = pbg.WorkerStub(self.channel)


def start_ray() -> None:
    """The test process's local Ray instance, started once (worker.local_ray retries a head
    whose GCS misses Ray's port deadline on a loaded machine)."""
    if not ray.is_initialized():
        # the worker actors take no CPU resource (start_worker): 2 CPUs, not the machine's,
        # so Ray prestarts 2 idle workers while the test process waits for its actors
        start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False,
                        configure_logging=False)


def start_worker(role: str, worker_id: str, timeout_s: float = 300,
                 node_labels: dict[str, str] | None = None, **kw: object) -> Worker:
    cfg = WorkerConfig.of(role, worker_id, SECRET, metrics_port=0, **kw)
    actor = launch_worker(cfg, num_cpus=0, node_labels=node_labels)
    ep = ray.get(actor.endpoints.remote(), timeout=timeout_s)
    ch = make_channel(ep["grpc_address"], cluster_secret=SECRET)
    return Worker(actor, cfg, ep["grpc_address"], pbg.WorkerStub(ch), ch)


def introduce(prefill: Worker, decode: Worker) -> pb.AddPeerReply:
    """The router's introduction, with its deadline: AddPeer may take the TP fan-out's 4.5 s
    and the warm-up read's 10 (a 10 s deadline here failed once on a loaded 2-core CI run)."""
    info = prefill.stub.GetPeerInfo(pb.GetPeerInfoRequest(), timeout=10)
    return decode.stub.AddPeer(info, timeout=ADD_PEER_TIMEOUT_S)


def prefill(p: Worker, rid: str, prompt: list[int], params: pb.SamplingParams,
            timeout_s: float = 60) -> pb.PrefillResult:
    return p.stub.Prefill(pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt,
                                            params=params, timeout_s=timeout_s),
                          timeout=timeout_s + 5)


def decode_stream(d: Worker, rid: str, prompt: list[int], params: pb.SamplingParams,
                  result: pb.PrefillResult | None = None,
                  timeout_s: float = 60) -> Iterator[pb.DecodeOutput]:
    req = pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt, params=params,
                           timeout_s=timeout_s)
    if result is not None:
        req.prefill.CopyFrom(result)
    return d.stub.Decode(req, timeout=timeout_s + 5)


def tokens_of(stream: Iterator[pb.DecodeOutput]) -> tuple[list[int], str]:
    toks: list[int] = []
    reason = ""
    for out in stream:
        toks += list(out.token_ids)
        reason = out.finish_reason or reason
    return toks, reason


def wait_until(cond: Callable[[], object], timeout_s: float, what: str) -> object:
    """Poll cond() until truthy and return its value (AssertionError at the deadline)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def idle(w: Worker) -> bool:
    """No running/waiting/held requests, nothing pinned, every block free or cached (by a
    fresh snapshot: "busy" answers carry the last one)."""
    h = w.health()
    return (h.status == "ok" and h.num_running == 0 and h.num_waiting == 0 and h.num_pinned_blocks == 0
            and h.num_held_requests == 0 and h.num_free_blocks == h.num_total_blocks)


def scrape(w: Worker) -> str:
    """The worker's Prometheus exposition text."""
    import urllib.request

    ep = ray.get(w.actor.endpoints.remote(), timeout=30)
    with urllib.request.urlopen(f"http://{ep['metrics_address']}/metrics", timeout=5) as r:
        return r.read().decode()


def metric_value(text: str, name: str) -> float:
    """Sum of a metric's samples over all label sets."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))
