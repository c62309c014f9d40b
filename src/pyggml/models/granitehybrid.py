"""Granite 4.0 hybrids (GGUF architecture "granitehybrid": Granite-4.0-H-Micro/Tiny/Small).

Pre-norm blocks of two kinds, a layer's kind being its ``attention.head_count_kv`` entry (0: Mamba-2):

- **Mamba-2** (``ssm_*``): the mixer of ``mamba2.py``.
- **attention**: grouped-query attention, rotary (normal, q/k rows interleaved by the converter) only
  when ``rope.scaling.finetuned`` is true (Granite 4's hybrids have none), scaled by ``attention.scale``.

Then a SwiGLU MLP, or (``expert_count``) a softmax-routed mixture of experts plus a shared SwiGLU
expert (``*_shexp``, ``expert_shared_feed_forward_length``). Granite's multipliers: embeddings times
``embedding_scale``, each block's two branches times ``residual_scale``, logits divided by
``logit_scale``.

Memory: attention layers use a ``Causal`` cache, Mamba-2 layers a ``Recurrent`` one, in a ``Wrapper`` by
kind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pyggml import nn
from pyggml.backend import Backend, Context
from pyggml.backend.metadata import MAX_CONTEXT, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH
from pyggml.kvcache import Causal, Recurrent, Wrapper
from pyggml.models import Batch, Model, ModelError, register
from pyggml.models.mamba2 import ATTENTION, SSM, Mamba2, Mamba2Options
from pyggml.tensor import RopeType, Tensor

_IS_ATTENTION = f"layer_kinds[layer] == {ATTENTION}"


@dataclass(frozen=True)
class Options(Mamba2Options):
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: tuple[int, ...]  # per layer; 0 for a Mamba-2 layer
    head_dim: int
    ffn_size: int  # the MLP's, or each expert's
    shared_ffn_size: int  # the shared expert's (0: none)
    n_experts: int
    n_experts_used: int
    vocab_size: int | None
    context_length: int
    eps: float
    embedding_scale: float
    residual_scale: float
    attention_scale: float
    logit_scale: float
    layer_kinds: tuple[int, ...]  # ATTENTION or SSM per layer
    rope: nn.Rope | None  # None: no positional encoding

    @classmethod
    def from_config(cls, config) -> Options:
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
                             f"Mamba-2 layer) or a divisor of the {n_heads} heads (attention); found {kv}")
        head_dim = config.uint("attention.key_length", 0, max=MAX_WIDTH) or hidden // n_heads
        if (config.uint("attention.value_length", 0, max=MAX_WIDTH) or head_dim) != head_dim or not head_dim:
            raise ModelError(f"{arch}: {arch}.attention.value_length must equal {arch}.attention.key_length")
        n_experts, n_used = nn.expert_counts(config, required=False)
        if config.float("expert_weights_scale", 0.0, min=-1e6, max=1e6) not in (0.0, 1.0):
            raise ModelError(f"{arch}: {arch}.expert_weights_scale is not supported (the chosen experts' weights "
                             "are their softmax only)")
        rope = None
        if config.bool("rope.scaling.finetuned", True):  # Granite's switch for rotary positions
            rope = nn.Rope.from_config(config, config.uint("rope.dimension_count", head_dim, max=head_dim) or head_dim,
                                       RopeType.NORMAL)
        scale = config.float("attention.scale", 0.0, min=0.0, max=1e6) or 1.0 / math.sqrt(head_dim)
        return cls(
            **Mamba2Options.read(config, recurrent=0 in kv),
            hidden_size=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=tuple(kv), head_dim=head_dim,
            ffn_size=config.uint("feed_forward_length", min=1, max=MAX_WIDTH),
            shared_ffn_size=config.uint("expert_shared_feed_forward_length", 0, max=MAX_WIDTH) if n_experts else 0,
            n_experts=n_experts, n_experts_used=n_used,
            vocab_size=config.uint("vocab_size", 0, max=MAX_VOCAB) or len(config.get("tokenizer.ggml.tokens", ()))
            or None,
            context_length=config.uint("context_length", 4096, min=1, max=MAX_CONTEXT),
            eps=config.float("attention.layer_norm_rms_epsilon", 1e-5, min=0.0, max=1.0),
            embedding_scale=config.float("embedding_scale", 0.0, min=-1e6, max=1e6) or 1.0,
            residual_scale=config.float("residual_scale", 0.0, min=-1e6, max=1e6) or 1.0,
            attention_scale=scale,
            logit_scale=config.float("logit_scale", 0.0, min=-1e6, max=1e6) or 1.0,
            layer_kinds=tuple(SSM if k == 0 else ATTENTION for k in kv), rope=rope,
        )


class SelfAttention(nn.Module):
    attn_q: nn.Linear | None = nn.shape("hidden_size", "n_heads * head_dim", when=_IS_ATTENTION)
    attn_k: nn.Linear | None = nn.shape("hidden_size", "n_kv_heads[layer] * head_dim", when=_IS_ATTENTION)
    attn_v: nn.Linear | None = nn.shape("hidden_size", "n_kv_heads[layer] * head_dim", when=_IS_ATTENTION)
    attn_output: nn.Linear | None = nn.shape("n_heads * head_dim", "hidden_size", when=_IS_ATTENTION)

    def __call__(self, ctx: Context, x: Tensor, positions: Tensor, cache: Wrapper, opts: Options,
                 layer: int) -> Tensor:
        n_tokens, n_kv = x.shape[1], opts.n_kv_heads[layer]
        q = self.attn_q(x).reshape(opts.head_dim, opts.n_heads, n_tokens)
        k = self.attn_k(x).reshape(opts.head_dim, n_kv, n_tokens)
        v = self.attn_v(x).reshape(opts.head_dim, n_kv, n_tokens)
        if opts.rope is not None:
            q, k = opts.rope(q, positions), opts.rope(k, positions)
        out = nn.attention(ctx, q, k, v, cache, opts.attention_scale)
        return nn.tap(f"blk.{layer}.attn_output", self.attn_output(out))


_DENSE, _MOE, _SHARED = "n_experts == 0", "n_experts > 0", "n_experts > 0 and shared_ffn_size > 0"


class FeedForward(nn.Module):
    """A SwiGLU MLP, or the experts (softmax over the chosen logits) and a shared SwiGLU expert."""

    ffn_gate: nn.Linear | None = nn.shape("hidden_size", "ffn_size", when=_DENSE)
    ffn_up: nn.Linear | None = nn.shape("hidden_size", "ffn_size", when=_DENSE)
    ffn_down: nn.Linear | None = nn.shape("ffn_size", "hidden_size", when=_DENSE)
    ffn_gate_inp: nn.Linear | None = nn.shape("hidden_size", "n_experts", when=_MOE)  # the router
    ffn_gate_exps: nn.Experts | None = nn.shape("hidden_size", "ffn_size", "n_experts", when=_MOE)
    ffn_up_exps: nn.Experts | None = nn.shape("hidden_size", "ffn_size", "n_experts", when=_MOE)
    ffn_down_exps: nn.Experts | None = nn.shape("ffn_size", "hidden_size", "n_experts", when=_MOE)
    ffn_gate_shexp: nn.Linear | None = nn.shape("hidden_size", "shared_ffn_size", when=_SHARED)
    ffn_up_shexp: nn.Linear | None = nn.shape("hidden_size", "shared_ffn_size", when=_SHARED)
    ffn_down_shexp: nn.Linear | None = nn.shape("shared_ffn_size", "hidden_size", when=_SHARED)

    def __call__(self, x: Tensor, opts: Options) -> Tensor:
        if not opts.n_experts:
            return self.ffn_down(self.ffn_gate(x).silu(self.ffn_up(x)))
        out = nn.moe(x, self.ffn_gate_inp(x), opts.n_experts_used, self.ffn_gate_exps, self.ffn_up_exps,
                     self.ffn_down_exps, glu=lambda g, u: g.silu(u))
        if opts.shared_ffn_size:
            out = out + self.ffn_down_shexp(self.ffn_gate_shexp(x).silu(self.ffn_up_shexp(x)))
        return out


class Layer(nn.Module):
    attn_norm: nn.RMSNorm = nn.shape("hidden_size")
    attention: SelfAttention
    mamba: Mamba2
    ffn_norm: nn.RMSNorm = nn.shape("hidden_size")
    mlp: FeedForward

    def __call__(self, ctx: Context, h: Tensor, positions: Tensor, outputs: Tensor | None, cache: Wrapper,
                 states: Recurrent, opts: Options, layer: int) -> Tensor:
        x = self.attn_norm(h, opts.eps)
        if opts.layer_kinds[layer] == SSM:
            x = self.mamba(ctx, x, states, opts, opts.eps, layer)
        else:
            x = self.attention(ctx, x, positions, cache, opts, layer)
        x, h = nn.output_rows(outputs, x, h)
        h = h + x.scale(opts.residual_scale)
        return h + self.mlp(self.ffn_norm(h, opts.eps), opts).scale(opts.residual_scale)


class Weights(nn.Module):
    token_embd: nn.Embedding = nn.shape("hidden_size", "vocab_size")
    blk: list[Layer]
    output_norm: nn.RMSNorm = nn.shape("hidden_size")
    output: nn.Linear = nn.shape("hidden_size", "vocab_size", alt="token_embd")


@register("granitehybrid")
class GraniteHybrid(Model):
    Options, Weights = Options, Weights

    def __init__(self, backend: Backend):
        self.backend = backend
        self.options = self.Options.from_config(backend.config)
        self.weights: Weights = nn.load(self.Weights, backend, self.options)
        self.states = Recurrent()
        self.cache = Wrapper(Causal(self.shift), self.states,
                             layer_types=self.options.layer_kinds)

    def forward(self, ctx: Context, batch: Batch) -> Tensor:
        w, o = self.weights, self.options
        inputs = nn.batch_inputs(ctx, batch)
        h = nn.tap("token_embd", w.token_embd(inputs.tokens)).scale(o.embedding_scale)
        for i, layer, rows in nn.layers(w.blk, self.cache, inputs.outputs):
            h = nn.tap(f"blk.{i}", layer(ctx, h, inputs.positions, rows, self.cache, self.states, o, i))
        logits = nn.tap("output", w.output(nn.tap("output_norm", w.output_norm(h, o.eps))))
        return logits.scale(1.0 / o.logit_scale)  # the taps are transformers' module outputs, before the multipliers

    def shift(self, ctx: Context, layer: int, key: Tensor, shift: Tensor) -> Tensor:
        rope = self.options.rope
        return key if rope is None else rope(key, shift)  # without rope a key does not depend on its position
