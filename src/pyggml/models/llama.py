"""Llama 2/3/3.1/3.2 and Mistral-style decoders (GGUF architecture "llama").

Pre-norm transformer: RMSNorm -> grouped-query attention with rotary positions -> residual,
RMSNorm -> SwiGLU MLP -> residual; final RMSNorm and the output projection (tied to the token
embeddings when the file has no output.weight).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from pyggml import nn
from pyggml.backend import Backend, Context
from pyggml.backend.metadata import MAX_CONTEXT, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH
from pyggml.kvcache import Causal
from pyggml.models import Batch, Model, ModelError, mistral3_vision, register
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
    vocab_size: int | None  # None: not in the metadata, token_embd's rows
    context_length: int
    eps: float
    rope: nn.Rope
    rope_mode: ClassVar[RopeType] = RopeType.NORMAL  # NEOX (halves rotated together) in Qwen and others

    @classmethod
    def from_config(cls, config, **extra) -> Options:
        """The options of a file; ``extra``: the fields a subclass adds (read by its own from_config)."""
        arch = config.architecture
        hidden = config.uint("embedding_length", min=1, max=MAX_WIDTH)
        n_heads = config.uint("attention.head_count", min=1, max=MAX_WIDTH)
        if not hidden or not n_heads:
            raise ModelError(f"{arch}: {arch}.embedding_length and {arch}.attention.head_count must be set and "
                             "non-zero")
        head_dim = config.uint("attention.key_length", 0, max=MAX_WIDTH) or hidden // n_heads
        n_kv_heads = config.uint("attention.head_count_kv", 0, max=n_heads) or n_heads
        if n_heads % n_kv_heads:
            raise ModelError(f"{arch}: {arch}.attention.head_count ({n_heads}) is not a multiple of "
                             f"{arch}.attention.head_count_kv ({n_kv_heads})")
        n_rot = config.uint("rope.dimension_count", 0, max=head_dim) or head_dim
        return cls(
            hidden_size=hidden,
            n_layers=config.uint("block_count", min=1, max=MAX_LAYERS),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            head_dim_v=config.uint("attention.value_length", 0, max=MAX_WIDTH) or head_dim,
            ffn_size=config.uint("feed_forward_length", min=1, max=MAX_WIDTH),
            vocab_size=config.uint("vocab_size", 0, max=MAX_VOCAB) or len(config.get("tokenizer.ggml.tokens", ()))
            or None,
            context_length=config.uint("context_length", 2048, min=1, max=MAX_CONTEXT),
            eps=config.float("attention.layer_norm_rms_epsilon", 1e-5, min=0.0, max=1.0),
            rope=nn.Rope.from_config(config, n_rot, cls.rope_mode),
            **extra,
        )


class SelfAttention(nn.Module):
    attn_q: nn.Linear = nn.shape("hidden_size", "n_heads * head_dim")
    attn_k: nn.Linear = nn.shape("hidden_size", "n_kv_heads * head_dim")
    attn_v: nn.Linear = nn.shape("hidden_size", "n_kv_heads * head_dim_v")
    attn_output: nn.Linear = nn.shape("n_heads * head_dim_v", "hidden_size")

    def __call__(self, ctx: Context, x: Tensor, positions: Tensor, cache: Causal | None, opts: Options,
                 freq_factors: Tensor | None) -> Tensor:
        q, k, v = self.project(x, opts)
        q = opts.rope(q, positions, freq_factors)
        k = opts.rope(k, positions, freq_factors)
        out = nn.attention(ctx, q, k, v, cache, 1.0 / math.sqrt(opts.head_dim))
        return self.attn_output(out)

    def project(self, x: Tensor, opts: Options) -> tuple[Tensor, Tensor, Tensor]:
        """Queries (head_dim, n_heads, n_tokens), keys and values (head_dim, n_kv_heads, n_tokens)."""
        n_tokens = x.shape[1]
        return (self.attn_q(x).reshape(opts.head_dim, opts.n_heads, n_tokens),
                self.attn_k(x).reshape(opts.head_dim, opts.n_kv_heads, n_tokens),
                self.attn_v(x).reshape(opts.head_dim_v, opts.n_kv_heads, n_tokens))


class MLP(nn.Module):
    ffn_gate: nn.Linear = nn.shape("hidden_size", "ffn_size")
    ffn_up: nn.Linear = nn.shape("hidden_size", "ffn_size")
    ffn_down: nn.Linear = nn.shape("ffn_size", "hidden_size")

    def __call__(self, x: Tensor, opts: Options) -> Tensor:
        return self.ffn_down(self.ffn_gate(x).silu(self.ffn_up(x)))


class Layer(nn.Module):
    attn_norm: nn.RMSNorm = nn.shape("hidden_size")
    attention: SelfAttention
    ffn_norm: nn.RMSNorm = nn.shape("hidden_size")
    mlp: MLP

    def __call__(self, ctx: Context, h: Tensor, positions: Tensor, outputs: Tensor | None, cache: Causal | None,
                 opts: Options, freq_factors: Tensor | None) -> Tensor:
        x = self.attention(ctx, self.attn_norm(h, opts.eps), positions, cache, opts, freq_factors)
        x, h = nn.output_rows(outputs, x, h)
        h = h + x
        return h + self.mlp(self.ffn_norm(h, opts.eps), opts)


class Weights(nn.Module):
    token_embd: nn.Embedding = nn.shape("hidden_size", "vocab_size")
    blk: list[Layer]
    output_norm: nn.RMSNorm = nn.shape("hidden_size")
    output: nn.Linear = nn.shape("hidden_size", "vocab_size", alt="token_embd")
    rope_freqs: nn.Weight | None = nn.shape("rope.n_dims // 2")  # llama 3.1+ long-context frequency factors


PIXTRAL_TEXT = ("llama", "mistral3")  # the text models llama.cpp pairs with a Pixtral mmproj


@register("llama")
class Llama(Model):
    Options, Weights = Options, Weights

    def __init__(self, backend: Backend):
        self.backend = backend
        self.options = self.Options.from_config(backend.config)
        self.weights: Weights = nn.load(self.Weights, backend, self.options)
        self.cache = Causal(self.shift)
        if self.architecture in PIXTRAL_TEXT and backend.get("v.patch_embd.weight") is not None:
            self.vision = mistral3_vision.load(backend, self.options.hidden_size)

    def forward(self, ctx: Context, batch: Batch) -> Tensor:
        w, o = self.weights, self.options
        inputs = nn.batch_inputs(ctx, batch)
        freq_factors = w.rope_freqs.weight if w.rope_freqs is not None else None
        h = nn.tap("token_embd", w.token_embd(inputs.tokens))
        if batch.multimodal:  # image embeddings over their placeholders (Mistral Small 3.x with Pixtral)
            h = nn.multimodal_embeddings(ctx, h, batch)
        for i, layer, rows in nn.layers(w.blk, self.cache, inputs.outputs):
            h = nn.tap(f"blk.{i}", layer(ctx, h, inputs.positions, rows, self.cache, o, freq_factors))
        return nn.tap("output", w.output(nn.tap("output_norm", w.output_norm(h, o.eps))))

    def attach_mmproj(self, projector: Backend) -> None:
        """A Pixtral mmproj (Mistral Small 3.x, whose text decoder is GGUF llama; Ministral 3's is mistral3)."""
        if self.architecture not in PIXTRAL_TEXT:  # a model built on Llama's graph is not thereby one of them
            return super().attach_mmproj(projector)
        mistral3_vision.attach(self, projector)

    def close(self) -> None:
        super().close()
        if getattr(self, "_projector", None) is not None:
            self._projector.close()
            self._projector = None

    def shift(self, ctx: Context, layer: int, key: Tensor, shift: Tensor) -> Tensor:
        freq_factors = self.weights.rope_freqs.weight if self.weights.rope_freqs is not None else None
        return self.options.rope(key, shift, freq_factors)

