"""LFM2 / LFM2.5 (GGUF architecture "lfm2"; Liquid AI's hybrid of short convolutions and attention).

Pre-norm blocks of two kinds, each followed by a SwiGLU MLP: most are **short-convolution** blocks
(``shortconv``: ``in_proj`` makes three gates b, c, x; the product b·x runs through a causal
depthwise convolution of ``shortconv.l_cache`` taps; c gates its output; ``out_proj``), the rest
grouped-query **attention** with RMS-normed q and k heads and NeoX rope. A layer's kind is its
``attention.head_count_kv`` entry: 0 for a convolution. The final norm is stored as
``token_embd_norm`` (as llama.cpp names it) and the output is tied to the embeddings when absent.

Memory: attention layers use a ``Causal`` cache and convolution layers a ``Recurrent`` one (the last
``l_cache - 1`` inputs of each sequence), in a ``Wrapper`` by layer kind. A recurrent state cannot
drop a range, so a context shift makes the runner re-evaluate the kept tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pyggml import nn
from pyggml.backend import Backend, Context
from pyggml.backend.metadata import MAX_CONTEXT, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH
from pyggml.kvcache import Causal, Recurrent, Wrapper
from pyggml.models import Batch, Model, ModelError, register
from pyggml.tensor import RopeType, Tensor

ATTENTION, CONV = 0, 1  # a layer's kind: the Wrapper's cache for it


@dataclass(frozen=True)
class Options:
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: tuple[int, ...]  # per layer; 0 for a convolution layer
    head_dim: int
    ffn_size: int
    vocab_size: int | None
    context_length: int
    eps: float
    shortconv_l_cache: int  # the convolution's taps (the token and the l_cache - 1 before it)
    layer_kinds: tuple[int, ...]  # ATTENTION or CONV per layer
    rope: nn.Rope

    @classmethod
    def from_config(cls, config, **extra) -> Options:
        """The options of a file; ``extra``: the fields a subclass adds (read by its own from_config)."""
        arch = config.architecture
        hidden = config.uint("embedding_length", min=1, max=MAX_WIDTH)
        n_heads = config.uint("attention.head_count", min=1, max=MAX_WIDTH)
        n_layers = config.uint("block_count", min=1, max=MAX_LAYERS)
        if not hidden or not n_heads or not n_layers:
            raise ModelError(f"{arch}: {arch}.embedding_length, {arch}.block_count and {arch}.attention.head_count "
                             "must be set and non-zero")
        kv = nn.per_layer(config, "attention.head_count_kv", n_layers, n_heads, n_heads)
        if any(k and n_heads % k for k in kv):
            raise ModelError(f"{arch}: {arch}.attention.head_count_kv must give each of the {n_layers} layers 0 (a "
                             f"convolution layer) or a divisor of the {n_heads} heads (attention); found {kv}")
        if hidden % n_heads:
            raise ModelError(f"{arch}: {arch}.embedding_length ({hidden}) is not a multiple of "
                             f"{arch}.attention.head_count ({n_heads})")
        l_cache = config.uint("shortconv.l_cache", 0, max=256)
        if any(k == 0 for k in kv) and l_cache < 2:
            raise ModelError(f"{arch}: {arch}.shortconv.l_cache must be set and >= 2 (the convolution's taps) for "
                             "the convolution layers")
        if config.uint("attention.sliding_window", 0):
            raise ModelError(f"{arch}: {arch}.attention.sliding_window is set; sliding-window LFM2 files (LFM2.5 "
                             "audio tokenizers) are not supported")
        head_dim = hidden // n_heads
        return cls(
            hidden_size=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=tuple(kv), head_dim=head_dim,
            ffn_size=config.uint("feed_forward_length", min=1, max=MAX_WIDTH),
            vocab_size=config.uint("vocab_size", 0, max=MAX_VOCAB) or len(config.get("tokenizer.ggml.tokens", ()))
            or None,
            context_length=config.uint("context_length", 128000, min=1, max=MAX_CONTEXT),
            eps=config.float("attention.layer_norm_rms_epsilon", 1e-5, min=0.0, max=1.0),
            shortconv_l_cache=l_cache, layer_kinds=tuple(CONV if k == 0 else ATTENTION for k in kv),
            rope=nn.Rope.from_config(config, head_dim, RopeType.NEOX), **extra,
        )


_IS_ATTENTION, _IS_CONV = f"layer_kinds[layer] == {ATTENTION}", f"layer_kinds[layer] == {CONV}"


class SelfAttention(nn.Module):
    attn_q: nn.Linear | None = nn.shape("hidden_size", "n_heads * head_dim", when=_IS_ATTENTION)
    attn_k: nn.Linear | None = nn.shape("hidden_size", "n_kv_heads[layer] * head_dim", when=_IS_ATTENTION)
    attn_v: nn.Linear | None = nn.shape("hidden_size", "n_kv_heads[layer] * head_dim", when=_IS_ATTENTION)
    attn_q_norm: nn.RMSNorm | None = nn.shape("head_dim", when=_IS_ATTENTION)
    attn_k_norm: nn.RMSNorm | None = nn.shape("head_dim", when=_IS_ATTENTION)
    attn_output: nn.Linear | None = nn.shape("n_heads * head_dim", "hidden_size", when=_IS_ATTENTION)

    def __call__(self, ctx: Context, x: Tensor, positions: Tensor, cache: Wrapper, opts: Options,
                 layer: int) -> Tensor:
        n_tokens, n_kv = x.shape[1], opts.n_kv_heads[layer]
        q = self.attn_q_norm(self.attn_q(x).reshape(opts.head_dim, opts.n_heads, n_tokens), opts.eps)
        k = self.attn_k_norm(self.attn_k(x).reshape(opts.head_dim, n_kv, n_tokens), opts.eps)
        v = self.attn_v(x).reshape(opts.head_dim, n_kv, n_tokens)
        q, k = opts.rope(q, positions), opts.rope(k, positions)
        out = nn.attention(ctx, q, k, v, cache, 1.0 / math.sqrt(opts.head_dim))
        return nn.tap(f"blk.{layer}.attn_output", self.attn_output(out))


class ShortConv(nn.Module):
    nested = True  # blk.N.shortconv.*
    conv: nn.Weight | None = nn.shape("shortconv_l_cache", "hidden_size", when=_IS_CONV)
    in_proj: nn.Linear | None = nn.shape("hidden_size", "3 * hidden_size", when=_IS_CONV)
    out_proj: nn.Linear | None = nn.shape("hidden_size", "hidden_size", when=_IS_CONV)

    def __call__(self, ctx: Context, x: Tensor, states: Recurrent, opts: Options, layer: int) -> Tensor:
        n, d = x.shape[1], opts.hidden_size
        bcx = nn.tap(f"blk.{layer}.shortconv.in_proj", self.in_proj(x))  # (3 * hidden, n): b, c, x
        b, c, v = (bcx.view(i * d * bcx.dtype.row_bytes(1), (d, n), (bcx.strides[1],)) for i in range(3))
        y = c * states.conv(ctx, b * v, self.conv.weight)
        return nn.tap(f"blk.{layer}.shortconv.out_proj", self.out_proj(y))


class MLP(nn.Module):
    ffn_gate: nn.Linear = nn.shape("hidden_size", "ffn_size")
    ffn_up: nn.Linear = nn.shape("hidden_size", "ffn_size")
    ffn_down: nn.Linear = nn.shape("ffn_size", "hidden_size")

    def __call__(self, x: Tensor, opts: Options, layer: int) -> Tensor:
        return self.ffn_down(self.ffn_gate(x).silu(self.ffn_up(x)))


class Layer(nn.Module):
    attn_norm: nn.RMSNorm = nn.shape("hidden_size")
    attention: SelfAttention
    shortconv: ShortConv
    ffn_norm: nn.RMSNorm = nn.shape("hidden_size")
    mlp: MLP

    def __call__(self, ctx: Context, h: Tensor, positions: Tensor, outputs: Tensor | None, cache: Wrapper,
                 states: Recurrent, opts: Options, layer: int) -> Tensor:
        x = self.attn_norm(h, opts.eps)
        if opts.layer_kinds[layer] == CONV:
            x = self.shortconv(ctx, x, states, opts, layer)
        else:
            x = self.attention(ctx, x, positions, cache, opts, layer)
        x, h = nn.output_rows(outputs, x, h)
        h = h + x
        return h + self.mlp(self.ffn_norm(h, opts.eps), opts, layer)


class Weights(nn.Module):
    token_embd: nn.Embedding = nn.shape("hidden_size", "vocab_size")
    blk: list[Layer]
    token_embd_norm: nn.RMSNorm = nn.shape("hidden_size")  # the final norm (llama.cpp's name for it)
    output: nn.Linear = nn.shape("hidden_size", "vocab_size", alt="token_embd")


@register("lfm2")
class Lfm2(Model):
    Options, Weights = Options, Weights

    def __init__(self, backend: Backend):
        self.backend = backend
        self.options = self.Options.from_config(backend.config)
        self.weights: Weights = nn.load(self.Weights, backend, self.options)
        self.states = Recurrent()
        self.cache = Wrapper(Causal(self.shift), self.states, layer_types=self.options.layer_kinds)

    def forward(self, ctx: Context, batch: Batch) -> Tensor:
        w, o = self.weights, self.options
        inputs = nn.batch_inputs(ctx, batch)
        h = nn.tap("token_embd", w.token_embd(inputs.tokens))
        for i, layer, rows in nn.layers(w.blk, self.cache, inputs.outputs):
            h = nn.tap(f"blk.{i}", layer(ctx, h, inputs.positions, rows, self.cache, self.states, o, i))
        return nn.tap("output", w.output(nn.tap("token_embd_norm", w.token_embd_norm(h, o.eps))))

    def shift(self, ctx: Context, layer: int, key: Tensor, shift: Tensor) -> Tensor:
        return self.options.rope(key, shift)
