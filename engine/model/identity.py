"""Cheap fingerprints of WHICH weights and tokenizer a model is loaded from, for the KV
compatibility payload (engine/core/config.py ModelIdentity): two workers serving different
fine-tunes of one architecture, or one checkpoint with another tokenizer, must refuse each
other at the handshake rather than exchange KV that means different things.

Hashing every byte of a 100+ GB checkpoint would add minutes to each start, so a weights file
is fingerprinted by its size, its whole header (a safetensors header names every tensor with
its dtype, shape and offsets) and SAMPLE_BYTES at NUM_SAMPLES fixed places of its data (the
first and last bytes and evenly between; a file that small is read whole): under a MiB of
reads per file, whatever its size. Fine-tunes change every tensor they train, so the samples
tell them apart; two files differing only between the samples are not (the price of cheap).
Tokenizers are small: their content is hashed whole. Paths and times are left out, so a copy
of a checkpoint in another folder is the same model.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import BinaryIO, Protocol

SAMPLE_BYTES = 64 << 10
NUM_SAMPLES = 8
MAX_SAFETENSORS_HEADER = 100 << 20  # safetensors' own limit on its JSON header
DIGEST_CHARS = 16  # as the compatibility hash: plenty against accidents, short in messages
# the HF tokenizer files whose content decides what token ids mean (vocabulary, merges, added
# and special tokens, normalizer, pre-tokenizer, decoder; bos/eos roles)
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class _GGUFField(Protocol):
    offset: int
    nbytes: int


class _GGUFReader(Protocol):  # the parts of gguf_reader.GGUFFile used here
    fields: dict[str, _GGUFField]
    data: object  # numpy memmap of the whole file (uint8)


def sample_windows(start: int, size: int) -> list[tuple[int, int]]:
    """(offset, length) of the bytes of [start, size) that stand for that data: all of it when
    it is short, else NUM_SAMPLES windows of SAMPLE_BYTES, the first at start and the last
    ending at size. Fixed for a given (start, size), so every copy is sampled alike."""
    span = size - start
    if span <= NUM_SAMPLES * SAMPLE_BYTES:
        return [(start, span)] if span > 0 else []
    room = span - SAMPLE_BYTES
    return [(start + room * i // (NUM_SAMPLES - 1), SAMPLE_BYTES) for i in range(NUM_SAMPLES)]


def _safetensors_header_end(f: BinaryIO, size: int) -> int:
    """Where a safetensors file's tensor data starts (8-byte little-endian header length, then
    the JSON header); 0 when the file does not look like one (then it is all data: the loader
    names the bad file, this only must not fail first)."""
    raw = f.read(8)
    if len(raw) < 8:
        return 0
    n = int.from_bytes(raw, "little")
    return 8 + n if n <= MAX_SAFETENSORS_HEADER and 8 + n <= size else 0


def file_fingerprint(path: Path) -> str:
    """sha256 of a weights file's size, its header (a .safetensors file's whole header; other
    files have none: their first window holds a GGUF's magic and first metadata) and its
    sample windows."""
    size = path.stat().st_size
    h = hashlib.sha256(f"size={size}\n".encode())
    with path.open("rb") as f:
        start = _safetensors_header_end(f, size) if path.suffix == ".safetensors" else 0
        f.seek(0)
        h.update(f.read(start))
        for offset, length in sample_windows(start, size):
            f.seek(offset)
            h.update(f.read(length))
    return h.hexdigest()


def weights_fingerprint(files: list[Path], *, names: bool = True) -> str:
    """One digest over the files of a checkpoint, in the order given. names: include each file's
    own name (a sharded checkpoint's shard names are part of it; a lone GGUF's name is
    whatever it was saved as, so it is left out)."""
    h = hashlib.sha256()
    for path in files:
        name = path.name if names else ""
        h.update(f"{name}\0{file_fingerprint(path)}\n".encode())
    return h.hexdigest()[:DIGEST_CHARS]


def hf_tokenizer_fingerprint(folder: str | Path) -> str:
    """Digest of the content of a HF folder's tokenizer files (HF_TOKENIZER_FILES; a missing
    one counts as absent, not as empty)."""
    folder = Path(folder)
    h = hashlib.sha256()
    for name in HF_TOKENIZER_FILES:
        path = folder / name
        content = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "absent"
        h.update(f"{name}\0{content}\n".encode())
    return h.hexdigest()[:DIGEST_CHARS]


def gguf_tokenizer_fingerprint(reader: _GGUFReader) -> str:
    """Digest of a GGUF's tokenizer.* metadata (tokens, merges, token types, special ids, chat
    template) as stored: each field's raw bytes (key, type, value) straight from the mapped
    file, which is what the tokenizer is built from (a few MB: milliseconds)."""
    h = hashlib.sha256()
    for key in sorted(k for k in reader.fields if k.startswith("tokenizer.")):
        field = reader.fields[key]
        h.update(reader.data[field.offset:field.offset + field.nbytes])  # type: ignore[index]
    return h.hexdigest()[:DIGEST_CHARS]


def preset_weights(preset: str, seed: int) -> str:
    """A random-weight preset is its shape's name and the seed its weights are drawn from."""
    return f"preset:{preset}:seed={seed}"
