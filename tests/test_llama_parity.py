"""Logits of pyggml's llama against Hugging Face transformers (torch CPU) on tiny random models.

Each case builds a randomly initialised LlamaForCausalLM/MistralForCausalLM offline, converts it
with our converter and compares logits for a multi-token prompt, processed in one batch and token
by token through the KV cache. Tolerances are relative to the logits' scale (max |logit|).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch==2.13.0 (the `reference` extra)")
pytest.importorskip("transformers", reason="needs transformers (the `reference` extra)")

import pyggml  # noqa: E402
from pyggml.convert import convert_hf  # noqa: E402

from ._models import scaled_error  # noqa: E402
from .hf_fixtures import make_tiny_llama  # noqa: E402

PROMPT = [1, 17, 42, 99, 5, 250, 31, 7, 64, 128, 3, 77]

CASES = {
    "gqa-untied": dict(n_kv_heads=2, tie=False),
    "mha-tied": dict(n_kv_heads=4, tie=True),
    "linear-rope": dict(n_kv_heads=2, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama3-rope": dict(n_kv_heads=1, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 16}),
    "yarn-rope": dict(n_kv_heads=2, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 64}),
    "spm-vocab": dict(n_kv_heads=2, vocab="spm"),
    "mistral": dict(n_kv_heads=2, arch="mistral"),
}


def reference_logits(hf_model, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float().numpy()


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = make_tiny_llama(tmp_path_factory.mktemp(name), **CASES[name])
        return cache[name]

    return get


# bounds on scaled_error, ~3x the largest measured over the cases (2 threads, x86-64 AVX2):
F32_BOUND = 1.5e-6  # F32 weights and KV cache: 5.0e-7 (yarn-rope, token by token)
F16_BOUND = 2.5e-3  # F16 weights and KV cache: 7.8e-4 (mha-tied)
Q8_BOUND = 5e-2  # Q8_0 weights, F16 KV cache: 1.8e-2 (mha-tied)


@pytest.mark.parametrize("case", list(CASES))
def test_f32_logits_match_transformers(case, hf_models, tmp_path):
    hf_dir, hf_model = hf_models(case)
    gguf = convert_hf(hf_dir, tmp_path / "model.gguf", out_type="f32")
    ref = reference_logits(hf_model, PROMPT)
    with pyggml.load(gguf, n_threads=2, num_ctx=64, cache_type="f32") as llm:
        batch = llm.logits(PROMPT)
        assert batch.shape == ref.shape
        assert scaled_error(batch, ref) <= F32_BOUND, f"one batch: {scaled_error(batch, ref):.2e}"
    # token by token through the cache: batches of one token, each step's logits for the newest one
    with pyggml.load(gguf, n_threads=2, num_ctx=64, batch_size=1, cache_type="f32") as llm:
        steps = llm.logits(PROMPT)
        assert scaled_error(steps, ref) <= F32_BOUND, f"token by token: {scaled_error(steps, ref):.2e}"


@pytest.mark.parametrize("case", ["gqa-untied", "mha-tied"])
def test_f16_and_q8_logits_close_to_transformers(case, hf_models, tmp_path):
    """f16 weights (and an F16 KV cache) lose ~3 decimal digits; q8_0 about two."""
    hf_dir, hf_model = hf_models(case)
    ref = reference_logits(hf_model, PROMPT)
    for out_type, bound in (("f16", F16_BOUND), ("q8_0", Q8_BOUND)):
        gguf = convert_hf(hf_dir, tmp_path / f"model-{out_type}.gguf", out_type=out_type)
        with pyggml.load(gguf, n_threads=2, num_ctx=64) as llm:
            err = scaled_error(llm.logits(PROMPT), ref)
        assert err <= bound, f"{out_type}: {err:.2e} > {bound}"


def test_two_sequences_in_one_batch_match_separate_runs(hf_models, tmp_path):
    """Two sequences interleaved in one batch see only their own history."""
    from pyggml.models import Batch

    hf_dir, hf_model = hf_models("gqa-untied")
    gguf = convert_hf(hf_dir, tmp_path / "model.gguf", out_type="f32")
    a, b = PROMPT[:6], PROMPT[6:]
    ref_a, ref_b = reference_logits(hf_model, a), reference_logits(hf_model, b)
    model = pyggml.models.load(gguf, pyggml.BackendParams(n_threads=2))
    try:
        model.cache.init(model.backend, "f32", max_sequences=2, capacity=32, max_batch=16)
        tokens = [t for pair in zip(a, b, strict=True) for t in pair]
        batch = Batch(inputs=tokens, outputs=list(range(12)), positions=[i // 2 for i in range(12)],
                      sequences=[i % 2 for i in range(12)])
        with model.backend.new_context() as ctx:
            model.cache.start_forward(ctx, batch)
            logits = model.forward(ctx, batch)
            ctx.compute(logits)
            out = logits.numpy()
        assert scaled_error(out[0::2], ref_a) <= F32_BOUND  # measured 4.4e-7
        assert scaled_error(out[1::2], ref_b) <= F32_BOUND
    finally:
        model.close()
