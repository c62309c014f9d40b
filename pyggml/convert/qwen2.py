"""Qwen 2 / 2.5 (GGUF ``qwen2``): Llama's layout plus q/k/v biases; NeoX rope, so q/k rows stay in HF order."""

from __future__ import annotations

from .base import Architecture, register


@register("Qwen2ForCausalLM", model_types=("qwen2",))
class Qwen2(Architecture):
    gguf_arch = "qwen2"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.config.get("use_sliding_window"):
            raise ValueError("config.json sets use_sliding_window=true; sliding-window Qwen 2 is not supported "
                             "(llama.cpp runs qwen2 with full attention)")

    def expected(self) -> dict[str, tuple[int, ...]]:
        kv = self.n_kv_heads * self.head_dim
        biases = {"blk.{bid}.attn_q.bias": (self.n_heads * self.head_dim,), "blk.{bid}.attn_k.bias": (kv,),
                  "blk.{bid}.attn_v.bias": (kv,)}
        return self.decoder_shapes() | biases
