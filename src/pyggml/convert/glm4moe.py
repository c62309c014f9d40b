"""GLM-4.5 / 4.6 (GGUF ``glm4moe``, as llama.cpp converts ``Glm4MoeForCausalLM``): grouped-query attention with
q/k/v biases and optional per-head q/k norms, NeoX rope over ``partial_rotary_factor`` of each head (q/k rows
in Hugging Face's order), and DeepSeek V3's experts (``deepseek2.DeepSeekMoE``); the multi-token prediction
layers are left out, as llama.cpp's ``--no-mtp``."""

from __future__ import annotations

import gguf

from .base import register
from .deepseek2 import DeepSeekMoE


@register("Glm4MoeForCausalLM", model_types=("glm4_moe",))
class Glm4Moe(DeepSeekMoE):
    gguf_arch = "glm4moe"
    rope_types = ("default",)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        factor = self.rope.get("partial_rotary_factor", self.config.get("partial_rotary_factor", 0.5))
        self.n_rot = int(self.head_dim * factor)
        if self.n_rot % 2 or not 0 < self.n_rot <= self.head_dim:
            raise ValueError(f"config.json's partial_rotary_factor {factor} gives {self.n_rot} rotated dims of "
                             f"{self.head_dim}; it must be an even number, at most the head size")
        self.qk_norm = bool(self.config.get("use_qk_norm"))
        self.biases = bool(self.config.get("attention_bias"))

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        w.add_vocab_size(self.n_vocab)
        w.add_rope_dimension_count(self.n_rot)
        self.moe_metadata(w, sigmoid=True, grouped=True)

    def expected(self) -> dict[str, tuple[int, ...]]:
        embd, q, kv, head = self.n_embd, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.head_dim
        shapes = {"token_embd.weight": (self.n_vocab, embd)}
        for i in range(self.n_layers):
            p = f"blk.{i}."
            shapes |= {p + "attn_norm.weight": (embd,), p + "attn_q.weight": (q, embd), p + "attn_k.weight": (kv, embd),
                       p + "attn_v.weight": (kv, embd), p + "attn_output.weight": (embd, q)}
            if self.biases:
                shapes |= {p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,)}
            if self.qk_norm:
                shapes |= {p + "attn_q_norm.weight": (head,), p + "attn_k_norm.weight": (head,)}
            shapes[p + "post_attention_norm.weight"] = (embd,)
            shapes |= self.feed_forward_shapes(i)
        shapes["output_norm.weight"] = (embd,)
        if not self.tied:
            shapes["output.weight"] = (self.n_vocab, embd)
        return shapes
