"""Gemma 2 (GGUF ``gemma2``): norms stored as ``1 + weight`` (Gemma's RMSNorm scales by 1 + w), extra
norms after attention and MLP, sliding-window layers alternating with global ones, logit soft-capping."""

from __future__ import annotations

from collections.abc import Iterable

import gguf

from .base import Architecture, register
from .tensors import Source
from .vocab import Vocab


@register("Gemma2ForCausalLM", model_types=("gemma2",))
class Gemma2(Architecture):
    gguf_arch = "gemma2"
    skip = (*Architecture.skip, r"^lm_head\.weight$")  # the output is the embedding (llama.cpp drops a copy)
    always_head_dim = True
    swa_period = 2  # llama.cpp's pattern: in each run of this many layers, the last is global, the rest local
    layers_27b = 46  # the depth llama.cpp recognises as the 27B model, whose queries scale by hidden / heads
    softcaps = ("attn_logit_softcapping", "final_logit_softcapping")  # required: llama.cpp has defaults for both

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tied = True
        if self.config.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"config.json has hidden_activation={self.config['hidden_activation']!r}; "
                             f"GGUF {self.gguf_arch} runs gelu_pytorch_tanh")
        pattern = ["full_attention" if (i + 1) % self.swa_period == 0 else "sliding_attention"
                   for i in range(self.n_layers)]
        if self.config.get("layer_types", pattern) != pattern:
            raise ValueError(f"config.json's layer_types are not GGUF {self.gguf_arch}'s pattern (one global layer "
                             f"after {self.swa_period - 1} sliding-window ones)")
        for key in self.softcaps:
            self.hparam(key)
        scalar = self.config.get("query_pre_attn_scalar", self.head_dim)
        if scalar != self.head_dim and not (self.n_layers == self.layers_27b and scalar == self.n_embd // self.n_heads):
            raise ValueError(f"config.json has query_pre_attn_scalar={scalar}; GGUF {self.gguf_arch} scales queries "
                             f"by head_dim ({self.head_dim}), or by hidden / heads in the 27B model")

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        if self.config.get("attn_logit_softcapping"):
            w.add_attn_logit_softcapping(float(self.config["attn_logit_softcapping"]))
        if self.config.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(float(self.config["final_logit_softcapping"]))
        w.add_sliding_window(int(self.hparam("sliding_window")))

    def vocab(self) -> Vocab:
        vocab = super().vocab()
        vocab.add_space_prefix = False  # as llama.cpp writes for Gemma
        return vocab

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        for gguf_name, out in super().tensors(name, source):
            if gguf_name.endswith("norm.weight"):  # Gemma's RMSNorm multiplies by (1 + weight)
                out = out.map(lambda w: w + 1)
            yield gguf_name, out

    def expected(self) -> dict[str, tuple[int, ...]]:
        embd = self.n_embd
        return self.decoder_shapes() | {"blk.{bid}.post_attention_norm.weight": (embd,),
                                        "blk.{bid}.post_ffw_norm.weight": (embd,)}
