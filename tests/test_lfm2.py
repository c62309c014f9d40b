"""LFM2 (GGUF ``lfm2``, and ``lfm2moe``): converted tiny random checkpoints against transformers and
llama.cpp, the runner on a recurrent-state model (greedy generation, a prompt that extends an earlier
one, a context overflow), and malformed files."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

import pyggml
from pyggml import BackendParams, models
from pyggml.convert import convert_hf
from pyggml.models import ModelError
from pyggml.runner import CompletionRequest, Runner
from pyggml.synthetic import write_model

from ._models import (
    cache_states,
    converted_cases,
    error,
    log_softmax,
    logits_match_in_batches,
    reference,
    sequences_match_transformers,
)
from .test_architectures import TINY
from .test_convert import needs_llama_cpp

torch = pytest.importorskip("torch", reason="the LFM2 parity tests build HF models with torch")
transformers = pytest.importorskip("transformers", reason="the LFM2 parity tests build HF models")

from .hf_fixtures import make_tiny_lfm2  # noqa: E402  (needs torch/transformers)
from .test_qwen import TEXTS, llama_cpp_agrees  # noqa: E402

CASES = {"conv-attn-tied": dict(),  # conv, attention, conv, conv; 3 taps
         "attn-first-untied-4-taps": dict(layer_types=("full_attention", "conv", "conv", "full_attention"),
                                          conv_taps=4, tie=False, auto_adjust_ff=True, n_kv_heads=4, seed=1),
         "moe-dense-first": dict(moe=True, seed=2)}  # lfm2moe: layer 0 dense, then 8 experts (2 chosen)
# max |ours - theirs| / max |theirs| over the logits; measured 4.9e-7 .. 7.8e-7 against transformers (F32 cache)
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(case, out_type)``: (path of the converted file, HF model, HF tokenizer), made once."""
    return converted_cases(tmp_path_factory.mktemp("lfm2"), make_tiny_lfm2, CASES)


# ---- against transformers ------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_in_one_batch_and_token_by_token(case, converted):
    path, model, tokenizer = converted(case)
    tokens = tokenizer.encode(TEXTS[0])
    assert len(tokens) > 8  # several times the convolution's taps
    # the whole prompt; batches that cut the convolution's window; token by token
    logits_match_in_batches(path, model, tokens, TOLERANCE, batch_sizes=(512, 3, 1), text=TEXTS[0])


@pytest.mark.parametrize("case", list(CASES))
def test_several_sequences_at_once_match_transformers(case, converted):
    path, model, tokenizer = converted(case)
    sequences_match_transformers(path, model, [tokenizer.encode(t) for t in TEXTS], TOLERANCE)


def test_a_q8_0_file_keeps_its_kernels_f32_and_stays_close_to_transformers(converted):
    path, model, tokenizer = converted("conv-attn-tied", "q8_0")
    tokens = tokenizer.encode(TEXTS[0])
    with pyggml.load(path, n_threads=2, num_ctx=64) as llm:
        types = {n: t.dtype.name for n, t in llm.model.backend.tensors().items()}
        assert types["blk.0.shortconv.conv.weight"] == "F32" and types["blk.0.shortconv.in_proj.weight"] == "Q8_0"
        # Q8_0 rounding of weights and activations (compare's Q8_0 tolerance); llama.cpp 0.3.36 dies (SIGILL) on
        # quantized lfm2 files, its own llama-quantize output included, so it is compared on F32 and F16 only
        assert error(llm.logits(tokens), reference(model, tokens)) < 5e-2


@needs_llama_cpp
@pytest.mark.parametrize("case", list(CASES))
def test_llama_cpp_gives_the_same_logits_and_greedy_tokens(case, converted):
    llama_cpp_agrees(converted(case)[0])


# ---- the runner on a recurrent model ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("lfm2-tiny") / "lfm2.gguf", "lfm2", TINY["lfm2"], "f32", seed=3)


PROMPT = [1, 17, 42, 99, 5, 23, 64, 7, 150, 33]


def no_end_tokens(llm) -> dict[int, float]:
    """A logit bias banning the end-of-generation tokens (random weights must not end a test early)."""
    n_vocab = llm.model.weights.token_embd.weight.shape[1]
    return {i: -np.inf for i in range(n_vocab) if llm.tokenizer.is_eog(i)}


def greedy_from_logits(llm, prompt: list[int], n: int, bias: dict[int, float]) -> list[int]:
    """``n`` greedy tokens, each the argmax of a fresh computation over everything before it."""
    history = list(prompt)
    for _ in range(n):
        row = llm.logits(history)[-1]
        row[list(bias)] = -np.inf
        history.append(int(np.argmax(row)))
    return history[len(prompt):]


def complete(llm, prompt: list[int], n: int, bias: dict[int, float]) -> tuple[list[int], int]:
    """Greedy tokens through the runner, and how many prompt tokens it reused from the cache."""
    chunks = list(llm.runner.completion(CompletionRequest(prompt, max_tokens=n, temperature=0.0, logit_bias=bias)))
    return [t for c in chunks for t in c.tokens], chunks[-1].cached_tokens


def test_generation_equals_greedy_from_logits(tiny_path):
    with pyggml.load(tiny_path, n_threads=2, num_ctx=64, batch_size=4, cache_type="f32") as llm:
        bias = no_end_tokens(llm)
        generated, _ = complete(llm, PROMPT, 12, bias)
        assert generated == greedy_from_logits(llm, PROMPT, 12, bias)


def test_a_prompt_that_extends_an_earlier_one_reuses_the_state_and_equals_a_fresh_run(tiny_path):
    with pyggml.load(tiny_path, n_threads=2, num_ctx=64, cache_type="f32") as llm:
        bias = no_end_tokens(llm)
        first, _ = complete(llm, PROMPT, 6, bias)
        longer = PROMPT + first + [11, 12, 13]
        continued, cached = complete(llm, longer, 6, bias)
        # the last sampled token was never evaluated: the state is one input behind the slot's inputs
        assert cached == len(PROMPT) + len(first) - 1
        again, cached_again = complete(llm, [2] + longer[1:], 6, bias)  # shares nothing: evaluated afresh
    with pyggml.load(tiny_path, n_threads=2, num_ctx=64, cache_type="f32") as fresh:
        assert continued == complete(fresh, longer, 6, bias)[0]
        assert again == complete(fresh, [2] + longer[1:], 6, bias)[0]
    assert cached_again == 0


NUM_CTX, NUM_KEEP, N_GEN = 24, 4, 40  # a 10-token prompt + 40 > 24: the context overflows twice or more


def test_a_context_overflow_re_evaluates_the_kept_tokens(tiny_path):
    """A recurrent state cannot drop tokens: on a full context the runner clears the sequence and
    re-evaluates what the shift keeps, so each token's logits equal a fresh computation over exactly
    the kept tokens (any number of layers: no stale state survives)."""
    with pyggml.load(tiny_path, n_threads=2, num_ctx=128, cache_type="f32") as reference_llm:
        bias = no_end_tokens(reference_llm)
        model = models.load(tiny_path, BackendParams(n_threads=2))
        try:
            with Runner(model, parallel=1, num_ctx=NUM_CTX, batch_size=8, cache_type="f32") as runner:
                request = CompletionRequest(PROMPT, max_tokens=N_GEN, temperature=0.0, logprobs=5, num_keep=NUM_KEEP,
                                            logit_bias=bias)
                chunks = list(runner.completion(request))
        finally:
            model.close()
        generated = [t for c in chunks for t in c.tokens]
        reported = [lp for c in chunks for lp in c.logprobs or ()]
        assert chunks[-1].finish_reason == "length" and len(generated) == N_GEN
        states, shifts = cache_states(PROMPT, generated, NUM_CTX, NUM_KEEP)
        assert shifts >= 2
        for i, (state, lp) in enumerate(zip(states, reported, strict=True)):
            expected = log_softmax(reference_llm.logits(state)[-1])  # logprobs are reported before the bias
            assert lp.token == generated[i]
            for token, value in lp.top:
                assert value == pytest.approx(expected[token], abs=1e-4), f"token {i}, context of {len(state)}"


# ---- malformed files -----------------------------------------------------------------------------------
def tiny(tmp_path, hparams=None, **kwargs):
    return write_model(tmp_path / "bad.gguf", "lfm2", {**TINY["lfm2"], **(hparams or {})}, "f32", **kwargs)


def test_a_missing_convolution_weight_is_named(tmp_path):
    with pytest.raises(ModelError, match=r"blk\.2\.shortconv\.conv\.weight"):
        models.load(tiny(tmp_path, omit={"blk.2.shortconv.conv.weight"}))


def test_a_state_size_that_does_not_match_the_kernel_is_named(tmp_path):
    path = tiny(tmp_path, shapes={"blk.0.shortconv.conv.weight": (4, 64), "blk.2.shortconv.conv.weight": (4, 64)})
    with pytest.raises(ModelError, match=r"blk\.0\.shortconv\.conv\.weight has shape \(4, 64\).*shortconv_l_cache"):
        models.load(path)


@pytest.mark.parametrize("hparams, words", [
    ({"attention.head_count_kv": [0, 3, 0]}, "head_count_kv"),  # 3 does not divide 4 heads: no layer kind
    ({"attention.head_count_kv": [0, 2]}, "head_count_kv"),  # a kind for 2 of 3 layers
    ({"shortconv.l_cache": 1}, "shortconv.l_cache"),
    ({"attention.sliding_window": 8}, "sliding_window"),
])
def test_unsupported_or_inconsistent_keys_are_named(hparams, words):
    from pyggml.backend.metadata import Config
    from pyggml.models.lfm2 import Options
    from pyggml.synthetic import metadata

    with pytest.raises(ModelError, match=words):
        Options.from_config(Config(metadata("lfm2", {**TINY["lfm2"], **hparams})))


def test_a_missing_l_cache_key_is_named():
    from pyggml.backend.metadata import Config
    from pyggml.models.lfm2 import Options
    from pyggml.synthetic import metadata

    hparams = {k: v for k, v in TINY["lfm2"].items() if k != "shortconv.l_cache"}
    with pytest.raises(ModelError, match="shortconv.l_cache"):
        Options.from_config(Config(metadata("lfm2", hparams)))


@pytest.mark.parametrize("config, words", [({"layer_types": ["conv", "mamba", "conv", "conv"]}, "layer_types"),
                                           ({"conv_bias": True}, "conv_bias")])
def test_the_converter_refuses_what_the_file_cannot_express(config, words, tmp_path, converted):
    import json

    source = Path(converted("conv-attn-tied")[2].name_or_path)
    hf_dir = tmp_path / "bad-config"
    hf_dir.mkdir()
    for f in source.iterdir():
        (hf_dir / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((source / "config.json").read_text()) | config
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=words):
        convert_hf(hf_dir, tmp_path / "out.gguf", "f32")


def run_logprobs(runner, prompt: list[int], n: int, bias: dict[int, float], **options) -> tuple[list, object]:
    """``n`` greedy tokens with their top-5 logprobs through ``runner``, and the last chunk."""
    chunks = list(runner.completion(CompletionRequest(prompt, max_tokens=n, temperature=0.0, logit_bias=bias,
                                                      logprobs=5, **options)))
    return [lp for c in chunks for lp in c.logprobs or ()], chunks[-1]


def same_logprobs(got: list, expected: list) -> None:
    assert [lp.token for lp in got] == [lp.token for lp in expected]
    for a, b in zip(got, expected, strict=True):
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        np.testing.assert_allclose([v for _, v in a.top], [v for _, v in b.top], rtol=0, atol=1e-4)


def test_a_prompt_that_extends_an_earlier_one_with_another_ending_resumes_from_a_checkpoint(tiny_path):
    """The slot's state is past the new prompt's divergence (it went on generating), so the exact
    position does not apply: the checkpoint kept where the first prompt ended does, and the rest is
    recomputed. The output (tokens and logprobs) is a fresh run's."""
    with pyggml.load(tiny_path, n_threads=2, num_ctx=64, cache_type="f32") as llm:
        bias = no_end_tokens(llm)
        first, _ = complete(llm, PROMPT, 6, bias)
        ending = [11, 12, 13] if first[0] != 11 else [12, 13, 14]
        other = PROMPT + ending  # shares the prompt with the slot, not its first sampled token
        got, last = run_logprobs(llm.runner, other, 6, bias)
    with pyggml.load(tiny_path, n_threads=2, num_ctx=64, cache_type="f32") as fresh:
        expected, fresh_last = run_logprobs(fresh.runner, other, 6, bias)
    assert last.cached_tokens == len(PROMPT) and fresh_last.cached_tokens == 0
    same_logprobs(got, expected)


def test_long_prompts_keep_checkpoints_before_their_last_input_and_every_few_positions(tiny_path):
    """Checkpoints fall before a prompt's last input (the same prompt again resumes there: one input
    is always left to compute) and every ``every`` positions of a prompt computed in chunks (a prompt
    that shares 18 of its 20 tokens resumes at 16); a slot keeps at most ``checkpoints`` of them.
    Each output (tokens and logprobs) is a fresh run's."""
    prompt = [1 + (7 * i) % 190 for i in range(20)]
    other = prompt[:18] + [3, 4, 5]
    model = models.load(tiny_path, BackendParams(n_threads=2))
    try:
        with Runner(model, parallel=1, num_ctx=64, batch_size=4, cache_type="f32") as runner:
            runner.plugins[0].every, runner.plugins[0].split_after = 8, 16
            bias = no_end_tokens(runner)
            first, _ = run_logprobs(runner, prompt, 12, bias)
            saved = sorted(model.states.saved[0].values())
            assert len(saved) == model.states.checkpoints == 4 and {8, 16, 19} <= set(saved)
            again, again_last = run_logprobs(runner, prompt, 12, bias)
            got, last = run_logprobs(runner, other, 6, bias)
        with Runner(model, parallel=1, num_ctx=64, batch_size=4, cache_type="f32") as runner:
            expected, _ = run_logprobs(runner, other, 6, bias)
    finally:
        model.close()
    assert again_last.cached_tokens == 19 and last.cached_tokens == 16
    same_logprobs(again, first)
    same_logprobs(got, expected)


def test_the_same_prompt_in_another_slot_forks_the_checkpoint_before_its_last_input(tiny_path):
    """Many users: the same prompt again goes to the least recently used slot, forked from the first
    one's checkpoint before the prompt's last input (not its end: one input is left to compute)."""
    prompt = [1 + (7 * i) % 190 for i in range(40)]
    model = models.load(tiny_path, BackendParams(n_threads=2))
    try:
        with Runner(model, parallel=2, num_ctx=64, batch_size=8, cache_type="f32", multi_user_cache=True) as runner:
            bias = no_end_tokens(runner)
            first, first_last = run_logprobs(runner, prompt, 8, bias)
            again, again_last = run_logprobs(runner, prompt, 8, bias)
    finally:
        model.close()
    assert (first_last.cached_tokens, again_last.cached_tokens) == (0, 39)
    same_logprobs(again, first)


def test_prompt_lookup_on_a_recurrent_model_rolls_rejected_drafts_back(tiny_path):
    """Speculative decoding on a recurrent model: the state is checkpointed before each verification,
    a rejection rolls it back and recomputes the accepted drafts. Drafts are accepted and rejected,
    and the output (tokens and logprobs) is plain greedy decoding's."""
    prompt = [1, 5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    with pyggml.load(tiny_path, n_threads=2, num_ctx=64, cache_type="f32") as llm:
        bias = no_end_tokens(llm)
        plain, _ = run_logprobs(llm.runner, prompt, 24, bias, cache_prompt=False)
        drafted, last = run_logprobs(llm.runner, prompt, 24, bias, cache_prompt=False, prompt_lookup=3)
    same_logprobs(drafted, plain)
    assert last.finish_reason == "length"
    assert 0 < last.accepted_tokens < last.draft_tokens


def test_compare_taps_every_layer_kind(converted):
    from pyggml import porting

    path, _, tokenizer = converted("conv-attn-tied")
    result = porting.compare(tokenizer.name_or_path, path)
    names = [layer.name for layer in result.layers]
    assert {"blk.0.shortconv.in_proj", "blk.0.shortconv.out_proj", "blk.1.attn_output", "blk.3",
            "token_embd_norm", "output"} <= set(names)
    assert result.ok and not result.unmatched


def test_parallel_generation_and_forked_slots_equal_each_sequence_alone(tiny_path):
    """Two sequences decoding in the same batches; then, one request at a time (multi-user cache),
    prompts that share part of another slot's history: the slot is forked (``copy_prefix``), and a
    state that is not at the shared prefix's end makes the fork start over. Each output is the one the
    sequence gets alone."""
    prompts = [PROMPT, [1, 80, 81, 82, 83, 84], PROMPT[:7] + [200, 201, 202]]
    with pyggml.load(tiny_path, n_threads=2, num_ctx=64, cache_type="f32") as alone:
        bias = no_end_tokens(alone)
        expected = [greedy_from_logits(alone, p, 8, bias) for p in prompts]

    def run(runner, prompt: list[int]) -> tuple[list[int], int]:
        chunks = list(runner.completion(CompletionRequest(prompt, max_tokens=8, temperature=0.0, logit_bias=bias)))
        return [t for c in chunks for t in c.tokens], chunks[-1].cached_tokens

    model = models.load(tiny_path, BackendParams(n_threads=2))
    forks, copy_prefix = [], model.states.copy_prefix
    model.states.copy_prefix = lambda *args: (forks.append(args[2]), copy_prefix(*args))
    try:
        with Runner(model, parallel=2, num_ctx=64, batch_size=8, cache_type="f32", multi_user_cache=True) as runner:
            results: list = [None, None]
            threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, run(runner, prompts[i])))
                       for i in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
        assert [r[0] for r in results] == expected[:2]
        forks.clear()  # (the two above may fork each other's first token, depending on who came first)
        with Runner(model, parallel=2, num_ctx=64, batch_size=8, cache_type="f32", multi_user_cache=True) as runner:
            # slot 0 takes prompts[1]; PROMPT shares its first token (slot 0 forked into slot 1 for 1
            # token); prompts[2] shares 7 with slot 1, forked into slot 0, the least recently used
            assert [run(runner, prompts[i]) for i in (1, 0, 2)] == [(expected[i], 0) for i in (1, 0, 2)]
    finally:
        model.close()
    assert forks == [1, 7]


def test_lfm2moe_bad_files_are_named(tmp_path):
    from pyggml.backend.metadata import Config
    from pyggml.models.lfm2moe import Options
    from pyggml.synthetic import metadata

    path = write_model(tmp_path / "moe.gguf", "lfm2moe", TINY["lfm2moe"], "f32", omit={"blk.1.exp_probs_b.bias"})
    with pytest.raises(ModelError, match=r"blk\.1\.exp_probs_b\.bias"):
        models.load(path)
    for key, value in (("expert_gating_func", 1), ("expert_used_count", 5), ("expert_weights_scale", 2.5)):
        with pytest.raises(ModelError, match=key):
            Options.from_config(Config(metadata("lfm2moe", {**TINY["lfm2moe"], key: value})))
