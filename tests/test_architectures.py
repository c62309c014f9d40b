"""Every registered architecture, run from a tiny random model (after mlx-lm's model_test_runner).

For each architecture ``pyggml.synthetic`` writes a tiny GGUF from the config in ``TINY`` (F32 and
F16 weights from the same random values), and the checks that apply to it run:

- generating models: logits shape; F32 vs F16; a whole prompt in one batch equals it token by token
  through the cache; two sequences in one batch equal each alone; decode steps reuse the graph;
- embedding models: embedding shape; F32 vs F16; two sequences in one batch equal each alone;
- both: llama.cpp loads the same file, tokenizes alike and computes the same logits / embeddings.

GPU test mode: ``PYGGML_TEST_DEVICE=gpu python -m pytest tests/test_architectures.py`` runs every
check with ``gpu_layers="all"`` (against llama.cpp on the CPU) and adds CPU-vs-GPU parity per
architecture; on a machine without a GPU every test of this module then skips (``ci_may_skip``).

A new architecture joins by adding its tiny config (GGUF keys without the architecture prefix) to
``TINY``; ``test_every_architecture_has_a_tiny_config`` fails until it does.
"""

from __future__ import annotations

import importlib.util
import json
import platform
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pyggml import BackendParams, DType, models
from pyggml.models import Batch, Model
from pyggml.runner.engine import Engine
from pyggml.synthetic import write_model
from tests.conftest import TEST_DEVICE, gpu_present

from ._models import error

ON_GPU = TEST_DEVICE == "gpu"
if ON_GPU:
    pytestmark = pytest.mark.ci_may_skip
GPU_TOLERANCE = 5e-3  # CPU vs GPU logits (relative to the largest); measured on an H200: <= 1.8e-3

TINY: dict[str, dict] = {
    "llama": {"block_count": 2, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
              "attention.head_count_kv": 2, "context_length": 128, "attention.layer_norm_rms_epsilon": 1e-5,
              "rope.freq_base": 10000.0, "vocab_size": 320},
    "gemma2": {"block_count": 2, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
               "attention.head_count_kv": 2, "context_length": 128, "attention.layer_norm_rms_epsilon": 1e-6,
               "attention.sliding_window": 4, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "vocab_size": 320},
    "gemma3": {"block_count": 2, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
               "attention.head_count_kv": 2, "attention.key_length": 16, "attention.value_length": 16,
               "context_length": 128, "attention.layer_norm_rms_epsilon": 1e-6, "attention.sliding_window": 4,
               "attention.sliding_window_pattern": 2, "rope.freq_base": 1e6, "vocab_size": 320},
    # gemma4: global layers with wider heads and fewer KV heads, the last two layers reading the cache of
    # layers 3 (global) and 2 (sliding), per-layer embeddings, experts beside the MLP
    "gemma4": {"block_count": 6, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
               "attention.head_count_kv": [2, 2, 2, 1, 2, 1], "attention.key_length": 32,
               "attention.value_length": 32, "attention.key_length_swa": 16, "attention.value_length_swa": 16,
               "attention.sliding_window_pattern": [True, True, True, False, True, False],
               "attention.shared_kv_layers": 2, "context_length": 128, "attention.layer_norm_rms_epsilon": 1e-6,
               "attention.sliding_window": 4, "rope.freq_base": 1e6, "rope.freq_base_swa": 10000.0,
               "rope.dimension_count": 32, "rope.dimension_count_swa": 16, "embedding_length_per_layer_input": 8,
               "final_logit_softcapping": 30.0, "vocab_size": 320,
               "expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 32},
    "gemma-embedding": {"block_count": 2, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
                        "attention.head_count_kv": 2, "attention.key_length": 16, "attention.value_length": 16,
                        "context_length": 128, "attention.layer_norm_rms_epsilon": 1e-6, "attention.sliding_window": 4,
                        "attention.sliding_window_pattern": 2, "rope.freq_base": 1e6, "vocab_size": 320,
                        "pooling_type": 1, "dense_2_feat_in": 64, "dense_2_feat_out": 96, "dense_3_feat_in": 96,
                        "dense_3_feat_out": 64},  # a window of 2 tokens either way; layer 1 global
    "qwen2": {"block_count": 2, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
              "attention.head_count_kv": 2, "context_length": 128, "attention.layer_norm_rms_epsilon": 1e-6,
              "rope.freq_base": 1000000.0, "vocab_size": 320, "tokenizer.ggml.model": "gpt2"},
    "qwen2vl": {"block_count": 2, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
                "attention.head_count_kv": 2, "context_length": 128, "attention.layer_norm_rms_epsilon": 1e-6,
                "rope.freq_base": 1000000.0, "rope.dimension_sections": [2, 3, 3, 0], "vocab_size": 320,
                "tokenizer.ggml.model": "gpt2"},
    "qwen25vl": {"block_count": 2, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
                 "attention.head_count_kv": 2, "context_length": 128, "attention.layer_norm_rms_epsilon": 1e-6,
                 "rope.freq_base": 1000000.0, "rope.mrope_section": [2, 3, 3], "vocab_size": 320,
                 "tokenizer.ggml.model": "gpt2"},  # Ollama's name of the sections
    "qwen3": {"block_count": 2, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
              "attention.head_count_kv": 2, "attention.key_length": 32, "attention.value_length": 32,
              "context_length": 128, "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1000000.0,
              "vocab_size": 320, "tokenizer.ggml.model": "gpt2"},
    "qwen3vl": {"block_count": 2, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
                "attention.head_count_kv": 2, "attention.key_length": 32, "attention.value_length": 32,
                "context_length": 128, "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1000000.0,
                "rope.dimension_sections": [6, 5, 5, 0], "n_deepstack_layers": 0, "vocab_size": 320,
                "tokenizer.ggml.model": "gpt2"},
    "qwen3vlmoe": {"block_count": 2, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
                   "attention.head_count_kv": 2, "context_length": 128, "attention.layer_norm_rms_epsilon": 1e-6,
                   "rope.freq_base": 1000000.0, "rope.dimension_sections": [2, 3, 3, 0], "n_deepstack_layers": 0,
                   "vocab_size": 320, "tokenizer.ggml.model": "gpt2", "expert_count": 8, "expert_used_count": 2,
                   "expert_feed_forward_length": 32},
    "qwen3moe": {"block_count": 2, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
                 "attention.head_count_kv": 2, "context_length": 128, "attention.layer_norm_rms_epsilon": 1e-6,
                 "rope.freq_base": 1000000.0, "vocab_size": 320, "tokenizer.ggml.model": "gpt2",
                 "expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 32},
    "gpt-oss": {"block_count": 2, "embedding_length": 64, "feed_forward_length": 32, "attention.head_count": 4,
                "attention.head_count_kv": 2, "attention.key_length": 16, "attention.value_length": 16,
                "context_length": 128, "attention.layer_norm_rms_epsilon": 1e-5, "attention.sliding_window": 4,
                "expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 32, "rope.freq_base": 10000.0,
                "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 32,
                "vocab_size": 320},
    "olmo2": {"block_count": 4, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
              "attention.head_count_kv": 2, "context_length": 128, "attention.layer_norm_rms_epsilon": 1e-6,
              "rope.freq_base": 500000.0, "vocab_size": 320, "attention.sliding_window": 4,  # OLMo 3's layers
              "attention.sliding_window_pattern": [True, True, True, False]},
    "phi3": {"block_count": 2, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
             "attention.head_count_kv": 2, "context_length": 128, "attention.layer_norm_rms_epsilon": 1e-5,
             "rope.dimension_count": 8, "rope.freq_base": 10000.0, "vocab_size": 320,
             "general.name": "tiny"},  # a name with "phi3" makes llama.cpp want Phi-3's <|endoftext|> token
    "lfm2": {"block_count": 3, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
             "attention.head_count_kv": [0, 2, 0], "shortconv.l_cache": 3, "context_length": 128,
             "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 1000000.0, "vocab_size": 320},
    "lfm2moe": {"block_count": 3, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
                "attention.head_count_kv": [0, 2, 0], "shortconv.l_cache": 3, "context_length": 128,
                "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 1000000.0, "vocab_size": 320,
                "expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 32,
                "leading_dense_block_count": 1, "expert_gating_func": 2},
    # Mamba-2 (4 heads of 32, 2 groups, a 4-tap convolution), attention (no rope: Granite 4's hybrids have none),
    # Mamba-2; experts and a shared expert; Granite's multipliers
    "granitehybrid": {"block_count": 3, "embedding_length": 64, "feed_forward_length": 32, "attention.head_count": 4,
                      "attention.head_count_kv": [0, 2, 0], "context_length": 128,
                      "attention.layer_norm_rms_epsilon": 1e-5, "vocab_size": 320, "ssm.conv_kernel": 4,
                      "ssm.inner_size": 128, "ssm.state_size": 16, "ssm.time_step_rank": 4, "ssm.group_count": 2,
                      "rope.scaling.finetuned": False, "expert_count": 4, "expert_used_count": 2,
                      "expert_shared_feed_forward_length": 48, "embedding_scale": 2.0, "residual_scale": 0.5,
                      "attention.scale": 0.125, "logit_scale": 4.0},
    # Mamba-2 (4 heads of 16, 2 groups, 4 taps), squared-ReLU MLP, attention (no rope), MLP, Mamba-2
    "nemotron_h": {"block_count": 5, "embedding_length": 64, "attention.head_count": 4,
                   "attention.head_count_kv": [0, 0, 2, 0, 0], "feed_forward_length": [0, 96, 0, 96, 0],
                   "attention.key_length": 16, "attention.value_length": 16, "context_length": 128,
                   "attention.layer_norm_epsilon": 1e-5, "attention.layer_norm_rms_epsilon": 1e-5,
                   "vocab_size": 320, "ssm.conv_kernel": 4, "ssm.inner_size": 64, "ssm.state_size": 16,
                   "ssm.time_step_rank": 4, "ssm.group_count": 2},
    "qwen35": {"block_count": 4, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
               "attention.head_count_kv": 2, "attention.key_length": 16, "attention.value_length": 16,
               "rope.dimension_count": 8, "context_length": 128, "attention.layer_norm_rms_epsilon": 1e-6,
               "rope.freq_base": 1e7, "vocab_size": 320, "ssm.conv_kernel": 4, "ssm.state_size": 16,
               "ssm.group_count": 2, "ssm.time_step_rank": 4, "ssm.inner_size": 64,
               "rope.dimension_sections": [2, 1, 1, 0], "full_attention_interval": 2},  # delta net, attention, x2
    "qwen35moe": {"block_count": 4, "embedding_length": 64, "attention.head_count": 4, "attention.head_count_kv": 2,
                  "attention.key_length": 16, "attention.value_length": 16, "rope.dimension_count": 8,
                  "context_length": 128, "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1e7,
                  "vocab_size": 320, "ssm.conv_kernel": 4, "ssm.state_size": 16, "ssm.group_count": 2,
                  "ssm.time_step_rank": 4, "ssm.inner_size": 64, "rope.dimension_sections": [2, 1, 1, 0],
                  "full_attention_interval": 2, "expert_count": 8, "expert_used_count": 2,
                  "expert_feed_forward_length": 32, "expert_shared_feed_forward_length": 48},
    "qwen3next": {"block_count": 4, "embedding_length": 64, "attention.head_count": 4, "attention.head_count_kv": 2,
                  "attention.key_length": 16, "attention.value_length": 16, "rope.dimension_count": 8,
                  "context_length": 128, "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1e7,
                  "vocab_size": 320, "ssm.conv_kernel": 4, "ssm.state_size": 16, "ssm.group_count": 2,
                  "ssm.time_step_rank": 4, "ssm.inner_size": 64, "full_attention_interval": 2, "expert_count": 8,
                  "expert_used_count": 2, "expert_feed_forward_length": 32, "expert_shared_feed_forward_length": 48},
    "smollm3": {"block_count": 4, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
                "attention.head_count_kv": 2, "context_length": 128, "attention.layer_norm_rms_epsilon": 1e-6,
                "rope.freq_base": 5000000.0, "vocab_size": 320},  # layer 3 has no rope
    "mistral3": {"block_count": 2, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
                 "attention.head_count_kv": 2, "attention.key_length": 32, "attention.value_length": 32,
                 "context_length": 128, "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 1e6,
                 "rope.dimension_count": 32, "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                 "rope.scaling.original_context_length": 4, "rope.scaling.yarn_log_multiplier": 1.0,
                 "attention.temperature_scale": 0.1, "vocab_size": 320},  # the temperature steps every 4 tokens
    "llama4": {"block_count": 4, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
               "attention.head_count_kv": 2, "context_length": 128, "attention.layer_norm_rms_epsilon": 1e-5,
               "rope.freq_base": 500000.0, "vocab_size": 320, "tokenizer.ggml.model": "gpt2",
               "expert_count": 4, "expert_used_count": 1, "expert_feed_forward_length": 32,
               "interleave_moe_layer_step": 2},  # layers 1 and 3 have experts; layer 3 no rope
    "mllama": {"block_count": 3, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
               "attention.head_count_kv": 2, "context_length": 128, "attention.layer_norm_rms_epsilon": 1e-5,
               "rope.freq_base": 10000.0, "vocab_size": 320, "attention.cross_attention_layers": [1]},  # text only
    # DeepSeek V3's layout: q_lora, a leading dense layer, sigmoid routing over 2 groups with a choosing bias,
    # renormalised and scaled weights, a shared expert, YaRN; its cache holds the latent (32) + rope key (16)
    "deepseek2": {"block_count": 3, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
                  "attention.head_count_kv": 1, "attention.q_lora_rank": 32, "attention.kv_lora_rank": 32,
                  "attention.key_length": 48, "attention.value_length": 32, "attention.key_length_mla": 32,
                  "attention.value_length_mla": 16, "rope.dimension_count": 16, "context_length": 128,
                  "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 10000.0, "vocab_size": 320,
                  "leading_dense_block_count": 1, "expert_count": 8, "expert_used_count": 2,
                  "expert_feed_forward_length": 32, "expert_shared_count": 1, "expert_gating_func": 2,
                  "expert_group_count": 2, "expert_group_used_count": 1, "expert_weights_norm": True,
                  "expert_weights_scale": 2.5, "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                  "rope.scaling.original_context_length": 32, "rope.scaling.yarn_log_multiplier": 0.0707},
    # GLM-4.5's layout: GQA with half-rotated heads (NeoX), DeepSeek V3's experts behind a dense layer
    "glm4moe": {"block_count": 3, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
                "attention.head_count_kv": 2, "rope.dimension_count": 8, "context_length": 128,
                "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 1000000.0, "vocab_size": 320,
                "leading_dense_block_count": 1, "expert_count": 8, "expert_used_count": 2,
                "expert_feed_forward_length": 32, "expert_shared_count": 1, "expert_gating_func": 2,
                "expert_weights_norm": True, "expert_weights_scale": 1.5},
    "bert": {"block_count": 2, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
             "context_length": 64, "attention.layer_norm_epsilon": 1e-12, "pooling_type": 1, "vocab_size": 160,
             "tokenizer.ggml.model": "bert", "tokenizer.ggml.token_type_count": 2},
    "nomic-bert": {"block_count": 2, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
                   "context_length": 64, "attention.layer_norm_epsilon": 1e-12, "pooling_type": 1, "vocab_size": 160,
                   "rope.freq_base": 1000.0, "tokenizer.ggml.model": "bert", "tokenizer.ggml.token_type_count": 2},
}

GENERATING = sorted(a for a, cls in models.registry().items() if cls.generates)
EMBEDDING = sorted(a for a, cls in models.registry().items() if cls.embed is not Model.embed)
PROMPT = [1, 17, 42, 99, 5, 23, 64]
OTHER = [1, 50, 31, 8]

# Tolerances, as max |a - b| / max |b| over the compared logits or embeddings, from the errors measured
# on these tiny models (F32 cache, 2 threads, x86-64 CPU) with a margin for other CPUs' kernels:
F16_TOLERANCE = 5e-3  # F16 vs F32 weights: measured 7.5e-4 (llama), 4.9e-4 (bert): F16 rounding (2^-11)
LLAMA_CPP_TOLERANCE = 2e-3  # the same file in llama.cpp: measured 2.5e-4 (llama: its cache is F16), 8e-5 (bert)
SAME_TOLERANCE = 2e-5  # one model along two batching paths: measured 0 .. 2.7e-7 (summation order only);
#                       a token seen or hidden by mistake changes later rows by ~0.4 (measured, llama)
if TEST_DEVICE == "gpu":  # there each batch shape picks its own matmul kernels (a one-row dot product or a
    SAME_TOLERANCE = GPU_TOLERANCE  # tiled GEMM with F16 inputs): two batching paths differ as CPU and GPU do,
    F16_TOLERANCE += GPU_TOLERANCE  # and F16 weights add their rounding to it (measured on an H200: 6.5e-3, qwen35moe)


def test_every_architecture_has_a_tiny_config():
    missing = sorted(set(models.registry()) - set(TINY))
    assert not missing, f"add a tiny config to TINY in {__file__} for: {', '.join(missing)}"


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    """``tiny_file(arch, dtype)``: the path of a tiny random model, written once per module."""
    folder, written = tmp_path_factory.mktemp("architectures"), {}

    def get(arch: str, dtype: str = "f32"):
        if (arch, dtype) not in written:
            written[arch, dtype] = write_model(folder / f"{arch}-{dtype}.gguf", arch, TINY[arch], dtype, seed=7)
        return written[arch, dtype]

    return get


def load(path, max_sequences=1, device: str = TEST_DEVICE) -> Model:
    if device == "gpu" and not gpu_present():
        pytest.skip("PYGGML_TEST_DEVICE=gpu but this build of pyggml sees no GPU")
    model = models.load(path, BackendParams(n_threads=2, gpu_layers="all" if device == "gpu" else 0))
    assert device != "gpu" or model.backend.has_gpu
    if model.cache is not None:
        model.cache.init(model.backend, DType.F32, max_sequences=max_sequences, capacity=64, max_batch=32)
    return model


def forward(model: Model, tokens, positions=None, sequences=None, outputs=None) -> np.ndarray:
    """Logits (len(outputs), vocab) of one batch (default: one sequence 0 from position 0, every row)."""
    batch = Batch(inputs=list(tokens), positions=list(positions if positions is not None else range(len(tokens))),
                  sequences=list(sequences if sequences is not None else [0] * len(tokens)),
                  outputs=list(outputs if outputs is not None else range(len(tokens))))
    with model.backend.new_context() as ctx:
        model.cache.start_forward(ctx, batch)
        logits = model.forward(ctx, batch)
        ctx.compute(logits)
        return logits.numpy()


def embed(model: Model, sequences: list[list[int]]) -> np.ndarray:
    """Pooled embeddings (n_sequences, hidden) of whole sequences in one batch."""
    tokens = [t for s in sequences for t in s]
    batch = Batch(inputs=tokens, positions=[p for s in sequences for p in range(len(s))],
                  sequences=[i for i, s in enumerate(sequences) for _ in s])
    with model.backend.new_context() as ctx:
        out = model.embed(ctx, batch)
        ctx.compute(out)
        return out.numpy()


def decode_with_reuse(model: Model, prompt: list[int], steps: list[int]) -> tuple[np.ndarray, int]:
    """Last-row logits after the prompt and after each decode step, through the engine's graph
    reuse; and how many passes reused the previous graph. (The only use of the engine here.)"""
    engine = Engine(model)
    try:
        rows = [engine.forward(Batch(inputs=prompt, outputs=[len(prompt) - 1], positions=range(len(prompt)),
                             sequences=[0] * len(prompt)))[-1]]
        for i, token in enumerate(steps):
            pos = len(prompt) + i
            rows.append(engine.forward(Batch(inputs=[token], outputs=[0], positions=[pos], sequences=[0]))[-1])
        return np.stack(rows), engine.reused
    finally:
        engine.close()


# ---- generating architectures ------------------------------------------------------------------------
@pytest.mark.parametrize("arch", GENERATING)
def test_logits_shape(arch, tiny_file):
    model = load(tiny_file(arch))
    try:
        logits = forward(model, PROMPT)
        n_vocab = TINY[arch]["vocab_size"]  # mllama's token_embd has 8 rows more (<|image|>)
        assert logits.shape == (len(PROMPT), n_vocab) and np.isfinite(logits).all()
        assert forward(model, [3, 4], positions=[7, 8], outputs=[1]).shape == (1, n_vocab)
    finally:
        model.close()


@pytest.mark.parametrize("arch", GENERATING)
def test_f16_weights_agree_with_f32(arch, tiny_file):
    f32, f16 = load(tiny_file(arch, "f32")), load(tiny_file(arch, "f16"))
    try:
        assert error(forward(f16, PROMPT), forward(f32, PROMPT)) < F16_TOLERANCE
    finally:
        f32.close()
        f16.close()


@pytest.mark.parametrize("arch", GENERATING)
def test_prompt_in_one_batch_equals_token_by_token(arch, tiny_file):
    model = load(tiny_file(arch))
    try:
        whole = forward(model, PROMPT)
        model.cache.remove(0, 0)
        steps = np.concatenate([forward(model, [t], positions=[i]) for i, t in enumerate(PROMPT)])
        assert error(steps, whole) < SAME_TOLERANCE
    finally:
        model.close()


@pytest.mark.parametrize("arch", GENERATING)
def test_two_sequences_in_one_batch_equal_each_alone(arch, tiny_file):
    alone = load(tiny_file(arch))
    both = load(tiny_file(arch), max_sequences=2)
    try:
        a = forward(alone, PROMPT)
        alone.cache.remove(0, 0)
        b = forward(alone, OTHER)
        # interleaved, so that each sequence's rows are not one block
        order = [(0, i) for i in range(len(PROMPT))]
        for j in range(len(OTHER)):
            order.insert(2 * j + 1, (1, j))
        tokens = [(PROMPT, OTHER)[s][i] for s, i in order]
        together = forward(both, tokens, positions=[i for _, i in order], sequences=[s for s, _ in order])
        assert error(together[[k for k, (s, _) in enumerate(order) if s == 0]], a) < SAME_TOLERANCE
        assert error(together[[k for k, (s, _) in enumerate(order) if s == 1]], b) < SAME_TOLERANCE
    finally:
        alone.close()
        both.close()


@pytest.mark.parametrize("arch", GENERATING)
def test_decode_steps_reuse_the_graph(arch, tiny_file):
    model = load(tiny_file(arch))
    try:
        steps = [9, 33, 70, 2]
        reused_rows, reused = decode_with_reuse(model, PROMPT, steps)
        assert reused >= len(steps) - 1  # the first step may build; the others recompute its graph
        model.cache.remove(0, 0)
        fresh = forward(model, PROMPT + steps)[len(PROMPT) - 1:]
        assert error(reused_rows, fresh) < SAME_TOLERANCE
    finally:
        model.close()


# ---- embedding architectures -------------------------------------------------------------------------
@pytest.mark.parametrize("arch", EMBEDDING)
def test_embedding_shape(arch, tiny_file):
    model = load(tiny_file(arch))
    try:
        vectors = embed(model, [PROMPT])
        assert vectors.shape == (1, model.weights.token_embd.weight.shape[0]) and np.isfinite(vectors).all()
    finally:
        model.close()


@pytest.mark.parametrize("arch", EMBEDDING)
def test_embedding_f16_weights_agree_with_f32(arch, tiny_file):
    f32, f16 = load(tiny_file(arch, "f32")), load(tiny_file(arch, "f16"))
    try:
        assert error(embed(f16, [PROMPT]), embed(f32, [PROMPT])) < F16_TOLERANCE
    finally:
        f32.close()
        f16.close()


@pytest.mark.parametrize("arch", EMBEDDING)
def test_embedding_two_sequences_in_one_batch_equal_each_alone(arch, tiny_file):
    model = load(tiny_file(arch))
    try:
        together = embed(model, [PROMPT, OTHER])
        assert error(together[:1], embed(model, [PROMPT])) < SAME_TOLERANCE
        assert error(together[1:], embed(model, [OTHER])) < SAME_TOLERANCE
    finally:
        model.close()


@pytest.mark.skipif(not ON_GPU, reason="GPU test mode only (PYGGML_TEST_DEVICE=gpu)")
@pytest.mark.ci_may_skip
@pytest.mark.parametrize("arch", GENERATING)
def test_gpu_logits_and_greedy_tokens_agree_with_cpu(arch, tiny_file):
    """Every layer on the GPU against the CPU: a prompt's logits, then 8 greedy decode steps."""
    prompt = [1, 5, 9, 13, 17, 21]
    results = []
    for device in ("cpu", "gpu"):
        model = load(tiny_file(arch), device=device)
        try:
            logits = forward(model, prompt)
            tokens = [int(np.argmax(logits[-1]))]
            for i in range(7):
                row = forward(model, tokens[-1:], positions=[len(prompt) + i], outputs=[0])[-1]
                tokens.append(int(np.argmax(row)))
            results.append((logits, tokens))
        finally:
            model.close()
    (cpu_logits, cpu_tokens), (gpu_logits, gpu_tokens) = results
    assert error(gpu_logits, cpu_logits) < GPU_TOLERANCE
    assert gpu_tokens == cpu_tokens


# ---- the same file in llama.cpp ----------------------------------------------------------------------
NOT_IN_LLAMA_CPP = {"mllama", "qwen25vl"}  # Ollama's architectures: llama.cpp never ran them
_LLAMA_CPP = textwrap.dedent("""
    import json, sys
    import llama_cpp
    path, text, embedding = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    llm = llama_cpp.Llama(model_path=path, n_ctx=64, n_threads=2, verbose=False, logits_all=not embedding,
                          embedding=embedding, **({"pooling_type": 1} if embedding else {}))
    tokens = llm.tokenize(text.encode())
    if embedding:
        out = llm.embed(text, normalize=False)
    else:
        llm.eval(tokens)
        out = [list(map(float, row)) for row in llm.scores[:len(tokens)]]
    print(json.dumps({"tokens": tokens, "out": out}))
""")


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama_cpp (llama-cpp-python) is absent")
@pytest.mark.parametrize("arch", sorted((set(GENERATING) | set(EMBEDDING)) - NOT_IN_LLAMA_CPP))
def test_llama_cpp_runs_the_same_file(arch, tiny_file):
    """Synthetic files are GGUFs as llama.cpp writes them (in a subprocess: a crash there must not end the run)."""
    path, text = tiny_file(arch), "hello world, 42!"
    done = subprocess.run([sys.executable, "-c", _LLAMA_CPP, str(path), text, "0" if arch in GENERATING else "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    model = load(tiny_file(arch))
    try:
        tokens = model.tokenizer.encode(text)
        assert tokens == theirs["tokens"]
        ours = forward(model, tokens) if arch in GENERATING else embed(model, [tokens])[0]
        assert error(ours, np.array(theirs["out"], np.float32)) < LLAMA_CPP_TOLERANCE
    finally:
        model.close()


# ---- the bench shapes of these architectures (pyggml.synthetic.SHAPES), shrunk ------------------------------
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama_cpp (llama-cpp-python) is absent")
@pytest.mark.parametrize("name, dtype", [("gemma3-1b", "q4_0"), ("phi3-mini-8l", "q8_0"), ("gpt-oss-small", "mxfp4"),
                                         ("lfm2-1.2b", "f16"),  # quantized: llama.cpp 0.3.36 dies (SIGILL) here
                                         ("granite-4.0-h-tiny-10l", "f16"), ("nemotron-nano-9b-v2-14l", "f16"),
                                         ("qwen3.5-35b-a3b", "q8_0"),
                                         ("gemma4-e2b", "q4_0"), ("llama4-small", "f16"),
                                         ("deepseek-v2-lite-small", "f16"),
                                         # Q4_0 experts run repacked (mulmat_id), attn_k_b stays plain (mulmat)
                                         ("deepseek-v2-lite-small", "q4_0"), ("qwen3moe-small", "q4_0")])
def test_bench_shapes_run_in_pyggml_and_llama_cpp(name, dtype, tmp_path):
    """Each shape's keys and types (MXFP4 experts and Q8_0 elsewhere for gpt-oss, as llama.cpp's MXFP4_MOE
    files) with fewer layers, experts and tokens: both engines load the file and compute the same logits."""
    from pyggml.synthetic import SHAPES, write_synthetic

    smaller = {"block_count": 6 if name.startswith("gemma3") else 2, "vocab_size": 512}
    if name.startswith("llama4"):  # one layer without rope: llama.cpp's temperature input must be used by one
        smaller["block_count"] = 4
    if "expert_count" in SHAPES[name].extra:
        smaller["expert_count"] = 4
        smaller["expert_used_count"] = min(SHAPES[name].extra["expert_used_count"], 4)
    if name.startswith("lfm2"):  # a layer kind per layer: convolution, attention, convolution
        smaller |= {"block_count": 3, "attention.head_count_kv": [0, 8, 0]}
    if name.startswith("granite"):  # Mamba-2, attention, Mamba-2
        smaller |= {"block_count": 3, "attention.head_count_kv": [0, 4, 0], "expert_count": 8}
    if name.startswith("nemotron"):  # Mamba-2, MLP, attention
        smaller |= {"block_count": 3, "attention.head_count_kv": [0, 0, 8], "feed_forward_length": [0, 15680, 0]}
    if name.startswith("qwen3.5"):  # a Gated DeltaNet layer, then an attention layer
        smaller |= {"full_attention_interval": 2, "expert_count": 8}
    if name.startswith("gemma4"):  # 4 sliding, 1 global, 2 sliding reading layer 3's cache
        smaller |= {"block_count": 7, "attention.sliding_window_pattern": [i % 5 < 4 for i in range(7)],
                    "attention.shared_kv_layers": 2, "feed_forward_length": [6144] * 5 + [12288] * 2}
    path = write_synthetic(tmp_path / f"{name}.gguf", name, dtype, hparams=smaller)
    text = "hello world, 42!"
    done = subprocess.run([sys.executable, "-c", _LLAMA_CPP, str(path), text, "0"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    model = load(path)
    try:
        assert model.architecture == SHAPES[name].arch
        if dtype == "mxfp4":
            types = {n: t.dtype for n, t in model.backend.tensors().items() if n.startswith("blk.0.")}
            assert {n for n, t in types.items() if t == DType.MXFP4} == {
                f"blk.0.ffn_{k}_exps.weight" for k in ("gate", "up", "down")}
            assert types["blk.0.attn_q.weight"] == DType.Q8_0
        if dtype in ("q4_0", "mxfp4") and platform.machine() in ("x86_64", "AMD64"):  # as llama.cpp places them
            experts = {n for n in model.backend.tensors() if n.endswith("_exps.weight")}
            assert experts <= model.backend._repacked, "ggml repacks Q4_0 and MXFP4 experts for AVX2 and later"
        tokens = model.tokenizer.encode(text)
        assert tokens == theirs["tokens"]
        # quantized weights: both engines quantize activations too, and at these widths a rounding flip on
        # one side moves random-weight logits by ~1% (measured phi3 Q8_0: 1.2% apart, each 1.6% from F32)
        assert error(forward(model, tokens), np.array(theirs["out"], np.float32)) < 5e-2
    finally:
        model.close()


# ---- experts stored fused (llama.cpp's converter with --fuse-gate-up-exps) --------------------------------------
def fuse_gate_up(src, dst) -> int:
    """Rewrite ``src`` with each layer's ffn_gate_exps and ffn_up_exps as one ffn_gate_up_exps (the gate's rows,
    then the up's), as llama.cpp's converter writes it on request. Returns the number of layers fused."""
    import gguf

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        sub = {"sub_type": field.types[-1]} if kind == gguf.GGUFValueType.ARRAY else {}
        writer.add_key_value(field.name, field.contents(), kind, **sub)
    tensors = {t.name: t for t in reader.tensors}
    fused = 0
    for t in reader.tensors:
        name, data = t.name, np.asarray(t.data)
        if name.endswith("ffn_up_exps.weight") and name.replace("_up_", "_gate_") in tensors:
            continue
        if name.endswith("ffn_gate_exps.weight") and name.replace("_gate_", "_up_") in tensors:
            up = np.asarray(tensors[name.replace("_gate_", "_up_")].data)
            name, data = name.replace("ffn_gate_exps", "ffn_gate_up_exps"), np.concatenate([data, up], 1)
            fused += 1
        writer.add_tensor(name, data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return fused


@pytest.mark.parametrize("arch, dtype", [("deepseek2", "f32"), ("glm4moe", "f32"), ("qwen35moe", "f32"),
                                         ("qwen3next", "f32"), ("deepseek2", "q4_0"), ("qwen35moe", "q4_0")])
def test_fused_gate_up_experts_compute_as_the_separate_ones(arch, dtype, tiny_file, tmp_path):
    """A file whose experts are stored as ffn_gate_up_exps loads and gives the logits of the same weights stored
    apart (Q4_0: the fused stack repacked), and those of llama.cpp on the fused F32 file, for the architectures
    llama.cpp reads it in. (Q4_0 is not held to llama.cpp here: with this F32 cache and llama.cpp's F16 one, a
    near-tie of deepseek2's tiny router flips at one token; with an F16 cache both give the same logits.)"""
    separate, fused = tiny_file(arch, dtype), tmp_path / f"{arch}-fused.gguf"
    assert fuse_gate_up(separate, fused) > 0
    tokens = [1, 5, 9, 2, 7]
    models_ = [load(separate), load(fused)]
    try:
        assert "blk.1.ffn_gate_up_exps.weight" in models_[1].backend.tensors()
        ours, theirs = (forward(m, tokens) for m in models_)
    finally:
        for m in models_:
            m.close()
    assert error(theirs, ours) < SAME_TOLERANCE
    if dtype == "f32" and arch != "glm4moe" and importlib.util.find_spec("llama_cpp") is not None:  # (no fused glm4moe)
        text = "hello world, 42!"
        done = subprocess.run([sys.executable, "-c", _LLAMA_CPP, str(fused), text, "0"], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        reference = json.loads(done.stdout.strip().splitlines()[-1])
        model = load(fused)
        try:
            ours = forward(model, reference["tokens"])
            assert error(ours, np.array(reference["out"], np.float32)) < LLAMA_CPP_TOLERANCE
        finally:
            model.close()
