"""Gemma 3's vision part: a SigLIP encoder (patch convolution, learned positions, pre-LayerNorm
transformer layers with biased attention and a GELU-tanh MLP, a final LayerNorm) and Gemma's
projector (average pooling of the patch grid down to ``mm_tokens_per_image``, an RMSNorm stored as
``1 + weight``, a projection into the text model's width). Tensors and keys are named as llama.cpp's
``mmproj`` files name them (``v.*``, ``mm.*``, ``clip.vision.*``); here they sit in the model file."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from pyggml import image, nn
from pyggml.backend import Context
from pyggml.models import Input, ModelError, VisionPart
from pyggml.tensor import DType, Tensor

KEY = "clip.vision."
PIXELS = "pixels"  # the vision graph's one input: (3, size, size) normalised pixels
FLASH = True  # the encoder attends over thousands of patches: ggml's fused attention (2x faster on CPU)


@dataclass(frozen=True)
class VisionOptions:
    hidden_size: int
    ffn_size: int
    n_layers: int
    n_heads: int
    eps: float
    image_size: int
    patch_size: int
    merge: int  # the pooling kernel: patches per side / tokens per side
    text_hidden: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def n_patches(self) -> int:
        return self.patches_per_side ** 2

    @property
    def tokens_per_image(self) -> int:
        return (self.patches_per_side // self.merge) ** 2

    @classmethod
    def from_config(cls, config, text_hidden: int) -> VisionOptions:
        projector = config.get("clip.projector_type", config.get("clip.vision.projector_type", "gemma3"))
        if projector != "gemma3":
            raise ModelError(f"gemma3: the vision projector is {projector!r}, not 'gemma3'")

        def uint(key: str, default: int | None = None) -> int:
            value = config.uint(KEY + key, default)
            if not value:
                raise ModelError(f"gemma3: the vision part needs a non-zero {KEY + key}")
            return value

        hidden, n_heads = uint("embedding_length"), uint("attention.head_count")
        image, patch, merge = uint("image_size"), uint("patch_size"), uint("projector.scale_factor", 4)
        if hidden % n_heads or image % patch or (image // patch) % merge:
            raise ModelError(f"gemma3: vision sizes do not divide: hidden {hidden} / {n_heads} heads, image {image} / "
                             f"patch {patch} / pooling {merge}")
        projection = config.uint(KEY + "projection_dim", 0) or text_hidden
        if projection != text_hidden:
            raise ModelError(f"gemma3: the vision projection width {projection} is not the text width {text_hidden}")
        mean = tuple(config.get(KEY + "image_mean", (0.5, 0.5, 0.5)))
        std = tuple(config.get(KEY + "image_std", (0.5, 0.5, 0.5)))
        if len(mean) != 3 or len(std) != 3 or not all(s > 0 for s in std):
            raise ModelError(f"gemma3: {KEY}image_mean/image_std must be 3 numbers (std > 0)")
        return cls(hidden_size=hidden, ffn_size=uint("feed_forward_length"), n_layers=uint("block_count"),
                   n_heads=n_heads, eps=config.float(KEY + "attention.layer_norm_epsilon", 1e-6), image_size=image,
                   patch_size=patch, merge=merge, text_hidden=text_hidden, image_mean=mean, image_std=std)


class EncoderLayer(nn.Module):
    ln1: nn.LayerNorm = nn.shape("hidden_size", bias=True)
    attn_q: nn.Linear = nn.shape("hidden_size", "hidden_size", bias=True)
    attn_k: nn.Linear = nn.shape("hidden_size", "hidden_size", bias=True)
    attn_v: nn.Linear = nn.shape("hidden_size", "hidden_size", bias=True)
    attn_out: nn.Linear = nn.shape("hidden_size", "hidden_size", bias=True)
    ln2: nn.LayerNorm = nn.shape("hidden_size", bias=True)
    ffn_up: nn.Linear = nn.shape("hidden_size", "ffn_size", bias=True)
    ffn_down: nn.Linear = nn.shape("ffn_size", "hidden_size", bias=True)

    def __call__(self, ctx: Context, h: Tensor, o: VisionOptions) -> Tensor:
        x, n = self.ln1(h, o.eps), h.shape[1]
        head_dim = o.hidden_size // o.n_heads
        q, k, v = (lin(x).reshape(head_dim, o.n_heads, n) for lin in (self.attn_q, self.attn_k, self.attn_v))
        h = h + self.attn_out(nn.attention(ctx, q, k, v, None, 1.0 / math.sqrt(head_dim), flash=FLASH))
        return h + self.ffn_down(self.ffn_up(self.ln2(h, o.eps)).gelu())


class VisionTower(nn.Module):
    """The ``v.*`` tensors: pixels (3, size, size), normalised -> states (hidden, n_patches)."""

    patch_embd: nn.Linear = nn.shape("patch_size", "patch_size", 3, "hidden_size", bias=True)
    position_embd: nn.Embedding = nn.shape("hidden_size", "n_patches")
    blk: list[EncoderLayer]
    post_ln: nn.LayerNorm = nn.shape("hidden_size", bias=True)

    def __call__(self, ctx: Context, pixels: np.ndarray, o: VisionOptions) -> Tensor:
        # named: the runner keeps this graph and refills the pixels for the next image (Engine.encode)
        image = ctx.from_numpy(np.ascontiguousarray(pixels, dtype=np.float32)[None], name=PIXELS)  # (W, H, 3, 1)
        kernel, p = self.patch_embd.weight, o.patch_size
        cols = image.im2col(kernel, p, p, 0, 0, 1, 1, dtype=DType.F32)  # (p*p*3, W/p, H/p, 1)
        h = kernel.reshape(p * p * 3, o.hidden_size, ctx=ctx).mulmat(cols.reshape(p * p * 3, o.n_patches))
        h = h + self.patch_embd.bias + self.position_embd.weight
        for i, layer in enumerate(self.blk):
            h = nn.tap(f"v.blk.{i}", layer(ctx, h, o))
        return self.post_ln(h, o.eps)


class Projector(nn.Module):
    """The ``mm.*`` tensors: states (hidden, n_patches) -> image embeddings (text_hidden, tokens_per_image)."""

    soft_emb_norm: nn.RMSNorm = nn.shape("hidden_size")
    input_projection: nn.Weight = nn.shape("text_hidden", "hidden_size")  # (vision, text) in HF's order

    def __call__(self, ctx: Context, h: Tensor, o: VisionOptions) -> Tensor:
        side = o.patches_per_side
        grid = h.transpose().contiguous(side, side, o.hidden_size)  # (x, y, channel)
        pooled = grid.avg_pool_2d(o.merge, o.merge)
        tokens = pooled.reshape(o.tokens_per_image, o.hidden_size).transpose().contiguous()
        tokens = self.soft_emb_norm(tokens, o.eps)
        return self.input_projection.weight.permute(1, 0, 2, 3, ctx=ctx).contiguous().mulmat(tokens)


@dataclass(frozen=True)
class Vision(VisionPart):
    """The model's vision part: every image resized to ``image_size`` (one graph shape), its
    ``tokens_per_image`` embeddings between "\n\n<start_of_image>" and "<end_of_image>\n\n", as Hugging
    Face's Gemma3Processor writes it; they see each other both ways (the text model's ``_images``)."""

    options: VisionOptions
    tower: VisionTower
    projector: Projector

    def __call__(self, ctx: Context, pixels: np.ndarray) -> Tensor:
        return self.projector(ctx, self.tower(ctx, pixels, self.options), self.options)

    def preprocess(self, data: bytes) -> dict[str, np.ndarray]:
        o = self.options
        return {PIXELS: image.resize_normalize(image.decode(data), (o.image_size, o.image_size), o.image_mean,
                                               o.image_std)}

    def build(self, ctx: Context, inputs: Mapping[str, np.ndarray]) -> list[Tensor]:
        return [self(ctx, inputs[PIXELS])]

    def worst_case(self) -> dict[str, np.ndarray]:
        size = self.options.image_size
        return {PIXELS: np.zeros((3, size, size), np.float32)}

    def placeholders(self, image: Input, tokenizer) -> list[Input]:
        start, end, soft = _image_tokens(tokenizer)
        n = self.options.tokens_per_image  # the rows and the token after them go in one batch
        return [*(Input(token=t) for t in start),
                Input(token=soft, multimodal=image.multimodal, multimodal_hash=image.multimodal_hash, same_batch=n),
                *(Input(token=soft) for _ in range(n - 1)), *(Input(token=t) for t in end)]


def _image_tokens(tok) -> tuple[list[int], list[int], int]:
    """The tokens before and after an image's embeddings, and the placeholder token."""

    def special(text: str) -> int:
        ids = tok.encode(text, add_special=False)
        if len(ids) != 1:
            raise ModelError(f"gemma3: the vocabulary has no {text} token, which images need")
        return ids[0]

    newlines = tok.encode("\n\n", add_special=False)
    soft = tok.encode("<image_soft_token>", add_special=False)
    return ([*newlines, special("<start_of_image>")], [special("<end_of_image>"), *newlines],
            soft[0] if len(soft) == 1 else 0)


def load(backend, text_hidden: int) -> Vision | None:
    """The vision part of a gemma3 file (``v.*``, ``mm.*``), or None when it has none (text only)."""
    if backend.get("v.patch_embd.weight") is None:
        return None
    opts = VisionOptions.from_config(backend.config, text_hidden)
    return Vision(opts, nn.load(VisionTower, nn.Prefixed(backend, "v."), opts),
                  nn.load(Projector, nn.Prefixed(backend, "mm."), opts))


