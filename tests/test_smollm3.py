"""SmolLM3 (GGUF ``smollm3``): tiny random Hugging Face models with a no-rope layer (layer 3 of 4) converted
with ``pyggml.convert``, run by pyggml against transformers (F32 logits in one batch and token by token,
several sequences at once) and against llama.cpp on the same files; names, keys and refused configs."""

from __future__ import annotations

import json
import shutil

import pytest

import pyggml
from pyggml import BackendParams, models
from pyggml.convert import convert_hf, from_interleaved_rope

from ._models import logits_from_threads
from .test_convert import needs_llama_cpp, read_gguf

torch = pytest.importorskip("torch", reason="the SmolLM3 parity tests build HF models with torch")
transformers = pytest.importorskip("transformers", reason="the SmolLM3 parity tests build HF models")

from .hf_fixtures import make_tiny_llama  # noqa: E402  (needs torch/transformers)
from .test_qwen import TEXTS, error, llama_cpp_agrees, reference  # noqa: E402

CASES = {"gqa-untied": dict(n_kv_heads=2, tie=False),
         "mha-tied": dict(n_kv_heads=4, tie=True, seed=1)}
# max |ours - theirs| / max |theirs| over the logits; measured 4.5e-7 against transformers (F32 cache); rope on
# the no-rope layer fails it (checked)
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(case)``: (path of the converted F32 file, HF model, HF tokenizer), made once;
    ``converted.hf_dirs[case]``: the checkpoint's folder."""
    root, done = tmp_path_factory.mktemp("smollm3"), {}

    def get(case: str):
        if case not in done:
            hf_dir, model = make_tiny_llama(root / case, arch="smollm3", n_layers=4, **CASES[case])
            path = convert_hf(hf_dir, root / f"{case}.gguf", "f32")
            done[case] = path, model, transformers.AutoTokenizer.from_pretrained(hf_dir)
            get.hf_dirs[case] = hf_dir
        return done[case]

    get.hf_dirs = {}
    return get


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_in_one_batch_and_token_by_token(case, converted):
    path, model, tokenizer = converted(case)
    assert model.config.no_rope_layers == [1, 1, 1, 0]
    tokens = tokenizer.encode(TEXTS[0])
    assert len(tokens) > 8
    expected = reference(model, tokens)
    for batch_size in (512, 1):
        with pyggml.load(path, n_threads=2, num_ctx=64, batch_size=batch_size, cache_type="f32") as llm:
            assert llm.tokenize(TEXTS[0]) == tokens
            assert error(llm.logits(tokens), expected) < TOLERANCE, batch_size


def test_several_sequences_at_once_match_transformers(converted):
    path, model, tokenizer = converted("gqa-untied")
    prompts = [tokenizer.encode(t) for t in TEXTS]
    results = logits_from_threads(path, prompts)
    for tokens, ours in zip(prompts, results, strict=True):
        assert error(ours, reference(model, tokens)) < TOLERANCE


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
    bad = tmp_path / "bad"
    shutil.copytree(converted.hf_dirs["gqa-untied"], bad)
    config = json.loads((bad / "config.json").read_text()) | change
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        convert_hf(bad, tmp_path / "m.gguf", "f32")
    assert not (tmp_path / "m.gguf").exists()


def test_a_context_shift_rotates_the_rope_layers_keys_only(tmp_path):
    """Cached keys of the no-rope layer carry no position: a shift must leave them as they are."""
    import numpy as np

    from pyggml import nn
    from pyggml.synthetic import write_model

    from .test_architectures import TINY

    model = models.load(write_model(tmp_path / "m.gguf", "smollm3", TINY["smollm3"], "f32", seed=3),
                        BackendParams(n_threads=2))
    try:
        keys = np.random.default_rng(0).standard_normal((3, 2, 16)).astype(np.float32)  # (tokens, kv heads, dim)
        with model.backend.new_context() as ctx:
            key, delta = ctx.from_numpy(keys), nn.int32_input(ctx, [-5, -5, -5])
            shifted = [model.shift(ctx, layer, key, delta) for layer in range(4)]
            ctx.compute(*shifted)
            out = [s.numpy() for s in shifted]
    finally:
        model.close()
    assert np.array_equal(out[3], keys)  # layer 3: no rope
    for layer in range(3):
        assert np.abs(out[layer] - keys).max() > 0.1, layer  # rotated back by 5 positions
        np.testing.assert_allclose(np.linalg.norm(out[layer], axis=-1), np.linalg.norm(keys, axis=-1), rtol=1e-5)
