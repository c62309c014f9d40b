"""Convert a Hugging Face Llama/Mistral or BERT checkpoint directory to a GGUF file.

The output follows llama.cpp's GGUF ``llama`` and ``bert`` conventions (tensor
names, metadata keys, interleaved rope layout, WordPiece vocabulary with word-start
markers) so the file also loads in other GGUF runtimes. Tensors are read lazily
from memory-mapped safetensors and written one at a time, so peak memory is about one tensor, not the whole model.

Only numpy and the ``gguf`` package (writer, q8_0 quantiser) are needed: no
torch, safetensors or sentencepiece at conversion time.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
BERT_ARCHITECTURES = ("BertModel", "BertForMaskedLM")
OUT_TYPES = ("f32", "f16", "q8_0")

# Token types, as tokenizer.ggml.token_type stores them (same numbers as
# SentencePiece's piece types).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The pre-tokenizer split regex of Llama 3's tokenizer.json. A BPE vocabulary
# that splits with exactly this pattern gets tokenizer.ggml.pre = "llama-bpe".
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

Progress = Callable[[int, int], None]


def convert_hf(
    hf_dir: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    out_type: str = "f16",
    progress: Progress | None = None,
    pooling: str | None = None,
) -> Path:
    """Write ``hf_dir`` (config.json, weights, tokenizer) as a GGUF ``llama`` or ``bert`` file.

    ``out_type`` is the type of 2-D weight matrices: "f32", "f16" or "q8_0" (q8_0
    only where the row length is a multiple of 32, f16 otherwise); norms and other
    1-D tensors stay f32. ``progress(done, total)`` is called after each tensor.
    ``pooling`` ("mean", "cls", "last" or "none") overrides how a BERT model pools
    its embeddings (default: its sentence-transformers config, else mean).
    The file is written beside ``out_path`` and renamed into place when complete.
    """
    if out_type not in OUT_TYPES:
        raise ValueError(f"unknown out_type {out_type!r}; choose one of {', '.join(OUT_TYPES)}")
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    config = _read_json(hf_dir / "config.json", required=True)
    name = hf_dir.resolve().name
    arch = "bert" if _is_bert(config) else "llama"
    if arch == "bert":
        bert = _BertParams.from_config(config, _bert_pooling(hf_dir, pooling))
        plan = _plan_bert_tensors(bert, _open_weights(hf_dir), out_type)
        vocab = _wordpiece_vocab(hf_dir, bert.vocab_size)

        def metadata(writer: Any) -> None:
            _write_bert_metadata(writer, bert, out_type, name)
            _write_vocab(writer, vocab)
            writer.add_token_type_count(bert.type_vocab_size)
    else:
        if pooling is not None:
            raise ValueError("pooling applies to embedding models (BERT); this is a text generation model")
        hp = _HParams.from_config(config)
        plan = _plan_tensors(hp, _Safetensors(_weight_files(hf_dir)), out_type)
        vocab = _read_vocab(hf_dir, hp.vocab_size)

        def metadata(writer: Any) -> None:
            _write_metadata(writer, hp, out_type, name)
            _write_vocab(writer, vocab)

    tmp_path = out_path.with_name(out_path.name + ".tmp")
    writer = gguf.GGUFWriter(tmp_path, arch)
    try:
        metadata(writer)
        for t in plan:
            writer.add_tensor_info(t.name, t.byte_shape, t.np_dtype, t.nbytes, raw_dtype=t.raw_dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i, t in enumerate(plan):
            writer.write_tensor_data(t.encode(t.load()))
            if progress is not None:
                progress(i + 1, len(plan))
        writer.close()
        os.replace(tmp_path, out_path)
    finally:
        writer.close()
        tmp_path.unlink(missing_ok=True)
    return out_path


# --- hyper-parameters -------------------------------------------------------


@dataclass(frozen=True)
class _HParams:
    n_layers: int
    n_embd: int
    n_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rms_eps: float
    rope_theta: float
    rope: dict[str, Any]  # the config's rope scaling parameters, "rope_type" normalised
    tie_embeddings: bool

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> _HParams:
        arch = (cfg.get("architectures") or [None])[0]
        if arch is None:  # a bare config.json without "architectures"
            arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}.get(cfg.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for flag in ("attention_bias", "mlp_bias"):
            if cfg.get(flag):
                raise ValueError(f"config.json sets {flag}=true; biases are not supported by this converter")
        # transformers >= 5 writes "rope_parameters" (with rope_theta inside);
        # older versions write "rope_theta" and "rope_scaling" ("type" or "rope_type").
        rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
        rope["rope_type"] = rope.get("rope_type", rope.get("type")) or "default"
        n_heads = cfg["num_attention_heads"]
        return cls(
            n_layers=cfg["num_hidden_layers"],
            n_embd=cfg["hidden_size"],
            n_ff=cfg["intermediate_size"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            vocab_size=cfg["vocab_size"],
            context_length=cfg.get("max_position_embeddings") or 2048,
            rms_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rope=rope,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )


def _write_header(writer: Any, hp: _HParams | _BertParams, out_type: str, name: str) -> None:
    """The keys every architecture has: name, file type, and the transformer's sizes."""
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[out_type]
    writer.add_name(name)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(hp.context_length)
    writer.add_embedding_length(hp.n_embd)
    writer.add_block_count(hp.n_layers)
    writer.add_feed_forward_length(hp.n_ff)
    writer.add_head_count(hp.n_heads)


def _write_metadata(writer: Any, hp: _HParams, out_type: str, name: str) -> None:
    _write_header(writer, hp, out_type, name)
    writer.add_head_count_kv(hp.n_kv_heads)
    writer.add_layer_norm_rms_eps(hp.rms_eps)
    writer.add_rope_freq_base(hp.rope_theta)
    writer.add_rope_dimension_count(hp.head_dim)
    if hp.head_dim != hp.n_embd // hp.n_heads:
        writer.add_key_length(hp.head_dim)
        writer.add_value_length(hp.head_dim)
    writer.add_vocab_size(hp.vocab_size)

    rope, kind = hp.rope, hp.rope["rope_type"]
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif kind == "yarn":
        # Same keys as llama.cpp's converter; HF's optional yarn parameters are
        # passed through unchanged (the runtime supplies its defaults for absent ones).
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(
            int(rope.get("original_max_position_embeddings") or hp.context_length))
        optional = {"extrapolation_factor": writer.add_rope_scaling_yarn_ext_factor,
                    "attention_factor": writer.add_rope_scaling_yarn_attn_factor,
                    "beta_fast": writer.add_rope_scaling_yarn_beta_fast,
                    "beta_slow": writer.add_rope_scaling_yarn_beta_slow}
        for key, add in optional.items():
            if rope.get(key) is not None:
                add(float(rope[key]))
    elif kind not in ("default", "llama3"):  # llama3 is carried by rope_freqs.weight
        raise ValueError(f"unsupported rope scaling type {kind!r}; supported: linear, yarn, llama3")


def llama3_rope_factors(
    head_dim: int, base: float, factor: float, low_freq_factor: float,
    high_freq_factor: float, original_context: int,
) -> np.ndarray:
    """Per-frequency divisors for Llama 3.1 rope scaling (``rope_freqs.weight``).

    ggml divides rotation frequency i by factor i. Llama 3.1 leaves frequencies
    whose wavelength is shorter than ``original_context / high_freq_factor``
    alone, slows those longer than ``original_context / low_freq_factor`` by
    ``factor``, and interpolates smoothly in between.
    """
    inv_freq = base ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    with np.errstate(divide="ignore", invalid="ignore"):
        smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        between = 1.0 / ((1 - smooth) / factor + smooth)
    factors = np.where(wavelen < original_context / high_freq_factor, 1.0,
                       np.where(wavelen > original_context / low_freq_factor, factor, between))
    return factors.astype(np.float32)


# --- tensors ----------------------------------------------------------------


def to_interleaved_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder q/k projection rows from HF's half-split rope layout to ggml's interleaved one.

    HF Llama rotates dimension i of each head together with dimension i + d/2
    ("rotate_half"); GGUF ``llama`` files are run with ggml's normal rope, which
    rotates dimensions 2i and 2i+1. Both use frequency base^(-2i/d) for pair i,
    so moving row i of each head to 2i and row i + d/2 to 2i + 1 makes ggml
    compute the same rotation. Attention scores are unchanged because q and k are
    reordered alike; v and the output projection are left as they are.
    """
    head_dim = w.shape[0] // n_heads
    # rows of one head as (half, pair member), then read pair-member-fastest
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def from_interleaved_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of :func:`to_interleaved_rope` (GGUF rows back to HF order)."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class _PlannedTensor:
    name: str
    shape: tuple[int, ...]  # numpy order (rows, cols)
    qtype: str  # "f32" | "f16" | "q8_0"
    load: Callable[[], np.ndarray]  # float32 data in GGUF layout

    @property
    def np_dtype(self) -> type:
        return {"f32": np.float32, "f16": np.float16, "q8_0": np.uint8}[self.qtype]

    @property
    def raw_dtype(self) -> Any:
        return gguf.GGMLQuantizationType.Q8_0 if self.qtype == "q8_0" else None

    @property
    def byte_shape(self) -> tuple[int, ...]:
        if self.qtype != "q8_0":
            return self.shape
        return gguf.quant_shape_to_byte_shape(self.shape, gguf.GGMLQuantizationType.Q8_0)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.byte_shape)) * np.dtype(self.np_dtype).itemsize

    def encode(self, data: np.ndarray) -> np.ndarray:
        if self.qtype == "q8_0":
            return gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
        return np.ascontiguousarray(data, dtype=self.np_dtype)


def _plan_tensors(hp: _HParams, weights: _Safetensors, out_type: str) -> list[_PlannedTensor]:
    """Map every HF tensor to its GGUF name, layout and type, failing on any missing or unknown name."""
    per_layer = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                 "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                 "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
                 "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    names = {"token_embd.weight": "model.embed_tokens.weight"}
    for i in range(hp.n_layers):
        for ours, theirs in per_layer.items():
            names[f"blk.{i}.{ours}.weight"] = f"model.layers.{i}.{theirs}.weight"
    names["output_norm.weight"] = "model.norm.weight"
    if not hp.tie_embeddings:
        names["output.weight"] = "lm_head.weight"

    missing = sorted(hf for hf in names.values() if hf not in weights.shapes)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing)}")
    ignorable = {"lm_head.weight"} if hp.tie_embeddings else set()
    wanted = set(names.values()) | ignorable
    unknown = sorted(n for n in weights.shapes if n not in wanted and not n.endswith("rotary_emb.inv_freq"))
    if unknown:
        raise ValueError(f"checkpoint has tensors this converter does not know: {', '.join(unknown[:10])}")

    q, kv, embd, ff = hp.n_heads * hp.head_dim, hp.n_kv_heads * hp.head_dim, hp.n_embd, hp.n_ff
    expected = {"token_embd": (hp.vocab_size, embd), "output": (hp.vocab_size, embd), "attn_q": (q, embd),
                "attn_k": (kv, embd), "attn_v": (kv, embd), "attn_output": (embd, q), "ffn_gate": (ff, embd),
                "ffn_up": (ff, embd), "ffn_down": (embd, ff)}
    for ours, theirs in names.items():
        want = expected.get(ours.split(".")[-2], (embd,))  # the rest are norms
        if weights.shapes[theirs] != want:
            raise ValueError(f"{theirs} has shape {weights.shapes[theirs]} but config.json implies {want}")

    plan = []
    if hp.rope["rope_type"] == "llama3":
        r = hp.rope
        factors = llama3_rope_factors(
            hp.head_dim, hp.rope_theta, float(r["factor"]), float(r.get("low_freq_factor", 1.0)),
            float(r.get("high_freq_factor", 4.0)), int(r.get("original_max_position_embeddings", 8192)))
        plan.append(_PlannedTensor("rope_freqs.weight", factors.shape, "f32", lambda: factors))
    for ours, theirs in names.items():
        shape = weights.shapes[theirs]
        qtype = "f32"
        if len(shape) == 2:
            qtype = out_type if out_type != "q8_0" or shape[1] % 32 == 0 else "f16"
        heads = {".attn_q.": hp.n_heads, ".attn_k.": hp.n_kv_heads}
        n_heads = next((n for key, n in heads.items() if key in ours), None)
        plan.append(_PlannedTensor(ours, shape, qtype, _loader(weights, theirs, n_heads)))
    return plan


def _loader(weights: _Safetensors, name: str, rope_heads: int | None) -> Callable[[], np.ndarray]:
    if rope_heads is None:
        return lambda: weights.load(name)
    return lambda: to_interleaved_rope(weights.load(name), rope_heads)


def _weight_files(hf_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files: those of the shard index if there is one."""
    index = _read_json(hf_dir / "model.safetensors.index.json")
    if index:
        files = sorted({hf_dir / f for f in index["weight_map"].values()})
    elif (hf_dir / "model.safetensors").exists():
        files = [hf_dir / "model.safetensors"]
    else:
        files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {hf_dir} (PyTorch .bin checkpoints are not supported)")
    for f in files:
        if not f.exists():
            raise FileNotFoundError(f"shard {f.name} listed in model.safetensors.index.json is missing")
    return files


_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}


class _Safetensors:
    """Memory-mapped reader for safetensors files (numpy has no bfloat16, so this is done by hand)."""

    def __init__(self, files: list[Path]) -> None:
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._where: dict[str, tuple[np.memmap, str, int, int]] = {}
        for path in files:
            with open(path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
            data = np.memmap(path, dtype=np.uint8, mode="r")
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                begin, end = info["data_offsets"]
                self.shapes[name] = tuple(info["shape"])
                self._where[name] = (data, info["dtype"], 8 + header_len + begin, 8 + header_len + end)

    def load(self, name: str) -> np.ndarray:
        """The tensor as float32."""
        data, dtype, begin, end = self._where[name]
        if dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name} has dtype {dtype}; supported: {', '.join(_ST_DTYPES)}")
        raw = data[begin:end].view(_ST_DTYPES[dtype]).reshape(self.shapes[name])
        if dtype == "BF16":  # bfloat16 is the top half of a float32
            return (raw.astype(np.uint32) << 16).view(np.float32)
        return raw.astype(np.float32)


# --- vocabulary -------------------------------------------------------------


@dataclass
class _Vocab:
    model: str  # "llama" (SentencePiece), "gpt2" (byte-level BPE) or "bert" (WordPiece)
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

    def pad_to(self, n: int) -> None:
        """Give ids up to ``n`` placeholder tokens (embedding rows that no token uses)."""
        for i in range(len(self.tokens), n):
            self.tokens.append(f"[PAD{i}]")
            self.types.append(UNUSED)
            if self.scores is not None:
                self.scores.append(-1000.0)


def _read_vocab(hf_dir: Path, n_vocab: int) -> _Vocab:
    """Read tokenizer.model (preferred) or tokenizer.json, padded to the embedding's ``n_vocab`` rows."""
    tok_config = _read_json(hf_dir / "tokenizer_config.json") or {}
    tok_json = _read_json(hf_dir / "tokenizer.json")
    added = _added_tokens(hf_dir, tok_config, tok_json)
    if (hf_dir / "tokenizer.model").exists():
        vocab = _spm_vocab(hf_dir / "tokenizer.model", added)
    elif tok_json is not None:
        vocab = _bpe_vocab(tok_json, added)
    else:
        raise FileNotFoundError(f"no tokenizer.model or tokenizer.json in {hf_dir}")
    if len(vocab.tokens) > n_vocab:
        raise ValueError(f"tokenizer has {len(vocab.tokens)} tokens but the model's vocab_size is {n_vocab}")
    vocab.pad_to(n_vocab)

    ids = {tok: i for i, tok in enumerate(vocab.tokens)}
    special_map = _read_json(hf_dir / "special_tokens_map.json") or {}
    config = _read_json(hf_dir / "config.json") or {}
    for kind in ("bos", "eos", "unk", "pad"):
        tok = tok_config.get(f"{kind}_token") or special_map.get(f"{kind}_token")
        tok = tok.get("content") if isinstance(tok, dict) else tok
        fallback = config.get(f"{kind}_token_id")
        fallback = fallback[0] if isinstance(fallback, list) and fallback else fallback
        if isinstance(tok, str) and tok in ids:
            vocab.special[kind] = ids[tok]
        elif isinstance(fallback, int) and 0 <= fallback < n_vocab:
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
    for content, i in (_read_json(hf_dir / "added_tokens.json") or {}).items():
        added[int(i)] = (content, False)
    for i, t in (tok_config.get("added_tokens_decoder") or {}).items():
        added[int(i)] = (t["content"], bool(t.get("special")))
    for t in (tok_json or {}).get("added_tokens", []):
        added[int(t["id"])] = (t["content"], bool(t.get("special")))
    return added


def _apply_added(vocab: _Vocab, added: dict[int, tuple[str, bool]]) -> None:
    """Place added tokens: new ids are appended, base tokens marked normal become user-defined/control."""
    for i in sorted(added):
        content, special = added[i]
        kind = CONTROL if special else USER_DEFINED
        vocab.pad_to(i + 1)
        if vocab.types[i] in (NORMAL, UNUSED):
            vocab.tokens[i], vocab.types[i] = content, kind


def _spm_vocab(path: Path, added: dict[int, tuple[str, bool]]) -> _Vocab:
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
    vocab = _Vocab("llama", tokens, types, special, scores=scores, add_bos=True, add_eos=False,
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


def _bpe_vocab(tok_json: dict, added: dict[int, tuple[str, bool]]) -> _Vocab:
    model = tok_json.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"tokenizer.json model type {model.get('type')!r} is not supported (only BPE)")
    if not _find([tok_json.get("pre_tokenizer"), tok_json.get("decoder")], "ByteLevel"):
        raise ValueError("tokenizer.json is a BPE without ByteLevel bytes (SentencePiece-style); "
                         "add the model's tokenizer.model to convert it")
    size = max(model["vocab"].values()) + 1
    tokens, types = [f"[PAD{i}]" for i in range(size)], [UNUSED] * size
    for tok, i in model["vocab"].items():
        tokens[i], types[i] = tok, NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    vocab = _Vocab("gpt2", tokens, types, {}, merges=merges, pre=_bpe_pre(tok_json))
    _apply_added(vocab, added)
    vocab.add_bos, vocab.add_eos = _template_adds(tok_json)
    return vocab


def _bpe_pre(tok_json: dict) -> str:
    """Name the pre-tokenizer for tokenizer.ggml.pre.

    Rule: "llama-bpe" when a Split uses exactly Llama 3's regex; "gpt-2" when the
    only splitting is ByteLevel's own (GPT-2) regex; "default" for anything else.
    """
    pre = tok_json.get("pre_tokenizer")
    patterns = [(s.get("pattern") or {}).get("Regex") for s in _find(pre, "Split")]
    if LLAMA3_PATTERN in patterns:
        return "llama-bpe"
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


def _write_vocab(writer: Any, vocab: _Vocab) -> None:
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


def _read_json(path: Path, required: bool = False) -> Any:
    if not path.exists():
        if required:
            raise FileNotFoundError(
                f"{path.name} not found in {path.parent} (is this a Hugging Face model directory?)")
        return None
    return json.loads(path.read_text(encoding="utf-8"))


# --- BERT (GGUF "bert": sentence-embedding encoders) -------------------------

# HF module path inside encoder.layer.N -> GGUF name inside blk.N
_BERT_LAYER = {
    "attention.self.query": "attn_q", "attention.self.key": "attn_k", "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output", "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up", "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm",
}
_BERT_EMBEDDINGS = {
    "embeddings.word_embeddings": "token_embd", "embeddings.token_type_embeddings": "token_types",
    "embeddings.position_embeddings": "position_embd", "embeddings.LayerNorm": "token_embd_norm",
}
# sentence-transformers Pooling config flag -> gguf pooling type
_POOLING_FLAGS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}
_WORDPIECE_SPECIALS = ("unk", "sep", "pad", "cls", "mask")


def _is_bert(cfg: dict[str, Any]) -> bool:
    arch = (cfg.get("architectures") or [None])[0]
    return arch in BERT_ARCHITECTURES or (arch is None and cfg.get("model_type") == "bert")


@dataclass(frozen=True)
class _BertParams:
    n_layers: int
    n_embd: int
    n_ff: int
    n_heads: int
    vocab_size: int
    context_length: int
    type_vocab_size: int
    eps: float
    pooling: gguf.PoolingType

    @classmethod
    def from_config(cls, cfg: dict[str, Any], pooling: gguf.PoolingType) -> _BertParams:
        act = cfg.get("hidden_act", "gelu")
        if act != "gelu":  # the runtime applies exact (erf) GELU, which is what BERT's "gelu" means
            raise ValueError(f"config.json has hidden_act={act!r}; only 'gelu' BERT models are supported")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"config.json has position_embedding_type={cfg['position_embedding_type']!r}; "
                             "only absolute position embeddings are supported")
        if cfg["hidden_size"] % cfg["num_attention_heads"]:
            raise ValueError("config.json: hidden_size is not a multiple of num_attention_heads")
        return cls(
            n_layers=cfg["num_hidden_layers"],
            n_embd=cfg["hidden_size"],
            n_ff=cfg["intermediate_size"],
            n_heads=cfg["num_attention_heads"],
            vocab_size=cfg["vocab_size"],
            context_length=cfg.get("max_position_embeddings") or 512,
            type_vocab_size=cfg.get("type_vocab_size") or 2,
            eps=float(cfg.get("layer_norm_eps", 1e-12)),
            pooling=pooling,
        )


def _bert_pooling(hf_dir: Path, override: str | None) -> gguf.PoolingType:
    """The override, else the sentence-transformers Pooling module's mode, else mean."""
    names = {"none": gguf.PoolingType.NONE, "mean": gguf.PoolingType.MEAN, "cls": gguf.PoolingType.CLS,
             "last": gguf.PoolingType.LAST}
    if override is not None:
        if override not in names:
            raise ValueError(f"unknown pooling {override!r}; choose one of {', '.join(names)}")
        return names[override]
    for module in _read_json(hf_dir / "modules.json") or []:
        if module.get("type", "").endswith("Pooling"):
            pool_cfg = _read_json(hf_dir / module.get("path", "") / "config.json") or {}
            modes = [mode for flag, mode in _POOLING_FLAGS.items() if pool_cfg.get(flag)]
            others = [k for k, v in pool_cfg.items() if k.startswith("pooling_mode") and v and k not in _POOLING_FLAGS]
            if len(modes) != 1 or others:
                raise ValueError(f"{module.get('path')}/config.json asks for pooling {modes + others}; supported: "
                                 "exactly one of mean, cls, lasttoken (pass pooling=... to override)")
            return names[modes[0]]
    return gguf.PoolingType.MEAN


def _write_bert_metadata(writer: Any, hp: _BertParams, out_type: str, name: str) -> None:
    _write_header(writer, hp, out_type, name)
    writer.add_layer_norm_eps(hp.eps)
    writer.add_causal_attention(False)
    writer.add_pooling_type(hp.pooling)


def _plan_bert_tensors(hp: _BertParams, weights: Any, out_type: str) -> list[_PlannedTensor]:
    """Map a BertModel / BertForMaskedLM state dict to GGUF names; heads (pooler, MLM) are dropped."""
    hf_names = {n.removeprefix("bert."): n for n in weights.shapes}
    names: dict[str, str] = {}  # GGUF name -> HF name
    for hf, ours in _BERT_EMBEDDINGS.items():
        names[f"{ours}.weight"] = f"{hf}.weight"
        if ours == "token_embd_norm":
            names[f"{ours}.bias"] = f"{hf}.bias"
    for i in range(hp.n_layers):
        for hf, ours in _BERT_LAYER.items():
            for kind in ("weight", "bias"):
                names[f"blk.{i}.{ours}.{kind}"] = f"encoder.layer.{i}.{hf}.{kind}"
    for ours, hf in list(names.items()):  # old checkpoints call LayerNorm parameters gamma and beta
        old = hf.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
        if hf not in hf_names and old in hf_names:
            names[ours] = old
    missing = sorted(hf for hf in names.values() if hf not in hf_names)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing)}")
    ignored = ("pooler.", "cls.", "embeddings.position_ids")
    unknown = sorted(n for n in hf_names if n not in names.values() and not n.startswith(ignored))
    if unknown:
        raise ValueError(f"checkpoint has tensors this converter does not know: {', '.join(unknown[:10])}")

    embd, ff = hp.n_embd, hp.n_ff
    matrices = {"token_embd": (hp.vocab_size, embd), "token_types": (hp.type_vocab_size, embd),
                "position_embd": (hp.context_length, embd), "ffn_up": (ff, embd), "ffn_down": (embd, ff)}
    plan = []
    for ours, hf in names.items():
        shape = weights.shapes[hf_names[hf]]
        base, kind = ours.split(".")[-2:]
        if base.endswith("norm") or kind == "bias":
            want = (ff,) if base == "ffn_up" else (embd,)
        else:
            want = matrices.get(base, (embd, embd))  # the attention projections
        if shape != want:
            raise ValueError(f"{hf_names[hf]} has shape {shape} but config.json implies {want}")
        qtype = "f32"
        if len(shape) == 2 and base not in ("token_types", "position_embd"):  # as llama.cpp: those stay f32
            qtype = out_type if out_type != "q8_0" or shape[1] % 32 == 0 else "f16"
        plan.append(_PlannedTensor(ours, shape, qtype, functools.partial(weights.load, hf_names[hf])))
    return plan


def _wordpiece_vocab(hf_dir: Path, n_vocab: int) -> _Vocab:
    """vocab.txt (or tokenizer.json's WordPiece model) in GGUF form: word-start pieces get a leading
    U+2581, continuations lose their "##", control tokens ([CLS], [SEP], ...) stay as they are."""
    tok_config = _read_json(hf_dir / "tokenizer_config.json") or {}
    if tok_config.get("do_lower_case") is False:
        raise ValueError("the tokenizer is cased (do_lower_case=false); GGUF's bert tokenizer lowercases, "
                         "so only uncased WordPiece vocabularies convert faithfully")
    tok_json = _read_json(hf_dir / "tokenizer.json")
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
    special_map = _read_json(hf_dir / "special_tokens_map.json") or {}
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
    vocab = _Vocab("bert", tokens, types, special, pre="default", add_bos=True, add_eos=False, add_sep=True)
    vocab.pad_to(n_vocab)
    return vocab


def _open_weights(hf_dir: Path) -> Any:
    """The checkpoint's safetensors, else its PyTorch pytorch_model.bin (read with torch)."""
    has_bin = (hf_dir / "pytorch_model.bin").exists() or (hf_dir / "pytorch_model.bin.index.json").exists()
    if has_bin and not list(hf_dir.glob("*.safetensors")):
        return _TorchCheckpoint(hf_dir)
    return _Safetensors(_weight_files(hf_dir))


class _TorchCheckpoint:
    """pytorch_model.bin (or its shards) as float32 numpy arrays; needs torch."""

    def __init__(self, hf_dir: Path) -> None:
        try:
            import torch
        except ImportError:
            raise ImportError(f"{hf_dir} has PyTorch .bin weights, which need torch to read "
                              "(pip install torch, or convert them to safetensors)") from None
        index = _read_json(hf_dir / "pytorch_model.bin.index.json")
        files = sorted({hf_dir / f for f in index["weight_map"].values()}) if index else [hf_dir / "pytorch_model.bin"]
        self._tensors: dict[str, Any] = {}
        for f in files:
            self._tensors.update(torch.load(f, map_location="cpu", weights_only=True))
        self.shapes = {name: tuple(t.shape) for name, t in self._tensors.items()}

    def load(self, name: str) -> np.ndarray:
        return self._tensors[name].float().numpy()
