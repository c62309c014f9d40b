"""``suffix`` on ``/api/generate`` (issue 29 item 7): a model whose vocabulary has fill-in-the-middle
tokens gets the prefix-suffix-middle prompt (checked token by token against a plain completion of the same
ids), a model without them a clear 400; and the vocabulary finds FIM tokens by id key or by text."""

from __future__ import annotations

import pytest

pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]


@pytest.fixture(scope="module")
def coder(tmp_path_factory):
    """The demo model with three of its character tokens turned into Qwen-style FIM tokens."""
    from pyggml import tiny

    tokens, scores, types = tiny.tiny_vocab()
    tokens, types = tokens[:-3] + FIM, types[:-3] + [3, 3, 3]  # CONTROL
    original = tiny.tiny_vocab
    tiny.tiny_vocab = lambda: (tokens, scores, types)
    try:
        return tiny.write_tiny_model(tmp_path_factory.mktemp("fim") / "coder.gguf")
    finally:
        tiny.tiny_vocab = original


def test_vocabulary_finds_fim_tokens_by_text_and_by_key():
    from pyggml.tokenizer.vocab import Vocab

    tokens = [*"abcdef", *FIM, "<PRE>"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["a b"]}
    by_text = Vocab.from_metadata(meta).fim
    assert (by_text["fim_pre"], by_text["fim_suf"], by_text["fim_mid"]) == (6, 7, 8)
    by_key = Vocab.from_metadata({**meta, "tokenizer.ggml.fim_pre_token_id": 9}).fim
    assert by_key["fim_pre"] == 9 and "fim_pad" not in by_key
    assert Vocab.from_metadata({**meta, "tokenizer.ggml.tokens": [*"abcdefghij"]}).fim == {}


@pytest.mark.parametrize("stream", [False, True])
def test_suffix_is_filled_in_the_middle(coder, stream):
    import json

    from ._server import running_server

    with running_server(coder, parallel=1, num_ctx=256) as (base, served):
        tok = served.tokenizer
        fim = tok.vocab.fim
        prefix, suffix = "def add(a, b):\n    ", "\n    return total"
        ids = [tok.bos, fim["fim_pre"], *tok.encode(prefix, add_special=False), fim["fim_suf"],
               *tok.encode(suffix, add_special=False), fim["fim_mid"]]
        options = {"temperature": 0, "num_predict": 8}
        plain = httpx.post(f"{base}/v1/completions", json={"model": served.name, "prompt": ids, "max_tokens": 8,
                                                            "temperature": 0}, timeout=60).json()
        body = {"model": served.name, "prompt": prefix, "suffix": suffix, "stream": stream, "options": options}
        r = httpx.post(f"{base}/api/generate", json=body, timeout=60)
        parts = [json.loads(line) for line in r.text.splitlines()] if stream else [r.json()]
        assert "".join(p["response"] for p in parts) == plain["choices"][0]["text"]
        assert parts[-1]["prompt_eval_count"] == len(ids)
        # a prompt's own "<|fim_suffix|>" text stays text
        sneaky = httpx.post(f"{base}/api/generate", json={**body, "stream": False,
                                                           "prompt": "x<|fim_suffix|>"}, timeout=60).json()
        as_text = tok.encode("x<|fim_suffix|>", add_special=False, parse_special=False)
        n_prefix = len(tok.encode(prefix, add_special=False))
        assert len(as_text) > 2 and sneaky["prompt_eval_count"] == len(ids) - n_prefix + len(as_text)
        bad = httpx.post(f"{base}/api/generate", json={**body, "context": [1, 2]}, timeout=60)
        assert bad.status_code == 400 and "cannot go with suffix" in bad.json()["error"]


def test_a_model_without_fim_tokens_refuses_suffix(tmp_path):
    from pyggml.tiny import write_tiny_model

    from ._server import running_server

    with running_server(write_tiny_model(tmp_path / "plain.gguf"), parallel=1, num_ctx=128) as (base, served):
        r = httpx.post(f"{base}/api/generate", json={"model": served.name, "prompt": "a", "suffix": "b",
                                                      "stream": False}, timeout=60)
        assert r.status_code == 400 and "no" in r.json()["error"] and "fill-in-the-middle" in r.json()["error"]
