"""Qwen 3 decoders and Qwen3-Embedding (GGUF architecture "qwen3").

Qwen 2 without the q/k/v biases and with one addition: every query and key head is RMS-normalised
(``attn_q_norm``, ``attn_k_norm``, one weight of head_dim shared by the heads) before rope.

A file with ``qwen3.pooling_type`` (Qwen3-Embedding) is an embedding model: ``embed`` runs whole
texts through the same layers with a causal mask per text and no KV cache, and takes the final
norm's output at each text's last token (last-token pooling); it does not generate. Any qwen3
file can be embedded that way (``embed`` defaults to last-token pooling).

Qwen3-Reranker (``pooling_type`` rank, as llama.cpp converts it): the same pass over a prompt made
from the file's ``rerank`` template, and at the last token the "yes" and "no" rows of the LM head
(``cls.output``); the score is the softmax probability of "yes" (``rank``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pyggml import nn
from pyggml.backend import Backend, Context
from pyggml.models import Batch, ModelError, Pooling, llama, qwen2, register
from pyggml.models.pooling import RankHead, WithinSequences, check_batch, classify, pool, rank_classes
from pyggml.tensor import Tensor


@dataclass(frozen=True)
class Options(qwen2.Options):  # Qwen 2's (NeoX rope), and a reranker's classes
    n_cls_out: int | None = None

    @classmethod
    def from_config(cls, config, **extra) -> Options:
        return super().from_config(config, n_cls_out=rank_classes(config), **extra)


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
    rank_head: RankHead  # Qwen3-Reranker's yes/no rows


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
            if self.pooling == Pooling.NONE:
                raise ModelError(f"{arch}.pooling_type: none pooling is not supported (Qwen3-Embedding pools the "
                                 "last token, Qwen3-Reranker ranks)")
            self.generates, self.cache = False, None  # an embedding model: no text generation, no KV cache

    def forward(self, ctx: Context, batch: Batch) -> Tensor:
        if not self.generates:
            raise NotImplementedError(f"{self.architecture}: this file is an embedding model (pooling_type is "
                                      "set); it produces embeddings, not next-token logits")
        return super().forward(ctx, batch)

    def rank(self, ctx: Context, batch: Batch, segments: np.ndarray | None = None) -> Tensor:
        """Qwen3-Reranker's class probabilities (n_cls_out, n_seqs): softmax of the yes/no logits at
        each sequence's last token (``segments`` is not used)."""
        if self.pooling != Pooling.RANK:
            raise ValueError(f"{self.architecture}.rank: the model is not a reranker (pooling_type is not rank)")
        return classify(self._pooled(ctx, batch, Pooling.LAST, "rank"), None, self.weights.rank_head).softmax()

    def embed(self, ctx: Context, batch: Batch, pooling: Pooling | str | None = None) -> Tensor:
        pooling = Pooling.parse(pooling if pooling is not None else self.pooling or Pooling.LAST)
        if pooling == Pooling.RANK:
            raise ValueError(f"{self.architecture}.embed: rank pooling gives scores, not embeddings (use rank)")
        return self._pooled(ctx, batch, pooling, "embed")

    def _pooled(self, ctx: Context, batch: Batch, pooling: Pooling, op: str) -> Tensor:
        w, o = self.weights, self.options
        tokens, positions, sequences = check_batch(batch, w.token_embd.weight.shape[1], None,
                                                   f"{self.architecture}.{op}")
        causal = (sequences[:, None] == sequences[None, :]) & (positions[None, :] <= positions[:, None])
        cache = WithinSequences(ctx.from_numpy(np.where(causal, 0.0, -np.inf).astype(np.float32)))
        positions_t = nn.int32_input(ctx, positions)
        freq_factors = w.rope_freqs.weight if w.rope_freqs is not None else None
        h = w.token_embd(nn.int32_input(ctx.input(), tokens))
        for layer in w.blk:
            h = layer(ctx, h, positions_t, None, cache, o, freq_factors)
        return pool(ctx, w.output_norm(h, o.eps), sequences, pooling)
