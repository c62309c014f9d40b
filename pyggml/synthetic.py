"""Random-weight GGUF models at real architecture dimensions, for benchmarking without downloads.

``write_synthetic("llama-1b.gguf", "llama-3.2-1b", "q4_0")`` writes a file llama.cpp and pyggml
both load; its text is meaningless, but every matrix has the real shape and type, so prompt
processing and generation speed are what a real model of that size would show.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from pyggml.tensor import DType, quantize


@dataclass(frozen=True)
class Shape:
    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    vocab: int
    context: int
    rope_base: float
    tied: bool


SHAPES = {
    "tinyllama-1.1b": Shape(22, 2048, 5632, 32, 4, 32000, 2048, 10000.0, False),
    "llama-3.2-1b": Shape(16, 2048, 8192, 32, 8, 128256, 131072, 500000.0, True),
    "llama-3.1-8b": Shape(32, 4096, 14336, 32, 8, 128256, 131072, 500000.0, False),
    "tiny": Shape(2, 256, 512, 8, 4, 1024, 1024, 10000.0, False),  # for tests
}


def write_synthetic(path: str | os.PathLike, shape: str | Shape = "tinyllama-1.1b", dtype: DType | str = "q4_0",
                    seed: int = 0, progress: Callable[[int, int], None] | None = None) -> Path:
    """Write a llama-architecture GGUF with random weights; matrices in ``dtype``, norms in F32."""
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ValueError(f"unknown model shape {shape!r}; known: {', '.join(SHAPES)}")
        shape = SHAPES[shape]
    dtype = DType.parse(dtype)
    if dtype.block_size > 1 and (shape.hidden % dtype.block_size or shape.ffn % dtype.block_size):
        raise ValueError(f"{dtype.name} blocks do not divide the model's rows")
    path = Path(path)
    rng = np.random.default_rng(seed)
    head_dim = shape.hidden // shape.n_heads
    tensors: list[tuple[str, tuple[int, ...], DType]] = [("token_embd.weight", (shape.vocab, shape.hidden), dtype)]
    for i in range(shape.n_layers):
        p = f"blk.{i}."
        tensors += [
            (p + "attn_norm.weight", (shape.hidden,), DType.F32),
            (p + "attn_q.weight", (shape.hidden, shape.hidden), dtype),
            (p + "attn_k.weight", (shape.n_kv_heads * head_dim, shape.hidden), dtype),
            (p + "attn_v.weight", (shape.n_kv_heads * head_dim, shape.hidden), dtype),
            (p + "attn_output.weight", (shape.hidden, shape.hidden), dtype),
            (p + "ffn_norm.weight", (shape.hidden,), DType.F32),
            (p + "ffn_gate.weight", (shape.ffn, shape.hidden), dtype),
            (p + "ffn_up.weight", (shape.ffn, shape.hidden), dtype),
            (p + "ffn_down.weight", (shape.hidden, shape.ffn), dtype),
        ]
    tensors.append(("output_norm.weight", (shape.hidden,), DType.F32))
    if not shape.tied:
        tensors.append(("output.weight", (shape.vocab, shape.hidden), dtype))

    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, "llama")
    _metadata(writer, shape, dtype)
    for name, numpy_shape, kind in tensors:
        nbytes = kind.row_bytes(numpy_shape[-1]) * int(np.prod(numpy_shape[:-1], dtype=np.int64))
        writer.add_tensor_info(name, numpy_shape, np.dtype(np.float32), nbytes,
                               raw_dtype=gguf.GGMLQuantizationType(int(kind)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    total = sum(int(np.prod(s)) for _, s, _ in tensors)
    done = 0
    for _name, numpy_shape, kind in tensors:
        if len(numpy_shape) == 1:  # norms: around 1, as trained models have
            data = (1.0 + 0.1 * rng.standard_normal(numpy_shape, dtype=np.float32)).astype(np.float32)
            writer.write_tensor_data(data)
        else:
            data = rng.standard_normal(numpy_shape, dtype=np.float32)
            data *= 0.02
            writer.write_tensor_data(quantize(data, kind))
        done += data.size
        if progress:
            progress(done, total)
    writer.close()
    os.replace(tmp, path)
    return path


def _metadata(writer: gguf.GGUFWriter, shape: Shape, dtype: DType) -> None:
    writer.add_name(f"synthetic random-weight llama ({dtype.name}; benchmark only)")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.n_layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.n_heads)
    writer.add_head_count_kv(shape.n_kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_rope_dimension_count(shape.hidden // shape.n_heads)
    writer.add_vocab_size(shape.vocab)
    file_types = {DType.F32: 0, DType.F16: 1, DType.Q4_0: 2, DType.Q4_1: 3, DType.Q8_0: 7, DType.Q5_0: 8,
                  DType.Q5_1: 9, DType.Q2_K: 10, DType.Q3_K: 11, DType.Q4_K: 15, DType.Q5_K: 17, DType.Q6_K: 18}
    if dtype in file_types:
        writer.add_file_type(file_types[dtype])
    # a SentencePiece-style vocabulary: control tokens, 256 byte tokens, then filler pieces
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"▁t{i}" for i in range(shape.vocab - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (shape.vocab - 259)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(shape.vocab - 259)])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
