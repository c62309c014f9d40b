"""Nomic BERT sentence encoders (GGUF architecture "nomic-bert": nomic-embed-text v1 / v1.5).

BERT's post-norm encoder with three changes (nomic-bert-2048): no position embedding table, rotary
positions (NeoX halves, ``rope.freq_base``) applied to queries and keys instead; one fused
``attn_qkv`` projection (queries, then keys, then values) without biases; a SwiGLU MLP
(``ffn_down(silu(ffn_gate(x)) * ffn_up(x))``). Token + token-type embeddings -> LayerNorm; per
layer, attention -> residual -> LayerNorm, MLP -> residual -> LayerNorm; token states pooled per
sequence (mean for nomic-embed). Like ``bert``, no KV cache: several whole sequences share a pass
with a block-diagonal mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pyggml import nn
from pyggml.backend import Context
from pyggml.backend.metadata import MAX_WIDTH
from pyggml.models import ModelError, Pooling, register
from pyggml.models.bert import Bert, encoder_options
from pyggml.models.pooling import sequence_mask
from pyggml.tensor import RopeType, Tensor


@dataclass(frozen=True)
class Options:
    hidden_size: int
    n_layers: int
    n_heads: int
    head_dim: int
    ffn_size: int
    vocab_size: int | None  # None: no tokenizer in the file, token_embd's rows
    n_token_types: int | None
    context_length: int  # the longest sequence (the rotary positions have no table to run out of)
    eps: float
    pooling: Pooling
    rope: nn.Rope

    @classmethod
    def from_config(cls, config) -> Options:
        if config.uint("moe_every_n_layers", 0):
            raise ModelError("nomic-bert: moe_every_n_layers is set (nomic-bert-moe); mixture-of-experts layers "
                             "are not supported")
        fields = encoder_options(config, "nomic-bert", default_context=2048)
        head_dim = fields["head_dim"]
        n_rot = config.uint("rope.dimension_count", head_dim, max=MAX_WIDTH)
        if n_rot != head_dim:
            raise ModelError(f"nomic-bert: rope.dimension_count {n_rot} differs from the head size {head_dim}; "
                             "partial rotary is not supported")
        return cls(**fields, rope=nn.Rope.from_config(config, head_dim, RopeType.NEOX))


class SelfAttention(nn.Module):
    attn_qkv: nn.Linear = nn.shape("hidden_size", "3 * hidden_size")  # queries, keys, values
    attn_output: nn.Linear = nn.shape("hidden_size", "hidden_size")

    def __call__(self, ctx: Context, x: Tensor, positions: Tensor, mask: Tensor, opts: Options) -> Tensor:
        d, n_heads, n_tokens = opts.head_dim, opts.n_heads, x.shape[1]
        qkv = self.attn_qkv(x)  # (q | k | v, n_tokens): each head a run of head_dim values
        row, size = qkv.strides[1], qkv.strides[0]

        def heads(first: int) -> Tensor:  # (head_dim, n_heads, n_tokens), the part from head ``first`` on
            return qkv.view(first * d * size, (d, n_heads, n_tokens), (d * size, row))

        q = opts.rope(heads(0), positions)
        k = opts.rope(heads(n_heads), positions)
        v = heads(2 * n_heads).contiguous()
        return self.attn_output(nn.attention(ctx, q, k, v, None, 1.0 / math.sqrt(d), mask=mask))


class MLP(nn.Module):
    ffn_up: nn.Linear = nn.shape("hidden_size", "ffn_size")
    ffn_gate: nn.Linear = nn.shape("hidden_size", "ffn_size")
    ffn_down: nn.Linear = nn.shape("ffn_size", "hidden_size")

    def __call__(self, x: Tensor) -> Tensor:
        return self.ffn_down(self.ffn_gate(x).silu(self.ffn_up(x)))  # SwiGLU


class Layer(nn.Module):
    attention: SelfAttention
    attn_output_norm: nn.LayerNorm = nn.shape("hidden_size", bias=True)
    mlp: MLP
    layer_output_norm: nn.LayerNorm = nn.shape("hidden_size", bias=True)

    def __call__(self, ctx: Context, h: Tensor, positions: Tensor, mask: Tensor, opts: Options) -> Tensor:
        h = self.attn_output_norm(h + self.attention(ctx, h, positions, mask, opts), opts.eps)
        return self.layer_output_norm(h + self.mlp(h), opts.eps)


class Weights(nn.Module):
    token_embd: nn.Embedding = nn.shape("hidden_size", "vocab_size")
    token_types: nn.Embedding | None = nn.shape("hidden_size", "n_token_types")  # every token is segment 0
    token_embd_norm: nn.LayerNorm = nn.shape("hidden_size", bias=True)
    blk: list[Layer]


@register("nomic-bert")
class NomicBert(Bert):
    Options, Weights = Options, Weights

    def encode(self, ctx: Context, tokens: np.ndarray, positions: np.ndarray, sequences: np.ndarray) -> Tensor:
        w, o = self.weights, self.options
        h = nn.tap("token_embd", w.token_embd(nn.int32_input(ctx.input(), tokens)))
        if w.token_types is not None:
            h = h + w.token_types(nn.int32_input(ctx.input(), np.zeros_like(tokens)))
        h = nn.tap("token_embd_norm", w.token_embd_norm(h, o.eps))
        pos = nn.int32_input(ctx.input(), positions)
        mask = ctx.from_numpy(sequence_mask(sequences))
        for i, layer in enumerate(w.blk):
            h = nn.tap(f"blk.{i}", layer(ctx, h, pos, mask, o))
        return h
