"""Llama 2/3/3.1/3.2 and Mistral-style decoders (GGUF architecture "llama").

Pre-norm transformer: RMSNorm -> grouped-query attention with rotary positions -> residual,
RMSNorm -> SwiGLU MLP -> residual; final RMSNorm and the output projection (tied to the token
embeddings when the file has no output.weight).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pyggml import nn
from pyggml.backend import MAX_CONTEXT, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH, Backend, Context
from pyggml.kvcache import Causal
from pyggml.models import Batch, Model, ModelError, register
from pyggml.tensor import RopeType, Tensor


@dataclass(frozen=True)
class Options:
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    head_dim_v: int
    ffn_size: int
    vocab_size: int
    context_length: int
    eps: float
    rope: nn.Rope

    @classmethod
    def from_config(cls, config) -> Options:
        hidden = config.uint("embedding_length", min=1, max=MAX_WIDTH)
        n_heads = config.uint("attention.head_count", min=1, max=MAX_WIDTH)
        if not hidden or not n_heads:
            raise ModelError("llama: embedding_length and attention.head_count must be set and non-zero")
        head_dim = config.uint("attention.key_length", 0, max=MAX_WIDTH) or hidden // n_heads
        n_kv_heads = config.uint("attention.head_count_kv", 0, max=n_heads) or n_heads
        if n_heads % n_kv_heads:
            raise ModelError(f"llama: {n_heads} heads are not a multiple of {n_kv_heads} KV heads")
        n_rot = config.uint("rope.dimension_count", 0, max=head_dim) or head_dim
        return cls(
            hidden_size=hidden,
            n_layers=config.uint("block_count", min=1, max=MAX_LAYERS),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            head_dim_v=config.uint("attention.value_length", 0, max=MAX_WIDTH) or head_dim,
            ffn_size=config.uint("feed_forward_length", min=1, max=MAX_WIDTH),
            vocab_size=config.uint("vocab_size", 0, max=MAX_VOCAB) or len(config.get("tokenizer.ggml.tokens", ())),
            context_length=config.uint("context_length", 2048, min=1, max=MAX_CONTEXT),
            eps=config.float("attention.layer_norm_rms_epsilon", 1e-5, min=0.0, max=1.0),
            rope=nn.Rope.from_config(config, n_rot, RopeType.NORMAL),
        )


class SelfAttention(nn.Module):
    attn_q: nn.Linear
    attn_k: nn.Linear
    attn_v: nn.Linear
    attn_output: nn.Linear

    def __call__(self, ctx: Context, x: Tensor, positions: Tensor, cache: Causal | None, opts: Options,
                 freq_factors: Tensor | None) -> Tensor:
        n_tokens = x.shape[1]
        q = self.attn_q(x).reshape(opts.head_dim, opts.n_heads, n_tokens)
        k = self.attn_k(x).reshape(opts.head_dim, opts.n_kv_heads, n_tokens)
        v = self.attn_v(x).reshape(opts.head_dim_v, opts.n_kv_heads, n_tokens)
        q = opts.rope(q, positions, freq_factors)
        k = opts.rope(k, positions, freq_factors)
        out = nn.attention(ctx, q, k, v, cache, 1.0 / math.sqrt(opts.head_dim))
        return self.attn_output(out)


class MLP(nn.Module):
    ffn_gate: nn.Linear
    ffn_up: nn.Linear
    ffn_down: nn.Linear

    def __call__(self, x: Tensor) -> Tensor:
        return self.ffn_down(self.ffn_gate(x).silu(self.ffn_up(x)))


class Layer(nn.Module):
    attn_norm: nn.RMSNorm
    attention: SelfAttention
    ffn_norm: nn.RMSNorm
    mlp: MLP

    def __call__(self, ctx: Context, h: Tensor, positions: Tensor, outputs: Tensor | None, cache: Causal | None,
                 opts: Options, freq_factors: Tensor | None) -> Tensor:
        x = self.attention(ctx, self.attn_norm(h, opts.eps), positions, cache, opts, freq_factors)
        if outputs is not None:  # last layer: only the rows whose logits are wanted go on
            x, h = x.rows(outputs), h.rows(outputs)
        h = h + x
        return h + self.mlp(self.ffn_norm(h, opts.eps))


class Weights(nn.Module):
    token_embd: nn.Embedding
    blk: list[Layer]
    output_norm: nn.RMSNorm
    output: nn.Linear = nn.alt("token_embd")
    rope_freqs: nn.Weight | None  # llama 3.1+ long-context frequency factors


@register("llama")
class Llama(Model):
    def __init__(self, backend: Backend):
        self.backend = backend
        self.options = Options.from_config(backend.config)
        self.weights: Weights = nn.load(Weights, backend, self.options.n_layers)
        self._check_shapes()
        self.cache = Causal(self.shift)

    def _check_shapes(self) -> None:
        o, w = self.options, self.weights
        expected = {
            "token_embd": (w.token_embd.weight, (o.hidden_size, o.vocab_size or w.token_embd.weight.shape[1])),
            "output": (w.output.weight, (o.hidden_size, w.token_embd.weight.shape[1])),
        }
        for i, layer in enumerate(w.blk):
            a, m = layer.attention, layer.mlp
            expected.update({
                f"blk.{i}.attn_q": (a.attn_q.weight, (o.hidden_size, o.n_heads * o.head_dim)),
                f"blk.{i}.attn_k": (a.attn_k.weight, (o.hidden_size, o.n_kv_heads * o.head_dim)),
                f"blk.{i}.attn_v": (a.attn_v.weight, (o.hidden_size, o.n_kv_heads * o.head_dim_v)),
                f"blk.{i}.attn_output": (a.attn_output.weight, (o.n_heads * o.head_dim_v, o.hidden_size)),
                f"blk.{i}.ffn_gate": (m.ffn_gate.weight, (o.hidden_size, o.ffn_size)),
                f"blk.{i}.ffn_up": (m.ffn_up.weight, (o.hidden_size, o.ffn_size)),
                f"blk.{i}.ffn_down": (m.ffn_down.weight, (o.ffn_size, o.hidden_size)),
            })
        for name, (tensor, shape) in expected.items():
            if tensor.shape[:2] != shape:
                raise ModelError(f"llama: tensor {name}.weight has shape {tensor.shape}, expected {shape} "
                                 "from the file's hyper-parameters")

    def forward(self, ctx: Context, batch: Batch) -> Tensor:
        w, o = self.weights, self.options
        tokens = nn.int32_input(ctx.input(), batch.tokens, "tokens")
        positions = nn.int32_input(ctx, batch.positions, "positions")
        outputs = nn.int32_input(ctx, batch.output_rows, "outputs")
        freq_factors = w.rope_freqs.weight if w.rope_freqs is not None else None
        h = w.token_embd(tokens)
        for i, layer in enumerate(w.blk):
            if self.cache is not None:
                self.cache.set_layer(i)
            last = outputs if i == len(w.blk) - 1 else None
            h = layer(ctx, h, positions, last, self.cache, o, freq_factors)
        return w.output(w.output_norm(h, o.eps))

    def shift(self, ctx: Context, layer: int, key: Tensor, shift: Tensor) -> Tensor:
        freq_factors = self.weights.rope_freqs.weight if self.weights.rope_freqs is not None else None
        return self.options.rope(key, shift, freq_factors)

