"""Gemma 2 (GGUF ``gemma2``): sliding-window layers among global ones, pre- and post-norms around
attention and MLP, soft-capped attention and final logits, embeddings always tied. Gemma's RMSNorm
multiplies by ``1 + weight``; llama.cpp's files store ``1 + weight``, and so do ours."""

from __future__ import annotations

from collections.abc import Iterable

import gguf

from .base import Architecture, register
from .tensors import Source


@register("Gemma2ForCausalLM", model_types=("gemma2",))
class Gemma2(Architecture):
    gguf_arch = "gemma2"
    default_context = 8192
    large_model_layers = 46  # the 27B model, whose query scale llama.cpp derives from its depth

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tied = True  # Gemma has no separate output matrix
        # llama.cpp has no key for the query scale: 1/sqrt(head_dim), or 1/sqrt(hidden/heads) for the
        # largest model. A checkpoint with another scalar cannot be written as a standard file.
        scalar = self.config.get("query_pre_attn_scalar", self.head_dim)
        expected = self.n_embd // self.n_heads if self.n_layers == self.large_model_layers else self.head_dim
        if scalar != expected:
            raise ValueError(f"config.json has query_pre_attn_scalar={scalar}; GGUF {self.gguf_arch} files imply "
                             f"{expected} for a {self.n_layers}-layer model (llama.cpp reads no key for it)")

    def layer_types(self) -> list[str]:
        """Each layer's attention, "sliding_attention" or "full_attention" (transformers' names)."""
        types = self.config.get("layer_types")
        if types:
            return list(types)
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.n_layers)]

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        w.add_key_length(self.head_dim)
        w.add_value_length(self.head_dim)
        w.add_sliding_window(int(self.hparam("sliding_window")))
        w.add_sliding_window_pattern([t == "sliding_attention" for t in self.layer_types()])
        for key, add in (("attn_logit_softcapping", w.add_attn_logit_softcapping),
                         ("final_logit_softcapping", w.add_final_logit_softcapping)):
            if self.config.get(key):
                add(float(self.config[key]))

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        for gguf_name, out in super().tensors(name, source):
            if gguf_name.endswith("norm.weight"):
                out = out.map(lambda w: w + 1.0)
            yield gguf_name, out

    def expected(self) -> dict[str, tuple[int, ...]]:
        embd = (self.n_embd,)
        return self.decoder_shapes() | {"blk.{bid}.post_attention_norm.weight": embd,
                                        "blk.{bid}.post_ffw_norm.weight": embd}
