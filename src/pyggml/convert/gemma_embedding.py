"""EmbeddingGemma (GGUF ``gemma-embedding``): a sentence-transformers folder around a bidirectional Gemma 3 text
model (``Gemma3TextModel`` with ``use_bidirectional_attention``): Gemma 3's tensors, the Pooling module's mode as
``pooling_type`` and the Dense modules (``2_Dense``, ``3_Dense``: no bias, no activation) as ``dense_2`` /
``dense_3`` with their sizes (what llama.cpp's converter writes with ``--sentence-transformers-dense-modules``)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import gguf

from .base import register
from .checkpoint import open_checkpoint, read_json
from .gemma3 import Gemma3
from .tensors import Source

_DENSE = {"2_Dense": "dense_2", "3_Dense": "dense_3"}  # llama.cpp's names for sentence-transformers' folders
_IDENTITY = ("torch.nn.modules.linear.Identity", "torch.nn.Identity", None)


@register("Gemma3TextModel")
class EmbeddingGemma(Gemma3):
    gguf_arch = "gemma-embedding"
    embedding = True

    def __init__(self, hf_dir: Path, config: dict[str, Any], pooling: str | None = None) -> None:
        super().__init__(hf_dir, config, pooling)
        if not self.config.get("use_bidirectional_attention"):
            raise ValueError("config.json has no use_bidirectional_attention=true: a causal Gemma3TextModel is not "
                             "an embedding model GGUF gemma-embedding runs (it attends both ways)")
        self.pooling_type = self.sentence_transformers_pooling() or gguf.PoolingType.MEAN
        self.dense = [self._dense(module) for module in read_json(hf_dir / "modules.json") or []
                      if module.get("type", "").endswith("Dense")]

    def _dense(self, module: dict[str, Any]) -> tuple[str, Path, int, int]:
        """(GGUF name, folder, in, out) of a sentence-transformers Dense module, checked."""
        path = self.hf_dir / module.get("path", "")
        name = _DENSE.get(path.name)
        cfg = read_json(path / "config.json") or {}
        if name is None or not (path / "model.safetensors").exists():
            raise ValueError(f"modules.json names a Dense module in {path.name!r}; GGUF gemma-embedding takes "
                             "2_Dense and 3_Dense, each with its model.safetensors")
        if cfg.get("bias") or cfg.get("activation_function") not in _IDENTITY:
            raise ValueError(f"{path.name}/config.json: a Dense module with a bias or an activation "
                             f"({cfg.get('activation_function')}) is not what GGUF gemma-embedding runs")
        return name, path, int(cfg["in_features"]), int(cfg["out_features"])

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        w.add_pooling_type(self.pooling_type)
        for name, _, n_in, n_out in self.dense:
            w.add_dense_features_dims(name, n_in, n_out)

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        return super().tensors(name if name.startswith("model.") else "model." + name, source)  # a base model's

    def extra_tensors(self) -> Iterable[tuple[str, Source]]:
        yield from super().extra_tensors()
        for name, path, _, _ in self.dense:
            weights = open_checkpoint(path)
            if set(weights.shapes) != {"linear.weight"}:
                raise ValueError(f"{path.name}/model.safetensors holds {sorted(weights.shapes)}, not linear.weight")
            yield f"{name}.weight", Source(weights.shapes["linear.weight"], lambda w=weights: w.load("linear.weight"))

    def expected(self) -> dict[str, tuple[int, ...]]:
        return super().expected() | {f"{name}.weight": (n_out, n_in) for name, _, n_in, n_out in self.dense}
