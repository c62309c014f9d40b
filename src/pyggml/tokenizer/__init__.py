"""Text <-> token ids from the ``tokenizer.ggml.*`` keys of a GGUF file.

    tok = from_metadata(meta)          # meta: GGUF key -> plain Python value
    ids = tok.encode("Hello world")    # BOS/EOS as the vocabulary asks
    tok.decode(ids, skip_special=True) == "Hello world"

Five vocabulary types, by ``tokenizer.ggml.model``: ``llama`` (SentencePiece),
``gpt2`` (byte-level BPE with the pre-tokenizer named by ``tokenizer.ggml.pre``),
``gemma4`` (BPE over SentencePiece-style text), ``bert`` (WordPiece) and ``t5`` (unigram: T5,
XLM-RoBERTa). Encoding matches llama.cpp's tokenizer test vectors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .base import StreamDecoder, Tokenizer
from .bpe import BytePairEncoding, SpacedBytePairEncoding
from .spm import SentencePiece
from .ugm import Unigram
from .vocab import TokenType, Vocab
from .wpm import WordPiece

__all__ = ["BytePairEncoding", "SentencePiece", "SpacedBytePairEncoding", "StreamDecoder", "TokenType", "Tokenizer",
           "Unigram", "Vocab", "WordPiece", "from_metadata"]

_TOKENIZERS: dict[str, type[Tokenizer]] = {
    "llama": SentencePiece,
    "gpt2": BytePairEncoding,
    "gemma4": SpacedBytePairEncoding,
    "bert": WordPiece,
    "t5": Unigram,
}


def from_metadata(meta: Mapping[str, Any]) -> Tokenizer:
    """Build the tokenizer described by GGUF metadata; ``ValueError`` if unsupported."""
    vocab = Vocab.from_metadata(meta)
    return _TOKENIZERS[vocab.model](vocab)
