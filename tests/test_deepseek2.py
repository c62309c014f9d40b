"""DeepSeek V2 / V3 (GGUF ``deepseek2``): tiny random Hugging Face models converted with ``pyggml.convert`` and run
by pyggml against transformers (F32 logits in one batch, in batches of 3, token by token, several sequences at once,
YaRN past its original context) and llama.cpp on the same files; the latent cache's size per token; the absorbed
attention against the decompressing one; context shift; layer-by-layer taps; the converter's names, keys and
refusals."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pyggml import BackendParams, DType, models

from ._models import (
    converted_cases,
    error,
    logits_match_in_batches,
    reference,
    refuses_config,
    sequences_match_transformers,
)
from .test_architectures import forward
from .test_convert import needs_llama_cpp, read_gguf

torch = pytest.importorskip("torch", reason="the DeepSeek parity tests build HF models with torch")
transformers = pytest.importorskip("transformers", reason="the DeepSeek parity tests build HF models")

from .hf_fixtures import make_tiny_deepseek  # noqa: E402  (needs torch/transformers)
from .test_qwen import TEXTS, llama_cpp_agrees  # noqa: E402

YARN = {"factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.707, "mscale_all_dim": 0.707}
CASES = {"v3-q-lora": dict(version=3),  # sigmoid routing in 4 groups (2 kept), correction bias, renorm, scale 2.5
         "v2-lite": dict(version=2, q_lora=None),  # attn_q, softmax routing, no renorm, scale 1.5
         "v3-yarn": dict(version=3, q_lora=None, yarn=YARN, seed=1),  # prompts run past the original 16 positions
         "glm-4.7-flash": dict(version="glm-lite", seed=2)}  # V3's layout as GLM-4.7-Flash names it
# max |ours - theirs| / max |theirs| over the logits; measured 4.4e-7 .. 6.1e-7 against transformers (F32 cache);
# the expert groups ignored gives 0.1 and more (test_the_routing_is_what_the_logits_depend_on)
TOLERANCE = 1e-3
SAME = 2e-5  # one model along two paths (summation order only)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(case, out_type="f32")``: (path of the converted file, HF model, HF tokenizer), made once;
    ``converted.hf_dirs[case]``: the checkpoint's folder."""
    return converted_cases(tmp_path_factory.mktemp("deepseek"), make_tiny_deepseek, CASES)


def prompt(tokenizer) -> list[int]:
    tokens = tokenizer.encode(TEXTS[0] + " " + TEXTS[1])
    assert len(tokens) > 2 * YARN["original_max_position_embeddings"]
    return tokens


def run(model, tokens: list[int], start: int = 0) -> np.ndarray:
    """Logits of every row of one batch of sequence 0 at positions start.."""
    return forward(model, tokens, positions=range(start, start + len(tokens)))


def load(path, dtype=DType.F32, capacity=64):
    model = models.load(path, BackendParams(n_threads=2))
    model.cache.init(model.backend, dtype, max_sequences=1, capacity=capacity, max_batch=64)
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_in_one_batch_and_token_by_token(case, converted):
    path, model, tokenizer = converted(case)
    logits_match_in_batches(path, model, prompt(tokenizer), TOLERANCE, batch_sizes=(512, 3, 1),
                            text=TEXTS[0] + " " + TEXTS[1])


def test_the_routing_is_what_the_logits_depend_on(converted):
    """The tiny V3's expert choice depends on its groups and its correction bias, so the parity above checks
    them: leaving either out moves the logits far past the tolerance."""
    path, model, tokenizer = converted("v3-q-lora")
    tokens = prompt(tokenizer)
    expected = reference(model, tokens)
    ours = load(path)
    try:
        assert error(run(ours, tokens), expected) < TOLERANCE
        ours.options = dataclasses.replace(ours.options, groups=1)
        ours.cache.remove(0, 0)
        assert error(run(ours, tokens), expected) > 50 * TOLERANCE
        for layer in ours.weights.blk[ours.options.n_dense:]:
            layer.mlp.exp_probs_b = None
        ours.options = dataclasses.replace(ours.options, groups=4)
        ours.cache.remove(0, 0)
        assert error(run(ours, tokens), expected) > 50 * TOLERANCE
    finally:
        ours.close()


@pytest.mark.parametrize("case", ["v3-q-lora", "v2-lite"])
def test_several_sequences_at_once_match_transformers(case, converted):
    path, model, tokenizer = converted(case)
    sequences_match_transformers(path, model, [tokenizer.encode(t) for t in TEXTS], TOLERANCE)


@needs_llama_cpp
@pytest.mark.parametrize("case, out_type", [(case, "f32") for case in CASES] + [("v3-q-lora", "q8_0")])
def test_llama_cpp_gives_the_same_logits_and_greedy_tokens(case, out_type, converted):
    llama_cpp_agrees(converted(case, out_type)[0])


@pytest.mark.parametrize("dtype", [DType.F32, DType.F16])
def test_the_cache_holds_a_latent_and_a_rope_key_per_token(converted, dtype):
    """MLA's point: per token and layer the cache stores kv_lora_rank + rope_dim values (here 32 + 8), not keys
    and values for every head (4 x (24 + 16))."""
    path, model, tokenizer = converted("v3-q-lora")
    cfg = model.config
    ours = load(path, dtype)
    try:
        run(ours, tokenizer.encode(TEXTS[0]))
        cache_bytes = sum(device["cache"] for device in ours.backend.memory().values())
        per_token = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.num_hidden_layers * dtype.type_size
        assert cache_bytes == per_token * ours.cache.cells.capacity
        assert not ours.cache.values  # no value tensors: the values are views of the keys
    finally:
        ours.close()


@pytest.mark.parametrize("case", ["v3-q-lora", "v3-yarn"])
def test_absorbed_decode_equals_decompressed_attention(case, converted):
    """The absorbed form (W_UK in the queries, W_UV after attention) against decompressing every cached latent
    into per-head keys and values: a prompt, then decode steps, from the same latent cache."""
    path, _, tokenizer = converted(case)
    tokens = prompt(tokenizer)
    rows = {}
    for absorb in (True, False):
        ours = load(path)
        ours.absorb = absorb
        try:
            steps = [run(ours, tokens[:20])]
            steps += [run(ours, [t], start=20 + i) for i, t in enumerate(tokens[20:])]
            rows[absorb] = np.concatenate(steps)
        finally:
            ours.close()
    assert error(rows[True], rows[False]) < SAME


@pytest.mark.parametrize("flash, dtype, tolerance", [(True, DType.F32, SAME), (True, DType.F16, 5e-3),
                                                     (False, DType.F16, 5e-3), (True, DType.Q8_0, 5e-2)])
def test_flash_attention_and_smaller_caches_read_the_values_from_the_keys(flash, dtype, tolerance, tmp_path):
    """Flash attention takes the values as a strided view of the key rows too, and F16 / Q8_0 latent caches (the
    value's 32 elements a whole number of Q8_0 blocks) agree with the plain F32 path up to their rounding (measured:
    4.3e-7 flash F32, 1e-3 F16, 1.7e-2 Q8_0), through a prompt and decode steps."""
    from pyggml.synthetic import write_model

    from .test_architectures import TINY

    hparams = {**TINY["deepseek2"], "attention.kv_lora_rank": 32, "attention.key_length": 64,
               "attention.value_length": 32, "rope.dimension_count": 32, "attention.key_length_mla": 48}
    path = write_model(tmp_path / "m.gguf", "deepseek2", hparams, "f32", seed=3)
    tokens = list(range(5, 45))
    logits = []
    for params in ((False, DType.F32), (flash, dtype)):
        model = models.load(path, BackendParams(n_threads=2, flash_attention=params[0]))
        model.cache.init(model.backend, params[1], max_sequences=1, capacity=64, max_batch=64)
        try:
            steps = [run(model, tokens[:30])] + [run(model, [t], start=30 + i) for i, t in enumerate(tokens[30:])]
            logits.append(np.concatenate(steps))
        finally:
            model.close()
    assert error(logits[1], logits[0]) < tolerance


@pytest.mark.parametrize("case", ["v3-q-lora", "v3-yarn"])
def test_context_shift_re_rotates_the_rope_keys(case, converted):
    """A prompt cached at positions 6.. and shifted down by 6 (``remove`` of the empty positions 0..6) holds what
    the prompt cached at 0.. holds: its latents as they were, its rope keys re-rotated by -6 (the scores are
    relative, so the states are the same). Without re-rotating, the next token's logits differ."""
    path, _, tokenizer = converted(case)
    tokens = prompt(tokenizer)[:30]
    at_zero = load(path)
    run(at_zero, tokens)
    expected = run(at_zero, tokens[:1], start=len(tokens))
    at_zero.close()
    for rotate in (True, False):
        shifted = load(path)
        try:
            if not rotate:
                shifted.cache.shift_fn = lambda ctx, layer, key, shift: key * 1.0
            run(shifted, tokens, start=6)
            shifted.cache.remove(0, 0, 6)
            logits = run(shifted, tokens[:1], start=len(tokens))
            assert (error(logits, expected) < SAME) == rotate
        finally:
            shifted.close()


def test_compare_taps_every_layer(converted):
    from pyggml import porting

    path, _, tokenizer = converted("v3-q-lora")
    result = porting.compare(tokenizer.name_or_path, path)
    names = [layer.name for layer in result.layers]
    assert {"token_embd", "blk.0", "blk.2", "output_norm", "output"} <= set(names)
    assert result.ok and not result.unmatched


@pytest.mark.parametrize("case", list(CASES))
def test_files_have_llama_cpps_names_and_keys(case, converted):
    path, model, _ = converted(case)
    meta, tensors = read_gguf(path)
    cfg = model.config
    rank, rope, nope, v, heads = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim, 4
    assert meta["general.architecture"] == "deepseek2"
    assert (meta["deepseek2.attention.key_length"], meta["deepseek2.attention.value_length"]) == (rank + rope, rank)
    assert meta["deepseek2.attention.key_length_mla"] == nope + rope
    assert meta["deepseek2.attention.value_length_mla"] == v
    assert meta["deepseek2.attention.head_count_kv"] == 1 and meta["deepseek2.leading_dense_block_count"] == 1
    v3 = cfg.model_type != "deepseek_v2"
    assert meta["deepseek2.expert_gating_func"] == (2 if v3 else 1)
    assert meta["deepseek2.attention.q_lora_rank"] == (cfg.q_lora_rank or 0)
    sd = {k: val.detach().numpy() for k, val in model.state_dict().items()}
    kv_b = sd["model.layers.1.self_attn.kv_b_proj.weight"].reshape(heads, nope + v, rank)
    assert (tensors["blk.1.attn_k_b.weight"][1] == kv_b[:, :nope].transpose(0, 2, 1)).all()  # (heads, rank, nope)
    assert (tensors["blk.1.attn_v_b.weight"][1] == kv_b[:, nope:]).all()  # (heads, v, rank)
    assert "blk.0.ffn_gate.weight" in tensors and "blk.0.ffn_gate_inp.weight" not in tensors
    assert tensors["blk.2.ffn_gate_exps.weight"][1].shape == (16, 32, 64)
    if v3:
        assert (tensors["blk.1.exp_probs_b.bias"][1] == sd["model.layers.1.mlp.gate.e_score_correction_bias"]).all()
        assert (meta["deepseek2.expert_group_count"], meta["deepseek2.expert_group_used_count"]) == (4, 2)
        assert meta["deepseek2.expert_weights_norm"]
        assert meta["deepseek2.expert_weights_scale"] == pytest.approx(cfg.routed_scaling_factor)
    if case == "v3-yarn":
        assert meta["deepseek2.rope.scaling.yarn_log_multiplier"] == pytest.approx(0.0707)
        assert meta["deepseek2.rope.scaling.type"] == "yarn" and meta["deepseek2.rope.scaling.factor"] == 4.0


@pytest.mark.parametrize("case, change, message", [
    ("v3-q-lora", dict(rope_interleave=False), "rope_interleave"),
    ("v3-q-lora", dict(attention_bias=True), "attention_bias"),
    ("v2-lite", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2), "group_limited_greedy"),
    ("v3-yarn", dict(rope_parameters={**YARN, "rope_type": "yarn", "rope_theta": 1e4, "mscale": 1.0}), "mscale"),
    ("v3-yarn", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                      "original_max_position_embeddings": 16}), "mscale_all_dim"),
])
def test_configs_llama_cpp_runs_otherwise_are_refused(case, change, message, converted, tmp_path):
    converted(case)
    refuses_config(converted.hf_dirs[case], tmp_path, change, message)
