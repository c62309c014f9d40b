"""Ministral 3 text decoders (GGUF ``mistral3``): tiny random Hugging Face models with YaRN and Llama 4's
attention temperature (a step every 8 positions, so the prompts cross several) converted with
``pyggml.convert``, run by pyggml against transformers (F32 logits in one batch, in small batches, token by
token, several sequences at once) and against llama.cpp on the same files; names, keys and refused configs."""

from __future__ import annotations

import pytest

import pyggml
from pyggml.convert import convert_hf

from ._models import (
    converted_cases,
    error,
    logits_match_in_batches,
    reference,
    refuses_config,
    sequences_match_transformers,
)
from .test_convert import needs_llama_cpp, read_gguf

torch = pytest.importorskip("torch", reason="the Mistral 3 parity tests build HF models with torch")
transformers = pytest.importorskip("transformers", reason="the Mistral 3 parity tests build HF models")

from .hf_fixtures import make_tiny_llama, make_tiny_mistral3_with_vision  # noqa: E402  (needs torch, transformers)
from .test_qwen import TEXTS, llama_cpp_agrees  # noqa: E402

STEP = 8  # original_max_position_embeddings: the temperature's step
ROPE = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 32.0, "original_max_position_embeddings": STEP,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}
CASES = {"gqa-untied-wide-heads": dict(n_kv_heads=2, tie=False, head_dim=32),
         "mha-tied": dict(n_kv_heads=4, tie=True, head_dim=16, seed=1)}
# max |ours - theirs| / max |theirs| over the logits; measured 4.2e-7 against transformers (F32 cache); YaRN's
# magnitude 1 + 0.1 ln(32) left in, or no temperature, fail it (checked)
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(case)``: (path of the converted F32 file, HF model, HF tokenizer), made once;
    ``converted.hf_dirs[case]``: the checkpoint's folder."""
    def make(root, **case):
        return make_tiny_llama(root, arch="ministral3", **case,
                               config_extra={"rope_parameters": dict(ROPE), "attn_implementation": "eager"})

    return converted_cases(tmp_path_factory.mktemp("mistral3"), make, CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_in_one_batch_and_token_by_token(case, converted):
    path, model, tokenizer = converted(case)
    tokens = tokenizer.encode(TEXTS[0] + " " + TEXTS[1])
    assert len(tokens) > 3 * STEP  # past several temperature steps
    logits_match_in_batches(path, model, tokens, TOLERANCE, batch_sizes=(512, 3, 1))


def test_several_sequences_at_once_match_transformers(converted):
    path, model, tokenizer = converted("gqa-untied-wide-heads")
    sequences_match_transformers(path, model, [tokenizer.encode(t) for t in TEXTS], TOLERANCE)


@needs_llama_cpp
@pytest.mark.parametrize("case", list(CASES))
def test_llama_cpp_gives_the_same_logits_and_greedy_tokens(case, converted):
    llama_cpp_agrees(converted(case)[0], steps=16)  # the greedy steps cross temperature steps too


@needs_llama_cpp
@pytest.mark.parametrize("text_type, gguf_arch", [("ministral3", "mistral3"), ("mistral", "llama")])
def test_the_text_decoder_of_a_checkpoint_with_vision_converts_and_runs_like_transformers(text_type, gguf_arch,
                                                                                         tmp_path):
    """Ministral 3 and Mistral Small 3.x (whose text decoder llama.cpp converts as GGUF llama), as published."""
    rope = ROPE if text_type == "ministral3" else {"rope_type": "default", "rope_theta": 1e9}
    hf_dir, model = make_tiny_mistral3_with_vision(tmp_path, rope, text_type=text_type)
    path = convert_hf(hf_dir, tmp_path / "m.gguf", "f32")
    meta, tensors = read_gguf(path)
    assert meta["general.architecture"] == gguf_arch and not any(n.startswith(("v.", "mm.")) for n in tensors)
    assert "output.weight" not in tensors  # tied, as saved
    tokens = transformers.AutoTokenizer.from_pretrained(hf_dir).encode(TEXTS[0] + " " + TEXTS[1])
    with pyggml.load(path, n_threads=2, num_ctx=64, cache_type="f32") as llm:
        assert error(llm.logits(tokens), reference(model, tokens)) < TOLERANCE
    llama_cpp_agrees(path)


def test_files_have_llama_cpps_names_and_keys(converted):
    path, _, _ = converted("gqa-untied-wide-heads")
    meta, tensors = read_gguf(path)
    assert meta["general.architecture"] == "mistral3"
    keys = {k.removeprefix("mistral3."): v for k, v in meta.items() if k.startswith("mistral3.")}
    assert keys == pytest.approx({
        "context_length": 256, "embedding_length": 64, "block_count": 2, "feed_forward_length": 128,
        "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 32,
        "attention.value_length": 32, "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 1e6,
        "rope.dimension_count": 32, "vocab_size": 416, "rope.scaling.type": "yarn", "rope.scaling.factor": 32.0,
        "rope.scaling.original_context_length": STEP, "rope.scaling.yarn_beta_fast": 32.0,
        "rope.scaling.yarn_beta_slow": 1.0, "rope.scaling.yarn_log_multiplier": 1.0,
        "attention.temperature_scale": 0.1})
    assert "output.weight" in tensors and "rope_freqs.weight" not in tensors


@pytest.mark.parametrize("change, message", [
    (dict(sliding_window=4), "sliding_window"),
    (dict(architectures=["Mistral3ForConditionalGeneration"], text_config={"model_type": "qwen3"}),
     "text_config is 'qwen3'"),
    (dict(rope_parameters={**ROPE, "mscale": 0.5}), "mscale"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e6, "factor": 8.0}), "rope scaling type"),
])
def test_configs_gguf_mistral3_cannot_express_are_refused(change, message, converted, tmp_path):
    converted("mha-tied")
    refuses_config(converted.hf_dirs["mha-tied"], tmp_path, change, message)
