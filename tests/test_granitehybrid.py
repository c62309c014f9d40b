"""Granite 4.0 hybrids (GGUF ``granitehybrid``): converted tiny random checkpoints against transformers
(whose Mamba-2 runs its reference PyTorch scan here: no CUDA kernels) and llama.cpp, several sequences
of unequal lengths in one batch, the runner resuming a recurrent state, and malformed files."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import pyggml
from pyggml import BackendParams, models
from pyggml.convert import convert_hf
from pyggml.models import ModelError
from pyggml.runner import CompletionRequest
from pyggml.synthetic import write_model

from ._models import converted_cases, error, logits_match_in_batches, reference, sequences_match_transformers
from .test_architectures import TINY, forward
from .test_convert import needs_llama_cpp

torch = pytest.importorskip("torch", reason="the Granite parity tests build HF models with torch")
transformers = pytest.importorskip("transformers", reason="the Granite parity tests build HF models")

from .hf_fixtures import make_tiny_granitehybrid  # noqa: E402  (needs torch/transformers)
from .test_qwen import TEXTS, llama_cpp_agrees  # noqa: E402

CASES = {"dense-tied": dict(),  # mamba, attention, mamba, mamba; no rope; the shared MLP is the MLP
         "moe-shared": dict(moe=True, seed=2),  # 4 experts (2 chosen) beside the shared expert
         "rope-attn-first-untied": dict(layer_types=("attention", "mamba", "mamba", "attention"), rope=True, tie=False,
                                        seed=1)}
# longer than the 4-tap convolution and several of transformers' 8-token scan chunks
LONG = " ".join(TEXTS)
# max |ours - theirs| / max |theirs| over the logits; measured 6.7e-7 .. 2.2e-6 against transformers (F32 cache)
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(case, out_type)``: (path of the converted file, HF model, HF tokenizer), made once."""
    return converted_cases(tmp_path_factory.mktemp("granitehybrid"), make_tiny_granitehybrid, CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_in_one_batch_and_token_by_token(case, converted):
    path, model, tokenizer = converted(case)
    tokens = tokenizer.encode(LONG)
    assert len(tokens) > 3 * 8  # several scan chunks, many convolution windows
    # the whole prompt; batches that cut windows and chunks; token by token
    logits_match_in_batches(path, model, tokens, TOLERANCE, batch_sizes=(512, 5, 1), num_ctx=96, text=LONG)


@pytest.mark.parametrize("case", ["dense-tied", "moe-shared"])
def test_several_sequences_at_once_match_transformers(case, converted):
    path, model, tokenizer = converted(case)
    sequences_match_transformers(path, model, [tokenizer.encode(t) for t in TEXTS], TOLERANCE)


def test_two_sequences_of_unequal_lengths_in_one_batch_equal_each_alone(tmp_path):
    interleaved_rows_equal_each_alone(tmp_path, "granitehybrid", [
        (1, 0), (0, 0), (0, 1), (1, 1), (0, 2), (0, 3), (0, 4), (1, 2), (1, 3), (0, 5), (0, 6), (0, 7), (0, 8), (1, 4),
        (1, 5), (0, 9), (0, 10)])


def test_a_prompt_that_extends_an_earlier_one_resumes_the_state_and_equals_a_fresh_run(tmp_path):
    extended_prompt_resumes_and_equals_a_fresh_run(tmp_path, "granitehybrid")


def interleaved_rows_equal_each_alone(tmp_path, arch: str, order: list[tuple[int, int]]) -> None:
    """Rows of two sequences interleaved in one batch as ``order`` says ((sequence, position) per row: the
    scan runs them as a padded (steps, sequences) grid), then a decode step of both in one batch: each row's
    logits are the sequence's alone. Shared with the other Mamba-2 hybrid's tests (nemotron_h)."""
    path = write_model(tmp_path / f"{arch}.gguf", arch, TINY[arch], "f32", seed=5)
    model = models.load(path, BackendParams(n_threads=2))
    try:
        model.cache.init(model.backend, "f32", max_sequences=3, capacity=64, max_batch=32)
        a, b = [1, 5, 9, 33, 70, 2, 8, 100, 200, 7, 11], [3, 4, 5, 6, 7, 8]
        alone_a, alone_b = forward(model, a, sequences=[2] * 11), forward(model, b, sequences=[2] * 6)
        both = forward(model, [(a, b)[s][i] for s, i in order], positions=[i for _, i in order],
                       sequences=[s for s, _ in order])
        rows = [[k for k, (s, _) in enumerate(order) if s == seq] for seq in (0, 1)]
        assert error(both[rows[0]], alone_a) < 1e-5 and error(both[rows[1]], alone_b) < 1e-5
        step = forward(model, [17, 18], positions=[11, 6], sequences=[0, 1])
        assert error(step[:1], forward(model, a + [17], sequences=[2] * 12)[-1:]) < 1e-5
        assert error(step[1:], forward(model, b + [18], sequences=[2] * 7)[-1:]) < 1e-5
    finally:
        model.close()


def extended_prompt_resumes_and_equals_a_fresh_run(tmp_path, arch: str) -> None:
    """A prompt that extends an earlier one (its prompt and reply) resumes the scan state after the
    earlier reply and generates what a fresh model does."""
    path = write_model(tmp_path / f"{arch}.gguf", arch, TINY[arch], "f32", seed=3)
    prompt = [1, 17, 42, 99, 5, 23, 64, 7, 150, 33]

    def complete(llm, tokens: list[int]) -> tuple[list[int], int]:
        bias = {i: -np.inf for i in range(TINY[arch]["vocab_size"]) if llm.tokenizer.is_eog(i)}
        chunks = list(llm.runner.completion(CompletionRequest(tokens, max_tokens=6, temperature=0.0,
                                                              logit_bias=bias)))
        return [t for c in chunks for t in c.tokens], chunks[-1].cached_tokens

    with pyggml.load(path, n_threads=2, num_ctx=64, cache_type="f32") as llm:
        first, _ = complete(llm, prompt)
        longer = prompt + first + [11, 12, 13]
        continued, cached = complete(llm, longer)
    with pyggml.load(path, n_threads=2, num_ctx=64, cache_type="f32") as fresh:
        assert continued == complete(fresh, longer)[0]
    assert cached == len(prompt) + len(first) - 1  # the last sampled token was never evaluated


@needs_llama_cpp
@pytest.mark.parametrize("case", list(CASES))
def test_llama_cpp_gives_the_same_logits_and_greedy_tokens(case, converted):
    llama_cpp_agrees(converted(case)[0])


@needs_llama_cpp
def test_a_q8_0_file_keeps_the_mamba_tensors_f32_and_agrees_with_llama_cpp(converted):
    path, model, tokenizer = converted("moe-shared", "q8_0")
    q8_0_file_keeps_the_mamba_tensors_f32_and_agrees(path, model, tokenizer.encode(LONG))


def q8_0_file_keeps_the_mamba_tensors_f32_and_agrees(path, model, tokens: list[int]) -> None:
    """A converted Q8_0 file quantises layer 0's ssm_in but keeps the scan's small tensors F32, stays within Q8_0's
    rounding of transformers' ``model`` on ``tokens``, and llama.cpp agrees with it. Shared with nemotron_h."""
    with pyggml.load(path, n_threads=2, num_ctx=64) as llm:
        types = {n: t.dtype.name for n, t in llm.model.backend.tensors().items() if n.startswith("blk.0.")}
        # Q8_0 rounding of weights and activations: measured 5%..7% from transformers on these tiny models
        assert error(llm.logits(tokens), reference(model, tokens)) < 0.15
    assert types["blk.0.ssm_in.weight"] == "Q8_0" and all(
        types[f"blk.0.{n}"] == "F32" for n in ("ssm_conv1d.weight", "ssm_a", "ssm_d", "ssm_norm.weight", "ssm_dt.bias"))
    llama_cpp_agrees(path)  # the same kernels: as close as the F32 files


def test_compare_taps_every_layer_kind(converted):
    from pyggml import porting

    path, _, tokenizer = converted("moe-shared")
    result = porting.compare(tokenizer.name_or_path, path)
    names = [layer.name for layer in result.layers]
    assert {"token_embd", "blk.0.ssm_in", "blk.0.ssm_out", "blk.1.attn_output", "blk.3", "output_norm",
            "output"} <= set(names)
    assert result.ok and not result.unmatched


# ---- malformed files -----------------------------------------------------------------------------------
def tiny(tmp_path, **kwargs):
    return write_model(tmp_path / "bad.gguf", "granitehybrid", TINY["granitehybrid"], "f32", **kwargs)


def test_a_missing_convolution_weight_is_named(tmp_path):
    with pytest.raises(ModelError, match=r"blk\.2\.ssm_conv1d\.weight"):
        models.load(tiny(tmp_path, omit={"blk.2.ssm_conv1d.weight"}))


def test_a_state_size_that_does_not_match_the_tensors_is_named(tmp_path):
    # a file whose ssm.state_size says 16 but whose in_proj and kernel were made for 8 (shapes ggml order)
    shapes = {"blk.0.ssm_in.weight": (64, 292), "blk.0.ssm_conv1d.weight": (4, 160)}
    with pytest.raises(ModelError, match=r"blk\.0\.ssm_in\.weight has shape \(64, 292\).*ssm_in_size"):
        models.load(tiny(tmp_path, shapes=shapes))


@pytest.mark.parametrize("hparams, words", [
    ({"attention.head_count_kv": [0, 3, 0]}, "head_count_kv"),  # 3 does not divide 4 heads: no layer kind
    ({"attention.head_count_kv": [0, 2]}, "head_count_kv"),  # a kind for 2 of 3 layers
    ({"ssm.conv_kernel": 1}, "ssm.conv_kernel"),
    ({"ssm.time_step_rank": 3}, "ssm.time_step_rank"),  # 128 is not 3 heads of a whole size
    ({"ssm.group_count": 3}, "ssm.group_count"),
    ({"expert_used_count": 5}, "expert_used_count"),
    ({"expert_weights_scale": 2.5}, "expert_weights_scale"),
])
def test_unsupported_or_inconsistent_keys_are_named(hparams, words):
    from pyggml.backend.metadata import Config
    from pyggml.models.granitehybrid import Options
    from pyggml.synthetic import metadata

    with pytest.raises(ModelError, match=words):
        Options.from_config(Config(metadata("granitehybrid", {**TINY["granitehybrid"], **hparams})))


@pytest.mark.parametrize("key", ["ssm.state_size", "ssm.inner_size", "ssm.time_step_rank", "ssm.group_count"])
def test_a_missing_ssm_key_is_named(key):
    from pyggml.backend.metadata import Config
    from pyggml.models.granitehybrid import Options
    from pyggml.synthetic import metadata

    hparams = {k: v for k, v in TINY["granitehybrid"].items() if k != key}
    with pytest.raises(ModelError, match=key):
        Options.from_config(Config(metadata("granitehybrid", hparams)))


@pytest.mark.parametrize("config, words", [
    ({"layer_types": ["mamba", "mamba2", "mamba", "mamba"]}, "layer_types"),
    ({"mamba_proj_bias": True}, "mamba_proj_bias"),
    ({"mamba_conv_bias": False}, "mamba_conv_bias"),
    ({"time_step_limit": [0.001, 100.0]}, "time_step_limit"),
    ({"mamba_d_head": 16}, "mamba_d_head")])
def test_the_converter_refuses_what_the_file_cannot_express(config, words, tmp_path, converted):
    source = Path(converted("dense-tied")[2].name_or_path)
    hf_dir = tmp_path / "bad-config"
    hf_dir.mkdir()
    for f in source.iterdir():
        (hf_dir / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((source / "config.json").read_text()) | config
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=words):
        convert_hf(hf_dir, tmp_path / "out.gguf", "f32")


# ---- the scan op ----------------------------------------------------------------------------------------
def test_ssm_scan_matches_the_recurrence_and_refuses_bad_operands():
    """``Tensor.ssm_scan`` against the recurrence written out in numpy (grouped B and C, one decay per
    head, states read from the units ``ids`` names); bad shapes and types raise before ggml sees them."""
    rng = np.random.default_rng(0)
    hd, nh, ng, ds, steps, n, units = 4, 6, 2, 8, 5, 2, 3
    x = rng.standard_normal((n, steps, nh, hd)).astype(np.float32)
    dt = rng.standard_normal((n, steps, nh)).astype(np.float32)
    a = -np.exp(rng.standard_normal((nh, 1))).astype(np.float32)
    b, c = (rng.standard_normal((n, steps, ng, ds)).astype(np.float32) for _ in range(2))
    states = rng.standard_normal((units, nh, hd, ds)).astype(np.float32)
    ids = np.array([2, 0], np.int32)
    y, last = np.zeros_like(x), np.zeros((n, nh, hd, ds), np.float32)
    for i in range(n):
        s = states[ids[i]].astype(np.float64)
        for t in range(steps):
            soft = np.log1p(np.exp(dt[i, t]))
            for h in range(nh):
                g = h // (nh // ng)
                s[h] = s[h] * np.exp(soft[h] * a[h, 0]) + soft[h] * np.outer(x[i, t, h], b[i, t, g])
                y[i, t, h] = s[h] @ c[i, t, g]
        last[i] = s
    with pyggml.Backend.cpu(n_threads=2) as backend, backend.new_context() as ctx:
        ins = [ctx.from_numpy(v) for v in (x, dt, a, b, c, states, ids)]
        ours, final = ins[0].ssm_scan(*ins[1:])
        ctx.compute(ours, final)
        np.testing.assert_allclose(ours.numpy(), y, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(final.numpy(), last, rtol=1e-4, atol=1e-5)
        with pytest.raises(ValueError, match="ssm_scan"):
            ins[0].ssm_scan(ctx.from_numpy(dt[:, :4]), *ins[2:])  # dt of other steps
        with pytest.raises(ValueError, match="ssm_scan"):
            ins[0].ssm_scan(ins[1], ins[2], ins[3], ins[4], ins[5], ctx.from_numpy(ids[:1]))  # ids of one sequence
        with pytest.raises(TypeError, match="ssm_scan"):
            ins[0].ssm_scan(*ins[1:5], ctx.from_numpy(states.astype(np.float16)), ins[6])


def test_ssm_scan_refuses_a_unit_outside_the_state_store():
    """ids name units of the state store, which ggml reads unchecked: one past the store is refused at
    compute as rows' indices are (in a child process: unchecked, it reads outside the buffer)."""
    script = textwrap.dedent("""
        import numpy as np, pyggml
        f = lambda *shape: np.zeros(shape, np.float32)
        with pyggml.Backend.cpu(n_threads=1) as backend, backend.new_context() as ctx:
            x, dt, a, b, c = (ctx.from_numpy(v) for v in (f(2, 1, 2, 4), f(2, 1, 2), f(2, 1), f(2, 1, 1, 8),
                                                          f(2, 1, 1, 8)))
            states = ctx.from_numpy(f(3, 2, 4, 8))
            y, last = x.ssm_scan(dt, a, b, c, states, ctx.from_numpy(np.array([2, 1 << 20], np.int32)))
            try:
                ctx.compute(y, last)
            except ValueError as e:
                print("refused:", e)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "refused: ssm_scan: index 1048576 out of range 0..2" in done.stdout, \
        (done.returncode, done.stdout, done.stderr[-2000:])


# ---- the runner's checkpoints of scan states (LFM2's layers have none) --------------------------------------
def logprobs_of(runner, prompt: list[int], n: int, **options) -> tuple[list, object]:
    """``n`` greedy tokens with their top-5 logprobs (end-of-generation tokens banned), and the last chunk."""
    bias = {i: -np.inf for i in range(TINY["granitehybrid"]["vocab_size"]) if runner.model.tokenizer.is_eog(i)}
    chunks = list(runner.completion(CompletionRequest(prompt, max_tokens=n, temperature=0.0, logit_bias=bias,
                                                      logprobs=5, **options)))
    return [lp for c in chunks for lp in c.logprobs or ()], chunks[-1]


def same_logprobs(got: list, expected: list) -> None:
    assert [lp.token for lp in got] == [lp.token for lp in expected]
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose([v for _, v in a.top], [v for _, v in b.top], rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("granitehybrid-tiny") / "g.gguf", "granitehybrid",
                       TINY["granitehybrid"], "f32", seed=6)  # a seed whose drafts are accepted and rejected


def test_a_prompt_with_another_ending_resumes_from_a_checkpoint_of_the_scan_states(tiny_path):
    """The slot's states went past the new prompt's divergence: the checkpoint kept where the first
    prompt ended (convolution and scan states) is resumed and the rest recomputed, as a fresh run."""
    prompt = [1, 17, 42, 99, 5, 23, 64, 7, 150, 33]
    with pyggml.load(tiny_path, n_threads=2, num_ctx=64, cache_type="f32") as llm:
        first, _ = logprobs_of(llm.runner, prompt, 6)
        other = prompt + ([11, 12, 13] if first[0].token != 11 else [12, 13, 14])
        got, last = logprobs_of(llm.runner, other, 6)
    with pyggml.load(tiny_path, n_threads=2, num_ctx=64, cache_type="f32") as fresh:
        expected, fresh_last = logprobs_of(fresh.runner, other, 6)
    assert last.cached_tokens == len(prompt) and fresh_last.cached_tokens == 0
    same_logprobs(got, expected)


def test_prompt_lookup_rolls_rejected_drafts_back_to_plain_greedy(tiny_path):
    prompt = [1, 5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    with pyggml.load(tiny_path, n_threads=2, num_ctx=64, cache_type="f32") as llm:
        plain, _ = logprobs_of(llm.runner, prompt, 24, cache_prompt=False)
        drafted, last = logprobs_of(llm.runner, prompt, 24, cache_prompt=False, prompt_lookup=3)
    same_logprobs(drafted, plain)
    assert last.finish_reason == "length" and 0 < last.accepted_tokens < last.draft_tokens
