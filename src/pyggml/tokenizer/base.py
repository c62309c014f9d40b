"""What every tokenizer shares: special-token splitting, BOS/EOS, decoding, streaming.

Subclasses supply ``_encode_text`` (plain text between special tokens -> ids) and
``_normal_piece`` (bytes of an ordinary token). Encoding follows llama.cpp, whose
published test vectors are the reference.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import ClassVar

from .vocab import SPECIAL_TYPES, TokenType, Vocab

# (a token type's enum member read once here: ``TokenType.BYTE`` in a function costs an enum lookup per call)
_BYTE, _UNUSED, _USER_DEFINED = TokenType.BYTE, TokenType.UNUSED, TokenType.USER_DEFINED
_NO_ID = object()  # token_to_piece: the id is not one of this vocabulary's

_ASCII_SPACE = " \t\n\v\f\r"
# Tokenizers cache the ids of the words they have seen (at most 100,000); only words up to this
# length, so that what a server keeps after many prompts stays small whatever they contained.
CACHED_WORD_CHARS = 64


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary."""

    model: ClassVar[str]  # the tokenizer.ggml.model value it implements
    # Decoding drops the space that encoding put in front of the text (SentencePiece,
    # WordPiece) and, for SentencePiece, in front of text after a special token.
    strips_prefix_space: bool = False
    strips_after_special: bool = False
    # ``add_sep`` ends an encoded text with SEP (BERT's); a unigram vocabulary uses it only to join pairs
    appends_sep: ClassVar[bool] = True

    def __init__(self, vocab: Vocab) -> None:
        self.vocab = vocab
        self.bos, self.eos = vocab.bos, vocab.eos
        self.vocab_size = len(vocab.tokens)
        self._ids = {text: i for i, text in enumerate(vocab.tokens)}
        self._types = vocab.types
        # by id, filled as tokens are decoded: lists, not dicts, as a decode step looks up an id per sequence and
        # a list entry is one memory read where a dict's is three (hash slot, entry, key), most of them cache misses
        self._pieces: list[bytes | None] = [None] * self.vocab_size
        self._texts: list[str | None] = [None] * self.vocab_size  # ordinary tokens whole in UTF-8 (StreamDecoder)
        specials = [i for i, t in enumerate(vocab.types) if t in SPECIAL_TYPES and vocab.tokens[i]]
        self._specials = sorted(specials, key=lambda i: -len(vocab.tokens[i].encode()))
        self._lstrip, self._rstrip = self._strip_attributes()

    def _strip_attributes(self) -> tuple[frozenset[int], frozenset[int]]:
        """Specials that swallow whitespace on their left/right (llama.cpp's per-model list)."""
        v = self.vocab
        if any(p in v.pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) and "<mask>" in self._ids:
            return frozenset({self._ids["<mask>"]}), frozenset()
        if "phi-3" in v.name or "phi3" in v.name:
            keep = {self._ids.get(t) for t in ("<unk>", "<s>", "<|endoftext|>")}
            return frozenset(), frozenset(i for i in self._specials if i not in keep)
        if "modern-bert" in v.name and "[MASK]" in self._ids:
            return frozenset({self._ids["[MASK]"]}), frozenset()
        return frozenset(), frozenset()

    # -- encoding ---------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``.

        ``add_special`` adds BOS/EOS (CLS/SEP for BERT) as the vocabulary asks;
        ``parse_special`` turns the texts of control tokens into those tokens
        (user-defined tokens are always recognised, as in llama.cpp).
        """
        v = self.vocab
        out: list[int] = []
        if add_special and v.add_bos and v.bos is not None:
            out.append(v.bos)
        after_special = True
        for fragment in self._split_special(text, parse_special):
            if isinstance(fragment, int):
                out.append(fragment)
                after_special = True
            else:
                self._encode_text(fragment, after_special, out)
                after_special = False
        if add_special and v.add_eos and v.eos is not None:
            out.append(v.eos)
        if add_special and self.appends_sep and v.add_sep and v.sep is not None:
            out.append(v.sep)
        return out

    def _encode_text(self, text: str, after_special: bool, out: list[int]) -> None:
        raise NotImplementedError

    def _split_special(self, text: str, parse_special: bool) -> list[str | int]:
        """Cut the texts of special tokens out of ``text``, longest token first."""
        fragments: list[str | int] = [text] if text else []
        for tid in self._specials:
            if not parse_special and self._types[tid] != TokenType.USER_DEFINED:
                continue
            special = self.vocab.tokens[tid]
            if special not in text:
                continue
            split: list[str | int] = []
            for frag in fragments:
                if isinstance(frag, int) or special not in frag:
                    split.append(frag)
                    continue
                parts = frag.split(special)
                for k, part in enumerate(parts):
                    if k > 0:
                        split.append(tid)
                        if tid in self._rstrip:
                            part = part.lstrip(_ASCII_SPACE)
                    if k < len(parts) - 1 and tid in self._lstrip:
                        part = part.rstrip(_ASCII_SPACE)
                    if part:
                        split.append(part)
            fragments = split
        return fragments

    # -- decoding ---------------------------------------------------------

    def token_to_piece(self, id: int) -> bytes:
        """The raw bytes token ``id`` stands for (special tokens give their text)."""
        try:
            piece = self._pieces[id] if id >= 0 else _NO_ID
        except (IndexError, TypeError):
            piece = _NO_ID
        if piece is None:  # an id of this vocabulary, not decoded yet (a runner decodes most tokens once)
            ttype, text = self._types[id], self.vocab.tokens[id]
            if ttype == _BYTE and len(text) == 6 and text.startswith("<0x"):
                piece = bytes([int(text[3:5], 16)])
            elif ttype in SPECIAL_TYPES:
                piece = text.encode()
            elif ttype == _UNUSED:
                piece = b""
            else:
                piece = self._normal_piece(text)
            self._pieces[id] = piece
        elif piece is _NO_ID:
            raise self._bad_id(id)
        return piece

    def _normal_piece(self, text: str) -> bytes:
        raise NotImplementedError

    def _bad_id(self, id: object) -> ValueError:
        """The error for ``id``, which is not a token id of this vocabulary (out of range, or not an int)."""
        return ValueError(f"token id {id!r} is out of range: this vocabulary's ids are the ints "
                          f"0..{self.vocab_size - 1}")

    def decode(self, ids: Sequence[int], skip_special: bool = False,
               continuation: bool = False) -> str:
        """Text of ``ids``; ``skip_special`` leaves out control and unknown tokens.

        The space that encoding puts in front of the text (SentencePiece, WordPiece)
        is removed unless ``continuation`` says the ids continue earlier text.
        """
        stream = self.stream(skip_special, continuation)
        return "".join([stream.feed(i) for i in ids]) + stream.flush()

    def stream(self, skip_special: bool = False, continuation: bool = False) -> StreamDecoder:
        """An incremental decoder whose pieces join to ``decode(ids)``."""
        return StreamDecoder(self, skip_special, continuation)

    def is_eog(self, id: int) -> bool:
        """True for tokens that end generation (EOS, EOT, EOM and end-of-turn texts)."""
        return id in self.vocab.eog

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.model}/{self.vocab.pre} {self.vocab_size} tokens>"


class StreamDecoder:
    """Turns ids into text one at a time, holding back incomplete UTF-8 sequences."""

    # (slots: a runner feeds one per sequence each step; what ``feed`` reads sits in one or two cache lines)
    __slots__ = ("_held", "_strip", "_texts", "_tok", "_skip_special", "_utf8")

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False,
                 continuation: bool = False) -> None:
        self._tok = tokenizer
        self._texts = tokenizer._texts
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._strip = tokenizer.strips_prefix_space and not continuation
        self._held = False  # whether the UTF-8 decoder holds the first bytes of a character

    def feed(self, id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        if not self._held and not self._strip:  # the usual token: its text, cached once decoded
            try:
                text = self._texts[id] if id >= 0 else None
            except (IndexError, TypeError):  # not an id of this vocabulary: token_to_piece says why
                text = None
            if text is not None:
                return text
        tok = self._tok
        piece = tok.token_to_piece(id)
        ttype = tok._types[id]
        if ttype in SPECIAL_TYPES:
            if self._skip_special and ttype != _USER_DEFINED:
                piece = b""
            if tok.strips_after_special:
                self._strip = True
            elif piece:
                self._strip = False
        else:
            if self._texts[id] is None:
                try:  # whole UTF-8 on its own: with nothing held back, its text is what decoding gives
                    text = self._texts[id] = piece.decode()
                except UnicodeDecodeError:
                    pass
                else:
                    if not self._held and not self._strip:  # (the decoder would hold nothing either)
                        return text
            if self._strip and piece.startswith(b" "):
                piece = piece[1:]
            self._strip = False
        text = self._utf8.decode(piece)
        self._held = bool(self._utf8.getstate()[0])
        return text

    def flush(self) -> str:
        """Return what is still held back (incomplete bytes become U+FFFD)."""
        self._held = False
        return self._utf8.decode(b"", final=True)
