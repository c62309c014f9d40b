"""Context shift, end to end: once the context is full and older tokens are dropped, the model must
see exactly what it would see had it processed the kept tokens from scratch at their new positions.

A generation with a small ``num_ctx`` shifts several times; for every generated token we rebuild the
cache's content at the moment its logits were computed (the prompt, then each generated token, with
``InputCache.shift_discard`` deciding what goes on each shift) and score that token list as a fresh
sequence (``LLM.logits``): the reference. The model has ONE layer: a kept token's keys and values
then depend only on that token and its position, so the shifted cache must equal a fresh one. (With
more layers a kept token's deeper keys still carry what it attended to before the shift, as in
llama.cpp and Ollama; no fresh computation reproduces them.) Through the ``Runner`` the reported top logprobs must equal
the reference's; through ``LLM.generate`` (greedy) each token must be the reference's argmax wherever
that argmax is clear. Both for a model with Llama 3.1's ``rope_freqs`` (the shift must re-rotate keys
with the same frequency factors as the forward pass) and one without.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyggml
from pyggml.runner import CompletionRequest, Runner

from ._models import (
    LETTER_IDS,
    ROPE_FREQS,
    cache_states,
    letters_llama,
    letters_to_ids,
    log_softmax,
    only_letters_bias,
)

NUM_CTX = 32
NUM_KEEP = 4
N_GEN = 70  # 10-token prompt + 70 > 32: three shifts
PROMPT = [1] + letters_to_ids("thequickb")
# measured (2 threads, F32 cache): max |logprob - reference| 3.2e-5 before any shift (batching noise on
# logprobs down to -20) and 2.7e-5 after the shifts; a shift without rope_freqs errs by 0.1 to 10
LOGPROB_TOL = 1e-4
ARGMAX_MARGIN = 1e-3  # ~30x the logit error above: greedy steps with a closer top 2 are not judged


@pytest.fixture(scope="module", params=["rope_freqs", "plain"])
def model_path(request, tmp_path_factory):
    freqs = ROPE_FREQS if request.param == "rope_freqs" else None
    return letters_llama(tmp_path_factory.mktemp("shift") / f"{request.param}.gguf", rope_freqs=freqs)


@pytest.fixture(scope="module")
def reference(model_path):
    """An LLM with room for everything (never shifts): scores token lists from scratch."""
    with pyggml.load(model_path, n_threads=2, num_ctx=128, cache_type="f32") as llm:
        yield llm


def test_runner_logprobs_after_a_shift_equal_a_fresh_computation(model_path, reference):
    model = pyggml.models.load(model_path, pyggml.BackendParams(n_threads=2))
    try:
        with Runner(model, parallel=1, num_ctx=NUM_CTX, batch_size=16, cache_type="f32") as runner:
            request = CompletionRequest(PROMPT, max_tokens=N_GEN, temperature=0.0, logprobs=20, num_keep=NUM_KEEP,
                                        logit_bias=only_letters_bias())
            chunks = list(runner.completion(request))
    finally:
        model.close()
    generated = [t for c in chunks for t in c.tokens]
    reported = [lp for c in chunks for lp in c.logprobs or ()]
    assert chunks[-1].finish_reason == "length" and len(generated) == len(reported) == N_GEN
    states, shifts = cache_states(PROMPT, generated, NUM_CTX, NUM_KEEP)
    assert shifts >= 3
    worst = 0.0
    for i, (state, lp) in enumerate(zip(states, reported, strict=True)):
        expected = log_softmax(reference.logits(state)[-1])
        assert lp.token == generated[i]
        for token, value in lp.top:
            worst = max(worst, abs(value - expected[token]))
            assert value == pytest.approx(expected[token], abs=LOGPROB_TOL), \
                f"token {i} (cache of {len(state)}): logprob of {token} is {value}, from scratch {expected[token]}"
    print(f"max |logprob - reference| = {worst:.2e}")


def test_llm_greedy_text_after_a_shift_follows_a_fresh_computation(model_path, reference):
    with pyggml.load(model_path, n_threads=2, num_ctx=NUM_CTX, cache_type="f32") as llm:
        text = llm.generate(PROMPT, max_tokens=N_GEN, temperature=0.0, logit_bias=only_letters_bias())
    assert len(text) == N_GEN and set(text) <= set(LETTER_IDS)
    generated = letters_to_ids(text)
    states, shifts = cache_states(PROMPT, generated, NUM_CTX, NUM_KEEP)
    assert shifts >= 3
    judged = 0
    for i, state in enumerate(states):
        row = reference.logits(state)[-1][3:]  # the letters (everything else is banned)
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] < ARGMAX_MARGIN:
            continue
        judged += 1
        assert generated[i] == 3 + int(np.argmax(row)), \
            f"token {i} (cache of {len(state)} tokens): generated {text[i]!r}, a fresh computation of the " \
            f"kept tokens picks {chr(ord('a') + int(np.argmax(row)))!r}"
    assert judged >= N_GEN - 5
