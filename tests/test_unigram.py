"""The unigram tokenizer (``tokenizer.ggml.model`` "t5": XLM-RoBERTa, bge-m3, bge-reranker, T5): the
best-scoring segmentation on a hand-made vocabulary, then llama.cpp's own tokenization of the real
XLM-R vocabulary (llama.cpp's ``ggml-vocab-nomic-bert-moe.gguf``, charsmap normalisation included),
and an XLM-R-style reranker file scored as llama.cpp scores it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from pyggml.tokenizer import TokenType, Unigram, from_metadata

from ._gguf_meta import read_metadata
from .conftest import SHARED_MODELS

# llama.cpp's XLM-R vocabulary (250,048 tokens) from the pinned llama-cpp-python sdist, vendor/llama.cpp/models/
# (sha256 90a6746926454784a98389ad36a36d89bc9cfc81db9cb0f33c941bcc959fe5f9)
UGM_VOCAB = Path(os.environ.get("PYGGML_TEST_UGM_VOCAB", SHARED_MODELS / "vocab" / "ggml-vocab-nomic-bert-moe.gguf"))
needs_vocab = pytest.mark.skipif(not UGM_VOCAB.exists(), reason=f"{UGM_VOCAB} is absent (stage it from the sdist)")
S = "\u2581"


def tiny(**extra) -> Unigram:
    tokens = ["<pad>", "<s>", "</s>", "<unk>", S, f"{S}a", f"{S}ab", "b", "a", f"{S}abc", "c"]
    scores = [0.0, 0.0, 0.0, 0.0, -2.0, -1.0, -1.0, -1.0, -3.0, -5.0, -1.0]
    types = [TokenType.CONTROL] * 3 + [TokenType.UNKNOWN] + [TokenType.NORMAL] * 7
    meta = {"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": [int(t) for t in types], "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 3,
            "tokenizer.ggml.remove_extra_whitespaces": True, **extra}
    tok = from_metadata(meta)
    assert isinstance(tok, Unigram)
    return tok


def pieces(tok: Unigram, text: str) -> list[str]:
    return [tok.vocab.tokens[i] for i in tok.encode(text, add_special=False)]


def test_the_best_scoring_segmentation_wins():
    tok = tiny()
    assert pieces(tok, "ab") == [f"{S}ab"]  # -1 beats ▁a + b (-2)
    assert pieces(tok, "abc") == [f"{S}ab", "c"]  # -2 beats ▁abc (-5)
    assert pieces(tok, "  a   b ") == [f"{S}a", S, "b"]  # runs of spaces merged, ends dropped
    assert pieces(tok, "zzz a") == [S, "<unk>", f"{S}a"]  # unknown characters: one unknown token
    assert tok.encode("ab") == [3 + 3, 2]  # the vocabulary adds EOS (no BOS unless the file says so)
    assert tok.decode(tok.encode("ab a", add_special=False)) == "ab a"


def test_without_merging_every_space_is_kept():
    tok = tiny(**{"tokenizer.ggml.remove_extra_whitespaces": False})
    assert pieces(tok, "a  b") == [f"{S}a", S, S, "b"]


def test_a_charsmap_without_a_trie_is_refused_when_the_vocabulary_loads():
    """A precompiled_charsmap whose trie is empty (or not whole nodes) cannot be searched: refused at load
    with the key's name, not an IndexError in the middle of encoding."""
    for blob in (b"\0\0\0\0" + b"x\0", b"\2\0\0\0" + b"abcdef"):
        with pytest.raises(ValueError, match="precompiled_charsmap"):
            tiny(**{"tokenizer.ggml.precompiled_charsmap": list(blob)})


@pytest.mark.ci_may_skip
@needs_vocab
def test_real_xlm_r_vocabulary_tokenizes_as_llama_cpp():
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is the reference")
    tok = from_metadata(read_metadata(UGM_VOCAB))
    ref = llama_cpp.Llama(str(UGM_VOCAB), vocab_only=True, verbose=False)
    texts = ["Hello world", " Hello  world ", "a\nb", "", " ", "Café naïve über — 42?", "ＦＵＬＬ ｗｉｄｔｈ ①②",
             "日本語のテキスト", "The  quick\tbrown fox\n\njumps", "Ünïcödé ﬁ ligature ™ ½", "<s> special </s> tokens",
             "emoji 🤖🚀 ok", "x" * 50, "\u00a0nbsp\u2003em", "İstanbul ǅ ß", "https://example.com/a_b-c?d=1"]
    for text in texts:
        ids = tok.encode(text)
        assert ids == ref.tokenize(text.encode(), add_bos=True, special=True), text
        assert tok.decode(ids, skip_special=True) == ref.detokenize(ids).decode().replace("<s>", "").replace(
            "</s>", ""), text


@pytest.mark.ci_may_skip
@needs_vocab
def test_xlm_r_style_reranker_scores_as_llama_cpp(tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is the reference")
    import pyggml
    from pyggml.synthetic import defaults, write_model

    from .test_rerank import llama_cpp_rank_scores

    tok = {k: v for k, v in read_metadata(UGM_VOCAB).items() if k.startswith("tokenizer.")}
    tok["tokenizer.ggml.precompiled_charsmap"] = bytes(b & 0xFF for b in tok["tokenizer.ggml.precompiled_charsmap"])
    # bge-reranker's layout as llama.cpp writes it: a bert file with the XLM-R vocabulary and rank pooling
    path = write_model(tmp_path / "xlmr-rerank.gguf", "bert", {
        **defaults("bert"), **tok, "pooling_type": 4, "tokenizer.ggml.token_type_count": 1,
        "embedding_length": 64, "vocab_size": len(tok["tokenizer.ggml.tokens"])}, "f32")
    query, docs = "what is the capital of France?", ["Paris is the capital of France.", "Berlin ist die Hauptstadt.",
                                                     "ＦＵＬＬ width ① text"]
    with pyggml.load(path) as llm:
        pairs = [llm.runner.embedder.pair(query, d)[0] for d in docs]
        ours, _ = llm.runner.rerank(query, docs)
    assert llama_cpp is not None
    np.testing.assert_allclose(ours, llama_cpp_rank_scores(path, pairs), atol=2e-3)
