"""Tokenizer throughput on real vocabularies (SentencePiece, byte-level BPE, WordPiece).

    python -m pytest bench/bench_tokenizer.py --benchmark-only

Vocabularies come from ``$PYGGML_VOCAB_DIR`` (default: ``../shared/models/vocab`` beside the
repository, llama.cpp's ``ggml-vocab-*.gguf`` files); absent files skip. The corpus is this
repository's README plus the vocabularies' own test strings, about 64 KiB of prose, code and
edge cases. ``extra_info`` holds bytes/s and tokens/s.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pyggml.backend import Backend, BackendParams
from pyggml.tokenizer import from_metadata

ROOT = Path(__file__).resolve().parents[1]
VOCABS = Path(os.environ.get("PYGGML_VOCAB_DIR") or ROOT.parent / "shared" / "models" / "vocab")
NAMES = ["llama-spm", "llama-bpe", "gpt-2", "qwen2", "bert-bge"]
CORPUS_BYTES = 64 << 10


def corpus() -> str:
    parts = [(ROOT / "README.md").read_text(encoding="utf-8")]
    for inp in sorted(VOCABS.glob("ggml-vocab-*.gguf.inp")):
        parts += inp.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    text = "\n".join(parts)
    while len(text.encode()) < CORPUS_BYTES:
        text += "\n" + text
    return text.encode()[:CORPUS_BYTES].decode("utf-8", "ignore")


@pytest.fixture(scope="module", params=NAMES)
def metadata(request):
    path = VOCABS / f"ggml-vocab-{request.param}.gguf"
    if not path.is_file():
        pytest.skip(f"vocabulary {path} not found")
    with Backend.load(path, BackendParams(repack=False)) as backend:
        return backend.config


@pytest.fixture(scope="module")
def tokenizer(metadata):
    return from_metadata(metadata)


@pytest.fixture(scope="module")
def text() -> str:
    if not (ROOT / "README.md").is_file():
        pytest.skip("README.md not found")
    return corpus()


def _rates(benchmark, text: str, ids: list[int]) -> None:
    mean = benchmark.stats.stats.mean
    benchmark.extra_info.update(bytes=len(text.encode()), tokens=len(ids),
                                bytes_per_s=len(text.encode()) / mean, tokens_per_s=len(ids) / mean)


def test_encode(benchmark, tokenizer, text):
    """Steady state: the tokenizer's per-word caches are warm (as in a long-running server)."""
    ids = benchmark.pedantic(tokenizer.encode, args=(text,), rounds=5, warmup_rounds=1)
    _rates(benchmark, text, ids)


def test_encode_cold(benchmark, metadata, text):
    """A fresh tokenizer per round (built untimed): every word is merged from scratch."""
    def fresh():
        return (from_metadata(metadata), text), {}

    ids = benchmark.pedantic(lambda tok, t: tok.encode(t), setup=fresh, rounds=3)
    _rates(benchmark, text, ids)


def test_decode(benchmark, tokenizer, text):
    ids = tokenizer.encode(text)
    benchmark.pedantic(tokenizer.decode, args=(ids,), rounds=10, warmup_rounds=1)
    benchmark.extra_info.update(tokens=len(ids), tokens_per_s=len(ids) / benchmark.stats.stats.mean)
