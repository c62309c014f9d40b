"""pyggml.tiny: the built-in random demo model is deterministic, well-formed and cached."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from pyggml import tiny


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PYGGML_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_two_builds_are_byte_identical(tmp_path):
    a = tiny.write_tiny_model(tmp_path / "a.gguf")
    b = tiny.write_tiny_model(tmp_path / "b.gguf")
    assert a.read_bytes() == b.read_bytes()
    assert not list(tmp_path.glob("*.tmp"))  # the temporary files were renamed into place


def test_metadata_and_tensors(cache):
    path = tiny.default_model_path()
    assert path.parent == cache and path.name == f"pyggml-tiny-random-v{tiny.TINY_VERSION}.gguf"
    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert meta["general.architecture"] == "llama"
    assert "random weights" in meta["general.name"] and "gibberish" in meta["general.name"]
    n_vocab = len(meta["tokenizer.ggml.tokens"])
    assert meta["llama.vocab_size"] == n_vocab
    assert {k: meta[f"llama.{k}"] for k in ("context_length", "embedding_length", "block_count",
                                            "feed_forward_length", "attention.head_count",
                                            "attention.head_count_kv", "rope.dimension_count")} == {
        "context_length": 512, "embedding_length": 64, "block_count": 2, "feed_forward_length": 128,
        "attention.head_count": 4, "attention.head_count_kv": 2, "rope.dimension_count": 16}
    assert meta["tokenizer.ggml.model"] == "llama"
    assert (meta["tokenizer.ggml.unknown_token_id"], meta["tokenizer.ggml.bos_token_id"],
            meta["tokenizer.ggml.eos_token_id"]) == (0, 1, 2)
    assert meta["tokenizer.ggml.add_bos_token"] is True and meta["tokenizer.ggml.add_space_prefix"] is True

    shapes = {t.name: (t.tensor_type, tuple(int(d) for d in t.shape)) for t in reader.tensors}  # ggml order
    f32 = gguf.GGMLQuantizationType.F32
    assert shapes["token_embd.weight"] == (f32, (64, n_vocab))
    assert shapes["output.weight"] == (f32, (64, n_vocab))
    assert shapes["output_norm.weight"] == (f32, (64,))
    for i in range(2):
        assert shapes[f"blk.{i}.attn_q.weight"] == (f32, (64, 64))
        assert shapes[f"blk.{i}.attn_k.weight"] == (f32, (64, 32))
        assert shapes[f"blk.{i}.attn_v.weight"] == (f32, (64, 32))
        assert shapes[f"blk.{i}.ffn_down.weight"] == (f32, (128, 64))
        assert shapes[f"blk.{i}.ffn_gate.weight"] == (f32, (64, 128))
    assert len(shapes) == 3 + 2 * 9
    assert all(np.isfinite(t.data).all() for t in reader.tensors)


def test_vocabulary_covers_any_text():
    tokens, scores, types = tiny.tiny_vocab()
    assert len(tokens) == len(scores) == len(types) == len(set(tokens))
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert tokens[3:259] == [f"<0x{b:02X}>" for b in range(256)]
    assert set(types[3:259]) == {gguf.TokenType.BYTE}
    pieces = {t for t, k in zip(tokens, types, strict=True) if k == gguf.TokenType.NORMAL}
    assert len(pieces) > 300 and "\u2581the" in pieces and "\u2581" in pieces
    # every multi-character piece can be reached by SentencePiece-style pairwise merges
    assert all(p[:-1] in pieces for p in pieces if len(p) > 1)


def test_cache_is_reused(cache, monkeypatch):
    first = tiny.default_model_path()
    stamp = first.stat().st_mtime_ns

    def must_not_rebuild(path):
        raise AssertionError("the cached model was rebuilt")

    monkeypatch.setattr(tiny, "write_tiny_model", must_not_rebuild)
    assert tiny.default_model_path() == first
    assert first.stat().st_mtime_ns == stamp


def test_cache_dir_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv("PYGGML_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tiny.cache_dir() == tmp_path / "pyggml"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tiny.cache_dir() == tmp_path / "home" / ".cache" / "pyggml"
