"""Gemma 4's vision part (llama.cpp projector ``gemma4v``): dynamic resolution. An image is resized,
aspect kept, to the largest size within ``max_soft_tokens`` x pool^2 patches whose sides are multiples
of patch x pool pixels (Hugging Face's ``get_aspect_ratio_preserving_size``); its patches (pixels in
[0, 1], taken to [-1, 1] in the graph) are embedded by a bias-free linear map plus two learned
position tables (column and row), then RMS-normed transformer layers (pre- and post-norms around
attention and the GeGLU MLP, q/k RMS norms with weights, v RMS norm without, no query scaling, 2-D
rope: the first half of each head turns with the column, the second with the row, each half NEOX
style), then each pool x pool block of patches averaged, scaled by sqrt(hidden), optionally
standardised (``v.std_bias``, ``v.std_scale``), RMS-normed without weight and projected into the text
model's width. Linear maps may clip their inputs and outputs (``*.input_min`` ... tensors). One graph
per grid shape; an image's tokens go between <|image> and <image|> (gemma4.py treats them)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from pyggml import image, nn
from pyggml.backend import Context
from pyggml.models import Input, ModelError, VisionPart
from pyggml.tensor import RopeType, Tensor

KEY = "clip.vision."
PROJECTOR = "gemma4v"
PIXELS = "pixels"  # (rows, columns, 3 * patch * patch): each patch's pixels in [0, 1], channel by channel
COLUMNS, ROWS = "v.pos_x", "v.pos_y"  # graph constants of a grid shape
MAX_SOFT_TOKENS = 280  # Hugging Face's Gemma4ImageProcessor default
SOFT_TOKEN_CHOICES = (70, 140, 280, 560, 1120)  # what the processor accepts
CLAMPS = ("input_min", "input_max", "output_min", "output_max")
FLASH = True


@dataclass(frozen=True)
class VisionOptions:
    hidden_size: int
    ffn_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float
    patch_size: int
    pool: int  # pooling kernel: patches per image token, a side
    n_positions: int  # rows of each position table
    text_hidden: int
    rope_base: float
    max_soft_tokens: int

    @property
    def patch_pixels(self) -> int:
        return 3 * self.patch_size ** 2

    @classmethod
    def from_config(cls, config, text_hidden: int) -> VisionOptions:
        projector = config.get("clip.projector_type", config.get(KEY + "projector_type", ""))
        if projector != PROJECTOR:
            raise ModelError(f"gemma4: the vision projector is {projector!r}, not {PROJECTOR!r}")

        def uint(key: str, default: int | None = None) -> int:
            value = config.uint(KEY + key, default)
            if not value:
                raise ModelError(f"gemma4: the vision part needs a non-zero {KEY + key}")
            return value

        hidden, n_heads, patch = uint("embedding_length"), uint("attention.head_count"), uint("patch_size")
        n_kv = uint("attention.head_count_kv", n_heads)
        head_dim = uint("attention.key_length", hidden // n_heads)
        if n_heads % n_kv or head_dim % 4:
            raise ModelError(f"gemma4: vision heads {n_heads} / {n_kv} KV heads, head size {head_dim} (a multiple "
                             "of 4: two rotated halves)")
        projection = config.uint(KEY + "projection_dim", 0) or text_hidden
        if projection != text_hidden:
            raise ModelError(f"gemma4: the vision projection width {projection} is not the text width {text_hidden}")
        pool = uint("projector.scale_factor", 3)
        # llama.cpp reads no token budget (it allows 70 to 1120 tokens); ours is the processor's
        most = config.uint(KEY + "image_max_pixels", MAX_SOFT_TOKENS * (pool * patch) ** 2) // (pool * patch) ** 2
        if most not in SOFT_TOKEN_CHOICES:
            raise ModelError(f"gemma4: {KEY}image_max_pixels allows {most} image tokens; the processor takes one "
                             f"of {SOFT_TOKEN_CHOICES}")
        return cls(hidden_size=hidden, ffn_size=uint("feed_forward_length"), n_layers=uint("block_count"),
                   n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
                   eps=config.float(KEY + "attention.layer_norm_epsilon", 1e-6), patch_size=patch, pool=pool,
                   n_positions=0, text_hidden=text_hidden,
                   rope_base=config.float(KEY + "rope.freq_base", 100.0, min=1.0), max_soft_tokens=most)

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """The image's size in patches (rows, columns), as Hugging Face's processor resizes it."""
        side = self.pool * self.patch_size
        budget = self.max_soft_tokens * self.pool ** 2 * self.patch_size ** 2
        factor = math.sqrt(budget / (height * width))
        h = math.floor(factor * height / side) * side
        w = math.floor(factor * width / side) * side
        longest = self.max_soft_tokens * side  # (max_patches // pool^2) * side
        if h == 0 and w == 0:
            raise image.ImageError(f"the image is {width}x{height}: too thin to resize")
        if h == 0:
            h, w = side, min(width // height * side, longest)
        elif w == 0:
            h, w = min(height // width * side, longest), side
        if h * w > budget:
            raise image.ImageError(f"the image is {width}x{height}: its aspect ratio is too extreme for "
                                   f"{self.max_soft_tokens} image tokens")
        return h // self.patch_size, w // self.patch_size


class ClippedLinear(nn.Linear):
    """A bias-free linear map whose input and output may be clamped (Gemma4ClippableLinear)."""

    clamps: tuple[float, float, float, float] | None = None  # set by ``load`` from the *.input_min ... tensors

    def __call__(self, x: Tensor) -> Tensor:
        if self.clamps is None:
            return self.weight.mulmat(x)
        in_min, in_max, out_min, out_max = self.clamps
        return self.weight.mulmat(x.clamp(in_min, in_max)).clamp(out_min, out_max)


class EncoderLayer(nn.Module):
    ln1: nn.RMSNorm = nn.shape("hidden_size")
    attn_q: ClippedLinear = nn.shape("hidden_size", "n_heads * head_dim")
    attn_k: ClippedLinear = nn.shape("hidden_size", "n_kv_heads * head_dim")
    attn_v: ClippedLinear = nn.shape("hidden_size", "n_kv_heads * head_dim")
    attn_q_norm: nn.RMSNorm = nn.shape("head_dim")
    attn_k_norm: nn.RMSNorm = nn.shape("head_dim")
    attn_out: ClippedLinear = nn.shape("n_heads * head_dim", "hidden_size")
    attn_post_norm: nn.RMSNorm = nn.shape("hidden_size")
    ln2: nn.RMSNorm = nn.shape("hidden_size")
    ffn_gate: ClippedLinear = nn.shape("hidden_size", "ffn_size")
    ffn_up: ClippedLinear = nn.shape("hidden_size", "ffn_size")
    ffn_down: ClippedLinear = nn.shape("ffn_size", "hidden_size")
    ffn_post_norm: nn.RMSNorm = nn.shape("hidden_size")

    def __call__(self, ctx: Context, h: Tensor, columns: Tensor, rows: Tensor, o: VisionOptions) -> Tensor:
        x, n, d = self.ln1(h, o.eps), h.shape[1], o.head_dim
        q = rope_2d(self.attn_q_norm(self.attn_q(x).reshape(d, o.n_heads, n), o.eps), columns, rows, o)
        k = rope_2d(self.attn_k_norm(self.attn_k(x).reshape(d, o.n_kv_heads, n), o.eps), columns, rows, o)
        v = self.attn_v(x).reshape(d, o.n_kv_heads, n).rms_norm(o.eps)
        h = h + self.attn_post_norm(self.attn_out(nn.attention(ctx, q, k, v, None, 1.0, flash=FLASH)), o.eps)
        x = self.ln2(h, o.eps)
        return h + self.ffn_post_norm(self.ffn_down(self.ffn_gate(x).gelu(self.ffn_up(x))), o.eps)


def rope_2d(x: Tensor, columns: Tensor, rows: Tensor, o: VisionOptions) -> Tensor:
    """The first half of each head (head_dim, heads, n) turned by the patch's column, the second by
    its row, each half a NEOX rope of its own."""
    half = o.head_dim // 2
    shape, strides = (half, x.shape[1], x.shape[2]), x.strides[1:3]
    first = x.view(0, shape, strides).rope(columns, half, o.rope_base, mode=RopeType.NEOX)
    second = x.view(half * x.strides[0], shape, strides).rope(rows, half, o.rope_base, mode=RopeType.NEOX)
    return first.concat(second, 0)


class VisionTower(nn.Module):
    """The ``v.*`` tensors: patches -> pooled, scaled states (hidden, n_tokens)."""

    patch_embd: nn.Weight = nn.shape("patch_size", "patch_size", 3, "hidden_size")
    position_embd: nn.Weight = nn.shape("hidden_size", "n_positions", 2)
    blk: list[EncoderLayer]
    std_bias: nn.Parameter | None = nn.shape("hidden_size")
    std_scale: nn.Parameter | None = nn.shape("hidden_size")


class Projector(nn.Module):
    """The ``mm.*`` tensor: the pooled states, RMS-normed without weight, into the text model's width."""

    input_projection: ClippedLinear = nn.shape("hidden_size", "text_hidden")


@dataclass(frozen=True)
class Vision(VisionPart):
    """The model's vision part: each image its own grid (one graph per grid shape), its tokens between
    <|image> and <image|>, as Hugging Face's Gemma4Processor writes them."""

    options: VisionOptions
    tower: VisionTower
    projector: Projector

    def __call__(self, ctx: Context, patches: np.ndarray) -> Tensor:
        o, t = self.options, self.tower
        n_rows, n_cols = patches.shape[0], patches.shape[1]
        if n_rows % o.pool or n_cols % o.pool or max(n_rows, n_cols) > o.n_positions:
            raise ValueError(f"gemma4 vision: a {n_rows}x{n_cols} patch grid is not a multiple of the {o.pool}x"
                             f"{o.pool} pooling within the {o.n_positions} positions")
        n = n_rows * n_cols
        x = ctx.from_numpy(np.ascontiguousarray(patches, np.float32), name=PIXELS).reshape(o.patch_pixels, n)
        h = t.patch_embd.weight.reshape(o.patch_pixels, o.hidden_size, ctx=ctx).mulmat(x.scale_bias(2.0, -1.0))
        cols = np.tile(np.arange(n_cols, dtype=np.int32), n_rows)
        rows = np.repeat(np.arange(n_rows, dtype=np.int32), n_cols)
        columns, rows = ctx.from_numpy(cols, name=COLUMNS), ctx.from_numpy(rows, name=ROWS)
        table, stride = t.position_embd.weight, t.position_embd.weight.strides[1]
        size = (o.hidden_size, o.n_positions)
        h = h + table.view(0, size, (stride,), ctx=ctx).rows(columns)
        h = h + table.view(o.n_positions * stride, size, (stride,), ctx=ctx).rows(rows)
        for i, layer in enumerate(t.blk):
            h = nn.tap(f"v.blk.{i}", layer(ctx, h, columns, rows, o))
        grid = h.transpose().contiguous(n_cols, n_rows, o.hidden_size)  # (column, row, channel)
        pooled = grid.avg_pool_2d(o.pool, o.pool)
        n_tokens = n // o.pool ** 2
        h = pooled.reshape(n_tokens, o.hidden_size).transpose().contiguous().scale(math.sqrt(o.hidden_size))
        if t.std_bias is not None:
            h = (h - t.std_bias.weight) * t.std_scale.weight
        return self.projector.input_projection(h.rms_norm(o.eps))

    def preprocess(self, data: bytes) -> dict[str, np.ndarray]:
        o = self.options
        picture = image.decode(data)
        rows, cols = o.grid(*picture.size)
        p = o.patch_size  # (Pillow, as Hugging Face, leaves an image already of the target size as it is)
        pixels = image.resize_normalize(picture, (cols * p, rows * p), (0.0,) * 3, (1.0,) * 3, bicubic=True)
        return {PIXELS: patchify(pixels, p)}

    def build(self, ctx: Context, inputs: Mapping[str, np.ndarray]) -> list[Tensor]:
        return [self(ctx, inputs[PIXELS])]

    def worst_case(self) -> dict[str, np.ndarray]:
        """A grid of the most tokens the budget allows (memory grows with their number, not the shape)."""
        o = self.options
        most = o.max_soft_tokens
        rows = max(d for d in range(1, math.isqrt(most) + 1) if most % d == 0)
        return {PIXELS: np.zeros((rows * o.pool, most // rows * o.pool, o.patch_pixels), np.float32)}

    def placeholders(self, picture: Input, tokenizer) -> list[Input]:
        start, end, soft = image_tokens(tokenizer)
        rows, cols = picture.multimodal[0].data[PIXELS].shape[:2]
        n = rows * cols // self.options.pool ** 2  # the rows and <image|> after them go in one batch
        return [Input(token=start),
                Input(token=soft, multimodal=picture.multimodal, multimodal_hash=picture.multimodal_hash,
                      same_batch=n),
                *(Input(token=soft) for _ in range(n - 1)), Input(token=end)]


def patchify(pixels: np.ndarray, patch: int) -> np.ndarray:
    """(3, H, W) -> (H/patch, W/patch, 3*patch*patch): each patch's pixels channel by channel (the
    order of llama.cpp's patch kernel)."""
    _, height, width = pixels.shape
    rows, cols = height // patch, width // patch
    return np.ascontiguousarray(pixels.reshape(3, rows, patch, cols, patch).transpose(1, 3, 0, 2, 4)
                                .reshape(rows, cols, 3 * patch * patch))


def image_tokens(tok) -> tuple[int, int, int]:
    """<|image>, <image|>, and the token each image embedding stands on: <|image|> (any token would do: its
    embedding is replaced and the per-layer table reads the padding token)."""

    def special(text: str) -> int:
        ids = tok.encode(text, add_special=False)
        if len(ids) != 1:
            raise ModelError(f"gemma4: the vocabulary has no {text} token, which images need")
        return ids[0]

    soft = tok.encode("<|image|>", add_special=False)
    return special("<|image>"), special("<image|>"), soft[0] if len(soft) == 1 else 0


def load(backend, text_hidden: int) -> Vision | None:
    """The vision part of a gemma4 file or mmproj (``v.*``, ``mm.*``), or None when it has none."""
    if backend.get("v.patch_embd.weight") is None:
        return None
    opts = VisionOptions.from_config(backend.config, text_hidden)
    table = backend.get("v.position_embd.weight")
    if table is None or len(table.shape) < 3 or table.shape[2] != 2:
        raise ModelError(f"{backend.path}: v.position_embd.weight must hold two position tables (hidden, n, 2)")
    opts = dataclasses.replace(opts, n_positions=table.shape[1])
    tower = nn.load(VisionTower, nn.Prefixed(backend, "v."), opts)
    if (tower.std_bias is None) != (tower.std_scale is None):
        raise ModelError(f"{backend.path}: v.std_bias and v.std_scale go together")
    projector = nn.load(Projector, nn.Prefixed(backend, "mm."), opts)
    linears = {f"v.blk.{i}.{name}": getattr(layer, name) for i, layer in enumerate(tower.blk)
               for name in ("attn_q", "attn_k", "attn_v", "attn_out", "ffn_gate", "ffn_up", "ffn_down")}
    for name, linear in {**linears, "mm.input_projection": projector.input_projection}.items():
        linear.clamps = _clamps(backend, name)
    return Vision(opts, tower, projector)


def _clamps(backend, name: str) -> tuple[float, float, float, float] | None:
    """The clip bounds of a linear map (``<name>.input_min`` ...; one missing: unbounded, as llama.cpp),
    or None when it has none."""
    tensors = [backend.get(f"{name}.{c}") for c in CLAMPS]
    if all(t is None for t in tensors):
        return None
    if any(t is not None and t.nelements != 1 for t in tensors):
        raise ModelError(f"{backend.path}: {name}'s {', '.join(CLAMPS)} must be one number each")
    lo_in, hi_in, lo_out, hi_out = (default if t is None else float(np.asarray(t.numpy(), np.float32).reshape(-1)[0])
                                    for t, default in zip(tensors, (-math.inf, math.inf) * 2, strict=True))
    if lo_in > hi_in or lo_out > hi_out:
        raise ModelError(f"{backend.path}: {name}'s clip bounds are reversed")
    return lo_in, hi_in, lo_out, hi_out
