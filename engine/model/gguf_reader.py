"""A GGUF file's metadata and tensor table, read in one pass (GGUF v2/v3, little-endian; the
layout is ggml's docs/gguf.md).

Why not gguf-py's GGUFReader: it builds a numpy view for every element of every metadata
array, and a vocabulary is ~100K strings (SmolLM2's 49K tokens and 48K merges): 3.6 s per
parse on one quiet core, paid by every model load (each worker start and restart, the
router's config read, every test that loads the model). Here strings are sliced from one
memoryview and decoded in a loop: 0.08 s. Tensor data stay views of one read-only memory map, typed
and shaped as gguf-py's (so gguf.quants.dequantize takes them); the gguf package still
provides the type table, dequantization and the writer.

    f = GGUFFile(path)             # ValueError / struct.error on malformed bytes
    f.fields["general.architecture"].value  -> "llama"
    f.tensors[0].name, .shape (ggml order: fastest dim first), .tensor_type, .data
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
# value type -> (struct format, numpy dtype) of the scalar types
SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
           4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
           10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
# tensor types stored as plain numbers (gguf-py's typed views); the others are bytes
PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
         GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
         GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
         GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GGUFField:
    """One metadata entry: offset and nbytes span its key, type and value as stored."""
    name: str
    offset: int
    nbytes: int
    value: object  # int / float / bool / str, or a list of them (gguf-py's contents())


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # ggml order (shape[0] varies fastest)
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # read-only view of the file: numbers [reversed shape], or bytes per row


class GGUFFile:
    """fields {key: GGUFField}, tensors [GGUFTensor] in file order, data (the whole file as a
    read-only uint8 memmap; data.filename is its path)."""

    def __init__(self, path: str | Path) -> None:
        self.data = np.memmap(path, dtype=np.uint8, mode="r")  # ValueError when empty
        self._buf = memoryview(self.data)
        if bytes(self._buf[:4]) != MAGIC:
            raise ValueError("no GGUF magic at the start")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", self._buf, 4)
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported {VERSIONS} "
                             "(a big-endian file reads as a huge version)")
        pos = 24
        self.fields: dict[str, GGUFField] = {}
        for _ in range(n_fields):
            start = pos
            key, pos = self._string(pos)
            (vtype,), pos = struct.unpack_from("<I", self._buf, pos), pos + 4
            value, pos = self._value(vtype, pos)
            self.fields[key] = GGUFField(key, start, pos - start, value)
        infos = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            (n_dims,), pos = struct.unpack_from("<I", self._buf, pos), pos + 4
            dims = struct.unpack_from(f"<{n_dims}Q", self._buf, pos)
            ttype, offset = struct.unpack_from("<IQ", self._buf, pos + 8 * n_dims)
            pos += 8 * n_dims + 12
            infos.append((name, dims, GGMLQuantizationType(ttype), offset))
        align = self.fields.get("general.alignment")
        align = int(align.value) if align is not None else DEFAULT_ALIGNMENT
        base = -(-pos // align) * align
        self.tensors = [self._tensor(name, dims, ttype, base + offset)
                        for name, dims, ttype, offset in infos]

    def _string(self, pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._buf, pos)
        end = pos + 8 + n
        if end > len(self._buf):
            raise ValueError(f"a string at byte {pos} runs past the end of the file")
        return str(self._buf[pos + 8:end], "utf-8"), end

    def _value(self, vtype: int, pos: int) -> tuple[object, int]:
        if vtype == STRING:
            return self._string(pos)
        if vtype in SCALARS:
            fmt = SCALARS[vtype][0]
            return struct.unpack_from(fmt, self._buf, pos)[0], pos + struct.calcsize(fmt)
        if vtype != ARRAY:
            raise ValueError(f"unknown metadata value type {vtype} at byte {pos}")
        etype, count = struct.unpack_from("<IQ", self._buf, pos)
        pos += 12
        if etype in SCALARS:  # one typed view, then Python numbers
            dtype = np.dtype(SCALARS[etype][1])
            arr = np.frombuffer(self._buf, dtype, count, pos)  # ValueError past the end
            return arr.tolist(), pos + count * dtype.itemsize
        items = []
        for _ in range(count):
            item, pos = self._value(etype, pos)
            items.append(item)
        return items, pos

    def _tensor(self, name: str, dims: tuple[int, ...], ttype: GGMLQuantizationType,
                offset: int) -> GGUFTensor:
        shape = tuple(reversed(dims))  # numpy order
        n_elems = int(np.prod(dims, dtype=np.int64))
        if ttype in PLAIN:
            dtype, count = np.dtype(PLAIN[ttype]), n_elems
        else:
            block, size = GGML_QUANT_SIZES[ttype]
            dtype, count = np.dtype(np.uint8), n_elems * size // block
            shape = quant_shape_to_byte_shape(shape, ttype)
        if offset + count * dtype.itemsize > len(self._buf):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        data = np.frombuffer(self._buf, dtype, count, offset).reshape(shape)
        return GGUFTensor(name, tuple(int(d) for d in dims), ttype, data)
