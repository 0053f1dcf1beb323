"""A port already taken stops `pdserve serve` at once, naming the port and its flag, before
Ray or any worker starts; gRPC servers do not share a port (no SO_REUSEPORT)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from pdserve.proto.rpc import make_server

from tests.router.harness import REPO


@pytest.fixture
def taken_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:  # listening: the port is in use
        yield s.getsockname()[1]


@pytest.mark.parametrize("flag", ["--port", "--grpc-port"])
def test_serve_on_a_taken_port_fails_naming_it_and_starts_no_ray(taken_port, flag) -> None:
    other = "--grpc-port" if flag == "--port" else "--port"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-m", "pdserve.router.cli", "serve", flag,
                          str(taken_port), other, "0"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"{flag}: 127.0.0.1:{taken_port} is in use" in res.stderr
    assert "launched" not in res.stdout and "Ray" not in res.stdout + res.stderr


def test_a_second_grpc_server_cannot_share_a_port() -> None:
    first, port = make_server("127.0.0.1", 0)
    first.start()
    try:
        with pytest.raises((OSError, RuntimeError)):
            make_server("127.0.0.1", port)
    finally:
        first.stop(0)
