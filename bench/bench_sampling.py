"""Host sampling of a decode step (no model): many rows at once (``sample_rows``) and one row (``Sampler.sample``).

    python -m pytest bench/bench_sampling.py --benchmark-only

Random logits (standard normal x 3, float32) at a Llama-2 (32k) and a Qwen (152k) vocabulary; samplers as a
server's requests have them: seeded temperature 0.8, top-k 40, top-p 0.9, the end-of-generation token banned
by a logit bias (``ignore_eos``). 128 rows is the 128-sequence step of ``bench/runner_host.py``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from pyggml.sample import Sampler, sample_rows

VOCABS = [32000, 151936]


def samplers(n: int) -> list[Sampler]:
    return [Sampler(temperature=0.8, top_k=40, top_p=0.9, seed=i, logit_bias={2: -math.inf}) for i in range(n)]


def logits(rows: int, vocab: int) -> np.ndarray:
    return (np.random.default_rng(vocab).standard_normal((rows, vocab)) * 3).astype(np.float32)


@pytest.mark.parametrize("vocab", VOCABS)
def test_seeded_rows(benchmark, vocab):
    """128 rows sampled together."""
    rows, chosen = logits(128, vocab), samplers(128)
    tokens, errors = benchmark(sample_rows, chosen, rows)
    assert not errors and ((0 <= tokens) & (tokens < vocab)).all()


@pytest.mark.parametrize("vocab", VOCABS)
def test_seeded_row(benchmark, vocab):
    """One row (one sequence's step)."""
    row, (sampler,) = logits(1, vocab)[0], samplers(1)
    token = benchmark(sampler.sample, row)
    assert 0 <= token < vocab
