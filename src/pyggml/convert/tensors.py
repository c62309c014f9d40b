"""Tensors on their way into the file: lazy sources, and the type each is written in.

A :class:`Source` knows its shape (numpy order, GGUF layout) before any data is read, so the file
header can be written first and each tensor loaded, transformed and encoded one at a time: peak
memory is about one tensor (one layer's experts for a stacked tensor), not the whole model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
# --type choices: the type of weight matrices, and the general.file_type that says so
OUT_TYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}
# more --type choices: ``pyggml quantize``'s file types (pyggml.quantize.FILE_TYPES, which needs the compiled module)
QUANTIZED_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "IQ4_NL")
FILE_TYPES = {Q.F32: gguf.LlamaFileType.ALL_F32, Q.F16: gguf.LlamaFileType.MOSTLY_F16,
              Q.BF16: gguf.LlamaFileType.MOSTLY_BF16, Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}


@dataclass(frozen=True)
class Source:
    """A tensor not read yet: its numpy-order shape and a function returning its float32 data, or,
    with ``qtype``, the bytes of data already in that encoding (e.g. MXFP4 experts, repacked as is)."""

    shape: tuple[int, ...]
    load: Callable[[], np.ndarray]
    qtype: Q | None = None

    def map(self, fn: Callable[[np.ndarray], np.ndarray], shape: Sequence[int] | None = None) -> Source:
        """The data passed through ``fn`` (which returns ``shape``, by default the same shape)."""
        return Source(tuple(shape) if shape is not None else self.shape, lambda: fn(self.load()))

    def split(self, sizes: Sequence[int], axis: int = 0) -> list[Source]:
        """Consecutive pieces of ``sizes`` along ``axis`` (a fused q/k/v or gate/up matrix)."""
        if sum(sizes) != self.shape[axis]:
            raise ValueError(f"cannot split {self.shape[axis]} rows into {list(sizes)}")
        bounds = np.cumsum([0, *sizes])
        return [Source(self.shape[:axis] + (int(n),) + self.shape[axis + 1:],
                       lambda b=int(b), e=int(e): np.take(self.load(), np.arange(b, e), axis=axis))
                for b, e, n in zip(bounds[:-1], bounds[1:], sizes, strict=True)]

    @staticmethod
    def stack(parts: Sequence[Source]) -> Source:
        """One tensor with a new leading axis (per-expert matrices into ``ffn_*_exps``)."""
        shapes = {p.shape for p in parts}
        if len(shapes) != 1:
            raise ValueError(f"cannot stack tensors of different shapes {sorted(shapes)}")
        return Source((len(parts), *parts[0].shape), lambda: np.stack([p.load() for p in parts]))

    @staticmethod
    def of(data: np.ndarray) -> Source:
        """A tensor computed by the converter itself (e.g. ``rope_freqs``)."""
        data = np.asarray(data, dtype=np.float32)
        return Source(data.shape, lambda: data)


def tensor_type(name: str, shape: tuple[int, ...], out_type: Q, keep_f32: Sequence[str]) -> Q:
    """llama.cpp's rule: vectors, norms, biases and the kinds in ``keep_f32`` stay F32; matrices get ``out_type``,
    except that a q8_0 matrix whose rows are not a multiple of the 32-wide block falls back to F16."""
    kind = name.split(".")[-2 if name.endswith((".weight", ".bias")) else -1]  # blk.N.ssm_a has no suffix
    if len(shape) < 2 or name.endswith(("_norm.weight", ".bias")) or kind in keep_f32:  # per-expert biases: 2-d
        return Q.F32
    if out_type == Q.Q8_0 and shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0]:
        return Q.F16
    return out_type


def encoded_layout(shape: tuple[int, ...], qtype: Q) -> tuple[tuple[int, ...], type]:
    """(shape, numpy dtype) of the array :func:`encode` returns, for GGUFWriter.add_tensor_info."""
    if qtype in (Q.F32, Q.F16):
        return shape, np.float32 if qtype == Q.F32 else np.float16
    return tuple(gguf.quant_shape_to_byte_shape(shape, qtype)), np.uint8


def encode(data: np.ndarray, qtype: Q) -> np.ndarray:
    """Float32 data in the file's encoding (quantised blocks as bytes)."""
    if qtype in (Q.F32, Q.F16):
        return np.ascontiguousarray(data, dtype=np.float32 if qtype == Q.F32 else np.float16)
    if qtype in (Q.BF16, Q.Q8_0):
        return gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), qtype)
    from pyggml.tensor import quantize  # ggml's own quantizers (K and IQ types): the compiled module

    return quantize(data, int(qtype))
