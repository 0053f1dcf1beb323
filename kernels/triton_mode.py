"""Compiled or interpreted Triton: chosen once per process, by an explicit call.

Triton runs kernels in its CPU interpreter only when TRITON_INTERPRET=1 is in the environment
*before triton is first imported* (its own library functions such as tl.sum are decorated at
import). Importing pdserve never sets it: entry points (the `pdserve` command, the Ray worker
actor, `LLM(use_triton=True)`) and the test setup call select_triton_mode() first. This
module does not import triton itself.
"""
from __future__ import annotations

import os
import sys


def select_triton_mode() -> bool:
    """Pick the interpreter when no CUDA device is visible and triton is not imported yet.

    Returns True when kernels will run interpreted. TRITON_INTERPRET=1 already in the
    environment is kept (it forces the interpreter on a GPU machine too, for debugging).
    If triton was imported earlier in compiled mode on a machine without CUDA, this changes
    nothing and the launchers refuse with a message that says why (_triton.interpreter_problem).
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    if "triton" in sys.modules:
        return False
    import torch

    if torch.cuda.is_available():
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    return True
