"""Sequences of different graphs on one backend give the same answers as numpy.

ggml's allocator keeps the last graph's memory plan for the next graph when their node and leaf counts
match and the sizes fit, whatever the new graph's shape: the old plan's in-place and liveness choices
then overlap tensors the new graph still needs (issue 25 item 5: an ``argsort`` after a graph that
ended in ``relu`` was written over its own input and returned ``[0, 1, 2]`` for every row). These
tests run random sequences of small graphs, in-place ops included, and recompute a kept graph between
them, checking every result.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pyggml import Backend


def _softmax(a: np.ndarray) -> np.ndarray:
    e = np.exp(a - a.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# ops that keep the shape; ggml may run all but tanh/exp in place over their source
BODY = {
    "relu": (lambda t: t.relu(), lambda a: np.maximum(a, 0)),
    "scale": (lambda t: t.scale(1.5), lambda a: a * 1.5),
    "softmax": (lambda t: t.softmax(), _softmax),
    "clamp": (lambda t: t.clamp(-0.5, 0.5), lambda a: np.clip(a, -0.5, 0.5)),
    "neg": (lambda t: -t, lambda a: -a),
    "square": (lambda t: t * t, lambda a: a * a),
    "tanh": (lambda t: t.tanh(), np.tanh),
}


def _sorted_by(values: np.ndarray, order: np.ndarray) -> np.ndarray:
    return np.take_along_axis(values, order.astype(np.int64), axis=-1)


def _check_last(name: str, got: np.ndarray, before: np.ndarray) -> None:
    """``got`` is the last op's result over ``before`` (numpy); ties may come in any order."""
    if name == "argsort":
        assert sorted(got[0].tolist()) == list(range(before.shape[-1]))
        np.testing.assert_array_equal(_sorted_by(before, got), np.sort(before, axis=-1))
    elif name == "top_k":
        k = got.shape[-1]
        np.testing.assert_array_equal(np.sort(_sorted_by(before, got), axis=-1), np.sort(before, axis=-1)[:, -k:])
    elif name == "argmax":
        np.testing.assert_array_equal(_sorted_by(before, got[:, None])[:, 0], before.max(axis=-1))
    else:
        np.testing.assert_allclose(got, LAST[name][1](before), rtol=1e-5, atol=1e-6)


LAST = {
    "argsort": (lambda t: t.argsort(), None),
    "top_k": (lambda t: t.top_k(2), None),
    "argmax": (lambda t: t.argmax(), None),
    "sum_rows": (lambda t: t.sum_rows(), lambda a: a.sum(axis=-1, keepdims=True)),
    "transpose": (lambda t: t.transpose().contiguous(), lambda a: a.T),
    "first_row": (lambda t: t.view(0, (t.shape[0], 1)).contiguous(), lambda a: a[:1]),
    "none": (lambda t: t, lambda a: a),
}

# one shape per sequence (every graph takes it, or one row less), so that graphs often have the same node
# and leaf counts and sizes that fit the previous plan: the case where ggml keeps that plan
graphs = st.tuples(
    st.lists(st.sampled_from(sorted(BODY)), min_size=0, max_size=2),
    st.sampled_from(sorted(LAST)),
    st.booleans(),  # one row less
    st.integers(0, 2**31 - 1),  # data
)


def _run(backend: Backend, shape: tuple[int, int], graph: tuple) -> None:
    body, last, smaller, seed = graph
    rows, cols = shape[0] - (smaller and shape[0] > 1), shape[1]
    x = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    with backend.new_context() as ctx:
        t, a = ctx.from_numpy(x), x
        for name in body:
            t, a = BODY[name][0](t), BODY[name][1](a)
        out = LAST[last][0](t)
        ctx.compute(out)
        _check_last(last, out.numpy(), a)


@settings(max_examples=60, deadline=None)
@given(st.tuples(st.integers(1, 4), st.integers(2, 8)), st.lists(graphs, min_size=2, max_size=6), st.booleans())
def test_random_graph_sequences_match_numpy(shape, graph_list, recompute_kept):
    """Each graph of a random sequence is right, on a backend that computed the ones before; a kept
    graph recomputed between them (with new inputs) is right too."""
    with Backend.cpu(n_threads=1) as backend:
        kept = backend.new_context()
        k_in = kept.from_numpy(np.zeros((2, 5), np.float32), name="x")
        k_out = k_in.relu().argsort()
        for i, graph in enumerate(graph_list):
            _run(backend, shape, graph)
            if recompute_kept:
                x = np.random.default_rng(i).standard_normal((2, 5)).astype(np.float32)
                kept.set_input("x", x)
                kept.compute(k_out)
                _check_last("argsort", k_out.numpy(), np.maximum(x, 0))
        kept.close()


def test_argsort_after_a_graph_that_ended_in_place():
    """The reported case: relu, scale or softmax over a larger input, then argsort on the same backend."""
    values = np.array([[0.3, 0.1, 0.2], [1.0, 3.0, 2.0]], np.float32)
    for op in ("relu", "scale", "softmax"):
        with Backend.cpu(n_threads=1) as backend:
            with backend.new_context() as ctx:
                t = BODY[op][0](ctx.from_numpy(np.ones((100, 100), np.float32)))
                ctx.compute(t)
            with backend.new_context() as ctx:
                x = ctx.from_numpy(values)
                order = x.argsort()
                ctx.compute(order)
                np.testing.assert_array_equal(order.numpy(), [[1, 2, 0], [0, 2, 1]], err_msg=op)
