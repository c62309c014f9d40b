"""Qwen 2.5-VL's vision part (llama.cpp projector ``qwen2.5vl_merger``; Qwen2-VL's ``qwen2vl_merger`` is the same
with LayerNorms, a QuickGELU MLP and no windows; Qwen3-VL's: qwen3vl_vision.py): dynamic resolution. An image is
resized to a grid of patches (each side a multiple of patch x merge pixels, the pixel count within the
file's min/max: ``image.smart_resize``), patches embedded by the 3-D convolution over two equal frames
(the two kernel frames added), RMSNorm transformer layers with a SwiGLU MLP and 2-D rotary positions
(height on the first quarter of each head's pairs, width on the second), attending within windows of
``window_size`` pixels except every ``n_wa_pattern``-th layer (full attention), then the merger: each
2x2 block of patches (kept together from the start) normed, joined and projected by a GELU MLP into
the text model's width. One graph per grid shape; its tokens go between <|vision_start|> and
<|vision_end|> with (row, column) mRoPE offsets."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from pyggml import image, nn
from pyggml.backend import Context
from pyggml.models import Input, ModelError, VisionPart
from pyggml.tensor import RopeType, Tensor

log = logging.getLogger(__name__)
KEY = "clip.vision."
PIXELS = "pixels"  # (rows/merge, columns/merge, merge*merge, 3*patch*patch) normalised patches, 2x2 blocks together
POSITIONS, WINDOWS = "v.positions", "v.windows"  # graph constants of a grid shape
PROJECTORS = ("qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger")  # Qwen3-VL's: qwen3vl_vision.py
MIN_PIXELS = {"qwen3vl_merger": 256 * 256}  # the processors' least pixels where a file does not say (else 56 x 56)
MAX_TOKENS = 1280  # image tokens at most (Hugging Face's default max_pixels): the window mask grows as tokens^2
FLASH = True


@dataclass(frozen=True)
class VisionOptions:
    hidden_size: int
    ffn_size: int
    n_layers: int
    n_heads: int
    eps: float
    patch_size: int
    merge: int
    full_every: int  # every n-th layer attends to the whole image (0: all of them)
    window: int  # window side in merged tokens
    text_hidden: int
    rope_base: float
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    projector: str = "qwen2.5vl_merger"
    deepstack: tuple[int, ...] = ()  # Qwen3-VL: layers whose states also feed the text model's first layers

    @property
    def layer_norm(self) -> bool:
        """Qwen2-VL's LayerNorms and QuickGELU MLP, in place of Qwen 2.5-VL's RMSNorms and SwiGLU."""
        return self.projector == "qwen2vl_merger"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    @property
    def merged(self) -> int:
        return self.hidden_size * self.merge ** 2

    @classmethod
    def from_config(cls, config, text_hidden: int) -> VisionOptions:
        projector = config.get("clip.projector_type", config.get(KEY + "projector_type", ""))
        if projector not in PROJECTORS:
            raise ModelError(f"the vision projector is {projector!r}; supported: {', '.join(PROJECTORS)}")

        def uint(key: str, default: int | None = None) -> int:
            value = config.uint(KEY + key, default)
            if not value:
                raise ModelError(f"qwen2vl: the vision part needs a non-zero {KEY + key}")
            return value

        hidden, n_heads, patch, merge = uint("embedding_length"), uint("attention.head_count"), uint("patch_size"), \
            uint("spatial_merge_size", 2)
        if hidden % n_heads or (hidden // n_heads) % 4:
            raise ModelError(f"qwen2vl: vision width {hidden} / {n_heads} heads must be a multiple of 4 per head")
        projection = config.uint(KEY + "projection_dim", 0) or text_hidden
        if projection != text_hidden:
            raise ModelError(f"qwen2vl: the vision projection width {projection} is not the text width {text_hidden}")
        factor = patch * merge
        max_pixels = uint("image_max_pixels", factor * factor * MAX_TOKENS)
        if max_pixels > factor * factor * MAX_TOKENS:
            log.info("qwen2vl: images are limited to %d tokens (the file allows %d pixels)", MAX_TOKENS, max_pixels)
            max_pixels = factor * factor * MAX_TOKENS
        mean, std = tuple(config.get(KEY + "image_mean", ())), tuple(config.get(KEY + "image_std", ()))
        if len(mean) != 3 or len(std) != 3 or not all(s > 0 for s in std):
            raise ModelError(f"qwen2vl: {KEY}image_mean/image_std must be 3 numbers (std > 0)")
        window = config.uint(KEY + "window_size", 112) // factor
        deepstack = tuple(i for i, on in enumerate(config.get(KEY + "is_deepstack_layers", ()) or ()) if on)
        return cls(hidden_size=hidden, ffn_size=uint("feed_forward_length"), n_layers=uint("block_count"),
                   n_heads=n_heads, eps=config.float(KEY + "attention.layer_norm_epsilon", 1e-6), patch_size=patch,
                   merge=merge, full_every=config.uint(KEY + "n_wa_pattern", 0), window=max(window, 1),
                   text_hidden=text_hidden, rope_base=config.float(KEY + "rope.freq_base", 10000.0, min=1.0),
                   min_pixels=min(uint("image_min_pixels", MIN_PIXELS.get(projector, 56 * 56)), max_pixels),
                   max_pixels=max_pixels,
                   image_mean=mean, image_std=std, projector=projector, deepstack=deepstack)

    def rope(self) -> nn.MRope:
        """2-D rope: pair i of a head (d/2 pairs) turns with the height for i < d/4, else with the width,
        at inverse frequency base^(-4j/d) for j = i mod d/4: one rope over d with base^2, the width's
        pairs scaled up by the base."""
        quarter = self.head_dim // 4
        axes = (0,) * quarter + (1,) * quarter
        return nn.MRope(nn.Rope(self.head_dim, self.rope_base ** 2, mode=RopeType.NEOX), axes,
                        (1.0,) * quarter + (self.rope_base,) * quarter)


class Norm(nn.LayerNorm):
    """Qwen 2.5-VL's RMSNorm, or Qwen2-VL's LayerNorm (``.bias`` required then: see ``load``)."""

    def __call__(self, x: Tensor, o: VisionOptions) -> Tensor:
        return x.norm(o.eps, self.weight, self.bias) if o.layer_norm else x.rms_norm(o.eps, self.weight)


class EncoderLayer(nn.Module):
    ln1: Norm = nn.shape("hidden_size")  # + .bias: a LayerNorm
    attn_q: nn.Linear = nn.shape("hidden_size", "hidden_size", bias=True)
    attn_k: nn.Linear = nn.shape("hidden_size", "hidden_size", bias=True)
    attn_v: nn.Linear = nn.shape("hidden_size", "hidden_size", bias=True)
    attn_out: nn.Linear = nn.shape("hidden_size", "hidden_size", bias=True)
    ln2: Norm = nn.shape("hidden_size")  # + .bias: a LayerNorm
    ffn_gate: nn.Linear | None = nn.shape("hidden_size", "ffn_size", bias=True, when="not layer_norm")
    ffn_up: nn.Linear = nn.shape("hidden_size", "ffn_size", bias=True)
    ffn_down: nn.Linear = nn.shape("ffn_size", "hidden_size", bias=True)

    def __call__(self, ctx: Context, h: Tensor, rope: tuple, mask: Tensor | None, o: VisionOptions) -> Tensor:
        x, n = self.ln1(h, o), h.shape[1]
        q, k, v = (lin(x).reshape(o.head_dim, o.n_heads, n) for lin in (self.attn_q, self.attn_k, self.attn_v))
        mrope, positions, factors = rope
        q, k = mrope(q, positions, factors), mrope(k, positions, factors)
        h = h + self.attn_out(nn.attention(ctx, q, k, v, None, 1.0 / math.sqrt(o.head_dim), mask=mask, flash=FLASH))
        x = self.ln2(h, o)
        if self.ffn_gate is None:  # Qwen2-VL: QuickGELU
            return h + self.ffn_down(self.ffn_up(x).gelu_quick())
        return h + self.ffn_down(self.ffn_gate(x).silu(self.ffn_up(x)))


class VisionTower(nn.Module):
    """The ``v.*`` tensors but the patch kernel's second frame: patches -> states (hidden, n_patches)."""

    patch_embd: nn.Weight = nn.shape("patch_size", "patch_size", 3, "hidden_size")
    blk: list[EncoderLayer]
    post_ln: Norm = nn.shape("hidden_size")  # + .bias: a LayerNorm


class Projector(nn.Module):
    """The ``mm.*`` tensors: each 2x2 block of normed states -> one image embedding."""

    mm_0: nn.Linear = nn.shape("merged", "merged", bias=True)
    mm_2: nn.Linear = nn.shape("merged", "text_hidden", bias=True)


@dataclass(frozen=True)
class DynamicVision(VisionPart):
    """What Qwen-VL vision parts share: the resizing, the patches, the placeholders; a subclass's
    ``__call__`` encodes one image's patches."""

    options: VisionOptions

    def __call__(self, ctx: Context, patches: np.ndarray) -> Tensor:
        raise NotImplementedError

    def embed_patches(self, ctx: Context, patches: np.ndarray, kernels: tuple[Tensor, Tensor]) -> Tensor:
        """(hidden, n_patches) from the patches (the graph's named input) through both frames' kernels:
        a still image's two frames are the same picture, so the 3-D convolution is the 2-D one of each
        frame, added."""
        o = self.options
        rows, cols = patches.shape[0], patches.shape[1]  # in merged tokens
        n, size = rows * cols * o.merge ** 2, 3 * o.patch_size ** 2
        x = ctx.from_numpy(np.ascontiguousarray(patches, np.float32), name=PIXELS).reshape(size, n)
        first, second = (k.reshape(size, o.hidden_size, ctx=ctx).mulmat(x) for k in kernels)
        return first + second

    def rope_inputs(self, ctx: Context, rows: int, cols: int) -> tuple[nn.MRope, Tensor, list[Tensor]]:
        mrope = self.options.rope()
        return (mrope, ctx.from_numpy(grid_positions(rows, cols, self.options.merge), name=POSITIONS),
                mrope.factors(ctx, "v.rope.axis"))

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """The image's size in merged tokens (rows, columns)."""
        o = self.options
        factor = o.patch_size * o.merge
        h, w = image.smart_resize(height, width, factor, o.min_pixels, o.max_pixels)
        return h // factor, w // factor

    def preprocess(self, data: bytes) -> dict[str, np.ndarray]:
        o = self.options
        picture = image.decode(data)
        rows, cols = self.grid(*picture.size)
        factor = o.patch_size * o.merge
        pixels = image.resize_normalize(picture, (cols * factor, rows * factor), o.image_mean, o.image_std,
                                        bicubic=True)
        return {PIXELS: patchify(pixels, o.patch_size, o.merge)}

    def build(self, ctx: Context, inputs: Mapping[str, np.ndarray]) -> list[Tensor]:
        return [self(ctx, inputs[PIXELS])]

    def worst_case(self) -> dict[str, np.ndarray]:
        """An image of the most tokens max_pixels allows (memory grows with their number, not the shape)."""
        o = self.options
        most = o.max_pixels // (o.patch_size * o.merge) ** 2
        rows = max(d for d in range(1, math.isqrt(most) + 1) if most % d == 0)
        return {PIXELS: np.zeros((rows, most // rows, o.merge ** 2, 3 * o.patch_size ** 2), np.float32)}

    def placeholders(self, picture: Input, tokenizer) -> list[Input]:
        start, end, pad = _image_tokens(tokenizer)
        rows, cols = picture.multimodal[0].data[PIXELS].shape[:2]
        n = rows * cols  # the rows and <|vision_end|> after them go in one batch
        tokens = [Input(token=pad, rope_offset=(0, k // cols, k % cols), rope_step=0) for k in range(n)]
        tokens[0] = Input(token=pad, multimodal=picture.multimodal, multimodal_hash=picture.multimodal_hash,
                          same_batch=n, rope_offset=(0, 0, 0), rope_step=0)
        tokens[-1].rope_step = max(rows, cols)  # the text after goes on from the image's largest position + 1
        return [Input(token=start), *tokens, Input(token=end)]


@dataclass(frozen=True)
class Vision(DynamicVision):
    """Qwen 2.5-VL's tower and merger."""

    tower: VisionTower
    second_frame: Tensor  # v.patch_embd.weight.1
    projector: Projector

    def __call__(self, ctx: Context, patches: np.ndarray) -> Tensor:
        o, t = self.options, self.tower
        rows, cols = patches.shape[0], patches.shape[1]
        h = self.embed_patches(ctx, patches, (t.patch_embd.weight, self.second_frame))
        rope = self.rope_inputs(ctx, rows, cols)
        windows = window_mask(rows, cols, o.merge, o.window)
        mask = ctx.from_numpy(windows, name=WINDOWS) if windows is not None else None
        for i, layer in enumerate(t.blk):
            full = not o.full_every or (i + 1) % o.full_every == 0
            h = nn.tap(f"v.blk.{i}", layer(ctx, h, rope, None if full else mask, o))
        h = t.post_ln(h, o).reshape(o.merged, rows * cols)
        return self.projector.mm_2(self.projector.mm_0(h).gelu_erf())


def patchify(pixels: np.ndarray, patch: int, merge: int) -> np.ndarray:
    """(3, H, W) -> (H/(patch*merge), W/(patch*merge), merge*merge, 3*patch*patch): each patch's pixels
    channel by channel, the patches of a merge block together, as Hugging Face's processor orders them."""
    _, height, width = pixels.shape
    rows, cols = height // (patch * merge), width // (patch * merge)
    blocks = pixels.reshape(3, rows, merge, patch, cols, merge, patch).transpose(1, 4, 2, 5, 0, 3, 6)
    return np.ascontiguousarray(blocks.reshape(rows, cols, merge * merge, 3 * patch * patch))


def grid_positions(rows: int, cols: int, merge: int) -> np.ndarray:
    """Each patch's (height, width) position, block by block: all heights, then all widths (I32)."""
    by, bx, dy, dx = np.meshgrid(np.arange(rows), np.arange(cols), np.arange(merge), np.arange(merge), indexing="ij")
    return np.concatenate([(by * merge + dy).reshape(-1), (bx * merge + dx).reshape(-1)]).astype(np.int32)


def window_mask(rows: int, cols: int, merge: int, window: int) -> np.ndarray | None:
    """(n, n) 0/-inf (F16): patches see the patches of their own window (``window`` merged tokens a side);
    None when the image is one window."""
    if rows <= window and cols <= window:
        return None
    by, bx = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    ids = np.repeat(((by // window) * -(-cols // window) + bx // window).reshape(-1), merge * merge)
    return np.where(ids[:, None] == ids[None, :], 0.0, -np.inf).astype(np.float16)  # what flash attention reads


def _image_tokens(tok) -> tuple[int, int, int]:
    """<|vision_start|>, <|vision_end|>, <|image_pad|>."""

    def special(text: str) -> int:
        ids = tok.encode(text, add_special=False)
        if len(ids) != 1:
            raise ModelError(f"qwen2vl: the vocabulary has no {text} token, which images need")
        return ids[0]

    return special("<|vision_start|>"), special("<|vision_end|>"), special("<|image_pad|>")


def load(backend, text_hidden: int, opts: VisionOptions | None = None) -> DynamicVision | None:
    """The vision part of a qwen2vl/qwen3vl file or mmproj (``v.*``, ``mm.*``), or None when it has none;
    ``opts``: its options when the file's keys are not llama.cpp's ``clip.vision.*`` (Ollama's layout)."""
    if backend.get("v.patch_embd.weight") is None:
        return None
    opts = opts or VisionOptions.from_config(backend.config, text_hidden)
    second = backend.get("v.patch_embd.weight.1")
    if second is None or second.shape != backend.get("v.patch_embd.weight").shape:
        raise ModelError(f"{backend.path}: v.patch_embd.weight.1 (the patch kernel's second frame) is missing or "
                         "not shaped like v.patch_embd.weight")
    if opts.projector == "qwen3vl_merger":
        from pyggml.models import qwen3vl_vision

        return qwen3vl_vision.load(backend, opts, second)
    tower = nn.load(VisionTower, nn.Prefixed(backend, "v."), opts)
    norms = [t.post_ln for t in [tower]] + [n for layer in tower.blk for n in (layer.ln1, layer.ln2)]
    if opts.layer_norm and any(norm.bias is None for norm in norms):
        raise ModelError(f"{backend.path}: qwen2vl_merger: the vision LayerNorms need their .bias tensors")
    return Vision(opts, tower, second, nn.load(Projector, Numbered(backend, ""), opts))


class Numbered(nn.Prefixed):
    """The merger's ``mm.0``/``mm.2`` tensors under field names Python allows (``mm_0``, ``mm_2``)."""

    def get(self, name: str) -> Tensor | None:
        return super().get(re.sub(r"^mm_(\d+)\.", r"mm.\1.", name))
