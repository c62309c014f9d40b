"""Qwen 3 (GGUF ``qwen3``): Qwen 2 without biases, with per-head RMSNorm of q and k before rope.

Qwen3-Embedding is the same network saved without ``model.`` prefixes and with a
sentence-transformers last-token Pooling module: its file carries ``qwen3.pooling_type``."""

from __future__ import annotations

from collections.abc import Iterable

import gguf

from .base import register
from .bert import sentence_transformers_pooling
from .qwen2 import Qwen2
from .tensors import Source


@register("Qwen3ForCausalLM", "Qwen3Model", model_types=("qwen3",))
class Qwen3(Qwen2):
    gguf_arch = "qwen3"
    embedding = True  # Qwen3-Embedding: a pooling type when the checkpoint has one (or pooling=...)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pooling_type = sentence_transformers_pooling(self.hf_dir, self.pooling) if self.embedding else None
        if self.pooling_type == gguf.PoolingType.NONE:
            self.pooling_type = None

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        if self.head_dim == self.n_embd // self.n_heads:  # llama.cpp writes head_dim whenever config.json has it
            w.add_key_length(self.head_dim)
            w.add_value_length(self.head_dim)
        if self.pooling_type is not None:
            w.add_pooling_type(self.pooling_type)

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        if not name.startswith(("model.", "lm_head.")):  # saved from Qwen3Model (Qwen3-Embedding)
            name = "model." + name
        yield from super().tensors(name, source)

    def expected(self) -> dict[str, tuple[int, ...]]:
        norms = {"blk.{bid}.attn_q_norm.weight": (self.head_dim,), "blk.{bid}.attn_k_norm.weight": (self.head_dim,)}
        if self.config.get("attention_bias"):
            return super().expected() | norms
        return self.decoder_shapes() | norms
