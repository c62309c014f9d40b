"""The pieces model files share through ``pyggml.nn``: layer kinds, the decoder-layer loop, MoE routing."""

from __future__ import annotations

import numpy as np
import pytest

from pyggml import nn
from pyggml.backend import Backend
from pyggml.backend.metadata import Config


def _config(pattern=None) -> Config:
    values = {"general.architecture": "gemma2"}
    if pattern is not None:
        values["gemma2.attention.sliding_window_pattern"] = pattern
    return Config(values)


def test_layer_kinds_read_a_period_a_list_or_the_default():
    S, G = nn.SLIDING, nn.GLOBAL
    assert nn.layer_kinds(_config(), 4, 2) == (S, G, S, G)  # the default period: every 2nd layer global
    assert nn.layer_kinds(_config(3), 6, 2) == (S, S, G, S, S, G)
    assert nn.layer_kinds(_config(0), 3, 2) == (S, S, S)  # 0: every layer slides
    assert nn.layer_kinds(_config([True, False, False]), 3, 2) == (S, G, G)
    with pytest.raises(nn.ModelError, match="2 entries for 3 layers"):
        nn.layer_kinds(_config([True, False]), 3, 2)
    with pytest.raises(nn.ModelError, match="bad attention.sliding_window_pattern"):
        nn.layer_kinds(_config(-1), 3, 2)


def test_the_layer_loop_points_the_cache_at_each_layer_and_gives_the_last_the_output_rows():
    class Cache:
        def __init__(self):
            self.layers = []

        def set_layer(self, i):
            self.layers.append(i)

    cache, outputs = Cache(), object()
    seen = [(i, layer, rows) for i, layer, rows in nn.layers(["a", "b", "c"], cache, outputs)]
    assert seen == [(0, "a", None), (1, "b", None), (2, "c", outputs)]
    assert cache.layers == [0, 1, 2]
    assert [i for i, _, _ in nn.layers(["a"], None, None)] == [0]  # no cache (encoders): nothing to point


def test_moe_routes_each_token_through_its_best_experts_weighted_by_their_softmax():
    rng = np.random.default_rng(0)
    hidden, ff, n_experts, k, n_tokens = 8, 6, 4, 2, 5
    x = rng.standard_normal((n_tokens, hidden)).astype(np.float32)
    logits = rng.standard_normal((n_tokens, n_experts)).astype(np.float32)
    gate = rng.standard_normal((n_experts, ff, hidden)).astype(np.float32)
    up = rng.standard_normal((n_experts, ff, hidden)).astype(np.float32)
    down = rng.standard_normal((n_experts, hidden, ff)).astype(np.float32)
    with Backend.cpu(n_threads=1) as backend, backend.new_context() as ctx:
        out = nn.moe(ctx.from_numpy(x), ctx.from_numpy(logits), k, nn.Experts(ctx.from_numpy(gate)),
                     nn.Experts(ctx.from_numpy(up)), nn.Experts(ctx.from_numpy(down)),
                     lambda g, u: g.silu(u))
        ctx.compute(out)
        ours = out.numpy()
    expected = np.zeros((n_tokens, hidden), np.float32)
    for t in range(n_tokens):
        chosen = np.argsort(-logits[t])[:k]
        weights = np.exp(logits[t, chosen] - logits[t, chosen].max())
        weights /= weights.sum()
        for e, w in zip(chosen, weights, strict=True):
            g, u = gate[e] @ x[t], up[e] @ x[t]
            expected[t] += w * (down[e] @ (g / (1 + np.exp(-g)) * u))
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-4)
