"""SmolLM3 (GGUF ``smollm3``): tiny random Hugging Face models with a no-rope layer (layer 3 of 4) converted
with ``pyggml.convert``, run by pyggml against transformers (F32 logits in one batch and token by token,
several sequences at once) and against llama.cpp on the same files; names, keys and refused configs."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from pyggml.convert import from_interleaved_rope

from ._models import (
    converted_cases,
    logits_match_in_batches,
    refuses_config,
    sequences_match_transformers,
    shifted_keys,
)
from .test_convert import needs_llama_cpp, read_gguf

torch = pytest.importorskip("torch", reason="the SmolLM3 parity tests build HF models with torch")
transformers = pytest.importorskip("transformers", reason="the SmolLM3 parity tests build HF models")

from .hf_fixtures import make_tiny_llama  # noqa: E402  (needs torch/transformers)
from .test_qwen import TEXTS, llama_cpp_agrees  # noqa: E402

CASES = {"gqa-untied": dict(n_kv_heads=2, tie=False),
         "mha-tied": dict(n_kv_heads=4, tie=True, seed=1)}
# max |ours - theirs| / max |theirs| over the logits; measured 4.5e-7 against transformers (F32 cache); rope on
# the no-rope layer fails it (checked)
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(case)``: (path of the converted F32 file, HF model, HF tokenizer), made once;
    ``converted.hf_dirs[case]``: the checkpoint's folder."""
    make = functools.partial(make_tiny_llama, arch="smollm3", n_layers=4)
    return converted_cases(tmp_path_factory.mktemp("smollm3"), make, CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_in_one_batch_and_token_by_token(case, converted):
    path, model, tokenizer = converted(case)
    assert model.config.no_rope_layers == [1, 1, 1, 0]
    tokens = tokenizer.encode(TEXTS[0])
    assert len(tokens) > 8
    logits_match_in_batches(path, model, tokens, TOLERANCE, batch_sizes=(512, 1), text=TEXTS[0])


def test_several_sequences_at_once_match_transformers(converted):
    path, model, tokenizer = converted("gqa-untied")
    sequences_match_transformers(path, model, [tokenizer.encode(t) for t in TEXTS], TOLERANCE)


@needs_llama_cpp
@pytest.mark.parametrize("case", list(CASES))
def test_llama_cpp_gives_the_same_logits_and_greedy_tokens(case, converted):
    llama_cpp_agrees(converted(case)[0])


@pytest.mark.parametrize("case", list(CASES))
def test_files_have_llama_cpps_names_and_keys(case, converted):
    path, model, _ = converted(case)
    meta, tensors = read_gguf(path)
    assert meta["general.architecture"] == "smollm3"
    per_block = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
    output = set() if CASES[case]["tie"] else {"output.weight"}  # tied: llama.cpp uses token_embd
    assert set(tensors) == {"token_embd.weight", "output_norm.weight"} | output | {
        f"blk.{i}.{n}.weight" for i in range(4) for n in per_block}
    assert meta["smollm3.rope.dimension_count"] == 16 and meta["smollm3.block_count"] == 4
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    # ggml's normal rope on smollm3 files: q rows interleaved as for llama
    q = from_interleaved_rope(tensors["blk.0.attn_q.weight"][1], 4)
    assert (q == sd["model.layers.0.self_attn.q_proj.weight"]).all()


@pytest.mark.parametrize("change, message", [
    (dict(no_rope_layers=[1, 0, 1, 1]), "no_rope_layers"),
    (dict(use_sliding_window=True, sliding_window=4), "use_sliding_window"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}), "rope scaling type"),
])
def test_configs_gguf_smollm3_cannot_express_are_refused(change, message, converted, tmp_path):
    converted("gqa-untied")
    refuses_config(converted.hf_dirs["gqa-untied"], tmp_path, change, message)


def test_a_context_shift_rotates_the_rope_layers_keys_only(tmp_path):
    """Cached keys of the no-rope layer carry no position: a shift must leave them as they are."""
    keys, out = shifted_keys(tmp_path, "smollm3")
    assert np.array_equal(out[3], keys)  # layer 3: no rope
    for layer in range(3):
        assert np.abs(out[layer] - keys).max() > 0.1, layer  # rotated back by 5 positions
        np.testing.assert_allclose(np.linalg.norm(out[layer], axis=-1), np.linalg.norm(keys, axis=-1), rtol=1e-5)
