"""Pre-tokenizer regexes for byte-level BPE, chosen by ``tokenizer.ggml.pre``.

Each entry is a list of patterns applied in turn: every pattern cuts each piece
left by the previous one into its matches and the text between them. The
patterns are the ones in each model's published ``tokenizer.json`` (case-insensitive
contractions spelled out), as llama.cpp uses them. Where llama.cpp's regex engine reads a
pattern otherwise (ASCII-only case, non-ASCII spaces seen as ``\v``, a splitter of its own), the
pattern here says what llama.cpp does, since its GGUF files are the ones read here; gpt-4o
alone keeps o200k's own case classes (transformers agrees with it; tests/test_gptoss.py).
tests/test_pretokenize_llamacpp.py checks every type against llama.cpp.
"""

from __future__ import annotations

import regex

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"


def _llama3_like(digits: str, *, contractions: bool = True, symbols: str = r" ?[^\s\p{L}\p{N}]+[\r\n]*",
                 spaces: str = r"\s+(?!\S)|\s+") -> str:
    return ((_CONTRACTIONS + "|" if contractions else "") + r"[^\r\n\p{L}\p{N}]?\p{L}+|" + digits
            + "|" + symbols + r"|\s*[\r\n]+|" + spaces)


_GPT4O = (  # o200k (GPT-4o, gpt-oss), as its tokenizer.json has it
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# (llama.cpp's engine sees any non-ASCII space as \v here, so the ones in U+0800-U+4E00 stay out)
_CJK = r"(?:(?!\s)[一-龥ࠀ-一가-퟿])+"
# Cased letters (Lu, Ll, Lt), as ranges. Escapes mark code points that Unicode
# normalisation would replace with a look-alike (e.g. KELVIN SIGN -> K).
_DEEPSEEK_LETTERS = (
    "A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚ"
    "Ḁ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼ"
    "ℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎ"
    "ↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ\U00010400-\U0001044f𐒰-𐓓𐓘-𐓻"
    "𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃"
)
# DeepSeek-V3's words: an ASCII symbol may lead an ASCII word; letters keep their marks
_DEEPSEEK3_WORDS = (r"[!-/:-@\[-`{-~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
                    r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_KANA_HAN = "[一-龥぀-ゟ゠-ヿ]+"
# A digit run cut into groups of three from its right end; the text before the run joins its
# first group (llama.cpp's AFMoE and Tiny Aya splitter leaves it there). Only the first group
# looks ahead to the run's end; the groups after it follow on in threes (linear time).
_DIGIT_GROUPS = r"(?<=\p{N})\p{N}{3}|(?:^|(?<=\p{N}))\P{N}*\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"
# llama.cpp reads case classes through its regex engine, which knows only ASCII case: "upper"
# is any letter but a-z, "lower" any letter but A-Z (so "камеРА" stays one word).
_UPPERISH, _LOWERISH = r"[^\P{L}a-z]", r"[^\P{L}A-Z]"
# AFMoE's East and Southeast Asian scripts; U+8C48 (not U+F900) starts the third span in llama.cpp,
# so it also takes in Hangul, Yi and more
_AFMOE_ASIAN = ("[\u4e00-\u9fff\u3400-\u4dbf\u8c48-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f"
                "\u2f00-\u2fdf\u0e40-\u0e7f\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f"
                "\ua9e0-\ua9ff\uac00-\ud7af\u1100-\u11ff]+")
# SuperBPE cuts a number before each group of three ASCII digits counted from the right: the
# cuts of the tokenizer.json's "(?=(?:[0-9]{3})+(?![0-9]))", which looks ahead from every
# digit (quadratic, as in llama.cpp). Here a match runs from one cut to the next: a run's first
# cut is found by looking ahead once; the groups after it follow on (\G), and the last one takes
# what follows up to the next run's first cut.
_ALIGNED = "(?=(?:[0-9]{3})+(?![0-9]))"
_SUPERBPE_THREES = (r"(?:\G(?<=[0-9])|(?<=(?:^|[^0-9])[0-9]{0,2})" + _ALIGNED + r")[0-9]{3}"
                    r"(?:(?=[0-9])|[^0-9]*+(?:[0-9]{1,2}+(?![0-9])[^0-9]*+)*+(?:\Z|[0-9]{0,2}" + _ALIGNED + "))")
# Jais 2's whitespace runs, cut in powers of two
_POWERS_OF_TWO_SPACES = "".join(rf"\s{{{n}}}(?!\S)|" for n in (512, 256, 128, 64, 32, 16, 8, 4)) + r"\s{1,2}(?!\S)|\s"
# Kimi K2's Han, as llama.cpp's splitter has it: the CJK ideograph blocks
_KIMI_HAN = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002a6df\U0002a700-\U0002ebef\U0002f800-\U0002fa1f"

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
    "deepseek-v3": [r"\p{N}{1,3}", _KANA_HAN, _DEEPSEEK3_WORDS],
    "spark2_5": [r"\p{N}{1,3}", _KANA_HAN, r"[!-/:-@\[-`{-~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                 r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+", r"\p{N}"],
    "afmoe": [_DIGIT_GROUPS, _AFMOE_ASIAN, _DEEPSEEK3_WORDS],
    "youtu": ["[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+",
              # the tokenizer.json's case classes, as llama.cpp reads them: letters and marks
              r"[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+" + _CONTRACTIONS + r"?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "tiny_aya": [_DIGIT_GROUPS, r"[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+" + _CONTRACTIONS
                 + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "tekken": [rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}*{_LOWERISH}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}+{_LOWERISH}*"
               r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "granite-embed-multi-97m": [  # tekken's case classes, with marks counted as letters of both cases
        r"[^\r\n\p{L}\p{N}]?(?:(?![a-z])[\p{L}\p{M}])*(?:(?![A-Z])[\p{L}\p{M}])+" + _CONTRACTIONS + "?"
        r"|[^\r\n\p{L}\p{N}]?(?:(?![a-z])[\p{L}\p{M}])+(?:(?![A-Z])[\p{L}\p{M}])*" + _CONTRACTIONS + "?"
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "kimi-k2": [rf"[{_KIMI_HAN}]+|[^\r\n\p{{L}}\p{{N}}]?[^\P{{L}}{_KIMI_HAN}]+{_CONTRACTIONS}?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "jais-2": [_llama3_like(r"\p{N}{1,3}", spaces=_POWERS_OF_TWO_SPACES)],
    "minicpm5": [r"\p{N}{1,3}", _llama3_like(r"\p{N}+")],
    "ufakzeka": [_llama3_like(r"\p{N}", contractions=False)],  # Turkish suffixes after an apostrophe stay on
    "seed-coder": [_llama3_like(r"\p{N}", symbols=r" ?[^\s\p{L}\p{N}]+")],
    "laguna": [r"\n+", _llama3_like(r"\p{N}")],
    "exaone-moe": [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+"],  # words joined by single spaces
    "superbpe": [r"\p{N}+", _SUPERBPE_THREES],  # the words span spaces
    "chameleon": ["<sentinel:[0-9]+>", "IMGIMG[A-I]{1,4}Z", "[\t\n]|    |  ", r"\p{N}",
                  r"[\p{P}!-/:-@\[-`{-~]", _GPT2],
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
    "deepseek-v3": "deepseek-v3", "hunyuan-dense": "deepseek-v3", "joyai-llm": "deepseek-v3",
    "hy_v4": "deepseek-v3", "spark2_5": "spark2_5", "afmoe": "afmoe", "youtu": "youtu",
    "tiny_aya": "tiny_aya", "cohere2moe": "tiny_aya", "tekken": "tekken",
    "granite-embed-multi-97m": "granite-embed-multi-97m", "kimi-k2": "kimi-k2", "jais-2": "jais-2",
    "minicpm5": "minicpm5", "ufakzeka": "ufakzeka", "seed-coder": "seed-coder",
    # Ling's regex has \s*[\r\n] for qwen2's \s*[\r\n]+: both end at the last newline of a run
    "bailingmoe": "qwen2", "bailingmoe2": "qwen2", "llada-moe": "qwen2",
    "laguna": "laguna", "exaone-moe": "exaone-moe", "superbpe": "superbpe", "chameleon": "chameleon",
    "grok-2": "qwen2", "hunyuan": "qwen2", "solar-open": "qwen2",
    "minimax-m2": "gpt-4o", "kanana2": "gpt-4o", "talkie": "gpt-4o",
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
