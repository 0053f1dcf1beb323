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


@pytest.mark.parametrize("argv, flag", [
    (["--max-restarts", "-2"], "--max-restarts"),
    (["--exit-after-unavailable", "-1"], "--exit-after-unavailable"),
    (["--exit-after-unavailable", "nan"], "--exit-after-unavailable"),
    (["--prefill-timeout", "0"], "--prefill-timeout"),
    (["--stall-timeout", "-1"], "--stall-timeout"),
    (["--stall-timeout", "5"], "--stall-timeout"),
    (["--node-label", "pdserve role"], "--node-label"),
    (["--port", "18123", "--grpc-port", "18123"], "--grpc-port"),
    (["--device", "gpu"], "--device"),
    (["--max-model-len", "-5"], "--max-model-len"),
    (["--num-blocks", "0"], "--num-blocks"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["--node-label", ""], "--node-label"),
    (["--cluster-secret-file", "/nonexistent/secret"], "--cluster-secret-file"),
])
def test_bad_lifecycle_and_secret_flags_are_named(argv, flag) -> None:
    from pdserve.router.cli import build_parser
    from pdserve.router.serve_args import check_serve_args as _check

    assert _check(build_parser().parse_args(["serve", *argv])).startswith(f"{flag}:")


def test_a_short_secret_file_is_refused(tmp_path) -> None:
    from pdserve.proto.rpc import read_secret_file

    (tmp_path / "s").write_text("short\n")
    with pytest.raises(ValueError, match="^--cluster-secret-file: must be a string of at least"):
        read_secret_file(str(tmp_path / "s"))
    (tmp_path / "s").write_text("x" * 40 + "\n")  # a trailing newline is not part of it
    assert read_secret_file(str(tmp_path / "s")) == "x" * 40


def test_exit_after_unavailable_waits_out_the_grace_period() -> None:
    """The --exit-after-unavailable watchdog returns once no decode worker has been up for
    the grace period, and not while one is up."""
    import asyncio
    import types

    from pdserve.router.launch import _unavailable_for

    worker = types.SimpleNamespace(up=True)
    pool = types.SimpleNamespace(by_role=lambda *roles: [worker])

    async def main() -> tuple[bool, bool]:
        watch = asyncio.create_task(_unavailable_for(pool, grace_s=0.6))
        await asyncio.sleep(1.2)
        while_up = watch.done()
        worker.up = False
        await asyncio.wait_for(watch, 5)
        return while_up, watch.done()

    assert asyncio.run(main()) == (False, True)


def test_a_model_no_worker_could_load_is_refused_before_ray_starts(tmp_path) -> None:
    """Said once by `pdserve serve`, exit 2, naming --model: a folder whose config.json is
    fine but whose weights are missing (every worker would fail on it), a Hub id (pdserve
    does not download), a path that does not exist."""
    import json
    import subprocess
    import sys

    folder = tmp_path / "no-weights"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 128,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}))
    for model, says in ((str(folder), "no model.safetensors"),
                        ("Qwen/Qwen3-0.6B", "huggingface-cli download Qwen/Qwen3-0.6B"),
                        (str(tmp_path / "nothing"), "is not an existing")):
        proc = subprocess.run([sys.executable, "-m", "pdserve.router.cli", "serve", "--model",
                               model, "--port", "0", "--grpc-port", "0"],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (model, proc.stdout, proc.stderr)
        assert proc.stderr.startswith("pdserve serve: --model: ") and says in proc.stderr, \
            proc.stderr
        assert "Traceback" not in proc.stderr and "starting Ray" not in proc.stdout
