"""Shared pytest setup: the `gpu` marker skips without CUDA."""
from __future__ import annotations

import pytest

from pdserve.kernels.triton_mode import select_triton_mode

# Test setup is an entry point: Triton's CPU interpreter must be chosen before anything
# imports triton, and importing pdserve never chooses it (kernels/triton_mode.py).
select_triton_mode()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
