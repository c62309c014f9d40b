"""The conversion itself: plan every tensor, check the plan against the architecture, write the file."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from . import tensors as tt
from .base import Architecture, UnknownTensorError, architecture_for
from .checkpoint import Checkpoint, open_checkpoint, read_json
from .tensors import Source
from .vocab import write_vocab

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class _Planned:
    name: str  # GGUF name
    origin: str  # the checkpoint tensor it comes from (for messages)
    source: Source
    qtype: gguf.GGMLQuantizationType


def convert_hf(
    hf_dir: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    out_type: str = "f16",
    progress: Progress | None = None,
    pooling: str | None = None,
) -> Path:
    """Write the Hugging Face model directory ``hf_dir`` (config.json, weights, tokenizer) as GGUF.

    The architecture comes from config.json's ``architectures`` (see
    :func:`pyggml.convert.supported`); tensor names and metadata keys are llama.cpp's, so the file
    also loads there. ``out_type`` ("f32", "f16", "bf16" or "q8_0") is the type of weight matrices
    (q8_0 only where rows are a multiple of 32, f16 otherwise); vectors and norms stay f32. A
    ``pyggml quantize`` type ("q4_k_m", "q6_k", ...: :data:`pyggml.quantize.FILE_TYPES`) quantizes the
    matrices from the checkpoint's values as that command would quantize an f32 file (matrices it keeps
    are f16).
    ``progress(done, total)`` is called after each tensor with bytes written so far and in all.
    ``pooling`` ("mean", "cls", "last" or "none") overrides an embedding model's pooling.
    The file is written beside ``out_path`` and renamed into place when complete.
    """
    mixed = out_type not in tt.OUT_TYPES and out_type.upper() in tt.QUANTIZED_TYPES
    if out_type not in tt.OUT_TYPES and not mixed:
        raise ValueError(f"unknown out_type {out_type!r}; choose one of "
                         f"{', '.join([*tt.OUT_TYPES, *(t.lower() for t in tt.QUANTIZED_TYPES)])}")
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    config = read_json(hf_dir / "config.json", required=True)
    arch = architecture_for(config)(hf_dir, config, pooling)
    plan = _plan(arch, open_checkpoint(hf_dir), tt.Q.F16 if mixed else tt.OUT_TYPES[out_type])
    if mixed:
        plan, file_type = _quantized(arch, plan, out_type.upper())
    else:
        file_type = tt.FILE_TYPES[tt.OUT_TYPES[out_type]]
    vocab = arch.vocab()

    tmp_path = out_path.with_name(out_path.name + ".tmp")
    writer = gguf.GGUFWriter(tmp_path, arch.gguf_arch)
    try:
        writer.add_name(hf_dir.resolve().name)
        writer.add_file_type(file_type)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        arch.metadata(writer)
        write_vocab(writer, vocab)
        sizes = []
        for t in plan:
            shape, dtype = tt.encoded_layout(t.source.shape, t.qtype)
            sizes.append(int(np.prod(shape)) * np.dtype(dtype).itemsize)
            raw = None if t.qtype in (tt.Q.F32, tt.Q.F16) else t.qtype
            writer.add_tensor_info(t.name, shape, dtype, sizes[-1], raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        done, total = 0, sum(sizes)
        for t, size in zip(plan, sizes, strict=True):
            data = t.source.load()
            want = tt.encoded_layout(t.source.shape, t.qtype)[0] if t.source.qtype else t.source.shape
            if data.shape != want:
                raise ValueError(f"{t.name} (from {t.origin}): the converter produced shape {data.shape}, not {want}")
            writer.write_tensor_data(data if t.source.qtype else tt.encode(data, t.qtype))
            done += size
            if progress is not None:
                progress(done, total)
        writer.close()
        os.replace(tmp_path, out_path)
    finally:
        writer.close()
        tmp_path.unlink(missing_ok=True)
    return out_path


def _plan(arch: Architecture, checkpoint: Checkpoint, out_type: gguf.GGMLQuantizationType) -> list[_Planned]:
    """Every tensor of the file, in the architecture's order, or ValueError listing every problem found."""
    produced: dict[str, tuple[str, Source]] = {}
    unknown, twice = [], []
    for name in sorted(checkpoint.shapes):
        if arch.skipped(name):
            continue
        source = Source(checkpoint.shapes[name], lambda name=name: checkpoint.load(name))
        try:
            for gguf_name, out in arch.tensors(name, source):
                if gguf_name in produced:
                    twice.append(gguf_name)
                produced[gguf_name] = (name, out)
        except UnknownTensorError:
            unknown.append(name)
    for gguf_name, out in arch.extra_tensors():
        if gguf_name in produced:
            twice.append(gguf_name)
        produced[gguf_name] = ("(computed)", out)

    if unknown:
        raise ValueError(f"checkpoint has tensors the {arch.gguf_arch} converter does not know: "
                         f"{', '.join(unknown[:10])}{' ...' if len(unknown) > 10 else ''}")
    if twice:
        raise ValueError(f"more than one checkpoint tensor maps to {', '.join(twice)}")
    if arch.incomplete():
        raise ValueError(f"checkpoint is missing parts of {', '.join(arch.incomplete())}")
    expected = _expand(arch.expected(), arch.n_layers)
    missing = [f"{n} ({_likely_origin(arch, n, produced, checkpoint)})" for n in expected if n not in produced]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing)}")
    extra = sorted(set(produced) - set(expected))
    if extra:
        raise ValueError(f"checkpoint has tensors a {arch.gguf_arch} file does not have: "
                         f"{', '.join(f'{produced[n][0]} -> {n}' for n in extra[:10])}")
    wrong = [f"{origin} has shape {source.shape} but config.json implies {expected[n]} (for {n})"
             for n, (origin, source) in produced.items() if source.shape != expected[n]]
    if wrong:
        raise ValueError("; ".join(wrong))
    return [_Planned(n, origin, source, source.qtype or tt.tensor_type(n, source.shape, out_type, arch.keep_f32))
            for n, (origin, source) in ((n, produced[n]) for n in expected)]


def _quantized(arch: Architecture, plan: list[_Planned], file_type: str) -> tuple[list[_Planned], gguf.LlamaFileType]:
    """The plan of an f16 file with its f16 matrices given ``pyggml quantize``'s types for ``file_type``."""
    from pyggml.quantize import FILE_TYPES, Mix
    from pyggml.tensor import DType

    mix = Mix.of(file_type, [t.name for t in plan], arch.n_layers, max(1, arch.n_heads // max(1, arch.n_kv_heads)),
                 int(arch.config.get("num_experts") or arch.config.get("num_local_experts") or 0))
    plan = [t if t.qtype != tt.Q.F16 or t.source.qtype else dataclasses.replace(
        t, qtype=tt.Q(int(mix.tensor_type(t.name, tuple(reversed(t.source.shape)), DType.F16)))) for t in plan]
    return plan, FILE_TYPES[file_type][1]


def _expand(templates: dict[str, tuple[int, ...]], n_layers: int) -> dict[str, tuple[int, ...]]:
    """Templates with ``{bid}`` repeated for every block, block by block (as llama.cpp orders a file):
    the names before the first per-block one, then each block's, then the rest."""
    per_block = [n for n in templates if "{bid}" in n]
    first = next((i for i, n in enumerate(templates) if "{bid}" in n), len(templates))
    names = [n for n in list(templates)[:first] if "{bid}" not in n]
    names += [n.format(bid=b) for b in range(n_layers) for n in per_block]
    names += [n for n in list(templates)[first:] if "{bid}" not in n]
    return {n: tuple(templates[n] if n in templates else templates[re.sub(r"^blk\.\d+\.", "blk.{bid}.", n)])
            for n in names}


def _likely_origin(arch: Architecture, gguf_name: str, produced: dict[str, tuple[str, Source]],
                   checkpoint: Checkpoint) -> str:
    """The checkpoint name a missing tensor would have had (for the error message): another block's
    tensor of the same kind renumbered, else the name map's candidate closest to the checkpoint's names."""
    block = re.match(r"blk\.(\d+)\.", gguf_name)
    if block:
        kind = gguf_name[block.end():]
        for other, (origin, _) in produced.items():
            found = re.match(r"blk\.(\d+)\.", other)
            if found and other[found.end():] == kind and f".{found[1]}." in origin:
                return origin.replace(f".{found[1]}.", f".{block[1]}.", 1)
    base, _, suffix = gguf_name.rpartition(".")
    candidates = [hf for hf, (_, mapped) in arch.name_map.mapping.items() if mapped == base]
    if not candidates:
        return "no checkpoint name known"

    def closeness(hf: str) -> int:
        return max((len(os.path.commonprefix([hf, have])) for have in checkpoint.shapes), default=0)

    return f"{max(candidates, key=closeness)}.{suffix}"
