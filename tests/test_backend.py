"""Backend, Context and DType: lifecycle, inputs, persistent tensors, memory, and leak checks."""

from __future__ import annotations

import gc
import os
import platform
import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest

import pyggml
from pyggml import Backend, BackendParams, DType
from pyggml.tensor import dtype_of_numpy, quantize


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---- package and devices ----------------------------------------------------------------------
def test_version_and_devices():
    assert pyggml.__version__
    assert pyggml.ggml_version().count(".") >= 1
    devs = pyggml.devices()
    cpus = [d for d in devs if d.kind == "cpu"]
    assert len(cpus) == 1 and cpus[0].name
    assert all(d.kind in ("cpu", "gpu", "igpu", "accel", "rpc") for d in devs)  # rpc: servers other tests added


@pytest.mark.parametrize("params", [
    dict(n_threads=0), dict(n_threads=-2), dict(n_threads=1.5), dict(gpu_layers=-1), dict(gpu_layers="most"),
    dict(gpu_layers=[0, -1]),
])
def test_backend_params_validation(params):
    with pytest.raises(ValueError):
        Backend(BackendParams(**params))


def test_cpu_backend_basics(cpu):
    assert cpu.n_threads == 2
    assert cpu.config.architecture == "" and len(cpu.config) == 0
    assert cpu.tensors() == {} and cpu.get("anything") is None
    assert cpu.max_graph_nodes >= 8192
    assert isinstance(cpu.flash_attention, bool)
    with pytest.raises(ValueError, match="max_nodes"):
        cpu.new_context(max_nodes=-1)
    with pytest.raises(ValueError, match="max_nodes"):
        pyggml.Context(cpu, 0)


# ---- DType -------------------------------------------------------------------------------------
def test_dtype():
    assert DType.parse("q4_0") is DType.Q4_0 and DType.parse(8) is DType.Q8_0 and DType.parse(DType.F16) is DType.F16
    with pytest.raises(ValueError, match="unknown dtype"):
        DType.parse("q3_0")
    with pytest.raises(ValueError, match="unknown ggml type"):
        DType.parse(1000)
    assert (DType.Q4_0.block_size, DType.Q4_0.type_size) == (32, 18)
    assert (DType.Q8_0.block_size, DType.Q8_0.type_size) == (32, 34)
    assert (DType.Q4_K.block_size, DType.Q6_K.block_size) == (256, 256)
    assert (DType.F16.block_size, DType.F16.type_size) == (1, 2)
    assert DType.Q4_0.row_bytes(64) == 36 and DType.F32.row_bytes(3) == 12
    assert DType.Q4_K.is_quantized and not DType.F16.is_quantized and not DType.BF16.is_quantized
    assert DType.I32.numpy_dtype == np.int32 and DType.Q8_0.numpy_dtype is None
    assert dtype_of_numpy(np.float16) is DType.F16 and dtype_of_numpy(np.int64) is DType.I64
    with pytest.raises(TypeError, match="no ggml equivalent"):
        dtype_of_numpy(np.complex64)


# ---- contexts and inputs ------------------------------------------------------------------------
def test_context_inputs(cpu):
    with cpu.new_context() as ctx:
        e = ctx.empty(DType.F32, 4, 2)
        z = ctx.zeros("i32", 3)
        r = ctx.arange(0, 5, 1)
        ri = ctx.arange(2, 11, 3, DType.I32)
        e.set(np.arange(8, dtype=np.float32).reshape(2, 4))
        y = e * 2.0
        ctx.compute(y, z, r, ri)
        np.testing.assert_array_equal(y.numpy(), np.arange(8).reshape(2, 4) * 2)
        np.testing.assert_array_equal(z.numpy(), [0, 0, 0])
        np.testing.assert_array_equal(r.numpy(), [0, 1, 2, 3, 4])
        np.testing.assert_array_equal(ri.numpy(), [2, 5, 8])
    with cpu.new_context() as ctx:
        with pytest.raises(ValueError, match="dims"):
            ctx.empty(DType.F32, 0, 2)
        with pytest.raises(ValueError, match="block size"):
            ctx.empty(DType.Q4_0, 16)
        with pytest.raises(ValueError, match="1 to 4 dims"):
            ctx.empty(DType.F32, 1, 1, 1, 1, 1)
        with pytest.raises(ValueError, match="empty"):
            ctx.from_numpy(np.zeros((0, 3), np.float32))
        with pytest.raises(ValueError, match="at most 4 dims"):
            ctx.from_numpy(np.zeros((1, 1, 1, 1, 2), np.float32))
        with pytest.raises(TypeError, match="from_numpy"):
            ctx.from_numpy(np.zeros(32, np.float32), DType.Q8_0)
        with pytest.raises(ValueError, match="arange"):
            ctx.arange(0, 5, 0)
        with pytest.raises(ValueError, match="set"):
            ctx.empty(DType.F32, 4).set(np.zeros(5, np.float32))
        with pytest.raises(TypeError, match="truncate"):
            ctx.empty(DType.I32, 4).set(np.zeros(4, np.float32))
        with pytest.raises(TypeError, match="forward"):
            ctx.forward("not a tensor")


def test_graph_reuse_with_new_inputs(cpu):
    """One built graph computed repeatedly, inputs rewritten with set() in between."""
    with cpu.new_context() as ctx:
        x = ctx.empty(DType.F32, 8)
        w = ctx.from_numpy(np.full(8, 3.0, np.float32))
        y = (x * w).sum()
        for i in range(5):
            x.set(np.full(8, float(i), np.float32))
            ctx.compute(y)
            assert y.numpy()[0] == pytest.approx(24.0 * i)


def test_forward_reserve_and_nodes(cpu):
    with cpu.new_context() as ctx:
        x = ctx.from_numpy(np.ones((16, 32), np.float32))
        y = (x + x).exp().sum_rows()
        ctx.forward(y)
        assert ctx.n_nodes == 3
        ctx.reserve()
        assert cpu.memory()[next(iter(cpu.memory()))]["graph"] > 0
        ctx.compute(y)
        np.testing.assert_allclose(y.numpy()[:, 0], np.full(16, 32 * np.exp(2)), rtol=1e-5)


def test_input_and_layer_subcontexts(cpu):
    with cpu.new_context() as ctx:
        a = ctx.input().from_numpy(np.ones(4, np.float32))
        b = ctx.layer(0).from_numpy(np.full(4, 2.0, np.float32))
        y = a + b
        assert y.ctx._state is ctx._state
        ctx.compute(y)
        np.testing.assert_array_equal(y.numpy(), [3, 3, 3, 3])


def test_tensor_name_and_repr(cpu):
    with cpu.new_context() as ctx:
        x = ctx.from_numpy(np.ones((2, 3), np.float32))
        x.name = "hello"
        assert x.name == "hello"
        assert repr(x) == "Tensor(hello, shape=(3, 2), dtype=F32)"
        x.name = "x" * 100  # truncated to ggml's limit, not an overflow
        assert x.name == "x" * 63
        assert x.strides == (4, 12) and x.nbytes == 24 and x.nelements == 6 and x.is_contiguous()
        assert not x.transpose().is_contiguous()


# ---- persistent tensors -------------------------------------------------------------------------
def test_alloc_persistent(cpu):
    before = sum(m["cache"] for m in cpu.memory().values())
    cache = cpu.alloc_persistent("f16", (8, 4), name="kv")
    assert cache.name == "kv" and cache.dtype == DType.F16 and cache.ctx is None
    assert sum(m["cache"] for m in cpu.memory().values()) >= before + 64
    np.testing.assert_array_equal(cache.numpy(), np.zeros((4, 8), np.float16))  # cleared
    data = np.arange(32, dtype=np.float32).reshape(4, 8)
    cache.set(data)  # immediate for persistent tensors
    np.testing.assert_array_equal(cache.numpy(), data.astype(np.float16))
    q = cpu.alloc_persistent(DType.Q8_0, (64, 2))
    assert q.nbytes == 2 * 2 * 34
    for bad in [(0, 4), (8, 4, 1, 1, 1), (33,)]:
        with pytest.raises(ValueError, match="alloc_persistent"):
            cpu.alloc_persistent(DType.Q8_0 if bad == (33,) else DType.F32, bad)
    with cpu.new_context() as ctx:
        y = cache.mulmat(ctx.from_numpy(np.ones((1, 8), np.float32)))
        assert cpu.supports_op(y)
        ctx.compute(y)
        np.testing.assert_allclose(y.numpy()[0], data.sum(1), rtol=1e-3)


def test_backend_close():
    backend = Backend.cpu(n_threads=1)
    ctx = backend.new_context()
    y = ctx.from_numpy(np.ones(3, np.float32)) + 1.0
    backend.close()
    backend.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        ctx.compute(y)
    with pytest.raises(ValueError, match="closed"):
        backend.new_context()
    with pytest.raises(ValueError, match="closed"):
        backend.alloc_persistent(DType.F32, (4,))
    with Backend.cpu(n_threads=1) as b2:
        assert not b2._closed
    assert b2._closed


# ---- leaks --------------------------------------------------------------------------------------
def test_no_leak_building_graphs():
    """2,000 small graphs, each in a new context that is closed: RSS stays flat after warm-up."""
    backend = Backend.cpu(n_threads=1)  # one thread: no pool hand-offs, fast on a busy machine
    a = np.arange(32, dtype=np.float32).reshape(4, 8)

    def step():
        with backend.new_context() as ctx:
            x = ctx.from_numpy(a)
            y = ((x * 2.0 + x).silu().sum_rows() - 1.0).scale(0.5)
            ctx.compute(y)
            return y.numpy()

    for _ in range(300):
        step()
    gc.collect()
    start = rss_bytes()
    for _ in range(2000):
        out = step()
    gc.collect()
    grown = rss_bytes() - start
    backend.close()
    assert out.shape == (4, 1)
    assert grown < 4 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over 2,000 graphs"


def test_no_leak_load_close(tmp_path):
    """Backend.load + close of a small GGUF 200 times keeps RSS flat."""


    path = tmp_path / "small.gguf"
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_tensor("a", np.ones((8, 32), np.float32))
    q = gguf.quants.quantize(np.ones((16, 64), np.float32), gguf.GGMLQuantizationType.Q4_0)
    writer.add_tensor("b", q, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    def once(repack: bool):
        with Backend.load(path, BackendParams(n_threads=1, repack=repack)) as backend:
            with backend.new_context() as ctx:
                y = backend.get("b").mulmat(ctx.from_numpy(np.ones((2, 64), np.float32)))
                ctx.compute(y)
                return y.numpy()

    for i in range(30):
        once(i % 2 == 0)
    gc.collect()
    start = rss_bytes()
    for i in range(200):
        out = once(i % 2 == 0)
    gc.collect()
    grown = rss_bytes() - start
    np.testing.assert_allclose(out, np.full((2, 16), 64.0), rtol=1e-2)
    assert grown < 4 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over 200 loads"


@pytest.mark.ci_may_skip
def test_gpu_layers_on_a_build_without_gpu_says_so(tmp_path, caplog):
    """gpu_layers asked for with no GPU backend built in: a warning and ``cpu_fallback``, not silence."""
    if any(d.kind in ("gpu", "igpu") for d in pyggml.devices()):
        pytest.skip("this build has a GPU backend")
    from pyggml.synthetic import write_synthetic

    path = write_synthetic(tmp_path / "tiny.gguf", "tiny", "f32")
    with caplog.at_level("WARNING", logger="pyggml.backend"):
        backend = Backend.load(path, BackendParams(gpu_layers="all", n_threads=1))
    try:
        assert "no GPU backend" in backend.cpu_fallback and "gpu_layers='all'" in backend.cpu_fallback
        assert backend.cpu_fallback in caplog.text
    finally:
        backend.close()
    plain = Backend.load(path, BackendParams(n_threads=1))
    assert plain.cpu_fallback is None
    plain.close()


def test_reserve_flags_the_outputs_later_computes_read(cpu):
    """ggml keeps the buffer plan of a reserve for any later graph with as many nodes whose tensors fit;
    a tensor read after compute (here top_k's ids, consumed by a later get_rows) must be flagged in the
    reserve too, or a later node (sum_rows) is placed over it. Context.reserve(*outputs) flags them."""
    def build(ctx, n):
        x = ctx.from_numpy(np.arange(n * 64, dtype=np.float32).reshape(n, 64))
        ids = x.top_k(8)
        return ids, x.reshape(1, 64, n).rows(ids), x.sum_rows()

    with cpu.new_context() as ctx:
        ctx.reserve(*build(ctx, 16))
    with cpu.new_context() as ctx:
        ids, vals, sums = build(ctx, 4)
        ctx.compute(ids, vals, sums)
        assert np.array_equal(np.sort(ids.numpy(), axis=1), np.tile(np.arange(56, 64), (4, 1)))
        assert np.array_equal(sums.numpy().reshape(-1), np.arange(4 * 64).reshape(4, 64).sum(axis=1))



@pytest.mark.parametrize("dtype", ["q4_0", "mxfp4", "iq4_nl", "q4_k", "q6_k", "q8_0"])
def test_expert_stacks_are_repacked_and_equal_the_plain_layout(tmp_path, dtype):
    """Quantized ``ffn_*_exps`` stacks go to the CPU's repacked layout where it has kernels for their type,
    as llama.cpp puts them (its mulmat_id kernels for them are the faster ones); the products equal the
    plain layout's, other ops on them are refused before ggml, and a 3-d weight that is not an expert stack
    (MLA's ``attn_k_b``, read by batched mulmat, which has no repacked kernel) stays plain and computes."""
    rng = np.random.default_rng(5)
    path = tmp_path / "experts.gguf"
    writer = gguf.GGUFWriter(path, arch="llama")
    qtype = DType[dtype.upper()]
    stack = quantize(rng.standard_normal((4 * 16, 256)).astype(np.float32), qtype).reshape(4, 16, -1)
    for name in ("blk.0.ffn_up_exps.weight", "blk.0.attn_k_b.weight"):  # 4 experts of 16 x 256
        writer.add_tensor(name, stack, raw_dtype=gguf.GGMLQuantizationType[dtype.upper()])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    x = rng.standard_normal((6, 1, 256)).astype(np.float32)  # 6 tokens, each through 2 experts
    ids = np.array([[0, 3], [1, 2], [3, 3], [2, 0], [1, 1], [0, 2]], np.int32)
    queries = rng.standard_normal((4, 3, 256)).astype(np.float32)

    def run(repack: bool):
        with Backend.load(path, BackendParams(n_threads=2, repack=repack)) as backend:
            experts, k_b = backend.get("blk.0.ffn_up_exps.weight"), backend.get("blk.0.attn_k_b.weight")
            repacked = "blk.0.ffn_up_exps.weight" in backend._repacked
            assert repack or not repacked
            assert "blk.0.attn_k_b.weight" not in backend._repacked
            with backend.new_context() as ctx:
                y = experts.mulmat_id(ctx.from_numpy(x), ctx.from_numpy(ids, DType.I32))
                z = k_b.mulmat(ctx.from_numpy(queries))
                ctx.compute(y, z)
                if repacked:
                    with pytest.raises(ValueError, match=r"repacked.*mulmat_id"):
                        experts.view(0, experts.shape, ctx=ctx)
                    with pytest.raises(ValueError, match="repacked"):
                        experts.mulmat(ctx.from_numpy(x.reshape(6, 256)))
                return y.numpy(), z.numpy(), repacked


    # a product ggml has no kernel for (a batched mulmat of the repacked stack) aborted the process: a
    # ValueError now, checked in a child
    child = textwrap.dedent(f"""
        import numpy as np, pytest
        from pyggml import Backend, BackendParams
        with Backend.load({str(path)!r}, BackendParams(n_threads=1)) as backend, backend.new_context() as ctx:
            experts = backend.get("blk.0.ffn_up_exps.weight")
            if "blk.0.ffn_up_exps.weight" in backend._repacked:
                with pytest.raises(ValueError, match="repacked.*mulmat_id"):
                    experts.mulmat(ctx.from_numpy(np.ones((4, 6, 256), np.float32)))
        print("done")
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr[-2000:]
    (plain, plain_z, _), (fast, fast_z, repacked) = run(False), run(True)
    if dtype in ("q4_0", "mxfp4", "iq4_nl", "q4_k") and platform.machine() in ("x86_64", "AMD64"):
        assert repacked, "ggml repacks these types for AVX2 and later"
    assert plain.shape == (6, 2, 16)
    np.testing.assert_allclose(fast, plain, rtol=0, atol=1e-5 * np.abs(plain).max())  # same Q8_0 activations
    np.testing.assert_array_equal(fast_z, plain_z)
