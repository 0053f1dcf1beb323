"""The security defaults of ANCHORS.md's "Security lessons", pinned so that a regression fails:

- a Ray head that `pdserve serve` starts has token authentication on and no dashboard
  (ShadowRay, CVE-2023-48022);
- the router (HTTP and gRPC) and the workers bind 127.0.0.1 unless told otherwise
  (vLLM CVE-2025-30202);
- no module that talks on a socket imports pickle or a pickling transport (vLLM
  CVE-2025-30165 / CVE-2025-47277, Mooncake CVE-2025-32444, SGLang CVE-2025-10164);
- with an API key, every Pdserve gRPC method but Health refuses a call without it.

Nothing here starts Ray: the Ray head's process is replaced by a stand-in that records its
command line and environment.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import ipaddress
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import types

import grpc
import pytest
from google.protobuf import message_factory

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pbg
from pdserve.proto.rpc import CLUSTER_SECRET_HEADER, auth_metadata, make_channel

REPO = pathlib.Path(__file__).resolve().parents[2]
RAY_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


# ---------------------------------------------------------------------------- Ray head


class _FakeHeadProcess:
    """Stands in for subprocess.Popen in worker/local_ray.py: records what RayHead.start
    would run and says "Ray runtime started" in the head's log, as `ray start` does."""

    calls: list[dict] = []

    def __init__(self, cmd, env=None, stdout=None, **kwargs) -> None:
        _FakeHeadProcess.calls.append({"cmd": list(cmd), "env": dict(env), **kwargs})
        stdout.write("Ray runtime started.\n")
        stdout.flush()
        self.pid = None  # never signalled: these tests never stop() the head

    def poll(self) -> None:
        return None


def test_ray_head_runs_without_dashboard_and_keeps_the_auth_token(monkeypatch, tmp_path):
    """RayHead.start runs `ray start --head` with the dashboard off, and hands the head the
    token-auth environment it is given (it must not drop RAY_AUTH_MODE / RAY_AUTH_TOKEN)."""
    from pdserve.worker import local_ray

    _FakeHeadProcess.calls = []
    monkeypatch.setattr(local_ray, "subprocess", types.SimpleNamespace(
        Popen=_FakeHeadProcess, DEVNULL=subprocess.DEVNULL, STDOUT=subprocess.STDOUT,
        TimeoutExpired=subprocess.TimeoutExpired))
    head = local_ray.RayHead("127.0.0.1", str(tmp_path / "head.log"))
    token = "f" * 64
    try:
        address = head.start({"PATH": os.environ.get("PATH", ""), "RAY_AUTH_MODE": "token",
                              "RAY_AUTH_TOKEN": token}, timeout_s=10)
    finally:
        head.proc = None  # a stand-in: nothing to stop
        shutil.rmtree(head.temp_dir, ignore_errors=True)
    [call] = _FakeHeadProcess.calls
    cmd, env = call["cmd"], call["env"]
    assert cmd[1:5] == ["-m", "pdserve.worker.local_ray", "start", "--head"], cmd
    _check_no_dashboard(cmd)
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN"] == token, env
    assert address.startswith("127.0.0.1:")


def _check_no_dashboard(cmd: list[str]) -> None:
    assert "--include-dashboard=false" in cmd, f"the Ray head starts a dashboard: {cmd}"
    assert not any(a.startswith(("--include-dashboard=true", "--dashboard-host")) for a in cmd), cmd


# `pdserve serve` with no RAY_AUTH_* in its environment, run up to the point where the Ray
# head would start: the head's process and ray.init are stand-ins; what they were given is
# printed as JSON. It runs in a subprocess so that `ray` is not imported yet, as in a real
# `pdserve serve` (serve configures Ray's token before Ray is imported).
_SERVE_UP_TO_RAY = textwrap.dedent("""
    import json, os, shutil, subprocess, sys, types

    if os.environ.get("IMPORT_RAY_FIRST"):  # an embedding program that imported ray already
        import ray  # noqa: F401
    from pdserve.router import cli, launch
    from pdserve.worker import local_ray

    seen = {"ray_imported_at_start": "ray" in sys.modules}

    class FakeHeadProcess:
        def __init__(self, cmd, env=None, stdout=None, **kwargs):
            seen["head_cmd"], seen["head_env"] = list(cmd), {
                k: v for k, v in env.items() if k.startswith("RAY_AUTH")}
            stdout.write("Ray runtime started.\\n")
            stdout.flush()
            self.pid = None

        def poll(self):
            return None

    local_ray.subprocess = types.SimpleNamespace(
        Popen=FakeHeadProcess, DEVNULL=subprocess.DEVNULL, STDOUT=subprocess.STDOUT,
        TimeoutExpired=subprocess.TimeoutExpired)

    async def serve_up_to_ray(args):
        import ray

        ray.init = lambda **kw: seen.setdefault("ray_init", kw)
        head = launch._start_ray(args, namespace=f"security-test-{os.getpid()}")
        seen["client_env"] = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
        shutil.rmtree(head.temp_dir, ignore_errors=True)
        os.remove(head.log_path)
        return 0

    launch._serve = serve_up_to_ray
    seen["rc"] = cli.main(["serve", "--port", "0", "--grpc-port", "0"])
    print("SEEN " + json.dumps(seen))
""")


@pytest.mark.parametrize("ray_first", [False, True], ids=["cli", "ray_imported_first"])
def test_serve_starts_its_ray_head_with_token_auth_and_no_dashboard(ray_first):
    """The whole chain of `pdserve serve` without --address: it turns token auth on with a
    fresh token before Ray is imported, the head it starts gets that token and no dashboard,
    and this process's Ray client joins with the same token. With ray imported before serve
    runs (too late for serve to set the token first), the head still gets one."""
    env = {k: v for k, v in os.environ.items()
           if k not in RAY_AUTH_VARS and k not in ("RAY_ADDRESS", "PDSERVE_API_KEY")}
    if ray_first:
        env["IMPORT_RAY_FIRST"] = "1"
    out = subprocess.run([sys.executable, "-c", _SERVE_UP_TO_RAY], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stdout.splitlines() if line.startswith("SEEN ")]
    assert out.returncode == 0 and lines, f"rc {out.returncode}\n{out.stdout}\n{out.stderr}"
    seen = json.loads(lines[-1].removeprefix("SEEN "))
    assert seen["rc"] == 0
    assert seen["ray_imported_at_start"] == ray_first, "pdserve's CLI imports ray before serve sets its auth"
    head_env = seen["head_env"]
    assert head_env.get("RAY_AUTH_MODE") == "token", f"the Ray head runs without token auth: {head_env}"
    token = head_env.get("RAY_AUTH_TOKEN") or ""
    assert len(token) >= 32 and token.strip() == token, "the Ray head's token is empty or short"
    assert seen["client_env"] == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    _check_no_dashboard(seen["head_cmd"])
    assert seen["ray_init"]["address"].startswith("127.0.0.1:")


# ---------------------------------------------------------------------------- bind addresses


def _is_loopback(host: str) -> bool:
    ip = ipaddress.ip_address(host.split("%")[0])
    # gRPC listens on an IPv6 socket bound to ::ffff:127.0.0.1 (IPv4 loopback, mapped)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def test_serve_binds_loopback_by_default():
    """`pdserve serve` with no flags: HTTP and gRPC (--host) and the workers (--worker-host)
    bind 127.0.0.1; so do start_stack and WorkerConfig when their callers give no host."""
    from pdserve.router import cli
    from pdserve.router.launch import start_stack
    from pdserve.worker.config import WorkerConfig

    args = cli.build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1", f"--host defaults to {args.host!r}"
    assert args.worker_host == "127.0.0.1", f"--worker-host defaults to {args.worker_host!r}"
    assert args.address is None  # no --address: serve starts its own (token-auth) Ray head
    assert inspect.signature(start_stack).parameters["host"].default == "127.0.0.1"
    host = {f.name: f.default for f in dataclasses.fields(WorkerConfig)}["host"]
    assert host == "127.0.0.1", f"WorkerConfig.host defaults to {host!r}"


def test_router_listens_on_loopback_only(cluster):
    """A router started with no host (as the harness starts it) has its HTTP and gRPC
    sockets on 127.0.0.1 only: nothing listens on another interface on their ports."""
    import psutil

    rt = cluster
    ports = {"http": rt.stack.http_port, "grpc": rt.stack.grpc_port}
    listening = [c.laddr for c in psutil.Process().net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    for name, port in ports.items():
        hosts = {addr.ip for addr in listening if addr.port == port}
        assert hosts, f"nothing listens on the {name} port {port}"
        assert all(_is_loopback(h) for h in hosts), f"{name} listens on {sorted(hosts)}"


def test_tensor_parallel_store_listens_on_its_host_only():
    """The TCP store a TP worker's ranks join (unauthenticated; their step messages pass
    through it) listens on init_address's host only. torch's store server, given a host,
    still listens on every interface (::); engine/dist/group.open_store binds it."""
    import psutil

    from pdserve.engine.dist.config import ParallelConfig
    from pdserve.engine.dist.group import open_store

    store = open_store(ParallelConfig(tp_size=2, rank=0, init_address="tcp://127.0.0.1:0",
                                      timeout_s=5))
    try:
        hosts = {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port}
        assert hosts and all(_is_loopback(h) for h in hosts), f"the store listens on {hosts}"
        follower = open_store(ParallelConfig(tp_size=2, rank=1, timeout_s=5,
                                             init_address=f"tcp://127.0.0.1:{store.port}"))
        store.set("k", "v")
        assert follower.get("k") == b"v"  # still a working store
    finally:
        del store


# ---------------------------------------------------------------------------- no pickle

# every package that serves or calls a socket; engine/dist carries the tensor-parallel
# messages (TCPStore, collectives) between a worker's ranks
SOCKET_PACKAGES = ("router", "worker", "kv_transfer", "prefill_worker", "decode_worker", "proto",
                   "engine/dist")
# modules that deserialize code-bearing bytes, and transports built on them
BANNED_MODULES = frozenset({"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal",
                            "shelve", "joblib", "jsonpickle", "zmq"})
BANNED_DOTTED = ("ray.cloudpickle", "multiprocessing.connection", "multiprocessing.managers")


def _banned(name: str) -> bool:
    return bool(set(name.split(".")) & BANNED_MODULES) or \
        any(name == d or name.startswith(d + ".") for d in BANNED_DOTTED)


def banned_imports(source: str, filename: str = "<source>") -> list[str]:
    """'line: name' for each import of a banned module in `source` (import, from-import,
    importlib.import_module / __import__ with a literal name)."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in (
                "__import__", "importlib.import_module", "import_module") and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            names = [node.args[0].value]
        found += [f"{node.lineno}: {n}" for n in names if _banned(n)]
    return found


@pytest.mark.parametrize("source", [
    "import pickle", "import pickle as p", "from pickle import loads", "import _pickle",
    "import cloudpickle", "from ray import cloudpickle", "import ray.cloudpickle",
    "import dill", "import marshal", "import zmq", "from zmq.asyncio import Context",
    "from multiprocessing.connection import Listener", "import importlib\nimportlib.import_module('dill')",
    "__import__('pickle')", "def f():\n    import pickle\n",
])
def test_pickle_scan_catches(source):
    """The scanner itself: each way of importing a banned module is found."""
    assert banned_imports(source), source


def test_pickle_scan_passes_plain_imports():
    assert banned_imports("import json\nimport grpc\nfrom ray import remote\nimport picklable\n") == []


def _socket_modules() -> list[pathlib.Path]:
    return sorted(p for pkg in SOCKET_PACKAGES for p in (REPO / pkg).rglob("*.py")
                  if "_pb2" not in p.name)


def test_no_pickle_on_any_socket():
    """No module of the packages that serve or call sockets imports pickle, cloudpickle,
    dill, marshal, zmq or a pickling transport: messages are protobuf (or fixed binary
    headers and JSON) only."""
    files = _socket_modules()
    rel = {str(p.relative_to(REPO)) for p in files}
    # the scan covers what it should (a moved folder must not make it pass vacuously)
    assert {"router/grpc_server.py", "worker/server.py", "kv_transfer/handshake.py",
            "proto/rpc.py", "prefill_worker/service.py", "decode_worker/service.py",
            "engine/dist/protocol.py"} <= rel
    assert not any("_pb2" in f for f in rel)
    offenders = {}
    for path in files:
        hits = banned_imports(path.read_text(), str(path))
        if hits:
            offenders[str(path.relative_to(REPO))] = hits
    assert not offenders, "pickle-family imports in socket-facing code: " + "; ".join(
        f"{f} (line {', line '.join(h)})" for f, h in sorted(offenders.items()))


# ---------------------------------------------------------------------------- gRPC auth

KEY = "security-test-key"


@pytest.fixture(scope="module")
def cluster():
    """A router (API key KEY) over one fake prefill and one fake decode worker."""
    from pdserve.router.core import RouterConfig
    from pdserve.router.frontend import load_frontend

    from tests.router.fake_worker import FakeRef, FakeWorker
    from tests.router.harness import RouterThread

    ws = [FakeWorker(wid, role).start() for wid, role in (("sec-p0", "prefill"), ("sec-d0", "decode"))]
    cfg = RouterConfig(block_size=16, router_id="router-security")
    rt = RouterThread([FakeRef(w) for w in ws], load_frontend(None), cfg, api_key=KEY)
    yield rt
    rt.stop()
    for w in ws:
        w.stop()


def _pdserve_methods():
    service = pb.DESCRIPTOR.services_by_name["Pdserve"]
    return list(service.methods)


def _call(stub, method, metadata) -> grpc.StatusCode:
    """Call `method` (a MethodDescriptor) with an empty request; the status it ended with."""
    request = message_factory.GetMessageClass(method.input_type)()
    rpc = getattr(stub, method.name)
    arg = iter([request]) if method.client_streaming else request
    try:
        result = rpc(arg, metadata=metadata, timeout=10)
        if method.server_streaming:
            list(result)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_pdserve_service_is_the_one_the_test_walks():
    """The methods come from the proto descriptor (a new RPC is covered automatically); the
    generated stub has each, and the known ones are there (the walk is not empty)."""
    names = [m.name for m in _pdserve_methods()]
    assert {"Generate", "ListModels", "Health"} <= set(names)
    stub = pbg.PdserveStub(grpc.insecure_channel("127.0.0.1:1"))
    assert all(hasattr(stub, n) for n in names)


@pytest.mark.parametrize("what,metadata", [
    ("no key", ()),
    ("a wrong key", auth_metadata("not-" + KEY)),
    ("the key without Bearer", (("authorization", KEY),)),
    ("the key under the cluster-secret header", ((CLUSTER_SECRET_HEADER, KEY),)),
])
def test_grpc_methods_need_the_api_key_but_health(cluster, what, metadata):
    """With --api-key, every Pdserve RPC except Health answers UNAUTHENTICATED to a caller
    without the key; Health answers it (load balancers probe it without a key)."""
    rt = cluster
    with make_channel(rt.grpc_address) as ch:
        stub = pbg.PdserveStub(ch)
        codes = {m.name: _call(stub, m, metadata) for m in _pdserve_methods()}
        health = stub.Health(pb.HealthRequest(), metadata=metadata, timeout=10)
    assert health.status == "ok" and codes.pop("Health") == grpc.StatusCode.OK, what
    refused = {n: c for n, c in codes.items() if c != grpc.StatusCode.UNAUTHENTICATED}
    assert not refused, f"with {what}, these RPCs did not refuse the call: {refused}"


def test_grpc_methods_with_the_api_key_are_not_refused(cluster):
    """The control: with the key, no RPC answers UNAUTHENTICATED (or UNIMPLEMENTED), so the
    refusals above come from the key check."""
    rt = cluster
    with make_channel(rt.grpc_address) as ch:
        stub = pbg.PdserveStub(ch)
        codes = {m.name: _call(stub, m, auth_metadata(KEY)) for m in _pdserve_methods()}
    bad = {n: c for n, c in codes.items()
           if c in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED)}
    assert not bad, bad
    assert codes["ListModels"] == grpc.StatusCode.OK and codes["Health"] == grpc.StatusCode.OK
    # an empty GenerateRequest is a bad request, found after the key check
    assert codes["Generate"] == grpc.StatusCode.INVALID_ARGUMENT
