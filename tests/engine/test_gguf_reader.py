"""engine/model/gguf_reader.py against gguf-py's own GGUFReader (the reference reading): every
metadata field's value and byte span, every tensor's name, shape, type and data, on the
embedded SmolLM2 GGUF (Q8_0 and F32 tensors, 49K-string arrays) and on a written file with
each scalar and array type; malformed files raise."""
from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pdserve.engine.model.loader import embedded_gguf_path

gguf = pytest.importorskip("gguf")
from pdserve.engine.model.gguf_reader import GGUFFile  # noqa: E402  (needs gguf)


def assert_same_reading(path: Path) -> None:
    ref, mine = gguf.GGUFReader(str(path)), GGUFFile(path)
    # gguf-py also lists the header (GGUF.version, .tensor_count, .kv_count) as fields
    stored = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(mine.fields) == list(stored)
    for key, field in stored.items():
        got = mine.fields[key]
        assert got.value == field.contents(), key
        assert (got.offset, got.nbytes) == (field.offset, sum(p.nbytes for p in field.parts)), key
    assert [t.name for t in mine.tensors] == [t.name for t in ref.tensors]
    for want, got in zip(ref.tensors, mine.tensors):
        assert got.shape == tuple(int(d) for d in want.shape), want.name
        assert got.tensor_type == want.tensor_type, want.name
        assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape
        assert np.array_equal(got.data, want.data), want.name


def test_embedded_smollm2_reads_as_gguf_py_reads_it() -> None:
    assert_same_reading(embedded_gguf_path())


def test_every_value_type_and_tensor_type(tmp_path: Path) -> None:
    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 7)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -3)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -5)
    w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 2**60)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "ünï ✓")
    w.add_array("t.strs", ["a", "", "日本"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.bools", [True, False])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32),
                              gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_same_reading(path)
    f = GGUFFile(path)
    assert f.fields["t.strs"].value == ["a", "", "日本"]
    assert f.fields["t.bool"].value is True
    assert f.tensors[3].shape == (64, 4)  # ggml order


@pytest.mark.parametrize("damage,match", [
    (lambda b: b"GGUX" + b[4:], "magic"),
    (lambda b: b[:4] + (99).to_bytes(4, "little") + b[8:], "version 99"),
    (lambda b: b[:3000], None),  # struct.error or a string past the end
    (lambda b: b[:-1000], "past the end"),
], ids=["magic", "version", "cut-in-metadata", "cut-in-tensors"])
def test_malformed_files_raise(damage, match: str | None, tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(damage(embedded_gguf_path().read_bytes()))
    with pytest.raises((ValueError, struct.error), match=match):
        GGUFFile(path)


def test_gguf_is_imported_only_to_open_a_gguf_file() -> None:
    """The gguf package is needed for GGUF files only: a preset or safetensors model loads
    without importing it (the GPU image here has no gguf), the embedded GGUF imports it."""
    code = ("import sys\nfrom pdserve.engine.model.loader import load_model\n"
            "load_model('tiny-llama')\nprint('gguf' in sys.modules)\n"
            "load_model(None)\nprint('gguf' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    assert out == ["False", "True"]
