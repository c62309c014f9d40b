"""Gemma 3 (GGUF architecture "gemma3"): Gemma 2 with per-head q/k RMSNorm, no soft-capping, five
sliding-window layers to one global layer, and two rope bases (the global layers' may be scaled for
long contexts; the local layers' is 10000 unless the file says). A file with a vision part
(gemma3_vision.py) takes images: each becomes "\n\n<start_of_image>", its embeddings (which see each
other both ways), "<end_of_image>\n\n", as Hugging Face's Gemma3Processor writes it."""

from __future__ import annotations

import numpy as np

from pyggml import image, nn
from pyggml.backend import Backend, Context
from pyggml.models import Batch, Input, ModelError, Multimodal, gemma2, gemma3_vision, register
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
        if self.vision is not None:
            raise ModelError(f"{self.backend.path} has a vision part already; it takes no mmproj file")
        vision = gemma3_vision.load(projector, self.options.hidden_size)
        if vision is None:
            raise ModelError(f"{projector.path}: no vision tensors (v.patch_embd.weight)")
        self.vision, self._projector = vision, projector

    def close(self) -> None:
        super().close()
        if getattr(self, "_projector", None) is not None:
            self._projector.close()
            self._projector = None

    @property
    def takes_images(self) -> bool:
        return self.vision is not None

    def encode_multimodal(self, ctx: Context, data: bytes) -> list[Multimodal]:
        if self.vision is None:
            return super().encode_multimodal(ctx, data)
        return [Multimodal(tensor=t, data=data) for t in self.build_multimodal(ctx, self.preprocess_multimodal(data))]

    def preprocess_multimodal(self, data: bytes) -> dict[str, np.ndarray] | None:
        if self.vision is None:
            return None
        o = self.vision.options
        pixels = image.resize_normalize(image.decode(data), (o.image_size, o.image_size), o.image_mean, o.image_std)
        return {gemma3_vision.PIXELS: pixels}

    def build_multimodal(self, ctx: Context, inputs: dict[str, np.ndarray]) -> list[Tensor]:
        if self.vision is None:
            return super().build_multimodal(ctx, inputs)
        return [self.vision(ctx, inputs[gemma3_vision.PIXELS])]

    def multimodal_worst_case(self) -> dict[str, np.ndarray] | None:
        if self.vision is None:
            return None
        size = self.vision.options.image_size  # every image is resized to it: one graph shape
        return {gemma3_vision.PIXELS: np.zeros((3, size, size), np.float32)}

    def post_tokenize(self, inputs: list[Input]) -> list[Input]:
        if self.vision is None or not any(x.multimodal for x in inputs):
            return inputs
        start, end, soft = self._image_tokens()
        n = self.vision.options.tokens_per_image
        out: list[Input] = []
        for inp in inputs:
            if not inp.multimodal:
                out.append(inp)
                continue
            out += [Input(token=t) for t in start]
            out.append(Input(token=soft, multimodal=inp.multimodal, multimodal_hash=inp.multimodal_hash,
                             same_batch=n))
            out += [Input(token=soft) for _ in range(n - 1)]
            out += [Input(token=t) for t in end]
        return out

    def _image_tokens(self) -> tuple[list[int], list[int], int]:
        """The tokens before and after an image's embeddings, and the placeholder token."""
        tok = self.tokenizer

        def special(text: str) -> int:
            ids = tok.encode(text, add_special=False)
            if len(ids) != 1:
                raise ModelError(f"gemma3: the vocabulary has no {text} token, which images need")
            return ids[0]

        newlines = tok.encode("\n\n", add_special=False)
        soft = tok.encode("<image_soft_token>", add_special=False)
        return ([*newlines, special("<start_of_image>")], [special("<end_of_image>"), *newlines],
                soft[0] if len(soft) == 1 else 0)

    def forward(self, ctx: Context, batch: Batch) -> Tensor:
        if not batch.multimodal:
            return super().forward(ctx, batch)
        return super().forward(ctx, batch, self._images)

    def _images(self, ctx: Context, h: Tensor, batch: Batch) -> Tensor:
        """Image embeddings over their placeholders (after the text's sqrt(hidden) scaling, as HF does)."""
        for m in batch.multimodal:
            self.cache.set_noncausal(m.index, m.index + self.vision.options.tokens_per_image)
        return nn.multimodal_embeddings(ctx, h, batch)
