"""BERT sentence encoders (GGUF architecture "bert": all-MiniLM, bge, e5 and the like).

Post-norm transformer without a causal mask: token + position + token-type embeddings ->
LayerNorm; per layer, attention -> residual -> LayerNorm, GELU MLP -> residual -> LayerNorm. The
token states are pooled into one vector per sequence (mean, first token, last token) in the graph.
A cross-encoder reranker (``pooling_type`` rank: bge-reranker, ms-marco cross-encoders) puts a query
and a document in one sequence (document tokens of segment 1 where the file has two token types) and
scores it with a classification head on the first token (``rank``).
There is no KV cache: a sequence is encoded whole in one pass, and several sequences share a pass
with a block-diagonal mask so that each token attends only to its own sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pyggml import nn
from pyggml.backend import Backend, Context
from pyggml.backend.metadata import MAX_CONTEXT, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH
from pyggml.models import Batch, Model, ModelError, Pooling, register
from pyggml.models.pooling import RankHead, check_batch, classify, pool, rank_classes, sequence_mask
from pyggml.tensor import Tensor


@dataclass(frozen=True)
class Options:
    hidden_size: int
    n_layers: int
    n_heads: int
    head_dim: int
    ffn_size: int
    vocab_size: int | None  # None: no tokenizer in the file, token_embd's rows
    n_token_types: int | None  # rows of token_types (None: not in the metadata, the file's)
    context_length: int  # rows of position_embd: the longest sequence
    eps: float
    pooling: Pooling
    n_cls_out: int | None = None  # a reranker's classes (rank pooling)

    @classmethod
    def from_config(cls, config) -> Options:
        return cls(**encoder_options(config, "bert", default_context=512, rank=True), n_cls_out=rank_classes(config))


def encoder_options(config, arch: str, default_context: int, rank: bool = False) -> dict:
    """The hyper-parameters every BERT-like encoder reads (the fields of ``Options``), checked, with
    errors that name ``arch``'s key: one head size, no grouped-query or causal attention, rank
    pooling only where ``rank``. ``default_context``: the context when the file does not say."""
    hidden = config.uint("embedding_length", min=1, max=MAX_WIDTH)
    n_heads = config.uint("attention.head_count", min=1, max=MAX_WIDTH)
    if not hidden or not n_heads or hidden % n_heads:
        raise ModelError(f"{arch}: embedding_length ({hidden}) must be a non-zero multiple of "
                         f"attention.head_count ({n_heads})")
    if config.uint("attention.head_count_kv", n_heads) != n_heads:
        raise ModelError(f"{arch}: attention.head_count_kv differs from attention.head_count; grouped-query "
                         f"attention is not supported for {arch}")
    if config.bool("attention.causal", False):
        raise ModelError(f"{arch}: attention.causal is true; only bidirectional encoders are supported")
    try:
        pooling = Pooling.parse(config.uint("pooling_type", Pooling.NONE))
    except ValueError as exc:
        raise ModelError(f"{arch}: {exc}") from None
    if pooling == Pooling.RANK and not rank:
        raise ModelError(f"{arch}: rank pooling (rerankers) is not supported")
    return dict(
        hidden_size=hidden,
        n_layers=config.uint("block_count", min=1, max=MAX_LAYERS),
        n_heads=n_heads,
        head_dim=hidden // n_heads,
        ffn_size=config.uint("feed_forward_length", min=1, max=MAX_WIDTH),
        vocab_size=len(config.get("tokenizer.ggml.tokens", ())) or None,
        n_token_types=config.uint("tokenizer.ggml.token_type_count", None, max=MAX_VOCAB),
        context_length=config.uint("context_length", default_context, min=1, max=MAX_CONTEXT),
        eps=config.float("attention.layer_norm_epsilon", 1e-12, min=0.0, max=1.0),
        pooling=pooling,
    )


class SelfAttention(nn.Module):
    attn_q: nn.Linear = nn.shape("hidden_size", "hidden_size", bias=True)
    attn_k: nn.Linear = nn.shape("hidden_size", "hidden_size", bias=True)
    attn_v: nn.Linear = nn.shape("hidden_size", "hidden_size", bias=True)
    attn_output: nn.Linear = nn.shape("hidden_size", "hidden_size", bias=True)

    def __call__(self, ctx: Context, x: Tensor, mask: Tensor, opts: Options) -> Tensor:
        n_tokens = x.shape[1]
        q = self.attn_q(x).reshape(opts.head_dim, opts.n_heads, n_tokens)
        k = self.attn_k(x).reshape(opts.head_dim, opts.n_heads, n_tokens)
        v = self.attn_v(x).reshape(opts.head_dim, opts.n_heads, n_tokens)
        out = nn.attention(ctx, q, k, v, None, 1.0 / math.sqrt(opts.head_dim), mask=mask)
        return self.attn_output(out)


class MLP(nn.Module):
    ffn_up: nn.Linear = nn.shape("hidden_size", "ffn_size", bias=True)
    ffn_down: nn.Linear = nn.shape("ffn_size", "hidden_size", bias=True)

    def __call__(self, x: Tensor) -> Tensor:
        return self.ffn_down(self.ffn_up(x).gelu_erf())  # BERT's "gelu" is the exact (erf) one


class Layer(nn.Module):
    attention: SelfAttention
    attn_output_norm: nn.LayerNorm = nn.shape("hidden_size", bias=True)
    mlp: MLP
    layer_output_norm: nn.LayerNorm = nn.shape("hidden_size", bias=True)

    def __call__(self, ctx: Context, h: Tensor, mask: Tensor, opts: Options) -> Tensor:
        h = self.attn_output_norm(h + self.attention(ctx, h, mask, opts), opts.eps)
        return self.layer_output_norm(h + self.mlp(h), opts.eps)


class Weights(nn.Module):
    token_embd: nn.Embedding = nn.shape("hidden_size", "vocab_size")
    # segment embeddings (every token is segment 0); required when the file states a token type count
    token_types: nn.Embedding | None = nn.shape("hidden_size", "n_token_types", when="n_token_types")
    position_embd: nn.Embedding = nn.shape("hidden_size", "context_length")
    token_embd_norm: nn.LayerNorm = nn.shape("hidden_size", bias=True)
    blk: list[Layer]
    # a reranker's head: a dense layer + tanh on the first token (optional), then the classes
    cls: nn.Linear | None = nn.shape("hidden_size", "hidden_size")
    rank_head: RankHead


@register("bert")
class Bert(Model):
    """Sentence encoders: ``embed`` checks the batch, runs ``encode`` and pools per sequence. An
    encoder of another architecture subclasses this with its own Options, Weights and ``encode``."""
    Options, Weights = Options, Weights
    generates = False

    def __init__(self, backend: Backend):
        self.backend = backend
        self.options = self.Options.from_config(backend.config)
        self.pooling = self.options.pooling
        self.weights = nn.load(self.Weights, backend, self.options)
        self.cache = None

    def forward(self, ctx: Context, batch: Batch) -> Tensor:
        raise NotImplementedError(f"{self.architecture} is an embedding model: it produces embeddings, "
                                  "not next-token logits")

    def embed(self, ctx: Context, batch: Batch, pooling: Pooling | str | None = None) -> Tensor:
        pooling = self.pooling if pooling is None else Pooling.parse(pooling)
        if pooling == Pooling.RANK:
            raise ValueError(f"{self.architecture}.embed: rank pooling is not supported")
        tokens, positions, sequences = check_batch(batch, self.weights.token_embd.weight.shape[1],
                                                   self.options.context_length, f"{self.architecture}.embed")
        return pool(ctx, self.encode(ctx, tokens, positions, sequences), sequences, pooling)

    def rank(self, ctx: Context, batch: Batch, segments: np.ndarray | None = None) -> Tensor:
        """A reranker's class logits (n_cls_out, n_seqs) of whole query+document sequences;
        ``segments``: each token's type (0: query, 1: document), used where the file has two."""
        if self.pooling != Pooling.RANK:
            raise ValueError(f"{self.architecture}.rank: the model is not a reranker (its pooling is "
                             f"{self.pooling.name.lower()})")
        tokens, positions, sequences = check_batch(batch, self.weights.token_embd.weight.shape[1],
                                                   self.options.context_length, f"{self.architecture}.rank")
        h = pool(ctx, self.encode(ctx, tokens, positions, sequences, segments), sequences, Pooling.CLS)
        return classify(h, self.weights.cls, self.weights.rank_head)

    def encode(self, ctx: Context, tokens: np.ndarray, positions: np.ndarray, sequences: np.ndarray,
               segments: np.ndarray | None = None) -> Tensor:
        """Token states (hidden, n_tokens) of a checked batch of whole sequences (``segments``: token
        types, all 0 when None or when the file has one type)."""
        w, o = self.weights, self.options
        h = w.token_embd(nn.int32_input(ctx.input(), tokens))
        nn.tap("token_embd", h)
        if w.token_types is not None:
            n_types = math.prod(w.token_types.weight.shape[1:])  # a table of one row is 1-d
            types = np.zeros_like(tokens) if segments is None or n_types < 2 else np.asarray(segments, np.int64)
            if types.shape != tokens.shape or types.min() < 0 or types.max() >= n_types:
                raise ValueError(f"{self.architecture}.encode: need one segment in 0..{n_types - 1} per token")
            h = h + w.token_types(nn.int32_input(ctx.input(), types))
        h = h + w.position_embd(nn.int32_input(ctx.input(), positions))
        h = nn.tap("token_embd_norm", w.token_embd_norm(h, o.eps))
        mask = ctx.from_numpy(sequence_mask(sequences))
        for i, layer in enumerate(w.blk):
            h = nn.tap(f"blk.{i}", layer(ctx, h, mask, o))
        return h
