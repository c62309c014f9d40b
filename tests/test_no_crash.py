"""Bad calls through the public API raise Python exceptions; none may abort the interpreter.

ggml answers a failed assertion with abort() (and some bad inputs with a segfault), so these run in
a child process: the test passes when the child exits 0 after printing its "done" marker. The child
runs the abort conditions listed in GGML-NOTES.md ("Aborts") one by one, then several hundred
seeded random op/shape/dtype/layout combinations, each computed when it builds. ValueError and
TypeError are the expected refusals; any other exception is reported as a failure too.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(r'''
    import collections, os, sys, traceback
    import numpy as np
    import gguf
    from pyggml import Backend, BackendParams, DType, GGUFError
    from pyggml.tensor import RopeType

    import resource
    # extreme shapes can ask for huge buffers: under this limit they fail (MemoryError) instead of being
    # overcommitted and filled on a shared machine
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    backend = Backend.cpu(n_threads=1)
    stats = collections.Counter()
    unexpected = []

    def attempt(label, fn):
        """Run fn(ctx) in a fresh context; compute and read whatever it returns."""
        try:
            with backend.new_context(max_nodes=256) as ctx:
                out = fn(ctx)
                outs = out if isinstance(out, tuple) else (out,)
                outs = [o for o in outs if o is not None]
                if outs:
                    ctx.compute(*outs)
                    for o in outs:
                        o.numpy()
            stats["ok"] += 1
        except (ValueError, TypeError) as e:
            stats["refused"] += 1
        except MemoryError:  # a clean failure to allocate what a valid but huge graph asks for
            stats["memory"] += 1
        except Exception as e:  # anything else is a bug in the validation, but not a crash
            unexpected.append(f"{label}: {type(e).__name__}: {e}")

    def arr(*shape, dtype=np.float32, seed=0):
        return np.random.default_rng(seed).standard_normal(tuple(reversed(shape))).astype(dtype)

    def T(ctx, *shape, dtype=None):
        a = arr(*shape)
        if dtype in (DType.I32, "i32"):
            return ctx.from_numpy(a.astype(np.int32))
        return ctx.from_numpy(a, dtype)

    def I(ctx, *values, dtype=np.int32):
        return ctx.from_numpy(np.array(values, dtype=dtype))

    # ---- the abort conditions of GGML-NOTES.md, one by one --------------------------------------
    specific = {
        "mulmat ne0": lambda c: T(c, 8, 3).mulmat(T(c, 9, 2)),
        "mulmat ne2": lambda c: T(c, 8, 3, 2).mulmat(T(c, 8, 2, 3)),
        "mulmat ne3": lambda c: T(c, 8, 3, 1, 2).mulmat(T(c, 8, 2, 1, 3)),
        "mulmat transposed a": lambda c: T(c, 3, 8).transpose().mulmat(T(c, 3, 2)),
        "mulmat transposed b": lambda c: T(c, 8, 3).mulmat(T(c, 2, 8).transpose()),
        "mulmat i32": lambda c: T(c, 8, 3, dtype="i32").mulmat(T(c, 8, 2)),
        "mulmat f32 x f16": lambda c: T(c, 8, 3).mulmat(T(c, 8, 2, dtype=DType.F16)),
        "mulmat q x f16": lambda c: T(c, 32, 3).cast("q8_0").mulmat(T(c, 32, 2, dtype=DType.F16)),
        "add no tile": lambda c: T(c, 8, 3) + T(c, 3, 3),
        "add i32": lambda c: T(c, 8, dtype="i32") + T(c, 8, dtype="i32"),
        "add f32+f16": lambda c: T(c, 8) + T(c, 8, dtype=DType.F16),
        "add transposed": lambda c: T(c, 3, 8).transpose() + T(c, 8, 3),
        "div no tile": lambda c: T(c, 4, 4) / T(c, 3),
        "reshape non-contiguous": lambda c: T(c, 3, 8).transpose().reshape(24),
        "reshape count": lambda c: T(c, 8, 3).reshape(25),
        "permute repeated": lambda c: T(c, 8, 3).permute(1, 1, 0, 2),
        "permute range": lambda c: T(c, 8, 3).permute(0, 4, 1, 2),
        "view past end": lambda c: T(c, 8, 3).view(8, (8, 3)),
        "view strided past end": lambda c: T(c, 8, 3).view(0, (8, 2), [96]),
        "view overlapping": lambda c: T(c, 8, 3).view(0, (8, 6), [0]),
        "rows idx f32": lambda c: T(c, 8, 3).rows(T(c, 2)),
        "rows dims": lambda c: T(c, 8, 3, 2).rows(I(c, 0, 1)),
        "rows range": lambda c: T(c, 8, 3).rows(I(c, 0, 3)),
        "rows negative": lambda c: T(c, 8, 3).rows(I(c, -1, 0)),
        "rows reshaped range": lambda c: T(c, 8, 3).rows(I(c, 5, 0).reshape(2)),
        "rows never set": lambda c: T(c, 8, 3).rows(c.empty(DType.I32, 2)),
        "set_rows ne0": lambda c: backend.alloc_persistent(DType.F16, (8, 4)).set_rows(T(c, 7, 2), I(c, 0, 1)),
        "set_rows count": lambda c: backend.alloc_persistent(DType.F16, (8, 4)).set_rows(T(c, 8, 2), I(c, 0)),
        "set_rows src i32": lambda c: backend.alloc_persistent(DType.F32, (8, 4)).set_rows(T(c, 8, 2, dtype="i32"),
                                                                                       I(c, 0, 1)),
        "set_rows range": lambda c: backend.alloc_persistent(DType.F32, (8, 4)).set_rows(T(c, 8, 2), I(c, 0, 4)),
        "set_rows i64 range": lambda c: backend.alloc_persistent(DType.F32, (8, 4)).set_rows(
            T(c, 8, 2), I(c, 9, 0, dtype=np.int64)),
        "set_rows into f64": lambda c: backend.alloc_persistent(DType.F64, (8, 4)).set_rows(T(c, 8, 2), I(c, 0, 1)),
        "set_rows into iq2": lambda c: backend.alloc_persistent(DType.IQ2_XXS, (256, 4)).set_rows(T(c, 256, 2),
                                                                                              I(c, 0, 1)),
        "rope positions f32": lambda c: T(c, 8, 2, 3).rope(T(c, 3), 8, 1e4),
        "rope positions len": lambda c: T(c, 8, 2, 3).rope(I(c, 0, 1), 8, 1e4),
        "rope n_dims odd": lambda c: T(c, 8, 2, 3).rope(I(c, 0, 1, 2), 7, 1e4),
        "rope n_dims big": lambda c: T(c, 8, 2, 3).rope(I(c, 0, 1, 2), 10, 1e4),
        "rope freq factors short": lambda c: T(c, 8, 2, 3).rope(I(c, 0, 1, 2), 8, 1e4, freq_factors=T(c, 3)),
        "rope transposed": lambda c: T(c, 2, 8, 3).transpose().rope(I(c, 0, 1, 2), 2, 1e4),
        "rope mode": lambda c: T(c, 8, 2, 3).rope(I(c, 0, 1, 2), 8, 1e4, mode=24),
        "softmax non-contiguous": lambda c: T(c, 3, 8).transpose().softmax(),
        "softmax mask i32": lambda c: T(c, 8, 3).softmax(T(c, 8, 3, dtype="i32")),
        "softmax mask ne0": lambda c: T(c, 8, 3).softmax(T(c, 7, 3)),
        "softmax mask rows": lambda c: T(c, 8, 3).softmax(T(c, 8, 2)),
        "softmax mask non-contiguous": lambda c: T(c, 8, 3).softmax(T(c, 3, 8).transpose()),
        "flash head dim": lambda c: T(c, 16, 3, 4).scaled_dot_product_attention(T(c, 8, 5, 2), T(c, 8, 5, 2), None,
                                                                               1.0, flash=True),
        "flash q.ne3": lambda c: T(c, 8, 3, 4, 2).scaled_dot_product_attention(T(c, 8, 5, 2), T(c, 8, 5, 2), None,
                                                                               1.0, flash=True),
        "flash mask rows": lambda c: T(c, 8, 3, 4).scaled_dot_product_attention(T(c, 8, 5, 2), T(c, 8, 5, 2),
                                                                                T(c, 5, 2), 1.0, flash=True),
        "flash mask kv": lambda c: T(c, 8, 3, 4).scaled_dot_product_attention(T(c, 8, 5, 2), T(c, 8, 5, 2),
                                                                              T(c, 4, 3), 1.0, flash=True),
        "attention heads": lambda c: T(c, 8, 3, 3).scaled_dot_product_attention(T(c, 8, 5, 2), T(c, 8, 5, 2), None,
                                                                                 1.0),
        "attention kv len": lambda c: T(c, 8, 3, 4).scaled_dot_product_attention(T(c, 8, 5, 2), T(c, 8, 4, 2), None,
                                                                                 1.0),
        "concat dim": lambda c: T(c, 8, 3).concat(T(c, 8, 3), 4),
        "concat type": lambda c: T(c, 8, 3).concat(T(c, 8, 3, dtype=DType.F16), 0),
        "concat dims": lambda c: T(c, 8, 3).concat(T(c, 7, 2), 0),
        "copy counts": lambda c: T(c, 8, 3).copy(c.empty(DType.F32, 8, 2)),
        "copy i32 to f16": lambda c: T(c, 8, dtype="i32").copy(c.empty(DType.F16, 8)),
        "copy q to f16": lambda c: T(c, 32).cast("q8_0").copy(c.empty(DType.F16, 32)),
        "copy strided into q": lambda c: T(c, 8, 32).transpose().copy(c.empty(DType.Q8_0, 32, 8)),
        "cast f16 to i32": lambda c: T(c, 8, dtype=DType.F16).cast(DType.I32),
        "cast to iq2": lambda c: T(c, 256).cast(DType.IQ2_XXS),
        "cast to f64": lambda c: T(c, 8).cast(DType.F64),
        "cast partial block": lambda c: T(c, 16).cast(DType.Q4_0),
        "quantized input partial block": lambda c: c.empty(DType.Q4_0, 16, 2),
        "quantized view partial block": lambda c: T(c, 64, 2).cast("q4_0").view(0, (16, 2)),
        "quantized transposed copy": lambda c: T(c, 32, 4).cast("q8_0").transpose().contiguous(),
        "persistent partial block": lambda c: backend.alloc_persistent(DType.Q4_0, (16, 2)),
        "graph full": lambda c: [c.from_numpy(np.ones(4, np.float32)) for _ in range(300)][-1],
        "scale f16": lambda c: T(c, 8, dtype=DType.F16).scale(2.0),
        "scale permuted": lambda c: T(c, 8, 2, 3).permute(0, 2, 1, 3).scale(2.0),
        "clamp bf16": lambda c: T(c, 8, dtype=DType.BF16).clamp(0, 1),
        "clamp permuted": lambda c: T(c, 32, 8, 1, 32, dtype=DType.F16).permute(0, 3, 1, 2).clamp(-1, 1),
        "argsort permuted": lambda c: T(c, 32, 64, 1, 32).permute(0, 3, 1, 2).argsort(),
        "top_k permuted": lambda c: T(c, 32, 64, 1, 32).permute(0, 3, 1, 2).top_k(4),
        "argmax transposed": lambda c: T(c, 64, 32).transpose().argmax(),
        "sum_rows f16": lambda c: T(c, 8, dtype=DType.F16).sum_rows(),
        "mean transposed": lambda c: T(c, 3, 8).transpose().mean(),
        "unary transposed": lambda c: T(c, 3, 8).transpose().silu(),
        "sqrt transposed": lambda c: T(c, 3, 8).transpose().sqrt(),
        "glu permuted": lambda c: (lambda p: p.silu(p))(T(c, 8, 2, 3).permute(0, 2, 1, 3)),
        "repeat transposed": lambda c: T(c, 3, 8).transpose().repeat(8, 6),
        "pool permuted": lambda c: T(c, 8, 2, 8).permute(0, 2, 1, 3).avg_pool_2d(2, 2),
        "pool bf16": lambda c: T(c, 8, 8, dtype=DType.BF16).avg_pool_2d(2, 2),
        "pool too big": lambda c: T(c, 4, 4).avg_pool_2d(9, 1),
        "im2col 1d channels": lambda c: T(c, 8, 8, 3).im2col(T(c, 3, 3, 3, 4), 1, 1, 1, 1, 1, 1, is_2d=False),
        "im2col too big": lambda c: T(c, 4, 4, 3).im2col(T(c, 9, 9, 3, 2), 1, 1, 0, 0, 1, 1),
        "conv channels": lambda c: T(c, 8, 8, 3).conv_2d(T(c, 3, 3, 2, 4)),
        "mulmat_id range": lambda c: T(c, 8, 3, 2).mulmat_id(T(c, 8, 1, 2), I(c, 2, 0).reshape(1, 2)),
        "mulmat_id f16 x": lambda c: T(c, 8, 3, 2).mulmat_id(T(c, 8, 1, 2, dtype=DType.F16), I(c, 1, 0).reshape(1, 2)),
        "top_k k": lambda c: T(c, 8, 3).top_k(9),
        "argmax 3d": lambda c: T(c, 8, 3, 2).argmax(),
        # issue 13: index tensors computed in the graph, parameter extremes, sizes, intermediate types
        "rows argmax range": lambda c: T(c, 4, 3).rows(T(c, 100, 2).argmax()),
        "rows argsort range": lambda c: T(c, 4, 3).rows(T(c, 10).argsort()),
        "rows top_k view": lambda c: T(c, 4, 3).rows(T(c, 10, 2).top_k(4).view(0, (2,))),
        "rows cast index": lambda c: T(c, 4, 3).rows(T(c, 2).scale(1e6).cast(DType.I32)),
        "rows persistent index": lambda c: T(c, 4, 3).rows(backend.alloc_persistent(DType.I32, (2,))),
        "rows of rows of argsort": lambda c: T(c, 4, 3).rows(T(c, 9).argsort().rows(I(c, 0, 1))),
        "set_rows argsort range": lambda c: backend.alloc_persistent(DType.F32, (8, 3)).set_rows(T(c, 8, 6),
                                                                                              T(c, 6).argsort()),
        "copy into index input": lambda c: (lambda idx: (c.forward(T(c, 2).scale(1e6).cast(DType.I32).copy(idx)),
                                                         T(c, 4, 3).rows(idx))[1])(I(c, 0, 1)),
        "mulmat_id top_k experts": lambda c: T(c, 8, 3, 2).mulmat_id(T(c, 8, 1, 2), T(c, 5, 2).top_k(1)),
        "rows q8_1 table": lambda c: backend.alloc_persistent(DType.Q8_1, (32, 4)).rows(I(c, 0, 1)),
        "rows q8_k table": lambda c: backend.alloc_persistent(DType.Q8_K, (256, 4)).rows(I(c, 0, 1)),
        "cast from q8_1": lambda c: backend.alloc_persistent(DType.Q8_1, (32, 4)).cast(DType.F32, ctx=c),
        "cast to q8_k": lambda c: T(c, 256).cast(DType.Q8_K),
        "rms_norm eps -1": lambda c: T(c, 8, 2).rms_norm(-1.0),
        "rms_norm eps nan": lambda c: T(c, 8, 2).rms_norm(float("nan")),
        "norm eps nan": lambda c: T(c, 8, 2).norm(float("nan")),
        "l2_norm eps -1": lambda c: T(c, 8, 2).l2_norm(-1.0),
        "norm transposed eps -1": lambda c: T(c, 2, 8).transpose().norm(-1.0),
        "pool padding nan": lambda c: T(c, 8, 8).avg_pool_2d(2, 2, float("nan")),
        "pool padding inf": lambda c: T(c, 8, 8).avg_pool_2d(2, 2, float("inf")),
        "pool stride huge": lambda c: T(c, 8, 8).avg_pool_2d(2, 2**40),
        "softmax alibi no mask": lambda c: T(c, 8, 3).softmax(None, 1.0, 8.0),
        "empty count overflow": lambda c: c.empty(DType.F32, 2**32, 2**32, 2**32),
        "zeros huge": lambda c: c.zeros(DType.F32, 2**62),
        "mulmat size overflow": lambda c: c.empty(DType.F32, 1, 2**40).mulmat(c.empty(DType.F32, 1, 2**40)),
        "rows size overflow": lambda c: c.empty(DType.F32, 2**40, 2).rows(c.empty(DType.I32, 2**30)),
        "repeat overflow": lambda c: T(c, 2).repeat(2**62),
        "pad overflow": lambda c: T(c, 2).pad(2**40),
        "concat overflow": lambda c: c.empty(DType.F32, 2**55).concat(c.empty(DType.F32, 2**55), 0),
        "persistent overflow": lambda c: backend.alloc_persistent(DType.F32, (2**40, 2**40)),
        "rope n_ctx_orig huge": lambda c: T(c, 8, 2, 3).rope(I(c, 0, 1, 2), 8, 1e4, n_ctx_orig=2**32 - 1),
        "conv stride huge": lambda c: T(c, 8, 8, 3).conv_2d(T(c, 3, 3, 3, 4), 2**40, 1),
        "im2col dilation huge": lambda c: T(c, 8, 8, 3).im2col(T(c, 3, 3, 3, 4), 1, 1, 0, 0, 2**33, 1),
        "threads huge": lambda c: Backend.cpu(n_threads=100_000),
        "cross context": lambda c: T(c, 8) + backend.new_context().from_numpy(np.ones(8, np.float32)),
        "weights without ctx": lambda c: backend.alloc_persistent(DType.F32, (8, 2)).exp(),
    }

    for label, fn in specific.items():
        attempt(label, fn)
    print("specific", dict(stats), flush=True)

    # ---- lifetime misuse ------------------------------------------------------------------------
    def lifetimes():
        ctx = backend.new_context()
        x = ctx.from_numpy(np.ones((2, 8), np.float32))
        y = x * 2.0
        ctx.close()
        repr(x), x.shape, x.dtype, y.strides  # must not read freed memory
        for fn in (lambda: y.numpy(), lambda: x + x, lambda: ctx.compute(y), lambda: x.set(np.ones((2, 8))),
                   lambda: ctx.from_numpy(np.ones(2))):
            try:
                fn()
            except (ValueError, TypeError):
                stats["refused"] += 1
        other = Backend.cpu(n_threads=1)
        cache = other.alloc_persistent(DType.F32, (8, 2))
        other.close()
        repr(cache)
        with backend.new_context() as c2:
            for fn in (lambda: cache.numpy(), lambda: cache.set(np.zeros((2, 8), np.float32)),
                       lambda: cache.mulmat(c2.from_numpy(np.ones((1, 8), np.float32))),
                       lambda: c2.from_numpy(np.ones((2, 8), np.float32)).set_rows(
                           c2.from_numpy(np.ones((1, 8), np.float32)), c2.from_numpy(np.zeros(1, np.int32)))):
                try:
                    out = fn()
                    if out is not None and hasattr(out, "ctx"):
                        c2.compute(out)
                except (ValueError, TypeError):
                    stats["refused"] += 1
        with backend.new_context() as c3:
            z = c3.from_numpy(np.ones(4, np.float32)) + 1.0
            w = c3.from_numpy(np.ones(4, np.float32)) * 3.0
            c3.compute(z)
            try:
                w.numpy()  # not part of the computed graph's outputs
            except ValueError:
                stats["refused"] += 1

    try:
        lifetimes()
    except Exception as e:
        unexpected.append(f"lifetimes: {type(e).__name__}: {e}")

    # ---- model weights are read-only (they may be a read-only file mapping) -------------------------
    def weights(tmpdir):
        path = os.path.join(tmpdir, "w.gguf")
        writer = gguf.GGUFWriter(path, arch="llama")
        writer.add_tensor("w", np.ones((4, 32), np.float32))
        writer.add_tensor("q", gguf.quants.quantize(np.ones((8, 32), np.float32), gguf.GGMLQuantizationType.Q4_0),
                          raw_dtype=gguf.GGMLQuantizationType.Q4_0)
        writer.write_header_to_file(); writer.write_kv_data_to_file(); writer.write_tensors_to_file(); writer.close()
        with Backend.load(path, BackendParams(n_threads=1)) as b:
            w, q = b.get("w"), b.get("q")
            for fn in (lambda c: w.set(np.zeros((4, 32), np.float32)),
                       lambda c: w.set_rows(c.from_numpy(np.zeros((1, 32), np.float32)),
                                            c.from_numpy(np.zeros(1, np.int32))),
                       lambda c: c.from_numpy(np.zeros((4, 32), np.float32)).copy(w),
                       lambda c: q.numpy(),  # repacked: unreadable
                       lambda c: q.rows(c.from_numpy(np.zeros(1, np.int32))),
                       lambda c: w.mulmat(w),
                       lambda c: w.reshape(64, 2, ctx=c).transpose().mulmat(c.from_numpy(np.ones((1, 2), np.float32)))):
                try:
                    with b.new_context() as c:
                        out = fn(c)
                        if out is not None and hasattr(out, "ctx"):
                            c.compute(out)
                            out.numpy()
                    stats["ok"] += 1
                except (ValueError, TypeError):
                    stats["refused"] += 1

    import tempfile
    with tempfile.TemporaryDirectory() as tmpdir:
        try:
            weights(tmpdir)
        except Exception as e:
            unexpected.append(f"weights: {type(e).__name__}: {traceback.format_exc()}")
    print("misuse", dict(stats), flush=True)

    # ---- seeded random combinations --------------------------------------------------------------
    rng = np.random.default_rng(int(sys.argv[1]))
    SIZES = [1, 2, 3, 4, 5, 8, 16, 32, 64]
    DTYPES = [DType.F32] * 8 + [DType.F16, DType.F16, DType.BF16, DType.I32, DType.Q8_0, DType.Q4_0, DType.I64]

    def rand_shape(limit=8192):
        while True:
            shape = tuple(int(rng.choice(SIZES)) for _ in range(int(rng.integers(1, 5))))
            if np.prod(shape) <= limit:
                return shape

    def rand_tensor(ctx, like=None):
        shape = rand_shape()
        dtype = DTYPES[int(rng.integers(len(DTYPES)))]
        if like is not None:  # often something that fits the first operand
            pick = rng.random()
            if pick < 0.35:
                shape = like.shape
            elif pick < 0.55:
                shape = (like.shape[0],) + shape[1:]
            elif pick < 0.7:
                shape = tuple(max(1, d // int(rng.choice([1, 2]))) for d in like.shape)
            if rng.random() < 0.7:
                dtype = DType.F32
        a = np.random.default_rng(int(rng.integers(1 << 30))).standard_normal(tuple(reversed(shape)))
        if dtype in (DType.I32, DType.I64):
            t = ctx.from_numpy((a * 4).astype(dtype.numpy_dtype))
        elif dtype.is_quantized:
            t = ctx.from_numpy(a.astype(np.float32)).cast(dtype)
        else:
            t = ctx.from_numpy(a.astype(np.float32), dtype)
        layout = int(rng.integers(8))
        if layout == 1:
            t = t.transpose()
        elif layout == 2:
            t = t.permute(*[int(v) for v in rng.permutation(4)])
        elif layout == 3 and t.ndim >= 2:
            shp = list(t.shape)
            shp[1] = max(1, shp[1] // 2)
            t = t.view(0, shp, [s * 2 for s in t.strides[1:]][: len(shp) - 1])
        return t

    def rand_int(lo=-2, hi=70):
        return int(rng.integers(lo, hi))

    FLOAT_EXTREMES = [float("nan"), float("inf"), float("-inf"), -1.0, -0.0, 0.0, 1e-30, 1e30, 3.4e38, -1e-8]
    INT_EXTREMES = [-(2**63), -(2**31) - 1, -1, 0, 2**31, 2**32 - 1, 2**40, 2**62, 2**63 - 1]

    def extreme_float():
        return FLOAT_EXTREMES[int(rng.integers(len(FLOAT_EXTREMES)))] if rng.random() < 0.6 else 1e-5

    def extreme_int():
        return INT_EXTREMES[int(rng.integers(len(INT_EXTREMES)))] if rng.random() < 0.6 else rand_int()

    def rand_index(ctx):
        """An I32 tensor computed in the graph (bounded or not), or an input, maybe reshaped."""
        src = rand_tensor(ctx)
        kind = int(rng.integers(7))
        if kind == 0:
            t = src.argmax()
        elif kind == 1:
            t = src.argsort(descending=bool(rng.random() < 0.5))
        elif kind == 2:
            t = src.top_k(rand_int(1, 6))
        elif kind == 3:
            t = src.cast(DType.I32)
        elif kind == 4:
            t = backend.alloc_persistent(DType.I32, rand_shape(64))
        elif kind == 5:
            t = ctx.from_numpy(rng.integers(-2, 70, int(rng.integers(1, 8))).astype(np.int32))
        else:
            t = src.argsort().rows(ctx.from_numpy(rng.integers(0, 3, 2).astype(np.int32)))
        if rng.random() < 0.3:
            t = t.reshape(t.nelements)
        elif rng.random() < 0.2 and t.ndim >= 2:
            t = t.view(0, (t.shape[0],))
        return t

    OPS = [
        lambda c, a, b: a + b, lambda c, a, b: a - b, lambda c, a, b: a * b, lambda c, a, b: a / b,
        lambda c, a, b: a + float(rng.standard_normal()), lambda c, a, b: a * 3.0,
        lambda c, a, b: getattr(a, str(rng.choice(["neg", "sqr", "sqrt", "exp", "log", "sin", "cos", "abs",
                                                    "tanh", "relu", "sigmoid", "silu", "gelu", "gelu_erf",
                                                    "gelu_quick", "sum_rows", "mean", "sum", "argmax",
                                                    "argsort", "transpose", "contiguous"])))(),
        lambda c, a, b: a.silu(b), lambda c, a, b: a.gelu(b),
        lambda c, a, b: a.scale(0.5), lambda c, a, b: a.scale_bias(2.0, 1.0), lambda c, a, b: a.clamp(-1.0, 1.0),
        lambda c, a, b: a.rms_norm(1e-5, b if rng.random() < 0.5 else None), lambda c, a, b: a.norm(1e-5),
        lambda c, a, b: a.l2_norm(1e-5), lambda c, a, b: a.group_norm(rand_int(0, 4), 1e-5),
        lambda c, a, b: a.softmax(b if rng.random() < 0.6 else None, 0.5),
        lambda c, a, b: a.mulmat(b), lambda c, a, b: b.mulmat(a),
        lambda c, a, b: a.mulmat_id(b, rand_tensor(c, like=b)),
        lambda c, a, b: a.reshape(*rand_shape()), lambda c, a, b: a.reshape(a.nelements // max(1, a.shape[0]),
                                                                            a.shape[0]),
        lambda c, a, b: a.view(rand_int(-4, 400), rand_shape()),
        lambda c, a, b: (lambda s: a.view(rand_int(0, 64), s, [rand_int(-8, 512) for _ in s[1:]]))(rand_shape()),
        lambda c, a, b: a.permute(*[rand_int(-1, 5) for _ in range(int(rng.integers(1, 6)))]),
        lambda c, a, b: a.permute(*[int(v) for v in rng.permutation(4)]),
        lambda c, a, b: a.concat(b, rand_int(-1, 5)),
        lambda c, a, b: a.pad(*[rand_int(-1, 3) for _ in range(int(rng.integers(1, 5)))]),
        lambda c, a, b: a.repeat(*rand_shape()),
        lambda c, a, b: a.copy(b), lambda c, a, b: a.cast(DTYPES[int(rng.integers(len(DTYPES)))]),
        lambda c, a, b: a.cast(DType(int(rng.choice([d.value for d in DType])))),
        lambda c, a, b: a.rows(b), lambda c, a, b: a.rows(c.from_numpy(rng.integers(-2, 10, int(rng.integers(1, 6)))
                                                                        .astype(np.int32))),
        lambda c, a, b: backend.alloc_persistent(DTYPES[int(rng.integers(len(DTYPES)))],
                                                 rand_shape(1024)).set_rows(a, b),
        lambda c, a, b: a.top_k(rand_int(-1, 10)),
        lambda c, a, b: a.rope(b, rand_int(-2, 20), 1e4, mode=int(rng.choice([0, 2, 8])),
                               freq_factors=rand_tensor(c) if rng.random() < 0.3 else None),
        lambda c, a, b: a.scaled_dot_product_attention(b, rand_tensor(c, like=b), rand_tensor(c) if rng.random() < 0.5
                                                       else None, 0.1, flash=bool(rng.random() < 0.5)),
        lambda c, a, b: a.conv_2d(b, *[rand_int(-1, 3) for _ in range(6)]),
        lambda c, a, b: a.im2col(b, *[rand_int(-1, 3) for _ in range(6)], is_2d=bool(rng.random() < 0.7)),
        lambda c, a, b: a.avg_pool_2d(rand_int(-1, 5), rand_int(-1, 3), float(rand_int(-1, 3))),
        lambda c, a, b: c.empty(DTYPES[int(rng.integers(len(DTYPES)))], *[rand_int(-1, 40) for _ in range(3)]),
        # computed index tensors
        lambda c, a, b: a.rows(rand_index(c)),
        lambda c, a, b: backend.alloc_persistent(DType.F32, rand_shape(1024)).set_rows(a, rand_index(c)),
        lambda c, a, b: a.mulmat_id(b, rand_index(c)),
        # parameter extremes
        lambda c, a, b: a.scale(extreme_float()), lambda c, a, b: a.scale_bias(extreme_float(), extreme_float()),
        lambda c, a, b: a.clamp(extreme_float(), extreme_float()),
        lambda c, a, b: getattr(a, str(rng.choice(["rms_norm", "norm", "l2_norm"])))(extreme_float()),
        lambda c, a, b: a.group_norm(rand_int(0, 4), extreme_float()),
        lambda c, a, b: a.softmax(b if rng.random() < 0.5 else None, extreme_float(), extreme_float()),
        lambda c, a, b: a.rope(b, rand_int(-2, 20), extreme_float(), extreme_float(), n_ctx_orig=extreme_int(),
                               ext_factor=extreme_float(), attn_factor=extreme_float(), beta_fast=extreme_float(),
                               beta_slow=extreme_float()),
        lambda c, a, b: a.avg_pool_2d(extreme_int(), extreme_int(), extreme_float()),
        lambda c, a, b: a.top_k(extreme_int()),
        lambda c, a, b: a.pad(*[extreme_int() for _ in range(int(rng.integers(1, 5)))]),
        lambda c, a, b: a.repeat(*[extreme_int() for _ in range(int(rng.integers(1, 5)))]),
        lambda c, a, b: a.view(extreme_int(), rand_shape()),
        lambda c, a, b: a.reshape(*[extreme_int() for _ in range(int(rng.integers(1, 5)))]),
        lambda c, a, b: a.conv_2d(b, *[extreme_int() for _ in range(6)]),
        lambda c, a, b: a.im2col(b, *[extreme_int() for _ in range(6)]),
        lambda c, a, b: a.scaled_dot_product_attention(b, rand_tensor(c, like=b), None, extreme_float(),
                                                       flash=bool(rng.random() < 0.5), softcap=extreme_float()),
        lambda c, a, b: c.empty(DTYPES[int(rng.integers(len(DTYPES)))], *[extreme_int() for _ in range(3)]),
        lambda c, a, b: c.arange(extreme_float(), extreme_float(), extreme_float()),
        lambda c, a, b: a.permute(*[extreme_int() for _ in range(4)]),
    ]

    def random_case(c):
        a = rand_tensor(c)
        b = rand_tensor(c, like=a)
        out = None
        for _ in range(int(rng.integers(1, 4))):
            op = OPS[int(rng.integers(len(OPS)))]
            out = op(c, a if out is None else out, b)
        return out

    n_random = int(sys.argv[2])
    for i in range(n_random):
        attempt(f"random #{i}", random_case)
    print("random", dict(stats), flush=True)
    for u in unexpected:
        print("UNEXPECTED", u)
    print("done", len(unexpected))
''')


# glibc's malloc checker (when installed) turns a heap overflow inside ggml into an abort here
MALLOC_DEBUG = Path("/lib/x86_64-linux-gnu/libc_malloc_debug.so.0")


@pytest.mark.parametrize("seed", [20240601, 7, 119])
def test_bad_calls_never_crash(tmp_path, seed):
    script = tmp_path / "bad_calls.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, GGML_NO_BACKTRACE="1", PYTHONFAULTHANDLER="1", MALLOC_PERTURB_="165")
    if MALLOC_DEBUG.exists():
        env.update(LD_PRELOAD=str(MALLOC_DEBUG), MALLOC_CHECK_="3")
    proc = subprocess.run([sys.executable, str(script), str(seed), "600"], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    tail = (proc.stdout[-4000:] + "\n--- stderr ---\n" + proc.stderr[-4000:])
    assert proc.returncode == 0, f"child died with {proc.returncode} (negative: killed by signal)\n{tail}"
    assert "\ndone 0" in proc.stdout, tail
    stats = re.search(r"^random (\{.*\})$", proc.stdout, re.M).group(1)
    refused, ok = (int(re.search(rf"'{key}': (\d+)", stats).group(1)) for key in ("refused", "ok"))
    assert refused > 300 and ok > 20  # both paths exercised: refusals and graphs that compute


# ---- grammar and schema sizes (issue 25 item 1) -------------------------------------------------------
GRAMMAR_SCRIPT = textwrap.dedent(r'''
    import collections, json, sys
    import gguf
    import numpy as np
    from pyggml.constrain import Constraint, ConstraintError, Grammar
    from pyggml.tokenizer import from_metadata
    from tests._grammar_probe import gbnf_chain, lark_chain, schema_chain

    reader = gguf.GGUFReader(sys.argv[1])
    tok = from_metadata({f.name: f.contents() for f in reader.fields.values()})
    rng = np.random.default_rng(int(sys.argv[2]))

    def n(high):  # sizes from 1 to high, log-uniform: small and huge alike
        return int(np.exp(rng.uniform(0, np.log(high))))

    def ref_loop(k):  # d0 -> d1 -> ... -> d0
        return Grammar.json({"$ref": "#/$defs/d0", "$defs": {f"d{i}": {"$ref": f"#/$defs/d{(i + 1) % k}"}
                                                              for i in range(k)}})

    def nested(depth, leaf, wrap):
        for _ in range(depth):
            leaf = wrap(leaf)
        return leaf

    FAMILIES = {
        "lark chain": lambda: Grammar.lark(lark_chain(n(4000))),
        "gbnf chain": lambda: Grammar.gbnf(gbnf_chain(n(3000))),
        "lark brackets": lambda: Grammar.lark("start: " + nested(n(400), '"a"', lambda x: f"({x})")),
        "gbnf brackets": lambda: Grammar.gbnf("root ::= " + nested(n(400), '"a"', lambda x: f"({x})")),
        "regex brackets": lambda: Grammar.regex(nested(n(400), "a", lambda x: f"({x})")),
        "regex alternatives": lambda: Grammar.regex("|".join(f"w{i}" for i in range(n(20000)))),
        "schema $ref chain": lambda: Grammar.json(schema_chain(n(4000))),
        "schema nesting": lambda: Grammar.json(nested(n(900), {"type": "integer"},
                                                      lambda x: {"type": "array", "items": x})),
        "schema width": lambda: Grammar.json({"type": "object",
                                              "properties": {f"p{i}": {"type": "integer"} for i in range(n(4000))}}),
        "schema anyOf width": lambda: Grammar.json({"anyOf": [{"const": i} for i in range(n(8000))]}),
        "schema enum": lambda: Grammar.json({"enum": [f"v{i}" for i in range(n(50000))]}),
        "$ref loop": lambda: ref_loop(n(50)),
        "lark %json chain": lambda: Grammar.lark("start: %json " + json.dumps(schema_chain(n(4000)))),
    }
    counts = {name: collections.Counter() for name in FAMILIES}
    for i in range(int(sys.argv[3])):
        name = list(FAMILIES)[i % len(FAMILIES)]
        counts[name]["tried"] += 1
        try:
            c = Constraint(FAMILIES[name](), tok)
            c.compute_mask()
            for _ in range(8):  # a few steps: limits can be reached while generating too
                if c.stopped:
                    break
                allowed = np.flatnonzero(c.allowed())
                c.consume(int(rng.choice(allowed)))
                c.compute_mask()
            counts[name]["clean"] += 1
        except ConstraintError:
            counts[name]["clean"] += 1
            counts[name]["refused"] += 1
        except Exception as e:  # anything else is a wrong answer (a 500 in the server)
            counts[name]["wrong"] += 1
            print("WRONG", name, type(e).__name__, str(e)[:300], flush=True)
    print(json.dumps(counts), flush=True)
''')


def test_grammar_and_schema_sizes_never_crash(tmp_path):
    """Every family of grammar and schema size (chains, nesting, width, loops) is compiled and
    followed a few tokens in a child process: a ConstraintError or a grammar that works, never a
    crash (the child dies), a hang (its time limit) or another exception. pytest -s shows the counts."""
    pytest.importorskip("llguidance")
    from .conftest import SHARED_MODELS

    root = Path(__file__).resolve().parent.parent  # the child imports tests._grammar_probe
    path = SHARED_MODELS / "stories260K.gguf"
    if not path.exists():
        pytest.skip(f"{path} is not there")
    script = tmp_path / "grammar_sizes.py"
    script.write_text(GRAMMAR_SCRIPT)
    env = dict(os.environ, GGML_NO_BACKTRACE="1", PYTHONFAULTHANDLER="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, str(script), str(path), "2501", "52"], capture_output=True, text=True,
                          timeout=560, env=env, cwd=tmp_path)
    tail = proc.stdout[-4000:] + "\n--- stderr ---\n" + proc.stderr[-4000:]
    assert proc.returncode == 0, f"child died with {proc.returncode}\n{tail}"
    counts = json.loads(proc.stdout.splitlines()[-1])
    print(json.dumps(counts))
    assert all(c["tried"] == 4 and c["clean"] == 4 for c in counts.values()), tail


# ---- RPC: mutated messages to a live `pyggml rpc-server`, mutated answers to the client -------------------------
def _rpc_messages(ptr: int, base: int, spare: int) -> list[tuple[int, bytes]]:
    """A well-formed message of every command a client sends after HELLO, on a 4 KiB buffer at ptr/base
    (``spare``: a second buffer of the session, for FREE_BUFFER). In order: the graph precedes its recompute."""
    from pyggml import rpc

    from . import rpc_wire as rw

    a, b = (rw.tensor(i + 1, buffer=ptr, data=base + 256 * i, ne=(64,)) for i in range(2))
    c = rw.tensor(3, buffer=ptr, data=base + 512, ne=(64,), op=rw.OP_ADD, src=(1, 2))
    q = struct.pack
    return [
        (rpc.CMD_DEVICE_COUNT, b""), (rpc.CMD_GET_ALIGNMENT, q("<I", 0)), (rpc.CMD_GET_MAX_SIZE, q("<I", 0)),
        (rpc.CMD_GET_DEVICE_MEMORY, q("<I", 0)), (rpc.CMD_ALLOC_BUFFER, q("<IQ", 0, 256)),
        (rpc.CMD_BUFFER_GET_BASE, q("<Q", ptr)), (rpc.CMD_BUFFER_CLEAR, q("<QB", ptr, 0)),
        (rpc.CMD_SET_TENSOR, a + b"\x00" + q("<Q", 0) + bytes(range(256))),
        (rpc.CMD_SET_TENSOR, b + b"\x00" + q("<Q", 0) + bytes(256)),
        (rpc.CMD_SET_TENSOR_HASH, a + q("<QQ", 0, 12345)), (rpc.CMD_GET_TENSOR, a + q("<QQ", 0, 256)),
        (rpc.CMD_COPY_TENSOR, a + b), (rpc.CMD_INIT_TENSOR, a), (rpc.CMD_GET_ALLOC_SIZE, q("<I", 0) + c + a + b
                                                                   + bytes(rpc.RPC_TENSOR_SIZE * 8)),
        (rpc.CMD_MEMSET_TENSOR, b + q("<QQB", 0, 256, 0)), (rpc.CMD_GRAPH_COMPUTE, rw.graph([3], [a, b, c])),
        (rpc.CMD_GRAPH_RECOMPUTE, q("<I", 0)), (rpc.CMD_FREE_BUFFER, q("<Q", spare)),
    ]


def _mutate(rng, cmd: int, payload: bytes, known: list[int]) -> bytes:
    """One framed message, damaged in one of the ways a hostile or broken client would."""
    edges = [0, 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1, 2**64 - 8, *known]
    body = bytearray(payload)
    size = len(body)
    kind = int(rng.integers(7))
    if kind == 0 and body:  # a field set to an edge value
        width = 8 if len(body) >= 8 and rng.integers(2) else 4
        at = int(rng.integers(0, max(1, len(body) - width + 1)))
        value = int(edges[int(rng.integers(len(edges)))]) % (1 << (8 * width))
        body[at:at + width] = value.to_bytes(width, "little")
    elif kind == 1 and body:  # random bytes flipped
        for _ in range(int(rng.integers(1, 6))):
            body[int(rng.integers(len(body)))] ^= int(rng.integers(1, 256))
    elif kind == 2:  # the header's size lies
        size = int([0, 1, size - 1, size + 1, 2**30, 2**63, 2**64 - 1][int(rng.integers(7))]) % 2**64
    elif kind == 3:  # cut short
        body = body[:int(rng.integers(0, len(body) + 1))]
        size = len(body)
    elif kind == 4:  # junk appended
        body += rng.bytes(int(rng.integers(1, 64)))
        size = len(body)
    elif kind == 5:  # another command's number
        cmd = int(rng.integers(0, 256))
    else:  # a tensor id, buffer or data word replaced by a neighbour's
        if len(body) >= 24:
            at = 8 * int(rng.integers(len(body) // 8))
            body[at:at + 8] = int(known[int(rng.integers(len(known)))] + int(rng.integers(-16, 17))).to_bytes(
                8, "little", signed=False) if known else bytes(8)
    return bytes([cmd]) + struct.pack("<Q", size) + bytes(body)


def test_rpc_mutated_messages_never_take_the_server_down():
    """Every command of the protocol, mutated, to a live rpc-server: the server never dies or hangs, and a real
    client's computation stays right. Counts per outcome are printed (pytest -s) for the issue's record."""
    import numpy as np
    from pyggml._ggml import lib

    from pyggml import rpc

    from . import rpc_wire as rw

    if not lib.PYGGML_HAS_RPC:
        pytest.skip("pyggml built without ggml RPC (PYGGML_RPC=OFF)")
    rng = np.random.default_rng(25)
    server = rw.Server("--max-memory", "256M")
    counts = dict(tried=0, answered=0, refused=0, stalled=0, crash=0, hang=0, wrong=0)
    try:
        client = None
        for trial in range(90):
            if client is None:
                client = rw.RawClient(server.endpoint, timeout=5)
                ptr, _, base = client.alloc(4096)
                spare = client.alloc(256)[0]
                (align,) = struct.unpack("<Q", client.call(rpc.CMD_GET_ALIGNMENT, bytes(4), 8))
            messages = _rpc_messages(ptr, base, spare)
            cmd, payload = messages[int(rng.integers(len(messages)))]
            counts["tried"] += 1
            try:
                client.sock.sendall(_mutate(rng, cmd, payload, [ptr, base, spare, base + 4096]))
                # the probe: answered right while the session lives, or the connection closes
                client.send(rpc.CMD_GET_ALIGNMENT, bytes(4))
                data = b""
                while True:  # skip answers the mutated message may have had, to the probe's (8 + 8 bytes)
                    chunk = client.sock.recv(1 << 16)
                    if not chunk:
                        raise ConnectionResetError
                    data += chunk
                    if data.endswith(struct.pack("<QQ", 8, align)):
                        counts["answered"] += 1
                        break
            except (ConnectionResetError, BrokenPipeError):
                counts["refused"] += 1
                client.sock.close()
                client = None
            except TimeoutError:  # waits for the rest of a message it was promised: the session's own time
                counts["stalled"] += 1
                client.sock.close()
                client = None
            if server.proc.poll() is not None:
                counts["crash"] += 1
                break
            if trial % 15 == 14:
                outcome = _round_trip_outcome(rw, server.endpoint)
                counts["wrong" if outcome.startswith("wrong") else "hang"] += outcome != "ok"
        if client is not None:
            client.sock.close()
    finally:
        code, err = server.stop()
    print("rpc messages:", counts)
    assert counts["crash"] == counts["hang"] == counts["wrong"] == 0, (counts, err[-3000:])
    assert counts["refused"] > 20 and counts["answered"] > 5, counts  # both paths exercised
    assert code == 0 and "Traceback" not in err, err[-3000:]


def _round_trip_outcome(rw, endpoint: str) -> str:
    """A real client's allocate-write-add-read on the server: "ok", "wrong: ...", or no service ("hang")."""
    result = []

    def run():
        try:
            rw.round_trip(endpoint)
            result.append("ok")
        except AssertionError as exc:
            result.append(f"wrong: {exc}")
        except OSError as exc:
            result.append(f"hang (no service: {exc})")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)  # a bound against a hang, not a timing check
    return result[0] if result else "hang"


RPC_ANSWERS_SCRIPT = textwrap.dedent(r'''
    import sys
    import numpy as np
    from pyggml import BackendParams
    from pyggml.backend import Backend
    from pyggml.rpc import RPCError
    for endpoint in sys.argv[1:]:
        try:
            backend = Backend(BackendParams(n_threads=1, rpc=[endpoint], tensor_split=[1, 1]))
            try:
                backend.config = type(backend.config)({"general.architecture": "t", "t.block_count": 2})
                w = backend.alloc_persistent("q8_0", (32, 8), layer=1)
                f = backend.alloc_persistent("f32", (4, 8), layer=1)
                with backend.new_context() as ctx:
                    out = f.rows(ctx.from_numpy(np.array([1, 0], np.int32))) * 2.0
                    ctx.compute(out)
                    out.numpy()
                print("outcome ok", flush=True)
            finally:
                backend.close()
        except (RPCError, MemoryError, ValueError) as exc:
            print("outcome refused", type(exc).__name__, str(exc)[:200], flush=True)
    print("done", flush=True)
''')


def test_rpc_mutated_answers_never_crash_the_client():
    """A fake server answers one command wrongly per trial (edge values, wrong lengths, junk): the client
    process raises or carries on, never aborts or hangs (ggml's client aborts on many of these by itself)."""
    import numpy as np
    from pyggml._ggml import lib

    from pyggml import rpc

    from . import rpc_wire as rw

    if not lib.PYGGML_HAS_RPC:
        pytest.skip("pyggml built without ggml RPC (PYGGML_RPC=OFF)")
    rng = np.random.default_rng(4)
    answered = [rpc.CMD_DEVICE_COUNT, rpc.CMD_GET_ALIGNMENT, rpc.CMD_GET_MAX_SIZE, rpc.CMD_GET_DEVICE_MEMORY,
                rpc.CMD_ALLOC_BUFFER, rpc.CMD_BUFFER_GET_BASE, rpc.CMD_GET_ALLOC_SIZE, rpc.CMD_GET_TENSOR,
                rpc.CMD_HELLO]
    edges = [0, 1, 3, 15, 16, 48, 2**20, 2**31, 2**32 - 1, 2**63, 2**64 - 8, 2**64 - 1]
    fakes = []
    for trial in range(36):
        cmd = answered[trial % len(answered)]
        kind = int(rng.integers(3))
        value = int(edges[int(rng.integers(len(edges)))])

        def answer(request, cmd=cmd, kind=kind, value=value):
            normal = rw.normal_answer(cmd, request)
            if kind == 0:  # an edge value in the first field
                width = 4 if len(normal) == 4 else 8
                return (value % (1 << 8 * width)).to_bytes(width, "little") + normal[width:]
            if kind == 1:  # the wrong length
                return normal[:len(normal) // 2] if value % 2 else normal + bytes(8)
            return bytes(rng.integers(0, 256, len(normal), dtype=np.uint8))
        fakes.append(rw.FakeServer({cmd: answer}))
    try:
        proc = subprocess.run([sys.executable, "-c", RPC_ANSWERS_SCRIPT, *(f.endpoint for f in fakes)],
                              capture_output=True, text=True, timeout=280, env=dict(os.environ, GGML_NO_BACKTRACE="1",
                                                                                     PYGGML_RPC_TIMEOUT="5"))
        crash = proc.returncode != 0
    except subprocess.TimeoutExpired as exc:
        proc, crash = exc, False
    finally:
        for f in fakes:
            f.close()
    out = proc.stdout if isinstance(proc.stdout, str) else (proc.stdout or b"").decode()
    counts = dict(tried=len(fakes), ok=out.count("outcome ok"), refused=out.count("outcome refused"),
                  crash=int(crash), hang=int(isinstance(proc, subprocess.TimeoutExpired)))
    print("rpc answers:", counts)
    assert not crash and not counts["hang"] and "done" in out, (counts, out[-2000:], str(proc.stderr)[-3000:])
    assert counts["ok"] + counts["refused"] == len(fakes), out[-3000:]
    assert counts["refused"] > 5, counts
