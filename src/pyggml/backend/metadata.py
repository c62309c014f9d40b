"""GGUF metadata: ``Config`` (typed, read-only key/value access with range-checked getters; every
integer key bounded, ``Config.count_bound``), the ``MAX_*`` bounds that model files check
hyper-parameters against, and ``GGUFError``."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pyggml.backend.hardware import NULL, ggml_log
from pyggml.tensor import DType, ffi, lib  # the compiled binding, loaded in one place


class GGUFError(ValueError):
    """A GGUF file is missing, truncated, corrupt or of an unsupported version."""



# ---- GGUF metadata -------------------------------------------------------------------------------
_SCALAR_GETTERS = {
    lib.GGUF_TYPE_UINT8: lib.gguf_get_val_u8, lib.GGUF_TYPE_INT8: lib.gguf_get_val_i8,
    lib.GGUF_TYPE_UINT16: lib.gguf_get_val_u16, lib.GGUF_TYPE_INT16: lib.gguf_get_val_i16,
    lib.GGUF_TYPE_UINT32: lib.gguf_get_val_u32, lib.GGUF_TYPE_INT32: lib.gguf_get_val_i32,
    lib.GGUF_TYPE_UINT64: lib.gguf_get_val_u64, lib.GGUF_TYPE_INT64: lib.gguf_get_val_i64,
    lib.GGUF_TYPE_FLOAT32: lib.gguf_get_val_f32, lib.GGUF_TYPE_FLOAT64: lib.gguf_get_val_f64,
    lib.GGUF_TYPE_BOOL: lib.gguf_get_val_bool,
}
_ARRAY_DTYPES = {
    lib.GGUF_TYPE_UINT8: np.uint8, lib.GGUF_TYPE_INT8: np.int8, lib.GGUF_TYPE_UINT16: np.uint16,
    lib.GGUF_TYPE_INT16: np.int16, lib.GGUF_TYPE_UINT32: np.uint32, lib.GGUF_TYPE_INT32: np.int32,
    lib.GGUF_TYPE_UINT64: np.uint64, lib.GGUF_TYPE_INT64: np.int64, lib.GGUF_TYPE_FLOAT32: np.float32,
    lib.GGUF_TYPE_FLOAT64: np.float64, lib.GGUF_TYPE_BOOL: np.bool_,
}


def refused_gguf(path: str | os.PathLike) -> GGUFError:
    """gguf_init_from_file refused ``path``: the reasons ggml logged, on the same line (a second "ggml:"
    line read as a second error), without the C functions' names."""
    reasons = [re.sub(r"^\w+: ", "", line.strip()) for line in ggml_log().splitlines() if line.strip()]
    return GGUFError(f"{os.fspath(path)} is not a valid GGUF file (corrupt or truncated)"
                     + (f": {'; '.join(reasons)}" if reasons else ""))


def read_metadata(gguf: Any, lengths: dict[str, int] | None = None) -> dict[str, Any]:
    """Every key/value of an open GGUF file (``gguf_context``), as Python values; with ``lengths``,
    arrays are not read: their lengths go there instead."""
    values: dict[str, Any] = {}
    for i in range(lib.gguf_get_n_kv(gguf)):
        key = ffi.string(lib.gguf_get_key(gguf, i)).decode("utf-8", "replace")
        kind = lib.gguf_get_kv_type(gguf, i)
        if kind == lib.GGUF_TYPE_STRING:
            values[key] = ffi.string(lib.gguf_get_val_str(gguf, i)).decode("utf-8", "replace")
        elif kind == lib.GGUF_TYPE_ARRAY and lengths is not None:
            lengths[key] = lib.gguf_get_arr_n(gguf, i)
        elif kind == lib.GGUF_TYPE_ARRAY:
            n = lib.gguf_get_arr_n(gguf, i)
            item = lib.gguf_get_arr_type(gguf, i)
            if item == lib.GGUF_TYPE_STRING:
                get = lib.gguf_get_arr_str
                values[key] = [ffi.string(get(gguf, i, j)).decode("utf-8", "replace") for j in range(n)]
            elif item in _ARRAY_DTYPES:
                dtype = np.dtype(_ARRAY_DTYPES[item])
                data = ffi.buffer(lib.gguf_get_arr_data(gguf, i), n * dtype.itemsize) if n else b""
                values[key] = np.frombuffer(data, dtype=dtype).tolist()
            # arrays of arrays have no getter in gguf.h; they are skipped
        elif kind in _SCALAR_GETTERS:
            value = _SCALAR_GETTERS[kind](gguf, i)
            values[key] = bool(value) if kind == lib.GGUF_TYPE_BOOL else value
    return values


# Bounds for hyper-parameters read with Config's range-checked getters (Options.from_config of each model):
# far beyond any real model, small enough that no size computed from them overflows ggml's arithmetic
MAX_LAYERS = 1 << 12
MAX_WIDTH = 1 << 20  # embedding, feed-forward, head and vocabulary-independent sizes
MAX_CONTEXT = 2**31 - 1  # ggml takes context lengths and positions as int32
MAX_VOCAB = 2**31 - 1  # token ids are int32
MAX_EXPERTS = 1 << 12
# Every integer hyper-parameter a model reads is bounded, so no count walks a loader through 2**31 layers:
# by the key's last part where it names a family, else (a key of the architecture's or of a vision/projector
# part) MAX_WIDTH: widths, heads, image and patch sizes, ... Other metadata (general.*, ...) reads as stored.
_FAMILY_MAX = {"block_count": MAX_LAYERS, "cross_attention_layers": MAX_LAYERS,
               "intermediate_layers_indices": MAX_LAYERS, "expert_count": MAX_EXPERTS,
               "expert_used_count": MAX_EXPERTS, "expert_shared_count": MAX_EXPERTS,
               "context_length": MAX_CONTEXT, "original_context_length": MAX_CONTEXT, "sliding_window": MAX_CONTEXT,
               "vocab_size": MAX_VOCAB, "token_type_count": MAX_VOCAB}


class Config(Mapping[str, Any]):
    """Typed, read-only GGUF metadata. Keys may omit the ``<architecture>.`` prefix:
    ``config.uint("block_count")`` reads ``llama.block_count`` for a llama file."""

    def __init__(self, values: dict[str, Any]):
        self._values = values
        self.architecture: str = str(values.get("general.architecture", ""))

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def _lookup(self, key: str) -> tuple[str, Any]:
        """(the key as stored, its value or None)."""
        if key in self._values:
            return key, self._values[key]
        full = f"{self.architecture}.{key}"
        return full, self._values.get(full)

    def count_bound(self, key: str) -> int | None:
        """The largest value the integer key (as stored) may hold unless a reader says otherwise, or None."""
        last = key.rsplit(".", 1)[-1]
        if last in _FAMILY_MAX:
            return _FAMILY_MAX[last]
        return MAX_WIDTH if key.startswith((f"{self.architecture}.", "clip.")) else None

    def _typed(self, key: str, default: Any, check: Callable[[Any], bool], kind: str, lo: Any = None,
               hi: Any = None, counted: bool = False) -> Any:
        """The value of ``key`` (``default`` when absent), refused when ``check`` fails or when a value lies
        outside [lo, hi] (NaN always does); ``counted``: an integer, whose bounds default to ``count_bound``."""
        key, value = self._lookup(key)
        if value is None:
            return default
        if counted and hi is None and (hi := self.count_bound(key)) is not None and lo is None:
            lo = -hi
        if not check(value):
            raise GGUFError(f"metadata {key!r} should be {kind}, found {type(value).__name__} {value!r:.80}")
        if lo is not None or hi is not None:
            for v in value if isinstance(value, list) else [value]:
                if v != v or (lo is not None and v < lo) or (hi is not None and v > hi):
                    bounds = " and ".join(x for x in (f">= {lo}" if lo is not None else "",
                                                      f"<= {hi}" if hi is not None else "") if x)
                    raise GGUFError(f"metadata {key!r} = {v!r:.80} is out of range: it must be {bounds}")
        return value

    # ``min``/``max`` (keyword-only) bound a value that is present; a missing key gives ``default`` unchecked.
    # Integers without ``max`` are bounded by ``count_bound`` (and from below by its negative).
    def uint(self, key: str, default: int | None = 0, *, min: int | None = None,  # noqa: A002
             max: int | None = None) -> int | None:  # noqa: A002
        return self._typed(key, default, lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                           "an unsigned integer", min, max, counted=True)

    def int(self, key: str, default: int | None = 0, *, min: int | None = None,  # noqa: A002
            max: int | None = None) -> int | None:  # noqa: A002
        return self._typed(key, default, lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer",
                           min, max, counted=True)

    def float(self, key: str, default: float | None = 0.0, *, min: float | None = None,  # noqa: A002
              max: float | None = None) -> float | None:  # noqa: A002
        """A number; with bounds, NaN and (unless a bound is infinite) infinities are refused too."""
        value = self._typed(key, default, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
                            "a number", min, max)
        return None if value is None else float(value)

    def bool(self, key: str, default: bool | None = False) -> bool | None:
        return self._typed(key, default, lambda v: isinstance(v, bool), "a boolean")

    def string(self, key: str, default: str | None = "") -> str | None:
        return self._typed(key, default, lambda v: isinstance(v, str), "a string")

    def strings(self, key: str, default: list[str] | None = None) -> list[str] | None:
        return self._typed(key, default, lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                           "a list of strings")

    def uints(self, key: str, default: list[int] | None = None, *, min: int | None = None,  # noqa: A002
              max: int | None = None) -> list[int] | None:  # noqa: A002
        return self._typed(key, default, lambda v: isinstance(v, list) and all(isinstance(x, int) for x in v),
                           "a list of integers", min, max, counted=True)

    def floats(self, key: str, default: list[float] | None = None, *, min: float | None = None,  # noqa: A002
               max: float | None = None) -> list[float] | None:  # noqa: A002
        value = self._typed(key, default, lambda v: isinstance(v, list) and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in v), "a list of numbers", min, max)
        return None if value is None else [float(x) for x in value]


@dataclass(frozen=True)
class GGUFSummary:
    """A GGUF header without its arrays' contents (a vocabulary is 10**5 strings) and without loading
    anything: what listing a model or checking it before a load needs."""

    config: Config  # the scalar and string metadata; arrays are left out
    array_lengths: dict[str, int]
    elements_by_type: dict[str, int]  # tensor elements per ggml type name ("Q8_0", "F32", ...)

    @property
    def n_parameters(self) -> int:
        return sum(self.elements_by_type.values())


def read_gguf_summary(path: str | os.PathLike) -> GGUFSummary:
    """The ``GGUFSummary`` of a file, read by ggml's own GGUF parser; ``GGUFError`` for a file it refuses."""
    gguf = lib.gguf_init_from_file(os.fsencode(path), {"no_alloc": True, "ctx": NULL})
    if gguf == NULL:
        raise refused_gguf(path)
    try:
        lengths: dict[str, int] = {}
        config = Config(read_metadata(gguf, lengths))
        by_type: dict[str, int] = {}
        known = {int(d) for d in DType}
        for i in range(lib.gguf_get_n_tensors(gguf)):
            kind = lib.gguf_get_tensor_type(gguf, i)
            dtype = DType(kind) if kind in known else None
            name = dtype.name if dtype is not None else f"type {kind}"
            size = lib.gguf_get_tensor_size(gguf, i)
            n = size // dtype.type_size * dtype.block_size if dtype is not None and dtype.type_size else 0
            by_type[name] = by_type.get(name, 0) + n
        return GGUFSummary(config, lengths, by_type)
    finally:
        lib.gguf_free(gguf)
