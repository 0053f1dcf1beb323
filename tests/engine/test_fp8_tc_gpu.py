"""Batch-1 decode on the tensor-core FP8 GEMV kernel (engine/model/tc_decode.py,
kernels/fp8_gemv_tc.py) on a Hopper GPU, bf16: turned on by use_fused_ops, within w8a8 of the
one-row GEMV path step after step, and the same greedy tokens with CUDA graphs as eagerly
(a graph replays the buffer protocol that tests/engine/test_fp8_tc.py checks on CPU)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.exec.kv_cache import allocate_kv_cache
from pdserve.engine.llm import LLM
from pdserve.engine.model.attention import make_metadata
from pdserve.engine.model.triton_attention import TritonAttentionBackend
from pdserve.engine.model.weights import load_hf

from tests.engine.hf_families import prompt
from tests.engine.test_fp8 import write_fp8
from tests.engine.test_fp8_tc import SHAPE, SHAPE_D128, W8A8_BOUND, tiny_tc

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
BLOCK = 16


@pytest.fixture(scope="module", params=[SHAPE, SHAPE_D128], ids=["d64", "d128_merge"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a compute capability 9.0 GPU")
    out = tmp_path_factory.mktemp("fp8_tc_gpu")
    write_fp8(tiny_tc(shape=request.param), out, "block")
    return out


class CudaPaged:
    def __init__(self, folder: Path, tc: bool) -> None:
        self.model, _ = load_hf(folder, dtype=torch.bfloat16, device="cuda",
                                backend=TritonAttentionBackend())
        self.model.use_fused_ops()
        assert (self.model.layers[0].tc is not None) is True  # on by default on Hopper
        assert self.model.use_tc_gemv(tc) is tc
        self.kv = allocate_kv_cache(self.model.config, 16, BLOCK, torch.bfloat16, "cuda")

    def step(self, toks: list[int], cached: int, table: list[int]) -> torch.Tensor:
        meta = make_metadata([len(toks)], [cached + len(toks)], [table], BLOCK, "cuda")
        ids = torch.tensor(toks, device="cuda")
        pos = torch.arange(cached, cached + len(toks), device="cuda")
        with torch.no_grad():
            return self.model.compute_logits(self.model(ids, pos, meta, self.kv)).float()


def test_decode_steps_stay_within_w8a8_of_the_gemv_path(folder: Path) -> None:
    gemv, tc = CudaPaged(folder, False), CudaPaged(folder, True)
    # 150 tokens: the prefill takes the FP8 GEMM (K 128 and 256: 1 and 2 scale blocks, which
    # torch._scaled_mm got wrong, kernels/fp8_gemm.py scaled_mm_fits), and the decode
    # attention's keys come in 3 splits (64-key tiles)
    toks, table = prompt(150, 3), [4, 1, 9, 0, 12, 2, 15, 3, 7, 10, 5]
    torch.testing.assert_close(tc.step(toks, 0, table), gemv.step(toks, 0, table))
    errs = []
    for i in range(6):
        nxt = [(11 * i + 5) % 96]
        a, b = gemv.step(nxt, len(toks) + i, table), tc.step(nxt, len(toks) + i, table)
        errs.append(((a - b).norm() / a.norm()).item())
    assert all(0 < e <= W8A8_BOUND for e in errs), errs


def test_graphs_give_the_eager_tokens(folder: Path) -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    kw = dict(device="cuda", dtype="bfloat16", use_triton=True, max_model_len=256,
              num_blocks=64, max_num_seqs=4)
    prompts = [prompt(9, 1), prompt(140, 2)]
    outs = {}
    for graphs in (False, True):
        llm = LLM(str(folder), use_cuda_graphs=graphs, **kw)
        assert llm.engine.runner.model.layers[0].tc is not None
        outs[graphs] = [llm.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]
    assert outs[True] == outs[False]
    assert all(len(t) == 12 for t in outs[True])
