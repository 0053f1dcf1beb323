"""FP8-KV checkpoints' static per-tensor scales (`layers.{i}.self_attn.{k,v}_scale`, as vLLM /
llm-compressor write them): loaded onto the attention modules, used as every block's scales by
an fp8 KV cache, and refused by name when malformed."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.exec.kv_cache import block_scales
from pdserve.engine.llm import build_engine
from pdserve.engine.model.loader import load_model
from pdserve.engine.model.weights import WeightsError

from tests.engine.test_fp8 import tiny

SCALES = {0: (0.011, 0.007), 1: (0.013, 0.005)}  # layer -> (k_scale, v_scale)


def _checkpoint(folder: Path, extra: dict[str, torch.Tensor]) -> Path:
    tiny("qwen3").save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    save_file({**tensors, **extra}, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _scales(layers: dict[int, tuple[float, float]]) -> dict[str, torch.Tensor]:
    out = {}
    for i, (k, v) in layers.items():
        out[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k)
        out[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v)
    return out


def test_static_scales_load_and_fill_every_written_block(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path, _scales(SCALES))
    model, _, _ = load_model(str(folder))
    got = {i: layer.self_attn.kv_static_scales for i, layer in enumerate(model.layers)}
    assert got == {i: pytest.approx(s) for i, s in SCALES.items()}
    engine = build_engine(str(folder), device="cpu", kv_cache_dtype="fp8", block_size=4,
                          num_blocks=32)
    engine.add_request([5, 17, 9, 3, 42, 7, 8], SamplingParams(max_tokens=6, temperature=0.0,
                                                                  ignore_eos=True))
    assert len([o for o in engine.generate_until_done() if o.finished]) == 1
    scales = block_scales(engine.runner.kv_cache)  # [NB, L, 2, Hkv]
    written = scales[:, 0, 0, 0] != 0
    assert written.sum() >= 3  # 13 tokens in blocks of 4
    for i, (k, v) in SCALES.items():
        assert torch.allclose(scales[written, i, 0], torch.tensor(k))
        assert torch.allclose(scales[written, i, 1], torch.tensor(v))


@pytest.mark.parametrize("extra,needle", [
    ({"model.layers.0.self_attn.k_scale": torch.tensor(0.01)}, "layers.0.self_attn.v_scale"),
    ({**_scales({0: (0.01, 0.01)}), "model.layers.1.self_attn.k_scale": torch.ones(2)},
     "layers.1.self_attn.k_scale"),
    ({**_scales({0: (0.01, -1.0)})}, "layers.0.self_attn.v_scale"),
    ({**_scales({0: (0.01, 0.01)}), **_scales({7: (0.01, 0.01)})}, "layers.7.self_attn"),
])
def test_bad_static_scales_are_refused_by_name(tmp_path: Path, extra, needle: str) -> None:
    folder = _checkpoint(tmp_path, extra)
    with pytest.raises(WeightsError, match=needle.replace(".", r"\.")):
        load_model(str(folder))
