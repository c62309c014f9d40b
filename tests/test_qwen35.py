"""Qwen 3.5 / 3.6 (GGUF ``qwen35``, ``qwen35moe``) and Qwen3-Next (``qwen3next``): the gated delta
rule op against numpy, converted tiny random checkpoints against transformers and llama.cpp (prompts
longer than the convolution's taps and the reference's 64-token chunks, in one batch and token by
token, several sequences in one batch), the per-layer compare, a file with a multi-token-prediction
block, and malformed files."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import pyggml
from pyggml import models
from pyggml.backend import Backend
from pyggml.convert import convert_hf
from pyggml.models import ModelError
from pyggml.synthetic import write_model

from ._models import converted_cases, error, logits_match_in_batches, sequences_match_transformers
from .test_architectures import TINY
from .test_convert import needs_llama_cpp


# ---- the op ----------------------------------------------------------------------------------------------
def delta_rule(q, k, v, g, beta, state):
    """The gated delta rule in numpy, one step at a time (numpy order: q, k (N, T, H_k, S); v (N, T, H_v, S);
    g, beta (N, T, H_v, 1); state (N, H_v, S, S) holding S transposed, as ggml stores it)."""
    n_seqs, steps, h_v, s = v.shape
    out, state = np.zeros_like(v), state.copy()
    for n in range(n_seqs):
        for h in range(h_v):
            m = state[n, h]  # m[j, i] = S[i, j]
            for t in range(steps):
                key, query = k[n, t, h % k.shape[2]], q[n, t, h % q.shape[2]]
                m *= np.exp(g[n, t, h, 0])
                m += np.outer((v[n, t, h] - m @ key) * beta[n, t, h, 0], key)
                out[n, t, h] = m @ query / np.sqrt(s)
    return out, state


def test_gated_delta_net_matches_numpy():
    rng = np.random.default_rng(0)
    s, h_k, h_v, steps, n = 8, 2, 4, 5, 3
    q = rng.standard_normal((n, steps, h_k, s)).astype(np.float32)
    k = rng.standard_normal((n, steps, h_k, s)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((n, steps, h_v, s)).astype(np.float32)
    g = -rng.random((n, steps, h_v, 1)).astype(np.float32)
    beta = rng.random((n, steps, h_v, 1)).astype(np.float32)
    state = rng.standard_normal((n, h_v, s, s)).astype(np.float32)
    with Backend.cpu(2) as backend, backend.new_context() as ctx:
        out, new = ctx.from_numpy(q).gated_delta_net(*(ctx.from_numpy(a) for a in (k, v, g, beta, state)))
        ctx.compute(out, new)
        expected_out, expected_state = delta_rule(q, k, v, g, beta, state)
        np.testing.assert_allclose(out.numpy(), expected_out, atol=1e-5)
        np.testing.assert_allclose(new.numpy(), expected_state, atol=1e-5)
        with pytest.raises(ValueError, match="gated_delta_net"):  # 3 value heads for 2 key heads
            ctx.from_numpy(q).gated_delta_net(*(ctx.from_numpy(a[:, :, :3] if a.ndim == 4 and i else a)
                                                for i, a in enumerate((k, v, g, beta, state))))


# ---- against transformers ----------------------------------------------------------------------------------
torch = pytest.importorskip("torch", reason="the Qwen 3.5 parity tests build HF models with torch")
transformers = pytest.importorskip("transformers", reason="the Qwen 3.5 parity tests build HF models")

from .hf_fixtures import make_tiny_qwen35  # noqa: E402  (needs torch/transformers)
from .test_qwen import TEXTS, llama_cpp_agrees  # noqa: E402

CASES = {"tiled-value-heads": dict(),  # delta net, attention, delta net, delta net; 2 key heads, 4 value heads
         "attention-first-untied": dict(layer_types=("full_attention", "linear_attention", "linear_attention",
                                                     "full_attention"), n_k_heads=2, n_v_heads=2, tie=False, seed=1),
         "moe": dict(arch="qwen35moe", seed=2),  # qwen35moe: 8 experts (2 chosen) and a shared expert per layer
         "next": dict(arch="qwen3next", seed=3),  # qwen3next: grouped value heads, fused projections
         "next-untied": dict(arch="qwen3next", layer_types=("full_attention", "linear_attention", "linear_attention",
                                                           "full_attention"), n_v_heads=2, tie=False, seed=4)}
LONG = " ".join(TEXTS * 2)  # about 100 tokens: past the reference's 64-token chunks
# max |ours - theirs| / max |theirs| over the logits; measured 3.2e-6 .. 2.6e-5 against transformers (F32 cache)
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(case)``: (path of the converted F32 file, HF model, HF tokenizer), made once."""
    return converted_cases(tmp_path_factory.mktemp("qwen35"), make_tiny_qwen35, CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_in_one_batch_and_token_by_token(case, converted):
    path, model, tokenizer = converted(case)
    tokens = tokenizer.encode(LONG)
    assert len(tokens) > 64
    # the whole prompt; batches that cut the convolution's window; token by token
    logits_match_in_batches(path, model, tokens, TOLERANCE, batch_sizes=(512, 5, 1), num_ctx=128)


@pytest.mark.parametrize("case", list(CASES))
def test_several_sequences_in_one_batch_match_each_alone(case, converted):
    """Three prompts of different lengths scored at once (batches holding several sequences, some
    shorter than others: the scan's padding steps must not touch their states) equal transformers."""
    path, model, tokenizer = converted(case)
    prompts = [tokenizer.encode(t) for t in (LONG, TEXTS[1], TEXTS[2])]
    sequences_match_transformers(path, model, prompts, TOLERANCE, num_ctx=128, batch_size=16, timeout=300)


@needs_llama_cpp
@pytest.mark.parametrize("case", list(CASES))
def test_llama_cpp_gives_the_same_logits_and_greedy_tokens(case, converted):
    llama_cpp_agrees(converted(case)[0])


@pytest.mark.parametrize("case", ["tiled-value-heads", "moe", "next"])
def test_compare_taps_every_layer_kind(case, converted):
    from pyggml import porting

    path, _, tokenizer = converted(case)
    result = porting.compare(tokenizer.name_or_path, path)
    names = {layer.name for layer in result.layers}
    assert {"blk.0.ssm_out", "blk.1.attn_output", "blk.0", "blk.1", "blk.3", "output_norm", "output"} <= names
    assert result.ok and not result.unmatched


# ---- files ---------------------------------------------------------------------------------------------------
def tiny(tmp_path, hparams=None, **kwargs):
    return write_model(tmp_path / "bad.gguf", "qwen35", {**TINY["qwen35"], **(hparams or {})}, "f32", **kwargs)


def test_a_file_with_a_multi_token_prediction_block_loads_and_computes_the_same(tmp_path):
    """One more block (``nextn_predict_layers``: attention, MLP and ``nextn.*`` weights) is loaded and
    checked, and leaves the logits alone; llama.cpp runs the file to the same logits."""
    plain, extra = tiny(tmp_path, seed=3), np.random.default_rng(4)

    def mtp_values(name, shape, rng):  # the MTP block's own values: the other tensors get the plain file's
        return 0.1 * extra.standard_normal(shape) if name.startswith("blk.4.") else None

    mtp = write_model(tmp_path / "mtp.gguf", "qwen35", {**TINY["qwen35"], "block_count": 5,
                                                        "nextn_predict_layers": 1}, "f32", seed=3, init=mtp_values)
    with pyggml.load(mtp, n_threads=2, num_ctx=64, cache_type="f32") as llm:
        names = set(llm.model.backend.tensors())
        assert {"blk.4.nextn.eh_proj.weight", "blk.4.attn_q.weight", "blk.4.ffn_up.weight"} <= names
        assert llm.model.weights.blk[4].nextn.eh_proj is not None
        ours = llm.logits([1, 17, 42, 99, 5, 23, 64])
    with pyggml.load(plain, n_threads=2, num_ctx=64, cache_type="f32") as llm:
        np.testing.assert_array_equal(ours, llm.logits([1, 17, 42, 99, 5, 23, 64]))
    if importlib.util.find_spec("llama_cpp") is not None:
        from pyggml.porting import llama_cpp_logits

        assert error(ours, llama_cpp_logits(mtp, [1, 17, 42, 99, 5, 23, 64], n_threads=2)) < TOLERANCE
    with pytest.raises(ModelError, match=r"blk\.4\.nextn\.hnorm\.weight"):
        models.load(write_model(tmp_path / "bad-mtp.gguf", "qwen35", {**TINY["qwen35"], "block_count": 5,
                                                                      "nextn_predict_layers": 1}, "f32",
                                omit={"blk.4.nextn.hnorm.weight"}))


def test_a_missing_convolution_weight_is_named(tmp_path):
    with pytest.raises(ModelError, match=r"blk\.2\.ssm_conv1d\.weight"):
        models.load(tiny(tmp_path, omit={"blk.2.ssm_conv1d.weight"}))


def test_a_state_size_that_does_not_match_the_tensors_is_named(tmp_path):
    bad = write_model(tmp_path / "bad-state.gguf", "qwen35", TINY["qwen35"], "f32",
                      shapes={"blk.0.ssm_conv1d.weight": (4, 96), "blk.2.ssm_conv1d.weight": (4, 96)})
    with pytest.raises(ModelError, match=r"blk\.0\.ssm_conv1d\.weight has shape \(4, 96\).*conv_dim"):
        models.load(bad)
    bad = write_model(tmp_path / "bad-norm.gguf", "qwen35", TINY["qwen35"], "f32",
                      shapes={"blk.0.ssm_norm.weight": (8,), "blk.2.ssm_norm.weight": (8,)})
    with pytest.raises(ModelError, match=r"blk\.0\.ssm_norm\.weight has shape \(8,\).*state_size"):
        models.load(bad)


@pytest.mark.parametrize("hparams, words", [
    ({"ssm.inner_size": 48}, "ssm.inner_size"),  # not time_step_rank heads of state_size
    ({"ssm.group_count": 3}, "ssm.group_count"),  # 4 value heads are not a multiple of 3 key heads
    ({"ssm.conv_kernel": 0}, "ssm.conv_kernel"),
    ({"attention.recurrent_layers": [True, False, True]}, "recurrent_layers"),  # 3 kinds for 4 layers
    ({"nextn_predict_layers": 1, "attention.recurrent_layers": [True, False, True, True]}, "recurrent_layers"),
])
def test_inconsistent_keys_are_named(hparams, words):
    from pyggml.backend.metadata import Config
    from pyggml.models.qwen35 import Options
    from pyggml.synthetic import metadata

    with pytest.raises(ModelError, match=words):
        Options.from_config(Config(metadata("qwen35", {**TINY["qwen35"], **hparams})))


def test_qwen35moe_bad_files_are_named(tmp_path):
    from pyggml.backend.metadata import Config
    from pyggml.models.qwen35moe import Options
    from pyggml.synthetic import metadata

    path = write_model(tmp_path / "moe.gguf", "qwen35moe", TINY["qwen35moe"], "f32",
                       omit={"blk.1.ffn_gate_inp_shexp.weight"})
    with pytest.raises(ModelError, match=r"blk\.1\.ffn_gate_inp_shexp\.weight"):
        models.load(path)
    for key, value in (("expert_gating_func", 2), ("expert_used_count", 9), ("expert_weights_scale", 2.5),
                       ("expert_shared_feed_forward_length", 0)):
        with pytest.raises(ModelError, match=key):
            Options.from_config(Config(metadata("qwen35moe", {**TINY["qwen35moe"], key: value})))


def test_a_released_style_checkpoint_converts_with_its_mtp_block(converted, tmp_path):
    """The layout of the released checkpoints: ``Qwen3_5ForConditionalGeneration`` with the text model's
    config under ``text_config``, its tensors under ``model.language_model.``, a vision tower (not
    written) and an MTP block (``mtp.*``, written as ``blk.4`` with ``nextn.*``). The file's logits are
    the text-only conversion's, in pyggml and in llama.cpp."""
    import json
    from pathlib import Path

    from safetensors.numpy import load_file, save_file

    path, _, tokenizer = converted("tiled-value-heads")
    source = Path(tokenizer.name_or_path)
    hf_dir = tmp_path / "released"
    hf_dir.mkdir()
    for f in source.iterdir():
        if not f.name.endswith((".safetensors", "config.json")) or f.name.startswith("tokenizer"):
            (hf_dir / f.name).write_bytes(f.read_bytes())
    text = json.loads((source / "config.json").read_text())
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "tie_word_embeddings": text["tie_word_embeddings"], "text_config": {**text, "mtp_num_hidden_layers": 1}}
    (hf_dir / "config.json").write_text(json.dumps(config))
    weights = {k.replace("model.", "model.language_model.", 1): v
               for k, v in load_file(source / "model.safetensors").items()}
    rng, layer = np.random.default_rng(5), "model.language_model.layers.1."  # an attention layer's shapes
    weights |= {"mtp.layers.0." + k[len(layer):]: (0.1 * rng.standard_normal(v.shape)).astype(np.float32)
                for k, v in weights.items() if k.startswith(layer)}
    weights |= {"mtp.fc.weight": (0.1 * rng.standard_normal((64, 128))).astype(np.float32),
                "model.visual.patch_embed.proj.weight": np.zeros((8, 3), np.float32)}
    weights |= {f"mtp.{k}.weight": np.zeros(64, np.float32)
                for k in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    save_file(weights, hf_dir / "model.safetensors")
    out = convert_hf(hf_dir, tmp_path / "released.gguf", "f32")
    tokens = tokenizer.encode(TEXTS[0])
    with pyggml.load(out, n_threads=2, num_ctx=64, cache_type="f32") as llm:
        config = llm.model.backend.config
        assert config.uint("block_count") == 5 and config.uint("nextn_predict_layers") == 1
        assert llm.model.weights.blk[4].nextn.enorm.weight.numpy().tolist() == [1.0] * 64  # 1 + weight
        ours = llm.logits(tokens)
    with pyggml.load(path, n_threads=2, num_ctx=64, cache_type="f32") as llm:
        np.testing.assert_array_equal(ours, llm.logits(tokens))
    if importlib.util.find_spec("llama_cpp") is not None:
        from pyggml.porting import llama_cpp_logits

        assert error(ours, llama_cpp_logits(out, tokens, n_threads=2)) < TOLERANCE


def test_qwen3next_bad_files_are_named(tmp_path):
    path = write_model(tmp_path / "next.gguf", "qwen3next", TINY["qwen3next"], "f32", omit={"blk.2.ssm_ba.weight"})
    with pytest.raises(ModelError, match=r"blk\.2\.ssm_ba\.weight"):
        models.load(path)
    path = write_model(tmp_path / "next-ba.gguf", "qwen3next", TINY["qwen3next"], "f32",
                       shapes={"blk.0.ssm_ba.weight": (64, 4), "blk.2.ssm_ba.weight": (64, 4)})
    with pytest.raises(ModelError, match=r"blk\.0\.ssm_ba\.weight has shape \(64, 4\).*n_v_heads"):
        models.load(path)


# ---- the runner on a Gated DeltaNet model -------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("qwen35-tiny") / "qwen35.gguf", "qwen35", TINY["qwen35"], "f32",
                       seed=3)


PROMPT = [1, 17, 42, 99, 5, 23, 64, 7, 150, 33]


def test_runner_reuses_delta_rule_checkpoints_and_rolls_drafts_back(tiny_path):
    """The runner's recurrent-state machinery on delta-rule states (state_size squared per value head):
    generation equals greedy decoding from fresh logits; a prompt sharing the first one's prompt but not
    its generated tokens resumes from the checkpoint where that prompt ended; prompt-lookup drafts are
    accepted and rejected, and the output is plain greedy decoding's."""
    from .test_lfm2 import complete, greedy_from_logits, no_end_tokens, run_logprobs, same_logprobs

    with pyggml.load(tiny_path, n_threads=2, num_ctx=64, batch_size=4, cache_type="f32") as llm:
        bias = no_end_tokens(llm)
        first, _ = complete(llm, PROMPT, 8, bias)
        other = PROMPT + ([11, 12, 13] if first[0] != 11 else [12, 13, 14])
        got, last = run_logprobs(llm.runner, other, 6, bias)
        assert first == greedy_from_logits(llm, PROMPT, 8, bias)  # (scoring replaces the slot's history)
    with pyggml.load(tiny_path, n_threads=2, num_ctx=64, batch_size=4, cache_type="f32") as fresh:
        expected, fresh_last = run_logprobs(fresh.runner, other, 6, bias)
    assert last.cached_tokens == len(PROMPT) and fresh_last.cached_tokens == 0
    same_logprobs(got, expected)

    prompt = [1, 2, 3, 4, 2, 3, 4, 2, 3]  # (with this file: 8 drafts, 1 accepted)
    with pyggml.load(tiny_path, n_threads=2, num_ctx=64, cache_type="f32") as llm:
        plain, _ = run_logprobs(llm.runner, prompt, 24, bias, cache_prompt=False)
        drafted, last = run_logprobs(llm.runner, prompt, 24, bias, cache_prompt=False, prompt_lookup=3)
    same_logprobs(drafted, plain)
    assert 0 < last.accepted_tokens < last.draft_tokens


def test_the_qwen35_pre_tokenizer_splits_as_its_tokenizer_json_does(tmp_path):
    """Qwen 3.5's split pattern keeps combining marks in words (qwen2's cuts a decomposed accent or a
    Devanagari vowel sign off, and glues it to the punctuation after it); the converter names it."""
    from tokenizers import Regex, pre_tokenizers

    from pyggml.convert.vocab import PRE_TOKENIZERS, QWEN35_PATTERN
    from pyggml.tokenizer.pretokenize import patterns_for, split_words

    text = "Naïve cafe\u0301 नमस्ते, it's 2026!\n\n  done"
    theirs = [piece for piece, _ in pre_tokenizers.Split(Regex(QWEN35_PATTERN), "isolated").pre_tokenize_str(text)]
    assert split_words(text, patterns_for("qwen35")) == theirs
    assert " नमस्ते" in theirs and split_words(text, patterns_for("qwen2")) != theirs
    assert PRE_TOKENIZERS[QWEN35_PATTERN] == "qwen35"
