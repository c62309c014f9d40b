"""The ``tokenizer.ggml.*`` GGUF keys, read once into a frozen ``Vocab``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

# As in llama.cpp (the pinned version), a token with one of these texts ends
# generation and counts as a control token whatever type the file gives it.
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})
# Fill-in-the-middle tokens found by text when their id key is absent (they too become
# control tokens); the pad, repo and file-separator ones also end generation.
FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_FIM_OLD_KEYS = {"fim_pre": "prefix", "fim_suf": "suffix", "fim_mid": "middle"}
_FIM_EOG = ("fim_pad", "fim_rep", "fim_sep")
# gpt-oss (harmony), as llama.cpp: the headers of its messages are written out (a reader finds the
# channels in the text), and with <|return|> and <|call|> to end a reply, <|end|> (the end of its
# thinking message) does not end generation
HARMONY_SHOWN = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")
_LOOKED_UP = EOG_TEXTS.union(*FIM_TEXTS.values(), HARMONY_SHOWN)

# tokenizer.ggml.pre values whose defaults differ from plain BPE: llama3-style, Tekken and
# Chameleon vocabularies add BOS; llama3-style, GLM, Tekken and a few more take whole-token
# pre-tokens as they are; RoBERTa-style embedding vocabularies add a separator.
LLAMA3_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                        "midm-2.0", "lfm2", "jina-v5-nano"})
ADD_BOS_PRE = LLAMA3_PRE | {"tekken", "chameleon"}
IGNORE_MERGES_PRE = LLAMA3_PRE | {"glm4", "glm5", "tekken", "youtu", "granite-embed-multi-97m", "minicpm5"}
SEP_PRE = frozenset({"jina-v1-en", "jina-v2-code", "roberta-bpe"})


class TokenType(IntEnum):
    """``tokenizer.ggml.token_type`` values."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


SPECIAL_TYPES = frozenset({TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN})


@dataclass(frozen=True)
class Vocab:
    """Everything a tokenizer needs from GGUF metadata, with defaults stated here."""

    model: str
    pre: str
    name: str
    tokens: list[str]
    types: list[int]  # after llama.cpp's fix-ups: end-of-generation and FIM texts are CONTROL
    scores: list[float]
    merges: list[str]
    bos: int | None
    eos: int | None
    unk: int | None
    sep: int | None
    eog: frozenset[int]
    add_bos: bool
    add_eos: bool
    add_sep: bool
    add_space_prefix: bool
    ignore_merges: bool
    # fill-in-the-middle tokens by role ("fim_pre", "fim_suf", "fim_mid", ...), from their id keys or texts
    fim: Mapping[str, int] = field(default_factory=dict)
    precompiled_charsmap: bytes = b""  # unigram ("t5"): SentencePiece's normalisation table
    remove_extra_whitespaces: bool = False  # unigram: runs of spaces become one

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Vocab:
        """Build from GGUF keys; raise ``ValueError`` for a missing or unknown vocabulary."""
        model = meta.get("tokenizer.ggml.model")
        if model not in ("llama", "gpt2", "gemma4", "bert", "t5"):
            raise ValueError(f"unsupported tokenizer.ggml.model {model!r} "
                             "(supported: 'llama', 'gpt2', 'gemma4', 'bert', 't5')")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
        tokens = list(tokens)
        n = len(tokens)
        types = list(meta.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * n)
        scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * n)
        if len(types) != n or len(scores) != n:
            raise ValueError(f"tokenizer.ggml.token_type/scores have {len(types)}/{len(scores)} "
                             f"entries for {n} tokens")
        merges = list(meta.get("tokenizer.ggml.merges") or [])
        if model in ("gpt2", "gemma4") and not merges:
            raise ValueError(f"tokenizer.ggml.model {model!r} needs tokenizer.ggml.merges")
        pre = meta.get("tokenizer.ggml.pre", "default") or "default"

        def token_id(key: str, default: int | str | None = None) -> int | None:
            """An id key, or its default given as an id or as a token text; None if absent."""
            value = meta.get(f"tokenizer.ggml.{key}", default)
            if isinstance(value, str):
                value = tokens.index(value) if value in tokens else None
            return value if isinstance(value, int) and 0 <= value < n else None

        # defaults per vocabulary type, as llama.cpp has them
        if model == "llama":
            bos, eos, unk = token_id("bos_token_id", 1), token_id("eos_token_id", 2), token_id("unknown_token_id", 0)
            sep = token_id("seperator_token_id")
            add_bos, add_eos, add_sep = True, False, False
        elif model == "bert":
            bos = token_id("bos_token_id", meta.get("tokenizer.ggml.cls_token_id", "[CLS]"))
            eos, unk = token_id("eos_token_id"), token_id("unknown_token_id", "[UNK]")
            sep = token_id("seperator_token_id", "[SEP]")
            add_bos, add_eos, add_sep = True, False, True
        elif model == "t5":  # unigram (T5, XLM-RoBERTa)
            bos, eos, unk = token_id("bos_token_id"), token_id("eos_token_id", 1), token_id("unknown_token_id", 2)
            sep = token_id("seperator_token_id")
            add_bos, add_eos, add_sep = False, True, False
        else:
            bos, eos, unk = token_id("bos_token_id"), token_id("eos_token_id"), token_id("unknown_token_id")
            sep = token_id("seperator_token_id")
            add_bos, add_eos, add_sep = pre in ADD_BOS_PRE, False, pre in SEP_PRE
        fim: dict[str, int] = {}
        eog = _end_of_generation(tokens, types, token_id, fim)
        return cls(
            model=model, pre=pre, name=str(meta.get("general.name", "")).lower(),
            tokens=tokens, types=types, scores=scores, merges=merges,
            bos=bos, eos=eos, unk=unk, sep=sep, eog=frozenset(i for i in (*eog, eos) if i is not None),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos)),
            add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", add_eos)),
            add_sep=bool(meta.get("tokenizer.ggml.add_sep_token", add_sep)),
            add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", model in ("llama", "t5"))),
            ignore_merges=pre in IGNORE_MERGES_PRE, fim=fim,
            precompiled_charsmap=bytes(b & 0xFF for b in meta.get("tokenizer.ggml.precompiled_charsmap") or ()),
            remove_extra_whitespaces=bool(meta.get("tokenizer.ggml.remove_extra_whitespaces", False)),
        )


def _end_of_generation(tokens: list[str], types: list[int], token_id: Callable[[str], int | None],
                       fim: dict[str, int]) -> set[int | None]:
    """Ids that end generation; marks the tokens llama.cpp recognises by text as CONTROL; fills ``fim``
    with the fill-in-the-middle tokens found."""
    found = {text: i for i, text in enumerate(tokens) if text in _LOOKED_UP}
    control = {i for text, i in found.items() if text in EOG_TEXTS}
    eog: set[int | None] = {*control, token_id("eot_token_id"), token_id("eom_token_id")}
    for role, texts in FIM_TEXTS.items():
        tid = token_id(f"{role}_token_id")
        if tid is None and role in _FIM_OLD_KEYS:
            tid = token_id(f"{_FIM_OLD_KEYS[role]}_token_id")
        if tid is None:
            tid = next((found[t] for t in texts if t in found), None)
            control.add(tid)
        if tid is not None:
            fim[role] = tid
        if role in _FIM_EOG:
            eog.add(tid)
    if "<|return|>" in found and "<|call|>" in found:
        eog.discard(found.get("<|end|>"))
        for text in HARMONY_SHOWN:
            if text in found:
                types[found[text]] = TokenType.USER_DEFINED
    for i in control - {None}:
        types[i] = TokenType.CONTROL
    return eog
