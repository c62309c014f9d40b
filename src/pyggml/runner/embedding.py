"""Embeddings of whole texts with an embedding model (``Model.pooling`` set, e.g. BERT).

An encoder sees a text all at once, so there is no KV cache and no chunking: each text must fit
the context (``truncate=True`` cuts it to fit), and several texts share a forward pass, up to
``batch_size`` tokens, as separate sequences. The model pools in the graph; the vectors are
L2-normalised here when asked.

A reranker (``Pooling.RANK``) scores (query, document) pairs the same way: each pair is one sequence,
``Model.rank`` gives its class scores, the first of which is the relevance score.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from pyggml.models import Batch, Model, Pooling


class EmbeddingsNotSupportedError(NotImplementedError):
    """The model produces no embeddings (it has no pooling output)."""


class GenerationNotSupportedError(ValueError):
    """The model produces embeddings only; it cannot generate text."""


class Embedder:
    """Embeds texts with ``model``; safe to call from several threads (one pass at a time).

    ``num_ctx``: the most tokens of one text (at most the model's trained context, the default);
    ``batch_size``: the most tokens of one forward pass (raised to ``num_ctx`` if smaller)."""

    def __init__(self, model: Model, num_ctx: int | None = None, batch_size: int = 512):
        if model.pooling is None:
            raise EmbeddingsNotSupportedError(
                f"the {model.architecture or 'loaded'} model generates text and has no embedding output; "
                "embeddings need an embedding model such as BERT")
        for name, value in (("num_ctx", num_ctx), ("batch_size", batch_size)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 3):
                raise ValueError(f"Embedder: {name} must be an int >= 3, got {value!r}")
        trained = model.context_length or 512
        self.model, self.tokenizer = model, model.tokenizer
        self.num_ctx = min(num_ctx or trained, trained)
        self.batch_size = max(batch_size, self.num_ctx)
        self._lock = threading.Lock()

    def tokenize(self, text: str, truncate: bool = False) -> list[int]:
        """Token ids of one text (with [CLS]/[SEP] or whatever the vocabulary adds), cut to
        ``num_ctx`` (keeping a final separator) when ``truncate``, else ``ValueError`` if too long."""
        if not isinstance(text, str):
            raise TypeError(f"embed: texts must be strings, got {type(text).__name__}")
        if not text:
            raise ValueError("embed: cannot embed an empty string")
        ids = self.tokenizer.encode(text, add_special=True)
        if len(ids) <= self.num_ctx:
            return ids
        if not truncate:
            raise ValueError(f"embed: a text of {len(ids)} tokens does not fit the context of {self.num_ctx} "
                             "tokens (shorten it, or truncate it)")
        v = self.tokenizer.vocab
        ends_with_special = (v.add_sep and ids[-1] == v.sep) or (v.add_eos and ids[-1] == v.eos)
        return ids[:self.num_ctx - 1] + ids[-1:] if ends_with_special else ids[:self.num_ctx]

    def embed(self, texts: str | Sequence[str], *, normalize: bool = True, truncate: bool = False,
              pooling: Pooling | str | None = None) -> np.ndarray:
        """Embeddings (len(texts), hidden) as float32; one text gives one row."""
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, Sequence):
            raise TypeError(f"embed: texts must be a string or a list of strings, got {type(texts).__name__}")
        if not texts:
            raise ValueError("embed: no texts given")
        pooling = self.model.pooling if pooling is None else Pooling.parse(pooling)
        if pooling in (Pooling.NONE, Pooling.RANK):
            raise ValueError(f"embed: the pooling is {pooling.name.lower()}, which gives no single vector per "
                             "text; pass pooling='mean', 'cls' or 'last'")
        ids = [self.tokenize(t, truncate) for t in texts]
        rows = []
        with self._lock:
            for group in self._packs(ids):
                rows.append(self._compute([ids[i] for i in group], pooling))
        out = np.concatenate(rows, axis=0)
        if normalize:
            out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        return out

    def rerank(self, query: str, documents: Sequence[str], *, truncate: bool = False) -> tuple[np.ndarray, int]:
        """Relevance scores (len(documents),) of each document to ``query`` and the tokens read;
        ``truncate`` cuts documents too long for the context (else ``ValueError``; always one with a
        ``rerank`` prompt template)."""
        if self.model.pooling != Pooling.RANK:
            raise ValueError(f"rerank: the {self.model.architecture or 'loaded'} model is not a reranker (its "
                             "pooling_type is not rank); use a cross-encoder such as bge-reranker or Qwen3-Reranker")
        if not isinstance(query, str) or not query:
            raise ValueError("rerank: query must be a non-empty string")
        if isinstance(documents, str) or not isinstance(documents, Sequence) or not documents:
            raise ValueError("rerank: documents must be a non-empty list of strings")
        pairs = [self.pair(query, d, truncate) for d in documents]
        rows = []
        with self._lock:
            for group in self._packs([ids for ids, _ in pairs]):
                rows.append(self._compute([pairs[i][0] for i in group], None,
                                          np.concatenate([pairs[i][1] for i in group])))
        return np.concatenate(rows, axis=0)[:, 0], sum(len(ids) for ids, _ in pairs)

    def pair(self, query: str, document: str, truncate: bool = False) -> tuple[list[int], np.ndarray]:
        """The tokens of one (query, document) sequence and their segments (0: query, 1: document).

        With a ``rerank`` template in the file (Qwen3-Reranker): the template with ``{query}`` and
        ``{document}`` filled in, as llama.cpp makes it. Otherwise a BERT vocabulary gives
        transformers' pair ``[CLS] query [SEP] document [SEP]``; any other, llama.cpp's ``BOS query
        EOS SEP document EOS`` (each special where the vocabulary adds it)."""
        if not isinstance(document, str) or not document:
            raise ValueError("rerank: documents must be non-empty strings")
        template = self.model.config.get("tokenizer.chat_template.rerank")
        if template:
            ids = self.tokenizer.encode(template.replace("{query}", query).replace("{document}", document),
                                        add_special=False)
            if len(ids) > self.num_ctx:
                raise ValueError(f"rerank: a query and document of {len(ids)} tokens do not fit the context of "
                                 f"{self.num_ctx} tokens (shorten the document)")
            return ids, np.zeros(len(ids), np.int64)
        v = self.tokenizer.vocab
        q = self.tokenizer.encode(query, add_special=False)
        d = self.tokenizer.encode(document, add_special=False)
        if v.model == "bert":
            head, tail = [v.bos, *q, v.sep], [v.sep]
        else:
            eos = [v.eos if v.eos is not None else v.sep] if v.add_eos else []
            head = ([v.bos] if v.add_bos else []) + q + eos + ([v.sep] if v.add_sep else [])
            tail = eos
        if None in head or None in tail:
            raise ValueError("rerank: the vocabulary lacks the special tokens that join a query and a document")
        room = self.num_ctx - len(head) - len(tail)
        if len(d) > room:
            if not truncate or room < 1:
                raise ValueError(f"rerank: a query and document of {len(head) + len(d) + len(tail)} tokens do not "
                                 f"fit the context of {self.num_ctx} tokens (shorten them, or truncate)")
            d = d[:room]
        ids = head + d + tail
        return ids, np.repeat(np.array([0, 1], np.int64), [len(head), len(d) + len(tail)])

    def reserve(self) -> None:
        """Allocate the compute memory of the largest pass now (MemoryError here, not mid-request)."""
        n, per = self.batch_size, self.num_ctx
        texts = [[0] * min(per, n - start) for start in range(0, n, per)]
        with self._lock, self.model.backend.new_context() as ctx:
            ctx.forward(self.model.embed(ctx, _batch(texts), Pooling.MEAN))
            ctx.reserve()

    def _packs(self, ids: list[list[int]]) -> list[list[int]]:
        """Indices of the texts in each forward pass: consecutive texts up to ``batch_size`` tokens."""
        packs: list[list[int]] = []
        used = self.batch_size
        for i, text in enumerate(ids):
            if used + len(text) > self.batch_size:
                packs.append([])
                used = 0
            packs[-1].append(i)
            used += len(text)
        return packs

    def _compute(self, texts: list[list[int]], pooling: Pooling | None, segments: np.ndarray | None = None
                 ) -> np.ndarray:
        """(len(texts), n) pooled vectors, or with ``pooling=None`` a reranker's class scores."""
        with self.model.backend.new_context() as ctx:
            batch = _batch(texts)
            out = self.model.rank(ctx, batch, segments) if pooling is None else self.model.embed(ctx, batch, pooling)
            ctx.compute(out)
            return out.numpy().astype(np.float32, copy=True)


def ranked(scores: Sequence[float], top_n: int | None = None) -> list[tuple[int, float]]:
    """(index, score) pairs, best first (ties by index), at most ``top_n``."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return [(i, float(scores[i])) for i in order[:top_n]]


def _batch(texts: list[list[int]]) -> Batch:
    """Texts as sequences 0, 1, ... of one batch, each at positions 0..len-1."""
    return Batch(inputs=[t for text in texts for t in text],
                 positions=[p for text in texts for p in range(len(text))],
                 sequences=[s for s, text in enumerate(texts) for _ in text])
