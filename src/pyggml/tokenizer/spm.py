"""SentencePiece-style tokenizer (``tokenizer.ggml.model == "llama"``).

Text becomes a row of characters with spaces written as U+2581; neighbouring
pieces are merged while the merged text is a vocabulary token, highest score
first (leftmost on ties). Characters left without a token fall back to
``<0xXX>`` byte tokens, else to the unknown token.
"""

from __future__ import annotations

import heapq
import re

from .base import CACHED_WORD_CHARS, Tokenizer
from .vocab import Vocab

SPACE = "\u2581"
# A word: optional run of spaces then non-spaces, or a trailing run of spaces.
_WORD = re.compile(f"{SPACE}*[^{SPACE}]+|{SPACE}+")


class SentencePiece(Tokenizer):
    model = "llama"

    def __init__(self, vocab: Vocab) -> None:
        super().__init__(vocab)
        self.strips_prefix_space = self.strips_after_special = vocab.add_space_prefix
        self._byte_ids = [self._ids.get(f"<0x{b:02X}>", self._ids.get(chr(b)) if b < 128 else None)
                          for b in range(256)]
        # Merges only ever build vocabulary tokens, so when no token has a space
        # after another character, words merge independently and can be cached.
        self._by_word = not any(SPACE in t.lstrip(SPACE) for t in vocab.tokens)
        self._cache: dict[str, list[int]] = {}

    def _encode_text(self, text: str, after_special: bool, out: list[int]) -> None:
        if self.vocab.add_space_prefix and after_special:
            text = " " + text
        text = text.replace(" ", SPACE)
        if not self._by_word:
            out.extend(self._merge(text))
            return
        cache = self._cache
        if len(cache) > 100_000:
            cache.clear()
        for word in _WORD.findall(text):
            ids = cache.get(word)
            if ids is None:
                ids = self._merge(word)
                if len(word) <= CACHED_WORD_CHARS:
                    cache[word] = ids
            out.extend(ids)

    def _merge(self, text: str) -> list[int]:
        """Merge the characters of ``text`` into tokens by descending score."""
        syms: list[str] = list(text)
        n = len(syms)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        ids, scores = self._ids, self.vocab.scores
        heap: list[tuple[float, int, int, str]] = []

        def push(left: int, right: int) -> None:
            if left >= 0 and right >= 0:
                merged = syms[left] + syms[right]
                tid = ids.get(merged)
                if tid is not None:
                    heapq.heappush(heap, (-scores[tid], left, right, merged))

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            if not syms[left] or not syms[right] or syms[left] + syms[right] != merged:
                continue  # a side was merged away or grew since this pair was queued
            syms[left], syms[right] = merged, ""
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
            else:
                for b in syms[i].encode():
                    fallback = self._byte_ids[b]
                    if fallback is None:
                        fallback = self.vocab.unk
                    if fallback is not None:
                        out.append(fallback)
            i = nxt[i]
        return out

    def _normal_piece(self, text: str) -> bytes:
        return text.replace(SPACE, " ").encode()
