"""Tiny, randomly initialised Hugging Face Llama/Mistral checkpoints built offline.

Shared by the converter tests and the logits-parity tests: everything is built
locally from a fixed seed (a generated corpus, a BPE or SentencePiece tokenizer
trained on it, a model constructed from its config), so no network is needed.
Requires torch, transformers and tokenizers (bpe) or sentencepiece (spm).
"""

from __future__ import annotations

import inspect
import io
import json
import random
from pathlib import Path
from typing import Any

import numpy as np

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")  # Qwen 2/3: digits one by one
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_WORDS = (
    "the of and to in is it you that he was for on are with as his they be at one have this from "
    "or had by hot word but what some we can out other were all there when up use your how said an "
    "each she which do their time if will way about many then them write would like so these her long "
    "make thing see him two has look more day could go come did number sound no most people my over "
    "know water than call first who may down side been now find head stand own page should country "
    "found answer school grow study still learn plant cover food sun four between state keep eye never"
).split()


def corpus(seed: int = 0, n_lines: int = 300) -> list[str]:
    """Deterministic English-like lines with some punctuation, digits and non-ASCII."""
    rng = random.Random(seed)
    extras = ["42", "2024", "café", "naïve", "über", "—", "?", "!", ",", "'s", "(x)"]
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.5:
            words.insert(rng.randrange(len(words)), rng.choice(extras))
        line = " ".join(words)
        lines.append(line[0].upper() + line[1:] + rng.choice([".", "?", "!", ""]))
    return lines


def make_bpe_tokenizer(out_dir: Path, seed: int = 0, vocab_size: int = 384, pattern: str = LLAMA3_PATTERN) -> int:
    """Train a byte-level BPE with Llama 3's split pattern; write tokenizer.json and tokenizer_config.json.

    Returns the number of token ids (base vocabulary plus added tokens).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(seed), trainer)
    tok.add_tokens(["<tool>"])  # a non-special added token: USER_DEFINED in GGUF
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)])
    tok.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>", "pad_token": "<|pad|>", "chat_template": CHAT_TEMPLATE,
        "model_max_length": 256,
    })
    return tok.get_vocab_size(with_added_tokens=True)


def make_spaced_bpe_tokenizer(out_dir: Path, seed: int = 0, vocab_size: int = 400) -> int:
    """Train a BPE over SentencePiece-style text, as Gemma 4's tokenizer.json: spaces written as U+2581, no
    pre-tokenizer, characters outside the vocabulary spelled in <0xXX> byte tokens (in the model's vocabulary);
    write tokenizer.json and tokenizer_config.json. Returns the number of token ids."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(corpus(seed), trainer)
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", bos)])
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # the byte tokens, as Gemma's vocabulary has them
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    (out_dir / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    _write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "unk_token": "<unk>", "add_bos_token": True, "chat_template": CHAT_TEMPLATE})
    return len(vocab)


def make_qwen_tokenizer(out_dir: Path, seed: int = 0, vocab_size: int = 384) -> int:
    """Train a byte-level BPE the Qwen 2/3 way: Qwen's split pattern, ChatML special tokens, no BOS
    (no post-processor template, ``bos_token`` null); write tokenizer.json and tokenizer_config.json."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(seed), trainer)
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])  # after the base vocabulary
    tok.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE, "model_max_length": 256,
    })
    return tok.get_vocab_size(with_added_tokens=True)


def make_spm_tokenizer(out_dir: Path, seed: int = 0, vocab_size: int = 400, symbols: tuple[str, ...] = ()) -> int:
    """Train a SentencePiece BPE with byte fallback (Llama 2 style ids); write tokenizer.model and config.
    ``symbols``: more user-defined tokens (after ``<tool>``)."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus(seed)), model_writer=model, vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, user_defined_symbols=["<tool>", *symbols],
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2)
    (out_dir / "tokenizer.model").write_bytes(model.getvalue())
    _write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE,
    })
    return vocab_size


# what ``save_random`` redraws: name suffix(es) -> (offset, scale)
NORMS_AROUND_1 = {"norm.weight": (1.0, 0.1)}
SHARP_ROUTER = {"gate.weight": (0.0, 0.5)}  # a router sharp enough that the choice matters
CORRECTION_BIAS = {"e_score_correction_bias": (0.0, 0.05)}  # DeepSeek V3-style routing's bias (a buffer)
# norms, kernels, A, D and the time-step bias: decays from fast to slow, time steps around 1
MAMBA2_REDRAW = NORMS_AROUND_1 | {("conv1d.weight", "conv1d.bias", "A_log", "D", "dt_bias"): (0.0, 0.5)}
BERT_REDRAW = {"LayerNorm.weight": (1.0, 0.1), "bias": (0.0, 0.1)}  # LayerNorm weights, every bias


def new_checkpoint(tmp_path: Path, name: str, seed: int, make_tokenizer=make_bpe_tokenizer) -> tuple[Path, int]:
    """The folder ``tmp_path/name`` (made) with a tokenizer ``make_tokenizer(folder, seed)`` in it, and the
    embedding's rows: the vocabulary padded to a multiple of 32, as many real checkpoints are."""
    hf_dir = Path(tmp_path) / name
    hf_dir.mkdir(parents=True, exist_ok=True)
    n_tokens = make_tokenizer(hf_dir, seed)
    return hf_dir, -(-n_tokens // 32) * 32


def save_random(hf_dir: Path, model_cls, config, seed: int, redraw: dict, buffers: dict | None = None,
                model_kwargs: dict | None = None, **save_kwargs: Any) -> tuple[Path, Any]:
    """Build ``model_cls(config)`` from ``seed`` (float32, eval mode), redraw as ``offset + scale * randn`` the
    parameters (and ``buffers``) whose names end with a key of ``redraw`` (a suffix or a tuple of them, mapped to
    ``(offset, scale)``; the first key that matches counts), so that a swapped or misplaced one shows in the parity
    tests, and save it to ``hf_dir``. Returns ``(hf_dir, model)``."""
    import torch

    torch.manual_seed(seed)
    model = model_cls(config, **(model_kwargs or {})).float().eval()
    with torch.no_grad():
        for tensors, keys in ((model.named_parameters(), redraw), (model.named_buffers(), buffers or {})):
            for name, t in tensors:
                offset, scale = next((v for k, v in keys.items() if name.endswith(k)), (None, None))
                if scale is not None:
                    t.copy_(offset + scale * torch.randn_like(t))
    model.save_pretrained(hf_dir, **save_kwargs)
    return hf_dir, model


def make_tiny_llama(
    tmp_path: Path,
    *,
    n_kv_heads: int = 2,
    tie: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    vocab: str = "bpe",
    seed: int = 0,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    arch: str = "llama",
    max_shard_size: str | None = None,
    config_extra: dict[str, Any] | None = None,
    n_layers: int = 2,
) -> tuple[Path, Any]:
    """Build and save an ``n_layers``-layer, 4-head, 64-wide random model with a locally trained tokenizer.

    Returns ``(hf_dir, hf_model)``; the model is float32 in eval mode. ``arch`` is "llama",
    "mistral", "qwen2", "qwen3", "qwen3moe", "phi3", "gpt_oss", "smollm3" or "ministral3" (``config_extra`` adds config
    arguments);
    ``vocab`` is "bpe" (tokenizer.json), "spm" (tokenizer.model) or "qwen" (Qwen's tokenizer.json);
    the embedding is padded to a multiple of 32 rows, as many real checkpoints are. Norm weights
    are randomised around 1 and biases around 0 so that a
    swapped or missing one shows up in parity tests.
    """
    import transformers

    hf_dir = Path(tmp_path) / f"tiny-{arch}-{vocab}-kv{n_kv_heads}-{'tied' if tie else 'untied'}-s{seed}"
    hf_dir.mkdir(parents=True, exist_ok=True)
    if vocab == "bpe":
        n_tokens = make_bpe_tokenizer(hf_dir, seed)
        bos, eos = 0, 1  # the trainer puts special tokens first
    elif vocab == "spm":
        n_tokens = make_spm_tokenizer(hf_dir, seed)
        bos, eos = 1, 2
        if arch == "phi3":  # Phi-3's <|endoftext|> is added after the SentencePiece model (llama.cpp needs it)
            tok_config = json.loads((hf_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
            tok_config["added_tokens_decoder"] = {str(n_tokens): {"content": "<|endoftext|>", "special": True}}
            _write_json(hf_dir / "tokenizer_config.json", tok_config)
            n_tokens += 1
    elif vocab == "qwen":
        n_tokens = make_qwen_tokenizer(hf_dir, seed)
        bos, eos = n_tokens - 3, n_tokens - 1  # <|endoftext|> (as Qwen's config.json), <|im_end|>
    else:
        raise ValueError(f"vocab must be 'bpe', 'spm' or 'qwen', not {vocab!r}")

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
        "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM),
        "ministral3": (transformers.Ministral3Config, transformers.Ministral3ForCausalLM),
    }[arch]
    extra = {"head_dim": head_dim or 16} if head_dim or arch.startswith("qwen3") else {}  # Qwen3's default: 128
    if arch == "qwen3moe":  # 4 experts of 32, 2 chosen per token
        extra |= {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}
    if rope_scaling is not None:
        extra["rope_scaling"] = rope_scaling
    if arch == "gpt_oss":  # 4 experts of 128 (2 chosen), a 4-token window on even layers, no YaRN
        extra |= {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "attn_implementation": "eager"}
    if arch == "phi3":  # Phi3Config's defaults name token 32000 and a 2047-token window
        extra |= {"pad_token_id": eos, "sliding_window": None}
    if arch == "smollm3":  # SmolLM3Config's default pad token is 128004
        extra |= {"pad_token_id": eos}
    extra |= config_extra or {}
    config = config_cls(
        vocab_size=-(-n_tokens // 32) * 32, hidden_size=64, intermediate_size=intermediate_size,
        num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=n_kv_heads,
        max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0, initializer_range=0.05,
        tie_word_embeddings=tie, bos_token_id=bos, eos_token_id=eos, **extra)
    kwargs: dict[str, Any] = {}
    if "safe_serialization" in inspect.signature(model_cls.save_pretrained).parameters:  # transformers 4.x; 5.x
        kwargs["safe_serialization"] = True  # always writes safetensors
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    # Qwen 2's q/k/v biases are initialised to zero
    return save_random(hf_dir, model_cls, config, seed, NORMS_AROUND_1 | {"bias": (0.0, 0.1)}, **kwargs)


def make_tiny_lfm2(tmp_path: Path, *, layer_types: tuple[str, ...] = ("conv", "full_attention", "conv", "conv"),
                   n_kv_heads: int = 2, conv_taps: int = 3, tie: bool = True, auto_adjust_ff: bool = False,
                   moe: bool = False, seed: int = 0) -> tuple[Path, Any]:
    """Build and save a random LFM2 model (64 wide, 4 heads of 16, convolution and attention layers as
    ``layer_types``) with a BPE tokenizer. Returns ``(hf_dir, hf_model)`` (float32, eval mode). Norm
    weights are randomised around 1. ``auto_adjust_ff``: the MLP width is derived from ``block_ff_dim``
    (2/3 of it, rounded up to ``block_multiple_of``) as in the released checkpoints. ``moe``: an LFM2-MoE
    model (the first layer dense, then 8 experts of 32, 2 chosen per token, a random expert bias)."""
    import transformers

    kinds = "".join(t[0] for t in layer_types)
    hf_dir, vocab_rows = new_checkpoint(tmp_path, f"tiny-lfm2{'moe' if moe else ''}-{kinds}-k{conv_taps}-s{seed}", seed)
    common = dict(
        vocab_size=vocab_rows, hidden_size=64, num_hidden_layers=len(layer_types), num_attention_heads=4,
        num_key_value_heads=n_kv_heads, max_position_embeddings=256, norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, layer_types=list(layer_types),
        conv_L_cache=conv_taps, initializer_range=0.05, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=1,
        pad_token_id=2)
    if moe:
        config = transformers.Lfm2MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                            num_experts_per_tok=2, num_dense_layers=1, **common)
        model_cls = transformers.Lfm2MoeForCausalLM
    else:
        config = transformers.Lfm2Config(intermediate_size=144 if auto_adjust_ff else 96,
                                         block_auto_adjust_ff_dim=auto_adjust_ff, block_multiple_of=32,
                                         block_ffn_dim_multiplier=1.0, **common)
        model_cls = transformers.Lfm2ForCausalLM
    # taps of either sign and size, so that a misplaced one shows; an expert bias large enough to change which
    # experts are chosen
    return save_random(hf_dir, model_cls, config, seed, NORMS_AROUND_1 | {"conv.conv.weight": (0.0, 0.5)},
                       buffers={"expert_bias": (0.0, 0.5)})


def make_tiny_granitehybrid(tmp_path: Path, *, layer_types: tuple[str, ...] = ("mamba", "attention", "mamba", "mamba"),
                            moe: bool = False, rope: bool = False, tie: bool = True, seed: int = 0) -> tuple[Path, Any]:
    """Build and save a random Granite 4.0 hybrid (GraniteMoeHybrid: 64 wide; Mamba-2 layers of 4 heads of
    32 in 2 groups, a 16-wide state, 4 taps and chunks of 8; attention of 4 heads over 2 KV heads) with a
    BPE tokenizer and Granite's multipliers. ``moe``: 4 experts of 32 (2 chosen) beside the shared MLP of
    48; else the shared MLP alone. ``rope``: rotary positions (Granite 4's hybrids have none). Returns
    ``(hf_dir, hf_model)`` (float32, eval mode); norms, A, D, the time-step bias and the kernels are
    randomised so that a misplaced one shows."""
    import transformers

    kinds = "".join(t[0] for t in layer_types)
    hf_dir, vocab_rows = new_checkpoint(
        tmp_path, f"tiny-granitehybrid-{kinds}{'-moe' if moe else ''}{'-rope' if rope else ''}-s{seed}", seed)
    config = transformers.GraniteMoeHybridConfig(
        vocab_size=vocab_rows, hidden_size=64, intermediate_size=32, shared_intermediate_size=48,
        num_hidden_layers=len(layer_types), num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, num_local_experts=4 if moe else 0, num_experts_per_tok=2, layer_types=list(layer_types),
        mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0,
        position_embedding_type="rope" if rope else None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=0.05, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    return save_random(hf_dir, transformers.GraniteMoeHybridForCausalLM, config, seed, MAMBA2_REDRAW)


def make_tiny_nemotron_h(tmp_path: Path, *, pattern: str = "M-*-M-", pattern_key: bool = False,
                         seed: int = 0) -> tuple[Path, Any]:
    """Build and save a random Nemotron-H (NemotronH: 64 wide; blocks by ``pattern``, M Mamba-2 (4 heads of
    16 in 2 groups, a 16-wide state, 4 taps, chunks of 8), * attention (4 heads of 16 over 2 KV heads),
    - a squared-ReLU MLP of 96) with a BPE tokenizer. ``pattern_key``: the config names the layers with
    the released checkpoints' ``hybrid_override_pattern`` string, not ``layers_block_type``. Returns
    ``(hf_dir, hf_model)`` (float32, eval mode); norms, A, D, the time-step bias and the kernels are
    randomised so that a misplaced one shows."""
    import transformers

    kinds = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
    hf_dir, vocab_rows = new_checkpoint(tmp_path, f"tiny-nemotron-h-{pattern.replace('*', 'A')}-s{seed}", seed)
    config = transformers.NemotronHConfig(
        vocab_size=vocab_rows, hidden_size=64, layers_block_type=[kinds[c] for c in pattern],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, max_position_embeddings=256,
        mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=8,
        layer_norm_epsilon=1e-5, initializer_range=0.05, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
        pad_token_id=2)
    hf_dir, model = save_random(hf_dir, transformers.NemotronHForCausalLM, config, seed, MAMBA2_REDRAW)
    if pattern_key:
        cfg = json.loads((hf_dir / "config.json").read_text())
        cfg.pop("layers_block_type", None)
        _write_json(hf_dir / "config.json", cfg | {"hybrid_override_pattern": pattern})
    return hf_dir, model


def make_tiny_gemma(tmp_path: Path, *, arch: str = "gemma3", n_layers: int = 6, n_kv_heads: int = 2,
                    sliding_window: int = 4, seed: int = 0) -> tuple[Path, Any]:
    """Build and save a random Gemma 2 / Gemma 3 text model (64 wide, 4 heads of 16) with a SentencePiece
    tokenizer. Returns ``(hf_dir, hf_model)`` (float32, eval mode, eager attention). ``sliding_window`` is
    small so that prompts run past it; Gemma 3's default pattern makes layer 5 its first global layer.
    Norm weights (Gemma scales by 1 + w) are randomised around 0."""
    import transformers

    hf_dir, vocab_rows = new_checkpoint(tmp_path, f"tiny-{arch}-kv{n_kv_heads}-w{sliding_window}-s{seed}", seed,
                                        make_spm_tokenizer)
    config_cls, model_cls = {
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[arch]
    config = config_cls(
        vocab_size=vocab_rows, hidden_size=64, intermediate_size=128, num_hidden_layers=n_layers,
        num_attention_heads=4, num_key_value_heads=n_kv_heads, head_dim=16, query_pre_attn_scalar=16,
        max_position_embeddings=256, rms_norm_eps=1e-6, sliding_window=sliding_window, initializer_range=0.05,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="eager")
    return save_random(hf_dir, model_cls, config, seed, {"norm.weight": (0.0, 0.1)})


def make_tiny_olmo(tmp_path: Path, *, arch: str = "olmo3", n_layers: int = 4, n_kv_heads: int = 2,
                   sliding_window: int = 4, layer_types: list[str] | None = None, tie: bool = False,
                   yarn: dict[str, float] | None = None, seed: int = 0) -> tuple[Path, Any]:
    """Build and save a random OLMo 2 / OLMo 3 model (64 wide, 4 heads of 16) with a BPE tokenizer. Returns
    ``(hf_dir, hf_model)`` (float32, eval mode, eager attention). OLMo 3: a ``sliding_window`` small enough
    that prompts run past it, the default layer pattern (every 4th layer global) unless ``layer_types``;
    ``yarn``: YaRN parameters of the global layers (the sliding ones rotate unscaled). Norm weights (the
    q/k norms included) are randomised around 1."""
    import transformers

    name = f"tiny-{arch}-l{n_layers}-kv{n_kv_heads}-w{sliding_window}-{'yarn-' if yarn else ''}s{seed}"
    hf_dir, vocab_rows = new_checkpoint(tmp_path, name, seed)
    common = dict(vocab_size=vocab_rows, hidden_size=64, intermediate_size=96, num_hidden_layers=n_layers,
                  num_attention_heads=4, num_key_value_heads=n_kv_heads, max_position_embeddings=256, rms_norm_eps=1e-6,
                  initializer_range=0.05, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                  attn_implementation="eager")
    if arch == "olmo2":
        config = transformers.Olmo2Config(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **common)
        model_cls = transformers.Olmo2ForCausalLM
    else:
        rope = {kind: {"rope_type": "default", "rope_theta": 500000.0}
                for kind in ("full_attention", "sliding_attention")}
        if yarn:
            rope["full_attention"] |= {"rope_type": "yarn", **yarn}
        config = transformers.Olmo3Config(sliding_window=sliding_window, layer_types=layer_types,
                                          rope_parameters=rope, **common)
        model_cls = transformers.Olmo3ForCausalLM
    return save_random(hf_dir, model_cls, config, seed, NORMS_AROUND_1)


def make_tiny_deepseek(tmp_path: Path, *, version: int | str = 3, q_lora: int | None = 24, n_layers: int = 3,
                       yarn: dict[str, float] | None = None, seed: int = 0, **overrides: Any) -> tuple[Path, Any]:
    """Build and save a random DeepSeek V2 or V3 (``version="glm-lite"``: GLM-4.7-Flash) model (64 wide, 4 heads;
    MLA with a 32-wide latent, heads of 16 + 8 rope / 16 value dims; one dense layer, then 16 experts of 32 (2
    chosen) and a shared expert; V3: 4 expert groups of which 2 are kept) with a BPE tokenizer. ``yarn``: YaRN
    parameters; ``overrides``: any other config key. Returns ``(hf_dir, hf_model)`` (float32, eval mode,
    eager attention). Norm weights and V3's correction bias are randomised (around 1, resp. 0)."""
    import transformers

    name = f"tiny-deepseek-v{version}-q{q_lora}-l{n_layers}-{'yarn-' if yarn else ''}s{seed}"
    hf_dir, vocab_rows = new_checkpoint(tmp_path, name, seed)
    rope = {"rope_type": "default", "rope_theta": 10000.0} if yarn is None else {
        "rope_type": "yarn", "rope_theta": 10000.0, **yarn}
    config = dict(vocab_size=vocab_rows, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                  n_routed_experts=16, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32,
                  q_lora_rank=q_lora, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                  max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.05, rope_parameters=rope,
                  bos_token_id=0, eos_token_id=1, pad_token_id=2, attn_implementation="eager")
    if version == 3:
        config |= dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
        cls, model_cls = transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM
    elif version == "glm-lite":  # GLM-4.7-Flash: V3's layout, its dense layers named per layer
        del config["first_k_dense_replace"]
        config |= dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=1.8,
                       mlp_layer_types=["dense"] + ["sparse"] * (n_layers - 1))
        cls, model_cls = transformers.Glm4MoeLiteConfig, transformers.Glm4MoeLiteForCausalLM
    else:
        config |= dict(topk_method="greedy", routed_scaling_factor=1.5)
        cls, model_cls = transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM
    return save_random(hf_dir, model_cls, cls(**(config | overrides)), seed, NORMS_AROUND_1 | SHARP_ROUTER,
                       buffers=CORRECTION_BIAS)


def make_tiny_glm4moe(tmp_path: Path, *, qk_norm: bool = False, tie: bool = False, seed: int = 0,
                      **overrides: Any) -> tuple[Path, Any]:
    """Build and save a random GLM-4.5-style model (64 wide, 4 heads of 16 over 2 KV heads with q/k/v biases, half
    of each head rotated; one dense layer, then 16 experts of 32 (4 chosen by sigmoid in 4 groups of which 2 are
    kept) and a shared expert) with a BPE tokenizer; ``qk_norm``: per-head q/k norms (GLM-4.5 355B). Returns
    ``(hf_dir, hf_model)`` (float32, eval mode, eager attention). Norms, biases and the correction bias are
    randomised."""
    import transformers

    name = f"tiny-glm4moe-{'qknorm-' if qk_norm else ''}{'tied-' if tie else ''}s{seed}"
    hf_dir, vocab_rows = new_checkpoint(tmp_path, name, seed)
    config = transformers.Glm4MoeConfig(**(dict(
        vocab_size=vocab_rows, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_shared_experts=1,
        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
        norm_topk_prob=True, routed_scaling_factor=1.5, use_qk_norm=qk_norm, attention_bias=True,
        max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.05, tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        bos_token_id=0, eos_token_id=1, pad_token_id=2, attn_implementation="eager") | overrides))
    return save_random(hf_dir, transformers.Glm4MoeForCausalLM, config, seed,
                       NORMS_AROUND_1 | {".bias": (0.0, 0.1)} | SHARP_ROUTER, buffers=CORRECTION_BIAS)


def make_tiny_mistral3_with_vision(tmp_path: Path, rope: dict[str, Any], *, text_type: str = "ministral3",
                                   seed: int = 0) -> tuple[Path, Any]:
    """Build and save a random ``Mistral3ForConditionalGeneration`` (a 2-layer, 64-wide text decoder with
    ``rope`` parameters, tied embeddings, and a 1-layer Pixtral vision tower), as Ministral 3 (``text_type``
    "ministral3") and Mistral Small 3.x ("mistral") are published. Returns ``(hf_dir, hf_model)`` (float32,
    eval mode)."""
    import transformers

    hf_dir, vocab_rows = new_checkpoint(tmp_path, f"tiny-mistral3-vision-{text_type}-s{seed}", seed)
    text_config = transformers.Ministral3Config if text_type == "ministral3" else transformers.MistralConfig
    extra = {} if text_type == "ministral3" else {"sliding_window": None}
    text = text_config(
        vocab_size=vocab_rows, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_parameters=dict(rope), initializer_range=0.05, bos_token_id=0, eos_token_id=1, pad_token_id=1, **extra)
    vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=2, image_size=32, patch_size=16, head_dim=16)
    config = transformers.Mistral3Config(text_config=text, vision_config=vision, image_token_index=5,
                                         spatial_merge_size=2, tie_word_embeddings=True)
    return save_random(hf_dir, transformers.Mistral3ForConditionalGeneration, config, seed, NORMS_AROUND_1)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False), encoding="utf-8")


def png(seed: int, size: tuple[int, int] = (40, 28), mode: str = "RGB") -> bytes:
    """A PNG of random pixels (``size`` = (width, height)), converted to ``mode``; needs Pillow."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(out, format="PNG")
    return out.getvalue()


def make_wordpiece_vocab(out_dir: Path, seed: int = 0) -> int:
    """A small uncased WordPiece vocabulary (vocab.txt) covering ``corpus(seed)``: the BERT special
    tokens, whole words, a few suffix pieces and every character alone and as a continuation.
    Returns its size."""
    text = " ".join(corpus(seed)).lower()
    chars = sorted({c for c in text if c.isalnum()} | set("abcdefghijklmnopqrstuvwxyz0123456789"))
    punct = sorted(set(".,?!'()-—") | {c for c in text if not c.isalnum() and not c.isspace()})
    words = sorted(set(_WORDS))
    pieces = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words, *chars, *punct,
              *(f"##{c}" for c in chars), "##s", "##ed", "##ing", "##er"]
    pieces = list(dict.fromkeys(pieces))  # a piece may be both a word and a character ("a")
    (out_dir / "vocab.txt").write_text("\n".join(pieces) + "\n", encoding="utf-8")
    _write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "BertTokenizer", "do_lower_case": True, "unk_token": "[UNK]", "sep_token": "[SEP]",
        "pad_token": "[PAD]", "cls_token": "[CLS]", "mask_token": "[MASK]", "model_max_length": 128,
    })
    return len(pieces)


def make_tiny_bert(tmp_path: Path, *, seed: int = 0, pooling: str | None = None) -> tuple[Path, Any]:
    """Build and save a 2-layer, 4-head, 64-wide random BertModel with a WordPiece vocabulary.

    Returns ``(hf_dir, hf_model)`` (float32, eval mode). Positions stop at 128, so long texts are
    easy to make. ``pooling`` ("mean", "cls" or "lasttoken") adds a sentence-transformers
    Pooling module. LayerNorm weights and biases and every linear bias are randomised so that a
    swapped or missing one shows up in parity tests.
    """
    import transformers

    hf_dir, vocab_rows = new_checkpoint(tmp_path, f"tiny-bert-s{seed}{f'-{pooling}' if pooling else ''}", seed,
                                        make_wordpiece_vocab)
    config = transformers.BertConfig(
        vocab_size=vocab_rows, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128, type_vocab_size=2, layer_norm_eps=1e-12,
        hidden_act="gelu", initializer_range=0.1, pad_token_id=0)
    kwargs: dict[str, Any] = {}
    if "safe_serialization" in inspect.signature(transformers.BertModel.save_pretrained).parameters:
        kwargs["safe_serialization"] = True
    hf_dir, model = save_random(hf_dir, transformers.BertModel, config, seed, BERT_REDRAW, **kwargs)
    if pooling is not None:
        _write_json(hf_dir / "modules.json", [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        ])
        (hf_dir / "1_Pooling").mkdir(exist_ok=True)
        _write_json(hf_dir / "1_Pooling" / "config.json", {
            "word_embedding_dimension": 64, "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
            "pooling_mode_lasttoken": pooling == "lasttoken"})
    return hf_dir, model


def make_tiny_qwen35(tmp_path: Path, *, layer_types: tuple[str, ...] = ("linear_attention", "full_attention",
                                                                         "linear_attention", "linear_attention"),
                     n_k_heads: int = 2, n_v_heads: int = 4, tie: bool = True, arch: str = "qwen35",
                     seed: int = 0) -> tuple[Path, Any]:
    """Build and save a random Qwen 3.5 text model (64 wide; attention: 4 heads of 16, 2 KV heads, rope on 8
    of 16 dims; Gated DeltaNet: ``n_k_heads`` key and ``n_v_heads`` value heads of 16, 4 taps) with a BPE
    tokenizer. Returns ``(hf_dir, hf_model)`` (float32, eval mode). Qwen's zero-centred norms get random
    weights around 0, the DeltaNet's output norm around 1, the convolution taps of either sign. ``arch``:
    ``qwen35``, ``qwen35moe`` (8 experts of 32, 2 chosen per token, a shared expert of 48 with its gate) or
    ``qwen3next`` (those experts; fused DeltaNet projections, no mRoPE sections)."""
    import transformers

    kinds = "".join(t[0] for t in layer_types)
    hf_dir, vocab_rows = new_checkpoint(tmp_path, f"tiny-{arch}-{kinds}-k{n_k_heads}v{n_v_heads}-s{seed}", seed)
    config_cls, model_cls = {
        "qwen35": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
        "qwen35moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
        "qwen3next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM)}[arch]
    mlp = dict(intermediate_size=96) if arch == "qwen35" else dict(
        moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    if arch != "qwen3next":
        rope |= {"mrope_section": [2, 1, 1], "mrope_interleaved": True}
    config = config_cls(
        vocab_size=vocab_rows, hidden_size=64, num_hidden_layers=len(layer_types), **mlp,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_parameters=rope,
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=n_k_heads,
        linear_num_value_heads=n_v_heads, layer_types=list(layer_types), initializer_range=0.05,
        tie_word_embeddings=tie, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    return save_random(hf_dir, model_cls, config, seed, {
        ("mlp.gate.weight", "shared_expert_gate.weight"): (0.0, 0.3),  # initialised to zero
        ("experts.gate_up_proj", "experts.down_proj"): (0.0, 0.1),
        "linear_attn.norm.weight": (1.0, 0.1),  # before the other norms: the first key that matches counts
        "norm.weight": (0.0, 0.1),
        ("conv1d.weight", "dt_bias"): (0.0, 0.5)})


def make_tiny_bert_reranker(tmp_path: Path, *, seed: int = 0, type_vocab_size: int = 2) -> tuple[Path, Any]:
    """A 2-layer, 64-wide random ``BertForSequenceClassification`` with one label (a cross-encoder
    reranker such as ms-marco-MiniLM) and the WordPiece vocabulary of ``make_tiny_bert``; biases and
    LayerNorm weights randomised. Returns ``(hf_dir, hf_model)`` (float32, eval mode)."""
    import transformers

    hf_dir, vocab_rows = new_checkpoint(tmp_path, f"tiny-bert-reranker-s{seed}-t{type_vocab_size}", seed,
                                        make_wordpiece_vocab)
    config = transformers.BertConfig(
        vocab_size=vocab_rows, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128, type_vocab_size=type_vocab_size, layer_norm_eps=1e-12,
        hidden_act="gelu", initializer_range=0.1, pad_token_id=0, num_labels=1,
        architectures=["BertForSequenceClassification"])
    return save_random(hf_dir, transformers.BertForSequenceClassification, config, seed, BERT_REDRAW)


def make_tiny_xlm_roberta(tmp_path: Path, *, seed: int = 0, reranker: bool = True) -> tuple[Path, Any]:
    """A 2-layer, 64-wide random XLM-RoBERTa (``XLMRobertaForSequenceClassification`` with one label, a
    bge-reranker in small, or the bare ``XLMRobertaModel``) with a unigram tokenizer trained on
    ``corpus(seed)`` (XLM-R's specials <s> <pad> </s> <unk> first, <mask> last; spaces merged, no
    charsmap). Returns ``(hf_dir, hf_model)`` (float32, eval mode)."""
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    hf_dir = Path(tmp_path) / f"tiny-xlmr-s{seed}{'-rerank' if reranker else ''}"
    hf_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Replace(Regex(" {2,}"), " ")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
                                      unk_token="<unk>", show_progress=False)
    tok.train_from_iterator(corpus(seed), trainer)
    tok.add_special_tokens(["<mask>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    fast = transformers.XLMRobertaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                 sep_token="</s>", cls_token="<s>", unk_token="<unk>",
                                                 pad_token="<pad>", mask_token="<mask>")
    fast.save_pretrained(hf_dir)
    n_tokens = tok.get_vocab_size(with_added_tokens=True)
    config = transformers.XLMRobertaConfig(
        vocab_size=n_tokens, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=130, type_vocab_size=1, layer_norm_eps=1e-5, hidden_act="gelu",
        initializer_range=0.1, pad_token_id=1, bos_token_id=0, eos_token_id=2, num_labels=1,
        architectures=["XLMRobertaForSequenceClassification" if reranker else "XLMRobertaModel"])
    if reranker:
        return save_random(hf_dir, transformers.XLMRobertaForSequenceClassification, config, seed, BERT_REDRAW)
    return save_random(hf_dir, transformers.XLMRobertaModel, config, seed, BERT_REDRAW,
                       model_kwargs={"add_pooling_layer": False})
