"""FP8 checkpoints on the fused (Triton) path: the FP8 GEMV, GEMM and fused-MoE kernels
against the torch path's dequantizing reference, in the interpreter on CPU.

Rows that run as GEMVs (decode steps, batches of up to 16 rows) keep their activations and
dequantize the weight tile in registers: logits equal the torch path's to fp32 rounding
(1e-4 absolute, as tests/engine/test_fp8.py). Longer batches run the FP8 GEMM, which also
quantizes activations per token and 128 columns (W8A8): each of the 8 matmuls of these two
layers rounds its input by at most half an e4m3 step (2^-4 relative), so the logits stay
within sqrt(8) * 2^-4 = 0.18 relative (L2), the bound test_fp8 uses for quantized weights.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install pdserve[triton])", allow_module_level=True)
from pdserve.engine.core.config import ConfigError  # noqa: E402
from pdserve.engine.core.sampling_params import SamplingParams  # noqa: E402
from pdserve.engine.llm import LLM  # noqa: E402
from pdserve.engine.model.fp8_convert import check_fp8_kernels, quantize_model  # noqa: E402
from pdserve.engine.model.presets import get_preset  # noqa: E402
from pdserve.engine.model.triton_attention import TritonAttentionBackend  # noqa: E402
from pdserve.engine.model.weights import load_hf, random_model  # noqa: E402
from pdserve.kernels._triton import interpreter_problem, interpreting  # noqa: E402

from tests.engine.hf_families import Paged, assert_match, prompt  # noqa: E402
from tests.engine.test_fp8 import tiny, write_fp8  # noqa: E402


@pytest.fixture(autouse=True)
def _kernels_runnable() -> None:
    problem = interpreter_problem()
    if problem is not None:
        pytest.skip(problem)
    if not interpreting():  # Paged keeps the model and its KV cache on the CPU
        pytest.skip("CPU tensors: these run in the interpreter (TRITON_INTERPRET=1); "
                    "tests/kernels and tests/engine/test_triton_path cover the GPU")


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(f"fp8_{request.param}")
    write_fp8(tiny(request.param), out, "block")
    return out


def _pair(folder: Path):
    ref, _ = load_hf(folder)
    fast, _ = load_hf(folder, backend=TritonAttentionBackend())
    return Paged(ref), Paged(fast.use_fused_ops())


def test_gemv_rows_equal_the_torch_path(folder: Path) -> None:
    ref, fast = _pair(folder)
    prompts, tables = [prompt(5, 1), prompt(9, 2)], [[7, 2], [12, 0, 9]]
    batch = [(p, 0, t) for p, t in zip(prompts, tables)]  # 14 rows: the GEMV's tensor cores
    for a, b in zip(ref.step(batch), fast.step(batch)):
        assert_match(b, a)
    for _ in range(2):  # decode steps of 2 rows: the fused decode layer's FP8 GEMVs
        nxt = [([3], len(prompts[0]), tables[0]), ([17], len(prompts[1]), tables[1])]
        for a, b in zip(ref.step(nxt), fast.step(nxt)):
            assert_match(b[0], a[0])
        prompts = [prompts[0] + [3], prompts[1] + [17]]


def test_gemm_rows_stay_close(folder: Path) -> None:
    ref, fast = _pair(folder)
    batch = [(prompt(23, 5), 0, list(range(6))), (prompt(18, 6), 0, list(range(6, 11)))]
    for a, b in zip(ref.step(batch), fast.step(batch)):
        err = ((a - b).norm() / a.norm()).item()
        print(f"W8A8 prefill logits: relative error {err:.3f}")
        assert err <= 8 ** 0.5 * 2 ** -4


def test_llm_serves_fp8_on_the_triton_path(folder: Path) -> None:
    kw = dict(device="cpu", dtype="float32", block_size=4, num_blocks=64, max_model_len=64)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = LLM(str(folder), use_triton=True, **kw).generate([prompt(6, 9)], greedy)
    assert len(out[0].outputs[0].token_ids) == 4


def test_blocks_the_kernels_cannot_tile_are_refused_by_name() -> None:
    model = random_model(get_preset("tiny-qwen3"))
    quantize_model(model, block=(1, 48))  # hidden 64: a K side of 48 is neither pow2 nor K
    check_fp8_kernels(model, use_triton=False)  # the torch path takes it
    with pytest.raises(ConfigError, match=r"layers\.0\.self_attn\.qkv_proj\.weight_scale has "
                                          r"scale block \(1, 48\)"):
        check_fp8_kernels(model, use_triton=True)
