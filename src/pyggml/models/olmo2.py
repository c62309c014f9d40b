"""OLMo 2 and OLMo 3 (GGUF architecture "olmo2").

A post-normed transformer: attention -> RMSNorm -> residual, SwiGLU MLP -> RMSNorm -> residual (no norm
before either). The queries and keys are RMS-normalised over their whole projection (one weight of
n_heads * head_dim, resp. n_kv_heads * head_dim, not per head) before NeoX rope. The output matrix is
never tied. OLMo 3 files (``attention.sliding_window`` set) slide a window over most layers (by default
three of every four, ``attention.sliding_window_pattern``); those layers rotate without the long-context
rope scaling the global layers may have, as transformers and llama.cpp do.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pyggml import nn
from pyggml.backend import Backend, Context
from pyggml.backend.metadata import MAX_CONTEXT, MAX_VOCAB, MAX_WIDTH
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
    vocab_size: int | None  # None: not in the metadata, token_embd's rows
    context_length: int
    eps: float
    sliding_window: int  # 0: every layer attends to the whole context (OLMo 2)
    layer_kinds: tuple[int, ...]  # nn.SLIDING or nn.GLOBAL per layer
    rope: nn.Rope  # global layers
    rope_local: nn.Rope  # sliding-window layers: the same base, no scaling

    @classmethod
    def from_config(cls, config) -> Options:
        arch = config.architecture
        hidden, n_layers, n_heads, n_kv_heads, head_dim = nn.attention_sizes(config)
        if head_dim * n_heads != hidden:  # llama.cpp sizes the projections by the width alone
            raise ModelError(f"{arch}: heads of {head_dim} x {n_heads} do not make the width {hidden}")
        window = config.uint("attention.sliding_window", 0, max=MAX_CONTEXT)
        rope = nn.Rope.from_config(config, head_dim, RopeType.NEOX)
        # as llama.cpp: YaRN's magnitude (1 + 0.1 ln(factor), in ggml's rope) times rope.scaling.attn_factor
        rope = dataclasses.replace(rope, attn_factor=rope.attn_factor * config.float(
            "rope.scaling.attn_factor", 1.0, min=1e-6, max=1e6))
        return cls(
            hidden_size=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
            ffn_size=config.uint("feed_forward_length", min=1, max=MAX_WIDTH),
            vocab_size=config.uint("vocab_size", 0, max=MAX_VOCAB) or len(config.get("tokenizer.ggml.tokens", ()))
            or None,
            context_length=config.uint("context_length", 4096, min=1, max=MAX_CONTEXT),
            eps=config.float("attention.layer_norm_rms_epsilon", 1e-6, min=0.0, max=1.0),
            sliding_window=window,
            layer_kinds=nn.layer_kinds(config, n_layers, 4) if window else (nn.GLOBAL,) * n_layers,
            rope=rope,
            rope_local=dataclasses.replace(rope, freq_scale=1.0, ext_factor=0.0, attn_factor=1.0),
        )


class SelfAttention(nn.Module):
    attn_q: nn.Linear = nn.shape("hidden_size", "n_heads * head_dim")
    attn_k: nn.Linear = nn.shape("hidden_size", "n_kv_heads * head_dim")
    attn_v: nn.Linear = nn.shape("hidden_size", "n_kv_heads * head_dim")
    attn_q_norm: nn.RMSNorm = nn.shape("n_heads * head_dim")  # over all heads at once
    attn_k_norm: nn.RMSNorm = nn.shape("n_kv_heads * head_dim")
    attn_output: nn.Linear = nn.shape("n_heads * head_dim", "hidden_size")

    def __call__(self, ctx: Context, x: Tensor, positions: Tensor, cache: Cache, opts: Options,
                 rope: nn.Rope) -> Tensor:
        n_tokens = x.shape[1]
        q = self.attn_q_norm(self.attn_q(x), opts.eps).reshape(opts.head_dim, opts.n_heads, n_tokens)
        k = self.attn_k_norm(self.attn_k(x), opts.eps).reshape(opts.head_dim, opts.n_kv_heads, n_tokens)
        v = self.attn_v(x).reshape(opts.head_dim, opts.n_kv_heads, n_tokens)
        q, k = rope(q, positions), rope(k, positions)
        return self.attn_output(nn.attention(ctx, q, k, v, cache, 1.0 / math.sqrt(opts.head_dim)))


class MLP(nn.Module):
    ffn_gate: nn.Linear = nn.shape("hidden_size", "ffn_size")
    ffn_up: nn.Linear = nn.shape("hidden_size", "ffn_size")
    ffn_down: nn.Linear = nn.shape("ffn_size", "hidden_size")

    def __call__(self, x: Tensor) -> Tensor:
        return self.ffn_down(self.ffn_gate(x).silu(self.ffn_up(x)))


class Layer(nn.Module):
    attention: SelfAttention
    post_attention_norm: nn.RMSNorm = nn.shape("hidden_size")
    mlp: MLP
    post_ffw_norm: nn.RMSNorm = nn.shape("hidden_size")

    def __call__(self, ctx: Context, h: Tensor, positions: Tensor, outputs: Tensor | None, cache: Cache,
                 opts: Options, rope: nn.Rope) -> Tensor:
        x = self.attention(ctx, h, positions, cache, opts, rope)
        x, h = nn.output_rows(outputs, x, h)
        h = h + self.post_attention_norm(x, opts.eps)
        return h + self.post_ffw_norm(self.mlp(h), opts.eps)


class Weights(nn.Module):
    token_embd: nn.Embedding = nn.shape("hidden_size", "vocab_size")
    blk: list[Layer]
    output_norm: nn.RMSNorm = nn.shape("hidden_size")
    output: nn.Linear = nn.shape("hidden_size", "vocab_size")  # required, as llama.cpp requires it


@register("olmo2")
class Olmo2(Model):
    Options, Weights = Options, Weights

    def __init__(self, backend: Backend):
        self.backend = backend
        self.options = Options.from_config(backend.config)
        self.weights: Weights = nn.load(Weights, backend, self.options)
        o = self.options
        if o.sliding_window:
            self.cache = Wrapper(Causal(self.shift, swa_window=o.sliding_window), Causal(self.shift),
                                 layer_types=o.layer_kinds)
        else:
            self.cache = Causal(self.shift)

    def forward(self, ctx: Context, batch: Batch) -> Tensor:
        w, o = self.weights, self.options
        inputs = nn.batch_inputs(ctx, batch)
        h = nn.tap("token_embd", w.token_embd(inputs.tokens))
        for i, layer, rows in nn.layers(w.blk, self.cache, inputs.outputs):
            h = nn.tap(f"blk.{i}", layer(ctx, h, inputs.positions, rows, self.cache, o, self._rope(i)))
        return nn.tap("output", w.output(nn.tap("output_norm", w.output_norm(h, o.eps))))

    def shift(self, ctx: Context, layer: int, key: Tensor, shift: Tensor) -> Tensor:
        return self._rope(layer)(key, shift)

    def _rope(self, layer: int) -> nn.Rope:
        o = self.options
        return o.rope_local if o.layer_kinds[layer] == nn.SLIDING else o.rope
