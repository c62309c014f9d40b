"""Gemma 3 text decoder (GGUF architecture "gemma3"): Gemma 2 with per-head q/k RMSNorm, no
soft-capping, five sliding-window layers to one global layer, and two rope bases (the global
layers' may be scaled for long contexts; the local layers' is 10000 unless the file says)."""

from __future__ import annotations

from pyggml import nn
from pyggml.models import gemma2, register
from pyggml.tensor import Tensor


class Options(gemma2.Options):
    @classmethod
    def from_config(cls, config) -> Options:
        return super().from_config(config, default_pattern=6, large_model_layers=62, local_rope_base=10000.0)


class SelfAttention(gemma2.SelfAttention):
    attn_q_norm: nn.RMSNorm = nn.shape("head_dim")
    attn_k_norm: nn.RMSNorm = nn.shape("head_dim")

    def norm_qk(self, q: Tensor, k: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        return self.attn_q_norm(q, eps), self.attn_k_norm(k, eps)


class Layer(gemma2.Layer):
    attention: SelfAttention


class Weights(gemma2.Weights):
    blk: list[Layer]


@register("gemma3")
class Gemma3(gemma2.Gemma2):
    Options, Weights = Options, Weights
