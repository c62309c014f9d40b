"""Qwen 2 / 2.5 (GGUF ``qwen2``): Llama's layout plus q/k/v biases; NeoX rope, so q/k rows stay in HF order."""

from __future__ import annotations

from collections.abc import Iterable

import gguf

from .base import Architecture, register
from .tensors import Source


@register("Qwen2ForCausalLM", "Qwen2Model", model_types=("qwen2",))
class Qwen2(Architecture):
    gguf_arch = "qwen2"
    embedding = None  # e.g. Qwen3-Embedding: a sentence-transformers last-token pooling config

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.config.get("use_sliding_window"):
            raise ValueError("config.json sets use_sliding_window=true; sliding-window Qwen 2 is not supported "
                             "(llama.cpp runs qwen2 with full attention)")
        self.pooling_type = self.sentence_transformers_pooling()
        # a bare Qwen2Model / Qwen3Model (embedding checkpoints): no "model." prefix and no LM head
        self.headless = (self.config.get("architectures") or [""])[0].endswith("Model")
        self.tied = self.tied or self.headless

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        yield from super().tensors(f"model.{name}" if self.headless else name, source)

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        if self.pooling_type is not None:
            w.add_pooling_type(self.pooling_type)

    def expected(self) -> dict[str, tuple[int, ...]]:
        kv = self.n_kv_heads * self.head_dim
        biases = {"blk.{bid}.attn_q.bias": (self.n_heads * self.head_dim,), "blk.{bid}.attn_k.bias": (kv,),
                  "blk.{bid}.attn_v.bias": (kv,)}
        return self.decoder_shapes() | biases
