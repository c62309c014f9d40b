"""Gemma 3 (GGUF architecture "gemma3"): Gemma 2 with per-head q/k RMSNorm, no soft-capping, five
sliding-window layers to one global layer, and two rope bases (the global layers' may be scaled for
long contexts; the local layers' is 10000 unless the file says). A file with a vision part
(gemma3_vision.py) takes images: each becomes "\n\n<start_of_image>", its embeddings (which see each
other both ways), "<end_of_image>\n\n", as Hugging Face's Gemma3Processor writes it."""

from __future__ import annotations

from pyggml import nn
from pyggml.backend import Backend, Context
from pyggml.models import Batch, gemma2, gemma3_vision, register
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
    vision: gemma3_vision.Vision | None = None

    def __init__(self, backend: Backend):
        super().__init__(backend)
        self.vision = gemma3_vision.load(backend, self.options.hidden_size)

    def attach_mmproj(self, projector: Backend) -> None:
        self.attach_vision(projector, gemma3_vision.load(projector, self.options.hidden_size))

    def forward(self, ctx: Context, batch: Batch) -> Tensor:
        if not batch.multimodal:
            return super().forward(ctx, batch)
        return super().forward(ctx, batch, self._images)

    def _images(self, ctx: Context, h: Tensor, batch: Batch) -> Tensor:
        """Image embeddings over their placeholders (after the text's sqrt(hidden) scaling, as HF does)."""
        for m in batch.multimodal:
            self.cache.set_noncausal(m.index, m.index + self.vision.options.tokens_per_image)
        return nn.multimodal_embeddings(ctx, h, batch)
