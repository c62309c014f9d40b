"""Qwen 3 (GGUF ``qwen3``): Qwen 2 without biases, with per-head RMSNorm of q and k before rope."""

from __future__ import annotations

from .base import register
from .qwen2 import Qwen2


@register("Qwen3ForCausalLM", "Qwen3Model", model_types=("qwen3",))
class Qwen3(Qwen2):
    gguf_arch = "qwen3"
    always_head_dim = True  # as llama.cpp does for a config.json that states head_dim

    def expected(self) -> dict[str, tuple[int, ...]]:
        norms = {"blk.{bid}.attn_q_norm.weight": (self.head_dim,), "blk.{bid}.attn_k_norm.weight": (self.head_dim,)}
        if self.config.get("attention_bias"):
            return super().expected() | norms
        return self.decoder_shapes() | norms
