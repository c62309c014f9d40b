"""Rerankers: BERT cross-encoders (``BertForSequenceClassification``) and Qwen3-Reranker, converted from
tiny random transformers checkpoints; scores against transformers and against llama.cpp (llama-cpp-python)
on the same file; ``LLM.rerank`` and the ``/v1/rerank`` route (llama-server's and Jina/Cohere's shape)."""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="builds HF reranker checkpoints")
transformers = pytest.importorskip("transformers", reason="builds HF reranker checkpoints")

import pyggml  # noqa: E402
from pyggml.convert import convert_hf  # noqa: E402

from .hf_fixtures import make_tiny_bert_reranker, make_tiny_llama, make_tiny_xlm_roberta  # noqa: E402

QUERY = "what is the sun"
DOCS = ["the sun is a star and it is hot", "water is found in the sea", "the school has a long page",
        "people know the sun will come up each day"]


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """(gguf, hf_dir, hf_model) of a cross-encoder with two token types (query 0, document 1)."""
    root = tmp_path_factory.mktemp("bert-rerank")
    hf_dir, model = make_tiny_bert_reranker(root, type_vocab_size=2)
    return convert_hf(hf_dir, root / "rerank.gguf", "f32"), hf_dir, model


def qwen3_reranker(root, tie: bool):
    """(gguf, hf_model, yes_id, no_id): a tiny Qwen3ForCausalLM whose vocabulary has "yes" and "no",
    converted as Qwen3-Reranker (detected from its README, as llama.cpp does)."""
    import tokenizers

    hf_dir, model = make_tiny_llama(root, arch="qwen3", vocab="qwen", n_kv_heads=2, tie=tie)
    tok = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    tok.add_tokens(["yes", "no"])
    tok.save(str(hf_dir / "tokenizer.json"))
    yes, no = tok.token_to_id("yes"), tok.token_to_id("no")
    assert max(yes, no) < model.config.vocab_size
    (hf_dir / "README.md").write_text("# Qwen3-Reranker-0.6B\n\ntiny random test copy\n")
    return convert_hf(hf_dir, root / f"qwen3-rerank-{tie}.gguf", "f32"), model, yes, no


def llama_cpp_rank_scores(path, token_lists) -> list[float]:
    """llama.cpp's rank output (first value) for each token list, one sequence at a time."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is the reference runtime")
    ref = llama_cpp.Llama(str(path), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_RANK, n_ctx=256,
                          n_batch=256, n_ubatch=256, verbose=False)
    try:
        scores = []
        for ids in token_lists:
            ref._batch.reset()
            ref._batch.add_sequence(ids, 0, False)
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ref._ctx.ctx), True)
            ref._ctx.decode(ref._batch)
            scores.append(llama_cpp.llama_get_embeddings_seq(ref._ctx.ctx, 0)[0])
        return scores
    finally:
        ref.close()


def test_bert_cross_encoder_scores_match_transformers(bert):
    path, hf_dir, model = bert
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    enc = tok([QUERY] * len(DOCS), DOCS, padding=True, return_tensors="pt")
    with torch.no_grad():
        want = model(**enc).logits[:, 0].numpy()
    with pyggml.load(path) as llm:
        for i, doc in enumerate(DOCS):  # transformers' pair: [CLS] q [SEP] d [SEP], segments 0 then 1
            ids, segments = llm.runner.embedder.pair(QUERY, doc)
            n = int(enc["attention_mask"][i].sum())
            assert ids == enc["input_ids"][i, :n].tolist()
            assert segments.tolist() == enc["token_type_ids"][i, :n].tolist()
        scores, n_tokens = llm.runner.rerank(QUERY, DOCS)  # all pairs in one pass
        ranked = llm.rerank(QUERY, DOCS, top_n=3)
    np.testing.assert_allclose(scores, want, rtol=1e-4, atol=1e-5)
    assert n_tokens == int(enc["attention_mask"].sum())
    order = np.argsort(-want, kind="stable")[:3]
    assert [r["index"] for r in ranked] == order.tolist()
    assert [r["document"] for r in ranked] == [DOCS[i] for i in order]
    np.testing.assert_allclose([r["relevance_score"] for r in ranked], want[order], rtol=1e-4, atol=1e-5)


def test_bert_reranker_file_has_llama_cpps_head_and_keys(bert):
    reader = gguf.GGUFReader(bert[0])
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert fields["bert.pooling_type"] == gguf.PoolingType.RANK
    assert fields["bert.classifier.output_labels"] == ["LABEL_0"]
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}
    assert shapes["cls.weight"] == (64, 64) and shapes["cls.bias"] == (64,)
    assert shapes["cls.output.weight"] == (64, 1) and shapes["cls.output.bias"] == (1,)


def test_bert_reranker_scores_match_llama_cpp(tmp_path):
    # llama.cpp reads every token as segment 0: compare on a model with one token type
    hf_dir, _ = make_tiny_bert_reranker(tmp_path, type_vocab_size=1)
    path = convert_hf(hf_dir, tmp_path / "rerank1.gguf", "f32")
    with pyggml.load(path) as llm:
        pairs = [llm.runner.embedder.pair(QUERY, d)[0] for d in DOCS]
        ours, _ = llm.runner.rerank(QUERY, DOCS)
    np.testing.assert_allclose(ours, llama_cpp_rank_scores(path, pairs), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_qwen3_reranker_is_p_yes_of_the_last_token_as_in_transformers_and_llama_cpp(tmp_path, tie):
    path, model, yes, no = qwen3_reranker(tmp_path, tie)
    fields = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}
    assert fields["qwen3.pooling_type"] == gguf.PoolingType.RANK
    assert fields["qwen3.classifier.output_labels"] == ["yes", "no"]
    assert "{query}" in fields["tokenizer.chat_template.rerank"]
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert "cls.output.weight" in names and "output.weight" not in names
    with pyggml.load(path) as llm:
        pairs = [llm.runner.embedder.pair(QUERY, d)[0] for d in DOCS]
        ours, _ = llm.runner.rerank(QUERY, DOCS)
        assert pairs[0] == llm.tokenize(fields["tokenizer.chat_template.rerank"].replace("{query}", QUERY)
                                        .replace("{document}", DOCS[0]), add_special=False)
    want = []
    for ids in pairs:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        want.append(torch.softmax(logits[[yes, no]], 0)[0].item())
    np.testing.assert_allclose(ours, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ours, llama_cpp_rank_scores(path, pairs), atol=2e-3)


def test_xlm_roberta_reranker_matches_transformers_and_llama_cpp(tmp_path):
    # bge-reranker's architecture: a unigram vocabulary, pairs as <s> q </s></s> d </s>, RoBERTa's position offset
    hf_dir, model = make_tiny_xlm_roberta(tmp_path)
    path = convert_hf(hf_dir, tmp_path / "xlmr-rerank.gguf", "f32")
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    enc = tok([QUERY] * len(DOCS), DOCS, padding=True, return_tensors="pt")
    with torch.no_grad():
        want = model(**enc).logits[:, 0].numpy()
    with pyggml.load(path) as llm:
        pairs = [llm.runner.embedder.pair(QUERY, d)[0] for d in DOCS]
        ours, _ = llm.runner.rerank(QUERY, DOCS)
        assert llm.tokenize("the sun is hot") == tok("the sun is hot")["input_ids"]
    assert pairs == [ids[:int(n)].tolist() for ids, n in zip(enc["input_ids"], enc["attention_mask"].sum(1),
                                                               strict=True)]
    np.testing.assert_allclose(ours, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ours, llama_cpp_rank_scores(path, pairs), atol=2e-3)


def test_xlm_roberta_encoder_embeddings_match_transformers(tmp_path):
    hf_dir, model = make_tiny_xlm_roberta(tmp_path, reranker=False)
    path = convert_hf(hf_dir, tmp_path / "xlmr.gguf", "f32")  # no sentence-transformers config: mean pooling
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    with pyggml.load(path) as llm:
        ours = llm.embed(DOCS, normalize=False)
    for row, doc in zip(ours, DOCS, strict=True):
        with torch.no_grad():
            states = model(**tok(doc, return_tensors="pt")).last_hidden_state[0]
        np.testing.assert_allclose(row, states.mean(0).numpy(), rtol=1e-4, atol=1e-5)


def test_rerank_refuses_what_is_not_a_reranker_and_bad_input(bert, tmp_path):
    from pyggml.runner import EmbeddingsNotSupportedError
    from pyggml.synthetic import write_model

    with pyggml.load(bert[0]) as llm:
        with pytest.raises(ValueError, match="pooling is rank"):
            llm.embed("hello")
        with pytest.raises(ValueError, match="documents must be a non-empty list"):
            llm.rerank(QUERY, "just one string")
        with pytest.raises(ValueError, match="query must be a non-empty string"):
            llm.rerank("", DOCS)
        with pytest.raises(ValueError, match="top_n must be a positive int"):
            llm.rerank(QUERY, DOCS, top_n=0)
        long = " ".join(["water"] * 200)
        with pytest.raises(ValueError, match="do not fit the context of 128 tokens"):
            llm.rerank(QUERY, [long])
        assert len(llm.rerank(QUERY, [long], truncate=True)) == 1
    embedder = write_model(tmp_path / "bert.gguf", "bert")
    with pyggml.load(embedder) as llm, pytest.raises(ValueError, match="not a reranker"):
        llm.rerank(QUERY, DOCS)
    with pyggml.load(write_model(tmp_path / "llama.gguf", "llama")) as llm:
        with pytest.raises(EmbeddingsNotSupportedError, match="reranking needs a reranker"):
            llm.rerank(QUERY, DOCS)


def test_rerank_route_answers_like_llama_server(bert, tmp_path):
    pytest.importorskip("starlette", reason="needs the server extra")
    httpx = pytest.importorskip("httpx", reason="needs httpx")
    from pyggml.synthetic import write_model

    from ._server import running_server

    with pyggml.load(bert[0]) as llm:
        want = llm.rerank(QUERY, DOCS)
    with running_server(bert[0], parallel=1, num_ctx=128) as (base, served):
        def post(route, **body):
            return httpx.post(base + route, json={"model": served.name, **body}, timeout=60)

        answer = post("/v1/rerank", query=QUERY, documents=DOCS).json()
        assert [r["index"] for r in answer["results"]] == [w["index"] for w in want]
        np.testing.assert_allclose([r["relevance_score"] for r in answer["results"]],
                                   [w["relevance_score"] for w in want], rtol=1e-5)
        assert all("document" not in r for r in answer["results"])
        assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] > 0
        assert answer["model"] == served.name
        for route in ("/rerank", "/v1/reranking", "/reranking"):
            other = post(route, query=QUERY, documents=[{"text": d} for d in DOCS], top_n=2,
                         return_documents=True).json()
            assert [r["index"] for r in other["results"]] == [w["index"] for w in want[:2]]
            assert [r["document"] for r in other["results"]] == [{"text": w["document"]} for w in want[:2]]
        for body, message in [({"documents": DOCS}, "query must be a non-empty string"),
                              ({"query": QUERY, "documents": []}, "documents must be a non-empty array"),
                              ({"query": QUERY, "documents": [1]}, r"documents\[0\] must be"),
                              ({"query": QUERY, "documents": DOCS, "top_k": 2}, "unknown field 'top_k'"),
                              ({"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n")]:
            response = post("/v1/rerank", **body)
            assert response.status_code == 400 and re.search(message, response.json()["error"]["message"]), body
    with running_server(write_model(tmp_path / "e.gguf", "bert"), parallel=1, num_ctx=128) as (base, served):
        response = httpx.post(base + "/v1/rerank", json={"model": served.name, "query": QUERY, "documents": DOCS})
        assert response.status_code == 400 and response.json()["error"]["code"] == "rerank_not_supported"
