"""Qwen3-VL's vision part (llama.cpp projector ``qwen3vl_merger``): Qwen 2.5-VL's dynamic resolution,
patches and 2-D rope (qwen2vl_vision.py), with a biased patch convolution plus learned absolute
positions (a square table resampled bilinearly, corners aligned, to each image's patch grid),
LayerNorm layers with a fused q/k/v and a GELU MLP, full attention everywhere, and DeepStack: the states
after a few chosen layers are merged like the last ones (LayerNorm over each joined 2x2 block, GELU MLP)
and go to the text model's first layers. An image's embeddings are one tensor
(text_hidden * (1 + deepstack layers), tokens): the merger's, then each DeepStack merger's, as llama.cpp's
mmproj output is."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pyggml import nn
from pyggml.backend import Context
from pyggml.models import ModelError
from pyggml.models.qwen2vl_vision import DynamicVision, Numbered, VisionOptions, grid_positions
from pyggml.tensor import Tensor

TABLE_ROWS, TABLE_WEIGHTS = "v.table_rows", "v.table_weights"  # graph constants of a grid shape


class EncoderLayer(nn.Module):
    ln1: nn.LayerNorm = nn.shape("hidden_size", bias=True)
    attn_qkv: nn.Linear = nn.shape("hidden_size", "3 * hidden_size", bias=True)
    attn_out: nn.Linear = nn.shape("hidden_size", "hidden_size", bias=True)
    ln2: nn.LayerNorm = nn.shape("hidden_size", bias=True)
    ffn_up: nn.Linear = nn.shape("hidden_size", "ffn_size", bias=True)
    ffn_down: nn.Linear = nn.shape("ffn_size", "hidden_size", bias=True)

    def __call__(self, ctx: Context, h: Tensor, rope: tuple, o: VisionOptions) -> Tensor:
        x, n, d = self.ln1(h, o.eps), h.shape[1], o.head_dim
        qkv = self.attn_qkv(x)  # (3 * hidden, n): the queries, keys and values of a token one after the other
        q, k, v = (qkv.view(i * o.hidden_size * qkv.strides[0], (d, o.n_heads, n),
                            (d * qkv.strides[0], qkv.strides[1])).contiguous() for i in range(3))
        mrope, positions, factors = rope
        q, k = mrope(q, positions, factors), mrope(k, positions, factors)
        h = h + self.attn_out(nn.attention(ctx, q, k, v, None, 1.0 / math.sqrt(d), flash=True))
        return h + self.ffn_down(self.ffn_up(self.ln2(h, o.eps)).gelu())  # HF's gelu_pytorch_tanh


class VisionTower(nn.Module):
    patch_embd: nn.Linear = nn.shape("patch_size", "patch_size", 3, "hidden_size", bias=True)
    position_embd: nn.Embedding = nn.shape("hidden_size", "n_positions")
    blk: list[EncoderLayer]
    post_ln: nn.LayerNorm = nn.shape("hidden_size", bias=True)


class Merger(nn.Module):
    """A DeepStack merger (``v.deepstack.N.*``): each joined 2x2 block normed, then a GELU MLP."""

    norm: nn.LayerNorm = nn.shape("merged", bias=True)
    fc1: nn.Linear = nn.shape("merged", "merged", bias=True)
    fc2: nn.Linear = nn.shape("merged", "text_hidden", bias=True)

    def __call__(self, h: Tensor, o: VisionOptions) -> Tensor:
        x = self.norm(h.reshape(o.merged, h.shape[1] // o.merge ** 2), o.eps)
        return self.fc2(self.fc1(x).gelu_erf())


class Projector(nn.Module):
    mm_0: nn.Linear = nn.shape("merged", "merged", bias=True)
    mm_2: nn.Linear = nn.shape("merged", "text_hidden", bias=True)


@dataclass(frozen=True)
class Options(VisionOptions):
    n_positions: int = 0  # rows of the learned position table (a square)


@dataclass(frozen=True)
class Vision(DynamicVision):
    tower: VisionTower
    second_frame: Tensor
    projector: Projector
    deepstack: tuple[Merger, ...]

    def __call__(self, ctx: Context, patches: np.ndarray) -> Tensor:
        o, t = self.options, self.tower
        rows, cols = patches.shape[0], patches.shape[1]
        n = rows * cols * o.merge ** 2
        h = self.embed_patches(ctx, patches, (t.patch_embd.weight, self.second_frame)) + t.patch_embd.bias
        h = h + self.positions(ctx, rows, cols)
        rope, features = self.rope_inputs(ctx, rows, cols), []
        for i, layer in enumerate(t.blk):
            h = nn.tap(f"v.blk.{i}", layer(ctx, h, rope, o))
            if i in o.deepstack:
                features.append(self.deepstack[o.deepstack.index(i)](h, o))
        h = t.post_ln(h, o.eps).reshape(o.merged, n // o.merge ** 2)
        out = self.projector.mm_2(self.projector.mm_0(h).gelu_erf())
        for feature in features:
            out = out.concat(feature, 0)
        return out

    def positions(self, ctx: Context, rows: int, cols: int) -> Tensor:
        """The learned position of each patch: four table rows mixed by bilinear weights (hidden, n)."""
        o = self.options
        index, weight = table_taps(rows * o.merge, cols * o.merge, math.isqrt(o.n_positions), o.merge)
        n = len(index) // 4
        picked = self.tower.position_embd(ctx.from_numpy(index, name=TABLE_ROWS)).reshape(o.hidden_size, 4, n)
        mixed = picked * ctx.from_numpy(weight.reshape(n, 4, 1), name=TABLE_WEIGHTS)
        rows_, step = (o.hidden_size, n), (mixed.strides[2],)
        total = mixed.view(0, rows_, step)
        for tap in range(1, 4):
            total = total + mixed.view(tap * mixed.strides[1], rows_, step)
        return total


def table_taps(height: int, width: int, side: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """For each patch of a height x width grid (in merge-block order), the four rows of a side x side
    table around its place and their bilinear weights (corners aligned), as Hugging Face resamples
    Qwen3-VL's position table: (4 * n,) I32 rows, tap-major per patch, and (4 * n,) F32 weights."""
    positions = grid_positions(height // merge, width // merge, merge)
    row, col = positions[:len(positions) // 2], positions[len(positions) // 2:]

    def axis(index: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
        floor = np.floor(src)
        taps = floor.astype(np.int64)[:, None] + np.arange(2)
        weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - np.arange(2)), 0, None)
        return np.clip(taps, 0, side - 1), weights.astype(np.float32)

    (r, rw), (c, cw) = axis(row, height), axis(col, width)
    index = (r[:, :, None] * side + c[:, None, :]).reshape(-1, 4)
    weight = (rw[:, :, None] * cw[:, None, :]).reshape(-1, 4)
    return index.reshape(-1).astype(np.int32), weight.reshape(-1).astype(np.float32)


def load(backend, opts: VisionOptions, second: Tensor) -> Vision:
    table = backend.get("v.position_embd.weight")
    if table is None or math.isqrt(table.shape[1]) ** 2 != table.shape[1]:
        raise ModelError(f"{backend.path}: qwen3vl: v.position_embd.weight must be a square table of positions")
    o = Options(**vars(opts), n_positions=table.shape[1])
    if any(i >= o.n_layers for i in o.deepstack):
        raise ModelError(f"{backend.path}: clip.vision.is_deepstack_layers names layers past the {o.n_layers}")
    deepstack = tuple(nn.load(Merger, nn.Prefixed(backend, f"v.deepstack.{i}."), o) for i in o.deepstack)
    return Vision(o, nn.load(VisionTower, nn.Prefixed(backend, "v."), o), second,
                  nn.load(Projector, Numbered(backend, ""), o), deepstack)
