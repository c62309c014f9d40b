"""``pyggml quantize IN.gguf OUT.gguf TYPE``: re-encode a GGUF's weight matrices with ggml's quantizers.

The file types and their mixes follow llama.cpp's ``llama-quantize`` (so the output loads there):
only 2-d/3-d ``*.weight`` tensors are quantized (never norms, routers, position or token-type
embeddings, convolution kernels); ``output.weight`` (or a tied ``token_embd``) gets Q6_K unless the
type is Q8_0; the ``_M`` mixes give ``attn_v`` and ``ffn_down`` of the first and last eighth of the
layers, and of every third layer between, the next type up; a matrix whose rows are not whole blocks
of the chosen type falls back to a smaller-block type, then F16. Everything else is copied as it is.
No importance matrix: the types that need one are not offered.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from pyggml.tensor import DType, dequantize, quantize

Progress = Callable[[int, int], None]
_F = gguf.LlamaFileType

# name -> (base type of the weight matrices, general.file_type)
FILE_TYPES: dict[str, tuple[DType, _F]] = {
    "F32": (DType.F32, _F.ALL_F32), "F16": (DType.F16, _F.MOSTLY_F16), "BF16": (DType.BF16, _F.MOSTLY_BF16),
    "Q4_0": (DType.Q4_0, _F.MOSTLY_Q4_0), "Q4_1": (DType.Q4_1, _F.MOSTLY_Q4_1),
    "Q5_0": (DType.Q5_0, _F.MOSTLY_Q5_0), "Q5_1": (DType.Q5_1, _F.MOSTLY_Q5_1), "Q8_0": (DType.Q8_0, _F.MOSTLY_Q8_0),
    "Q4_K_S": (DType.Q4_K, _F.MOSTLY_Q4_K_S), "Q4_K_M": (DType.Q4_K, _F.MOSTLY_Q4_K_M),
    "Q5_K_S": (DType.Q5_K, _F.MOSTLY_Q5_K_S), "Q5_K_M": (DType.Q5_K, _F.MOSTLY_Q5_K_M),
    "Q6_K": (DType.Q6_K, _F.MOSTLY_Q6_K), "IQ4_NL": (DType.IQ4_NL, _F.MOSTLY_IQ4_NL),
}
# a type whose blocks do not divide a row falls back to one with 32-wide blocks (then F16)
_FALLBACK = {DType.Q4_K: DType.Q5_0, DType.Q5_K: DType.Q5_1, DType.Q6_K: DType.Q8_0}
# 2-d weights llama.cpp never quantizes (small, or precision-critical)
_KEEP = re.compile(r"_norm\.weight$|ffn_gate_inp\.weight$|^position_embd\.|^token_types\.|ssm_conv1d|shortconv\.conv"
                   r"|altup|laurel|per_layer_model_proj|attn_rel_b|time_mix_|\.patch_embd|\.position_embd")


def parse_file_type(name: str) -> str:
    """The canonical name of a file type ("q4_k_m" -> "Q4_K_M"), or ValueError listing the choices."""
    key = name.upper()
    if key not in FILE_TYPES:
        raise ValueError(f"unknown quantization type {name!r}; choose one of {', '.join(FILE_TYPES)}")
    return key


_ATTN_V = ("attn_v.weight", "attn_qkv.weight", "attn_kv_b.weight")  # llama.cpp's attention-v-like tensors


@dataclass(frozen=True)
class Mix:
    """Which type each tensor of one model gets for one file type: llama.cpp's rules for these types."""

    file_type: str
    n_layers: int
    gqa: int = 1  # query heads per KV head
    n_expert: int = 0
    tied_output: bool = False  # no output.weight: token_embd is the output matrix too
    attn_v: tuple[str, ...] = ()  # the attention-v-like tensors in order (llama.cpp counts them)

    @classmethod
    def of(cls, file_type: str, names: list[str], n_layers: int, gqa: int = 1, n_expert: int = 0) -> Mix:
        """The mix for a model whose tensors are ``names``."""
        attn_v = sorted((n for n in names if any(k in n for k in _ATTN_V)), key=lambda n: (_layer(n), n))
        return cls(file_type, n_layers, gqa, n_expert, "output.weight" not in names, tuple(attn_v))

    def tensor_type(self, name: str, shape: tuple[int, ...], current: DType) -> DType:
        """The type for tensor ``name`` of ggml shape ``shape`` now stored as ``current``."""
        if len(shape) < 2 or not name.endswith("weight") or _KEEP.search(name):
            return current
        base, _ = FILE_TYPES[self.file_type]
        if not base.is_quantized:
            return base
        return self._fit(self._mixed(name, shape, base), shape[0])

    def _mixed(self, name: str, shape: tuple[int, ...], base: DType) -> DType:
        ft, eight = self.file_type, self.n_expert == 8
        if name == "output.weight" or (self.tied_output and name == "token_embd.weight"):
            if shape[0] % base.block_size:
                return DType.Q8_0
            return base if base == DType.Q8_0 else DType.Q6_K
        if any(k in name for k in _ATTN_V):
            i, n = (self.attn_v.index(name), len(self.attn_v)) if name in self.attn_v else (_layer(name), self.n_layers)
            if eight:
                return DType.Q8_0
            if ft == "IQ4_NL" and self.gqa >= 4:
                return DType.Q5_K
            if ft in ("Q4_K_M", "Q5_K_M") and _more_bits(i, n):
                return DType.Q6_K
            if ft == "Q4_K_S" and i < 4:
                return DType.Q5_K
        elif "attn_k.weight" in name and eight:
            return DType.Q8_0
        elif "attn_output.weight" in name and eight and ft in ("Q4_K_S", "Q4_K_M", "IQ4_NL"):
            return DType.Q5_K
        elif "ffn_down" in name:
            i, n = _layer(name), self.n_layers
            if ft in ("Q4_K_M", "Q5_K_M") and _more_bits(i, n):
                return DType.Q6_K
            if ft in ("Q4_K_S", "IQ4_NL") and i < n // 8:
                return DType.Q5_K
        return base

    @staticmethod
    def _fit(dtype: DType, row: int) -> DType:
        if row % dtype.block_size:
            dtype = _FALLBACK.get(dtype, DType.F16)
        return DType.F16 if row % dtype.block_size else dtype


def _layer(name: str) -> int:
    found = re.match(r"blk\.(\d+)\.", name)
    return int(found[1]) if found else -1


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of layers for more bits: the first and last eighth, and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def quantize_gguf(src: str | os.PathLike, dst: str | os.PathLike, file_type: str, *,
                  progress: Progress | None = None, n_threads: int | None = None) -> dict[str, DType]:
    """Write ``src`` re-encoded as ``file_type`` (a ``FILE_TYPES`` name) to ``dst``; returns each
    tensor's new type. ``progress(done, total)`` is called after each tensor with source bytes read.
    The file is written beside ``dst`` and renamed into place when complete."""
    file_type = parse_file_type(file_type)
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise ValueError("quantize: the output must be another file than the input")
    reader = gguf.GGUFReader(src)
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{src}: no general.architecture; not a model GGUF")
    n_layers = int(_field(reader, f"{arch}.block_count") or 0)
    heads, kv_heads = _field(reader, f"{arch}.attention.head_count"), _field(reader, f"{arch}.attention.head_count_kv")
    gqa = heads // kv_heads if isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads else 1
    n_expert = _field(reader, f"{arch}.expert_count")
    mix = Mix.of(file_type, [t.name for t in reader.tensors], n_layers, gqa,
                 n_expert if isinstance(n_expert, int) else 0)
    plan = [(t, DType(int(t.tensor_type)), mix.tensor_type(t.name, tuple(int(n) for n in t.shape),
                                                           DType(int(t.tensor_type)))) for t in reader.tensors]

    tmp = dst.with_name(dst.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, arch=arch)
    try:
        _copy_metadata(reader, writer, FILE_TYPES[file_type][1])
        for t, _, new in plan:
            shape = tuple(int(n) for n in t.shape)  # ggml order
            qtype = gguf.GGMLQuantizationType(new)
            writer.add_tensor_info(t.name, gguf.quant_shape_to_byte_shape(tuple(reversed(shape)), qtype), np.uint8,
                                   new.row_bytes(shape[0]) * int(np.prod(shape[1:])), raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        done, total = 0, sum(int(t.n_bytes) for t, _, _ in plan)
        workers = n_threads or os.cpu_count() or 1
        with ThreadPoolExecutor(workers) as pool:
            for t, old, new in plan:
                writer.write_tensor_data(_encode(t, old, new, pool, workers))
                done += int(t.n_bytes)
                if progress is not None:
                    progress(done, total)
        writer.close()
        os.replace(tmp, dst)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return {t.name: new for t, _, new in plan}


def _encode(t: gguf.ReaderTensor, old: DType, new: DType, pool: ThreadPoolExecutor, workers: int) -> np.ndarray:
    """Tensor ``t``'s bytes in type ``new``: its own when the type stays, else through float32."""
    raw = np.ascontiguousarray(t.data).view(np.uint8).reshape(-1)
    if new == old:
        return raw
    shape = tuple(int(n) for n in t.shape)
    rows = dequantize(raw, old, shape).reshape(-1, shape[0])
    if new == DType.BF16:
        return gguf.quants.quantize(rows, gguf.GGMLQuantizationType.BF16).view(np.uint8).reshape(-1)
    # ggml's quantizers release the GIL: chunks of rows in parallel
    chunks = np.array_split(rows, max(1, min(len(rows) // 16, workers * 4)))
    return np.concatenate([q.reshape(-1) for q in pool.map(lambda c: quantize(c, new), chunks)])


def _field(reader: gguf.GGUFReader, key: str) -> object:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, file_type: gguf.LlamaFileType) -> None:
    """Every key of ``reader`` but the GGUF header's own, with ``general.file_type`` set to ``file_type``."""
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type",
                                              "general.quantization_version"):
            continue
        vtype = field.types[0]
        if key == "general.alignment":
            writer.data_alignment = int(field.contents())
        if vtype == gguf.GGUFValueType.ARRAY:
            if len(field.types) > 2:
                raise ValueError(f"quantize: metadata key {key} is a nested array, which is not supported")
            writer.add_key_value(key, field.contents(), vtype, sub_type=field.types[1] if len(field.types) > 1
                                 else gguf.GGUFValueType.INT32)
        else:
            writer.add_key_value(key, field.contents(), vtype)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
