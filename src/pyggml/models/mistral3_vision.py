"""Mistral 3's vision part (Pixtral): an image kept at its aspect ratio (longest edge at most ``image_size``,
each side a multiple of ``patch_size * merge``), cut into patches by a convolution, RMS-normed, then
transformer layers with 2-D rotary positions (half of each head turns with the patch's row, half with its
column) and SwiGLU; Mistral 3's projector RMS-norms the states, merges each ``merge x merge`` block of
patches by a linear layer, and maps them to the text model's width (linear, GELU, linear). In the prompt an
image is its embeddings row by row, ``[IMG_BREAK]`` after each row but the last, then ``[IMG_END]``
(Hugging Face's PixtralProcessor); the break rows come out of the graph too (the ``[IMG_BREAK]`` embedding
``v.token_embd.img_break``), as llama.cpp's mtmd gives them. Names and layout are those of llama.cpp's
``pixtral`` mmproj files (q/k rows in rope pair order); here they may sit in the model file."""

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
PIXELS = "pixels"  # the graph's one input: (3, height, width) normalised pixels
FLASH = True  # thousands of patches attend to each other: ggml's fused attention keeps the memory small
ROPE_BASE = 10000.0  # Pixtral's (llama.cpp's mtmd assumes it)


@dataclass(frozen=True)
class VisionOptions:
    hidden_size: int
    ffn_size: int
    n_layers: int
    n_heads: int
    eps: float
    image_size: int  # the longest edge
    patch_size: int
    merge: int  # patches per side merged into one image token
    text_hidden: int
    silu: bool  # the layers' gated activation: SiLU (clip.use_silu), else GELU (llama.cpp's default)
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    @property
    def unit(self) -> int:
        """Pixels per image token along a side: image sides are multiples of it."""
        return self.patch_size * self.merge

    @property
    def merged_size(self) -> int:
        return self.hidden_size * self.merge ** 2

    @classmethod
    def from_config(cls, config, text_hidden: int) -> VisionOptions:
        projector = config.get("clip.projector_type", config.get("clip.vision.projector_type"))
        if projector != "pixtral":
            raise ModelError(f"mistral3: the vision projector is {projector!r}, not 'pixtral'")

        def uint(key: str, default: int | None = None) -> int:
            return config.uint(KEY + key, default, min=1, max=1 << 20)

        hidden, n_heads, patch, merge = (uint("embedding_length"), uint("attention.head_count"), uint("patch_size"),
                                         uint("spatial_merge_size", 1))
        if hidden % n_heads or (hidden // n_heads) % 4:
            raise ModelError(f"mistral3: {KEY}embedding_length {hidden} is not {n_heads} heads of a multiple of 4 "
                             "(2-D rotary positions turn pairs by rows and columns)")
        mean, std = config.get(KEY + "image_mean", [0.5] * 3), config.get(KEY + "image_std", [0.5] * 3)
        if len(mean) != 3 or len(std) != 3 or not all(s > 0 for s in std):
            raise ModelError(f"mistral3: {KEY}image_mean/image_std must be 3 numbers (std > 0)")
        if config.get("clip.use_gelu", False) and config.get("clip.use_silu", False):
            raise ModelError("mistral3: clip.use_gelu and clip.use_silu are both set")
        return cls(hidden_size=hidden, ffn_size=uint("feed_forward_length"), n_layers=uint("block_count"),
                   n_heads=n_heads, eps=config.float(KEY + "attention.layer_norm_epsilon", 1e-5),
                   image_size=uint("image_size"), patch_size=patch, merge=merge, text_hidden=text_hidden,
                   silu=bool(config.get("clip.use_silu", False)), image_mean=tuple(mean), image_std=tuple(std))


def rope_2d(x: Tensor, rows: Tensor, cols: Tensor, base: float = ROPE_BASE) -> Tensor:
    """Pixtral's rotary positions on ``x`` (head_dim, n_heads, n_patches), its q/k rows in pair order: the
    first half of each head turns by the patch's row with the even frequencies base^(-4i/head_dim), the
    second half by its column with the odd ones base^(-(4i+2)/head_dim)."""
    d, heads, n = x.shape[:3]
    half, size = d // 2, 4  # x: the F32 product of a projection, contiguous
    strides = (d * size, d * heads * size)
    first = x.view(0, (half, heads, n), strides).rope(rows, half, base)
    second = x.view(half * size, (half, heads, n), strides).rope(cols, half, base, base ** (-2.0 / d))
    return first.concat(second, 0)


class EncoderLayer(nn.Module):
    ln1: nn.RMSNorm = nn.shape("hidden_size")
    attn_q: nn.Linear = nn.shape("hidden_size", "hidden_size")
    attn_k: nn.Linear = nn.shape("hidden_size", "hidden_size")
    attn_v: nn.Linear = nn.shape("hidden_size", "hidden_size")
    attn_out: nn.Linear = nn.shape("hidden_size", "hidden_size")
    ln2: nn.RMSNorm = nn.shape("hidden_size")
    ffn_gate: nn.Linear = nn.shape("hidden_size", "ffn_size")
    ffn_up: nn.Linear = nn.shape("hidden_size", "ffn_size")
    ffn_down: nn.Linear = nn.shape("ffn_size", "hidden_size")

    def __call__(self, ctx: Context, h: Tensor, rows: Tensor, cols: Tensor, o: VisionOptions) -> Tensor:
        x, n = self.ln1(h, o.eps), h.shape[1]
        q, k, v = (lin(x).reshape(o.head_dim, o.n_heads, n) for lin in (self.attn_q, self.attn_k, self.attn_v))
        q, k = rope_2d(q, rows, cols), rope_2d(k, rows, cols)
        h = h + self.attn_out(nn.attention(ctx, q, k, v, None, 1.0 / math.sqrt(o.head_dim), flash=FLASH))
        x = self.ln2(h, o.eps)
        gate = self.ffn_gate(x)
        return h + self.ffn_down(gate.silu(self.ffn_up(x)) if o.silu else gate.gelu_erf() * self.ffn_up(x))


class BreakEmbedding(nn.Module):
    nested = "token_embd"
    img_break: nn.Parameter = nn.shape("text_hidden")  # the text model's [IMG_BREAK] embedding


class VisionTower(nn.Module):
    """The ``v.*`` tensors: pixels (3, H, W), normalised -> states (hidden, H/p * W/p), row by row."""

    patch_embd: nn.Linear = nn.shape("patch_size", "patch_size", 3, "hidden_size")
    token_embd: BreakEmbedding
    pre_ln: nn.RMSNorm = nn.shape("hidden_size")
    blk: list[EncoderLayer]

    def __call__(self, ctx: Context, pixels: np.ndarray, o: VisionOptions) -> Tensor:
        _, height, width = pixels.shape
        nx, ny, p = width // o.patch_size, height // o.patch_size, o.patch_size
        # named: the runner keeps this graph per image shape and refills the pixels (Engine.encode)
        image = ctx.from_numpy(np.ascontiguousarray(pixels, dtype=np.float32)[None], name=PIXELS)  # (W, H, 3, 1)
        kernel = self.patch_embd.weight
        cols = image.im2col(kernel, p, p, 0, 0, 1, 1, dtype=DType.F32)  # (p*p*3, nx, ny, 1)
        h = kernel.reshape(p * p * 3, o.hidden_size, ctx=ctx).mulmat(cols.reshape(p * p * 3, nx * ny))
        h = self.pre_ln(h, o.eps)
        # each patch's row and column (a constant of the graph's shape)
        rows = nn.int32_input(ctx, np.repeat(np.arange(ny), nx))
        columns = nn.int32_input(ctx, np.tile(np.arange(nx), ny))
        for i, layer in enumerate(self.blk):
            h = nn.tap(f"v.blk.{i}", layer(ctx, h, rows, columns, o))
        return h


class Projector(nn.Module):
    """The ``mm.*`` tensors: states (hidden, patches) -> image embeddings (text_hidden, merged patches)."""

    # Mistral 3's merger (llama.cpp's pixtral mmproj also serves Pixtral 12B, which has none)
    input_norm: nn.RMSNorm | None = nn.shape("hidden_size")
    patch_merger: nn.Linear | None = nn.shape("merged_size", "hidden_size")
    linear_1: nn.Linear = nn.shape("hidden_size", "text_hidden")
    linear_2: nn.Linear = nn.shape("text_hidden", "text_hidden")

    def __call__(self, ctx: Context, h: Tensor, nx: int, ny: int, o: VisionOptions) -> Tensor:
        if self.patch_merger is not None:
            m = o.merge
            grid = self.input_norm(h, o.eps).transpose().contiguous(nx, ny, o.hidden_size)  # (x, y, channel)
            # each m x m block's states, channel-major then row then column (torch's unfold): an im2col
            # whose kernel only gives the shape (a contiguous view, as GPU backends want)
            kernel = grid.view(0, (m, m, o.hidden_size))
            blocks = grid.reshape(nx, ny, o.hidden_size, 1).im2col(kernel, m, m, 0, 0, 1, 1, dtype=DType.F32)
            h = self.patch_merger(blocks.reshape(o.merged_size, (nx // m) * (ny // m)))
        return self.linear_2(self.linear_1(h).gelu_erf())


@dataclass(frozen=True)
class Vision(VisionPart):
    """The model's vision part: per image, its embeddings row by row with the ``[IMG_BREAK]`` embedding after
    each row but the last (one graph per image shape; the text model attends to them causally)."""

    options: VisionOptions
    tower: VisionTower
    projector: Projector

    def __call__(self, ctx: Context, pixels: np.ndarray) -> Tensor:
        o = self.options
        _, height, width = pixels.shape
        nx, ny = width // o.patch_size, height // o.patch_size
        tokens = self.projector(ctx, self.tower(ctx, pixels, o), nx, ny, o)  # (text_hidden, cols * rows)
        cols, rows = nx // o.merge, ny // o.merge
        if rows == 1:
            return tokens
        breaks = self.tower.token_embd.img_break.weight.reshape(o.text_hidden, 1, 1, ctx=ctx).repeat(
            o.text_hidden, 1, rows)
        lines = tokens.reshape(o.text_hidden, cols, rows).concat(breaks, 1)  # (text_hidden, cols + 1, rows)
        return lines.reshape(o.text_hidden, (cols + 1) * rows).view(0, (o.text_hidden, (cols + 1) * rows - 1))

    def size(self, width: int, height: int) -> tuple[int, int]:
        """The (width, height) an image is resized to: scaled down (rounded down) to fit ``image_size`` if it
        is larger, then each side up to a multiple of ``patch_size * merge`` (PixtralImageProcessor)."""
        o = self.options
        ratio = max(height / o.image_size, width / o.image_size)
        if ratio > 1:
            width, height = math.floor(width / ratio), math.floor(height / ratio)
        return -(-width // o.unit) * o.unit, -(-height // o.unit) * o.unit

    def preprocess(self, data: bytes) -> dict[str, np.ndarray]:
        o, picture = self.options, image.decode(data)
        return {PIXELS: image.resize_normalize(picture, self.size(*picture.size), o.image_mean, o.image_std,
                                               bicubic=True)}

    def build(self, ctx: Context, inputs: Mapping[str, np.ndarray]) -> list[Tensor]:
        pixels = inputs[PIXELS]
        o = self.options
        if pixels.ndim != 3 or pixels.shape[0] != 3 or pixels.shape[1] % o.unit or pixels.shape[2] % o.unit:
            raise ValueError(f"mistral3: pixels must be (3, height, width) in multiples of {o.unit}, got "
                             f"{pixels.shape}")
        return [self(ctx, pixels)]

    def worst_case(self) -> dict[str, np.ndarray]:
        side = self.size(self.options.image_size, self.options.image_size)[0]
        return {PIXELS: np.zeros((3, side, side), np.float32)}

    def placeholders(self, image: Input, tokenizer) -> list[Input]:
        img, brk, end = (_special(tokenizer, t) for t in ("[IMG]", "[IMG_BREAK]", "[IMG_END]"))
        _, height, width = image.multimodal[0].data[PIXELS].shape
        cols, rows = width // self.options.unit, height // self.options.unit
        tokens = ([img] * cols + [brk]) * rows
        tokens[-1] = end  # the embeddings stand for all but [IMG_END]; it and they go in one batch
        return [Input(token=img, multimodal=image.multimodal, multimodal_hash=image.multimodal_hash,
                      same_batch=len(tokens) - 1), *(Input(token=t) for t in tokens[1:])]


def _special(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special=False)
    if len(ids) != 1:
        raise ModelError(f"mistral3: the vocabulary has no {text} token, which images need")
    return ids[0]


_PROJECTOR_NAMES = {"linear_1.": "1.", "linear_2.": "2."}  # llama.cpp's mm.1 / mm.2


class _Projector(nn.Prefixed):
    def get(self, name: str) -> Tensor | None:
        for ours, theirs in _PROJECTOR_NAMES.items():
            if name.startswith(ours):
                name = theirs + name.removeprefix(ours)
        return super().get(name)


def load(backend, text_hidden: int) -> Vision | None:
    """The vision part of a mistral3 file or a pixtral mmproj (``v.*``, ``mm.*``); None when it has none."""
    if backend.get("v.patch_embd.weight") is None:
        return None
    opts = VisionOptions.from_config(backend.config, text_hidden)
    projector = nn.load(Projector, _Projector(backend, "mm."), opts)
    if (projector.input_norm is None) != (projector.patch_merger is None) or (
            opts.merge > 1 and projector.patch_merger is None):
        raise ModelError(f"mistral3: spatial_merge_size {opts.merge} needs mm.input_norm.weight and "
                         "mm.patch_merger.weight (both or, without merging, neither)")
    return Vision(opts, nn.load(VisionTower, nn.Prefixed(backend, "v."), opts), projector)


def attach(model, projector) -> None:
    """Give ``model`` (a text model with Pixtral's placeholders in its forward) the vision part of a llama.cpp
    pixtral mmproj, which it then owns (``model._projector``, closed with it)."""
    if model.vision is not None:
        raise ModelError(f"{model.backend.path} has a vision part already; it takes no mmproj file")
    vision = load(projector, model.options.hidden_size)
    if vision is None:
        raise ModelError(f"{projector.path}: no vision tensors (v.patch_embd.weight)")
    model.vision, model._projector = vision, projector
