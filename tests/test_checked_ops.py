"""The checked C ops (csrc/pyggml_ops.c) against tensor.py's Python checks.

Hot ops first try one C call that validates and builds the node; only when it declines does the
Python validation run (and raise the error message). The C side must therefore never accept a call
that the Python checks refuse, or ggml could abort the process. These tests run the same random
calls twice, once as usual and once with the C side forced to decline, and require:
C accepted => Python accepts, with the same result shape.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from pyggml._ggml import ffi, lib

from pyggml import Backend, BackendParams, DType, tensor


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
    if dtype is DType.I32 and layout == "computed":  # indices computed in the graph: bounded or not
        src = ctx.from_numpy(rng.standard_normal(tuple(reversed(shape))).astype(np.float32))
        kind = int(rng.integers(4))
        if kind == 0:
            return src.argsort()
        if kind == 1:
            return src.top_k(int(rng.integers(1, shape[0] + 1)))
        if kind == 2 and len(shape) <= 2:
            return src.argmax()
        return src.scale(2.0).cast(DType.I32)
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
    layout = ["plain", "plain", "transposed", "permuted", "row_view", "computed"][int(rng.integers(6))]
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


# ---- attention: the composite C op ---------------------------------------------------------------

def _attention_case(ctx, rng):
    """Random q, k, v, mask and flag around a valid attention call (a dim or a type may be off)."""
    d, t, kv, hkv = int(rng.choice([4, 32])), int(rng.integers(1, 4)), int(rng.integers(2, 6)), int(rng.integers(1, 3))
    h = hkv * int(rng.integers(1, 3))
    q_shape, k_shape, v_shape, m_shape = [d, t, h], [d, kv, hkv], [int(rng.choice([4, 32])), kv, hkv], [kv, t]
    if rng.random() < 0.3:  # one dim off
        shape = [q_shape, k_shape, v_shape, m_shape][int(rng.integers(4))]
        shape[int(rng.integers(len(shape)))] += 1

    def make(shape, dtype):
        if dtype.is_quantized and shape[0] % dtype.block_size:
            dtype = DType.F32
        if dtype.is_quantized or dtype is DType.BF16:
            return ctx.empty(dtype, *shape)
        return ctx.from_numpy(rng.standard_normal(tuple(reversed(shape))).astype(np.float32), dtype)

    kinds = [DType.F32, DType.F32, DType.F16, DType.BF16, DType.Q8_0]
    q, k, v = (make(s, kinds[int(rng.integers(len(kinds)))] if rng.random() < 0.3 else DType.F32)
               for s in (q_shape, k_shape, v_shape))
    mask = None
    if rng.random() < 0.8:
        mask_np = np.where(rng.random(tuple(reversed(m_shape))) < 0.7, 0, -np.inf).astype(np.float32)
        mask_np[:, 0] = 0  # every query sees one key
        mask = ctx.from_numpy(mask_np, DType.F16 if rng.random() < 0.5 else DType.F32)
        if rng.random() < 0.1 and mask.shape[0] == mask.shape[1]:
            mask = mask.transpose()
    return q, k, v, mask, bool(rng.random() < 0.5)


def _attention_outcome(backend, monkeypatch, decline: bool, seed: int):
    rng = np.random.default_rng(seed)
    with monkeypatch.context() as m:
        if decline:
            m.setattr(tensor, "lib", _DeclineChecked())
        with backend.new_context(max_nodes=64) as ctx:
            q, k, v, mask, flash = _attention_case(ctx, rng)
            try:
                out = q.scaled_dot_product_attention(k, v, mask, 0.25, flash=flash)
            except (ValueError, TypeError):
                return None, None
            values = None
            if all(t.dtype is DType.F32 for t in (q, k, v)):
                ctx.compute(out)
                values = out.numpy()
            return (out.shape, out.dtype, flash), values


def test_checked_attention_matches_the_python_graph(backend, monkeypatch):
    """pyg_attention accepts only what the Python path accepts, and computes the same values."""
    accepted = refused = computed = 0
    for seed in range(300):
        fast, fast_values = _attention_outcome(backend, monkeypatch, False, seed)
        slow, slow_values = _attention_outcome(backend, monkeypatch, True, seed)
        if fast is None:
            refused += 1
            continue
        accepted += 1
        assert slow == fast, f"seed {seed}: the C path built {fast}, the Python checks say {slow}"
        if fast_values is not None:
            np.testing.assert_allclose(fast_values, slow_values, rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}")
            computed += 1
    assert accepted > 50 and refused > 20 and computed > 30


def test_checked_attention_builds_one_node_chain(backend):
    """Seven nodes without flash, two with (what the Python path builds), from one C call."""
    with backend.new_context() as ctx:
        q = ctx.from_numpy(np.ones((3, 4, 8), np.float32))  # (D=8, T=4, H=3)
        k = ctx.from_numpy(np.ones((3, 5, 8), np.float32))
        v = ctx.from_numpy(np.ones((3, 5, 8), np.float32))
        before = ctx._state.n_tensors
        out = q.scaled_dot_product_attention(k, v, None, 0.5)
        assert ctx._state.n_tensors - before == 7 and out.shape == (8, 3, 4)
        before = ctx._state.n_tensors
        out = q.scaled_dot_product_attention(k, v, None, 0.5, flash=True)
        assert ctx._state.n_tensors - before == 2 and out.shape == (8, 3, 4)


# ---- which tensors an op may use: graph, backend, closed, read-only ------------------------------

def test_checked_ops_refuse_tensors_they_do_not_own():
    """The C side finds a tensor's owner by address; it must decline everything Python refuses."""
    a = Backend.cpu(n_threads=1)
    b = Backend.cpu(n_threads=1)
    cache = a.alloc_persistent(DType.F32, (4, 2))
    other_cache = b.alloc_persistent(DType.F32, (4, 2))
    ctx = a.new_context()
    x = ctx.from_numpy(np.ones((3, 4), np.float32))
    rows = ctx.from_numpy(np.arange(2, dtype=np.int32))
    assert cache.set_rows(ctx.from_numpy(np.ones((2, 4), np.float32)), rows).shape == (4, 2)  # its own cache
    assert cache.mulmat(x).shape == (2, 3)
    # another backend's tensor: C declines, Python checks and builds it (nothing wrong with it)
    assert other_cache.mulmat(x).shape == (2, 3)
    with b.new_context() as other:
        y = other.from_numpy(np.ones((3, 4), np.float32))
        with pytest.raises(ValueError, match="different contexts"):
            x + y
        product = cache.mulmat(y)  # backend a's cache in b's graph: declined by C, allowed by Python
        with pytest.raises(ValueError, match="different contexts"):
            product.rows(rows)
    full = a.new_context(max_nodes=3)
    z = full.from_numpy(np.ones(4, np.float32))
    with pytest.raises(ValueError, match="graph is full"):
        for _ in range(4):
            z = z + z
    a.close()
    with pytest.raises(ValueError, match="closed backend"):
        cache.mulmat(x)  # the context is still open; the backend is not
    with pytest.raises(ValueError, match="closed backend"):
        cache.set_rows(x.contiguous().reshape(4, 3).view(0, (4, 2)), rows)
    ctx.close()
    with pytest.raises(ValueError, match="closed"):
        x + x
    b.close()


def test_checked_ops_refuse_writes_into_weights(tmp_path):
    path = tmp_path / "w.gguf"
    rng = np.random.default_rng(3)
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_tensor("token_embd.weight", rng.standard_normal((8, 64)).astype(np.float32))
    q4 = gguf.quants.quantize(rng.standard_normal((16, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q4_0)
    writer.add_tensor("w.q4_0", q4, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with Backend.load(path, BackendParams(n_threads=1)) as backend, backend.new_context() as ctx:
        w = backend.get("token_embd.weight")
        src = ctx.from_numpy(np.ones((1, w.shape[0]), np.float32))
        with pytest.raises(ValueError, match="cannot write into model weight"):
            w.set_rows(src, ctx.from_numpy(np.zeros(1, np.int32)))
        repacked = [backend.get(name) for name in backend._repacked]
        assert repacked, "the CPU backend repacks a 2-d Q4_0 weight with rows % 8 == 0"
        for r in repacked:  # only the left operand of mulmat
            with pytest.raises(ValueError, match="repacked"):
                ctx.from_numpy(np.ones((1, r.shape[0]), np.float32)).mulmat(r)
            with pytest.raises(ValueError, match="repacked"):
                r.view(0, r.shape, ctx=ctx)


def test_checked_ops_decline_unbounded_indices_and_bad_parameters(backend):
    """The C side leaves to Python what Python refuses or must decide (issue 13): computed index tensors,
    a negative/NaN eps, softmax ALiBi without a mask, a Q8_1 table, a product too large for ggml's sizes."""
    with backend.new_context(max_nodes=64) as ctx:
        table = ctx.from_numpy(np.ones((3, 4), np.float32))
        scores = ctx.from_numpy(np.ones((2, 3), np.float32))
        g = ctx._g
        assert lib.pyg_get_rows(g, table._p, scores.argsort()._p) == ffi.NULL
        assert lib.pyg_get_rows(g, table._p, scores.argmax()._p) == ffi.NULL
        assert lib.pyg_get_rows(g, table._p, scores.cast(DType.I32).reshape(6)._p) == ffi.NULL
        inputs = ctx.from_numpy(np.array([0, 2], np.int32))
        assert lib.pyg_get_rows(g, table._p, inputs.reshape(2, 1)._p) != ffi.NULL  # an input: checked at compute
        cache = backend.alloc_persistent(DType.F32, (4, 3))
        rows = ctx.from_numpy(np.ones((3, 4), np.float32))
        assert lib.pyg_set_rows(g, cache._p, rows._p, scores.argsort().view(0, (3,))._p) == ffi.NULL
        for eps in (-1.0, float("nan"), float("inf")):
            assert lib.pyg_norm(g, tensor._FN["rms_norm"], table._p, eps) == ffi.NULL
        assert lib.pyg_soft_max(g, table._p, ffi.NULL, 1.0, 8.0) == ffi.NULL
        q81 = backend.alloc_persistent(DType.Q8_1, (32, 4))
        assert lib.pyg_get_rows(g, q81._p, inputs._p) == ffi.NULL
        wide = ctx.empty(DType.F32, 1, 2**40)
        assert lib.pyg_mul_mat(g, wide._p, wide._p) == ffi.NULL
