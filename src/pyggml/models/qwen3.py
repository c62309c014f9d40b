"""Qwen 3 decoders and Qwen3-Embedding (GGUF architecture "qwen3").

Qwen 2 without the q/k/v biases and with one addition: every query and key head is RMS-normalised
(``attn_q_norm``, ``attn_k_norm``, one weight of head_dim shared by the heads) before rope.

A file with ``qwen3.pooling_type`` (Qwen3-Embedding) is an embedding model: ``embed`` runs whole
texts through the same layers with a causal mask per text and no KV cache, and takes the final
norm's output at each text's last token (last-token pooling); it does not generate. Any qwen3
file can be embedded that way (``embed`` defaults to last-token pooling).
"""

from __future__ import annotations

import numpy as np

from pyggml import nn
from pyggml.backend import Backend, Context
from pyggml.models import Batch, ModelError, Pooling, llama, qwen2, register
from pyggml.models.pooling import WithinSequences, check_batch, pool
from pyggml.tensor import Tensor

Options = qwen2.Options  # Qwen 2's: NeoX rope


class SelfAttention(llama.SelfAttention):
    attn_q_norm: nn.RMSNorm = nn.shape("head_dim")
    attn_k_norm: nn.RMSNorm = nn.shape("head_dim")

    def project(self, x: Tensor, opts: llama.Options) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = super().project(x, opts)
        return self.attn_q_norm(q, opts.eps), self.attn_k_norm(k, opts.eps), v


class Layer(llama.Layer):
    attention: SelfAttention


class Weights(llama.Weights):
    blk: list[Layer]


@register("qwen3")
class Qwen3(qwen2.Qwen2):
    Options, Weights = Options, Weights

    def __init__(self, backend: Backend):
        super().__init__(backend)
        arch = backend.config.architecture
        pooling = backend.config.uint("pooling_type", None)
        if pooling is not None:
            try:
                self.pooling = Pooling.parse(pooling)
            except ValueError:
                raise ModelError(f"{arch}.pooling_type: unknown pooling type {pooling}") from None
            if self.pooling in (Pooling.NONE, Pooling.RANK):
                raise ModelError(f"{arch}.pooling_type: {self.pooling.name.lower()} pooling is not supported "
                                 "(Qwen3-Embedding pools the last token; rerankers are not supported)")
            self.generates, self.cache = False, None  # an embedding model: no text generation, no KV cache

    def forward(self, ctx: Context, batch: Batch) -> Tensor:
        if not self.generates:
            raise NotImplementedError(f"{self.architecture}: this file is an embedding model (pooling_type is "
                                      "set); it produces embeddings, not next-token logits")
        return super().forward(ctx, batch)

    def embed(self, ctx: Context, batch: Batch, pooling: Pooling | str | None = None) -> Tensor:
        w, o = self.weights, self.options
        pooling = Pooling.parse(pooling if pooling is not None else self.pooling or Pooling.LAST)
        if pooling == Pooling.RANK:
            raise ValueError(f"{self.architecture}.embed: rank pooling is not supported")
        tokens, positions, sequences = check_batch(batch, w.token_embd.weight.shape[1], None,
                                                   f"{self.architecture}.embed")
        causal = (sequences[:, None] == sequences[None, :]) & (positions[None, :] <= positions[:, None])
        cache = WithinSequences(ctx.from_numpy(np.where(causal, 0.0, -np.inf).astype(np.float32)))
        positions_t = nn.int32_input(ctx, positions)
        freq_factors = w.rope_freqs.weight if w.rope_freqs is not None else None
        h = w.token_embd(nn.int32_input(ctx.input(), tokens))
        for layer in w.blk:
            h = layer(ctx, h, positions_t, None, cache, o, freq_factors)
        return pool(ctx, w.output_norm(h, o.eps), sequences, pooling)
