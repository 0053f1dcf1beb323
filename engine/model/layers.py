"""Small building blocks of the decoder: RMSNorm, rotary embeddings (incl. Llama-3 scaling), SwiGLU.

Each is the plain torch reference; the Triton kernels in kernels/ compute the same functions
(fused residual-add + RMSNorm, QK-norm + RoPE, SiLU-and-mul) and are checked against these.
A module whose `fused` flag is set (Model.use_fused_ops) calls the kernel instead; the flag is
off by default, so the torch path is exactly what it was without kernels/ installed.
"""
from __future__ import annotations

import math
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.core.config import RopeScaling

_KERNELS: ModuleType | None = None


def fused_kernels() -> ModuleType:
    """pdserve.kernels.ops, imported on first use: the torch path never needs triton."""
    global _KERNELS
    if _KERNELS is None:
        from pdserve.kernels import ops

        _KERNELS = ops
    return _KERNELS


def fused_attention() -> ModuleType:
    """engine/model/triton_attention.py (attend_with_prologue), imported on first use, like
    fused_kernels()."""
    from pdserve.engine.model import triton_attention

    return triton_attention


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back to the input dtype.

    forward(x, residual) fuses the residual add that precedes every norm in the decoder:
    it returns (norm(x + residual), x + residual), so the caller carries the un-normed sum on.
    With `fused`, rows [T, dim] go through one Triton kernel (add + norm in a single pass).
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fused = False

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None,
        rows: torch.Tensor | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """rows int64 [R]: normalise only those rows (outputs [R, H]; the fused kernel gathers
        them itself); out: where the normed rows go (e.g. one half of a concatenation)."""
        if self.fused and x.dim() == 2:
            normed, new_residual = fused_kernels().fused_add_rmsnorm(
                x, residual, self.weight, self.eps, out=out, rows=rows)
            return normed if residual is None else (normed, new_residual)
        if rows is not None:
            x = x.index_select(0, rows)
            residual = None if residual is None else residual.index_select(0, rows)
        if residual is not None:
            x = x + residual
        normed = self._norm(x)
        if out is not None:
            normed = out.copy_(normed)
        return normed if residual is None else (normed, x)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], float32 on CPU.

    Llama-3 scaling leaves high frequencies (short wavelengths) alone, divides low frequencies by
    `factor`, and blends linearly in between, so long contexts stretch only the slow dimensions.
    """
    # exponents as int64 -> float32, so the values agree bit for bit with the reference models
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    old_ctx = scaling.original_max_position_embeddings
    low_freq_wavelen = old_ctx / scaling.low_freq_factor
    high_freq_wavelen = old_ctx / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Non-interleaved RoPE (rotate-half, as in HF Llama/Qwen3) at explicit per-token positions.

    inv_freq is a plain float32 attribute, not a buffer: the model is built on the meta device
    and cast to bf16 wholesale, and neither may touch it. It is copied to the positions' device
    once and cached, so steady-state calls (and CUDA-graph capture after a warm-up) do no copies.
    """

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self._inv_freq_cpu = rope_inv_freq(head_dim, theta, scaling)
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}
        self._table: torch.Tensor | None = None  # [max_pos, 2, head_dim // 2]: cos, sin

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """[head_dim // 2] float32 on `device` (fused kernels build cos/sin tables from it)."""
        cached = self._inv_freq_by_device.get(device)
        if cached is None:
            cached = self._inv_freq_cpu.to(device)
            self._inv_freq_by_device[device] = cached
        return cached

    def reserve(self, max_positions: int, device: torch.device) -> None:
        """Precompute cos/sin for positions < max_positions on `device` (the engine calls this
        with max_model_len + the draft tokens), so that cos_sin is one gather per forward
        instead of four elementwise kernels (a batch-1 decode step is latency-bound). The rows
        are the same ops on the same device as the direct computation: bit-identical."""
        table = self._table
        if table is not None and table.shape[0] >= max_positions and table.device == device:
            return
        freqs = self._freqs(torch.arange(max_positions, device=device))
        self._table = torch.stack((freqs.cos(), freqs.sin()), dim=1)

    def _freqs(self, positions: torch.Tensor) -> torch.Tensor:
        return positions[:, None].float() * self.inv_freq(positions.device)[None, :]

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos, sin tables [max_pos, head_dim // 2] float32 (strided views of the reserved
        table) for kernels that index them by position, or None before reserve() on
        `device`."""
        table = self._table
        if table is None or table.device != device:
            return None
        return table[:, 0], table[:, 1]

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> cos, sin [T, head_dim // 2] float32 (row views of one
        [T, 2, head_dim // 2] gather once reserve() has built the table on this device)."""
        table = self._table
        if table is not None and table.device == positions.device:
            rows = table[positions]  # positions < the reserved count (the scheduler's bound)
            return rows[:, 0], rows[:, 1]
        freqs = self._freqs(positions)
        return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos/sin [T, R/2] over its first R dims: pairs are (i, i + R/2),
    not adjacent lanes. R = D except with partial rotary (GLM-4.5: R = D/2), where dims R..D
    pass through unchanged, as in transformers' Glm4Moe."""
    rot = 2 * cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    dtype = x.dtype
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] (gate ++ up) -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up merged into one matmul.
    With `fused`, silu-and-mul is one Triton kernel instead of three torch ops."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        act = fused_kernels().silu_and_mul(gate_up) if self.fused else silu_and_mul(gate_up)
        return self.down_proj(act)
