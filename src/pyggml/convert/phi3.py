"""Phi-3 / Phi-4-mini (GGUF ``phi3``): q/k/v in one ``attn_qkv`` matrix and gate/up in one ``ffn_up``
(GGUF keeps both fused, as the checkpoint has them); LongRoPE factors as ``rope_factors_{long,short}``."""

from __future__ import annotations

import math
from collections.abc import Iterable

import gguf

from .base import Architecture, register
from .tensors import Source


@register("Phi3ForCausalLM", model_types=("phi3",))
class Phi3(Architecture):
    gguf_arch = "phi3"
    rope_types = ("default", "longrope", "su")  # "su" is LongRoPE's first name

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        partial = self.config.get("partial_rotary_factor", self.rope.get("partial_rotary_factor", 1.0))
        self.n_rot = int(partial * self.n_embd) // self.n_heads
        self.original_context = int(self.config.get("original_max_position_embeddings")
                                    or self.rope.get("original_max_position_embeddings") or self.context_length)
        self.longrope = self.rope["rope_type"] in ("longrope", "su")
        if self.longrope:
            for key in ("long_factor", "short_factor"):
                if len(self.rope.get(key) or ()) != self.n_rot // 2:
                    raise ValueError(f"config.json's rope {key} must have {self.n_rot // 2} values (rotated dims / 2)")

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        w.add_rope_scaling_orig_ctx_len(self.original_context)
        w.add_rope_dimension_count(self.n_rot)
        w.add_sliding_window(self.config.get("sliding_window") or 0)  # 0: none (Phi-4)
        if self.longrope:  # LongRoPE's attention scale, as transformers computes it
            scale = self.context_length / self.original_context
            default = math.sqrt(1 + math.log(scale) / math.log(self.original_context)) if scale > 1 else 1.0
            w.add_rope_scaling_attn_factors(float(self.rope.get("attention_factor") or default))

    def extra_tensors(self) -> Iterable[tuple[str, Source]]:
        if self.longrope:
            yield "rope_factors_long.weight", Source.of(self.rope["long_factor"])
            yield "rope_factors_short.weight", Source.of(self.rope["short_factor"])

    def expected(self) -> dict[str, tuple[int, ...]]:
        embd, ff, vocab = self.n_embd, self.hparam("intermediate_size"), self.n_vocab
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        shapes = {"rope_factors_long.weight": (self.n_rot // 2,), "rope_factors_short.weight": (self.n_rot // 2,)}
        shapes = shapes if self.longrope else {}
        shapes |= {
            "token_embd.weight": (vocab, embd),
            "blk.{bid}.attn_norm.weight": (embd,),
            "blk.{bid}.attn_qkv.weight": (q + 2 * kv, embd),
            "blk.{bid}.attn_output.weight": (embd, q),
            "blk.{bid}.ffn_norm.weight": (embd,),
            "blk.{bid}.ffn_up.weight": (2 * ff, embd),  # gate rows, then up rows
            "blk.{bid}.ffn_down.weight": (embd, ff),
            "output_norm.weight": (embd,),
        }
        if not self.tied:
            shapes["output.weight"] = (vocab, embd)
        return shapes
