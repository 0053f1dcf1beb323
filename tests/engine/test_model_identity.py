"""Which weights and tokenizer an engine serves (engine/model/identity.py, ModelIdentity) is
part of the KV compatibility payload: checkpoints of one shape with other weights, or one
checkpoint with another tokenizer or load-time quantization, differ there and the difference
is named; a copy in another folder does not differ; a 100+ GB file is sampled, not read.
The refusal at the workers' introduction is in tests/workers/test_disagg_inproc.py."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from pdserve.engine.core.config import (
    CacheConfig,
    ModelIdentity,
    compat_payload,
    describe_mismatch,
)
from pdserve.engine.model.identity import (
    NUM_SAMPLES,
    SAMPLE_BYTES,
    file_fingerprint,
    gguf_tokenizer_fingerprint,
    sample_windows,
)
from pdserve.engine.model.loader import load_tokenizer, model_identity, resolve_model
from pdserve.engine.model.presets import get_preset

from tests.engine.tiny_vocab import tiny_tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 512  # tiny_tokenizer's


def save_checkpoint(folder: Path, seed: int) -> Path:
    """A tiny Llama saved by transformers' save_pretrained, the same config for every seed and
    weights drawn from `seed`, with a 512-token tokenizer beside it (tokenizer.json and
    tokenizer_config.json, as a HF folder has them)."""
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    tiny_tokenizer().backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


def edit_token(folder: Path, old: str = "<pad>", new: str = "<sep>") -> Path:
    """Rename one token in a checkpoint's tokenizer.json, in place (its vocabulary entry and
    its added-token entry: the file stays a valid tokenizer)."""
    path = folder / "tokenizer.json"
    text = path.read_text()
    assert f'"{old}"' in text and f'"{new}"' not in text
    path.write_text(text.replace(f'"{old}"', f'"{new}"'))
    return folder


def identity_of(folder: Path, quantization: str | None = None) -> ModelIdentity:
    """What load_rank computes for a checkpoint folder (engine/llm.py)."""
    return model_identity(resolve_model(str(folder)), seed=0, quantization=quantization,
                          tokenizer=load_tokenizer(str(folder)))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """seed0, seed1: one config, other weights; copy: seed0 in another folder; retok: seed0's
    weights with one token of its tokenizer renamed."""
    root = tmp_path_factory.mktemp("identity")
    a = save_checkpoint(root / "seed0", 0)
    b = save_checkpoint(root / "seed1", 1)
    copy = Path(shutil.copytree(a, root / "elsewhere" / "seed0"))
    retok = edit_token(Path(shutil.copytree(a, root / "retok")))
    return {"seed0": a, "seed1": b, "copy": copy, "retok": retok}


def test_other_weights_of_one_config_differ_and_a_copy_does_not(checkpoints) -> None:
    a, b, copy = (identity_of(checkpoints[k]) for k in ("seed0", "seed1", "copy"))
    assert a.weights.startswith("safetensors:") and a.weights != b.weights
    assert a.tokenizer == b.tokenizer is not None  # the same tokenizer files
    assert copy == a  # folder, path and file times are not part of it
    diffs = describe_mismatch(compat_payload(get_preset("tiny-llama"), CacheConfig(), None, a),
                              compat_payload(get_preset("tiny-llama"), CacheConfig(), None, b))
    assert diffs == [f"identity.weights: {a.weights!r} != {b.weights!r}"]


def test_one_changed_token_changes_the_tokenizer_identity_only(checkpoints) -> None:
    a, retok = identity_of(checkpoints["seed0"]), identity_of(checkpoints["retok"])
    assert retok.weights == a.weights
    assert retok.tokenizer != a.tokenizer
    assert load_tokenizer(str(checkpoints["retok"])).token_to_id("<sep>") == 3  # still loads


def test_quantization_and_a_presets_seed_are_part_of_it() -> None:
    preset = resolve_model("tiny-llama")
    plain = model_identity(preset, seed=0, quantization=None, tokenizer=None)
    assert plain == ModelIdentity("preset:tiny-llama:seed=0", None, None)
    fp8 = model_identity(preset, seed=0, quantization="fp8", tokenizer=None)
    reseeded = model_identity(preset, seed=1, quantization=None, tokenizer=None)
    model = get_preset("tiny-llama")
    assert describe_mismatch(compat_payload(model, CacheConfig(), None, plain),
                             compat_payload(model, CacheConfig(), None, fp8)) == \
        ["identity.quantization: None != 'fp8'"]
    assert describe_mismatch(compat_payload(model, CacheConfig(), None, plain),
                             compat_payload(model, CacheConfig(), None, reseeded)) == \
        ["identity.weights: 'preset:tiny-llama:seed=0' != 'preset:tiny-llama:seed=1'"]


def test_sample_windows_are_fixed_and_bounded() -> None:
    assert sample_windows(8, 8) == []
    assert sample_windows(8, 1000) == [(8, 992)]  # short: read whole
    size = 200 << 30
    windows = sample_windows(100, size)
    assert len(windows) == NUM_SAMPLES and all(n == SAMPLE_BYTES for _, n in windows)
    assert windows[0][0] == 100 and windows[-1][0] + SAMPLE_BYTES == size


def test_a_200_gb_file_is_fingerprinted_from_samples(tmp_path: Path) -> None:
    """A sparse 200 GiB '.safetensors' file (a zero header length, then holes): fingerprinted in
    well under a second, and a byte changed in one sample window changes the fingerprint."""
    path = tmp_path / "model-00001-of-00001.safetensors"
    size = 200 << 30
    with path.open("wb") as f:
        f.truncate(size)
    if os.stat(path).st_blocks * 512 >= SAMPLE_BYTES * NUM_SAMPLES:
        pytest.skip("this filesystem has no sparse files")
    start = time.perf_counter()
    before = file_fingerprint(path)
    assert time.perf_counter() - start < 1.0
    offset = sample_windows(8, size)[NUM_SAMPLES // 2][0] + 1234
    with path.open("r+b") as f:
        f.seek(offset)
        f.write(b"\x01")
    assert file_fingerprint(path) != before


def _gguf_with_tokens(path: Path, tokens: list[str], name: str) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(["a b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_tokenizer_identity_is_its_tokenizer_metadata(tmp_path: Path) -> None:
    from pdserve.engine.model.gguf_reader import GGUFFile

    tokens = ["a", "b", "ab", "<s>", "</s>"]
    fps = [gguf_tokenizer_fingerprint(GGUFFile(str(_gguf_with_tokens(
        tmp_path / f"{i}.gguf", toks, name)))) for i, (toks, name) in enumerate(
            [(tokens, "one"), (tokens, "another name"), (tokens[:-1] + ["<|end|>"], "one")])]
    assert fps[0] == fps[1]  # other metadata (general.name) is not the tokenizer
    assert fps[0] != fps[2]  # one token renamed


def test_the_flag_on_an_fp8_checkpoint_changes_nothing(tmp_path: Path) -> None:
    """--quantization fp8 quantizes a float checkpoint (other weights in memory: part of the
    identity) but leaves an FP8 checkpoint as it is: a worker started with the flag and one
    without, on the same FP8 checkpoint, hold the same weights and must pair."""
    folder = save_checkpoint(tmp_path / "ckpt", seed=0)
    source = resolve_model(str(folder))
    assert model_identity(source, seed=0, quantization="fp8", tokenizer=None) != \
        model_identity(source, seed=0, quantization=None, tokenizer=None)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config))
    flagged = model_identity(source, seed=0, quantization="fp8", tokenizer=None)
    assert flagged == model_identity(source, seed=0, quantization=None, tokenizer=None)
    assert flagged.quantization is None
