"""Op parity of pyggml.Tensor against numpy references, the shape convention, and validation.

Shapes: ggml order in ``Tensor.shape`` (innermost first), numpy order in arrays; so a numpy array
of shape ``(d3, d2, d1, d0)`` is a tensor of shape ``(d0, d1, d2, d3)``. References work on numpy
arrays; helpers below convert ggml permutations and dims to numpy axes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyggml import Backend, BackendParams, DType
from pyggml.tensor import RopeType, quantize

FAST = settings(max_examples=12, deadline=None, derandomize=True, database=None)
F16_TOL = dict(rtol=2e-3, atol=2e-3)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def randn(*shape: int, seed: int = 0) -> np.ndarray:
    return rng(seed).standard_normal(shape).astype(np.float32)


def compute(cpu: Backend, build, *arrays: np.ndarray, dtype=None):
    """Build ``build(*inputs)`` over graph inputs made from ``arrays``, compute, return numpy results."""
    with cpu.new_context() as ctx:
        inputs = [ctx.from_numpy(a, dtype) for a in arrays]
        out = build(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        ctx.compute(*outs)
        results = tuple(o.numpy() for o in outs)
    return results if isinstance(out, tuple) else results[0]


def as4d(a: np.ndarray) -> np.ndarray:
    return a.reshape((1,) * (4 - a.ndim) + a.shape)


def np_permute(a: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """numpy equivalent of ggml's permute (dim i moves to position axes[i]) on a 4-d array."""
    axes = tuple(axes) + tuple(range(len(axes), 4))
    perm = [0] * 4
    for i, ax in enumerate(axes):
        perm[3 - ax] = 3 - i
    return np.transpose(as4d(a), perm)


def tile_to(b: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """ggml's broadcast of a right operand: repeat ``b`` until it has ``shape`` (numpy order)."""
    return np.tile(b, tuple(s // t for s, t in zip(shape, b.shape, strict=True)))


def erf(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# ---- shape convention -------------------------------------------------------------------------
@FAST
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4))
def test_shape_convention(cpu, shape):
    a = randn(*shape)
    with cpu.new_context() as ctx:
        t = ctx.from_numpy(a)
        assert t.shape == tuple(reversed(a.shape))
        assert t.ndim == a.ndim
        y = t * 1.0
        ctx.compute(y)
        out = y.numpy()
        assert out.shape == tuple(reversed(y.shape)) == a.shape
        np.testing.assert_array_equal(out, a)


def test_shape_with_unit_dims(cpu):
    for shape in [(1,), (1, 1), (3, 1), (1, 3), (1, 1, 4), (2, 1, 1, 5), (1, 1, 1, 1)]:
        a = randn(*shape)
        with cpu.new_context() as ctx:
            t = ctx.from_numpy(a)
            assert t.shape == tuple(reversed(shape))
            ctx.compute(t)
            assert t.numpy().shape == shape
            np.testing.assert_array_equal(t.numpy(), a)


def test_scalar_and_dtypes(cpu):
    with cpu.new_context() as ctx:
        s = ctx.from_numpy(np.float32(3.5))
        i = ctx.from_numpy(np.arange(6, dtype=np.int32).reshape(2, 3))
        h = ctx.from_numpy(np.ones((2, 3)), DType.F16)
        d = ctx.from_numpy(np.ones(4))  # float64 defaults to F32
        assert (s.shape, s.dtype) == ((1,), DType.F32)
        assert (i.shape, i.dtype) == ((3, 2), DType.I32)
        assert h.dtype == DType.F16 and d.dtype == DType.F32
        ctx.compute(s, i, h, d)
        assert i.numpy().dtype == np.int32 and h.numpy().dtype == np.float16
        np.testing.assert_array_equal(i.numpy(), np.arange(6).reshape(2, 3))


# ---- elementwise -----------------------------------------------------------------------------
@st.composite
def tiling_shapes(draw):
    """(left numpy shape, right numpy shape) where the right tiles the left (ggml broadcasting)."""
    nd = draw(st.integers(1, 4))
    right = tuple(draw(st.integers(1, 4)) for _ in range(nd))
    reps = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    return tuple(r * k for r, k in zip(right, reps, strict=True)), right


BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}


@FAST
@given(tiling_shapes(), st.sampled_from(sorted(BINARY)))
def test_binary_broadcast_f32(cpu, shapes, op):
    left, right = shapes
    a = randn(*left, seed=1)
    b = (rng(2).uniform(0.5, 2.0, right) * rng(3).choice([-1, 1], right)).astype(np.float32)
    out = compute(cpu, lambda x, y: getattr(x, op)(y), a, b)
    np.testing.assert_allclose(out, BINARY[op](a, tile_to(b, left)), rtol=1e-6, atol=1e-6)


def test_binary_operators_and_scalars(cpu):
    a, b = randn(3, 8, seed=1), randn(3, 8, seed=2) + 4.0
    outs = compute(cpu, lambda x, y: (x + y, x - y, x * y, x / y, -x, x + 2.5, x - 1.5, x * 3.0, x / 4.0,
                                      2.0 + x, 3.0 * x), a, b)
    expected = (a + b, a - b, a * b, a / b, -a, a + 2.5, a - 1.5, a * 3.0, a / 4.0, 2.0 + a, 3.0 * a)
    for got, want in zip(outs, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("right", ["f16", "f32"])
@pytest.mark.parametrize("layout", ["contiguous", "permuted"])
def test_binary_f16(cpu, right, layout):
    a, b = randn(2, 4, 16, seed=1), randn(1, 1, 16, seed=2)
    with cpu.new_context() as ctx:
        x = ctx.from_numpy(a, DType.F16)
        if layout == "permuted":  # (16, 2, 4): packed rows, strided dims 1 and 2
            x = x.permute(0, 2, 1, 3)
            a = a.transpose(1, 0, 2)
        y = ctx.from_numpy(b, DType.F16 if right == "f16" else DType.F32)
        outs = (x + y, x - y, x * y)
        ctx.compute(*outs)
        a16, b16 = a.astype(np.float16).astype(np.float32), b.astype(np.float16).astype(np.float32)
        for out, want in zip(outs, (a16 + b16, a16 - b16, a16 * b16), strict=True):
            assert out.dtype == DType.F16
            np.testing.assert_allclose(out.numpy().astype(np.float32), want, **F16_TOL)


def test_binary_non_contiguous_inputs(cpu):
    a, b = randn(2, 3, 4, 8, seed=1), randn(2, 4, 3, 8, seed=2)
    with cpu.new_context() as ctx:
        x = ctx.from_numpy(a)
        y = ctx.from_numpy(b).permute(0, 2, 1, 3)  # swap dims 1 and 2: (8, 4, 3, 2)
        v = ctx.from_numpy(a).view(32, (8, 2, 3, 2), [64, 128, 384])  # odd rows, with an offset
        outs = (x + y, y * x, v + v, v * x.view(0, (8, 2, 3, 2), [64, 128, 384]))
        ctx.compute(*outs)
        b_p = np_permute(b, (0, 2, 1, 3))
        np.testing.assert_allclose(outs[0].numpy(), a + b_p, rtol=1e-6)
        np.testing.assert_allclose(outs[1].numpy(), b_p * a, rtol=1e-6)
        np.testing.assert_allclose(outs[2].numpy(), 2 * a[:, :, 1::2], rtol=1e-6)
        np.testing.assert_allclose(outs[3].numpy(), a[:, :, 1::2] * a[:, :, 0::2], rtol=1e-6)


UNARY = {
    "neg": (lambda x: -x, 1e-6),
    "sqr": (lambda x: x * x, 1e-6),
    "sqrt": (lambda x: np.sqrt(np.abs(x) + 0.1), 1e-6),
    "exp": (np.exp, 1e-5),
    "log": (lambda x: np.log(np.abs(x) + 0.1), 1e-5),
    "sin": (np.sin, 1e-5),
    "cos": (np.cos, 1e-5),
    "abs": (np.abs, 1e-6),
    "tanh": (np.tanh, 1e-5),
    "relu": (lambda x: np.maximum(x, 0), 1e-6),
    "sigmoid": (lambda x: 1 / (1 + np.exp(-x)), 1e-5),
    "silu": (lambda x: x / (1 + np.exp(-x)), 1e-5),
    "gelu": (lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))), 1e-3),
    "gelu_erf": (lambda x: 0.5 * x * (1 + erf(x / np.sqrt(2))), 1e-5),
    "gelu_quick": (lambda x: x / (1 + np.exp(-1.702 * x)), 1e-3),
}
POSITIVE = {"sqrt", "log"}


@pytest.mark.parametrize("op", sorted(UNARY))
@pytest.mark.parametrize("layout", ["contiguous", "permuted"])
def test_unary_f32(cpu, op, layout):
    ref, tol = UNARY[op]
    a = randn(3, 5, 4, 16, seed=sorted(UNARY).index(op)) * 2
    if op in POSITIVE:
        a = np.abs(a) + 0.1
    with cpu.new_context() as ctx:
        x = ctx.from_numpy(a)
        if layout == "permuted":  # rows stay contiguous, dims 1 and 2 swap
            x = x.permute(0, 2, 1, 3)
            a = np_permute(a, (0, 2, 1, 3))
        y = getattr(x, op)()
        ctx.compute(y)
        want = ref(np.abs(a) - 0.1 if op in POSITIVE else a)
        np.testing.assert_allclose(y.numpy(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("op", ["neg", "sqr", "sqrt", "exp", "abs", "tanh", "relu", "sigmoid", "silu", "gelu",
                                "sin", "cos", "log"])
@pytest.mark.parametrize("layout", ["contiguous", "permuted"])
def test_unary_f16(cpu, op, layout):
    ref, _ = UNARY[op]
    a = randn(2, 4, 32, seed=5)
    if op in POSITIVE:
        a = np.abs(a) + 0.1
    if layout == "permuted":
        out = compute(cpu, lambda x: getattr(x.permute(0, 2, 1, 3), op)(), a, dtype=DType.F16)
        a = a.transpose(1, 0, 2)
    else:
        out = compute(cpu, lambda x: getattr(x, op)(), a, dtype=DType.F16)
    assert out.dtype == np.float16
    a16 = a.astype(np.float16).astype(np.float64)
    want = ref(np.abs(a16) - 0.1 if op in POSITIVE else a16)
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_glu(cpu, act):
    g, u = randn(3, 64, seed=1), randn(3, 64, seed=2)
    fused = compute(cpu, lambda x, y: getattr(x, act)(y), g, u)
    ref = UNARY[act][0](g) * u
    np.testing.assert_allclose(fused, ref, rtol=1e-3, atol=1e-3)


def test_scale_clamp(cpu):
    a = randn(2, 3, 8, seed=3) * 3
    outs = compute(cpu, lambda x: (x.scale(0.5), x.scale_bias(2.0, -1.0), x.clamp(-1.0, 0.5)), a)
    np.testing.assert_allclose(outs[0], a * 0.5, rtol=1e-6)
    np.testing.assert_allclose(outs[1], a * 2 - 1, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(outs[2], np.clip(a, -1.0, 0.5), rtol=0)
    clamped16 = compute(cpu, lambda x: x.clamp(-1.0, 0.5), a, dtype=DType.F16)
    np.testing.assert_allclose(clamped16.astype(np.float32), np.clip(a, -1, 0.5), **F16_TOL)


# ---- reductions and normalisation -----------------------------------------------------------
def test_reductions(cpu):
    a = randn(2, 3, 7, seed=4)
    s, m, t, am = compute(cpu, lambda x: (x.sum_rows(), x.mean(), x.sum(), x.reshape(7, 6).argmax()), a)
    assert s.shape == (2, 3, 1) and m.shape == (2, 3, 1) and t.shape == (1,)
    np.testing.assert_allclose(s, a.sum(-1, keepdims=True), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(m, a.mean(-1, keepdims=True), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(t, [a.sum()], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(am, a.reshape(6, 7).argmax(-1))


def test_norms(cpu):
    a = randn(3, 4, 32, seed=6) * 2 + 0.5
    w, b = randn(32, seed=7), randn(32, seed=8)
    eps = 1e-5
    with cpu.new_context() as ctx:
        x, wt, bt = ctx.from_numpy(a), ctx.from_numpy(w), ctx.from_numpy(b)
        outs = (x.rms_norm(eps), x.rms_norm(eps, wt), x.norm(eps), x.norm(eps, wt, bt), x.l2_norm(eps),
                x.permute(0, 2, 1, 3).rms_norm(eps))
        ctx.compute(*outs)
        got = [o.numpy() for o in outs]
    rms = a / np.sqrt((a * a).mean(-1, keepdims=True) + eps)
    ln = (a - a.mean(-1, keepdims=True)) / np.sqrt(a.var(-1, keepdims=True) + eps)
    l2 = a / np.maximum(np.sqrt((a * a).sum(-1, keepdims=True)), eps)
    wants = (rms, rms * w, ln, ln * w + b, l2, np_permute(rms, (0, 2, 1, 3)))
    for g, want in zip(got, wants, strict=True):
        np.testing.assert_allclose(g, want.reshape(g.shape), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mask_dtype", [None, DType.F32, DType.F16])
def test_softmax(cpu, mask_dtype):
    scores = randn(2, 5, 9, seed=9)  # ggml (9 kv, 5 tokens, 2 heads)
    mask = np.where(rng(10).random((6, 9)) < 0.3, -np.inf, 0.0).astype(np.float32)  # 6 >= 5 rows
    mask[:, 0] = 0
    with cpu.new_context() as ctx:
        x = ctx.from_numpy(scores)
        m = ctx.from_numpy(mask, mask_dtype) if mask_dtype else None
        y = x.softmax(m, scale=0.7)
        ctx.compute(y)
        got = y.numpy()
    want = softmax(scores * 0.7 + (mask[:5] if mask_dtype else 0))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ---- matrix products --------------------------------------------------------------------------
@st.composite
def mulmat_shapes(draw):
    k, m, n = draw(st.integers(1, 40)), draw(st.integers(1, 9)), draw(st.integers(1, 9))
    a2, a3 = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    r2, r3 = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    return k, m, n, a2, a3, a2 * r2, a3 * r3


def np_mulmat(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """ggml mul_mat on 4-d numpy arrays: w (A3, A2, M, K), x (B3, B2, N, K) -> (B3, B2, N, M)."""
    w4, x4 = as4d(w).astype(np.float64), as4d(x).astype(np.float64)
    b3, b2 = x4.shape[:2]
    r3, r2 = b3 // w4.shape[0], b2 // w4.shape[1]
    out = np.empty((b3, b2, x4.shape[2], w4.shape[2]))
    for i3 in range(b3):
        for i2 in range(b2):
            out[i3, i2] = x4[i3, i2] @ w4[i3 // r3, i2 // r2].T
    return out


@FAST
@given(mulmat_shapes())
def test_mulmat_broadcast(cpu, shapes):
    k, m, n, a2, a3, b2, b3 = shapes
    w, x = randn(a3, a2, m, k, seed=11), randn(b3, b2, n, k, seed=12)
    out = compute(cpu, lambda wt, xt: wt.mulmat(xt), w, x)
    assert out.shape == (b3, b2, n, m)
    np.testing.assert_allclose(out, np_mulmat(w, x), rtol=1e-4, atol=1e-4)


def test_mulmat_2d_3d_f16(cpu):
    w, x = randn(24, 64, seed=13), randn(5, 64, seed=14)
    with cpu.new_context() as ctx:
        wt, xt = ctx.from_numpy(w), ctx.from_numpy(x)
        w16, x16 = ctx.from_numpy(w, DType.F16), ctx.from_numpy(x, DType.F16)
        outs = (wt.mulmat(xt), w16.mulmat(xt), w16.mulmat(x16), wt.mulmat_full_prec(xt),
                wt.reshape(64, 6, 4).mulmat(xt.reshape(64, 5, 1).repeat(64, 5, 4)))
        ctx.compute(*outs)
        got = [o.numpy() for o in outs]
    assert got[0].shape == (5, 24)
    np.testing.assert_allclose(got[0], x @ w.T, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[1], x @ w.T, rtol=2e-2, atol=2e-2)  # x rounded to F16 for the kernel
    np.testing.assert_allclose(got[2], x @ w.T, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(got[3], x @ w.T, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[4], np.stack([x @ w.reshape(4, 6, 64)[i].T for i in range(4)]), rtol=1e-4,
                               atol=1e-4)


def test_mulmat_non_contiguous_operands(cpu):
    w, x = randn(3, 16, 32, seed=15), randn(6, 3, 32, seed=16)  # ggml w (32, 16, 3), x (32, 3, 6)
    with cpu.new_context() as ctx:
        xt = ctx.from_numpy(x).permute(0, 2, 1, 3)  # (32, 6, 3): rows contiguous, not contiguous
        y = ctx.from_numpy(w).mulmat(xt)
        ctx.compute(y)
        got = y.numpy()
    np.testing.assert_allclose(got, np_mulmat(w, np_permute(x, (0, 2, 1, 3)))[0], rtol=1e-4, atol=1e-4)


def test_mulmat_id(cpu):
    k, m, n_exp, n_used, n_tok = 32, 8, 4, 2, 5
    w = randn(n_exp, m, k, seed=17)  # ggml (K, M, E)
    x = randn(n_tok, 1, k, seed=18)  # ggml (K, 1, N): one input row shared by the used experts
    ids = rng(19).integers(0, n_exp, (n_tok, n_used)).astype(np.int32)  # ggml (U, N)
    out = compute(cpu, lambda wt, xt, it: wt.mulmat_id(xt, it), w, x, ids)
    assert out.shape == (n_tok, n_used, m)
    want = np.stack([[w[ids[t, u]] @ x[t, 0] for u in range(n_used)] for t in range(n_tok)])
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    x2 = randn(n_tok, n_used, k, seed=20)  # one input row per used expert
    out2 = compute(cpu, lambda wt, xt, it: wt.mulmat_id(xt, it), w, x2, ids)
    want2 = np.stack([[w[ids[t, u]] @ x2[t, u] for u in range(n_used)] for t in range(n_tok)])
    np.testing.assert_allclose(out2, want2, rtol=1e-4, atol=1e-4)


# ---- shape and layout ------------------------------------------------------------------------
def test_reshape_view_permute_transpose(cpu):
    a = randn(2, 3, 4, 8, seed=21)
    with cpu.new_context() as ctx:
        x = ctx.from_numpy(a)
        r = x.reshape(32, 6)
        v1 = x.view(8 * 4, (8, 3))  # rows 1..3 of the first (4, 8) slab
        v2 = x.view(4 * 2, (4, 3, 2), [8 * 4, 8 * 4 * 4])  # strided: columns 2..5 of rows 0..2 of two slabs
        v4 = x.view(0, (8, 2, 3, 2), [8 * 4 * 2, 8 * 4 * 4, 8 * 4 * 4 * 3])
        p = x.permute(2, 0, 3, 1)
        t = x.transpose()
        outs = (r, v1.contiguous(), v2.contiguous(), v4.contiguous(), p.contiguous(), t.contiguous(),
                x.contiguous(6, 32))
        ctx.compute(*outs)
        got = [o.numpy() for o in outs]
        direct = [v.numpy() for v in (v2, p, t)]  # strided reads of computed views
    flat = a.reshape(-1)
    np.testing.assert_array_equal(got[0], a.reshape(6, 32))
    np.testing.assert_array_equal(got[1], flat[8:32].reshape(3, 8))
    want_v2 = as4d(a)[0, :2, :3, 2:6]
    np.testing.assert_array_equal(got[2], want_v2)
    np.testing.assert_array_equal(got[3], as4d(a)[:, :, ::2, :].reshape(2, 3, 2, 8))
    np.testing.assert_array_equal(got[4], np_permute(a, (2, 0, 3, 1)))
    np.testing.assert_array_equal(got[5], np.swapaxes(a, -1, -2))
    np.testing.assert_array_equal(got[6], a.reshape(32, 6))
    np.testing.assert_array_equal(direct[0], want_v2)
    np.testing.assert_array_equal(direct[1], np_permute(a, (2, 0, 3, 1)))
    np.testing.assert_array_equal(direct[2], np.swapaxes(a, -1, -2))


@pytest.mark.parametrize("dim", [0, 1, 2, 3])
def test_concat(cpu, dim):
    shape_a, shape_b = [2, 3, 4, 5], [2, 3, 4, 5]
    shape_b[3 - dim] = 2
    a, b = randn(*shape_a, seed=22), randn(*shape_b, seed=23)
    out = compute(cpu, lambda x, y: x.concat(y, dim), a, b)
    np.testing.assert_array_equal(out, np.concatenate([a, b], axis=3 - dim))
    out16 = compute(cpu, lambda x, y: x.concat(y, dim), a, b, dtype=DType.F16)
    np.testing.assert_array_equal(out16, np.concatenate([a, b], axis=3 - dim).astype(np.float16))


def test_pad_repeat(cpu):
    a = randn(2, 3, 4, seed=24)
    padded, tiled, tiled16 = compute(
        cpu, lambda x: (x.pad(2, 1, 1), x.repeat(8, 6, 2, 2), x.cast("f16").repeat(8, 3, 2)), a)
    np.testing.assert_array_equal(padded, np.pad(a, ((0, 1), (0, 1), (0, 2))))
    np.testing.assert_array_equal(tiled, np.tile(a, (2, 1, 2, 2)))
    np.testing.assert_array_equal(tiled16, np.tile(a, (1, 1, 2)).astype(np.float16))


def test_copy_cast(cpu):
    a = randn(3, 40, seed=25) * 100
    with cpu.new_context() as ctx:
        x = ctx.from_numpy(a)
        h = x.cast(DType.F16)
        back = h.cast("f32")
        dst = ctx.empty(DType.F16, 40, 3)
        copied = x.copy(dst)
        perm = x.transpose().cast(DType.F16)  # converting copy from a strided source
        ints = ctx.from_numpy(np.arange(12, dtype=np.int32)).cast(DType.F32)
        ctx.compute(h, back, copied, perm, ints)
        np.testing.assert_array_equal(h.numpy(), a.astype(np.float16))
        np.testing.assert_array_equal(back.numpy(), a.astype(np.float16).astype(np.float32))
        np.testing.assert_array_equal(copied.numpy(), a.astype(np.float16))
        np.testing.assert_array_equal(perm.numpy(), a.T.astype(np.float16))
        np.testing.assert_array_equal(ints.numpy(), np.arange(12, dtype=np.float32))


# ---- indexing ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [DType.F32, DType.F16])
def test_rows(cpu, dtype):
    table = randn(10, 16, seed=26)
    idx = np.array([3, 0, 9, 3], dtype=np.int32)
    with cpu.new_context() as ctx:
        t = ctx.from_numpy(table, dtype)
        y = t.rows(ctx.from_numpy(idx))
        t3 = ctx.from_numpy(randn(2, 5, 16, seed=27))
        i3 = ctx.from_numpy(np.array([[4, 0, 1], [2, 2, 3]], dtype=np.int32))
        y3 = t3.rows(i3)
        ctx.compute(y, y3)
        assert y.dtype == DType.F32 and y.shape == (16, 4)
        np.testing.assert_allclose(y.numpy(), table.astype(dtype.numpy_dtype)[idx].astype(np.float32))
        t3n = randn(2, 5, 16, seed=27)
        np.testing.assert_array_equal(y3.numpy(), np.stack([t3n[0][[4, 0, 1]], t3n[1][[2, 2, 3]]]))


@pytest.mark.parametrize("dtype", [DType.F32, DType.F16])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_set_rows_persistent(cpu, dtype, index_dtype):
    cache = cpu.alloc_persistent(dtype, (16, 6), name="test_cache")
    assert cache.ctx is None and cache.shape == (16, 6)
    np.testing.assert_array_equal(cache.numpy(), np.zeros((6, 16), dtype.numpy_dtype))
    src = randn(2, 16, seed=28)
    with cpu.new_context() as ctx:
        written = cache.set_rows(ctx.from_numpy(src), ctx.from_numpy(np.array([4, 1], dtype=index_dtype)))
        ctx.compute(written)
    want = np.zeros((6, 16), np.float32)
    want[[4, 1]] = src
    np.testing.assert_array_equal(cache.numpy(), want.astype(dtype.numpy_dtype))
    # a second graph reads the cache back through get_rows
    with cpu.new_context() as ctx:
        y = cache.rows(ctx.from_numpy(np.array([1, 4, 0], dtype=np.int32)))
        ctx.compute(y)
        np.testing.assert_allclose(y.numpy(), want[[1, 4, 0]].astype(dtype.numpy_dtype).astype(np.float32))


def test_top_k_argsort(cpu):
    a = rng(29).permutation(6 * 20).reshape(6, 20).astype(np.float32)  # distinct values
    top, asc, desc = compute(cpu, lambda x: (x.top_k(5), x.argsort(), x.argsort(descending=True)), a)
    assert top.dtype == np.int32 and top.shape == (6, 5)
    np.testing.assert_array_equal(np.sort(top, -1), np.sort(np.argsort(-a, -1)[:, :5], -1))
    np.testing.assert_array_equal(asc, np.argsort(a, -1))
    np.testing.assert_array_equal(desc, np.argsort(-a, -1))


# ---- rope --------------------------------------------------------------------------------------
def rope_ref(x: np.ndarray, pos: np.ndarray, n_dims: int, base: float, freq_scale: float, mode: RopeType,
             ff: np.ndarray | None = None) -> np.ndarray:
    """x numpy (T, H, D). NORMAL rotates pairs (2i, 2i+1); NEOX rotates (i, i + n_dims/2)."""
    x = x.astype(np.float64)
    half = n_dims // 2
    theta = pos[:, None].astype(np.float64) * base ** (-2.0 * np.arange(half) / n_dims) * freq_scale
    if ff is not None:
        theta = theta / ff[:half]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    out = x.copy()
    if mode == RopeType.NORMAL:
        x0, x1 = x[..., 0:n_dims:2], x[..., 1:n_dims:2]
        out[..., 0:n_dims:2], out[..., 1:n_dims:2] = x0 * cos - x1 * sin, x0 * sin + x1 * cos
    else:
        x0, x1 = x[..., :half], x[..., half:n_dims]
        out[..., :half], out[..., half:n_dims] = x0 * cos - x1 * sin, x0 * sin + x1 * cos
    return out


@pytest.mark.parametrize("mode", [RopeType.NORMAL, RopeType.NEOX])
@pytest.mark.parametrize("n_dims", [16, 8])
@pytest.mark.parametrize("with_ff", [False, True])
def test_rope(cpu, mode, n_dims, with_ff):
    t, h, d = 5, 3, 16
    x = randn(t, h, d, seed=30)
    pos = np.array([0, 1, 7, 30, 2], dtype=np.int32)
    ff = rng(31).uniform(1.0, 4.0, n_dims // 2).astype(np.float32) if with_ff else None
    with cpu.new_context() as ctx:
        xt, pt = ctx.from_numpy(x), ctx.from_numpy(pos)
        ft = ctx.from_numpy(ff) if with_ff else None
        y = xt.rope(pt, n_dims, 10000.0, 0.5, mode=mode, freq_factors=ft)
        y16 = ctx.from_numpy(x, DType.F16).rope(pt, n_dims, 10000.0, 0.5, mode=mode, freq_factors=ft)
        ctx.compute(y, y16)
        want = rope_ref(x, pos, n_dims, 10000.0, 0.5, mode, ff)
        np.testing.assert_allclose(y.numpy(), want, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(y16.numpy().astype(np.float64), want, rtol=1e-2, atol=1e-2)


def test_rope_on_permuted_heads(cpu):
    x = randn(3, 4, 16, seed=32)  # numpy (H=3, T=4, D): ggml (16, 4, 3) -> permute to (16, 3, 4)
    pos = np.arange(4, dtype=np.int32) * 3
    with cpu.new_context() as ctx:
        xt = ctx.from_numpy(x).permute(0, 2, 1, 3)
        y = xt.rope(ctx.from_numpy(pos), 16, 500.0)
        ctx.compute(y)
        np.testing.assert_allclose(y.numpy(), rope_ref(x.transpose(1, 0, 2), pos, 16, 500.0, 1.0, RopeType.NORMAL),
                                   rtol=1e-4, atol=1e-4)


# ---- attention ---------------------------------------------------------------------------------
def attention_ref(q, k, v, mask, scale):
    """numpy q (H, T, D), k (Hkv, KV, D), v (Hkv, KV, Dv), mask (>=T, KV) -> (T, H, Dv)."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    n_heads, n_tok = q.shape[:2]
    group = n_heads // k.shape[0]
    out = np.empty((n_tok, n_heads, v.shape[-1]))
    for h in range(n_heads):
        p = softmax(q[h] @ k[h // group].T * scale + mask[:n_tok])
        out[:, h] = p @ v[h // group]
    return out


def causal_mask(n_tok: int, n_kv: int, rows: int) -> np.ndarray:
    past = n_kv - n_tok
    mask = np.zeros((rows, n_kv), np.float32)
    for t in range(n_tok):
        mask[t, past + t + 1:] = -np.inf
    return mask


@pytest.mark.parametrize("flash", [False, True])
@pytest.mark.parametrize("kv_dtype", [DType.F32, DType.F16])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
def test_scaled_dot_product_attention(cpu, flash, kv_dtype, heads):
    n_heads, n_kv_heads = heads
    d, n_tok, n_kv = 32, 5, 9
    q = randn(n_heads, n_tok, d, seed=33)
    k = randn(n_kv_heads, n_kv, d, seed=34)
    v = randn(n_kv_heads, n_kv, d, seed=35)
    mask = causal_mask(n_tok, n_kv, rows=8)  # padded rows beyond n_tok are allowed
    scale = 1 / math.sqrt(d)
    with cpu.new_context() as ctx:
        qt = ctx.from_numpy(q)
        kt, vt = ctx.from_numpy(k, kv_dtype), ctx.from_numpy(v, kv_dtype)
        y = qt.scaled_dot_product_attention(kt, vt, ctx.from_numpy(mask), scale, flash=flash)
        ctx.compute(y)
        got = y.numpy()
    assert y.shape == (d, n_heads, n_tok)
    kr, vr = (a.astype(kv_dtype.numpy_dtype) for a in (k, v))
    tol = 1e-4 if kv_dtype == DType.F32 and not flash else 3e-3
    np.testing.assert_allclose(got, attention_ref(q, kr, vr, mask, scale), rtol=tol, atol=tol)


def test_attention_permuted_q_and_batch(cpu):
    d, n_tok, n_kv, h = 16, 3, 4, 2
    q = randn(n_tok, h, d, seed=36)  # as a model has it after the q projection: ggml (D, H, T)
    k, v = randn(h, n_kv, d, seed=37), randn(h, n_kv, d, seed=38)
    mask = causal_mask(n_tok, n_kv, rows=n_tok)
    outs = []
    for flash in (False, True):
        with cpu.new_context() as ctx:
            qt = ctx.from_numpy(q).permute(0, 2, 1, 3)  # (D, T, H)
            y = qt.scaled_dot_product_attention(ctx.from_numpy(k), ctx.from_numpy(v), ctx.from_numpy(mask), 0.25,
                                                flash=flash)
            ctx.compute(y)
            outs.append(y.numpy())
    want = attention_ref(q.transpose(1, 0, 2), k, v, mask, 0.25)
    for got in outs:
        np.testing.assert_allclose(got, want, rtol=3e-3, atol=3e-3)


def test_attention_4d_batch(cpu):
    d, n_tok, n_kv, h, b = 16, 3, 5, 2, 2
    q, k, v = randn(b, h, n_tok, d, seed=39), randn(b, h, n_kv, d, seed=40), randn(b, h, n_kv, d, seed=41)
    mask = causal_mask(n_tok, n_kv, rows=n_tok)
    for flash in (False, True):
        with cpu.new_context() as ctx:
            y = ctx.from_numpy(q).scaled_dot_product_attention(ctx.from_numpy(k), ctx.from_numpy(v),
                                                               ctx.from_numpy(mask), 0.3, flash=flash)
            ctx.compute(y)
            got = y.numpy()
        assert got.shape == (b, n_tok, h, d)
        for i in range(b):
            np.testing.assert_allclose(got[i], attention_ref(q[i], k[i], v[i], mask, 0.3), rtol=3e-3, atol=3e-3)


# ---- convolution and pooling -----------------------------------------------------------------
def conv_out(size, k, s, p, d):
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def conv2d_ref(x, w, s0, s1, p0, p1, d0, d1):
    """numpy x (N, C, H, W), w (OC, C, KH, KW) -> (N, OC, OH, OW) (cross-correlation)."""
    n, c, h, wd = x.shape
    oc, _, kh, kw = w.shape
    oh, ow = conv_out(h, kh, s1, p1, d1), conv_out(wd, kw, s0, p0, d0)
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (p1, p1), (p0, p0)))
    out = np.zeros((n, oc, oh, ow))
    for i in range(kh):
        for j in range(kw):
            patch = xp[:, :, i * d1: i * d1 + s1 * (oh - 1) + 1: s1, j * d0: j * d0 + s0 * (ow - 1) + 1: s0]
            out += np.einsum("nchw,oc->nohw", patch, w[:, :, i, j])
    return out


def im2col_ref(x, kh, kw, s0, s1, p0, p1, d0, d1):
    """numpy x (N, C, H, W) -> (N, OH, OW, C*KH*KW), ggml's patch order (c, kh, kw)."""
    n, c, h, wd = x.shape
    oh, ow = conv_out(h, kh, s1, p1, d1), conv_out(wd, kw, s0, p0, d0)
    xp = np.pad(x, ((0, 0), (0, 0), (p1, p1), (p0, p0)))
    out = np.zeros((n, oh, ow, c, kh, kw), np.float32)
    for i in range(kh):
        for j in range(kw):
            out[..., i, j] = xp[:, :, i * d1: i * d1 + s1 * (oh - 1) + 1: s1,
                                j * d0: j * d0 + s0 * (ow - 1) + 1: s0].transpose(0, 2, 3, 1)
    return out.reshape(n, oh, ow, c * kh * kw)


@pytest.mark.parametrize("params", [(1, 1, 0, 0, 1, 1), (2, 1, 1, 2, 1, 1), (1, 2, 1, 0, 2, 1)])
def test_conv_2d_and_im2col(cpu, params):
    s0, s1, p0, p1, d0, d1 = params
    x, w = randn(2, 3, 9, 10, seed=42), randn(4, 3, 3, 2, seed=43)  # ggml x (10, 9, 3, 2), w (2, 3, 3, 4)
    with cpu.new_context() as ctx:
        xt, wt = ctx.from_numpy(x), ctx.from_numpy(w)
        y = xt.conv_2d(wt, s0, s1, p0, p1, d0, d1)
        cols = xt.im2col(wt, s0, s1, p0, p1, d0, d1)
        y16 = xt.conv_2d(ctx.from_numpy(w, DType.F16), s0, s1, p0, p1, d0, d1)
        ctx.compute(y, cols, y16)
        got, got_cols, got16 = y.numpy(), cols.numpy(), y16.numpy()
    want = conv2d_ref(x, w, s0, s1, p0, p1, d0, d1)
    # ggml_conv_2d unfolds the input to F16 (im2col) before its matrix product, F32 kernel or not
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(got16, want, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(got_cols, im2col_ref(x, 3, 2, s0, s1, p0, p1, d0, d1), rtol=0, atol=0)


@pytest.mark.parametrize("kernel,stride,padding", [(2, 2, 0), (3, 1, 1), (3, 2, 0)])
def test_avg_pool_2d(cpu, kernel, stride, padding):
    x = randn(2, 3, 7, 8, seed=44)
    out = compute(cpu, lambda t: t.avg_pool_2d(kernel, stride, padding), x)
    xp = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    oh, ow = (7 + 2 * padding - kernel) // stride + 1, (8 + 2 * padding - kernel) // stride + 1
    want = np.zeros((2, 3, oh, ow))
    for i in range(oh):
        for j in range(ow):
            win = xp[:, :, i * stride: i * stride + kernel, j * stride: j * stride + kernel]
            want[:, :, i, j] = win.sum((-1, -2)) / (kernel * kernel)  # padding counts as zeros
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


# ---- quantized matrix products ----------------------------------------------------------------
QUANT_TYPES = ["Q4_0", "Q8_0", "Q4_K", "Q6_K"]


def quantize_rows(w: np.ndarray, qtype: str) -> np.ndarray:
    """Raw blocks (uint8, one row of bytes per weight row) of ``w`` in ``qtype``."""
    import gguf

    try:
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    except NotImplementedError:  # the gguf package has no K-quant quantizer: use ggml's
        return quantize(w, qtype)


@pytest.fixture(scope="module")
def quant_file(tmp_path_factory):
    import gguf

    path = tmp_path_factory.mktemp("quant") / "quant.gguf"
    writer = gguf.GGUFWriter(path, arch="test")
    weights = {}
    for i, qtype in enumerate(QUANT_TYPES):
        w = randn(64, 256, seed=50 + i)  # 64 rows (a multiple of 8: repackable), K = 256
        raw = quantize_rows(w, qtype)
        writer.add_tensor(f"w.{qtype}", raw, raw_dtype=gguf.GGMLQuantizationType[qtype])
        weights[qtype] = w
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, weights


@pytest.mark.parametrize("qtype", QUANT_TYPES)
@pytest.mark.parametrize("repack", [False, True])
def test_quantized_mulmat(quant_file, qtype, repack):
    """ggml quantizes the activations to Q8_0 (Q8_K for K-quants) inside these kernels, so the
    product differs from (dequantized weight) @ x by the activation rounding: ~0.4% of each value
    relative, which accumulates randomly over K=256. We bound the error by 2e-2 of max|reference|."""
    path, weights = quant_file
    x = randn(32, 256, seed=60)
    with Backend.load(path, BackendParams(n_threads=2, repack=False)) as plain:
        deq = plain.get(f"w.{qtype}").numpy()
    quant_err = np.abs(deq - weights[qtype]).max() / np.abs(weights[qtype]).max()
    assert 0 < quant_err < 0.2  # really quantized, and close to the original
    with Backend.load(path, BackendParams(n_threads=2, repack=repack)) as backend:
        w = backend.get(f"w.{qtype}")
        assert w.dtype == DType[qtype] and w.shape == (256, 64)
        if qtype == "Q4_0":  # the x86 CPU backend repacks 2-d Q4_0 weights with rows % 8 == 0
            assert (w.name in backend._repacked) == repack
        for n in (1, 7, 32):
            with backend.new_context() as ctx:
                y = w.mulmat(ctx.from_numpy(x[:n]))
                ctx.compute(y)
                got = y.numpy()
            ref = x[:n].astype(np.float64) @ deq.T.astype(np.float64)
            assert got.shape == (n, 64)
            assert np.abs(got - ref).max() <= 2e-2 * np.abs(ref).max(), (qtype, repack, n)


# ---- validation -------------------------------------------------------------------------------
def raises(exc, *words):
    """pytest.raises matching every word (op name, ...) in the message."""
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{w})" for w in words))


@pytest.fixture
def ctx(cpu):
    with cpu.new_context() as c:
        yield c


def test_validation_shapes(ctx):
    f = lambda *s: ctx.from_numpy(np.zeros(tuple(reversed(s)), np.float32))  # noqa: E731
    with raises(ValueError, "mulmat", r"\(8, 3\)", r"\(9, 2\)"):
        f(8, 3).mulmat(f(9, 2))
    with raises(ValueError, "mulmat"):
        f(8, 3, 2).mulmat(f(8, 2, 3))
    with raises(ValueError, "mulmat", "transposed"):
        f(3, 8).transpose().mulmat(f(8, 2))
    with raises(ValueError, "add", "tile"):
        f(8, 3) + f(3, 3)
    with raises(ValueError, "mul", "tile"):
        f(4, 1) * f(4, 2)
    with raises(ValueError, "reshape", "contiguous"):
        f(8, 3).transpose().reshape(24)
    with raises(ValueError, "reshape", "elements"):
        f(8, 3).reshape(5, 5)
    with raises(ValueError, "view"):
        f(8, 3).view(4, (8, 3))  # past the end
    with raises(ValueError, "view"):
        f(8, 3).view(0, (4, 2), [96])  # strided past the end (ggml would not notice)
    with raises(ValueError, "view"):
        f(8, 3).view(0, (8, 4), [0])  # overlapping rows: ggml's own size bound
    with raises(ValueError, "view"):
        f(8, 3).view(0, (4, 2, 2), [16])  # wrong number of strides
    with raises(ValueError, "permute"):
        f(8, 3).permute(0, 0, 1, 2)
    with raises(ValueError, "permute"):
        f(8, 3).permute(0, 1, 2, 3, 4)
    with raises(ValueError, "concat"):
        f(8, 3).concat(f(7, 3), 1)
    with raises(ValueError, "concat"):
        f(8, 3).concat(f(8, 3), 4)
    with raises(ValueError, "repeat"):
        f(8, 3).repeat(8, 4)
    with raises(ValueError, "softmax", "mask"):
        f(8, 3).softmax(f(7, 3))
    with raises(ValueError, "softmax", "mask"):
        f(8, 3).softmax(f(8, 2))
    with raises(ValueError, "softmax", "contiguous"):
        f(3, 8).transpose().softmax()
    with raises(ValueError, "top_k"):
        f(8, 3).top_k(9)
    with raises(ValueError, "clamp"):
        f(8).clamp(1, 0)
    with raises(ValueError, "conv_2d"):
        f(4, 4, 3).conv_2d(f(5, 5, 3, 2))
    with raises(ValueError, "conv_2d", "channels"):
        f(8, 8, 3).conv_2d(f(3, 3, 2, 2))
    with raises(ValueError, "im2col"):
        f(8, 8, 3).im2col(f(3, 3, 2, 2), 1, 1, 0, 0, 1, 1)
    with raises(ValueError, "avg_pool_2d"):
        f(4, 4).avg_pool_2d(5, 1)
    with raises(ValueError, "silu", "shape"):
        f(8, 3).silu(f(8, 2))


def test_validation_types(ctx):
    x = ctx.from_numpy(np.zeros((3, 8), np.float32))
    i = ctx.from_numpy(np.zeros((3, 8), np.int32))
    h = ctx.from_numpy(np.zeros((3, 8), np.float32), DType.F16)
    with raises(TypeError, "add"):
        i + i
    with raises(TypeError, "add"):
        x + h  # an F16 right operand only goes with an F16 left one
    with raises(TypeError, "mulmat"):
        i.mulmat(x)
    with raises(TypeError, "mulmat"):
        x.mulmat(h)
    with raises(TypeError, "exp"):
        i.exp()
    with raises(TypeError, "scale"):
        h.scale(2.0)
    with raises(TypeError, "mul"):
        h * 2.0
    with raises(TypeError, "sum_rows"):
        h.sum_rows()
    with raises(TypeError, "rms_norm"):
        h.rms_norm(1e-5)
    with raises(TypeError, "cast", "I32", "F16"):
        i.cast(DType.F16)
    with raises(TypeError, "cast", "IQ2_XXS"):
        ctx.from_numpy(np.zeros((1, 256), np.float32)).cast(DType.IQ2_XXS)
    with raises(TypeError, "copy"):
        h.copy(ctx.empty(DType.I32, 8, 3))
    with raises(TypeError, "rows"):
        x.rows(x)
    with raises(TypeError, "concat"):
        x.concat(h, 0)
    with raises(TypeError, "softmax"):
        x.softmax(i)
    with raises(TypeError, "rope"):
        x.reshape(8, 3, 1).rope(x, 8, 1e4)
    with raises(TypeError, "unsupported"):
        x + "a"


def test_validation_layout(ctx):
    t = ctx.from_numpy(np.zeros((8, 4), np.float32)).transpose()  # (8, 4) with strided rows
    for op in ("exp", "sqrt", "neg", "silu", "sum_rows"):
        with raises(ValueError, op, "contiguous"):
            getattr(t, op)()
    with raises(ValueError, "add", "contiguous"):
        t + t
    with raises(ValueError, "scale", "contiguous"):
        t.scale(2.0)
    with raises(ValueError, "mulmat", "contiguous"):
        ctx.from_numpy(np.zeros((3, 8), np.float32)).mulmat(t)
    with raises(ValueError, "avg_pool_2d", "contiguous"):
        t.avg_pool_2d(2, 2)
    with raises(ValueError, "silu"):
        p = ctx.from_numpy(np.zeros((2, 3, 8), np.float32)).permute(0, 2, 1)
        p.silu(p)


def test_validation_rows_and_set_rows(cpu):
    with cpu.new_context() as ctx:
        table = ctx.from_numpy(np.zeros((5, 4), np.float32))
        with raises(ValueError, "rows"):
            table.rows(ctx.from_numpy(np.zeros((2, 2), np.int32)))
        y = table.rows(ctx.from_numpy(np.array([0, 5], np.int32)))
        with raises(ValueError, "rows", "out of range"):
            ctx.compute(y)
    with cpu.new_context() as ctx:  # negative, and through a reshape of the index input
        y = ctx.from_numpy(np.zeros((5, 4), np.float32)).rows(ctx.from_numpy(np.array([[-1, 2]], np.int32)).reshape(2))
        with raises(ValueError, "rows", "out of range"):
            ctx.compute(y)
    with cpu.new_context() as ctx:  # indices made with empty() and never set
        y = ctx.from_numpy(np.zeros((5, 4), np.float32)).rows(ctx.empty(DType.I32, 2))
        with raises(ValueError, "rows", "never"):
            ctx.compute(y)
    cache = cpu.alloc_persistent(DType.F16, (4, 6))
    with cpu.new_context() as ctx:
        src = ctx.from_numpy(np.zeros((2, 4), np.float32))
        with raises(ValueError, "set_rows"):
            cache.set_rows(ctx.from_numpy(np.zeros((2, 5), np.float32)), ctx.from_numpy(np.array([0, 1], np.int32)))
        with raises(ValueError, "set_rows"):
            cache.set_rows(src, ctx.from_numpy(np.array([0, 1, 2], np.int32)))
        with raises(TypeError, "set_rows"):
            cache.set_rows(src, ctx.from_numpy(np.array([0.0, 1.0], np.float32)))
        y = cache.set_rows(src, ctx.from_numpy(np.array([0, 6], np.int64)))
        with raises(ValueError, "set_rows", "out of range"):
            ctx.compute(y)
    with cpu.new_context() as ctx:
        w = ctx.from_numpy(np.zeros((3, 2, 8), np.float32))
        ids = ctx.from_numpy(np.array([[0, 3]], np.int32))
        y = w.mulmat_id(ctx.from_numpy(np.zeros((1, 1, 8), np.float32)), ids)
        with raises(ValueError, "mulmat_id", "out of range"):
            ctx.compute(y)


def test_validation_rope_and_attention(ctx):
    x = ctx.from_numpy(np.zeros((3, 2, 8), np.float32))  # (8, 2, 3): head_dim 8, 2 heads, 3 tokens
    pos = ctx.from_numpy(np.arange(3, dtype=np.int32))
    for bad in (0, 7, 10):
        with raises(ValueError, "rope", "n_dims"):
            x.rope(pos, bad, 1e4)
    with raises(ValueError, "rope", "positions"):
        x.rope(ctx.from_numpy(np.arange(2, dtype=np.int32)), 8, 1e4)
    with raises(TypeError, "rope", "positions"):
        x.rope(ctx.from_numpy(np.arange(3, dtype=np.float32)), 8, 1e4)
    with raises(ValueError, "rope", "freq_factors"):
        x.rope(pos, 8, 1e4, freq_factors=ctx.from_numpy(np.ones(3, np.float32)))
    with raises(ValueError, "rope", "mode"):
        x.rope(pos, 8, 1e4, mode=8)
    q = ctx.from_numpy(np.zeros((4, 3, 8), np.float32))  # (8, 3 tokens, 4 heads)
    k = ctx.from_numpy(np.zeros((2, 5, 8), np.float32))  # (8, 5 kv, 2 kv heads)
    v = ctx.from_numpy(np.zeros((2, 5, 8), np.float32))
    sdpa = "scaled_dot_product_attention"
    with raises(ValueError, sdpa):
        q.scaled_dot_product_attention(ctx.from_numpy(np.zeros((3, 5, 8), np.float32)), v, None, 1.0)
    with raises(ValueError, sdpa):
        q.scaled_dot_product_attention(k, ctx.from_numpy(np.zeros((2, 4, 8), np.float32)), None, 1.0)
    with raises(ValueError, sdpa):
        q.scaled_dot_product_attention(ctx.from_numpy(np.zeros((2, 5, 16), np.float32)), v, None, 1.0)
    for bad_mask in (np.zeros((3, 4), np.float32), np.zeros((2, 5), np.float32)):
        for flash in (False, True):
            with raises(ValueError, sdpa, "mask"):
                q.scaled_dot_product_attention(k, v, ctx.from_numpy(bad_mask), 1.0, flash=flash)


def test_validation_contexts(cpu):
    weight = cpu.alloc_persistent(DType.F32, (8, 4))
    other = cpu.alloc_persistent(DType.F32, (8, 2))
    with raises(ValueError, "mulmat", "ctx="):
        weight.mulmat(other)
    with raises(ValueError, "exp", "ctx="):
        weight.exp()
    with cpu.new_context() as ctx:
        y = weight.mulmat(other, ctx=ctx)
        ctx.compute(y)
        assert y.shape == (4, 2)
    ctx = cpu.new_context()
    x = ctx.from_numpy(np.ones((2, 8), np.float32))
    ctx.close()
    with raises(ValueError, "exp", "closed"):
        x.exp()
    with raises(ValueError, "mulmat", "closed"):
        weight.mulmat(x)
    with raises(ValueError, "numpy", "closed"):
        x.numpy()
    with pytest.raises(ValueError, match="closed"):
        ctx.compute(x)
    assert x.shape == (8, 2) and "F32" in repr(x)  # still safe to look at
    with cpu.new_context() as a, cpu.new_context() as b:
        xa, xb = a.from_numpy(np.ones(4, np.float32)), b.from_numpy(np.ones(4, np.float32))
        with raises(ValueError, "add", "different contexts"):
            xa + xb
        with raises(ValueError, "forward"):
            a.forward(xb)


def test_validation_graph_full(cpu):
    with cpu.new_context(max_nodes=10) as ctx:
        x = ctx.from_numpy(np.ones(4, np.float32))
        with raises(ValueError, "add", "graph is full"):
            for _ in range(20):
                x = x + x


def test_validation_numpy_timing(cpu):
    with cpu.new_context() as ctx:
        x = ctx.from_numpy(np.ones(4, np.float32))
        y = x * 2.0
        with raises(ValueError, "numpy", "not been computed"):
            y.numpy()
        with raises(ValueError, "numpy", "not been computed"):
            x.numpy()
        ctx.compute(y)
        np.testing.assert_array_equal(y.numpy(), [2, 2, 2, 2])
        with cpu.new_context() as other:
            z = other.from_numpy(np.ones(2, np.float32)) + 1.0
            other.compute(z)
        with raises(ValueError, "numpy", "another graph"):
            y.numpy()
        ctx.compute(y)  # computing again makes it readable again
        np.testing.assert_array_equal(y.numpy(), [2, 2, 2, 2])


def test_closed_backend_tensors():
    backend = Backend.cpu(n_threads=1)
    cache = backend.alloc_persistent(DType.F32, (4, 2))
    ctx = backend.new_context()
    backend.close()
    with raises(ValueError, "numpy", "closed"):
        cache.numpy()
    with raises(ValueError, "set", "closed"):
        cache.set(np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="closed"):
        backend.new_context()
    other = Backend.cpu(n_threads=1)
    with other.new_context() as octx:
        with raises(ValueError, "mulmat", "closed backend"):
            cache.mulmat(octx.from_numpy(np.ones((1, 4), np.float32)))
    other.close()
    assert cache.shape == (4, 2)
    ctx.close()


def test_validation_kernel_constraints(ctx):
    """Conditions ggml's CPU kernels assert at compute time (each was an abort before it was checked)."""
    f = lambda *s: ctx.from_numpy(np.zeros(tuple(reversed(s)), np.float32))  # noqa: E731
    with raises(ValueError, "view", "multiple"):
        f(8, 3).view(2, (4,))  # misaligned offset
    with raises(ValueError, "view", "multiple"):
        f(8, 3).view(0, (4, 2), [6])  # misaligned stride
    with raises(TypeError, "rows"):
        ctx.from_numpy(np.zeros((3, 4), np.int64)).rows(ctx.from_numpy(np.zeros(1, np.int32)))
    with raises(ValueError, "conv_2d", "contiguous"):
        f(8, 8, 3).conv_2d(f(3, 4, 3, 2).permute(1, 0, 2, 3))
    with raises(TypeError, "conv_2d"):
        f(40, 8, 3).conv_2d(f(32, 1, 3, 2).cast(DType.Q8_0))
    with raises(TypeError, "im2col"):
        f(8, 8, 3).cast(DType.BF16).im2col(f(3, 3, 3, 2), 1, 1, 0, 0, 1, 1)
    with raises(ValueError, "group_norm", "contiguous"):
        f(3, 8, 4).transpose().group_norm(2, 1e-5)
    with raises(TypeError, "mulmat_id"):
        f(8, 3, 2).mulmat_id(f(8, 1, 2).cast(DType.F16), ctx.from_numpy(np.zeros((2, 1), np.int32)))
    with raises(ValueError, "scale", "contiguous"):
        f(8, 4, 3).view(0, (8, 2, 3), [64, 128]).scale(2.0)  # packed rows, padded dims
    with raises(ValueError, "contiguous", "block"):
        f(32, 4).cast(DType.Q8_0).transpose().contiguous()


def test_permute_keeps_rank(ctx):
    f = lambda *s: ctx.from_numpy(np.zeros(tuple(reversed(s)), np.float32))  # noqa: E731
    assert f(8, 3, 2).permute(0, 2, 1, 3).shape == (8, 2, 3)
    assert f(8, 3).permute(1, 0).shape == (3, 8)
    assert f(8, 3).permute(2, 0, 1, 3).shape == (3, 1, 8)
    assert f(8, 3, 2, 5).permute(3, 2, 1, 0).shape == (5, 2, 3, 8)
    assert f(8).transpose().shape == (1, 8)


def test_view_1d_and_default_strides(cpu):
    a = randn(3, 8, seed=45)
    with cpu.new_context() as ctx:
        x = ctx.from_numpy(a)
        v1 = x.view(4 * 4, (6,))
        v3 = x.view(8 * 4, (8, 1, 2))  # default strides: packed
        ctx.compute(v1.contiguous(), v3.contiguous())
        np.testing.assert_array_equal(v1.numpy(), a.reshape(-1)[4:10])
        np.testing.assert_array_equal(v3.numpy(), a[1:].reshape(2, 1, 8))


def test_set_quantized_persistent(cpu):
    w = randn(4, 64, seed=46)
    raw = quantize(w, DType.Q8_0)
    t = cpu.alloc_persistent(DType.Q8_0, (64, 4))
    t.set(raw)
    np.testing.assert_allclose(t.numpy(), w, atol=np.abs(w).max() / 100)
    with raises(TypeError, "set", "raw uint8"):
        t.set(raw[:, :-1])
    with raises(TypeError, "set", "raw uint8"):
        t.set(w)


def test_cached_shapes_match_ggml(ctx):
    """Ops that know their result's shape pass it to the Tensor instead of reading it back from C:
    it must be exactly what ggml computed."""
    x = ctx.from_numpy(randn(2, 3, 4, 8, seed=47))
    w = ctx.from_numpy(randn(5, 8, seed=48))
    h = ctx.from_numpy(randn(3, 4, 8, seed=49))
    pos = ctx.from_numpy(np.arange(3, dtype=np.int32))
    outs = [x + 1.0, x * x, x.silu(), x.exp(), x.sum_rows(), x.mean(), x.scale(2.0), x.clamp(0, 1), x.rms_norm(1e-5),
            x.softmax(), w.mulmat(x), w.mulmat(h), x.reshape(32, 6), x.reshape(192), x.view(32, (8, 2), [64]),
            x.view(0, (8, 3, 2), [32, 128]), x.permute(2, 0, 3, 1), x.permute(1, 0), x.transpose(), x.contiguous(),
            x.transpose().contiguous(), x.cast(DType.F16), x.copy(ctx.empty(DType.F16, 8, 4, 3, 2)),
            x.silu(x), h.rope(pos, 8, 1e4), x.concat(x, 2), x.pad(1, 2)]
    for t in outs:
        assert t._ne == tuple(t._p.ne), t
        assert t.shape == tuple(t._p.ne)[: t.ndim]


# ---- gpt-oss ops: clamped SwiGLU, per-expert biases, attention sinks ----------------------------------
def test_swiglu_oai(cpu):
    g, u = 4 * randn(3, 64, seed=60), 4 * randn(3, 64, seed=61)  # past the limit both ways
    out = compute(cpu, lambda a, b: a.swiglu_oai(b, 1.702, 7.0), g, u)
    gc, uc = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
    np.testing.assert_allclose(out, gc / (1 + np.exp(-1.702 * gc)) * (uc + 1), rtol=1e-5, atol=1e-5)
    with cpu.new_context() as ctx:
        a = ctx.from_numpy(g)
        with raises(ValueError, "swiglu_oai", "same shape"):
            a.swiglu_oai(ctx.from_numpy(u[:, :32].copy()), 1.702, 7.0)
        with raises(TypeError, "swiglu_oai"):
            a.swiglu_oai(ctx.from_numpy(u, DType.F16), 1.702, 7.0)


def test_add_id(cpu):
    m, n_exp, n_used, n_tok = 8, 4, 2, 5
    x = randn(n_tok, n_used, m, seed=62)  # ggml (M, U, N)
    bias = randn(n_exp, m, seed=63)  # ggml (M, E)
    ids = rng(64).integers(0, n_exp, (n_tok, n_used)).astype(np.int32)  # ggml (U, N)
    out = compute(cpu, lambda a, b, i: a.add_id(b, i), x, bias, ids)
    np.testing.assert_allclose(out, x + bias[ids], rtol=1e-6, atol=1e-6)
    with cpu.new_context() as ctx:
        a, b = ctx.from_numpy(x), ctx.from_numpy(bias)
        with raises(ValueError, "add_id"):
            a.add_id(b, ctx.from_numpy(ids[:, :1].copy()))
        with raises(TypeError, "add_id"):
            a.add_id(b, ctx.from_numpy(ids.astype(np.float32)))
        y = a.add_id(b, ctx.from_numpy(np.full((n_tok, n_used), n_exp, np.int32)))
        with raises(ValueError, "add_id", "out of range"):
            ctx.compute(y)


@pytest.mark.parametrize("flash", [False, True])
def test_attention_sinks(cpu, flash):
    n_heads, n_kv_heads, d, n_tok, n_kv = 4, 2, 32, 5, 9
    q = randn(n_heads, n_tok, d, seed=65)
    k, v = randn(n_kv_heads, n_kv, d, seed=66), randn(n_kv_heads, n_kv, d, seed=67)
    sinks = randn(n_heads, seed=68) + 1.0
    mask = causal_mask(n_tok, n_kv, rows=8)
    scale = 1 / math.sqrt(d)
    with cpu.new_context() as ctx:
        y = ctx.from_numpy(q).scaled_dot_product_attention(ctx.from_numpy(k), ctx.from_numpy(v), ctx.from_numpy(mask),
                                                          scale, flash=flash, sinks=ctx.from_numpy(sinks))
        ctx.compute(y)
        got = y.numpy()
    want = np.empty((n_tok, n_heads, d))
    for h in range(n_heads):  # the sink is one more logit per row, with no value
        scores = q[h].astype(np.float64) @ k[h // 2].T * scale + mask[:n_tok]
        top = np.maximum(scores.max(axis=-1, keepdims=True), sinks[h])
        e = np.exp(scores - top)
        want[:, h] = e @ v[h // 2] / (e.sum(axis=-1, keepdims=True) + np.exp(sinks[h] - top))
    tol = 3e-3 if flash else 1e-4
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    with cpu.new_context() as ctx:
        with raises(ValueError, "scaled_dot_product_attention", "sinks"):
            ctx.from_numpy(q).scaled_dot_product_attention(ctx.from_numpy(k), ctx.from_numpy(v), None, scale,
                                                           sinks=ctx.from_numpy(sinks[:2].copy()))
