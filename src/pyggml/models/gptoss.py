"""gpt-oss (GGUF architecture "gpt-oss"; OpenAI's open-weight mixture-of-experts models).

Pre-norm transformer: RMSNorm -> grouped-query attention (q/k/v/o biases, NeoX rope with YaRN
scaling) -> residual, RMSNorm -> mixture of experts -> residual. Each head has a learned *sink*: a
logit that joins the softmax of every query and takes probability mass without contributing a value.
Layers alternate between a sliding window (even layers) and full attention (two ``Causal`` caches
in a ``Wrapper``). The router (a biased linear map) picks the top-k experts per token and weights
them by a softmax over the chosen logits; each expert is a clamped SwiGLU with biases
(``g * sigmoid(1.702 g) * (u + 1)``, g clipped above and u on both sides at 7).
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

SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # no GGUF keys: llama.cpp fixes them too


@dataclass(frozen=True)
class Options:
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    n_experts_used: int
    expert_ffn_size: int
    vocab_size: int | None
    context_length: int
    eps: float
    sliding_window: int
    layer_kinds: tuple[int, ...]  # nn.SLIDING or nn.GLOBAL per layer
    rope: nn.Rope  # full-attention layers
    rope_local: nn.Rope  # sliding-window layers (another base only if the file says)

    @classmethod
    def from_config(cls, config) -> Options:
        arch = config.architecture
        hidden, n_layers, n_heads, n_kv_heads, head_dim = nn.attention_sizes(config)
        n_experts, n_used = nn.expert_counts(config)
        expert_ffn = config.uint("expert_feed_forward_length", 0)
        if not expert_ffn:
            raise ModelError(f"{arch}: {arch}.expert_feed_forward_length must be set")
        window = config.uint("attention.sliding_window", 0)
        if window < 1:
            raise ModelError(f"{arch}: {arch}.attention.sliding_window must be set and >= 1")
        n_rot = config.uint("rope.dimension_count", 0) or head_dim
        try:
            rope = nn.Rope.from_config(config, n_rot, RopeType.NEOX)
        except ModelError:
            raise
        except ValueError as exc:
            raise ModelError(f"{arch}: {arch}.rope.scaling.type: {exc}") from None
        return cls(
            hidden_size=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
            n_experts=n_experts, n_experts_used=n_used, expert_ffn_size=expert_ffn,
            vocab_size=config.uint("vocab_size", 0) or len(config.get("tokenizer.ggml.tokens", ())) or None,
            context_length=config.uint("context_length", 131072),
            eps=config.float("attention.layer_norm_rms_epsilon", 1e-5),
            sliding_window=window, layer_kinds=nn.layer_kinds(config, n_layers, 2), rope=rope,
            rope_local=dataclasses.replace(
                rope, base=config.float("rope.freq_base_swa", 0.0, min=0.0, max=1e12) or rope.base),
        )


class SelfAttention(nn.Module):
    attn_q: nn.Linear = nn.shape("hidden_size", "n_heads * head_dim", bias=True)
    attn_k: nn.Linear = nn.shape("hidden_size", "n_kv_heads * head_dim", bias=True)
    attn_v: nn.Linear = nn.shape("hidden_size", "n_kv_heads * head_dim", bias=True)
    attn_output: nn.Linear = nn.shape("n_heads * head_dim", "hidden_size", bias=True)
    attn_sinks: nn.Weight = nn.shape("n_heads")

    def __call__(self, ctx: Context, x: Tensor, positions: Tensor, cache: Cache, opts: Options,
                 rope: nn.Rope) -> Tensor:
        n_tokens = x.shape[1]
        q = self.attn_q(x).reshape(opts.head_dim, opts.n_heads, n_tokens)
        k = self.attn_k(x).reshape(opts.head_dim, opts.n_kv_heads, n_tokens)
        v = self.attn_v(x).reshape(opts.head_dim, opts.n_kv_heads, n_tokens)
        q, k = rope(q, positions), rope(k, positions)
        out = nn.attention(ctx, q, k, v, cache, 1.0 / math.sqrt(opts.head_dim), sinks=self.attn_sinks.weight)
        return self.attn_output(out)


class MoE(nn.Module):
    ffn_gate_inp: nn.Linear = nn.shape("hidden_size", "n_experts", bias=True)  # the router
    ffn_gate_exps: nn.Experts = nn.shape("hidden_size", "expert_ffn_size", "n_experts", bias=True)
    ffn_up_exps: nn.Experts = nn.shape("hidden_size", "expert_ffn_size", "n_experts", bias=True)
    ffn_down_exps: nn.Experts = nn.shape("expert_ffn_size", "hidden_size", "n_experts", bias=True)

    def __call__(self, x: Tensor, opts: Options) -> Tensor:
        return nn.moe(x, self.ffn_gate_inp(x), opts.n_experts_used, self.ffn_gate_exps, self.ffn_up_exps,
                      self.ffn_down_exps, lambda gate, up: gate.swiglu_oai(up, SWIGLU_ALPHA, SWIGLU_LIMIT))


class Layer(nn.Module):
    attn_norm: nn.RMSNorm = nn.shape("hidden_size")
    attention: SelfAttention
    post_attention_norm: nn.RMSNorm = nn.shape("hidden_size")
    moe: MoE

    def __call__(self, ctx: Context, h: Tensor, positions: Tensor, outputs: Tensor | None, cache: Cache,
                 opts: Options, rope: nn.Rope) -> Tensor:
        x = self.attention(ctx, self.attn_norm(h, opts.eps), positions, cache, opts, rope)
        x, h = nn.output_rows(outputs, x, h)
        h = h + x
        return h + self.moe(self.post_attention_norm(h, opts.eps), opts)


class Weights(nn.Module):
    token_embd: nn.Embedding = nn.shape("hidden_size", "vocab_size")
    blk: list[Layer]
    output_norm: nn.RMSNorm = nn.shape("hidden_size")
    output: nn.Linear = nn.shape("hidden_size", "vocab_size", alt="token_embd")


@register("gpt-oss")
class GptOss(Model):
    Options, Weights = Options, Weights

    def __init__(self, backend: Backend):
        self.backend = backend
        self.options = Options.from_config(backend.config)
        self.weights: Weights = nn.load(Weights, backend, self.options)
        o = self.options
        self.cache = Wrapper(Causal(self.shift, swa_window=o.sliding_window), Causal(self.shift),
                             layer_types=o.layer_kinds)

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
