"""Random-weight GGUF files for any registered architecture, from a few hyper-parameters.

    write_model("tiny.gguf", "llama", {"block_count": 2, "embedding_length": 64, ...}, "f16")
    write_synthetic("llama-1b.gguf", "llama-3.2-1b", "q4_0")   # a named shape at real dimensions

Hyper-parameters are GGUF metadata keys as llama.cpp writes them, given without the architecture
prefix (``attention.head_count`` is written as ``llama.attention.head_count``; ``general.*`` and
``tokenizer.*`` keys as they are). The architecture's own ``Options.from_config`` reads them back
and its weight declarations (``nn.shape``) give every tensor's name and shape, so a new model file
needs nothing here. A vocabulary of the kind ``tokenizer.ggml.model`` names (``llama``:
SentencePiece, the default; ``bert``: WordPiece; ``gpt2``: byte-level BPE) and of ``vocab_size``
tokens is generated unless ``tokenizer.ggml.tokens`` is given, so every file runs end to end. Its
text is meaningless, but every matrix has its real shape and type: speed is what a trained model of
that size would show.
"""

from __future__ import annotations

import os
import secrets
import string
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from pyggml import nn
from pyggml.tensor import DType, quantize

# ``write_model(path, arch)`` and ``pyggml make-model ARCH``: a small shape, and the keys llama.cpp
# requires of most architectures (an architecture ignores the ones it does not read)
DEFAULTS: dict[str, Any] = {
    "block_count": 2, "context_length": 256, "embedding_length": 64, "feed_forward_length": 128,
    "attention.head_count": 4, "vocab_size": 384, "attention.layer_norm_rms_epsilon": 1e-5,
    "attention.layer_norm_epsilon": 1e-5, "tokenizer.ggml.token_type_count": 2,
}
# and the keys some architectures need beyond those (experts, a window, an embedding model's pooling), so
# every registered architecture's default file loads and runs
_EXPERTS = {"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 32}
_ENCODER = {"pooling_type": 1, "tokenizer.ggml.model": "bert"}  # mean pooling: `pyggml embed` works
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3moe": _EXPERTS, "gpt-oss": {**_EXPERTS, "attention.sliding_window": 16},
    "bert": _ENCODER, "nomic-bert": _ENCODER,
    "gemma-embedding": {"pooling_type": 1, "attention.sliding_window": 8},
    # Gemma 4: sliding and global layers with their own head sizes, the last two layers reading earlier layers'
    # caches, per-layer embeddings of 8, experts beside the MLP
    "gemma4": {"block_count": 6, "attention.head_count_kv": [2, 2, 2, 1, 2, 1], "attention.key_length": 32,
               "attention.value_length": 32, "attention.key_length_swa": 16, "attention.value_length_swa": 16,
               "attention.sliding_window_pattern": [True, True, True, False, True, False],
               "attention.shared_kv_layers": 2, "attention.sliding_window": 8, "rope.freq_base_swa": 10000.0,
               "rope.dimension_count": 32, "rope.dimension_count_swa": 16, "embedding_length_per_layer_input": 8,
               "final_logit_softcapping": 30.0, **_EXPERTS},
    # Llama 4: layer 3 without rope, layers 1 and 3 with experts (one chosen, as Llama 4 chooses)
    "llama4": {"block_count": 4, **_EXPERTS, "expert_used_count": 1, "interleave_moe_layer_step": 2},
    # LFM2: a short convolution of 3 taps; one attention layer of three (head_count_kv 0: a convolution)
    "lfm2": {"block_count": 3, "shortconv.l_cache": 3, "attention.head_count_kv": [0, 2, 0]},
    "lfm2moe": {"block_count": 3, "shortconv.l_cache": 3, "attention.head_count_kv": [0, 2, 0], **_EXPERTS,
                "leading_dense_block_count": 1, "expert_gating_func": 2},
    # Granite 4 hybrid: Mamba-2 (4 heads of 32, 2 groups, 4 taps), attention in the middle, no rope
    "granitehybrid": {"block_count": 3, "attention.head_count_kv": [0, 2, 0], "ssm.conv_kernel": 4,
                      "ssm.inner_size": 128, "ssm.state_size": 16, "ssm.time_step_rank": 4, "ssm.group_count": 2,
                      "rope.scaling.finetuned": False},
    # Nemotron-H: Mamba-2 (4 heads of 16, 2 groups, 4 taps), an MLP, attention, an MLP
    "nemotron_h": {"block_count": 4, "attention.head_count_kv": [0, 0, 2, 0], "feed_forward_length": [0, 128, 0, 128],
                   "attention.key_length": 16, "attention.value_length": 16, "ssm.conv_kernel": 4,
                   "ssm.inner_size": 64, "ssm.state_size": 16, "ssm.time_step_rank": 4, "ssm.group_count": 2},
    # Qwen 3.5: three Gated DeltaNet layers (4 taps, 2 key heads and 4 value heads of 16) to one attention layer
    "qwen35": {"block_count": 4, "attention.head_count_kv": 2, "attention.key_length": 16,
               "attention.value_length": 16, "rope.dimension_count": 8, "ssm.conv_kernel": 4, "ssm.state_size": 16,
               "ssm.group_count": 2, "ssm.time_step_rank": 4, "ssm.inner_size": 64,
               "rope.dimension_sections": [2, 1, 1, 0]},  # llama.cpp requires the key (text: plain rope)
    "qwen35moe": {"block_count": 4, "attention.head_count_kv": 2, "attention.key_length": 16,
                  "attention.value_length": 16, "rope.dimension_count": 8, "ssm.conv_kernel": 4, "ssm.state_size": 16,
                  "ssm.group_count": 2, "ssm.time_step_rank": 4, "ssm.inner_size": 64,
                  "rope.dimension_sections": [2, 1, 1, 0], **_EXPERTS, "expert_shared_feed_forward_length": 32},
    "qwen3next": {"block_count": 4, "attention.head_count_kv": 2, "attention.key_length": 16,
                  "attention.value_length": 16, "rope.dimension_count": 8, "ssm.conv_kernel": 4, "ssm.state_size": 16,
                  "ssm.group_count": 2, "ssm.time_step_rank": 4, "ssm.inner_size": 64, **_EXPERTS,
                  "expert_shared_feed_forward_length": 32},
    # Qwen-VL text models: mRoPE sections of the 8 rotated pairs of a 16-wide head (text only: no vision part)
    "qwen2vl": {"rope.dimension_sections": [2, 3, 3, 0]},
    "qwen3vl": {"rope.dimension_sections": [2, 3, 3, 0]},
    "qwen3vlmoe": {"rope.dimension_sections": [2, 3, 3, 0], **_EXPERTS},
    "qwen25vl": {"rope.mrope_section": [2, 3, 3]},  # Ollama's layout and name
    # DeepSeek's latent attention (a 32-wide latent and 16 rope dims cached per token; heads of 16 + 16, values
    # of 16), one dense layer, then experts with a shared one
    "deepseek2": {"attention.head_count_kv": 1, "attention.kv_lora_rank": 32, "attention.key_length": 48,
                  "attention.value_length": 32, "attention.key_length_mla": 32, "attention.value_length_mla": 16,
                  "rope.dimension_count": 16, "leading_dense_block_count": 1, **_EXPERTS, "expert_shared_count": 1},
    "glm4moe": {"leading_dense_block_count": 1, **_EXPERTS, "expert_shared_count": 1, "rope.dimension_count": 8},
}
Init = Callable[[str, tuple[int, ...], np.random.Generator], "np.ndarray | None"]


def defaults(arch: str) -> dict[str, Any]:
    """The hyper-parameters of ``arch``'s small default file (``write_model(path, arch)``)."""
    return {**DEFAULTS, **ARCH_DEFAULTS.get(arch, {})}


@dataclass(frozen=True)
class Shape:
    """A real model's shape (the named shapes below; ``Shape.hparams`` gives its metadata): a decoder
    of architecture ``arch`` (llama unless said) with these sizes; ``extra`` adds or overrides keys
    (head sizes other than hidden / heads, experts, ...)."""

    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    vocab: int
    context: int
    rope_base: float
    tied: bool
    arch: str = "llama"
    extra: Mapping[str, Any] = field(default_factory=dict)

    def hparams(self) -> dict[str, Any]:
        return {"block_count": self.n_layers, "context_length": self.context, "embedding_length": self.hidden,
                "feed_forward_length": self.ffn, "attention.head_count": self.n_heads,
                "attention.head_count_kv": self.n_kv_heads, "attention.layer_norm_rms_epsilon": 1e-5,
                "rope.freq_base": self.rope_base, "rope.dimension_count": self.hidden // self.n_heads,
                "vocab_size": self.vocab, **self.extra}


# 2-d weights that llama.cpp never quantizes (nor its converters write as F16): convolution kernels, per-group norms
_SMALL_MATRICES = (".shortconv.conv.weight", ".ssm_conv1d.weight", ".ssm_norm.weight")
_QWEN3_HEADS = {"attention.key_length": 128, "attention.value_length": 128, "rope.dimension_count": 128,
                "attention.layer_norm_rms_epsilon": 1e-6, "tokenizer.ggml.model": "gpt2"}
_QWEN35 = {"attention.key_length": 256, "attention.value_length": 256, "rope.dimension_count": 64,
           "rope.dimension_sections": [11, 11, 10, 0], "attention.layer_norm_rms_epsilon": 1e-6,
           "tokenizer.ggml.model": "gpt2", "full_attention_interval": 4, "ssm.conv_kernel": 4, "ssm.state_size": 128,
           "ssm.group_count": 16, "ssm.time_step_rank": 32, "ssm.inner_size": 4096}
# a general.name with "phi3" or "phi-3" in it makes llama.cpp want Phi-3's <|endoftext|> token, which a
# synthetic vocabulary lacks
_PHI3 = {"attention.sliding_window": 2047, "rope.scaling.original_context_length": 4096,
         "general.name": "synthetic random-weight model (Phi 3 mini shape)"}
SHAPES = {
    "tinyllama-1.1b": Shape(22, 2048, 5632, 32, 4, 32000, 2048, 10000.0, False),
    "llama-3.2-1b": Shape(16, 2048, 8192, 32, 8, 128256, 131072, 500000.0, True),
    "llama-3.1-8b": Shape(32, 4096, 14336, 32, 8, 128256, 131072, 500000.0, False),
    "tiny": Shape(2, 256, 512, 8, 4, 1024, 1024, 10000.0, False),  # for tests
    "qwen2.5-0.5b": Shape(24, 896, 4864, 14, 2, 151936, 32768, 1000000.0, True, "qwen2",
                          {"attention.layer_norm_rms_epsilon": 1e-6}),
    "qwen3-0.6b": Shape(28, 1024, 3072, 16, 8, 151936, 40960, 1000000.0, True, "qwen3", _QWEN3_HEADS),
    # Qwen3-30B-A3B's layer (64 of its 128 experts, 8 used) in a 16-layer model of ~1.5B parameters, and the
    # dense model with the same active parameters (one MLP as wide as the 8 used experts together)
    "qwen3moe-small": Shape(16, 1024, 3072, 16, 8, 151936, 40960, 1000000.0, True, "qwen3moe",
                            {**_QWEN3_HEADS, "expert_count": 64, "expert_used_count": 8,
                             "expert_feed_forward_length": 384}),
    "qwen3-small-dense": Shape(16, 1024, 3072, 16, 8, 151936, 40960, 1000000.0, True, "qwen3", _QWEN3_HEADS),
    # Gemma 3 1B: 5 sliding-window (512) layers to 1 global, one 256-wide KV head, a 262k vocabulary
    "gemma3-1b": Shape(26, 1152, 6912, 4, 1, 262144, 32768, 1000000.0, True, "gemma3",
                       {"attention.key_length": 256, "attention.value_length": 256, "rope.dimension_count": 256,
                        "attention.sliding_window": 512, "attention.sliding_window_pattern": 6,
                        "attention.layer_norm_rms_epsilon": 1e-6}),
    # Gemma 4 E2B's text decoder (as its published config reads): 35 layers, 4 sliding-window (512) layers to 1
    # global, one KV head of 256 (sliding) or 512 (global, a quarter rotated), the last 20 layers reading the
    # caches of layers 13 and 14 with MLPs twice as wide, 256-wide per-layer embeddings; a synthetic file has
    # no attn_v (its values are the keys' projection, in llama.cpp too)
    "gemma4-e2b": Shape(35, 1536, 6144, 8, 1, 262144, 131072, 1000000.0, True, "gemma4", {
        "feed_forward_length": [6144] * 15 + [12288] * 20, "attention.key_length": 512, "attention.value_length": 512,
        "attention.key_length_swa": 256, "attention.value_length_swa": 256, "rope.dimension_count": 512,
        "rope.dimension_count_swa": 256, "rope.freq_base_swa": 10000.0, "attention.sliding_window": 512,
        "attention.sliding_window_pattern": [i % 5 < 4 for i in range(35)], "attention.shared_kv_layers": 20,
        "embedding_length_per_layer_input": 256, "final_logit_softcapping": 30.0,
        "attention.layer_norm_rms_epsilon": 1e-6}),
    # Phi-3-mini-4k (3.8B), and its first 8 layers (~1.1B: the same matrices per token, quick on 2 cores)
    "phi3-mini": Shape(32, 3072, 8192, 32, 32, 32064, 4096, 10000.0, False, "phi3", _PHI3),
    "phi3-mini-8l": Shape(8, 3072, 8192, 32, 32, 32064, 4096, 10000.0, False, "phi3", _PHI3),
    # gpt-oss-20b's layer layout (64-wide heads, 8 query heads per KV head, 32 experts of which 4 are used,
    # alternating 128-token sliding window, YaRN) narrowed to 1024 and 8 layers (~1.2B, ~0.3B active);
    # ``write_synthetic(..., "mxfp4")`` stores its experts as MXFP4 and the other matrices as Q8_0
    # LFM2-1.2B: 10 short-convolution layers (3 taps) and 6 attention layers, 8 KV heads of 64
    "lfm2-1.2b": Shape(16, 2048, 8192, 32, 8, 65536, 128000, 1000000.0, True, "lfm2",
                       {"attention.head_count_kv": [8 if i in (2, 5, 8, 10, 12, 14) else 0 for i in range(16)],
                        "shortconv.l_cache": 3}),
    # Qwen3.5-9B: 24 Gated DeltaNet layers (16 key and 32 value heads of 128, 4 taps) and 8 gated attention layers
    # (16 heads of 256, 4 KV heads, rope on 64 dims), a 248k vocabulary
    "qwen3.5-9b": Shape(32, 4096, 12288, 16, 4, 248320, 262144, 10000000.0, False, "qwen35", _QWEN35),
    # Qwen3.5-35B-A3B: 40 layers of 2048 (30 Gated DeltaNet, 10 gated attention with 2 KV heads), 256 experts of 512
    # (8 used) and a shared expert of 512 per layer
    "qwen3.5-35b-a3b": Shape(40, 2048, 512, 16, 2, 248320, 262144, 10000000.0, False, "qwen35moe",
                             {**_QWEN35, "expert_count": 256, "expert_used_count": 8, "expert_feed_forward_length": 512,
                              "expert_shared_feed_forward_length": 512}),
    # Qwen3-Next-80B-A3B: 48 layers of 2048 (36 Gated DeltaNet, 12 gated attention), 512 experts of 512 (10 used)
    "qwen3-next-80b-a3b": Shape(48, 2048, 512, 16, 2, 151936, 262144, 10000000.0, False, "qwen3next",
                                {**{k: v for k, v in _QWEN35.items() if k != "rope.dimension_sections"},
                                 "expert_count": 512, "expert_used_count": 10, "expert_feed_forward_length": 512,
                                 "expert_shared_feed_forward_length": 512}),
    # DeepSeek-V2-Lite's layers (16 heads; MLA: a 512-wide latent + 64 rope dims cached per token, heads of 128 +
    # 64, values of 128; no q_lora; YaRN x40 of 4096 with mscale_all_dim 0.707; softmax routing to 6 experts of
    # 1408 plus 2 shared) with 32 of its 64 experts, in 6 layers (the first dense): ~2.0B parameters, ~0.6B active
    "deepseek-v2-lite-small": Shape(6, 2048, 10944, 16, 1, 102400, 163840, 10000.0, False, "deepseek2",
                                    {"attention.kv_lora_rank": 512, "attention.key_length": 576,
                                     "attention.value_length": 512, "attention.key_length_mla": 192,
                                     "attention.value_length_mla": 128, "rope.dimension_count": 64,
                                     "attention.q_lora_rank": 0, "attention.layer_norm_rms_epsilon": 1e-6,
                                     "leading_dense_block_count": 1, "expert_count": 32, "expert_used_count": 6,
                                     "expert_feed_forward_length": 1408, "expert_shared_count": 2,
                                     "expert_gating_func": 1, "expert_weights_scale": 1.0,
                                     "rope.scaling.type": "yarn", "rope.scaling.factor": 40.0,
                                     "rope.scaling.original_context_length": 4096,
                                     "rope.scaling.yarn_log_multiplier": 0.0707, "tokenizer.ggml.model": "gpt2"}),
    "gpt-oss-small": Shape(8, 1024, 1024, 16, 2, 201088, 131072, 150000.0, False, "gpt-oss",
                           {"attention.key_length": 64, "attention.value_length": 64, "rope.dimension_count": 64,
                            "expert_count": 32, "expert_used_count": 4, "expert_feed_forward_length": 1024,
                            "attention.sliding_window": 128, "rope.scaling.type": "yarn", "rope.scaling.factor": 32.0,
                            "rope.scaling.original_context_length": 4096, "tokenizer.ggml.model": "gpt2"}),
    # Granite-4.0-H-Tiny-like (~7B, ~1B active): 40 layers, attention in 4 of them (no rope), the others Mamba-2
    # (48 heads of 64, a 128-wide state, one group, 4 taps); 64 experts of 512 (6 used) and a shared expert
    # of 1024; and its first 10 layers (one attention layer: quick on 2 cores)
    **{name: Shape(n, 1536, 512, 12, 4, 100352, 131072, 10000.0, True, "granitehybrid",
                   {"attention.head_count_kv": [4 if i % 10 == 5 else 0 for i in range(n)], "ssm.conv_kernel": 4,
                    "ssm.inner_size": 3072, "ssm.state_size": 128, "ssm.time_step_rank": 48, "ssm.group_count": 1,
                    "rope.scaling.finetuned": False, "expert_count": 64, "expert_used_count": 6,
                    "expert_shared_feed_forward_length": 1024, "embedding_scale": 12.0, "residual_scale": 0.22,
                    "attention.scale": 0.0078125, "logit_scale": 6.0, "tokenizer.ggml.model": "gpt2"})
       for name, n in (("granite-4.0-h-tiny", 40), ("granite-4.0-h-tiny-10l", 10))},
    # Nemotron-Nano-9B-v2-like: 56 one-mixer blocks (27 Mamba-2 of 128 heads of 80 in 8 groups, a 128-wide
    # state; 4 attention of 40 heads over 8 KV heads of 128, no rope; 25 squared-ReLU MLPs of 15680);
    # and its first 14 blocks (one attention block: quick on 2 cores)
    **{name: Shape(len(pattern), 4480, 15680, 40, 8, 131072, 131072, 10000.0, False, "nemotron_h",
                   {"attention.head_count_kv": [8 if c == "*" else 0 for c in pattern],
                    "feed_forward_length": [15680 if c == "-" else 0 for c in pattern], "attention.key_length": 128,
                    "attention.value_length": 128, "ssm.conv_kernel": 4, "ssm.inner_size": 10240,
                    "ssm.state_size": 128, "ssm.time_step_rank": 128, "ssm.group_count": 8,
                    "attention.layer_norm_epsilon": 1e-5, "tokenizer.ggml.model": "gpt2"})
       for name, pattern in (("nemotron-nano-9b-v2", "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"),
                             ("nemotron-nano-9b-v2-14l", "M-M-M-MM-M-M-M*"))},
    # Llama 4 Scout's layer layout (128-wide heads, 4 query heads per KV head, 16 experts of which 1 is used plus a
    # shared one in every layer, rope left out of every 4th layer, 8192-token chunks) narrowed to 1024 wide and
    # 8 layers (~0.9B parameters, ~0.2B active per token with the 202k-token embeddings)
    "llama4-small": Shape(8, 1024, 4096, 8, 2, 202048, 131072, 500000.0, False, "llama4",
                          {"expert_count": 16, "expert_used_count": 1, "expert_feed_forward_length": 1024,
                           "interleave_moe_layer_step": 1, "tokenizer.ggml.model": "gpt2"}),
}


def write_synthetic(path: str | os.PathLike, shape: str | Shape = "tinyllama-1.1b", dtype: DType | str = "q4_0",
                    seed: int = 0, progress: Callable[[int, int], None] | None = None,
                    hparams: Mapping[str, Any] | None = None) -> Path:
    """Write a named shape (``SHAPES``) or any registered architecture (with ``DEFAULTS``);
    ``hparams`` override single keys."""
    from pyggml.models import registry

    named = shape if isinstance(shape, Shape) else SHAPES.get(shape)
    if named is not None:
        arch, base, omit = named.arch, named.hparams(), ("output.weight",) if named.tied else ()
    elif shape in registry():
        arch, base, omit = shape, defaults(shape), ()
    else:
        raise ValueError(f"unknown model shape {shape!r}; known: {', '.join(SHAPES)}, or an architecture: "
                         f"{', '.join(sorted(registry()))}")
    return write_model(path, arch, {**base, **(hparams or {})}, dtype, seed=seed, progress=progress, omit=omit)


def write_model(path: str | os.PathLike, arch: str, hparams: Mapping[str, Any] | None = None,
                dtype: DType | str = "f32", *, seed: int = 0, progress: Callable[[int, int], None] | None = None,
                init: Init | None = None, omit: Collection[str] = (),
                shapes: Mapping[str, tuple[int, ...]] | None = None) -> Path:
    """Write a GGUF of architecture ``arch`` with random weights (written atomically: temp file + rename).

    Matrices are ``dtype`` (F16 where a quantized type's blocks do not divide a row; for MXFP4 only
    the stacked experts, the other matrices Q8_0, as llama.cpp's MXFP4_MOE files), norms and biases
    F32; the same ``seed`` gives the same values whatever the type, so an F32 and an F16 file differ
    only by rounding. ``hparams`` default to ``defaults(arch)``. ``init(name, numpy_shape, rng)`` may
    return a tensor's values (None: the default); ``omit`` leaves tensors out (e.g. ``output.weight``:
    tied embeddings); ``shapes`` overrides declared shapes (ggml order; for tests of malformed files).
    ``progress(done, total)`` counts elements."""
    from pyggml.backend.metadata import Config
    from pyggml.models import ModelError, registry

    model = registry().get(arch)
    if model is None:
        raise ValueError(f"unknown architecture {arch!r}; registered: {', '.join(sorted(registry()))}")
    if model.Options is None or model.Weights is None:
        raise ValueError(f"{arch}: the model class declares no Options/Weights to build a file from")
    dtype = DType.parse(dtype)
    meta = metadata(arch, defaults(arch) if hparams is None else hparams, dtype)
    try:
        options = model.Options.from_config(Config(meta))
    except (ModelError, ValueError) as e:
        raise ValueError(f"these hyper-parameters do not make a valid {arch} model: {e}") from None
    tensors = []
    for t in nn.declared(model.Weights, options):
        if t.required and t.name not in omit:
            ggml_shape = tuple((shapes or {}).get(t.name, t.shape))
            matrix = len(ggml_shape) > 1 and t.name.endswith(".weight") and not t.name.endswith(_SMALL_MATRICES)
            kind = dtype if matrix else DType.F32
            if kind == DType.MXFP4 and "_exps." not in t.name:  # llama.cpp's MXFP4_MOE: experts only
                kind = DType.Q8_0
            if kind.block_size > 1 and ggml_shape[0] % kind.block_size:
                kind = DType.F16
            tensors.append((t, tuple(reversed(ggml_shape)), kind))

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")  # one per writer; mode as open()'s
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        for key, value in meta.items():
            if key != "general.architecture":
                _add(writer, key, value)
        for t, numpy_shape, kind in tensors:
            nbytes = kind.row_bytes(numpy_shape[-1]) * int(np.prod(numpy_shape[:-1], dtype=np.int64))
            writer.add_tensor_info(t.name, numpy_shape, np.dtype(np.float32), nbytes,
                                   raw_dtype=gguf.GGMLQuantizationType(int(kind)))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        rng = np.random.default_rng(seed)
        total, done = sum(int(np.prod(s)) for _, s, _ in tensors), 0
        for t, numpy_shape, kind in tensors:
            data = init(t.name, numpy_shape, rng) if init is not None else None
            data = _random(t, numpy_shape, rng) if data is None else np.asarray(data, np.float32)
            writer.write_tensor_data(quantize(data.reshape(numpy_shape), kind))
            done += data.size
            if progress:
                progress(done, total)
        writer.close()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _random(t: nn.TensorDecl, numpy_shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Values that keep activations O(1): norm weights near 1, small biases, matrices scaled 1/sqrt(fan_in)."""
    data = rng.standard_normal(numpy_shape, dtype=np.float32)
    if t.name.endswith(".ssm_a"):  # a state-space decay: negative, or the states grow without bound
        return -np.exp(0.5 * data)
    if t.name.endswith(".bias"):
        data *= 0.1
    elif issubclass(t.module, (nn.RMSNorm, nn.LayerNorm)) or len(numpy_shape) == 1:
        data *= 0.1
        data += 1.0
    elif not issubclass(t.module, nn.Embedding):
        data *= 1.0 / np.sqrt(numpy_shape[-1])
    return data


# ---- metadata ---------------------------------------------------------------------------------------
_FILE_TYPES = {DType.F32: 0, DType.F16: 1, DType.Q4_0: 2, DType.Q4_1: 3, DType.Q8_0: 7, DType.Q5_0: 8,
               DType.Q5_1: 9, DType.Q2_K: 10, DType.Q3_K: 11, DType.Q4_K: 15, DType.Q5_K: 17, DType.Q6_K: 18,
               DType.BF16: 32, DType.MXFP4: 38}


def metadata(arch: str, hparams: Mapping[str, Any], dtype: DType = DType.F32) -> dict[str, Any]:
    """The GGUF key/values of a synthetic ``arch`` file: ``hparams`` under the architecture's
    prefix, a name, the file type and a generated vocabulary (unless ``hparams`` has one)."""
    meta: dict[str, Any] = {"general.architecture": arch,
                            "general.name": f"synthetic random-weight {arch} ({dtype.name}; not a language model)"}
    if dtype in _FILE_TYPES:
        meta["general.file_type"] = _FILE_TYPES[dtype]
    if dtype.is_quantized:
        meta["general.quantization_version"] = gguf.GGML_QUANT_VERSION
    for key, value in hparams.items():
        meta[key if key.startswith(("general.", "tokenizer.")) else f"{arch}.{key}"] = value
    if "tokenizer.ggml.tokens" not in meta:
        model = meta.setdefault("tokenizer.ggml.model", "llama")
        n_vocab = int(hparams.get("vocab_size", DEFAULTS["vocab_size"]))
        if model not in _VOCABS:
            raise ValueError(f"no synthetic vocabulary of kind {model!r}; choose one of {', '.join(_VOCABS)}")
        meta.update({k: v for k, v in _VOCABS[model](n_vocab).items() if k not in meta})
    return meta


def _add(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    """One key with the value type llama.cpp expects: integers uint32, numbers float32."""
    V = gguf.GGUFValueType
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, (int, np.integer)):
        (writer.add_uint32 if value >= 0 else writer.add_int32)(key, int(value))
    elif isinstance(value, (float, np.floating)):
        writer.add_float32(key, float(value))
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, bytes):  # e.g. a unigram vocabulary's precompiled_charsmap: uint8, as llama.cpp reads it
        writer.add_key_value(key, list(value), V.ARRAY, sub_type=V.UINT8)
    elif isinstance(value, (list, tuple)):
        if key == "tokenizer.ggml.token_type":  # llama.cpp reads token types as int32
            writer.add_key_value(key, [int(v) for v in value], V.ARRAY, sub_type=V.INT32)
        else:
            writer.add_array(key, list(value))
    else:
        raise TypeError(f"metadata {key!r}: cannot write a {type(value).__name__}")


_CHARS = list(string.ascii_letters + string.digits + string.punctuation)
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = (int(t) for t in (gguf.TokenType.NORMAL, gguf.TokenType.UNKNOWN,
                                                       gguf.TokenType.CONTROL, gguf.TokenType.BYTE))


def _spm_vocab(n: int) -> dict[str, Any]:
    """SentencePiece (``llama``): <unk> <s> </s>, the 256 byte tokens when there is room, characters, filler pieces."""
    tokens, types = ["<unk>", "<s>", "</s>"], [_UNKNOWN, _CONTROL, _CONTROL]
    if n >= 3 + 256 + len(_CHARS) + 1:
        tokens += [f"<0x{b:02X}>" for b in range(256)]
        types += [_BYTE] * 256
    pieces = ["\u2581", *_CHARS]
    tokens += (pieces + [f"\u2581t{i}" for i in range(max(0, n - len(tokens) - len(pieces)))])[:n - len(tokens)]
    types += [_NORMAL] * (n - len(types))
    scores = [0.0 if t != _NORMAL else -float(i) for i, t in enumerate(types)]
    return {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2}


def _wpm_vocab(n: int) -> dict[str, Any]:
    """WordPiece (``bert``) as llama.cpp stores it (word starts marked '▁', continuations bare): [PAD] [UNK]
    [CLS] [SEP] [MASK], characters starting a word, continuing characters, filler words."""
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    types = [_CONTROL, _UNKNOWN, _CONTROL, _CONTROL, _CONTROL]
    chars = [c for c in _CHARS if not c.isupper()]
    pieces = [f"\u2581{c}" for c in chars] + list(string.ascii_lowercase + string.digits)
    tokens += (pieces + [f"\u2581w{i}" for i in range(max(0, n - len(tokens) - len(pieces)))])[:n - len(tokens)]
    types += [_NORMAL] * (n - len(types))
    return {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.unknown_token_id": 1,
            "tokenizer.ggml.cls_token_id": 2, "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.seperator_token_id": 3,
            "tokenizer.ggml.mask_token_id": 4}


def _bpe_vocab(n: int) -> dict[str, Any]:
    """Byte-level BPE (``gpt2``): the 256 byte symbols, merged pairs of letters (with and without a
    leading space, 'Ġ'), <|endoftext|> last."""
    if n < 258:
        raise ValueError(f"a gpt2 vocabulary needs at least 258 tokens, not {n}")
    symbols = _byte_symbols()
    letters = [symbols[ord(c)] for c in string.ascii_lowercase]
    pairs = [("\u0120", c) for c in letters] + [(a, b) for a in letters for b in letters]
    merges = pairs[:n - 257]
    tokens = symbols + [a + b for a, b in merges] + ["<|endoftext|>"]
    tokens += [f"<|filler{i}|>" for i in range(n - len(tokens))]
    eot = 256 + len(merges)
    types = [_NORMAL] * eot + [_CONTROL] * (n - eot)
    return {"tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": [f"{a} {b}" for a, b in merges], "tokenizer.ggml.bos_token_id": eot,
            "tokenizer.ggml.eos_token_id": eot}


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte value (bytes_to_unicode), in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


_VOCABS: dict[str, Callable[[int], dict[str, Any]]] = {"llama": _spm_vocab, "bert": _wpm_vocab, "gpt2": _bpe_vocab}
