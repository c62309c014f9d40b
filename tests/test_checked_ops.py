"""The checked C ops (csrc/pyggml_ops.c) against tensor.py's Python checks.

Hot ops first try one C call that validates and builds the node; only when it declines does the
Python validation run (and raise the error message). The C side must therefore never accept a call
that the Python checks refuse, or ggml could abort the process. These tests run the same random
calls twice, once as usual and once with the C side forced to decline, and require:
C accepted => Python accepts, with the same result shape.
"""

from __future__ import annotations

import numpy as np
import pytest
from pyggml._ggml import ffi, lib

from pyggml import Backend, DType, tensor


class _DeclineChecked:
    """Stands in for ``lib`` in tensor.py: every ``pyg_*`` op declines, everything else is ggml."""

    def __getattr__(self, name: str):
        if name.startswith("pyg_"):
            return lambda *args: ffi.NULL
        return getattr(lib, name)


@pytest.fixture(scope="module")
def backend():
    b = Backend.cpu(n_threads=1)
    yield b
    b.close()


TYPES = [DType.F32, DType.F16, DType.BF16, DType.Q8_0, DType.Q4_0, DType.I32]


def _operand(ctx, rng, spec):
    """A tensor from a spec: (dtype, shape, layout) where layout picks a plain tensor or a view."""
    dtype, shape, layout = spec
    if dtype is DType.I32:
        t = ctx.from_numpy(rng.integers(0, 4, tuple(reversed(shape))).astype(np.int32))
    elif dtype.is_quantized or dtype is DType.BF16:
        t = ctx.empty(dtype, *shape) if shape[0] % dtype.block_size == 0 else ctx.empty(DType.F32, *shape)
    else:
        t = ctx.from_numpy(rng.standard_normal(tuple(reversed(shape))).astype(np.float32), dtype)
    if layout == "transposed" and t.ndim >= 2:
        t = t.transpose()
    elif layout == "permuted" and t.ndim >= 3:
        t = t.permute(0, 2, 1, 3)
    elif layout == "row_view" and t.shape[0] > 1 and not t.dtype.is_quantized:
        t = t.view(0, (t.shape[0] - 1, *t.shape[1:]), t.strides[1:])  # rows no longer packed together
    return t


def _random_spec(rng):
    n = int(rng.integers(1, 5))
    shape = tuple(int(rng.choice([1, 2, 3, 4, 32, 64])) for _ in range(n))
    dtype = TYPES[int(rng.integers(len(TYPES)))]
    layout = ["plain", "plain", "transposed", "permuted", "row_view"][int(rng.integers(5))]
    return dtype, shape, layout


def _random_call(rng):
    """(label, fn(a, b, c) -> Tensor) for one of the ops with a checked C path."""
    dims = [int(rng.choice([1, 2, 3, 4, 8, 32, 64, 0, -1])) for _ in range(4)]
    n = int(rng.integers(1, 5))
    offset = int(rng.choice([0, 2, 4, 64]))
    perm = [int(x) for x in rng.permutation(4)][:n]
    bad_perm = [int(x) for x in rng.integers(0, 4, n)]
    rope_dims = int(rng.choice([2, 4, 3, 64]))
    ops = [
        ("add", lambda a, b, c: a + b), ("sub", lambda a, b, c: a - b), ("mul", lambda a, b, c: a * b),
        ("div", lambda a, b, c: a / b), ("silu", lambda a, b, c: a.silu()), ("neg", lambda a, b, c: a.neg()),
        ("swiglu", lambda a, b, c: a.silu(b)), ("rms_norm", lambda a, b, c: a.rms_norm(1e-5)),
        ("norm", lambda a, b, c: a.norm(1e-5)), ("scale", lambda a, b, c: a.scale(0.5)),
        ("mulmat", lambda a, b, c: a.mulmat(b)), ("reshape", lambda a, b, c: a.reshape(*dims[:n])),
        ("view", lambda a, b, c: a.view(offset, tuple(dims[:n]))),
        ("view_strided", lambda a, b, c: a.view(0, tuple(dims[:n]), tuple(abs(d) * 8 for d in dims[1:n]))),
        ("permute", lambda a, b, c: a.permute(*perm)),
        ("permute_bad", lambda a, b, c: a.permute(*bad_perm)),
        ("contiguous", lambda a, b, c: a.contiguous()), ("rows", lambda a, b, c: a.rows(c)),
        ("set_rows", lambda a, b, c: a.set_rows(b, c)), ("softmax", lambda a, b, c: a.softmax()),
        ("softmax_mask", lambda a, b, c: a.softmax(b, 0.5)),
        ("rope", lambda a, b, c: a.rope(c, rope_dims, 1e4)),
    ]
    return ops[int(rng.integers(len(ops)))]


def _outcome(backend, monkeypatch, decline: bool, specs, call, seed):
    rng = np.random.default_rng(seed)
    with monkeypatch.context() as m:
        if decline:
            m.setattr(tensor, "lib", _DeclineChecked())
        with backend.new_context(max_nodes=64) as ctx:
            a, b, c = (_operand(ctx, rng, s) for s in specs)
            try:
                out = call(a, b, c)
            except (ValueError, TypeError):
                return None
            return out.shape, out.dtype


@pytest.mark.parametrize("seed", range(8))
def test_checked_ops_never_accept_what_python_refuses(backend, monkeypatch, seed):
    rng = np.random.default_rng(1000 + seed)
    accepted = refused = 0
    for _ in range(250):
        specs = [_random_spec(rng) for _ in range(3)]
        label, call = _random_call(rng)
        call_seed = int(rng.integers(1 << 30))
        fast = _outcome(backend, monkeypatch, False, specs, call, call_seed)
        slow = _outcome(backend, monkeypatch, True, specs, call, call_seed)
        if fast is not None:
            assert slow == fast, f"{label} on {specs}: the C path built {fast}, the Python checks say {slow}"
            accepted += 1
        else:
            refused += 1
    assert accepted > 20 and refused > 20  # both sides of the rule were exercised


def test_checked_ops_build_the_usual_nodes(backend):
    """The C paths give the shapes the Python paths gave (a few fixed cases, computed)."""
    with backend.new_context() as ctx:
        x = ctx.from_numpy(np.arange(24, dtype=np.float32).reshape(2, 3, 4))
        w = ctx.from_numpy(np.ones((5, 4), np.float32))
        assert x.reshape(12, 2).shape == (12, 2)
        assert x.permute(0, 2, 1, 3).shape == (4, 2, 3)
        assert x.view(16, (4, 2), (16,)).shape == (4, 2)
        assert w.mulmat(x).shape == (5, 3, 2)
        y = (x + x).scale(0.5).contiguous()
        ctx.compute(y)
        np.testing.assert_array_equal(y.numpy(), np.arange(24, dtype=np.float32).reshape(2, 3, 4))
