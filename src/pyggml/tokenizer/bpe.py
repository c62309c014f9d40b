"""Byte-level BPE (``tokenizer.ggml.model == "gpt2"``).

Text is cut into pre-tokens by the regexes of ``tokenizer.ggml.pre``; each
pre-token's UTF-8 bytes are written with GPT-2's printable byte alphabet and
merged pair by pair, lowest ``tokenizer.ggml.merges`` rank first.

Gemma 4's BPE (``"gemma4"``) merges SentencePiece-style text instead: spaces
written as U+2581, characters as they are, one line at a time; a symbol left
without a token is spelled in ``<0xXX>`` byte tokens.
"""

from __future__ import annotations

import heapq
import re

from .base import CACHED_WORD_CHARS, Tokenizer
from .pretokenize import patterns_for, split_words
from .vocab import Vocab


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> character table: printable Latin-1 stays, the rest moves past 255."""
    kept = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, moved = [], 0
    for b in range(256):
        if b in kept:
            table.append(chr(b))
        else:
            table.append(chr(256 + moved))
            moved += 1
    return table


BYTE_TO_CHAR = _byte_alphabet()
CHAR_TO_BYTE = {ch: b for b, ch in enumerate(BYTE_TO_CHAR)}
# str.translate tables: Latin-1 text -> alphabet, and alphabet -> Latin-1 text.
# Latin-1 characters outside the alphabet map to U+FFFF so that encoding fails
# and _normal_piece falls back to plain UTF-8 for them.
_ENCODE = {b: ch for b, ch in enumerate(BYTE_TO_CHAR)}
_DECODE = {b: 0xFFFF for b in range(256)} | {ord(ch): b for ch, b in CHAR_TO_BYTE.items()}


class BytePairEncoding(Tokenizer):
    model = "gpt2"

    def __init__(self, vocab: Vocab) -> None:
        super().__init__(vocab)
        self._patterns = patterns_for(vocab.pre)
        # Keyed by the merge's own "left right" text; the first of duplicates wins.
        merges = vocab.merges
        self._ranks = dict(zip(reversed(merges), range(len(merges) - 1, -1, -1), strict=True))
        self._cache: dict[str, list[int]] = {}

    def _encode_text(self, text: str, after_special: bool, out: list[int]) -> None:
        cache = self._cache
        if len(cache) > 100_000:
            cache.clear()
        for word in split_words(text, self._patterns):
            ids = cache.get(word)
            if ids is None:
                ids = self._merge(word.encode().decode("latin-1").translate(_ENCODE))
                if len(word) <= CACHED_WORD_CHARS:
                    cache[word] = ids
            out.extend(ids)

    def _merge(self, word: str) -> list[int]:
        """Token ids of one pre-token written in the byte alphabet."""
        ids, ranks = self._ids, self._ranks
        if self.vocab.ignore_merges and word in ids:
            return [ids[word]]
        syms = list(word)
        n = len(syms)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap: list[tuple[int, int, int, str, str]] = []

        def push(left: int, right: int) -> None:
            if left >= 0 and right >= 0:
                rank = ranks.get(syms[left] + " " + syms[right])
                if rank is not None:
                    heapq.heappush(heap, (rank, left, right, syms[left], syms[right]))

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, left, right, a, b = heapq.heappop(heap)
            if syms[left] != a or syms[right] != b:
                continue  # a side was merged away or grew since this pair was queued
            syms[left], syms[right] = a + b, ""
            nxt[left] = nxt[right]
            if nxt[left] >= 0:
                prv[nxt[left]] = left
            push(prv[left], left)
            push(left, nxt[left])

        out: list[int] = []
        i = 0
        while i >= 0:
            tid = ids.get(syms[i])
            if tid is not None:
                out.append(tid)
            else:  # a merge result missing from the vocabulary: spell it out
                self._spell(syms[i], out)
            i = nxt[i]
        return out

    def _spell(self, symbol: str, out: list[int]) -> None:
        for ch in symbol:
            tid = self._ids.get(ch, self.vocab.unk)
            if tid is not None:
                out.append(tid)

    def _normal_piece(self, text: str) -> bytes:
        try:
            return text.translate(_DECODE).encode("latin-1")
        except UnicodeEncodeError:
            return b"".join(bytes([CHAR_TO_BYTE[ch]]) if ch in CHAR_TO_BYTE else ch.encode()
                            for ch in text)


SPACE = "\u2581"
_LINES = re.compile("[^\n]+|\n+")


class SpacedBytePairEncoding(BytePairEncoding):
    """Gemma 4's BPE, as llama.cpp's ``gemma4`` vocabulary (see the module docstring)."""

    model = "gemma4"

    def __init__(self, vocab: Vocab) -> None:
        Tokenizer.__init__(self, vocab)  # no pre-tokenizer regexes: lines are the words
        merges = vocab.merges
        self._ranks = dict(zip(reversed(merges), range(len(merges) - 1, -1, -1), strict=True))
        self._cache = {}
        self._bytes = [self._ids.get(f"<0x{b:02X}>") for b in range(256)]

    def _encode_text(self, text: str, after_special: bool, out: list[int]) -> None:
        cache = self._cache
        if len(cache) > 100_000:
            cache.clear()
        for line in _LINES.findall(text.replace(" ", SPACE)):
            ids = cache.get(line)
            if ids is None:
                whole = self._ids.get(line) if line[0] == "\n" else None  # a run of newlines that is one token
                ids = [whole] if whole is not None else self._merge(line)
                if len(line) <= CACHED_WORD_CHARS:
                    cache[line] = ids
            out.extend(ids)

    def _spell(self, symbol: str, out: list[int]) -> None:
        out.extend(tid for tid in (self._bytes[b] for b in symbol.encode()) if tid is not None)

    def _normal_piece(self, text: str) -> bytes:
        return text.replace(SPACE, " ").encode()
