"""Gemma 3 text models (GGUF ``gemma3``): Gemma 2 without soft-capping, with q/k norms, 5 local layers
per global one, separate rope bases (``rope.freq_base`` global; llama.cpp's fixed 10000 local)."""

from __future__ import annotations

from typing import Any

from .base import register
from .gemma2 import Gemma2
from .tensors import Source
from .vocab import Vocab, read_vocab

LOCAL_ROPE_BASE = 10000.0  # llama.cpp runs gemma3's sliding-window layers with this base


@register("Gemma3ForCausalLM", model_types=("gemma3_text",))
class Gemma3(Gemma2):
    gguf_arch = "gemma3"
    swa_period = 6
    layers_27b = 62
    rope_types = ("default", "linear")
    softcaps = ()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.config.get("attn_logit_softcapping") is not None:
            raise ValueError("config.json sets attn_logit_softcapping; GGUF gemma3 has none")
        # llama.cpp drops embedding rows past the tokenizer's last token (and so does the vocabulary here)
        self._vocab = read_vocab(self.hf_dir, self.n_vocab, pad=False)
        self.n_vocab = len(self._vocab.tokens)

    def vocab(self) -> Vocab:
        self._vocab.add_space_prefix = False
        return self._vocab

    def tensors(self, name: str, source: Source):
        if name == "model.embed_tokens.weight":
            source = source.map(lambda w: w[:self.n_vocab], (self.n_vocab, *source.shape[1:]))
        return super().tensors(name, source)

    def expected(self) -> dict[str, tuple[int, ...]]:
        norms = {"blk.{bid}.attn_q_norm.weight": (self.head_dim,), "blk.{bid}.attn_k_norm.weight": (self.head_dim,)}
        return super().expected() | norms

    def _rope_parameters(self) -> dict[str, Any]:
        # transformers >= 5: {"full_attention": {...}, "sliding_attention": {...}}; before: rope_theta for
        # global layers, rope_local_base_freq for local ones, rope_scaling (global layers only)
        self.config = dict(self.config)
        params = self.config.get("rope_parameters") or {}
        local = (params.get("sliding_attention") or {}).get("rope_theta", self.config.get("rope_local_base_freq"))
        if local not in (None, LOCAL_ROPE_BASE):
            raise ValueError(f"config.json's sliding-window rope base is {local}; GGUF gemma3 runs it at 10000")
        if "full_attention" in params:
            self.config["rope_parameters"] = params["full_attention"]
        self.config.setdefault("rope_theta", 1_000_000.0)
        return super()._rope_parameters()
