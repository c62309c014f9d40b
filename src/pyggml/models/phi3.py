"""Phi-3 / Phi-3.5 / Phi-4-mini (GGUF architecture "phi3").

Llama's pre-norm decoder with the checkpoint's fused matrices kept fused: one ``attn_qkv`` projection
(queries, then keys, then values) and one ``ffn_up`` (gate rows, then up rows) for the SwiGLU MLP.
NeoX rope over ``rope.dimension_count`` dimensions (partial rotary in Phi-4-mini). Long-context
models carry LongRoPE factors: ``rope_factors_short`` for contexts up to the original training
length and ``rope_factors_long`` beyond it, chosen once by the context a sequence may use (the
cache's capacity, as llama.cpp picks them by its per-sequence context), and an attention factor
``rope.scaling.attn_factor`` that scales cos/sin. A non-zero ``attention.sliding_window`` makes
every layer attend to that many tokens (itself included), as transformers does.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pyggml import nn
from pyggml.backend import Backend, Context
from pyggml.kvcache import Causal
from pyggml.models import Batch, Model, ModelError, llama, register
from pyggml.tensor import RopeType, Tensor


@dataclass(frozen=True)
class Options:
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_size: int
    vocab_size: int | None
    context_length: int
    original_context: int  # LongRoPE: contexts beyond it rotate with the long factors
    eps: float
    sliding_window: int | None
    rope: nn.Rope

    @classmethod
    def from_config(cls, config) -> Options:
        hidden, n_layers, n_heads, n_kv_heads, head_dim = nn.attention_sizes(config)
        n_rot = config.uint("rope.dimension_count", 0) or head_dim
        if n_rot > head_dim or n_rot % 2:
            raise ModelError(f"phi3: rope.dimension_count {n_rot} must be even and at most the head size {head_dim}")
        context = config.uint("context_length", 4096)
        original = config.uint("rope.scaling.original_context_length", 0) or context
        if (config.string("rope.scaling.type", "") or "") in ("longrope", "su"):  # llama.cpp's files name it
            base = config.float("rope.freq_base", 10000.0, min=1.0, max=1e12)
            rope = nn.Rope(n_rot, base, mode=RopeType.NEOX, n_ctx_orig=original)
        else:
            try:
                rope = nn.Rope.from_config(config, n_rot, RopeType.NEOX)
            except ModelError:
                raise
            except ValueError as exc:
                raise ModelError(f"phi3: phi3.rope.scaling.type: {exc}") from None
        # LongRoPE's attention factor multiplies llama.cpp's yarn one (both scale cos and sin)
        attn_factor = config.float("rope.scaling.attn_factor", 1.0, min=1e-6, max=1e6)
        rope = dataclasses.replace(rope, attn_factor=rope.attn_factor * attn_factor)
        window = config.uint("attention.sliding_window", 0) or None
        return cls(
            hidden_size=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
            ffn_size=config.uint("feed_forward_length"),
            vocab_size=config.uint("vocab_size", 0) or len(config.get("tokenizer.ggml.tokens", ())) or None,
            context_length=context,
            original_context=original,
            eps=config.float("attention.layer_norm_rms_epsilon", 1e-5),
            sliding_window=window, rope=rope,
        )


class SelfAttention(nn.Module):
    attn_qkv: nn.Linear = nn.shape("hidden_size", "(n_heads + 2 * n_kv_heads) * head_dim")
    attn_output: nn.Linear = nn.shape("n_heads * head_dim", "hidden_size")

    def __call__(self, ctx: Context, x: Tensor, positions: Tensor, cache: Causal, opts: Options,
                 factors: Tensor | None) -> Tensor:
        d, n_tokens = opts.head_dim, x.shape[1]
        qkv = self.attn_qkv(x)  # (q | k | v, n_tokens): each head a run of head_dim values
        row, size = qkv.strides[1], qkv.strides[0]

        def heads(first: int, count: int) -> Tensor:
            return qkv.view(first * d * size, (d, count, n_tokens), (d * size, row))

        q = opts.rope(heads(0, opts.n_heads), positions, factors)
        k = opts.rope(heads(opts.n_heads, opts.n_kv_heads), positions, factors)
        v = heads(opts.n_heads + opts.n_kv_heads, opts.n_kv_heads).contiguous()
        return self.attn_output(nn.attention(ctx, q, k, v, cache, 1.0 / math.sqrt(d)))


class MLP(nn.Module):
    ffn_up: nn.Linear = nn.shape("hidden_size", "2 * ffn_size")  # gate rows, then up rows
    ffn_down: nn.Linear = nn.shape("ffn_size", "hidden_size")

    def __call__(self, x: Tensor, opts: Options) -> Tensor:
        gate_up = self.ffn_up(x)
        ff, row, n_tokens = opts.ffn_size, gate_up.strides[1], x.shape[1]
        gate = gate_up.view(0, (ff, n_tokens), (row,))
        up = gate_up.view(ff * gate_up.strides[0], (ff, n_tokens), (row,))
        return self.ffn_down(gate.silu(up))


class Layer(llama.Layer):  # llama's pre-norm block around the fused attention and MLP
    attention: SelfAttention
    mlp: MLP


class Weights(nn.Module):
    token_embd: nn.Embedding = nn.shape("hidden_size", "vocab_size")
    blk: list[Layer]
    output_norm: nn.RMSNorm = nn.shape("hidden_size")
    output: nn.Linear = nn.shape("hidden_size", "vocab_size", alt="token_embd")
    rope_factors_long: nn.Weight | None = nn.shape("rope.n_dims // 2")  # LongRoPE (128k models)
    rope_factors_short: nn.Weight | None = nn.shape("rope.n_dims // 2")


@register("phi3")
class Phi3(Model):
    Options, Weights = Options, Weights

    def __init__(self, backend: Backend):
        self.backend = backend
        self.options = Options.from_config(backend.config)
        self.weights: Weights = nn.load(Weights, backend, self.options)
        w = self.weights
        if (w.rope_factors_long is None) != (w.rope_factors_short is None):
            missing = "rope_factors_short" if w.rope_factors_short is None else "rope_factors_long"
            raise ModelError(f"{backend.path}: phi3: {missing}.weight is missing (LongRoPE needs both factor sets)")
        self.cache = Causal(self.shift, swa_window=self.options.sliding_window)

    def forward(self, ctx: Context, batch: Batch) -> Tensor:
        w, o = self.weights, self.options
        inputs = nn.batch_inputs(ctx, batch)
        factors = self._rope_factors()
        h = nn.tap("token_embd", w.token_embd(inputs.tokens))
        for i, layer, rows in nn.layers(w.blk, self.cache, inputs.outputs):
            h = nn.tap(f"blk.{i}", layer(ctx, h, inputs.positions, rows, self.cache, o, factors))
        return nn.tap("output", w.output(nn.tap("output_norm", w.output_norm(h, o.eps))))

    def shift(self, ctx: Context, layer: int, key: Tensor, shift: Tensor) -> Tensor:
        return self.options.rope(key, shift, self._rope_factors())

    def _rope_factors(self) -> Tensor | None:
        """LongRoPE's factors for the context the cache was sized for (fixed from ``init`` on, so
        every graph of a run rotates alike): long beyond the original training context."""
        w = self.weights
        if w.rope_factors_long is None:
            return None
        long = (getattr(self.cache, "capacity", 0) or 0) > self.options.original_context
        return (w.rope_factors_long if long else w.rope_factors_short).weight
