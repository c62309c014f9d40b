"""BERT sentence encoders (GGUF ``bert``): WordPiece vocabulary, pooling from sentence-transformers."""

from __future__ import annotations

from collections.abc import Iterable

import gguf

from .base import Architecture, register
from .tensors import Source
from .vocab import Vocab, unigram_vocab, wordpiece_vocab


@register("BertModel", "BertForMaskedLM", model_types=("bert",))
class Bert(Architecture):
    gguf_arch = "bert"
    skip = (r"^(bert\.)?(pooler\.|cls\.|embeddings\.position_ids)",)  # heads (pooler, MLM) are dropped
    embedding = True
    default_context = 512

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        act = self.config.get("hidden_act", "gelu")
        if act != "gelu":  # the runtime applies exact (erf) GELU, which is what BERT's "gelu" means
            raise ValueError(f"config.json has hidden_act={act!r}; only 'gelu' BERT models are supported")
        if self.config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"config.json has position_embedding_type={self.config['position_embedding_type']!r}; "
                             "only absolute position embeddings are supported")
        if self.n_embd % self.n_heads:
            raise ValueError("config.json: hidden_size is not a multiple of num_attention_heads")
        self.n_types = self.config.get("type_vocab_size") or 2
        self.pooling_type = self.sentence_transformers_pooling() or gguf.PoolingType.MEAN

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        encoder_metadata(self, w)

    def vocab(self) -> Vocab:
        return wordpiece_vocab(self.hf_dir, self.n_vocab)

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        # BertForMaskedLM nests the encoder under "bert."; old checkpoints call LayerNorm parameters gamma/beta
        name = name.removeprefix("bert.").replace("LayerNorm.gamma", "LayerNorm.weight")
        yield self.map_name(name.replace("LayerNorm.beta", "LayerNorm.bias")), source

    def expected(self) -> dict[str, tuple[int, ...]]:
        embd, ff = self.n_embd, self.hparam("intermediate_size")
        shapes = {"token_embd.weight": (self.n_vocab, embd), "token_types.weight": (self.n_types, embd),
                  "position_embd.weight": (self.context_length, embd),
                  "token_embd_norm.weight": (embd,), "token_embd_norm.bias": (embd,)}
        per_layer = {"attn_q": (embd, embd), "attn_k": (embd, embd), "attn_v": (embd, embd),
                     "attn_output": (embd, embd), "attn_output_norm": (embd,), "ffn_up": (ff, embd),
                     "ffn_down": (embd, ff), "layer_output_norm": (embd,)}
        for kind, shape in per_layer.items():
            shapes[f"blk.{{bid}}.{kind}.weight"] = shape
            shapes[f"blk.{{bid}}.{kind}.bias"] = shape[:1]
        return shapes


def encoder_metadata(arch: Architecture, w: gguf.GGUFWriter) -> None:
    """The keys every BERT-like encoder adds to the common ones: BERT's LayerNorm epsilon when the
    config has none, bidirectional attention, the pooling and the token-type count (``arch``'s
    ``pooling_type`` and ``n_types``)."""
    if "layer_norm_eps" not in arch.config:
        w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    w.add_pooling_type(arch.pooling_type)
    w.add_token_type_count(arch.n_types)


@register("BertForSequenceClassification")
class BertReranker(Bert):
    """A BERT cross-encoder (ms-marco-MiniLM style): rank pooling, the pooler (dense + tanh on [CLS]) as
    llama.cpp's ``cls``, the classifier as ``cls.output``."""

    skip = (r"^(bert\.)?embeddings\.position_ids",)
    head = {"bert.pooler.dense": "cls", "pooler.dense": "cls", "classifier": "cls.output"}

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.pooling is not None:
            raise ValueError("a reranker scores query/document pairs (rank pooling); --pooling does not apply")
        self.pooling_type = gguf.PoolingType.RANK
        labels = self.config.get("id2label") or {}
        self.labels = [labels[k] for k in sorted(labels, key=int)] or ["LABEL_0"] * (self.config.get("num_labels") or 1)

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        w.add_classifier_output_labels(self.labels)

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        base, _, suffix = name.rpartition(".")
        if base in self.head:
            yield f"{self.head[base]}.{suffix}", source
        else:
            yield from super().tensors(name, source)

    def expected(self) -> dict[str, tuple[int, ...]]:
        embd = self.n_embd
        return {**super().expected(), "cls.weight": (embd, embd), "cls.bias": (embd,),
                "cls.output.weight": (len(self.labels), embd), "cls.output.bias": (len(self.labels),)}


class _Roberta:
    """What XLM-RoBERTa changes in a BERT file, as llama.cpp writes it: the unigram vocabulary, the
    encoder under ``roberta.``, and position embeddings without RoBERTa's first padding_idx + 1 rows
    (its positions start after the padding id)."""

    def _roberta_init(self) -> None:
        self.offset = (self.config.get("pad_token_id") or 1) + 1
        self.context_length -= self.offset
        self.n_types = self.config.get("type_vocab_size") or 1

    def vocab(self) -> Vocab:
        return unigram_vocab(self.hf_dir, self.n_vocab)

    def _roberta_tensor(self, name: str, source: Source) -> tuple[str, Source]:
        name = name.removeprefix("roberta.")
        if name == "embeddings.position_embeddings.weight":
            rows = source.shape[0] - self.offset
            source = source.map(lambda w: w[self.offset:], (rows, *source.shape[1:]))
        return name, source


@register("XLMRobertaModel", model_types=("xlm-roberta",))
class XLMRoberta(_Roberta, Bert):
    """XLM-RoBERTa sentence encoders (bge-m3, multilingual-e5): a ``bert`` file with a ``t5`` vocabulary."""

    skip = (r"^(roberta\.)?(pooler\.|embeddings\.position_ids)",)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._roberta_init()

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        yield from super().tensors(*self._roberta_tensor(name, source))


@register("XLMRobertaForSequenceClassification")
class XLMRobertaReranker(_Roberta, BertReranker):
    """XLM-RoBERTa cross-encoders (bge-reranker-base/large/v2-m3): the classifier's dense layer (tanh) as
    ``cls`` and its projection as ``cls.output``."""

    skip = (r"^(roberta\.)?embeddings\.position_ids",)
    head = {"classifier.dense": "cls", "classifier.out_proj": "cls.output"}

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._roberta_init()

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        yield from super().tensors(*self._roberta_tensor(name, source))
