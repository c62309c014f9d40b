"""Byte-level BPE pre-tokenizers (``tokenizer.ggml.pre``) checked against llama.cpp itself.

Each case copies a real vocabulary file with only ``tokenizer.ggml.pre`` changed, then
tokenizes the same texts with pyggml and with llama.cpp (llama-cpp-python, ``vocab_only``):
the ids must be equal. The vocabularies have multi-digit, whitespace-run and
space-prefixed tokens, so a pre-token cut in a different place shows in the ids.
"""

from __future__ import annotations

import functools
import struct
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from pyggml.tokenizer import from_metadata
from pyggml.tokenizer.bpe import BYTE_TO_CHAR
from pyggml.tokenizer.pretokenize import patterns_for, split_words

try:  # tests/ is imported as a package or as a plain directory, depending on the layout
    from ._gguf_meta import read_metadata
    from .conftest import SHARED_MODELS
except ImportError:
    from _gguf_meta import read_metadata
    from conftest import SHARED_MODELS

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed")

VOCABS = SHARED_MODELS / "vocab"

# pre types added for llama.cpp parity, then some that were there before, as a control
ADDED = [
    "deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4", "spark2_5", "afmoe", "youtu", "tiny_aya",
    "cohere2moe", "tekken", "granite-embed-multi-97m", "kimi-k2", "jais-2", "minicpm5", "ufakzeka",
    "seed-coder", "bailingmoe", "llada-moe", "laguna", "exaone-moe", "superbpe",
    "chameleon", "grok-2", "hunyuan", "solar-open", "minimax-m2", "kanana2", "talkie",
]
CONTROLS = ["llama-bpe", "qwen2", "deepseek-llm", "deepseek-coder", "gpt-2", "starcoder", "qwen35", "gpt-4o"]

HOSTILE = [
    "中文123数字4567和汉字", "日本語のテキスト、カタカナ１２３", "価格は1234567円です。",
    "1234567", "12345678901234567890", " 1 12 123 1234 12345", "3.14159 1,000,000 2024-01-01 0x1F",
    "١٢٣٤٥ ۱۲۳ ١٢", "x²1234 ½123 ٣12345 1² 12٣4567", "Ⅻ ⅷ ½ ² 𝟘𝟙𝟚",
    "🦙🚀😶\u200d🌫️👨\u200d👩\u200d👧\u200d👦", "👍🏽 ok ✅ 🇫🇷!", "a😀b 😀😀 :-)",
    "café naïve ", "ÀÉÎÕÜ àéîõü Ǆǅǆ ﬁ ẞß",
    "I'M YOU'RE HE'S THEY'LL WE'VE SHE'D I'm it's", "don't DON'T Don'T o'clock rock'n'roll ''s",
    "tabs\tand\nnewlines\n\n\r\n \t \n  \n\n   x", "  leading\n\n\n\ttrailing  \t ", "\n", " ", "\t\t\n ",
    "a\u00a0b\u2003c\u3000d\u202fe \u0085f", "zero\u200bwidth\u200djoin\u2060x",
    "!!!???... --- ***", "((([[[{{{}}}]]])))", "...,,,;;;:::", "<html><body>x</body></html>",
    "email@example.com http://x.y/z?q=1&r=2#f", "#include <stdio.h>\nint main(){return 0;}",
    "def f(x):\n    return x**2  # square\n\tpass", "a+b=c; x->y => z != w",
    "한국어 문장입니다. 한글123", "ภาษาไทยเป็นภาษาที่สวยงาม", "हिन्दी भाषा में लिखा गया",
    "Ελληνικά κείμενο ΚΕΊΜΕΝΟ", "русский ТЕКСТ Текст", "עברית والعربية", "Cửa Việt Nam",
    "HelloWorld helloWORLD HELLOworld hELLO", "ABCdefGHI jklMNO", "x" * 100, " " * 17 + "y",
    "«quoted» “curly” ‘single’ — dash … ellipsis", "ＦＵＬＬ ｗｉｄｔｈ １２３ ！？",
    "$100 €200 ¥300 £400 +5 -6 ^7 ~8 |9| `10`", "<sentinel:12> IMGIMGABZ IMGIMGAAAAAZ",
    "ab   1234 and\t\t56789 x  123\n  4", "ꆈꌠꁱ ꂷꃅ ㄅㄆㄇ ㄱㄴ", "Ankara'dan İstanbul'a don'tx it'sy WE'REx",
]
# Case changes inside non-ASCII words and combining marks: llama.cpp's regex engine knows only
# ASCII case and reads o200k's letter classes without the marks; the pre types added here follow
# it, but pyggml's gpt-4o follows o200k's own tokenizer.json (tests/test_gptoss.py checks it
# against transformers), so these are not compared for it.
ENGINE_TEXTS = ["камеРА ÀbÇd ñÑñÑ ΑβΓδ", "cafe\u0301 re\u0301sume\u0301 nai\u0308ve"]


def llama_cpp_cases() -> list[str]:
    """The texts of llama.cpp's tokenizer test vectors (the ``.inp`` beside the vocabularies)."""
    inp = VOCABS / "ggml-vocab-llama-bpe.gguf.inp"
    if not inp.is_file():
        return []
    cases = inp.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    return cases[:-1]


O200K_PRE = {"gpt-4o", "llama4", "minimax-m2", "kanana2", "talkie"}


def texts(pre: str) -> list[str]:
    return llama_cpp_cases() + HOSTILE + ([] if pre in O200K_PRE else ENGINE_TEXTS)


# -- copying a GGUF vocabulary with another tokenizer.ggml.pre ---------------

def _read(f: BinaryIO, fmt: str) -> Any:
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def _value(f: BinaryIO, vtype: Any) -> Any:
    if vtype == gguf.GGUFValueType.STRING:
        return f.read(_read(f, "<Q")).decode("utf-8")
    if vtype == gguf.GGUFValueType.ARRAY:
        etype = gguf.GGUFValueType(_read(f, "<I"))
        return [_value(f, etype) for _ in range(_read(f, "<Q"))]
    return _read(f, _FORMATS[vtype])


@functools.cache
def _typed_fields(path: Path) -> tuple[int, list[tuple[str, Any, Any, Any]]]:
    """Tensor count and the (key, type, element type, value) fields of a GGUF file, in order.

    (``gguf.GGUFReader`` gives the same but takes ~20 s on a 128k-token vocabulary.)
    """
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF" and _read(f, "<I") >= 2
        n_tensors, n_kv = _read(f, "<Q"), _read(f, "<Q")
        fields = []
        for _ in range(n_kv):
            key = f.read(_read(f, "<Q")).decode("utf-8")
            vtype = gguf.GGUFValueType(_read(f, "<I"))
            start = f.tell()
            etype = gguf.GGUFValueType(_read(f, "<I")) if vtype == gguf.GGUFValueType.ARRAY else None
            f.seek(start)
            fields.append((key, vtype, etype, _value(f, vtype)))
    return n_tensors, fields


def with_pre(src: Path, dst: Path, pre: str, changed: dict[str, Any] | None = None) -> Path:
    """Write ``src`` to ``dst`` with ``tokenizer.ggml.pre`` set to ``pre`` and the ``changed`` values,
    every other key as it was."""
    n_tensors, fields = _typed_fields(src)
    assert n_tensors == 0, f"{src.name}: a vocabulary file with tensors is not expected here"
    changed = {**(changed or {}), "tokenizer.ggml.pre": pre}
    values = {key: value for key, _, _, value in fields}
    writer = gguf.GGUFWriter(dst, values["general.architecture"])
    for key, vtype, etype, value in fields:
        if key == "general.architecture":
            continue  # the writer adds it
        writer.add_key_value(key, changed.get(key, value), vtype, etype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


_FORMATS = {
    gguf.GGUFValueType.UINT8: "<B", gguf.GGUFValueType.INT8: "<b", gguf.GGUFValueType.UINT16: "<H",
    gguf.GGUFValueType.INT16: "<h", gguf.GGUFValueType.UINT32: "<I", gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.UINT64: "<Q", gguf.GGUFValueType.INT64: "<q", gguf.GGUFValueType.FLOAT32: "<f",
    gguf.GGUFValueType.FLOAT64: "<d", gguf.GGUFValueType.BOOL: "<?",
}


def revealing_keys(src: Path, pre: str, texts: list[str]) -> dict[str, Any]:
    """Vocabulary keys that make pyggml's pre-token cuts show in the ids.

    A real vocabulary has no merge across most cuts, so a cut in another place often gives the
    same ids. Merges put first here build each of pyggml's pre-tokens into one token, and join
    each two neighbours into one more: where llama.cpp cuts elsewhere, a pre-token is left
    unbuilt or two are joined, and its ids differ.
    """
    patterns = patterns_for(pre)
    tokens = list(_field(src, "tokenizer.ggml.tokens"))
    known = set(tokens)
    merges: list[str] = []

    def merge(left: str, right: str) -> None:
        merges.append(f"{left} {right}")
        if left + right not in known:
            known.add(left + right)
            tokens.append(left + right)

    for text in texts:
        words = ["".join(BYTE_TO_CHAR[b] for b in w.encode()) for w in split_words(text, patterns)]
        for word in words:
            for i in range(1, len(word)):
                merge(word[:i], word[i])
        for left, right in zip(words, words[1:], strict=False):
            merge(left, right)
    n = len(tokens)
    changed = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges + _field(src, "tokenizer.ggml.merges")}
    for key, fill in (("tokenizer.ggml.token_type", 1), ("tokenizer.ggml.scores", 0.0)):  # NORMAL, no score
        if (old := _field(src, key)) is not None:
            changed[key] = old + [fill] * (n - len(old))
    changed |= {key: n for key, _, _, _ in _typed_fields(src)[1] if key.endswith(".vocab_size")}
    return changed


def _field(src: Path, key: str) -> Any:
    return next((value for k, _, _, value in _typed_fields(src)[1] if k == key), None)


def check_pre(vocab: str, pre: str, tmp_path: Path, *, reveal: bool = False) -> None:
    """pyggml and llama.cpp give the same ids for every test text under ``pre``; with ``reveal``, in
    a vocabulary where every cut shows (``revealing_keys``)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    src = VOCABS / f"ggml-vocab-{vocab}.gguf"
    if not src.is_file():
        pytest.skip(f"vocabulary file not found: {src}")
    changed = revealing_keys(src, pre, texts(pre)) if reveal else None
    path = with_pre(src, tmp_path / f"{vocab}-{pre}.gguf", pre, changed)
    try:
        meta = read_metadata(path)
        assert meta["tokenizer.ggml.pre"] == pre
        tok = from_metadata(meta)
        ref = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
        mismatches = []
        for text in texts(pre):
            expected = ref.tokenize(text.encode(), add_bos=False, special=False)
            got = tok.encode(text, add_special=False, parse_special=False)
            if got != expected:
                mismatches.append((text, got, expected))
        assert not mismatches, f"{len(mismatches)} texts differ, first: {mismatches[0]}"
        # BOS: where the file has no tokenizer.ggml.add_bos_token (gpt-2, llama-bpe), the type decides
        assert tok.encode("Hi", add_special=True) == ref.tokenize(b"Hi", add_bos=True, special=False)
    finally:
        path.unlink()


@pytest.mark.ci_may_skip  # the vocabulary files (shared/models/vocab) may be absent
@pytest.mark.parametrize("pre", ADDED + CONTROLS)
def test_pre_matches_llama_cpp(pre: str, tmp_path: Path) -> None:
    check_pre("llama-bpe", pre, tmp_path)


@pytest.mark.ci_may_skip
@pytest.mark.parametrize("pre", ADDED + CONTROLS)
def test_pre_cuts_match_llama_cpp(pre: str, tmp_path: Path) -> None:
    check_pre("gpt-2", pre, tmp_path, reveal=True)


@pytest.mark.ci_may_skip
@pytest.mark.parametrize("pre", ["deepseek-v3", "deepseek-llm"])
def test_pre_matches_llama_cpp_deepseek_vocab(pre: str, tmp_path: Path) -> None:
    check_pre("deepseek-llm", pre, tmp_path)


def test_unknown_pre_is_refused_by_name() -> None:
    vocab = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "no-such-pre",
             "tokenizer.ggml.tokens": ["a", "b", "ab"], "tokenizer.ggml.merges": ["a b"]}
    with pytest.raises(ValueError, match=r"unsupported tokenizer.ggml.pre 'no-such-pre' \(supported: .*deepseek-v3"):
        from_metadata(vocab)


@pytest.mark.parametrize(("pre", "reference"), [
    # the tokenizer.json's own lookahead, which llama.cpp runs (time quadratic in a digit run)
    ("superbpe", [r"\p{N}+", "(?=(?:[0-9]{3})+(?![0-9]))"]),
    # llama.cpp's AFMoE digit splitter, as one lookahead per group
    ("afmoe", [r"(?:^|(?<=\p{N}))\P{N}*\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"]),
])
def test_linear_digit_groups_cut_as_the_lookahead(pre: str, reference: list[str]) -> None:
    """The linear-time digit patterns cut where their plainer quadratic forms do (no llama.cpp needed)."""
    import random

    import regex

    rng = random.Random(0)
    ours = patterns_for(pre)[:len(reference)]
    plain = [regex.compile(p) for p in reference]
    for _ in range(20_000):
        text = "".join(rng.choice("0123456789٣²½a \n") if rng.random() < 0.4 else rng.choice("0123")
                       for _ in range(rng.randint(0, 16)))
        assert split_words(text, ours) == split_words(text, plain), text
