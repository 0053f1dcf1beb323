"""Batch-1 decode on the tensor-core FP8 GEMV (engine/model/tc_decode.py), driven like the
engine, with the kernel's torch reference standing in for it on CPU (the GPU test
tests/engine/test_fp8_tc_gpu.py runs the kernel): the buffer protocol (each launch zeroes
what the module doc says), the fp32 residual stream and the attention's compute dtype.

Each decode step's 8 matmuls (4 per layer) quantize their activation per 128 columns (w8a8),
so the logits stay within sqrt(8) * 2^-4 relative (L2) of the w8a16 GEMV path's, the bound
tests/engine/test_fp8_triton.py uses; a zeroing missed would add a step's outputs to the
last one's, far outside it.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install pdserve[triton])", allow_module_level=True)
import transformers  # noqa: E402

from pdserve.engine.model.triton_attention import TritonAttentionBackend  # noqa: E402
from pdserve.engine.model.weights import load_hf  # noqa: E402
from pdserve.kernels._triton import interpreter_problem, interpreting  # noqa: E402

from tests.engine.hf_families import Paged, prompt  # noqa: E402
from tests.engine.test_fp8 import VOCAB, tiny, write_fp8  # noqa: E402

W8A8_BOUND = 8 ** 0.5 * 2 ** -4
# 128-multiple shapes (the kernel's K groups; q, k and v each whole 128-row scale blocks, so
# merged q/k/v keeps 128 x 128 blocks): q/k/v 512 x 128, o 128 x 256, gate_up 512 x 128,
# down 128 x 256
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)
# Qwen3's head_dim 128: o_proj merges the decode attention's splits (TcBuffers.merge)
SHAPE_D128 = dict(hidden_size=256, intermediate_size=256, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=128)


@pytest.fixture(autouse=True)
def _kernels_runnable() -> None:
    problem = interpreter_problem()
    if problem is not None:
        pytest.skip(problem)
    if not interpreting():
        pytest.skip("CPU tensors: these run in the interpreter (TRITON_INTERPRET=1); "
                    "tests/engine/test_fp8_tc_gpu.py covers the GPU")


def tiny_tc(seed: int = 0, shape: dict = SHAPE) -> transformers.PreTrainedModel:
    return tiny("qwen3", seed, **shape)


@pytest.fixture(scope="module", params=[SHAPE, SHAPE_D128], ids=["d64", "d128_merge"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fp8_tc")
    write_fp8(tiny_tc(shape=request.param), out, "block")
    return out


def _fused(folder: Path, tc: bool):
    model, _ = load_hf(folder, backend=TritonAttentionBackend())
    model.use_fused_ops()
    assert model.use_tc_gemv(tc) is tc
    return Paged(model)


def test_decode_steps_stay_within_w8a8_of_the_gemv_path(folder: Path) -> None:
    gemv, tc = _fused(folder, False), _fused(folder, True)
    assert tc.model.layers[0].tc.merge is (tc.model.config.head_dim % 128 == 0)
    # 40 tokens: the prefill takes the FP8 GEMM (more rows than the GEMV's), and the decode
    # attention splits the keys (2 tiles of 32)
    toks, table = prompt(40, 3), [4, 1, 9, 17, 30, 2, 11, 5, 40, 22, 8, 13]
    for a, b in zip(gemv.step([(toks, 0, table)]), tc.step([(toks, 0, table)])):
        torch.testing.assert_close(b, a)  # 40 rows: both take the w8a16 GEMV
    errs = []
    for i in range(5):  # one row: q/k/v, o, gate_up, down on the tensor-core path
        nxt = [([(11 * i + 5) % VOCAB], len(toks) + i, table)]
        (a,), (b,) = gemv.step(nxt), tc.step(nxt)
        errs.append(((a - b).norm() / a.norm()).item())
    assert all(0 < e <= W8A8_BOUND for e in errs), errs  # > 0: the other path ran


def test_a_step_replayed_gives_the_same_logits(folder: Path) -> None:
    """The buffers are zero again after each whole step: two caches, the same step."""
    first, second = _fused(folder, True), _fused(folder, True)
    toks, table = prompt(5, 4), [2, 6]
    first.step([(toks, 0, table)])
    second.step([(toks, 0, table)])
    step = [([9], len(toks), table)]
    (a,) = first.step(step)
    (b,) = second.step(step)
    (c,) = second.step([([9], len(toks) + 1, table)])
    torch.testing.assert_close(b, a)
    assert not torch.equal(c, b)


def test_models_the_kernel_does_not_take_stay_on_the_gemv(tmp_path: Path) -> None:
    for family in ("qwen3", "qwen3_moe"):  # hidden 160: not whole 128-column groups; MoE
        out = tmp_path / family
        write_fp8(tiny(family), out, "block")
        model, _ = load_hf(out, backend=TritonAttentionBackend())
        assert model.use_fused_ops().use_tc_gemv(True) is False
        assert all(layer.tc is None for layer in model.layers)
