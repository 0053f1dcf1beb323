"""`pdserve serve` on CUDA asks Ray for one GPU per worker rank; a cluster with fewer is
refused before any worker starts (exit 2, naming the flags and the way out) instead of
leaving workers pending until --startup-timeout."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from pdserve.router.serve_args import add_serve_arguments, gpu_shortfall

from tests.router.harness import REPO


def _args(*flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(list(flags))


@pytest.mark.parametrize("flags,need", [
    ((), 2), (("--prefill", "2", "--decode", "3"), 5),
    (("--prefill-tp", "2", "--decode-tp", "4"), 6), (("--colocated",), 1),
    (("--colocated", "--replicas", "2", "--decode-tp", "2"), 4),
])
def test_one_gpu_per_worker_rank(flags: tuple[str, ...], need: int) -> None:
    args = _args(*flags)
    assert gpu_shortfall(args, need) is None
    short = gpu_shortfall(args, need - 1)
    if need > 1:
        assert short is not None and f"needs {need} GPUs" in short and f"has {need - 1}" in short
        assert "--colocated" in short and "--device cpu" in short
    none = gpu_shortfall(args, 0)  # no GPU at all: --colocated would not help either
    assert none.startswith("--device cuda: this Ray cluster has no GPU") and f"needs {need})" \
        in none and "--device cpu" in none and "--colocated" not in none


def test_serve_on_cuda_without_the_gpus_exits_2_before_any_worker() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-m", "pdserve.router.cli", "serve", "--device", "cuda",
                          "--port", "0", "--grpc-port", "0"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "--device cuda: this Ray cluster has no GPU (--prefill 1 --decode 1 needs 2)" \
        in res.stderr
    assert "launched" not in res.stdout
