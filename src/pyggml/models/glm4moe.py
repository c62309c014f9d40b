"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (GGUF architecture "glm4moe", as llama.cpp runs it).

DeepSeek V3's mixture of experts (``pyggml.models.deepseek2``'s feed-forward: leading dense layers, then a
sigmoid router with a choosing-only bias, optional grouped top-k, renormalised and scaled weights, and shared
experts) under plain grouped-query attention: q/k/v projections with biases, optional per-head q/k RMS norms,
NeoX rope over the first ``rope.dimension_count`` dims of each head (half of them in GLM-4.5), a post-attention
norm named ``post_attention_norm``. The last ``nextn_predict_layers`` blocks of a file are GLM's multi-token
prediction layers: llama.cpp loads but never runs them, and neither does pyggml.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pyggml import nn
from pyggml.backend import Backend, Context
from pyggml.backend.metadata import MAX_CONTEXT, MAX_LAYERS, MAX_VOCAB
from pyggml.kvcache import Cache, Causal
from pyggml.models import Batch, Model, ModelError, deepseek2, register
from pyggml.tensor import RopeType, Tensor


@dataclass(frozen=True)
class Options:
    hidden_size: int
    n_layers: int  # the layers run (the file's blocks less its multi-token prediction ones)
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int | None
    context_length: int
    eps: float
    rope: nn.Rope
    # the feed-forward's (deepseek2.moe_options)
    ffn_size: int
    n_dense: int
    n_experts: int
    n_experts_used: int
    expert_ffn_size: int
    n_shared: int
    sigmoid: bool
    groups: int
    groups_used: int
    normalize: bool
    expert_scale: float
    fused_experts: bool = False  # gate and up experts in one ffn_gate_up_exps (nn.fused_gate_up)

    @classmethod
    def from_config(cls, config) -> Options:
        arch = config.architecture
        hidden, n_blocks, n_heads, n_kv_heads, head_dim = nn.attention_sizes(config)
        nextn = config.uint("nextn_predict_layers", 0, max=MAX_LAYERS)
        if nextn >= n_blocks:
            raise ModelError(f"{arch}: nextn_predict_layers ({nextn}) must be fewer than block_count ({n_blocks})")
        n_rot = config.uint("rope.dimension_count", 0) or head_dim
        if n_rot > head_dim or n_rot % 2:
            raise ModelError(f"{arch}: rope.dimension_count ({n_rot}) must be even and at most the head size")
        n_layers = n_blocks - nextn
        return cls(
            hidden_size=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
            vocab_size=config.uint("vocab_size", 0, max=MAX_VOCAB) or len(config.get("tokenizer.ggml.tokens", ()))
            or None,
            context_length=config.uint("context_length", 4096, min=1, max=MAX_CONTEXT),
            eps=config.float("attention.layer_norm_rms_epsilon", 1e-5, min=0.0, max=1.0),
            rope=nn.Rope.from_config(config, n_rot, RopeType.NEOX),
            **deepseek2.moe_options(config, n_layers, deepseek2.SIGMOID))


class SelfAttention(nn.Module):
    attn_q: nn.Linear = nn.shape("hidden_size", "n_heads * head_dim")  # biases: loaded when the file has them
    attn_k: nn.Linear = nn.shape("hidden_size", "n_kv_heads * head_dim")
    attn_v: nn.Linear = nn.shape("hidden_size", "n_kv_heads * head_dim")
    attn_q_norm: nn.RMSNorm | None = nn.shape("head_dim")  # GLM-4.5 (355B) only
    attn_k_norm: nn.RMSNorm | None = nn.shape("head_dim")
    attn_output: nn.Linear = nn.shape("n_heads * head_dim", "hidden_size")

    def __call__(self, ctx: Context, x: Tensor, positions: Tensor, cache: Cache, o: Options) -> Tensor:
        n = x.shape[1]
        q = self.attn_q(x).reshape(o.head_dim, o.n_heads, n)
        k = self.attn_k(x).reshape(o.head_dim, o.n_kv_heads, n)
        v = self.attn_v(x).reshape(o.head_dim, o.n_kv_heads, n)
        if self.attn_q_norm is not None:
            q = self.attn_q_norm(q, o.eps)
        if self.attn_k_norm is not None:
            k = self.attn_k_norm(k, o.eps)
        q, k = o.rope(q, positions), o.rope(k, positions)
        return self.attn_output(nn.attention(ctx, q, k, v, cache, 1.0 / math.sqrt(o.head_dim)))


class Layer(nn.Module):
    attn_norm: nn.RMSNorm = nn.shape("hidden_size")
    attention: SelfAttention
    post_attention_norm: nn.RMSNorm = nn.shape("hidden_size")
    mlp: deepseek2.FeedForward

    def __call__(self, ctx: Context, h: Tensor, positions: Tensor, outputs: Tensor | None, cache: Cache, o: Options,
                 layer: int) -> Tensor:
        x = self.attention(ctx, self.attn_norm(h, o.eps), positions, cache, o)
        x, h = nn.output_rows(outputs, x, h)
        h = h + x
        return h + self.mlp(self.post_attention_norm(h, o.eps), o, layer)


class Weights(nn.Module):
    token_embd: nn.Embedding = nn.shape("hidden_size", "vocab_size")
    blk: list[Layer]
    output_norm: nn.RMSNorm = nn.shape("hidden_size")
    output: nn.Linear = nn.shape("hidden_size", "vocab_size", alt="token_embd")


@register("glm4moe")
class Glm4Moe(Model):
    Options, Weights = Options, Weights

    def __init__(self, backend: Backend):
        self.backend = backend
        self.options = dataclasses.replace(Options.from_config(backend.config), fused_experts=nn.fused_gate_up(backend))
        self.weights: Weights = nn.load(Weights, backend, self.options)
        self.cache = Causal(self.shift)

    def forward(self, ctx: Context, batch: Batch) -> Tensor:
        w, o = self.weights, self.options
        inputs = nn.batch_inputs(ctx, batch)
        h = nn.tap("token_embd", w.token_embd(inputs.tokens))
        for i, layer, rows in nn.layers(w.blk, self.cache, inputs.outputs):
            h = nn.tap(f"blk.{i}", layer(ctx, h, inputs.positions, rows, self.cache, o, i))
        return nn.tap("output", w.output(nn.tap("output_norm", w.output_norm(h, o.eps))))

    def shift(self, ctx: Context, layer: int, key: Tensor, shift: Tensor) -> Tensor:
        return self.options.rope(key, shift)
