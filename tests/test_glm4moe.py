"""GLM-4.5 (GGUF ``glm4moe``): tiny random Hugging Face models converted with ``pyggml.convert`` and run by pyggml
against transformers (F32 logits in one batch, in batches of 3, token by token, several sequences at once) and
llama.cpp on the same files; the routing the logits depend on; layer-by-layer taps; the converter's names, keys and
refusals."""

from __future__ import annotations

import dataclasses

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
from .test_convert import needs_llama_cpp, read_gguf

torch = pytest.importorskip("torch", reason="the GLM parity tests build HF models with torch")
transformers = pytest.importorskip("transformers", reason="the GLM parity tests build HF models")

from .hf_fixtures import make_tiny_glm4moe  # noqa: E402  (needs torch/transformers)
from .test_deepseek2 import run  # noqa: E402
from .test_qwen import TEXTS, llama_cpp_agrees  # noqa: E402

CASES = {"glm4.5-air": dict(),  # q/k/v biases, sigmoid routing in 4 groups (2 kept), a shared expert
         "glm4.5-qk-norm-tied": dict(qk_norm=True, tie=True, seed=1)}
# max |ours - theirs| / max |theirs| over the logits; measured 3.8e-7 .. 4.7e-7 against transformers (F32 cache)
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(case)``: (path of the converted F32 file, HF model, HF tokenizer), made once;
    ``converted.hf_dirs[case]``: the checkpoint's folder."""
    return converted_cases(tmp_path_factory.mktemp("glm4moe"), make_tiny_glm4moe, CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_in_one_batch_and_token_by_token(case, converted):
    path, model, tokenizer = converted(case)
    tokens = tokenizer.encode(TEXTS[0] + " " + TEXTS[1])
    logits_match_in_batches(path, model, tokens, TOLERANCE, batch_sizes=(512, 3, 1))


def test_the_routing_is_what_the_logits_depend_on(converted):
    """The tiny model's expert choice depends on its groups, so the parity above checks them."""
    path, model, tokenizer = converted("glm4.5-air")
    tokens = tokenizer.encode(TEXTS[0])
    expected = reference(model, tokens)
    ours = models.load(path, BackendParams(n_threads=2))
    ours.cache.init(ours.backend, DType.F32, max_sequences=1, capacity=64, max_batch=64)
    try:
        assert error(run(ours, tokens), expected) < TOLERANCE
        ours.options = dataclasses.replace(ours.options, groups=1)
        ours.cache.remove(0, 0)
        assert error(run(ours, tokens), expected) > 50 * TOLERANCE
    finally:
        ours.close()


def test_several_sequences_at_once_match_transformers(converted):
    path, model, tokenizer = converted("glm4.5-air")
    sequences_match_transformers(path, model, [tokenizer.encode(t) for t in TEXTS], TOLERANCE)


@needs_llama_cpp
@pytest.mark.parametrize("case", list(CASES))
def test_llama_cpp_gives_the_same_logits_and_greedy_tokens(case, converted):
    llama_cpp_agrees(converted(case)[0])


def test_compare_taps_every_layer(converted):
    from pyggml import porting

    path, _, tokenizer = converted("glm4.5-air")
    result = porting.compare(tokenizer.name_or_path, path)
    assert {"token_embd", "blk.0", "blk.2", "output_norm", "output"} <= {layer.name for layer in result.layers}
    assert result.ok and not result.unmatched


@pytest.mark.parametrize("case", list(CASES))
def test_files_have_llama_cpps_names_and_keys(case, converted):
    path, model, _ = converted(case)
    meta, tensors = read_gguf(path)
    cfg = model.config
    assert meta["general.architecture"] == "glm4moe"
    assert meta["glm4moe.rope.dimension_count"] == 8 and meta["glm4moe.leading_dense_block_count"] == 1
    assert meta["glm4moe.expert_gating_func"] == 2 and meta["glm4moe.expert_shared_count"] == 1
    assert (meta["glm4moe.expert_group_count"], meta["glm4moe.expert_group_used_count"]) == (4, 2)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    assert (tensors["blk.0.attn_q.weight"][1] == sd["model.layers.0.self_attn.q_proj.weight"]).all()  # NeoX order
    assert (tensors["blk.1.attn_k.bias"][1] == sd["model.layers.1.self_attn.k_proj.bias"]).all()
    assert (tensors["blk.1.exp_probs_b.bias"][1] == sd["model.layers.1.mlp.gate.e_score_correction_bias"]).all()
    assert "blk.0.post_attention_norm.weight" in tensors and "blk.0.ffn_gate.weight" in tensors
    assert ("blk.0.attn_q_norm.weight" in tensors) == cfg.use_qk_norm
    assert ("output.weight" in tensors) != cfg.tie_word_embeddings


@pytest.mark.parametrize("change, message", [
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "rope scaling type"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}),
     "partial_rotary_factor"),
])
def test_configs_gguf_glm4moe_cannot_express_are_refused(change, message, converted, tmp_path):
    converted("glm4.5-air")
    refuses_config(converted.hf_dirs["glm4.5-air"], tmp_path, change, message)
