"""Tokenizer tests: llama.cpp's published vectors, round trips, streaming,
Hugging Face agreement, bad input and speed.

The vocabulary files live in shared/models/vocab beside the repository; tests
that need them skip when it is absent. The synthetic-vocabulary tests always run.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time
from pathlib import Path

import pytest

from pyggml.tokenizer import Tokenizer, TokenType, from_metadata

try:  # tests/ is imported as a package or as a plain directory, depending on the layout
    from ._gguf_meta import read_metadata, read_metadata_reference
except ImportError:
    from _gguf_meta import read_metadata, read_metadata_reference

MODELS = Path(__file__).resolve().parents[1].parent / "shared" / "models"
VOCABS = MODELS / "vocab"
NAMES = ["llama-spm", "phi-3", "bert-bge", "gpt-2", "llama-bpe", "qwen2",
         "deepseek-llm", "deepseek-coder", "falcon", "starcoder"]

CORPUS = [
    "Hello world", " leading space", "trailing space ", "multiple   spaces  here",
    "\ttabs\tand\nnewlines\n\n", "line\r\nwindows\r\n", "   ", "\n\n\n", " \t \n ",
    "naïve café résumé", "Größe Straße Äpfel", "Ελληνικά κείμενο", "русский текст",
    "日本語のテキスト", "中文字符测试", "한국어 문장", "Cửa Việt",
    "🦙🚀😶\u200d🌫️👨\u200d👩\u200d👧\u200d👦", "👍🏽 ok ✅",
    "def f(x):\n    return x**2  # square\n", "for (int i = 0; i < n; ++i) { a[i] = b[i]; }",
    "3.14159 1,000,000 2024-01-01 0x1F 1234567890", "I'm you're he's they'll we've she'd HE'S",
    "a\u00a0b", "zero\u200bwidth", "e\u0301 combining", "!!!???...", "<html><body>x</body></html>",
    "email@example.com http://x.y/z?q=1", "x" * 300,
]


def needs_vocabs() -> None:
    if not VOCABS.is_dir():
        pytest.skip(f"vocabulary files not found at {VOCABS}")


@functools.cache
def meta(name: str) -> dict:
    return read_metadata(VOCABS / f"ggml-vocab-{name}.gguf")


@functools.cache
def tokenizer(name: str) -> Tokenizer:
    needs_vocabs()
    return from_metadata(meta(name))


def special_texts(tok: Tokenizer) -> list[str]:
    """Corpus lines with the vocabulary's control-token texts inside."""
    bos = tok.vocab.tokens[tok.bos] if tok.bos is not None else ""
    eos = tok.vocab.tokens[tok.eos] if tok.eos is not None else ""
    return [f"{bos}Hello", f"Hi{eos}", f"{bos}a{eos}there{eos}", f"x {eos}y"]


# -- llama.cpp test vectors ---------------------------------------------------

def vectors(name: str) -> list[tuple[str, list[int]]]:
    """Cases of ``<name>.gguf.inp`` with the ids of ``.out`` (format: shared/models/MANIFEST.md)."""
    base = VOCABS / f"ggml-vocab-{name}.gguf"
    cases = base.with_name(base.name + ".inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    lines = base.with_name(base.name + ".out").read_text(encoding="utf-8").split("\n")
    assert cases[-1] == ""
    return [(case, [int(x) for x in line.split()]) for case, line in zip(cases[:-1], lines, strict=False)]


@pytest.mark.parametrize("name", NAMES)
def test_llama_cpp_vectors(name: str) -> None:
    # llama.cpp's test-tokenizer-0 encodes without BOS/EOS and without parsing specials.
    tok = tokenizer(name)
    cases = vectors(name)
    assert len(cases) == 46
    wrong = [(text, expected, tok.encode(text, add_special=False, parse_special=False))
             for text, expected in cases
             if tok.encode(text, add_special=False, parse_special=False) != expected]
    assert not wrong, f"{len(wrong)} of {len(cases)} differ, first: {wrong[0]!r}"


@pytest.mark.ci_may_skip
def test_gemma4_vectors() -> None:
    """Gemma 4's ``gemma4`` vocabulary (BPE over U+2581 text, 262144 tokens): llama.cpp's cases, each decoding
    back to its text. Its file ships in the pinned llama-cpp-python sdist (vendor/llama.cpp/models/) but is
    not staged in shared/models/vocab by default (MANIFEST.md)."""
    if not (VOCABS / "ggml-vocab-gemma-4.gguf").exists():
        pytest.skip(f"ggml-vocab-gemma-4.gguf not found in {VOCABS}")
    tok = from_metadata(read_metadata(VOCABS / "ggml-vocab-gemma-4.gguf"))
    # this .inp has no separator after its last case
    texts = (VOCABS / "ggml-vocab-gemma-4.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    lines = (VOCABS / "ggml-vocab-gemma-4.gguf.out").read_text(encoding="utf-8").split("\n")
    cases = [(text, [int(x) for x in line.split()]) for text, line in zip(texts, lines, strict=False)]
    assert len(cases) == 46 and tok.vocab.model == "gemma4"
    wrong = [(text, expected, tok.encode(text, add_special=False, parse_special=False))
             for text, expected in cases
             if tok.encode(text, add_special=False, parse_special=False) != expected]
    assert not wrong, f"{len(wrong)} of {len(cases)} differ, first: {wrong[0]!r}"
    assert all(tok.decode(expected) == text for text, expected in cases)


def test_meta_matches_gguf_reader() -> None:
    needs_vocabs()
    path = VOCABS / "ggml-vocab-phi-3.gguf"  # strings, bools, ints, float and string arrays
    assert read_metadata(path) == read_metadata_reference(path)


# -- round trips, special tokens, streaming -----------------------------------

@pytest.mark.parametrize("name", [n for n in NAMES if n != "bert-bge"])
def test_round_trip(name: str) -> None:
    tok = tokenizer(name)
    for text in CORPUS + special_texts(tok):
        ids = tok.encode(text, add_special=False)
        assert tok.decode(ids) == text, (text, ids)
    for text in CORPUS:
        assert tok.decode(tok.encode(text), skip_special=True) == text


def test_round_trip_bert() -> None:
    # WordPiece normalises (lowercase, accents, spacing), so check that decoding
    # gives text that encodes to the same ids, and the normalised form of simple text.
    tok = tokenizer("bert-bge")
    for text in CORPUS:
        ids = tok.encode(text, add_special=False)
        if tok.vocab.unk not in ids:
            assert tok.encode(tok.decode(ids), add_special=False) == ids, text
    ids = tok.encode("Hello, World! Naïve")
    assert ids[0] == 101 and ids[-1] == 102
    assert tok.decode(ids, skip_special=True) == "hello , world ! naive"
    assert tok.decode(ids) == "[CLS] hello , world ! naive[SEP]"


@pytest.mark.parametrize("name", NAMES)
def test_special_tokens(name: str) -> None:
    tok = tokenizer(name)
    for tid in (tok.bos, tok.eos):
        if tid is None:
            continue
        text = tok.vocab.tokens[tid]
        assert tok.encode(f"a{text}b", add_special=False)[1:-1].count(tid) == 1
        assert tid not in tok.encode(f"a{text}b", add_special=False, parse_special=False)
        assert tok.decode([tid]) == text and tok.decode([tid], skip_special=True) == ""


@pytest.mark.parametrize(("name", "bos", "eos", "add_bos", "eog"), [
    ("llama-spm", 1, 2, True, {2}),
    ("phi-3", 1, 32000, True, {2, 32000, 32007}),  # llama.cpp counts "</s>" as end of generation
    ("gpt-2", 50256, 50256, False, {50256}),
    ("llama-bpe", 128000, 128001, True, {128001, 128009}),
    ("qwen2", 151643, 151643, False, {128247, 151643, 151645}),  # 128247 is "</s>"
    ("deepseek-coder", 32013, 32014, True, {32014}),
])
def test_bos_eos_eog(name: str, bos: int, eos: int, add_bos: bool, eog: set[int]) -> None:
    tok = tokenizer(name)
    assert (tok.bos, tok.eos) == (bos, eos)
    assert (tok.encode("Hello")[0] == bos) == add_bos
    assert tok.encode("Hello", add_special=False)[0] != bos
    assert {i for i in range(tok.vocab_size) if tok.is_eog(i)} == eog


@pytest.mark.parametrize("name", NAMES)
def test_stream_matches_decode(name: str) -> None:
    tok = tokenizer(name)
    ids = tok.encode("".join(CORPUS + special_texts(tok)))
    for skip_special in (False, True):
        stream = tok.stream(skip_special=skip_special)
        chunks = [stream.feed(i) for i in ids] + [stream.flush()]
        assert "".join(chunks) == tok.decode(ids, skip_special=skip_special)
        for chunk in chunks:
            chunk.encode("utf-8")  # no lone surrogates
            assert "\ufffd" not in chunk


def test_stream_holds_back_split_emoji() -> None:
    tok = tokenizer("llama-spm")
    ids = tok.encode("a🦙", add_special=False)
    assert [tok.token_to_piece(i) for i in ids[-4:]] == [bytes([b]) for b in "🦙".encode()]
    stream = tok.stream()
    assert [stream.feed(i) for i in ids] == ["a", "", "", "", "🦙"]
    assert stream.flush() == ""
    # a continuation keeps the space of its first word; a fresh decode drops it
    ids = tok.encode("Hello world", add_special=False)
    assert tok.decode(ids) == "Hello world"
    assert tok.decode(ids, continuation=True) == " Hello world"


def test_stream_of_cached_texts_equals_an_incremental_utf8_decoder() -> None:
    """The stream returns a decoded token's text from a cache when no UTF-8 is held back: run
    twice (cold, then every text cached) over whole tokens mixed with split and invalid bytes, it
    gives what Python's incremental UTF-8 decoder gives for the same bytes, feed by feed."""
    import codecs

    tok = tokenizer("llama-spm")
    byte = {b: tok.vocab.tokens.index(f"<0x{b:02X}>") for b in (0xE2, 0x82, 0xAC, 0xFF, 0x41)}
    words = tok.encode("Hello world, a llama", add_special=False)
    ids = [words[0], byte[0xE2], byte[0x82], words[1], byte[0xE2], byte[0x82], byte[0xAC], words[2],
           byte[0xFF], byte[0x41], words[3], byte[0xE2], *words[4:], byte[0xE2]]
    for _ in range(2):
        stream = tok.stream(continuation=True)
        reference = codecs.getincrementaldecoder("utf-8")("replace")
        assert [stream.feed(i) for i in ids] == [reference.decode(tok.token_to_piece(i)) for i in ids]
        assert stream.flush() == reference.decode(b"", final=True) == "\ufffd"


def test_token_to_piece() -> None:
    spm, bpe = tokenizer("llama-spm"), tokenizer("gpt-2")
    assert spm.token_to_piece(spm.encode("Hello", add_special=False)[0]) == b" Hello"
    assert spm.token_to_piece(spm.vocab.tokens.index("<0xAB>")) == b"\xab"
    assert bpe.token_to_piece(bpe.encode(" world", add_special=False)[0]) == b" world"


# -- Hugging Face agreement ---------------------------------------------------

# transformers builds these tokenizers from the GGUF itself. Where its conversion
# departs from llama.cpp it is not a fair reference, so those inputs are left out:
# - SPM: it adds no prefix space to text that already starts with whitespace;
# - llama3: it ignores the vocabulary's ignore_merges flag, so pre-tokens that are
#   whole vocabulary tokens but not reachable by merges (e.g. "Việt") differ.
HF_SKIP = {
    "llama-spm": lambda text: text[:1].isspace(),
    "llama-bpe": lambda text: "Việt" in text,
}


def hf_tokenizer(name: str, cache: pytest.Cache | None):
    """The ``tokenizers.Tokenizer`` that transformers builds from a vocab file.

    Converting a GGUF takes 10-60 s, so the result is kept in pytest's cache
    directory. Only the Rust tokenizer is kept and used: a saved-and-reloaded
    transformers wrapper can add steps of its own (Qwen2's adds NFC).
    """
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from tokenizers import Tokenizer as RustTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gguf = VOCABS / f"ggml-vocab-{name}.gguf"
    saved = None
    if cache is not None:
        key = f"{name}-{gguf.stat().st_size}-transformers-{transformers.__version__}.json"
        saved = cache.mkdir("hf-gguf-tokenizers") / key
        if saved.is_file():
            return RustTokenizer.from_file(str(saved))
    hf = transformers.AutoTokenizer.from_pretrained(str(VOCABS), gguf_file=gguf.name)
    if saved is not None:
        hf.backend_tokenizer.save(str(saved))
    return hf.backend_tokenizer


@pytest.mark.parametrize("name", ["llama-spm", "gpt-2", "llama-bpe", "qwen2"])
def test_matches_transformers(name: str, request: pytest.FixtureRequest) -> None:
    tok = tokenizer(name)
    hf = hf_tokenizer(name, getattr(request.config, "cache", None))
    skip = HF_SKIP.get(name, lambda text: False)
    texts = [t for t in CORPUS + [case for case, _ in vectors(name)] if not skip(t)]
    for text in texts:
        ids = tok.encode(text, add_special=False, parse_special=False)
        assert ids == hf.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=False), text


CHAT = ("<|user|>\n Hi<|end|>\n<|assistant|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|> [CLS] a [SEP] <s> b </s>")


@pytest.mark.parametrize("name", NAMES)
def test_matches_llama_cpp(name: str) -> None:
    # llama-cpp-python bundles the llama.cpp whose vectors are checked above; this
    # extends the check to BOS/EOS, special-token parsing and per-token pieces.
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    tok = tokenizer(name)
    llm = llama_cpp.Llama(model_path=str(VOCABS / f"ggml-vocab-{name}.gguf"), vocab_only=True, verbose=False)
    texts = CORPUS + special_texts(tok) + [CHAT]
    if name == "bert-bge":  # pyggml strips accents after a full NFD, as BERT does; see wpm.py
        texts = [t for t in texts if "\u0301" not in t and "한" not in t]
    for text in texts:
        for add_special in (False, True):
            for parse_special in (False, True):
                expected = llm.tokenize(text.encode(), add_bos=add_special, special=parse_special)
                assert tok.encode(text, add_special, parse_special) == expected, (text, add_special, parse_special)
    vocab, buf = llm._model.vocab, ctypes.create_string_buffer(1024)
    for i in range(tok.vocab_size):
        n = llama_cpp.llama_token_to_piece(vocab, i, buf, len(buf), 0, True)
        assert tok.token_to_piece(i) == buf.raw[:n], i
        assert tok.is_eog(i) == llama_cpp.llama_vocab_is_eog(vocab, i), i


# -- synthetic vocabularies and bad input (no files needed) -------------------

def tiny_spm() -> dict:
    """Nine-token SentencePiece vocabulary with byte fallback for 'é' (0xC3 0xA9)."""
    tokens = ["<unk>", "<s>", "</s>", "▁", "▁a", "b", "▁ab", "<0xC3>", "<0xA9>"]
    types = [2, 3, 3, 1, 1, 1, 1, 6, 6]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": [0.0, 0, 0, -3, -2, -3, -1, 0, 0]}


def test_tiny_spm() -> None:
    tok = from_metadata(tiny_spm())
    assert tok.model == "llama" and tok.vocab_size == 9
    assert tok.encode("ab") == [1, 6]
    assert tok.encode("ab é", add_special=False) == [6, 3, 7, 8]
    assert tok.decode([1, 6, 3, 7, 8]) == "<s>ab é"
    assert tok.decode([6, 3, 7]) == "ab \ufffd"
    assert tok.encode("c", add_special=False) == [3, 0]  # no byte token for 'c': unknown


def test_tiny_spm_merges_across_words() -> None:
    # a token with a space inside ("a▁b") stops the per-word shortcut
    meta = tiny_spm()
    meta["tokenizer.ggml.tokens"] = ["<unk>", "<s>", "</s>", "▁", "a", "b", "▁a", "a▁", "a▁b"]
    meta["tokenizer.ggml.scores"] = [0.0, 0, 0, -5, -5, -5, -2, -1, -0.5]
    meta["tokenizer.ggml.token_type"] = [2, 3, 3, 1, 1, 1, 1, 1, 1]
    tok = from_metadata(meta)
    assert tok.encode("a b", add_special=False) == [3, 8]
    assert tok.decode([3, 8]) == "a b"


def test_tiny_bpe() -> None:
    tokens = ["a", "b", "Ġ", "ab", "Ġab", "<|end|>", "<u>"]
    tok = from_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
                         "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1] * 5 + [3, 4],
                         "tokenizer.ggml.merges": ["a b", "Ġ ab"], "tokenizer.ggml.eos_token_id": 5})
    assert tok.model == "gpt2" and tok.bos is None
    assert tok.encode("ab ab<|end|>") == [3, 4, 5]
    assert tok.encode("ab", add_special=False) == [3] and tok.eos == 5 and tok.is_eog(5)
    assert tok.decode([3, 4, 5]) == "ab ab<|end|>"
    # user-defined tokens are split out even without parse_special; control ones are not
    assert tok.encode("a<u>b<|end|>", parse_special=False)[:3] == [0, 6, 1]
    assert 5 not in tok.encode("a<u>b<|end|>", parse_special=False)


@pytest.mark.parametrize(("meta_", "message"), [
    ({"tokenizer.ggml.model": "ugm", "tokenizer.ggml.tokens": ["a"]}, "'ugm'"),
    ({"tokenizer.ggml.tokens": ["a"]}, "tokenizer.ggml.model"),
    ({"tokenizer.ggml.model": "llama"}, "tokenizer.ggml.tokens"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"]}, "merges"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.merges": ["a a"],
      "tokenizer.ggml.pre": "no-such-pre"}, "'no-such-pre'"),
])
def test_bad_metadata(meta_: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        from_metadata(meta_)


@pytest.mark.parametrize("cached", [False, True])
def test_bad_ids(cached: bool) -> None:
    tok = from_metadata(tiny_spm())
    if cached:  # every id's bytes and text cached (by id): a bad id still finds none
        tok.decode(list(range(tok.vocab_size)))
    normal = [i for i, t in enumerate(tok.vocab.types) if t == TokenType.NORMAL]
    for bad in (-1, normal[-1] - tok.vocab_size, 9, 10**9, "1", None, 2.0):
        with pytest.raises(ValueError, match="out of range"):
            tok.decode([1, bad])
        with pytest.raises(ValueError, match="out of range"):
            tok.token_to_piece(bad)
        with pytest.raises(ValueError, match="out of range"):
            tok.stream(continuation=True).feed(bad)
    assert TokenType(tok.vocab.types[7]) is TokenType.BYTE


# -- speed --------------------------------------------------------------------

def test_speed() -> None:
    import pydoc_data.topics

    needs_vocabs()
    start = time.perf_counter()
    from_metadata(meta("qwen2"))
    assert time.perf_counter() - start < 2.0, "loading a 152k-token vocabulary"
    text = "\n".join(pydoc_data.topics.topics.values())[:100_000]
    tok = from_metadata(meta("llama-bpe"))  # fresh, so no cached words
    start = time.perf_counter()
    ids = tok.encode(text)
    assert time.perf_counter() - start < 10.0, "encoding 100 kB with the 128k llama3 vocabulary"
    assert tok.decode(ids, skip_special=True) == text
