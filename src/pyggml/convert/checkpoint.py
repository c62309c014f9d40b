"""Reading a Hugging Face checkpoint: config files, safetensors (memory-mapped, by hand) and torch .bin files."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Protocol

import numpy as np


class Checkpoint(Protocol):
    """Tensors by Hugging Face name: their shapes up front, their data one at a time as float32."""

    shapes: dict[str, tuple[int, ...]]

    def load(self, name: str) -> np.ndarray: ...


def read_json(path: Path, required: bool = False) -> Any:
    """The parsed file, or None when it does not exist (FileNotFoundError when ``required``)."""
    if not path.exists():
        if required:
            raise FileNotFoundError(
                f"{path.name} not found in {path.parent} (is this a Hugging Face model directory?)")
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def open_checkpoint(hf_dir: Path) -> Checkpoint:
    """The directory's safetensors (one file or the shards of an index), else its pytorch_model.bin."""
    index = read_json(hf_dir / "model.safetensors.index.json")
    if index:
        files = sorted({hf_dir / f for f in index["weight_map"].values()})
    elif (hf_dir / "model.safetensors").exists():
        files = [hf_dir / "model.safetensors"]
    else:
        files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        if (hf_dir / "pytorch_model.bin").exists() or (hf_dir / "pytorch_model.bin.index.json").exists():
            return TorchCheckpoint(hf_dir)
        raise FileNotFoundError(f"no *.safetensors or pytorch_model.bin weights in {hf_dir}")
    for f in files:
        if not f.exists():
            raise FileNotFoundError(f"shard {f.name} listed in model.safetensors.index.json is missing")
    return Safetensors(files)


_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U8": np.uint8}


class Safetensors:
    """Memory-mapped reader for safetensors files (numpy has no bfloat16, so this is done by hand)."""

    def __init__(self, files: list[Path]) -> None:
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._where: dict[str, tuple[np.memmap, str, int, int]] = {}
        for path in files:
            with open(path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
            data = np.memmap(path, dtype=np.uint8, mode="r")
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                begin, end = info["data_offsets"]
                self.shapes[name] = tuple(info["shape"])
                self._where[name] = (data, info["dtype"], 8 + header_len + begin, 8 + header_len + end)

    def load(self, name: str) -> np.ndarray:
        """The tensor as float32 (U8 tensors, packed quantised blocks, as they are)."""
        data, dtype, begin, end = self._where[name]
        if dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name} has dtype {dtype}; supported: {', '.join(_ST_DTYPES)}")
        raw = data[begin:end].view(_ST_DTYPES[dtype]).reshape(self.shapes[name])
        if dtype == "U8":
            return np.array(raw)
        if dtype == "BF16":  # bfloat16 is the top half of a float32
            return (raw.astype(np.uint32) << 16).view(np.float32)
        return raw.astype(np.float32)


class TorchCheckpoint:
    """pytorch_model.bin (or its shards) as float32 numpy arrays; needs torch."""

    def __init__(self, hf_dir: Path) -> None:
        try:
            import torch
        except ImportError:
            raise ImportError(f"{hf_dir} has PyTorch .bin weights, which need torch to read "
                              "(pip install torch, or convert them to safetensors)") from None
        index = read_json(hf_dir / "pytorch_model.bin.index.json")
        files = sorted({hf_dir / f for f in index["weight_map"].values()}) if index else [hf_dir / "pytorch_model.bin"]
        self._tensors: dict[str, Any] = {}
        for f in files:
            self._tensors.update(torch.load(f, map_location="cpu", weights_only=True))
        self.shapes = {name: tuple(t.shape) for name, t in self._tensors.items()}

    def load(self, name: str) -> np.ndarray:
        return self._tensors[name].float().numpy()
