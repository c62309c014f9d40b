"""Pre-tokenizer regexes for byte-level BPE, chosen by ``tokenizer.ggml.pre``.

Each entry is a list of patterns applied in turn: every pattern cuts each piece
left by the previous one into its matches and the text between them. The
patterns are the ones in each model's published ``tokenizer.json`` (case-insensitive
contractions spelled out), as llama.cpp uses them.
"""

from __future__ import annotations

import regex

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"


def _llama3_like(digits: str) -> str:
    return (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|" + digits
            + r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


_GPT4O = (  # o200k (GPT-4o, gpt-oss), as its tokenizer.json has it
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CJK = "[一-龥ࠀ-一가-퟿]+"
# Cased letters (Lu, Ll, Lt), as ranges. Escapes mark code points that Unicode
# normalisation would replace with a look-alike (e.g. KELVIN SIGN -> K).
_DEEPSEEK_LETTERS = (
    "A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚ"
    "Ḁ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼ"
    "ℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎ"
    "ↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ\U00010400-\U0001044f𐒰-𐓓𐓘-𐓻"
    "𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃"
)

_PATTERNS: dict[str, list[str]] = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
    "gpt2": [_GPT2],
    "llama3": [_llama3_like(r"\p{N}{1,3}")],
    "qwen2": [_llama3_like(r"\p{N}")],
    # Qwen 3.5: qwen2's, with combining marks (\p{M}) kept in words (Devanagari, decomposed accents)
    "qwen35": [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
               r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "starcoder": [r"\p{N}", _GPT2],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"],
    "deepseek-llm": [
        # U+3000 left out of the punctuation class: llama.cpp's regex engine never matches it there
        "[\r\n]", rf"\s?[{_DEEPSEEK_LETTERS}]+", r"\s?[!-/:-~！-／：-～‘-‟、-。]+",
        r"\s+\Z", _CJK, r"\p{N}+",
    ],
    "deepseek-coder": ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"],
    "gpt-4o": [_GPT4O],
    "bloom": [r" ?[^(\s|.,!?…。，、।۔،)]+"],
    "viking": [r" ?[^(\s|.,!?…。，、।۔،)]+", r"\p{N}"],
}

# tokenizer.ggml.pre value -> key of _PATTERNS
_ALIASES = {
    "gpt-2": "gpt2", "phi-2": "gpt2", "mpt": "gpt2", "olmo": "gpt2", "jais": "gpt2",
    "jina-es": "gpt2", "jina-de": "gpt2", "jina-v1-en": "gpt2", "jina-v2-es": "gpt2",
    "jina-v2-de": "gpt2", "jina-v2-code": "gpt2", "roberta-bpe": "gpt2", "gigachat": "gpt2",
    "trillion": "gpt2", "a.x-4.0": "gpt2", "mellum": "gpt2", "exaone4": "gpt2", "modern-bert": "gpt2",
    "granite-docling": "gpt2",
    "llama3": "llama3", "llama-v3": "llama3", "llama-bpe": "llama3", "falcon3": "llama3",
    "falcon-h1": "llama3", "pixtral": "llama3", "midm-2.0": "llama3", "lfm2": "llama3", "jina-v5-nano": "llama3",
    "dbrx": "llama3", "smaug-bpe": "llama3", "chatglm-bpe": "llama3", "glm4": "llama3",
    "glm5": "llama3",
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2", "kormo": "qwen2", "f2llmv2": "qwen2", "stablelm2": "qwen2",
    "megrez": "qwen2", "qwen35": "qwen35",
    "starcoder": "starcoder", "refact": "starcoder", "command-r": "starcoder",
    "smollm": "starcoder", "codeshell": "starcoder", "exaone": "starcoder",
    "minerva-7b": "starcoder", "mellum2": "starcoder",
    "poro-chat": "bloom", "bloom": "bloom", "gpt3-finnish": "bloom", "viking": "viking",
    "default": "default", "falcon": "falcon", "gpt-4o": "gpt-4o", "llama4": "gpt-4o",
    "deepseek-llm": "deepseek-llm", "deepseek-coder": "deepseek-coder",
}


def patterns_for(pre: str) -> list[regex.Pattern[str]]:
    """Compiled patterns for a ``tokenizer.ggml.pre`` value; ``ValueError`` if unknown."""
    key = _ALIASES.get(pre)
    if key is None:
        raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r} "
                         f"(supported: {', '.join(sorted(_ALIASES))})")
    return [regex.compile(p) for p in _PATTERNS[key]]


def split_words(text: str, patterns: list[regex.Pattern[str]]) -> list[str]:
    """Cut ``text`` into pre-tokens: matches and the gaps between them, pattern by pattern."""
    pieces = [text]
    for pattern in patterns:
        out: list[str] = []
        for piece in pieces:
            pos = 0
            for m in pattern.finditer(piece):
                start, end = m.span()
                if start > pos:
                    out.append(piece[pos:start])
                if end > start:
                    out.append(piece[start:end])
                pos = end
            if pos < len(piece):
                out.append(piece[pos:])
        pieces = out
    return pieces
