"""Tokenizer export: SentencePiece (tokenizer.model), byte-level BPE (tokenizer.json) and WordPiece
(vocab.txt) vocabularies in GGUF's ``tokenizer.ggml.*`` form, as llama.cpp's converter writes them.

Only the standard library: the SentencePiece protobuf is parsed by hand, tokenizer.json is JSON.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checkpoint import read_json

# Token types, as tokenizer.ggml.token_type stores them (same numbers as
# SentencePiece's piece types).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


# Pre-tokenizer split regexes of known tokenizer.json files, by the tokenizer.ggml.pre name llama.cpp
# gives them (llama.cpp recognises them by hashing a test encoding; the regex says the same here).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")  # digits split one by one
GPT4O_PATTERN = (  # o200k (gpt-oss)
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35_PATTERN = (  # Qwen 3.5: letters and combining marks together
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"
    r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {LLAMA3_PATTERN: "llama-bpe", QWEN2_PATTERN: "qwen2", GPT4O_PATTERN: "gpt-4o",
                  QWEN35_PATTERN: "qwen35"}


@dataclass
class Vocab:
    model: str  # "llama" (SentencePiece), "gpt2" (byte-level BPE), "gemma4" (BPE of U+2581 text), "bert" (WordPiece)
    tokens: list[str]
    types: list[int]
    special: dict[str, int]  # "bos"/"eos"/"unk"/"pad" -> id
    scores: list[float] | None = None
    merges: list[str] | None = None
    pre: str | None = None
    add_bos: bool | None = None
    add_eos: bool | None = None
    add_space_prefix: bool | None = None
    add_sep: bool | None = None
    chat_template: str | list[dict[str, str]] | None = None
    precompiled_charsmap: bytes | None = None  # unigram ("t5"): SentencePiece's normalisation table
    remove_extra_whitespaces: bool | None = None

    def pad_to(self, n: int) -> None:
        """Give ids up to ``n`` placeholder tokens (embedding rows that no token uses)."""
        for i in range(len(self.tokens), n):
            self.tokens.append(f"[PAD{i}]")
            self.types.append(UNUSED)
            if self.scores is not None:
                self.scores.append(-1000.0)


def read_vocab(hf_dir: Path, n_vocab: int, pad: bool = True) -> Vocab:
    """Read tokenizer.model (preferred) or tokenizer.json, padded to the embedding's ``n_vocab`` rows
    (unless not ``pad``: then as many tokens as the tokenizer has)."""
    tok_config = read_json(hf_dir / "tokenizer_config.json") or {}
    tok_json = read_json(hf_dir / "tokenizer.json")
    # as llama.cpp: added tokens past the model's rows are left out (Gemma 3's <image_soft_token>, id 262144)
    added = {i: token for i, token in _added_tokens(hf_dir, tok_config, tok_json).items() if i < n_vocab}
    if (hf_dir / "tokenizer.model").exists():
        vocab = _spm_vocab(hf_dir / "tokenizer.model", added)
    elif tok_json is not None:
        vocab = _bpe_vocab(tok_json, added)
    else:
        raise FileNotFoundError(f"no tokenizer.model or tokenizer.json in {hf_dir}")
    if len(vocab.tokens) > n_vocab:
        raise ValueError(f"tokenizer has {len(vocab.tokens)} tokens but the model's vocab_size is {n_vocab}")
    if pad:
        vocab.pad_to(n_vocab)

    ids = {tok: i for i, tok in enumerate(vocab.tokens)}
    special_map = read_json(hf_dir / "special_tokens_map.json") or {}
    config = read_json(hf_dir / "config.json") or {}
    for kind in ("bos", "eos", "unk", "pad"):
        tok = tok_config.get(f"{kind}_token") or special_map.get(f"{kind}_token")
        tok = tok.get("content") if isinstance(tok, dict) else tok
        fallback = config.get(f"{kind}_token_id")
        fallback = fallback[0] if isinstance(fallback, list) and fallback else fallback
        if isinstance(tok, str) and tok in ids:
            vocab.special[kind] = ids[tok]
        elif isinstance(fallback, int) and 0 <= fallback < len(vocab.tokens):
            vocab.special[kind] = fallback
    for kind in ("bos", "eos"):
        if f"add_{kind}_token" in tok_config:
            setattr(vocab, f"add_{kind}", bool(tok_config[f"add_{kind}_token"]))
    template = tok_config.get("chat_template")
    if (hf_dir / "chat_template.jinja").exists():  # where newer transformers save it
        template = (hf_dir / "chat_template.jinja").read_text(encoding="utf-8")
    vocab.chat_template = template
    return vocab


def _added_tokens(hf_dir: Path, tok_config: dict, tok_json: dict | None) -> dict[int, tuple[str, bool]]:
    """id -> (content, special) of tokens added on top of the base vocabulary."""
    added: dict[int, tuple[str, bool]] = {}
    for content, i in (read_json(hf_dir / "added_tokens.json") or {}).items():
        added[int(i)] = (content, False)
    for i, t in (tok_config.get("added_tokens_decoder") or {}).items():
        added[int(i)] = (t["content"], bool(t.get("special")))
    for t in (tok_json or {}).get("added_tokens", []):
        added[int(t["id"])] = (t["content"], bool(t.get("special")))
    return added


def _apply_added(vocab: Vocab, added: dict[int, tuple[str, bool]]) -> None:
    """Place added tokens: new ids are appended, base tokens marked normal become user-defined/control."""
    for i in sorted(added):
        content, special = added[i]
        kind = CONTROL if special else USER_DEFINED
        vocab.pad_to(i + 1)
        if vocab.types[i] in (NORMAL, UNUSED):
            vocab.tokens[i], vocab.types[i] = content, kind


def _spm_vocab(path: Path, added: dict[int, tuple[str, bool]]) -> Vocab:
    """Read a SentencePiece tokenizer.model directly from its protobuf bytes.

    Parsing the few fields needed here keeps conversion free of the sentencepiece
    and protobuf packages, and sees what sentencepiece's Python API hides
    (user-defined pieces, the add_dummy_prefix flag).
    """
    tokens, scores, types = [], [], []
    special = {"unk": 0, "bos": 1, "eos": 2, "pad": -1}  # TrainerSpec defaults
    add_dummy_prefix = True
    for field, value in _proto_fields(path.read_bytes()):
        if field == 1:  # repeated SentencePiece {1: piece, 2: score, 3: type}
            piece = dict(_proto_fields(value))
            tokens.append(piece.get(1, b"").decode("utf-8"))
            scores.append(struct.unpack("<f", piece[2])[0] if 2 in piece else 0.0)
            types.append(piece.get(3, NORMAL))
        elif field == 2:  # TrainerSpec {40: unk_id, 41: bos_id, 42: eos_id, 43: pad_id}
            ids = {f: v for f, v in _proto_fields(value) if f in (40, 41, 42, 43)}
            for f, kind in ((40, "unk"), (41, "bos"), (42, "eos"), (43, "pad")):
                if f in ids:  # int32 varints: negative values arrive as 64-bit two's complement
                    special[kind] = ids[f] - (1 << 64) if ids[f] >= 1 << 63 else ids[f]
        elif field == 3:  # NormalizerSpec {3: add_dummy_prefix}
            add_dummy_prefix = bool(dict(_proto_fields(value)).get(3, True))
    if not tokens:
        raise ValueError(f"{path} holds no SentencePiece pieces")
    special = {kind: i for kind, i in special.items() if 0 <= i < len(tokens)}
    vocab = Vocab("llama", tokens, types, special, scores=scores, add_bos=True, add_eos=False,
                   add_space_prefix=add_dummy_prefix)
    _apply_added(vocab, added)
    return vocab


def _proto_fields(buf: bytes) -> Iterator[tuple[int, Any]]:
    """(field number, value) pairs of one protobuf message: ints for varints, bytes otherwise."""
    def varint(pos: int) -> tuple[int, int]:
        result = shift = 0
        while True:
            b = buf[pos]
            result |= (b & 0x7F) << shift
            pos, shift = pos + 1, shift + 7
            if b < 0x80:
                return result, pos

    pos = 0
    while pos < len(buf):
        key, pos = varint(pos)
        wire = key & 7
        if wire == 0:
            value, pos = varint(pos)
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, pos = buf[pos:pos + size], pos + size
        elif wire == 2:
            size, pos = varint(pos)
            value, pos = buf[pos:pos + size], pos + size
        else:
            raise ValueError(f"unsupported protobuf wire type {wire} in tokenizer.model")
        yield key >> 3, value


def _bpe_vocab(tok_json: dict, added: dict[int, tuple[str, bool]]) -> Vocab:
    model = tok_json.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"tokenizer.json model type {model.get('type')!r} is not supported (only BPE)")
    # SentencePiece-style BPE (spaces as U+2581, <0xXX> byte tokens: Gemma 4) is llama.cpp's "gemma4" vocabulary
    spaced = any((r.get("pattern") or {}).get("String") == "\u2581" for r in _find(tok_json.get("decoder"), "Replace"))
    if not spaced and not _find([tok_json.get("pre_tokenizer"), tok_json.get("decoder")], "ByteLevel"):
        raise ValueError("tokenizer.json is a BPE with neither ByteLevel bytes nor U+2581 spaces; "
                         "add the model's tokenizer.model to convert it")
    size = max(model["vocab"].values()) + 1
    tokens, types = [f"[PAD{i}]" for i in range(size)], [UNUSED] * size
    for tok, i in model["vocab"].items():
        tokens[i] = tok
        types[i] = BYTE if spaced and len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">") else NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    if spaced:
        vocab = Vocab("gemma4", tokens, types, {}, merges=merges, pre="gemma4", add_space_prefix=False)
    else:
        vocab = Vocab("gpt2", tokens, types, {}, merges=merges, pre=_bpe_pre(tok_json))
    _apply_added(vocab, added)
    vocab.add_bos, vocab.add_eos = _template_adds(tok_json)
    return vocab


def _bpe_pre(tok_json: dict) -> str:
    """Name the pre-tokenizer for tokenizer.ggml.pre.

    Rule: the name of PRE_TOKENIZERS when a Split uses exactly one of its regexes; "gpt-2" when
    the only splitting is ByteLevel's own (GPT-2) regex; "default" for anything else.
    """
    pre = tok_json.get("pre_tokenizer")
    patterns = [(s.get("pattern") or {}).get("Regex") for s in _find(pre, "Split")]
    for pattern in patterns:
        if pattern in PRE_TOKENIZERS:
            return PRE_TOKENIZERS[pattern]
    if not patterns and any(b.get("use_regex", True) for b in _find(pre, "ByteLevel")):
        return "gpt-2"
    return "default"


def _template_adds(tok_json: dict) -> tuple[bool | None, bool | None]:
    """Whether tokenizer.json's TemplateProcessing puts a special token before/after a single sequence."""
    templates = _find(tok_json.get("post_processor"), "TemplateProcessing")
    if not templates:
        return None, None
    single = templates[0].get("single") or []
    first, last = (single[0], single[-1]) if single else ({}, {})
    return "SpecialToken" in first, "SpecialToken" in last


def _find(node: Any, kind: str) -> list[dict]:
    """Every dict with ``"type": kind`` inside a tokenizer.json component (which may nest Sequences)."""
    if isinstance(node, list):
        return [hit for item in node for hit in _find(item, kind)]
    if not isinstance(node, dict):
        return []
    here = [node] if node.get("type") == kind else []
    return here + [hit for value in node.values() for hit in _find(value, kind)]


def write_vocab(writer: Any, vocab: Vocab) -> None:
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    adders = {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id, "unk": writer.add_unk_token_id,
              "pad": writer.add_pad_token_id, "sep": writer.add_sep_token_id, "mask": writer.add_mask_token_id}
    for kind, token_id in vocab.special.items():
        adders[kind](token_id)
    if vocab.add_bos is not None:
        writer.add_add_bos_token(vocab.add_bos)
    if vocab.add_eos is not None:
        writer.add_add_eos_token(vocab.add_eos)
    if vocab.add_space_prefix is not None:
        writer.add_add_space_prefix(vocab.add_space_prefix)
    if vocab.add_sep is not None:
        writer.add_add_sep_token(vocab.add_sep)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)
    if vocab.precompiled_charsmap:
        writer.add_precompiled_charsmap(vocab.precompiled_charsmap)
    if vocab.remove_extra_whitespaces is not None:
        writer.add_remove_extra_whitespaces(vocab.remove_extra_whitespaces)


def unigram_vocab(hf_dir: Path, n_vocab: int) -> Vocab:
    """tokenizer.json's Unigram model (XLM-RoBERTa's) in GGUF form (llama.cpp's ``t5`` vocabulary): the
    pieces with their scores, the normaliser's precompiled charsmap and space merging, and the
    specials <s> (BOS), </s> (EOS and SEP), <unk>, <pad>, <mask>; a pair is ``<s> A </s></s> B </s>``."""
    import base64

    tok_json = read_json(hf_dir / "tokenizer.json") or {}
    model = tok_json.get("model") or {}
    if model.get("type") != "Unigram":
        raise FileNotFoundError(f"no Unigram tokenizer.json in {hf_dir} (XLM-RoBERTa's fast tokenizer)")
    tokens = [piece for piece, _ in model["vocab"]]
    scores = [float(score) for _, score in model["vocab"]]
    types = [NORMAL] * len(tokens)
    if model.get("unk_id") is not None:
        types[model["unk_id"]] = UNKNOWN
    vocab = Vocab("t5", tokens, types, {}, scores=scores, pre="default", add_bos=True, add_eos=True, add_sep=True,
                  add_space_prefix=True, remove_extra_whitespaces=False)
    _apply_added(vocab, _added_tokens(hf_dir, read_json(hf_dir / "tokenizer_config.json") or {}, tok_json))
    normalizers = [tok_json.get("normalizer") or {}]
    normalizers += normalizers[0].get("normalizers") or []
    for n in normalizers:
        if n.get("type") == "Precompiled" and n.get("precompiled_charsmap"):
            vocab.precompiled_charsmap = base64.b64decode(n["precompiled_charsmap"])
        if n.get("type") == "Replace" and (n.get("pattern") or {}).get("Regex") == " {2,}":
            vocab.remove_extra_whitespaces = True
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    for kind, text in (("bos", "<s>"), ("eos", "</s>"), ("sep", "</s>"), ("unk", "<unk>"), ("pad", "<pad>"),
                       ("mask", "<mask>")):
        if text in ids:
            vocab.special[kind] = ids[text]
    if "bos" not in vocab.special or "eos" not in vocab.special:
        raise ValueError("the Unigram vocabulary has no <s> or </s> token")
    if len(vocab.tokens) > n_vocab:
        raise ValueError(f"tokenizer.json has {len(vocab.tokens)} tokens but the model's vocab_size is {n_vocab}")
    vocab.pad_to(n_vocab)
    return vocab


_WORDPIECE_SPECIALS = ("unk", "sep", "pad", "cls", "mask")


def wordpiece_vocab(hf_dir: Path, n_vocab: int) -> Vocab:
    """vocab.txt (or tokenizer.json's WordPiece model) in GGUF form: word-start pieces get a leading
    U+2581, continuations lose their "##", control tokens ([CLS], [SEP], ...) stay as they are."""
    tok_config = read_json(hf_dir / "tokenizer_config.json") or {}
    if tok_config.get("do_lower_case") is False:
        raise ValueError("the tokenizer is cased (do_lower_case=false); GGUF's bert tokenizer lowercases, "
                         "so only uncased WordPiece vocabularies convert faithfully")
    tok_json = read_json(hf_dir / "tokenizer.json")
    if (hf_dir / "vocab.txt").exists():
        pieces = (hf_dir / "vocab.txt").read_text(encoding="utf-8").split("\n")
        pieces = pieces[:-1] if pieces and pieces[-1] == "" else pieces
    elif tok_json is not None and (tok_json.get("model") or {}).get("type") == "WordPiece":
        by_id = {i: t for t, i in tok_json["model"]["vocab"].items()}
        pieces = [by_id.get(i, f"[PAD{i}]") for i in range(max(by_id) + 1)]
    else:
        raise FileNotFoundError(f"no vocab.txt or WordPiece tokenizer.json in {hf_dir}")
    if len(pieces) > n_vocab:
        raise ValueError(f"vocab.txt has {len(pieces)} tokens but the model's vocab_size is {n_vocab}")
    ids = {tok: i for i, tok in enumerate(pieces)}
    special_map = read_json(hf_dir / "special_tokens_map.json") or {}
    special: dict[str, int] = {}
    for kind in _WORDPIECE_SPECIALS:
        tok = tok_config.get(f"{kind}_token") or special_map.get(f"{kind}_token") or f"[{kind.upper()}]"
        tok = tok.get("content") if isinstance(tok, dict) else tok
        if tok in ids:
            special[kind] = ids[tok]
    if "cls" not in special or "sep" not in special:
        raise ValueError("the WordPiece vocabulary has no [CLS] or [SEP] token")
    control = set(special.values())
    for i, t in (tok_config.get("added_tokens_decoder") or {}).items():
        if t.get("special") and int(i) < len(pieces):
            control.add(int(i))
    types = [CONTROL if i in control else NORMAL for i in range(len(pieces))]
    tokens = [tok if i in control else tok[2:] if tok.startswith("##") else "\u2581" + tok
              for i, tok in enumerate(pieces)]
    special["bos"] = special.pop("cls")  # GGUF readers take the [CLS] id from bos_token_id
    vocab = Vocab("bert", tokens, types, special, pre="default", add_bos=True, add_eos=False, add_sep=True)
    vocab.pad_to(n_vocab)
    return vocab
