"""Nemotron-H (GGUF ``nemotron_h``, dense): converted tiny random checkpoints against transformers
(whose Mamba-2 runs its reference PyTorch scan here) and llama.cpp, several sequences in one batch,
the runner resuming a recurrent state, and malformed files. The Mamba-2 mixer itself is
``models/mamba2.py``, shared with granitehybrid (tests/test_granitehybrid.py tests its scan op)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pyggml import models
from pyggml.convert import convert_hf
from pyggml.models import ModelError
from pyggml.synthetic import write_model

from ._models import converted_cases, logits_match_in_batches, sequences_match_transformers
from .test_architectures import TINY
from .test_convert import needs_llama_cpp

torch = pytest.importorskip("torch", reason="the Nemotron-H parity tests build HF models with torch")
transformers = pytest.importorskip("transformers", reason="the Nemotron-H parity tests build HF models")

from .hf_fixtures import make_tiny_nemotron_h  # noqa: E402  (needs torch/transformers)
from .test_granitehybrid import (  # noqa: E402  (the Mamba-2 hybrids' shared checks)
    extended_prompt_resumes_and_equals_a_fresh_run,
    interleaved_rows_equal_each_alone,
    q8_0_file_keeps_the_mamba_tensors_f32_and_agrees,
)
from .test_qwen import TEXTS, llama_cpp_agrees  # noqa: E402

CASES = {"mamba-mlp-attention": dict(),  # M - * - M -
         # attention first and last, two Mamba-2 blocks in a row; layers named by hybrid_override_pattern
         "pattern-attention-first": dict(pattern="*M-MM-*", pattern_key=True, seed=1)}
LONG = " ".join(TEXTS)  # longer than the 4-tap convolution and several of transformers' 8-token scan chunks
# max |ours - theirs| / max |theirs| over the logits; measured 1.1e-6 .. 1.2e-6 against transformers (F32 cache)
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(case, out_type)``: (path of the converted file, HF model, HF tokenizer), made once."""
    return converted_cases(tmp_path_factory.mktemp("nemotron_h"), make_tiny_nemotron_h, CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_in_one_batch_and_token_by_token(case, converted):
    path, model, tokenizer = converted(case)
    tokens = tokenizer.encode(LONG)
    assert len(tokens) > 3 * 8
    # the whole prompt; batches that cut windows and chunks; token by token
    logits_match_in_batches(path, model, tokens, TOLERANCE, batch_sizes=(512, 5, 1), num_ctx=96, text=LONG)


def test_several_sequences_at_once_match_transformers(converted):
    path, model, tokenizer = converted("mamba-mlp-attention")
    sequences_match_transformers(path, model, [tokenizer.encode(t) for t in TEXTS], TOLERANCE)


def test_two_sequences_of_unequal_lengths_in_one_batch_equal_each_alone(tmp_path):
    interleaved_rows_equal_each_alone(tmp_path, "nemotron_h", [
        (0, 0), (1, 0), (1, 1), (0, 1), (0, 2), (1, 2), (0, 3), (0, 4), (0, 5), (1, 3), (1, 4), (0, 6), (0, 7), (0, 8),
        (1, 5), (0, 9), (0, 10)])


def test_a_prompt_that_extends_an_earlier_one_resumes_the_state_and_equals_a_fresh_run(tmp_path):
    extended_prompt_resumes_and_equals_a_fresh_run(tmp_path, "nemotron_h")


@needs_llama_cpp
@pytest.mark.parametrize("case", list(CASES))
def test_llama_cpp_gives_the_same_logits_and_greedy_tokens(case, converted):
    llama_cpp_agrees(converted(case)[0])


@needs_llama_cpp
def test_a_q8_0_file_keeps_the_mamba_tensors_f32_and_agrees_with_llama_cpp(converted):
    path, model, tokenizer = converted("mamba-mlp-attention", "q8_0")
    q8_0_file_keeps_the_mamba_tensors_f32_and_agrees(path, model, tokenizer.encode(LONG))


def test_compare_taps_every_layer_kind(converted):
    from pyggml import porting

    path, _, tokenizer = converted("mamba-mlp-attention")
    result = porting.compare(tokenizer.name_or_path, path)
    names = [layer.name for layer in result.layers]
    assert {"token_embd", "blk.0.ssm_in", "blk.0.ssm_out", "blk.1.ffn_down", "blk.2.attn_output", "blk.5",
            "output_norm", "output"} <= set(names)
    assert result.ok and not result.unmatched


# ---- malformed files -----------------------------------------------------------------------------------
def test_a_missing_tensor_of_each_kind_is_named(tmp_path):
    for i, name in enumerate(("blk.4.ssm_conv1d.weight", "blk.1.ffn_up.weight", "blk.2.attn_k.weight")):
        path = write_model(tmp_path / f"bad{i}.gguf", "nemotron_h", TINY["nemotron_h"], "f32", omit={name})
        with pytest.raises(ModelError, match=name.replace(".", r"\.")):
            models.load(path)


def test_a_state_size_that_does_not_match_the_tensors_is_named(tmp_path):
    # ssm.state_size says 16, the in_proj was made for 8: 2*64 + 2*2*8 + 4 rows
    path = write_model(tmp_path / "bad.gguf", "nemotron_h", TINY["nemotron_h"], "f32",
                       shapes={"blk.0.ssm_in.weight": (64, 164)})
    with pytest.raises(ModelError, match=r"blk\.0\.ssm_in\.weight has shape \(64, 164\).*ssm_in_size"):
        models.load(path)


@pytest.mark.parametrize("hparams, words", [
    ({"feed_forward_length": [0, 96, 96, 96, 0]}, "not both"),  # layer 2: attention and MLP, an unknown kind
    ({"attention.head_count_kv": [0, 0, 3, 0, 0]}, "head_count_kv"),
    ({"feed_forward_length": [0, 96]}, "feed_forward_length"),
    ({"expert_count": 8}, "expert_count"),
    ({"ssm.group_count": 3}, "ssm.group_count"),
])
def test_unsupported_or_inconsistent_keys_are_named(hparams, words):
    from pyggml.backend.metadata import Config
    from pyggml.models.nemotron_h import Options
    from pyggml.synthetic import metadata

    with pytest.raises(ModelError, match=words):
        Options.from_config(Config(metadata("nemotron_h", {**TINY["nemotron_h"], **hparams})))


@pytest.mark.parametrize("config, words", [
    ({"layers_block_type": ["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "mlp"]},
     "moe"),
    ({"mlp_hidden_act": "gelu"}, "mlp_hidden_act"),
    ({"use_conv_bias": False}, "use_conv_bias")])
def test_the_converter_refuses_what_the_file_cannot_express(config, words, tmp_path, converted):
    source = Path(converted("mamba-mlp-attention")[2].name_or_path)
    hf_dir = tmp_path / "bad-config"
    hf_dir.mkdir()
    for f in source.iterdir():
        (hf_dir / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((source / "config.json").read_text()) | config
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=words):
        convert_hf(hf_dir, tmp_path / "out.gguf", "f32")
