"""Every kernel launcher in one namespace (imports triton): `from pdserve.kernels import ops`.

The engine reaches the kernels through this module only when its fused path is on, so the
torch path never imports triton.
"""
from __future__ import annotations

from pdserve.kernels.argmax import argmax
from pdserve.kernels.attn_prologue import fused_qk_norm_rope_kv
from pdserve.kernels.decode_attention import (
    MAX_GROUP_ROWS,
    Prologue,
    fused_decode_attention,
    paged_decode_attention,
)
from pdserve.kernels.decode_attention_config import choose_num_splits
from pdserve.kernels.fp8_gemm import fp8_gemm, quant_act
from pdserve.kernels.fp8_gemv_tc import fp8_gemv_tc, tc_available
from pdserve.kernels.fp8_gemv_tc import tc_fits as fp8_gemv_tc_fits
from pdserve.kernels.fused_moe import Fp8Experts, fused_experts, fused_moe
from pdserve.kernels.gemv import MAX_ROWS as GEMV_MAX_ROWS
from pdserve.kernels.gemv import MODEL_ROWS as GEMV_ROWS
from pdserve.kernels.gemv import gemv
from pdserve.kernels.kv_write import write_kv
from pdserve.kernels.moe_align import moe_align
from pdserve.kernels.moe_gemm import moe_down, moe_gate_up
from pdserve.kernels.moe_route import moe_route, moe_route_align
from pdserve.kernels.prefill_attention import paged_prefill_attention
from pdserve.kernels.rmsnorm import fused_add_rmsnorm
from pdserve.kernels.silu_mul import silu_and_mul
from pdserve.kernels.spec_accept import spec_accept

__all__ = [
    "Fp8Experts", "GEMV_MAX_ROWS", "GEMV_ROWS", "MAX_GROUP_ROWS", "Prologue", "argmax", "choose_num_splits",
    "fp8_gemm", "fp8_gemv_tc", "fp8_gemv_tc_fits", "fused_add_rmsnorm", "fused_decode_attention",
    "fused_experts", "fused_moe",
    "fused_qk_norm_rope_kv", "gemv", "moe_align", "moe_down", "moe_gate_up", "moe_route",
    "moe_route_align", "paged_decode_attention", "paged_prefill_attention", "quant_act",
    "silu_and_mul", "spec_accept", "tc_available", "write_kv",
]
