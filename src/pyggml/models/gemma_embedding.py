"""EmbeddingGemma (GGUF architecture "gemma-embedding": EmbeddingGemma-300M).

Gemma 3's text layers (``pyggml.models.gemma3``: scaled embeddings, pre- and post-norms, per-head q/k
norms, two rope bases) run as an encoder: attention sees both ways, the global layers the whole text, the
sliding-window layers the tokens at most ``attention.sliding_window`` / 2 positions away on either side
(as llama.cpp's symmetric window and Hugging Face's ``use_bidirectional_attention`` read it). The final
norm's states are pooled per text (``pooling_type``, mean for EmbeddingGemma) and projected by the
sentence-transformers Dense modules when the file has them (``dense_2``: hidden -> ``dense_2_feat_out``,
``dense_3``: ``dense_3_feat_in`` -> hidden, no bias, no activation). There is no KV cache and no text
generation. ``embed`` returns the vectors unnormalised; the runner L2-normalises them (as sentence-transformers'
Normalize module does).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from pyggml import nn
from pyggml.backend import Backend, Context
from pyggml.backend.metadata import MAX_WIDTH
from pyggml.models import Batch, Model, ModelError, Pooling, gemma3, register
from pyggml.models.pooling import WithinSequences, check_batch, pool
from pyggml.tensor import Tensor


@dataclass(frozen=True)
class Options(gemma3.Options):
    pooling: Pooling = Pooling.MEAN
    dense_2_out: int = 0  # 0: no dense_2
    dense_3_in: int = 0  # 0: no dense_3

    @classmethod
    def from_config(cls, config) -> Options:
        arch = config.architecture
        options = super().from_config(config)
        try:
            pooling = Pooling.parse(config.uint("pooling_type", Pooling.MEAN))
        except ValueError as exc:
            raise ModelError(f"{arch}: {exc}") from None
        if pooling == Pooling.RANK:
            raise ModelError(f"{arch}: rank pooling (rerankers) is not supported")
        dense = {key: config.uint(key, 0, max=MAX_WIDTH) for key in ("dense_2_feat_in", "dense_2_feat_out",
                                                                      "dense_3_feat_in", "dense_3_feat_out")}
        if dense["dense_2_feat_in"] not in (0, options.hidden_size) or \
                dense["dense_3_feat_out"] not in (0, options.hidden_size):
            raise ModelError(f"{arch}: dense_2_feat_in and dense_3_feat_out must equal embedding_length "
                             f"({options.hidden_size}), as llama.cpp requires")
        return dataclasses.replace(options, pooling=pooling, dense_2_out=dense["dense_2_feat_out"],
                                   dense_3_in=dense["dense_3_feat_in"],
                                   query_scale=1.0 / math.sqrt(options.head_dim))  # whatever the layer count


class Weights(gemma3.Weights):
    dense_2: nn.Linear | None = nn.shape("hidden_size", "dense_2_out", when="dense_2_out")
    dense_3: nn.Linear | None = nn.shape("dense_3_in", "hidden_size", when="dense_3_in")


@register("gemma-embedding")
class GemmaEmbedding(Model):
    Options, Weights = Options, Weights
    generates = False

    def __init__(self, backend: Backend):
        self.backend = backend
        self.options = Options.from_config(backend.config)
        self.pooling = self.options.pooling
        self.weights: Weights = nn.load(Weights, backend, self.options)
        self.cache = None

    def forward(self, ctx: Context, batch: Batch) -> Tensor:
        raise NotImplementedError(f"{self.architecture} is an embedding model: it produces embeddings, "
                                  "not next-token logits")

    def embed(self, ctx: Context, batch: Batch, pooling: Pooling | str | None = None) -> Tensor:
        w, o = self.weights, self.options
        pooling = self.pooling if pooling is None else Pooling.parse(pooling)
        if pooling == Pooling.RANK:
            raise ValueError(f"{self.architecture}.embed: rank pooling is not supported")
        tokens, positions, sequences = check_batch(batch, w.token_embd.weight.shape[1], o.context_length,
                                                   f"{self.architecture}.embed")
        h = nn.tap("token_embd", w.token_embd(nn.int32_input(ctx.input(), tokens)).scale(math.sqrt(o.hidden_size)))
        cache = WithinSequences(*(ctx.from_numpy(m) for m in self._masks(positions, sequences)),
                                layer_kinds=o.layer_kinds)
        positions_t = nn.int32_input(ctx, positions)
        for i, layer, _ in nn.layers(w.blk, cache, None):
            rope = o.rope_local if o.layer_kinds[i] == nn.SLIDING else o.rope
            h = nn.tap(f"blk.{i}", layer(ctx, h, positions_t, None, cache, o, rope))
        out = pool(ctx, nn.tap("output_norm", w.output_norm(h, o.eps)), sequences, pooling)
        for dense in (w.dense_2, w.dense_3):  # sentence-transformers' projections, as llama.cpp applies them
            if dense is not None:
                out = dense(out)
        return out

    def _masks(self, positions: np.ndarray, sequences: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The attention masks (n_tokens, n_tokens) of the sliding-window and the global layers (indexed
        by nn.SLIDING, nn.GLOBAL): each token sees its own text, within half the window either way."""
        same = sequences[:, None] == sequences[None, :]
        near = np.abs(positions[:, None] - positions[None, :]) <= self.options.sliding_window // 2
        masks = {nn.SLIDING: same & near, nn.GLOBAL: same}
        return tuple(np.where(masks[kind], 0.0, -np.inf).astype(np.float32) for kind in sorted(masks))
