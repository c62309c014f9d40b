"""Context shift through a sliding-window layer (issue 25 item 8): after the context fills and older
tokens are dropped, a one-layer Gemma 3 whose only layer attends through a window of 4 must give the
logprobs a fresh computation of the kept tokens gives. One layer, so a kept token's keys depend only on
the token and its position: the shifted window cache must equal a fresh one. It fails when the shift
skips the sliding-window cache (its keys stay at their old positions) or re-rotates them with the
global layers' rope (Gemma 3's sliding layers rotate with base 10,000, its global ones with 1e6).
"""

from __future__ import annotations

import pytest

import pyggml
from pyggml.runner import CompletionRequest, Runner
from pyggml.synthetic import write_model

from ._models import cache_states, log_softmax
from .test_architectures import TINY

NUM_CTX = 16
NUM_KEEP = 4
N_GEN = 40  # a 9-token prompt + 40 > 16: several shifts
PROMPT = [2] + [(11 * i) % 250 + 20 for i in range(8)]
LOGPROB_TOL = 1e-4  # plus 1e-5 relative (logprobs down to -50); a wrong shift errs by 0.05 and more


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    config = {**TINY["gemma3"], "block_count": 1}  # pattern 2: layer 0 slides
    return write_model(tmp_path_factory.mktemp("shift-swa") / "gemma3.gguf", "gemma3", config, "f32", seed=3)


def test_runner_logprobs_after_a_shift_through_a_window_equal_a_fresh_computation(model_path):
    model = pyggml.models.load(model_path, pyggml.BackendParams(n_threads=2))
    try:
        assert [getattr(c, "swa_window", None) for c in model.cache.caches] == [4, None]
        assert model.options.layer_kinds == (0,) and model.options.rope_local.base != model.options.rope.base
    finally:
        model.close()
    _check_shifted_logprobs(model_path)


def test_runner_logprobs_after_a_shift_of_partly_rotated_keys_equal_a_fresh_computation(tmp_path):
    """Gemma 4's global layers rotate a quarter of each head (rope_freqs stop the rest): the shift must
    re-rotate with the same factors. One global layer with two KV heads of 32, 8 of them rotated."""
    config = {**TINY["gemma4"], "block_count": 1, "attention.head_count_kv": 2, "attention.shared_kv_layers": 0,
              "attention.sliding_window_pattern": [False], "feed_forward_length": 96}
    factors = [1.0] * 4 + [1e30] * 12  # as the converter writes them for partial_rotary_factor 0.25

    def init(name, shape, rng):
        return factors if name == "rope_freqs.weight" else None

    path = write_model(tmp_path / "gemma4.gguf", "gemma4", config, "f32", seed=3, init=init)
    _check_shifted_logprobs(path)


def _check_shifted_logprobs(model_path) -> None:
    model = pyggml.models.load(model_path, pyggml.BackendParams(n_threads=2))
    try:
        banned = {t: -1e9 for t in model.tokenizer.vocab.eog}  # never ends early
        with Runner(model, parallel=1, num_ctx=NUM_CTX, batch_size=8, cache_type="f32") as runner:
            # a presence penalty: this random model (tied embeddings) repeats its last token, whose keys differ
            # only by their rotation and whose values are all equal, so no rotation error could show
            request = CompletionRequest(PROMPT, max_tokens=N_GEN, temperature=0.0, presence_penalty=100.0,
                                        repeat_last_n=-1, logprobs=20, num_keep=NUM_KEEP, logit_bias=banned)
            chunks = list(runner.completion(request))
    finally:
        model.close()
    generated = [t for c in chunks for t in c.tokens]
    reported = [lp for c in chunks for lp in c.logprobs or ()]
    assert len(generated) == len(reported) == N_GEN
    states, shifts = cache_states(PROMPT, generated, NUM_CTX, NUM_KEEP)
    assert shifts >= 3 and len(set(generated)) > N_GEN // 2
    with pyggml.load(model_path, n_threads=2, num_ctx=128, cache_type="f32") as reference:
        for i, (state, lp) in enumerate(zip(states, reported, strict=True)):
            expected = log_softmax(reference.logits(state)[-1])
            for token, value in lp.top:
                assert value == pytest.approx(expected[token], rel=1e-5, abs=LOGPROB_TOL), \
                    f"token {i} (cache of {len(state)}): logprob of {token} is {value}, from scratch {expected[token]}"
