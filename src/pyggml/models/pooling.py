"""What every embedding model does around its encoder: check a batch of whole sequences, mask attention
to each sequence (``WithinSequences`` in place of a decoder's KV cache), pool token states per sequence,
and a reranker's classification head. Shared by the model files; not a model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from pyggml import nn
from pyggml.input import Batch
from pyggml.models import Pooling

if TYPE_CHECKING:
    from pyggml.backend import Context
    from pyggml.tensor import Tensor


def check_batch(batch: Batch, n_vocab: int, n_positions: int | None, name: str) -> tuple[np.ndarray, ...]:
    """A batch of whole sequences as int arrays (tokens, positions, sequences), after checking what
    the graph would otherwise read out of bounds: token ids below ``n_vocab``, positions below
    ``n_positions`` (None: no limit), sequences numbered 0, 1, ... with each one's tokens together."""
    tokens = np.asarray(batch.tokens, dtype=np.int64)
    positions = np.asarray(batch.positions, dtype=np.int64)
    sequences = np.asarray(batch.sequences, dtype=np.int64)
    if not len(tokens) or tokens.ndim != 1 or positions.shape != tokens.shape or sequences.shape != tokens.shape:
        raise ValueError(f"{name}: need equally long, non-empty tokens, positions and sequences; got "
                         f"{tokens.shape}, {positions.shape}, {sequences.shape}")
    if tokens.min() < 0 or tokens.max() >= n_vocab:
        raise ValueError(f"{name}: token ids must lie in 0..{n_vocab - 1}")
    if positions.min() < 0 or (n_positions is not None and positions.max() >= n_positions):
        raise ValueError(f"{name}: positions must lie in 0..{n_positions - 1} (the model's context length)"
                         if n_positions is not None else f"{name}: positions must not be negative")
    steps = np.diff(sequences)
    if sequences[0] != 0 or ((steps != 0) & (steps != 1)).any():
        raise ValueError(f"{name}: sequences must be numbered 0, 1, ... with each one's tokens together")
    return tokens, positions, sequences


def sequence_mask(sequences: np.ndarray) -> np.ndarray:
    """(n_tokens, n_tokens) additive attention mask: 0 within a sequence, -inf across sequences."""
    same = sequences[:, None] == sequences[None, :]
    return np.where(same, 0.0, -np.inf).astype(np.float32)


class WithinSequences:
    """Stands in for the KV cache while a decoder's layers embed whole texts: attention over the batch
    itself, each token seeing what the mask of the current layer lets it ((n_tokens, n_tokens), 0 or
    -inf): ``masks[layer_kinds[layer]]`` after ``set_layer(layer)``, else (and before) ``masks[0]``."""

    def __init__(self, *masks: Tensor, layer_kinds: Sequence[int] | None = None):
        self.masks, self.layer_kinds, self.mask = masks, layer_kinds, masks[0]

    def set_layer(self, layer: int) -> None:
        self.mask = self.masks[self.layer_kinds[layer] if self.layer_kinds is not None else 0]

    def put(self, ctx: Context, key: Tensor, value: Tensor) -> None:
        self.key, self.value = key.permute(0, 2, 1, 3), value.permute(0, 2, 1, 3)

    def get(self, ctx: Context) -> tuple[Tensor, Tensor, Tensor]:
        return self.key, self.value, self.mask

    def get_groups(self, ctx: Context) -> None:
        return None  # one attention over the batch, by the mask


def pool(ctx: Context, h: Tensor, sequences: np.ndarray, pooling: Pooling) -> Tensor:
    """Pool token states ``h`` (hidden, n_tokens) per sequence: (hidden, n_seqs), or ``h`` for NONE."""
    if pooling == Pooling.NONE:
        return h
    n_seqs = int(sequences[-1]) + 1
    starts = np.searchsorted(sequences, np.arange(n_seqs), side="left")
    ends = np.searchsorted(sequences, np.arange(n_seqs), side="right")
    if pooling == Pooling.CLS:
        return h.rows(nn.int32_input(ctx, starts))
    if pooling == Pooling.LAST:
        return h.rows(nn.int32_input(ctx, ends - 1))
    # mean: h (hidden, n_tokens) times a (n_tokens, n_seqs) matrix of 1/length within each sequence
    weights = np.zeros((n_seqs, len(sequences)), np.float32)  # numpy order: row s is sequence s
    weights[sequences, np.arange(len(sequences))] = (1.0 / (ends - starts))[sequences]
    return h.transpose().contiguous().mulmat(ctx.from_numpy(weights))


class RankHead(nn.Module):
    """A reranker's output projection, llama.cpp's ``cls.output`` (``n_cls_out`` classes: one relevance
    logit for a BERT cross-encoder; the "yes" and "no" rows of the LM head for Qwen3-Reranker); required
    when the file's pooling is rank."""
    nested = "cls"
    output: nn.Linear | None = nn.shape("hidden_size", "n_cls_out", when="n_cls_out")


def rank_classes(config) -> int | None:
    """The classes of a reranker's head (``<arch>.classifier.output_labels``, else 1) when the file's
    ``pooling_type`` is rank, else None."""
    if config.uint("pooling_type", Pooling.NONE) != Pooling.RANK:
        return None
    return len(config.get(f"{config.architecture}.classifier.output_labels") or ()) or 1


def classify(x: Tensor, dense: nn.Linear | None, head: RankHead) -> Tensor:
    """The classification head on pooled states ``x`` (hidden, n_seqs), as llama.cpp applies it:
    ``cls`` then tanh (BERT's pooler, RoBERTa's classifier.dense) when present, then ``cls.output``."""
    if dense is not None:
        x = dense(x).tanh()
    return head.output(x) if head.output is not None else x
