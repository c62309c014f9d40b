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


# ---- every checked op, sampled until C has accepted it often enough --------------------------------

MIN_ACCEPTED = 40  # per op
MAX_TRIES = 500  # per op; the generators below aim near each op's rules, so ~1/3 to 2/3 are accepted
DIMS = (1, 2, 3, 4, 8, 32)
FLOATS = (DType.F32, DType.F32, DType.F16, DType.BF16, DType.Q8_0, DType.I32)


def _shape(rng, n=None):
    return tuple(int(rng.choice(DIMS)) for _ in range(n or int(rng.integers(1, 5))))


def _some(rng, options):
    return options[int(rng.integers(len(options)))]


def _layout(rng):
    return _some(rng, ("plain", "plain", "plain", "transposed", "permuted", "row_view"))


def _near(rng, shape, p=0.2):
    """``shape``, or (with probability p) one dim changed."""
    shape = list(shape)
    if rng.random() < p:
        shape[int(rng.integers(len(shape)))] = int(rng.choice(DIMS))
    return tuple(shape)


def _make(ctx, rng, spec):
    """A tensor from (dtype, shape[, layout[, high]]): float data, I32/I64 indices in [0, high),
    or (BF16 and quantized types) an uninitialised tensor; returns (tensor, has_data)."""
    dtype, shape = spec[0], spec[1]
    layout = spec[2] if len(spec) > 2 else "plain"
    high = spec[3] if len(spec) > 3 else 4
    numpy_shape = tuple(reversed(shape))
    if (dtype.is_quantized or dtype is DType.BF16) and shape[0] % dtype.block_size:
        dtype = DType.F32  # no such tensor can exist
    if dtype in (DType.I32, DType.I64):
        t, data = ctx.from_numpy(rng.integers(0, max(high, 1), numpy_shape).astype(np.int64), dtype), True
    elif dtype.is_quantized or dtype is DType.BF16:
        t, data = ctx.empty(dtype, *shape), False
    else:
        t, data = ctx.from_numpy(rng.standard_normal(numpy_shape).astype(np.float32), dtype), True
    if layout == "transposed" and t.ndim >= 2:
        t = t.transpose()
    elif layout == "permuted" and t.ndim >= 3:
        t = t.permute(0, 2, 1, 3)
    elif layout == "row_view" and t.shape[0] > 1 and not t.dtype.is_quantized:
        t = t.view(0, (t.shape[0] - 1, *t.shape[1:]), t.strides[1:])
    return t, data


def _mask_spec(rng, n_kv, n_tokens, heads):
    rows = n_tokens + int(rng.choice([0, 0, 0, 1, 3]))
    return (_some(rng, (DType.F32, DType.F16)), _near(rng, (n_kv, rows, _some(rng, (1, heads)))), "plain")


def _binary_case(rng, fn):
    a = _shape(rng)
    b = tuple(d if rng.random() < 0.6 else 1 for d in a) if rng.random() < 0.8 else _shape(rng)
    da = _some(rng, FLOATS)
    return [(da, a, _layout(rng)), (_some(rng, (DType.F32, da, DType.F16)), b, _layout(rng))], fn


def _unary_case(rng, fn):
    return [(_some(rng, FLOATS), _shape(rng), _layout(rng))], fn


def _case(op, rng):
    """Operand specs and ``fn(*tensors) -> Tensor`` for one random call of ``op``, near its rules."""
    if op in ("add", "sub", "mul", "div"):
        return _binary_case(rng, {"add": lambda a, b: a + b, "sub": lambda a, b: a - b,
                                  "mul": lambda a, b: a * b, "div": lambda a, b: a / b}[op])
    if op in ("silu", "neg", "rms_norm", "norm", "scale"):
        return _unary_case(rng, {"silu": lambda a: a.silu(), "neg": lambda a: a.neg(),
                                 "rms_norm": lambda a: a.rms_norm(1e-5), "norm": lambda a: a.norm(1e-5),
                                 "scale": lambda a: a.scale(0.5)}[op])
    if op == "swiglu":
        shape, dtype = _shape(rng), _some(rng, FLOATS)
        return [(dtype, shape, _layout(rng)), (_some(rng, (dtype, dtype, DType.F32)), _near(rng, shape),
                                               _layout(rng))], lambda a, b: a.silu(b)
    if op == "mulmat":
        k, d2, d3 = int(rng.choice([4, 32, 64])), int(rng.choice([1, 2])), int(rng.choice([1, 2]))
        a = (k, int(rng.integers(1, 9)), d2, d3)
        b = (k, int(rng.integers(1, 9)), d2 * int(rng.choice([1, 2])), d3)
        return [(_some(rng, FLOATS), _near(rng, a), _layout(rng)),
                (_some(rng, (DType.F32, DType.F32, DType.F16)), _near(rng, b), _layout(rng))], lambda a, b: a.mulmat(b)
    if op == "reshape":
        shape = _shape(rng)
        n = int(np.prod(shape))
        target = [n] if rng.random() < 0.4 else [d for d in _shape(rng, len(shape))]
        if rng.random() < 0.5 and n % 2 == 0:
            target = [2, n // 2]
        return [(_some(rng, FLOATS), shape, _layout(rng))], lambda a: a.reshape(*target)
    if op in ("view", "view_strided"):
        shape = _shape(rng)
        dims = tuple(max(1, d // int(rng.choice([1, 2]))) for d in _near(rng, shape))
        offset = int(rng.choice([0, 0, 4, 64]))
        if op == "view":
            return [(_some(rng, FLOATS), shape, _layout(rng))], lambda a: a.view(offset, dims)
        return [(_some(rng, FLOATS), shape, _layout(rng))], \
            lambda a: a.view(0, dims, tuple(a.strides[1:len(dims)]))
    if op == "permute":
        shape = _shape(rng, 4)
        perm = [int(x) for x in rng.permutation(4)] if rng.random() < 0.8 else [int(x) for x in rng.integers(0, 4, 4)]
        return [(_some(rng, FLOATS), shape, _layout(rng))], lambda a: a.permute(*perm)
    if op == "contiguous":
        return [(_some(rng, FLOATS), _shape(rng), _layout(rng))], lambda a: a.contiguous()
    if op == "rows":
        k, r, d2 = int(rng.choice([4, 32])), int(rng.integers(1, 9)), int(rng.choice([1, 2]))
        n = int(rng.integers(1, 6))
        return [(_some(rng, FLOATS), (k, r, d2), _layout(rng)),
                (_some(rng, (DType.I32, DType.I32, DType.F32)), _near(rng, (n, d2)), "plain", r)], \
            lambda a, i: a.rows(i)
    if op == "set_rows":
        k, r, d2 = int(rng.choice([4, 32])), int(rng.integers(2, 9)), int(rng.choice([1, 2]))
        n = int(rng.integers(1, r + 1))
        dst_type = _some(rng, (DType.F32, DType.F16, DType.BF16, DType.Q8_0, DType.Q4_0, DType.I32))
        return [(dst_type, (k, r, d2), "plain"),
                (_some(rng, (DType.F32, DType.F32, DType.F16, DType.BF16)), _near(rng, (k, n, d2)), _layout(rng)),
                (_some(rng, (DType.I32, DType.I32, DType.I64, DType.F32)), _near(rng, (n, d2)), "plain", r)], \
            lambda dst, src, i: dst.set_rows(src, i)
    if op in ("softmax", "softmax_mask"):
        n_kv, t, h = int(rng.choice([4, 8, 32])), int(rng.integers(1, 5)), int(rng.choice([1, 2, 4]))
        a = (_some(rng, (DType.F32, DType.F32, DType.F32, DType.F16)), _near(rng, (n_kv, t, h), 0.1),
             _some(rng, ("plain", "plain", "transposed")))
        if op == "softmax":
            return [a], lambda a: a.softmax()
        return [a, _mask_spec(rng, n_kv, t, h)], lambda a, m: a.softmax(m, 0.5)
    if op == "rope":
        d, h, t = int(rng.choice([4, 8, 16, 64])), int(rng.integers(1, 4)), int(rng.integers(1, 6))
        n_dims = int(rng.choice([d, d, d // 2, 2, 3, d + 2]))
        mode = int(rng.choice([0, 2]))
        specs = [(_some(rng, (DType.F32, DType.F16, DType.F16, DType.BF16, DType.Q8_0)), (d, h, t), _layout(rng)),
                 (_some(rng, (DType.I32, DType.I32, DType.I32, DType.F32)), _near(rng, (t,), 0.1), "plain", 100)]
        if rng.random() < 0.3:
            n_factors = max(1, n_dims // 2 - int(rng.integers(0, 2)))
            specs.append((_some(rng, (DType.F32, DType.F32, DType.F16)), (n_factors,), "plain"))
            return specs, lambda a, p, f: a.rope(p, n_dims, 1e4, mode=mode, freq_factors=f)
        return specs, lambda a, p: a.rope(p, n_dims, 1e4, mode=mode)
    raise AssertionError(op)


CHECKED_OPS = ("add", "sub", "mul", "div", "silu", "neg", "swiglu", "rms_norm", "norm", "scale", "mulmat", "reshape",
               "view", "view_strided", "permute", "contiguous", "rows", "set_rows", "softmax", "softmax_mask", "rope")


def _op_outcome(backend, monkeypatch, decline: bool, op: str, seed: int):
    """(shape, dtype) and the computed values (None when an input has no data) of one call, or
    (None, None) when it is refused."""
    rng = np.random.default_rng(seed)
    specs, fn = _case(op, rng)
    with monkeypatch.context() as m:
        if decline:
            m.setattr(tensor, "lib", _DeclineChecked())
        with backend.new_context(max_nodes=64) as ctx:
            made = [_make(ctx, rng, s) for s in specs]
            try:
                out = fn(*(t for t, _ in made))
            except (ValueError, TypeError):
                return None, None
            values = None
            if all(has for _, has in made) and out.dtype in (DType.F32, DType.F16, DType.I32):
                ctx.compute(out)
                values = out.numpy()
            return (out.shape, out.dtype), values


@pytest.mark.parametrize("op", CHECKED_OPS)
def test_each_checked_op_agrees_with_python_when_c_accepts(backend, monkeypatch, op):
    """Sampled near its rules until C has accepted the op MIN_ACCEPTED times: whenever C accepts,
    Python accepts the same call with the same shape and type, and the node computes the same values
    (bit for bit: the same ggml op on the same data)."""
    accepted = refused = tries = 0
    while accepted < MIN_ACCEPTED and tries < MAX_TRIES:
        seed = 10_000 * CHECKED_OPS.index(op) + tries
        tries += 1
        fast, fast_values = _op_outcome(backend, monkeypatch, False, op, seed)
        if fast is None:
            refused += 1
            continue
        accepted += 1
        slow, slow_values = _op_outcome(backend, monkeypatch, True, op, seed)
        assert slow == fast, f"{op} (seed {seed}): the C path built {fast}, the Python checks say {slow}"
        if fast_values is not None:
            np.testing.assert_array_equal(fast_values, slow_values, err_msg=f"{op} (seed {seed})")
    print(f"{op}: C accepted {accepted}, declined {refused} of {tries} calls")
    assert accepted >= MIN_ACCEPTED, f"{op}: C accepted only {accepted} of {tries} calls"
    assert refused > 0 or op in ("contiguous", "scale"), f"{op}: no call was declined (the rules are untested)"
