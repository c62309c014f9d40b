"""Unigram tokenizer (``tokenizer.ggml.model == "t5"``: SentencePiece's unigram model as T5, XLM-RoBERTa,
bge-m3 and bge-reranker use it), as llama.cpp runs it.

Text is first normalised: each prefix found in the file's ``precompiled_charsmap`` (SentencePiece's
normalisation table: a double-array trie of byte strings and their replacements) is replaced, runs of
spaces are merged, a space is put before each word and spaces are written as U+2581. Then the
segmentation with the highest sum of token scores wins (Viterbi over the characters); a character no
token covers is the unknown token (consecutive ones merged), scored below every real token.
"""

from __future__ import annotations

import struct

from .spm import SPACE, SentencePiece
from .vocab import TokenType, Vocab


class Charsmap:
    """SentencePiece's precompiled normalisation map: a 4-byte size, an XOR-compressed double-array trie
    over UTF-8 bytes (one packed uint32 per node), then NUL-terminated replacement strings."""

    def __init__(self, blob: bytes):
        if len(blob) < 4:
            raise ValueError("tokenizer.ggml.precompiled_charsmap is too short")
        (size,) = struct.unpack_from("<I", blob)
        if not size or size % 4 or 4 + size >= len(blob):  # the root node is read first: none is no map
            raise ValueError("tokenizer.ggml.precompiled_charsmap: its trie is empty or does not fit the blob")
        self.nodes = struct.unpack_from(f"<{size // 4}I", blob, 4)
        self.strings = blob[4 + size:]

    def longest_prefix(self, data: bytes, start: int) -> tuple[int, bytes]:
        """(bytes matched, replacement) of the longest key that ``data[start:]`` begins with; (0, b"") if none."""
        nodes, best, replacement_at = self.nodes, 0, 0
        node = self._base(0)
        for i in range(start, len(data)):
            c = data[i]
            if c == 0:
                break
            node ^= c
            if node >= len(nodes) or nodes[node] & 0x800000FF != c:  # not a child labelled c
                break
            leaf = (nodes[node] >> 8) & 1
            node ^= self._base(node)
            if leaf:
                if node >= len(nodes):
                    break
                best, replacement_at = i - start + 1, nodes[node] & 0x7FFFFFFF
        if not best:
            return 0, b""
        if replacement_at >= len(self.strings):
            raise ValueError("tokenizer.ggml.precompiled_charsmap points past its strings")
        end = self.strings.find(b"\0", replacement_at)
        return best, self.strings[replacement_at:end if end >= 0 else None]

    def _base(self, index: int) -> int:
        packed = self.nodes[index]
        return (packed >> 10) << ((packed & (1 << 9)) >> 6)


class Unigram(SentencePiece):
    model = "t5"
    appends_sep = False  # as llama.cpp: SEP only joins a reranker's query and document

    def __init__(self, vocab: Vocab) -> None:
        super().__init__(vocab)
        self.strips_prefix_space = vocab.add_space_prefix
        self.strips_after_special = False
        self.charsmap = Charsmap(vocab.precompiled_charsmap) if vocab.precompiled_charsmap else None
        self.merge_spaces = vocab.remove_extra_whitespaces
        matchable = (TokenType.NORMAL, TokenType.USER_DEFINED, TokenType.UNUSED)
        self._pieces_ids = {t: i for i, (t, k) in enumerate(zip(vocab.tokens, vocab.types, strict=True))
                            if k in matchable and t}
        self._user = sorted((t for t, k in zip(vocab.tokens, vocab.types, strict=True)
                             if k == TokenType.USER_DEFINED and t), key=len, reverse=True)
        self._user_ids = {t for t in self._user}
        self._longest = max((len(t) for t in self._pieces_ids), default=1)
        normal = [s for s, k in zip(vocab.scores, vocab.types, strict=True) if k == TokenType.NORMAL]
        self._unknown_score = (min(normal) if normal else 0.0) - 10.0

    def _encode_text(self, text: str, after_special: bool, out: list[int]) -> None:
        out.extend(self._viterbi(self._normalize(text)))

    def _normalize(self, text: str) -> str:
        """The charsmap's replacements, then whitespace as llama.cpp's UGM tokenizer treats it."""
        data, pieces, i = text.encode(), [], 0
        while i < len(data):
            user = next((u for u in self._user if data.startswith(u.encode(), i)), None)
            if user is not None:
                pieces.append(user)
                i += len(user.encode())
                continue
            n, replacement = self.charsmap.longest_prefix(data, i) if self.charsmap else (0, b"")
            if n:
                pieces.append(replacement.decode("utf-8", "replace"))
                i += n
                continue
            width = _utf8_width(data[i])  # ``data`` is valid UTF-8: it came from a str
            pieces.append(data[i:i + width].decode())
            i += width
        out, in_word, spaced = [], False, False
        for c in "".join(pieces):
            if c != " ":
                if not in_word:
                    in_word = True
                    if (self.vocab.add_space_prefix and not spaced) or self.merge_spaces:
                        out.append(SPACE)
                        spaced = True
                out.append(c)
            else:
                in_word = False
                if not self.merge_spaces:
                    out.append(SPACE)
        return "".join(out)

    def _viterbi(self, text: str) -> list[int]:
        """The highest-scoring segmentation of ``text`` into tokens (unknown characters: the unknown token)."""
        n, ids, scores, unk = len(text), self._pieces_ids, self.vocab.scores, self.vocab.unk
        if not n:
            return []
        best = [float("-inf")] * (n + 1)
        back: list[tuple[int, int | None]] = [(0, unk)] * (n + 1)
        best[0] = 0.0
        for start in range(n):
            if best[start] == float("-inf"):
                continue
            covered = False
            for end in range(start + 1, min(n, start + self._longest) + 1):
                tid = ids.get(text[start:end])
                if tid is None:
                    continue
                covered |= end == start + 1
                score = best[start] + (0.0 if text[start:end] in self._user_ids else scores[tid])
                if score > best[end]:
                    best[end], back[end] = score, (start, tid)
            if not covered and best[start] + self._unknown_score > best[start + 1]:
                best[start + 1], back[start + 1] = best[start] + self._unknown_score, (start, unk)
        out: list[int] = []
        end, previous_unknown = n, False
        while end > 0:
            start, tid = back[end]
            unknown = tid == unk
            if not (unknown and previous_unknown) and tid is not None:
                out.append(tid)
            previous_unknown, end = unknown, start
        return out[::-1]


def _utf8_width(lead: int) -> int:
    return 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
