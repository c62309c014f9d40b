"""OLMo 2 and OLMo 3 (GGUF ``olmo2``): tiny random Hugging Face models converted with ``pyggml.convert``, run
by pyggml against transformers (F32 logits in one batch, in batches that cut the window, token by token, several
sequences at once; OLMo 3 prompts run well past its sliding window) and against llama.cpp on the same files;
the converter's names and keys, and the configs GGUF olmo2 cannot express."""

from __future__ import annotations

import math

import pytest

from ._models import (
    converted_cases,
    logits_match_in_batches,
    refuses_config,
    sequences_match_transformers,
)
from .test_convert import needs_llama_cpp, read_gguf

torch = pytest.importorskip("torch", reason="the OLMo parity tests build HF models with torch")
transformers = pytest.importorskip("transformers", reason="the OLMo parity tests build HF models")

from .hf_fixtures import make_tiny_olmo  # noqa: E402  (needs torch/transformers)
from .test_qwen import TEXTS, llama_cpp_agrees  # noqa: E402

WINDOW = 4
CASES = {"olmo2-gqa": dict(arch="olmo2", n_layers=2),
         "olmo3-window-gqa": dict(arch="olmo3", sliding_window=WINDOW),  # sliding, sliding, sliding, global
         "olmo3-own-pattern-mha-tied": dict(arch="olmo3", sliding_window=WINDOW, n_kv_heads=4, tie=True, seed=1,
                                            layer_types=["full_attention", "sliding_attention", "full_attention",
                                                         "sliding_attention"]),
         # YaRN on the global layers, with an attention factor other than Hugging Face's default 1 + 0.1 ln(4)
         "olmo3-yarn": dict(arch="olmo3", sliding_window=WINDOW, seed=2,
                            yarn={"factor": 4.0, "original_max_position_embeddings": 16, "attention_factor": 1.3})}
# max |ours - theirs| / max |theirs| over the logits; measured 7.5e-7 .. 8.8e-7 against transformers (F32 cache);
# YaRN's attention factor applied twice (ggml's rope applies 1 + 0.1 ln(factor) itself) gives 6e-2
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(case)``: (path of the converted F32 file, HF model, HF tokenizer), made once;
    ``converted.hf_dirs[case]``: the checkpoint's folder."""
    return converted_cases(tmp_path_factory.mktemp("olmo"), make_tiny_olmo, CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_in_one_batch_and_token_by_token(case, converted):
    path, model, tokenizer = converted(case)
    tokens = tokenizer.encode(TEXTS[0] + " " + TEXTS[1])
    assert len(tokens) > 4 * WINDOW  # well past the window
    # the whole prompt; batches that cut the window; token by token
    logits_match_in_batches(path, model, tokens, TOLERANCE, batch_sizes=(512, 3, 1))


@pytest.mark.parametrize("case", ["olmo3-window-gqa", "olmo3-own-pattern-mha-tied"])
def test_several_sequences_at_once_match_transformers(case, converted):
    path, model, tokenizer = converted(case)
    sequences_match_transformers(path, model, [tokenizer.encode(t) for t in TEXTS], TOLERANCE)


@needs_llama_cpp
@pytest.mark.parametrize("case", list(CASES))
def test_llama_cpp_gives_the_same_logits_and_greedy_tokens(case, converted):
    llama_cpp_agrees(converted(case)[0])


@pytest.mark.parametrize("case", list(CASES))
def test_files_have_llama_cpps_names_and_keys(case, converted):
    path, model, _ = converted(case)
    meta, tensors = read_gguf(path)
    cfg = model.config
    assert meta["general.architecture"] == "olmo2"
    per_block = ["attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "post_attention_norm",
                 "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm"]
    assert set(tensors) == {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(cfg.num_hidden_layers) for n in per_block}  # tied: output written
    assert tensors["blk.0.attn_k_norm.weight"][1].shape == (cfg.num_key_value_heads * 16,)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    # NeoX rope: the q rows stay in Hugging Face's order
    assert (tensors["blk.0.attn_q.weight"][1] == sd["model.layers.0.self_attn.q_proj.weight"]).all()
    assert (tensors["output.weight"][1] == sd["lm_head.weight"]).all()
    if cfg.model_type == "olmo3":
        assert meta["olmo2.attention.sliding_window"] == WINDOW
        assert meta["olmo2.attention.sliding_window_pattern"] == [t == "sliding_attention" for t in cfg.layer_types]
        assert meta["olmo2.rope.freq_base"] == 500000.0
        if case == "olmo3-yarn":  # llama.cpp's key, as a multiple of what ggml's rope applies by itself
            assert meta["olmo2.rope.scaling.attn_factor"] == pytest.approx(1.3 / (1 + 0.1 * math.log(4.0)))
            assert meta["olmo2.rope.scaling.type"] == "yarn" and meta["olmo2.rope.scaling.factor"] == 4.0
            assert meta["olmo2.rope.scaling.original_context_length"] == 16
    else:
        assert "olmo2.attention.sliding_window" not in meta


@pytest.mark.parametrize("change, message", [
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), "own rope parameters"),
    (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0},
                           "sliding_attention": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0}}),
     "own rope parameters"),
    (dict(rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 5e5, "factor": 8.0},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 5e5}}), "rope scaling type"),
    (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0,
                                              "truncate": False},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 5e5}}), "truncate"),
    (dict(head_dim=32), "head_dim=32"),
    (dict(layer_types=["sliding_attention"] * 3), "layer_types"),
])
def test_configs_gguf_olmo2_cannot_express_are_refused(change, message, converted, tmp_path):
    converted("olmo3-window-gqa")
    refuses_config(converted.hf_dirs["olmo3-window-gqa"], tmp_path, change, message)
