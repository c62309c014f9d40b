"""WordPiece (``tokenizer.ggml.model == "bert"``).

GGUF stores BERT vocabularies with a leading U+2581 on word-initial pieces and
without the ``##`` on continuations. Text is decomposed (NFD), lowercased and
stripped of accents and control characters, split at whitespace, punctuation
and CJK ideographs, and each word is covered greedily by its longest pieces;
a word that cannot be covered becomes the unknown token.

Accents are stripped as BERT does (full NFD, then drop nonspacing marks, Mn).
llama.cpp instead keeps the first code point of each character's NFD, so it
differs on Hangul syllables (it keeps only the leading jamo) and on text that
arrives already decomposed (it keeps the marks); both agree on llama.cpp's vectors.
"""

from __future__ import annotations

import unicodedata

from .base import CACHED_WORD_CHARS, Tokenizer
from .spm import SPACE
from .vocab import Vocab

# Unicode White_Space characters.
_WHITESPACE = frozenset("\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
                        "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")
_CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
               (0x2B740, 0x2B81F), (0x2B920, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


def _stands_alone(ch: str) -> bool:
    """Punctuation, ASCII symbols and CJK ideographs are words by themselves."""
    cat, cp = unicodedata.category(ch), ord(ch)
    return (cat[0] == "P" or (cp < 0x7F and cat[0] == "S")
            or any(lo <= cp <= hi for lo, hi in _CJK_RANGES))


def split_words(text: str) -> list[str]:
    """Normalise ``text`` BERT-style and cut it into words."""
    words: list[str] = []
    word: list[str] = []
    for ch in unicodedata.normalize("NFD", text):
        if ch in _WHITESPACE:
            if word:
                words.append("".join(word))
                word = []
            continue
        cat = unicodedata.category(ch)
        if ch in "\x00\ufffd" or cat in ("Cc", "Cf", "Co", "Cs", "Mn"):
            continue
        if _stands_alone(ch):
            if word:
                words.append("".join(word))
                word = []
            words.append(ch.lower())
        else:
            word.append(ch.lower())
    if word:
        words.append("".join(word))
    return words


class WordPiece(Tokenizer):
    model = "bert"
    strips_prefix_space = True

    def __init__(self, vocab: Vocab) -> None:
        super().__init__(vocab)
        self._longest = max(len(t) for t in vocab.tokens)
        self._cache: dict[str, list[int]] = {}

    def _encode_text(self, text: str, after_special: bool, out: list[int]) -> None:
        cache = self._cache
        if len(cache) > 100_000:
            cache.clear()
        for word in split_words(text):
            ids = cache.get(word)
            if ids is None:
                ids = self._pieces_of(SPACE + word)
                if len(word) <= CACHED_WORD_CHARS:
                    cache[word] = ids
            out.extend(ids)

    def _pieces_of(self, word: str) -> list[int]:
        """Cover ``word`` left to right with the longest matching tokens."""
        ids, out, start = self._ids, [], 0
        while start < len(word):
            for end in range(min(len(word), start + self._longest), start, -1):
                tid = ids.get(word[start:end])
                if tid is not None:
                    out.append(tid)
                    start = end
                    break
            else:
                return [self.vocab.unk] if self.vocab.unk is not None else []
        return out

    def _normal_piece(self, text: str) -> bytes:
        return text.replace(SPACE, " ").encode()
