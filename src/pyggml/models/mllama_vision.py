"""Llama 3.2 Vision's image encoder (``v.*``) and projector (``mm.0``), as Ollama's mllama files store them.

An image is cut into up to ``max_num_tiles`` tiles (pyggml.image.tiles); each tile's patches get a class
token, learned positions (gated), and per-aspect-ratio tile embeddings (gated) before and after a
"local" stack of layers; a gated "global" stack follows. Both stacks attend over all tiles at once,
with the padding (unused tiles, and the patches that round each tile up to a multiple of 8) hidden
from each other. The output concatenates the last states with states of some local layers (the
inputs of the layers ``intermediate_layers_indices`` names, as Meta's reference and Ollama read them)
and is projected to the text width: keys and values for the text model's cross-attention layers."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from pyggml import image, nn
from pyggml.backend import Context
from pyggml.models import Input, ModelError, VisionPart
from pyggml.tensor import DType, Tensor

KEY = "vision."
PIXELS, RATIO, PADDING, TILES = "pixels", "ratio", "padding", "tiles"  # the vision graph's named inputs
FLASH = True  # ggml's fused attention: no (heads, L, L) score matrix (16 x 6432^2 floats at 560 px)
LN_EPS = 1e-5  # the pre/post LayerNorms (torch's default; the layers' own use the file's epsilon)
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class VisionOptions:
    hidden_size: int
    ffn_size: int
    n_layers: int
    n_global: int
    n_heads: int
    eps: float
    image_size: int
    patch_size: int
    max_tiles: int
    intermediate: tuple[int, ...]
    text_hidden: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def n_positions(self) -> int:  # the patches and the class token
        return self.n_patches + 1

    @property
    def padded(self) -> int:  # positions rounded up to a multiple of 8
        return -(-self.n_positions // 8) * 8

    @property
    def n_ratios(self) -> int:  # tile grids, and id 0 (no image)
        return len(image.tile_ratios(self.max_tiles)) + 1

    @property
    def out_dim(self) -> int:
        return self.hidden_size * (1 + len(self.intermediate))

    @property
    def n_enc(self) -> int:  # encoder tokens the text attends to
        return self.max_tiles * self.n_positions

    @classmethod
    def from_config(cls, config, text_hidden: int) -> VisionOptions:
        arch = config.architecture

        def uint(key: str, limit: int = 1 << 16) -> int:
            value = config.uint(KEY + key, 0, max=limit)
            if not value:
                raise ModelError(f"{arch}: the vision part needs a non-zero {arch}.{KEY}{key}")
            return value

        hidden, n_heads, n_layers = uint("embedding_length"), uint("attention.head_count"), uint("block_count", 256)
        size, patch, tiles = uint("image_size"), uint("patch_size"), uint("max_num_tiles", 16)
        if hidden % n_heads or size % patch:
            raise ModelError(f"{arch}: vision sizes do not divide: hidden {hidden} / {n_heads} heads, image {size} / "
                             f"patch {patch}")
        if config.uint(KEY + "num_channels", 3) != 3:
            raise ModelError(f"{arch}.{KEY}num_channels must be 3 (RGB)")
        indices = tuple(config.uints(KEY + "intermediate_layers_indices", []) or ())
        if not all(0 <= i < n_layers for i in indices):
            raise ModelError(f"{arch}.{KEY}intermediate_layers_indices {list(indices)} name layers outside "
                             f"0..{n_layers - 1}")
        mean = tuple(config.floats(KEY + "image_mean", list(CLIP_MEAN)))
        std = tuple(config.floats(KEY + "image_std", list(CLIP_STD)))
        if len(mean) != 3 or len(std) != 3 or not all(s > 0 for s in std):
            raise ModelError(f"{arch}.{KEY}image_mean/image_std must be 3 numbers (std > 0)")
        return cls(hidden_size=hidden, ffn_size=uint("feed_forward_length"), n_layers=n_layers,
                   n_global=config.uint(KEY + "global.block_count", 0, max=256), n_heads=n_heads,
                   eps=config.float(KEY + "attention.layer_norm_epsilon", 1e-5, min=0.0, max=1.0), image_size=size,
                   patch_size=patch, max_tiles=tiles, intermediate=indices, text_hidden=text_hidden,
                   image_mean=mean, image_std=std)


class EncoderLayer(nn.Module):
    ln1: nn.LayerNorm = nn.shape("hidden_size", bias=True)
    attn_q: nn.Linear = nn.shape("hidden_size", "hidden_size")
    attn_k: nn.Linear = nn.shape("hidden_size", "hidden_size")
    attn_v: nn.Linear = nn.shape("hidden_size", "hidden_size")
    attn_out: nn.Linear = nn.shape("hidden_size", "hidden_size")
    ln2: nn.LayerNorm = nn.shape("hidden_size", bias=True)
    ffn_down: nn.Linear = nn.shape("hidden_size", "ffn_size", bias=True)  # Ollama's names: fc1 ...
    ffn_up: nn.Linear = nn.shape("ffn_size", "hidden_size", bias=True)  # ... and fc2

    def __call__(self, ctx: Context, h: Tensor, mask: Tensor, o: VisionOptions) -> Tensor:
        x, n, head_dim = self.ln1(h, o.eps), h.shape[1], o.hidden_size // o.n_heads
        q, k, v = (lin(x).reshape(head_dim, o.n_heads, n) for lin in (self.attn_q, self.attn_k, self.attn_v))
        out = self.attn_out(nn.attention(ctx, q, k, v, None, 1 / math.sqrt(head_dim), mask=mask, flash=FLASH))
        h = h + self.gated("attn_gate", out)
        return h + self.gated("ffn_gate", self.ffn_up(self.ffn_down(self.ln2(h, o.eps)).gelu_erf()))

    def gated(self, gate: str, x: Tensor) -> Tensor:
        return x


class GatedLayer(EncoderLayer):
    """A global layer: attention and MLP outputs scaled by gates (stored as tanh(gate))."""

    attn_gate: nn.Parameter = nn.shape(1)
    ffn_gate: nn.Parameter = nn.shape(1)

    def gated(self, gate: str, x: Tensor) -> Tensor:
        return x * getattr(self, gate).weight


class Gated(nn.Module):
    """An embedding table and its gate, ``<name>.weight`` and ``<name>.gate``."""

    nested = True
    weight: nn.Parameter
    gate: nn.Parameter = nn.shape(1)


class PositionEmbedding(Gated):
    weight: nn.Parameter = nn.shape("hidden_size", "n_positions")  # gate stored as 1 - tanh(gate)


class TilePositionEmbedding(Gated):
    weight: nn.Parameter = nn.shape("max_tiles * n_positions * hidden_size", "n_ratios")


class TileEmbedding(Gated):
    weight: nn.Parameter = nn.shape("max_tiles * hidden_size", "n_ratios")

    def __call__(self, ratio: Tensor, o: VisionOptions) -> Tensor:
        return self.weight.weight.rows(ratio).reshape(o.hidden_size, 1, o.max_tiles) * self.gate.weight


class Tower(nn.Module):
    """The ``v.*`` tensors but the layers."""

    nested = "v"
    patch_embd: nn.Weight = nn.shape("patch_size", "patch_size", 3, "hidden_size")
    class_embd: nn.Parameter = nn.shape("hidden_size")
    position_embd: PositionEmbedding
    tile_position_embd: TilePositionEmbedding
    pre_tile_position_embd: TileEmbedding
    post_tile_position_embd: TileEmbedding
    pre_ln: nn.LayerNorm = nn.shape("hidden_size", bias=True)
    post_ln: nn.LayerNorm = nn.shape("hidden_size", bias=True)


class Local(nn.Module):
    nested = "v"
    blk: list[EncoderLayer]


class Global(nn.Module):
    nested = "v.global"
    blk: list[GatedLayer]


@dataclass(frozen=True)
class Vision(VisionPart):
    """The model's vision part: an image becomes the ``<|image|>`` token carrying its embeddings
    (text_hidden, n_enc) and its tile mask (n_enc,), which the cross-attention layers read. Every
    image is padded to ``max_tiles`` tiles: one graph shape, refilled with the pixels, the aspect ratio
    and the padding of each image."""

    max_images = 1  # the encoder cache holds one image: a later one (a later turn) replaces it
    options: VisionOptions
    tower: Tower
    local: Local
    global_: Global
    projector: nn.Linear  # mm.0: (out_dim) -> text width

    def preprocess(self, data: bytes) -> dict[str, np.ndarray]:
        o = self.options
        return self.arrays(*image.tiles(image.decode(data), o.image_size, o.max_tiles, o.image_mean, o.image_std))

    def build(self, ctx: Context, inputs: Mapping[str, np.ndarray]) -> list[Tensor]:
        """The embeddings (text_hidden, n_enc) and the tile mask (n_enc,): 0 for the image's tiles, -inf
        for the padding tiles."""
        return [self.projector(self._encoder(ctx, inputs, named=True)),
                ctx.from_numpy(inputs[TILES], name=TILES).scale(1.0)]

    def worst_case(self) -> dict[str, np.ndarray]:
        o = self.options
        return self.arrays(np.zeros((o.max_tiles, 3, o.image_size, o.image_size), np.float32), 1, o.max_tiles)

    def placeholders(self, image: Input, tokenizer) -> list[Input]:
        ids = tokenizer.encode("<|image|>", add_special=False)
        if len(ids) != 1:
            raise ModelError("mllama: the vocabulary has no <|image|> token, which images need")
        return [Input(token=ids[0], multimodal=image.multimodal, multimodal_hash=image.multimodal_hash)]

    def arrays(self, pixels: np.ndarray, ratio_id: int, n_tiles: int) -> dict[str, np.ndarray]:
        """The graph's inputs: pixels (max_tiles, 3, size, size) of ``n_tiles`` tiles in aspect ratio ``ratio_id``."""
        o, tiles = self.options, self.options.max_tiles
        if pixels.shape != (tiles, 3, o.image_size, o.image_size) or not 1 <= n_tiles <= tiles or \
                not 1 <= ratio_id < o.n_ratios:
            raise ValueError(f"mllama vision: need pixels ({tiles}, 3, {o.image_size}, {o.image_size}), 1..{tiles} "
                             f"tiles and an aspect ratio id in 1..{o.n_ratios - 1}; got {pixels.shape}, "
                             f"{n_tiles}, {ratio_id}")
        pad = np.ones((tiles, o.padded), np.float32)  # 1 at the padding positions: unused tiles, round-up
        pad[:n_tiles, :o.n_positions] = 0
        bias = np.where(np.arange(o.n_enc) < n_tiles * o.n_positions, 0.0, -np.inf).astype(np.float32)
        return {PIXELS: np.ascontiguousarray(pixels, dtype=np.float32), RATIO: np.array([ratio_id], np.int32),
                PADDING: pad.reshape(-1, 1), TILES: bias}

    def encoder(self, ctx: Context, pixels: np.ndarray, ratio_id: int, n_tiles: int) -> Tensor:
        """Pixels (max_tiles, 3, size, size) -> encoder states (out_dim, n_positions * max_tiles), tile by tile."""
        return self._encoder(ctx, self.arrays(pixels, ratio_id, n_tiles))

    def _encoder(self, ctx: Context, inputs: Mapping[str, np.ndarray], named: bool = False) -> Tensor:
        """``named``: the inputs are named, so the engine can refill the graph for the next image."""
        o, t = self.options, self.tower

        def read(key: str, dtype=None) -> Tensor:
            return ctx.from_numpy(inputs[key], dtype, name=key if named else None)

        hidden, tiles, n, p = o.hidden_size, o.max_tiles, o.n_positions, o.patch_size
        images = read(PIXELS)  # (W, H, 3, tiles)
        kernel = t.patch_embd.weight
        cols = images.im2col(kernel, p, p, 0, 0, 1, 1, dtype=DType.F32)  # (p*p*3, W/p, H/p, tiles)
        h = kernel.reshape(p * p * 3, hidden, ctx=ctx).mulmat(cols.reshape(p * p * 3, o.n_patches * tiles))
        ratio = read(RATIO, DType.I32)
        h = h.reshape(hidden, o.n_patches, tiles) + t.pre_tile_position_embd(ratio, o)
        h = t.class_embd.weight.reshape(hidden, 1, 1, ctx=ctx).repeat(hidden, 1, tiles).concat(h, 1)
        h = h + t.position_embd.weight.weight.reshape(hidden, n, 1, ctx=ctx) * t.position_embd.gate.weight
        tile_pos = t.tile_position_embd.weight.weight.rows(ratio).reshape(hidden, n, tiles)
        h = t.pre_ln(h + tile_pos * t.tile_position_embd.gate.weight, LN_EPS)
        h = h.pad(0, o.padded - n).reshape(hidden, o.padded * tiles)
        flags = read(PADDING)  # (L, 1): padding hidden from padding (Hugging Face's rule)
        mask = flags.mulmat(flags).scale(-1e30)  # (L, L) over all tiles' padded positions
        kept = []
        for i, layer in enumerate(self.local.blk):
            if i in o.intermediate:
                kept.append(h)
            h = nn.tap(f"v.blk.{i}", layer(ctx, h, mask, o))
        h = t.post_ln(h, LN_EPS).reshape(hidden, o.padded, tiles) + t.post_tile_position_embd(ratio, o)
        h = h.reshape(hidden, o.padded * tiles)
        for i, layer in enumerate(self.global_.blk):
            h = nn.tap(f"v.global.blk.{i}", layer(ctx, h, mask, o))
        if kept:  # Hugging Face stacks them last: feature d of kept state j goes to hidden + d * len(kept) + j
            stacked = kept[0].reshape(1, hidden, o.padded * tiles)
            for state in kept[1:]:
                stacked = stacked.concat(state.reshape(1, hidden, o.padded * tiles), 0)
            h = h.concat(stacked.reshape(len(kept) * hidden, o.padded * tiles), 0)
        h = h.reshape(o.out_dim, o.padded, tiles)
        h = h.view(0, (o.out_dim, n, tiles), (h.strides[1], h.strides[2]))  # drop the padding positions
        return h.contiguous().reshape(o.out_dim, n * tiles)

    def __call__(self, ctx: Context, pixels: np.ndarray, ratio_id: int, n_tiles: int) -> Tensor:
        """Image embeddings (text_hidden, n_enc) for the text model's cross-attention."""
        return self.projector(self.encoder(ctx, pixels, ratio_id, n_tiles))


def load(backend, text_hidden: int) -> Vision | None:
    """The vision part of an mllama file, or None when it has none (text only)."""
    if backend.get("v.patch_embd.weight") is None:
        return None
    o = VisionOptions.from_config(backend.config, text_hidden)
    weight, bias = backend.get("mm.0.weight"), backend.get("mm.0.bias")
    missing = [name for name, t in (("mm.0.weight", weight), ("mm.0.bias", bias)) if t is None]
    if missing:
        raise nn.MissingWeightsError(f"{backend.path}: missing tensors: {', '.join(missing)}")
    if tuple(weight.shape) != (o.out_dim, text_hidden) or tuple(bias.shape) != (text_hidden,):
        raise ModelError(f"{backend.path}: mm.0.weight/bias have shapes {tuple(weight.shape)}/{tuple(bias.shape)}, "
                         f"expected ({o.out_dim}, {text_hidden})/({text_hidden},) = (out_dim, text hidden)")
    # three loads: the two stacks have their own layer counts
    return Vision(o, nn.load(_TowerFile, backend, o, n_layers=0).tower,
                  nn.load(_LocalFile, backend, o, n_layers=o.n_layers).local,
                  nn.load(_GlobalFile, backend, o, n_layers=o.n_global).global_, nn.Linear(weight, bias))


class _TowerFile(nn.Module):
    tower: Tower


class _LocalFile(nn.Module):
    local: Local


class _GlobalFile(nn.Module):
    global_: Global
