"""Prompt reuse with sliding-window caches (gemma2, gemma3, gpt-oss): a new request sharing a prompt
prefix longer than the window reuses it while the window before the prefix's end is still stored (the
window layers keep the window plus a batch of positions), else recomputes the prompt; either way it
gets exactly what a fresh evaluation gives. Tiny random models from the registry-wide test's configs
(window 4), batches of 8 tokens, so 30-token prompts span several batches and many windows."""

from __future__ import annotations

import numpy as np
import pytest

from pyggml import BackendParams, models
from pyggml.runner import CompletionRequest, Runner
from pyggml.synthetic import write_model

from .test_architectures import TINY

PROMPT = [(7 * i) % 250 + 5 for i in range(30)]  # 30 tokens: 7 windows, 4 batches
BATCH = 8


@pytest.fixture(scope="module", params=["gemma2", "gemma3", "gpt-oss"])
def model(request, tmp_path_factory):
    path = write_model(tmp_path_factory.mktemp("swa") / f"{request.param}.gguf", request.param, TINY[request.param],
                       "f32", seed=5)
    m = models.load(path, BackendParams(n_threads=1))
    assert 4 in [getattr(c, "swa_window", None) for c in m.cache.caches]
    yield m
    m.close()


def run(runner: Runner, prompt: list[int], **options):
    """(tokens, logprobs (n, 1 + top), last chunk) of a greedy completion that never ends early."""
    banned = {t: -1e9 for t in runner.model.tokenizer.vocab.eog} if runner.model.tokenizer else {}
    chunks = list(runner.completion(CompletionRequest(prompt, max_tokens=5, temperature=0.0, logprobs=3,
                                                      logit_bias=banned, **options)))
    logprobs = [lp for c in chunks for lp in c.logprobs or []]
    table = np.array([[lp.logprob, *(v for _, v in lp.top)] for lp in logprobs])
    return [t for c in chunks for t in c.tokens], table, chunks[-1]


def test_a_prefix_longer_than_the_window_is_reused_while_its_window_is_stored(model):
    near_end = PROMPT[:26] + [200, 201, 202]  # diverges within a batch of the first request's end
    far_back = PROMPT[:12] + [200, 201, 202]  # diverges where the window layers kept nothing
    with Runner(model, parallel=1, num_ctx=96, batch_size=BATCH) as runner:
        fresh = {name: run(runner, p, cache_prompt=False) for name, p in
                 [("prompt", PROMPT), ("near_end", near_end), ("far_back", far_back)]}
    with Runner(model, parallel=1, num_ctx=96, batch_size=BATCH) as runner:
        first = run(runner, PROMPT)
        again = run(runner, PROMPT)  # the same prompt: all but its last token
        near = run(runner, near_end)
        run(runner, PROMPT)
        far = run(runner, far_back)
    assert first[2].cached_tokens == 0 and again[2].cached_tokens == len(PROMPT) - 1
    assert near[2].cached_tokens == 26 and far[2].cached_tokens == 0
    for name, got in [("prompt", first), ("prompt", again), ("near_end", near), ("far_back", far)]:
        tokens, logprobs, _ = fresh[name]
        assert got[0] == tokens, name
        np.testing.assert_allclose(got[1], logprobs, rtol=1e-4, atol=1e-5, err_msg=name)


def test_a_forked_prefix_is_reused_by_another_slot(model):
    """Many users: the longest prefix of another slot is shared into a free one (copy_prefix), window included."""
    other = PROMPT[:27] + [9, 10]
    with Runner(model, parallel=1, num_ctx=96, batch_size=BATCH) as runner:
        expected = run(runner, other, cache_prompt=False)
    with Runner(model, parallel=2, num_ctx=96, batch_size=BATCH, multi_user_cache=True) as runner:
        run(runner, PROMPT)
        forked = run(runner, other)
    assert forked[2].cached_tokens == 27 and forked[0] == expected[0]
    np.testing.assert_allclose(forked[1], expected[1], rtol=1e-4, atol=1e-5)
