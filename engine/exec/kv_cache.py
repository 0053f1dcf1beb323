"""The paged KV cache's memory: one tensor, one region per block (what KV transfer moves)."""
from __future__ import annotations

import torch

from pdserve.engine.core.config import ModelConfig

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def allocate_kv_cache(model: ModelConfig, num_blocks: int, block_size: int,
                      dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """[num_blocks, num_kv_layers, 2, block_size, num_kv_heads, head_dim]: one block = one region."""
    shape = (num_blocks, model.num_kv_layers, 2, block_size, model.num_kv_heads, model.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)
