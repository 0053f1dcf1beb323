"""pdserve: disaggregated prefill/decode LLM serving.

Installed, every folder of the repository is a subpackage of this one (pdserve.engine,
pdserve.kernels, pdserve.router, ...). The offline API:

    from pdserve import LLM, SamplingParams
    [res] = LLM().generate("The capital of France is", SamplingParams(max_tokens=8))

LLM and SamplingParams load on first use, so `import pdserve` stays light (no torch).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from pdserve.engine.core.sampling_params import SamplingParams
    from pdserve.engine.llm import LLM


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pdserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pdserve.engine.core.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
