"""Read GGUF metadata into a plain dict for tokenizer tests.

``gguf.GGUFReader`` takes ~20 s to open the 128k-token llama-bpe vocab (it
builds a numpy view per string), so tests read the key/value section with
this small parser instead; ``test_meta_matches_gguf_reader`` checks it against
``GGUFReader`` on the small files. Value type codes come from the gguf package.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from gguf import GGUFReader, GGUFValueType

_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.FLOAT64: "<d",
    GGUFValueType.BOOL: "<?",
}


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    return struct.unpack(fmt, f.read(size))[0]


def _string(f: BinaryIO) -> str:
    return f.read(_read(f, "<Q")).decode("utf-8")


def _value(f: BinaryIO, vtype: GGUFValueType) -> Any:
    if vtype == GGUFValueType.STRING:
        return _string(f)
    if vtype == GGUFValueType.ARRAY:
        etype = GGUFValueType(_read(f, "<I"))
        count = _read(f, "<Q")
        if etype in _SCALARS and etype != GGUFValueType.BOOL:
            dtype = np.dtype(_SCALARS[etype])
            return np.frombuffer(f.read(dtype.itemsize * count), dtype).tolist()
        return [_value(f, etype) for _ in range(count)]
    return _read(f, _SCALARS[vtype])


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Return the GGUF key/value pairs of ``path`` as plain Python values."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        version = _read(f, "<I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        _read(f, "<Q")  # tensor count
        n_kv = _read(f, "<Q")
        meta = {}
        for _ in range(n_kv):
            key = _string(f)
            meta[key] = _value(f, GGUFValueType(_read(f, "<I")))
        return meta


def read_metadata_reference(path: str | Path) -> dict[str, Any]:
    """The same dict built with ``gguf.GGUFReader`` (slow on big vocabularies)."""
    reader = GGUFReader(path)
    return {key: field.contents() for key, field in reader.fields.items()
            if not key.startswith("GGUF.")}
