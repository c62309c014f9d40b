"""Graph-building overhead and matrix-product throughput of pyggml's core.

    python -m pytest bench/bench_ops.py --benchmark-only

- graph building: a ~1,000-node graph built from Python (new context, ops, forward), reported as
  µs per ggml node in ``extra_info`` (target < 1.5 µs/node; raw cffi calls cost ~0.3-0.4 µs);
- mulmat: a 4096x4096 weight times 4096xN inputs (N = 1, 32, 128) at 2 threads (or
  ``PYGGML_BENCH_THREADS``), F32 against numpy's matmul on the same shape and thread count, and
  Q8_0/Q4_0 (with and without the CPU repack), in GFLOP/s (``extra_info``). One graph is built per
  case and ``ctx.compute`` is timed on it.
Not collected by the default test command (``testpaths = ["tests"]``).
"""

from __future__ import annotations

import os
import sys

THREADS = int(os.environ.get("PYGGML_BENCH_THREADS", "2"))  # e.g. 1: is a gap the kernel or the threading?
# numpy's BLAS reads these when it loads: match ggml's threads (set before numpy is imported)
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = str(THREADS)
_NUMPY_PRELOADED = "numpy" in sys.modules

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from pyggml import Backend, BackendParams, DType  # noqa: E402
from pyggml.tensor import quantize  # noqa: E402

K = M = 4096
NS = (1, 32, 128)


# ---- graph building -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cpu():
    backend = Backend.cpu(n_threads=THREADS)
    yield backend
    backend.close()


def _report(benchmark, n_nodes: int, n_calls: int) -> None:
    seconds = benchmark.stats.stats.median
    benchmark.extra_info.update(nodes=n_nodes, python_ops=n_calls, us_per_node=round(seconds / n_nodes * 1e6, 3),
                                us_per_op=round(seconds / n_calls * 1e6, 3))


def test_build_elementwise_chain(benchmark, cpu):
    """1,000 nodes of cheap elementwise ops: the per-op Python cost."""
    a = np.ones((4, 64), np.float32)

    def build():
        with cpu.new_context() as ctx:
            x = ctx.from_numpy(a)
            y = ctx.from_numpy(a)
            for i in range(250):
                x = (x + y) * y
                x = x.silu() if i % 2 else x.scale(0.5)
                x = x - y
            ctx.forward(x)
            return ctx.n_nodes

    n_nodes = benchmark.pedantic(build, rounds=40, warmup_rounds=3)
    assert n_nodes == 1000
    _report(benchmark, n_nodes, 1002)


def test_build_transformer_layers(benchmark, cpu):
    """A llama-like decoder (norms, projections, rope, attention, SwiGLU) of ~1,000 nodes."""
    d, heads, hd, ff, n_tok, n_layers = 64, 4, 16, 128, 8, 33
    rng = np.random.default_rng(0)
    weights = {}
    for name, shape in [("q", (d, d)), ("k", (d, d)), ("v", (d, d)), ("o", (d, d)), ("g", (d, ff)), ("u", (d, ff)),
                        ("dn", (ff, d)), ("n1", (d,)), ("n2", (d,))]:
        t = cpu.alloc_persistent(DType.F32, shape)
        t.set(rng.standard_normal(tuple(reversed(shape))).astype(np.float32))
        weights[name] = t
    w = weights
    x_np = rng.standard_normal((n_tok, d)).astype(np.float32)
    pos_np = np.arange(n_tok, dtype=np.int32)
    mask_np = np.triu(np.full((n_tok, n_tok), -np.inf, np.float32), 1)
    calls = 0

    def build():
        nonlocal calls
        with cpu.new_context() as ctx:
            x, pos, mask = ctx.from_numpy(x_np), ctx.from_numpy(pos_np), ctx.from_numpy(mask_np)
            for _ in range(n_layers):
                h = x.rms_norm(1e-5, w["n1"])
                q = w["q"].mulmat(h).reshape(hd, heads, n_tok).rope(pos, hd, 1e4).permute(0, 2, 1, 3)
                k = w["k"].mulmat(h).reshape(hd, heads, n_tok).rope(pos, hd, 1e4).permute(0, 2, 1, 3)
                v = w["v"].mulmat(h).reshape(hd, heads, n_tok).permute(0, 2, 1, 3)
                a = q.scaled_dot_product_attention(k, v, mask, hd ** -0.5)
                x = x + w["o"].mulmat(a.reshape(d, n_tok))
                h = x.rms_norm(1e-5, w["n2"])
                x = x + w["dn"].mulmat(w["g"].mulmat(h).silu(w["u"].mulmat(h)))
            ctx.forward(x)
            calls = ctx._state.n_tensors
            return ctx.n_nodes

    n_nodes = benchmark.pedantic(build, rounds=30, warmup_rounds=3)
    assert 900 <= n_nodes <= 1100
    _report(benchmark, n_nodes, calls)


# ---- matrix products ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def weight_f32() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((M, K)).astype(np.float32) * 0.02


@pytest.fixture(scope="module")
def quant_file(tmp_path_factory, weight_f32):
    path = tmp_path_factory.mktemp("bench") / "weights.gguf"
    writer = gguf.GGUFWriter(path, arch="bench")
    for qtype in ("Q8_0", "Q4_0"):
        writer.add_tensor(f"w.{qtype}", quantize(weight_f32, qtype), raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gflops(benchmark, n: int) -> None:
    seconds = benchmark.stats.stats.median
    benchmark.extra_info.update(n=n, gflops=round(2 * M * K * n / seconds / 1e9, 1), threads=THREADS)


def _rounds(n: int) -> int:
    return 20 if n == 1 else 8


def _bench_graph(benchmark, backend: Backend, weight, n: int) -> None:
    x = np.random.default_rng(2).standard_normal((n, K)).astype(np.float32)
    with backend.new_context() as ctx:
        y = weight.mulmat(ctx.from_numpy(x))
        ctx.compute(y)  # warm-up, and a correctness check against numpy
        benchmark.pedantic(lambda: ctx.compute(y), rounds=_rounds(n), warmup_rounds=1)
        assert y.numpy().shape == (n, M)
    _gflops(benchmark, n)


@pytest.mark.parametrize("n", NS)
def test_mulmat_f32(benchmark, weight_f32, n):
    with Backend.cpu(n_threads=THREADS) as backend:
        w = backend.alloc_persistent(DType.F32, (K, M))
        w.set(weight_f32)
        _bench_graph(benchmark, backend, w, n)


@pytest.mark.parametrize("n", NS)
def test_mulmat_numpy_f32(benchmark, weight_f32, n):
    x = np.random.default_rng(2).standard_normal((n, K)).astype(np.float32)
    wt = np.ascontiguousarray(weight_f32.T)
    benchmark.pedantic(lambda: np.matmul(x, wt), rounds=_rounds(n), warmup_rounds=1)
    _gflops(benchmark, n)
    benchmark.extra_info["numpy_imported_before_thread_env"] = _NUMPY_PRELOADED


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("qtype,repack", [("Q8_0", True), ("Q4_0", True), ("Q4_0", False)])
def test_mulmat_quantized(benchmark, quant_file, qtype, repack, n):
    with Backend.load(quant_file, BackendParams(n_threads=THREADS, repack=repack)) as backend:
        name = f"w.{qtype}"
        assert (name in backend._repacked) == (repack and qtype == "Q4_0")  # x86 repacks Q4_0, not Q8_0
        _bench_graph(benchmark, backend, backend.get(name), n)
        benchmark.extra_info["repacked"] = name in backend._repacked
