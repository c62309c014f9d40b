"""Gemma 2 (GGUF architecture "gemma2").

Pre- and post-normed transformer: RMSNorm -> attention -> RMSNorm -> residual, RMSNorm -> GELU-gated
MLP -> RMSNorm -> residual. Layers alternate between a sliding window and full attention (two
``Causal`` caches in a ``Wrapper``), attention scores and the final logits are soft-capped
(``cap * tanh(x / cap)``), the token embeddings are scaled by ``sqrt(hidden)`` and double as the
output matrix. Norm weights are stored as ``1 + weight`` (Gemma's RMSNorm), so they apply as usual.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pyggml import nn
from pyggml.backend import Backend, Context
from pyggml.kvcache import Cache, Causal, Wrapper
from pyggml.models import Batch, Model, ModelError, register
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
    eps: float
    sliding_window: int
    layer_kinds: tuple[int, ...]  # nn.SLIDING or nn.GLOBAL per layer
    rope: nn.Rope  # global layers
    rope_local: nn.Rope  # sliding-window layers
    query_scale: float
    attn_softcap: float
    final_softcap: float

    @classmethod
    def from_config(cls, config, default_pattern: int = 2, large_model_layers: int = 46,
                    local_rope_base: float | None = None) -> Options:
        """``local_rope_base``: Gemma 3's sliding-window layers rotate with their own unscaled base
        (``rope.freq_base_swa``, else this); Gemma 2's use the global rope."""
        arch = config.architecture
        hidden, n_layers, n_heads, n_kv_heads, head_dim = nn.attention_sizes(config)
        window = config.uint("attention.sliding_window", 4096)
        if window < 1:
            raise ModelError(f"{arch}: attention.sliding_window must be >= 1")
        rope = nn.Rope.from_config(config, head_dim, RopeType.NEOX)
        local_base = config.float("rope.freq_base_swa", 0.0, min=0.0, max=1e12) or local_rope_base or rope.base
        if local_rope_base is not None:
            rope_local = nn.Rope(head_dim, local_base, mode=RopeType.NEOX, n_ctx_orig=rope.n_ctx_orig)
        else:
            rope_local = dataclasses.replace(rope, base=local_base)
        # as llama.cpp: 1/sqrt(head_dim), but 1/sqrt(hidden/heads) for the largest model (no GGUF key)
        scale_dim = hidden // n_heads if n_layers == large_model_layers else head_dim
        return cls(
            hidden_size=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
            ffn_size=config.uint("feed_forward_length"),
            vocab_size=config.uint("vocab_size", 0) or len(config.get("tokenizer.ggml.tokens", ())) or None,
            context_length=config.uint("context_length", 8192),
            eps=config.float("attention.layer_norm_rms_epsilon", 1e-6),
            sliding_window=window,
            layer_kinds=nn.layer_kinds(config, n_layers, default_pattern),
            rope=rope, rope_local=rope_local, query_scale=1.0 / math.sqrt(scale_dim),
            attn_softcap=config.float("attn_logit_softcapping", 0.0, min=0.0, max=1e6) or 0.0,
            final_softcap=config.float("final_logit_softcapping", 0.0, min=0.0, max=1e6) or 0.0,
        )


class SelfAttention(nn.Module):
    attn_q: nn.Linear = nn.shape("hidden_size", "n_heads * head_dim")
    attn_k: nn.Linear = nn.shape("hidden_size", "n_kv_heads * head_dim")
    attn_v: nn.Linear = nn.shape("hidden_size", "n_kv_heads * head_dim")
    attn_output: nn.Linear = nn.shape("n_heads * head_dim", "hidden_size")

    def __call__(self, ctx: Context, x: Tensor, positions: Tensor, cache: Cache, opts: Options,
                 rope: nn.Rope) -> Tensor:
        n_tokens = x.shape[1]
        q = self.attn_q(x).reshape(opts.head_dim, opts.n_heads, n_tokens)
        k = self.attn_k(x).reshape(opts.head_dim, opts.n_kv_heads, n_tokens)
        v = self.attn_v(x).reshape(opts.head_dim, opts.n_kv_heads, n_tokens)
        q, k = self.norm_qk(q, k, opts.eps)
        q, k = rope(q, positions), rope(k, positions)
        return self.attn_output(nn.attention(ctx, q, k, v, cache, opts.query_scale, softcap=opts.attn_softcap))

    def norm_qk(self, q: Tensor, k: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        return q, k  # Gemma 3 normalises each head here


class MLP(nn.Module):
    ffn_gate: nn.Linear = nn.shape("hidden_size", "ffn_size")
    ffn_up: nn.Linear = nn.shape("hidden_size", "ffn_size")
    ffn_down: nn.Linear = nn.shape("ffn_size", "hidden_size")

    def __call__(self, x: Tensor) -> Tensor:
        return self.ffn_down(self.ffn_gate(x).gelu(self.ffn_up(x)))  # GELU (tanh form) gate


class Layer(nn.Module):
    attn_norm: nn.RMSNorm = nn.shape("hidden_size")
    attention: SelfAttention
    post_attention_norm: nn.RMSNorm = nn.shape("hidden_size")
    ffn_norm: nn.RMSNorm = nn.shape("hidden_size")
    mlp: MLP
    post_ffw_norm: nn.RMSNorm = nn.shape("hidden_size")

    def __call__(self, ctx: Context, h: Tensor, positions: Tensor, outputs: Tensor | None, cache: Cache,
                 opts: Options, rope: nn.Rope) -> Tensor:
        x = self.attention(ctx, self.attn_norm(h, opts.eps), positions, cache, opts, rope)
        x, h = nn.output_rows(outputs, x, h)
        h = h + self.post_attention_norm(x, opts.eps)
        return h + self.post_ffw_norm(self.mlp(self.ffn_norm(h, opts.eps)), opts.eps)


class Weights(nn.Module):
    token_embd: nn.Embedding = nn.shape("hidden_size", "vocab_size")
    blk: list[Layer]
    output_norm: nn.RMSNorm = nn.shape("hidden_size")
    # llama.cpp's gemma files have no output matrix (the embeddings are it); one that has it is used
    output: nn.Linear | None = nn.shape("hidden_size", "vocab_size", alt="token_embd")


@register("gemma2")
class Gemma2(Model):
    Options, Weights = Options, Weights

    def __init__(self, backend: Backend):
        self.backend = backend
        self.options = self.Options.from_config(backend.config)
        self.weights = nn.load(self.Weights, backend, self.options)
        o = self.options
        self.cache = Wrapper(Causal(self.shift, swa_window=o.sliding_window), Causal(self.shift),
                             layer_types=o.layer_kinds)

    def forward(self, ctx: Context, batch: Batch, embeddings=None) -> Tensor:
        """``embeddings(ctx, h, batch) -> h``: edits the scaled token embeddings (Gemma 3's images)."""
        w, o = self.weights, self.options
        inputs = nn.batch_inputs(ctx, batch)
        h = w.token_embd(inputs.tokens).scale(math.sqrt(o.hidden_size))
        if embeddings is not None:
            h = embeddings(ctx, h, batch)
        for i, layer, rows in nn.layers(w.blk, self.cache, inputs.outputs):
            h = nn.tap(f"blk.{i}", layer(ctx, h, inputs.positions, rows, self.cache, o, self._rope(i)))
        logits = w.output(nn.tap("output_norm", w.output_norm(h, o.eps)))
        if o.final_softcap:
            logits = logits.scale(1.0 / o.final_softcap).tanh().scale(o.final_softcap)
        return logits

    def shift(self, ctx: Context, layer: int, key: Tensor, shift: Tensor) -> Tensor:
        return self._rope(layer)(key, shift)

    def _rope(self, layer: int) -> nn.Rope:
        o = self.options
        return o.rope_local if o.layer_kinds[layer] == nn.SLIDING else o.rope
