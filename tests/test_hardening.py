"""Issue 13 items 1-4 and 13: files that load must not crash on their first request, computed index
tensors must be bounded, parameter extremes are refused, header and count errors are clean, and a model
build/close keeps no memory.

Anything that used to abort the interpreter runs in a child process (``run_child``): a regression then
fails the test instead of killing the test run.
"""

from __future__ import annotations

import gc
import math
import os
import subprocess
import sys
import textwrap
import time
import weakref

import gguf
import numpy as np
import pytest

from pyggml import Backend, BackendParams, DType, GGUFError, models
from pyggml.models import ModelError

from .conftest import SHARED_MODELS

HIDDEN, FFN, HEADS, KV, VOCAB = 32, 64, 4, 2, 300


def write_llama(path, meta=None, *, block_count=1):
    """A small llama GGUF (F32 weights, a 300-token SPM vocab); ``meta`` overrides metadata by full key
    (a float value is written as FLOAT32, an int as UINT32/UINT64)."""
    writer = gguf.GGUFWriter(path, "llama")
    meta = dict(meta or {})
    defaults = {"llama.block_count": block_count, "llama.embedding_length": HIDDEN,
                "llama.feed_forward_length": FFN, "llama.attention.head_count": HEADS,
                "llama.attention.head_count_kv": KV, "llama.context_length": 128,
                "llama.attention.layer_norm_rms_epsilon": 1e-5}
    for key, value in {**defaults, **meta}.items():
        if isinstance(value, float):
            writer.add_float32(key, value)
        elif value >= 2**32:
            writer.add_uint64(key, value)
        else:
            writer.add_uint32(key, value)
    writer.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [f"▁w{i}" for i in range(41)]
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * 41)
    rng = np.random.default_rng(0)
    kv_dim = KV * HIDDEN // HEADS
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,), "output.weight": (VOCAB, HIDDEN)}
    for i in range(block_count):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
            f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN), f"blk.{i}.attn_k.weight": (kv_dim, HIDDEN),
            f"blk.{i}.attn_v.weight": (kv_dim, HIDDEN), f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN), f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, FFN)})
    for name, shape in shapes.items():
        writer.add_tensor(name, (0.1 * rng.standard_normal(shape)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def run_child(tmp_path, body: str, timeout: int = 240) -> str:
    """Run ``body`` in a fresh interpreter (after common imports); returns its stdout. The child must
    exit 0: a native abort or segfault fails the test with the child's output."""
    script = tmp_path / "child.py"
    script.write_text("import math, sys\nimport numpy as np\nfrom pyggml import Backend, DType\n"
                      "from pyggml.tensor import quantize\n" + textwrap.dedent(body))
    env = dict(os.environ, GGML_NO_BACKTRACE="1", PYTHONFAULTHANDLER="1")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, f"child died with {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


# The cases each print "REFUSED <label>" (a ValueError/TypeError before ggml was reached) or "RAN <label>".
REFUSE_HELPER = """
b = Backend.cpu(n_threads=1)
def F(c, *shape, seed=0):
    return c.from_numpy(np.random.default_rng(seed).random(tuple(reversed(shape))).astype(np.float32))
def attempt(label, fn):
    try:
        with b.new_context(max_nodes=256) as c:
            out = fn(c)
            if out is not None:
                c.compute(out)
                out.numpy()
        print("RAN", label, flush=True)
    except (ValueError, TypeError) as e:
        print("REFUSED", label, "|", e, flush=True)
"""


def refused_labels(out: str) -> tuple[set[str], dict[str, str]]:
    refused, messages = set(), {}
    for line in out.splitlines():
        if line.startswith("REFUSED "):
            label, _, message = line[len("REFUSED "):].partition(" | ")
            refused.add(label)
            messages[label] = message
    return refused, messages


# ---- item 1: hyper-parameters and weight types are checked at load ---------------------------------
@pytest.mark.parametrize("key, value", [
    ("llama.attention.layer_norm_rms_epsilon", -1.0),
    ("llama.attention.layer_norm_rms_epsilon", math.nan),
    ("llama.attention.layer_norm_rms_epsilon", math.inf),
    ("llama.context_length", 2**32 - 1),
    ("llama.context_length", 0),
    ("llama.embedding_length", 2**40),
    ("llama.feed_forward_length", 0),
    ("llama.attention.head_count_kv", HEADS * 2),
    ("llama.rope.dimension_count", 2 * HIDDEN),
    ("llama.rope.freq_base", math.nan),
    ("llama.rope.freq_base", -10000.0),
    ("llama.rope.scaling.factor", math.inf),
])
def test_bad_hyperparameters_refused_at_load(tmp_path, key, value):
    path = write_llama(tmp_path / "m.gguf", {key: value})
    with pytest.raises(ModelError, match=key.replace(".", r"\.")):
        models.load(path, BackendParams(n_threads=1))


def test_good_file_still_loads(tmp_path):
    path = write_llama(tmp_path / "m.gguf")
    model = models.load(path, BackendParams(n_threads=1))
    assert model.options.eps == pytest.approx(1e-5) and model.options.context_length == 128
    model.close()


def retype_tensor(path, name: str, dtype: DType, ne0: int) -> None:
    """Patch the GGUF tensor-info entry of ``name`` (written as 2-d I8 bytes of the same size) to ``dtype``
    with ``ne0`` columns (gguf-py's size table for Q8_1 disagrees with ggml's, so it cannot write one)."""
    import struct

    data = bytearray(path.read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key) + len(key)
    n_dims, ne0_old = struct.unpack_from("<IQ", data, at)
    assert n_dims == 2 and struct.unpack_from("<I", data, at + 4 + 16)[0] == gguf.GGMLQuantizationType.I8
    assert ne0_old == ne0 // dtype.block_size * dtype.type_size
    struct.pack_into("<Q", data, at + 4, ne0)
    struct.pack_into("<I", data, at + 4 + 16, int(dtype))
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("qtype", [DType.Q8_1, DType.Q8_K])
def test_intermediate_weight_type_refused_at_load(tmp_path, qtype):
    """token_embd stored as Q8_1 segfaulted in the first request's get_rows (Q8_K aborted)."""
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, qtype.type_size), np.int8),
                      raw_dtype=gguf.GGMLQuantizationType.I8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    retype_tensor(path, "token_embd.weight", qtype, qtype.block_size)
    with pytest.raises(GGUFError, match=f"token_embd.weight.*{qtype.name}"):
        Backend.load(path, BackendParams(n_threads=1))


@pytest.mark.parametrize("name, dtype, use", [("token_embd.weight", DType.I32, "embedding table"),
                                              ("blk.0.attn_norm.weight", DType.I32, "norm weight"),
                                              ("blk.0.attn_q.weight", DType.I32, "matrix-product weight")])
def test_weight_type_unusable_for_its_use_refused_at_load(tmp_path, name, dtype, use):
    """A weight in a type ggml has no kernel for in its use failed on the first request; now at load."""
    import struct

    path = write_llama(tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key) + len(key)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, int(dtype))  # F32 -> I32: the same bytes
    path.write_bytes(bytes(data))
    with pytest.raises(ModelError, match=f"{name.replace('.', '[.]')}.*{dtype.name}.*{use}"):
        models.load(path, BackendParams(n_threads=1))


def test_intermediate_types_refused_by_ops(tmp_path):
    out = run_child(tmp_path, REFUSE_HELPER + """
for t in ("Q8_1", "Q8_K"):
    dt = DType.parse(t)
    table = b.alloc_persistent(dt, (dt.block_size, 4))
    attempt(f"rows {t}", lambda c: table.rows(c.from_numpy(np.array([0, 1], np.int32))))
    attempt(f"cast from {t}", lambda c: table.cast(DType.F32, ctx=c))
    attempt(f"cast to {t}", lambda c: F(c, dt.block_size, 2).cast(dt))
    attempt(f"copy from {t}", lambda c: table.copy(c.empty(DType.F32, dt.block_size, 4)))
    try:
        quantize(np.ones((2, dt.block_size), np.float32), dt)
        print("RAN", f"quantize {t}")
    except (ValueError, TypeError) as e:
        print("REFUSED", f"quantize {t}", "|", e)
""")
    refused, _ = refused_labels(out)
    expected = {f"{op} {t}" for t in ("Q8_1", "Q8_K") for op in ("rows", "cast from", "cast to", "copy from",
                                                                   "quantize")}
    assert expected <= refused, out


# ---- item 2: index tensors computed in the graph ---------------------------------------------------------
def test_computed_indices_are_bounded(tmp_path):
    out = run_child(tmp_path, REFUSE_HELPER + """
attempt("rows argmax too wide", lambda c: F(c, 4, 3).rows(F(c, 100, 2).argmax()))
attempt("rows argsort too wide", lambda c: F(c, 4, 3).rows(F(c, 10).argsort()))
attempt("rows view of argsort", lambda c: F(c, 4, 3).rows(F(c, 10, 2).argsort().view(0, (2,))))
attempt("rows cast", lambda c: F(c, 4, 3).rows(F(c, 2).scale(1e6).cast(DType.I32)))
attempt("rows persistent", lambda c: F(c, 4, 3).rows(b.alloc_persistent(DType.I32, (2,))))
attempt("mulmat_id top_k too many experts",
        lambda c: F(c, 8, 3, 2).mulmat_id(F(c, 8, 1, 2), F(c, 5, 2).top_k(1)))
attempt("set_rows argsort too wide",
        lambda c: b.alloc_persistent(DType.F32, (8, 3)).set_rows(F(c, 8, 6), F(c, 6).argsort()))
attempt("rows from rows of argsort",
        lambda c: F(c, 4, 3).rows(F(c, 9).argsort().rows(c.from_numpy(np.array([0, 1], np.int32)))))

def overwrite_index(c):  # the copy runs first and replaces the checked values
    idx = c.from_numpy(np.array([0, 1], np.int32))
    c.forward(F(c, 2).scale(1e6).cast(DType.I32).copy(idx))
    return F(c, 4, 3).rows(idx)
attempt("copy into index input", overwrite_index)
""")
    refused, messages = refused_labels(out)
    assert refused == {"rows argmax too wide", "rows argsort too wide", "rows view of argsort", "rows cast",
                       "rows persistent", "mulmat_id top_k too many experts", "set_rows argsort too wide",
                       "rows from rows of argsort", "copy into index input"}, out
    assert "over 100 entries" in messages["rows argmax too wide"] and "at most 3" in messages["rows argmax too wide"]
    assert "graph input" in messages["rows cast"]


def test_bounded_computed_indices_compute(cpu):
    """Indices from argmax/argsort/top_k over at most the indexed dimension are accepted and correct."""
    rng = np.random.default_rng(3)
    table = rng.standard_normal((5, 4)).astype(np.float32)  # 5 rows of 4
    scores = rng.standard_normal((3, 5)).astype(np.float32)  # 3 rows of 5 scores
    with cpu.new_context() as ctx:
        t, s = ctx.from_numpy(table), ctx.from_numpy(scores)
        by_argmax = t.rows(s.argmax())
        by_order = t.rows(s.argsort().view(0, (5,)))  # the first row's order
        experts = ctx.from_numpy(rng.standard_normal((5, 6, 4)).astype(np.float32))  # (K=4, M=6, E=5)
        x = ctx.from_numpy(rng.standard_normal((3, 1, 4)).astype(np.float32))  # (K, 1, N=3)
        ids = s.top_k(2)  # (2, 3): two experts per column
        moe = experts.mulmat_id(x, ids)
        ctx.compute(by_argmax, by_order, moe, ids)
        np.testing.assert_allclose(by_argmax.numpy(), table[scores.argmax(axis=1)])
        np.testing.assert_allclose(by_order.numpy(), table[np.argsort(scores[0], kind="stable")])
        chosen = ids.numpy()  # (3, 2)
        assert set(chosen.ravel()) <= set(range(5))
        e_np, x_np = experts.numpy(), x.numpy()
        want = np.stack([np.stack([e_np[chosen[n, u]] @ x_np[n, 0] for u in range(2)]) for n in range(3)])
        np.testing.assert_allclose(moe.numpy(), want, rtol=1e-5, atol=1e-5)


def test_input_indices_still_checked_at_compute(cpu):
    with cpu.new_context() as ctx:
        idx = ctx.from_numpy(np.array([0, 7], np.int32), name="idx")
        y = ctx.from_numpy(np.ones((3, 4), np.float32)).rows(idx.reshape(2))
        with pytest.raises(ValueError, match="index 7 out of range 0..2"):
            ctx.compute(y)
        ctx.set_input("idx", np.array([2, 0], np.int32))
        ctx.compute(y)
        assert y.numpy().shape == (2, 4)


# ---- item 3: other aborts --------------------------------------------------------------------------------
def test_parameter_extremes_refused(tmp_path):
    out = run_child(tmp_path, REFUSE_HELPER + """
for op in ("rms_norm", "norm", "l2_norm"):
    for eps in (-1.0, float("nan"), -1e-30, float("inf")):
        attempt(f"{op} {eps}", lambda c: getattr(F(c, 8, 2), op)(eps))
for pad in (float("nan"), float("inf"), -1.0, 1e9):
    attempt(f"pool {pad}", lambda c: F(c, 8, 8).avg_pool_2d(2, 2, pad))
attempt("pool stride huge", lambda c: F(c, 8, 8).avg_pool_2d(2, 2**40))
attempt("softmax max_bias no mask", lambda c: F(c, 8, 2).softmax(None, 1.0, 8.0))
attempt("empty overflow", lambda c: c.empty(DType.F32, 2**32, 2**32, 2**32))
attempt("empty huge", lambda c: c.empty(DType.F32, 2**31, 2**31, 2**2))
attempt("mulmat overflow", lambda c: c.empty(DType.F32, 1, 2**40).mulmat(c.empty(DType.F32, 1, 2**40)))
attempt("repeat overflow", lambda c: F(c, 2).repeat(2**62))
attempt("pad overflow", lambda c: F(c, 2).pad(2**40))
attempt("rope n_ctx_orig huge", lambda c: F(c, 8, 2, 3).rope(c.from_numpy(np.arange(3, dtype=np.int32)), 8, 1e4,
                                                             n_ctx_orig=2**32 - 1))
attempt("conv stride huge", lambda c: F(c, 8, 8, 3).conv_2d(F(c, 3, 3, 3, 4), 2**40, 1))
attempt("persistent overflow", lambda c: b.alloc_persistent(DType.F32, (2**40, 2**40)) and None)
print("done")
""")
    refused, messages = refused_labels(out)
    assert "done" in out
    assert not [line for line in out.splitlines() if line.startswith("RAN")], out
    assert "eps must be a finite number >= 0" in messages["rms_norm -1.0"]
    assert "needs a mask" in messages["softmax max_bias no mask"]


def test_thread_count_capped():
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"n_threads=100000 is more than \d+ \(4 per logical CPU"):
        Backend.cpu(n_threads=100_000)
    with pytest.raises(ValueError, match="n_threads=1000 "):
        Backend(BackendParams(n_threads=1000))
    assert time.perf_counter() - start < 2
    with Backend.cpu(n_threads=min(4, 4 * (os.cpu_count() or 1))) as b:
        assert b.n_threads >= 1


def test_poll_level_checked_and_any_level_computes():
    for bad in (-1, 101, 1.5, True, "50"):
        with pytest.raises(ValueError, match="poll must be an integer from 0 to 100"):
            Backend(BackendParams(n_threads=1, poll=bad))
    assert BackendParams().poll == 1  # idle workers soon sleep: docs/server.md, "Threads under contention"
    for level in (0, 50, 100):
        with Backend(BackendParams(n_threads=2, poll=level)) as b, b.new_context() as ctx:
            x = ctx.from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
            out = x.mulmat(x)
            ctx.compute(out)
            assert out.numpy().tolist() == [[5.0, 14.0], [14.0, 50.0]]


def test_free_cores_follows_the_busy_processes(monkeypatch):
    """FreeCores: a core that other processes kept busy half of a window or more is taken (the
    median of the last SAMPLES windows); never fewer than 1 thread, never more than asked."""
    import pyggml.backend.hardware as hardware

    busy = 0.0
    monkeypatch.setattr(hardware, "cpu_busy_seconds", lambda cpus: busy)
    free = hardware.FreeCores(2)  # its first window starts here
    free.cpus = [0, 1]
    assert free() == 2 and free() == 2  # too soon: no window has ended yet
    seen = []
    for load in (2.0, 2.0, 0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 5.0, 5.0):
        free._last = (time.monotonic() - 1.0, busy, time.process_time())  # a window of one second...
        busy += load  # ...in which other processes kept `load` cores busy
        seen.append(free())
    assert seen == [1, 1, 1, 2, 2, 2, 1, 1, 1, 1], seen
    monkeypatch.setattr(hardware, "cpu_busy_seconds", lambda cpus: None)  # no /proc/stat: all threads
    free = hardware.FreeCores(2)
    assert free() == 2 and free() == 2


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads Linux's /proc/stat")
def test_free_cores_sees_busy_processes():
    from pyggml.backend.hardware import FreeCores

    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        free = FreeCores(2)
        time.sleep(0.5)
        free()
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert free.busy[-1] >= 0.75 * min(2, len(free.cpus)), list(free.busy)


def test_a_busy_machine_computes_with_fewer_threads_and_the_same_result(monkeypatch):
    import pyggml.backend.hardware as hardware

    with pytest.raises(ValueError, match="adapt_threads must be True or False"):
        Backend(BackendParams(n_threads=2, adapt_threads="yes"))
    monkeypatch.setattr(hardware.FreeCores, "SAMPLE_S", 0.0)
    monkeypatch.setattr(hardware.FreeCores, "FIRST_S", 0.0)
    busy = iter(range(0, 10**9, 10**6))  # every window: a million seconds of other processes' work
    monkeypatch.setattr(hardware, "cpu_busy_seconds", lambda cpus: next(busy))
    results = {}
    for adapt in (False, True):
        with Backend(BackendParams(n_threads=2, adapt_threads=adapt)) as b, b.new_context() as ctx:
            x = ctx.from_numpy(np.arange(64 * 48, dtype=np.float32).reshape(48, 64) / 100)
            out = x.mulmat(x).softmax()
            ctx.compute(out)  # the first window (from the backend's start) has ended
            results[adapt] = (b._threads_now, out.numpy())
    assert results[False][0] == 2 and results[True][0] == 1
    np.testing.assert_array_equal(results[False][1], results[True][1])


# ---- item 4: clean messages and early count checks -------------------------------------------------------
def test_four_byte_file_message(tmp_path):
    path = tmp_path / "magic.gguf"
    path.write_bytes(b"GGUF")
    with pytest.raises(GGUFError) as info:
        Backend.load(path)
    assert "truncated" in str(info.value) and "not b'GGUF'" not in str(info.value)
    path.write_bytes(b"GGU")
    with pytest.raises(GGUFError, match=r"starts with b'GGU', not b'GGUF'"):
        Backend.load(path)


def test_huge_block_count_fails_fast(tmp_path):
    path = write_llama(tmp_path / "m.gguf", {"llama.block_count": 10**6})
    start = time.perf_counter()
    with pytest.raises((GGUFError, ModelError), match=r"block_count.*1000000"):
        models.load(path, BackendParams(n_threads=1))
    assert time.perf_counter() - start < 10


def test_context_length_overflow_is_a_model_error(tmp_path):
    path = write_llama(tmp_path / "m.gguf", {"llama.context_length": 2**32 - 1})
    with pytest.raises(ModelError, match=r"llama\.context_length.*4294967295"):
        models.load(path, BackendParams(n_threads=1))


# ---- item 13: a model build/close keeps nothing ------------------------------------------------------
def test_closed_model_is_freed_without_gc(tmp_path):
    """close() + dropping the model frees it at once: nothing waits for the cyclic garbage collector
    (the model -> cache -> model.shift cycle kept ~2.5 MB per build of a 32k-vocab model)."""
    path = write_llama(tmp_path / "m.gguf")
    gc.collect()
    gc.disable()
    try:
        model = models.load(path, BackendParams(n_threads=1))
        refs = [weakref.ref(model), weakref.ref(model.backend), weakref.ref(model.tokenizer)]
        model.close()
        del model
        assert [r() is None for r in refs] == [True, True, True]
    finally:
        gc.enable()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_no_leak_model_build_close():
    """40 builds and closes of llama-2-tiny-random (32k vocab) without a garbage collection in between:
    RSS stays flat (it grew ~2.5 MB per cycle while closed models waited for the collector)."""
    path = SHARED_MODELS / "llama-2-tiny-random.gguf"
    if not path.exists():
        pytest.skip(f"{path} not present")
    params = BackendParams(n_threads=1)
    for _ in range(5):
        models.load(path, params).close()
    gc.collect()
    gc.disable()
    try:
        start = rss_bytes()
        for _ in range(40):
            models.load(path, params).close()
        grown = rss_bytes() - start
    finally:
        gc.enable()
    assert grown < 24 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over 40 model builds"


def test_graphs_with_named_inputs_are_freed_without_gc(cpu):
    """A graph's state (its ggml context: ~3 MB of address space for the default node count) goes when its
    context is closed and dropped; named inputs used to form a cycle state -> tensor -> context -> state."""
    from pyggml.backend import _GraphState

    def live_states() -> int:
        return sum(isinstance(o, _GraphState) for o in gc.get_objects())

    gc.collect()
    gc.disable()
    try:
        before = live_states()
        for _ in range(5):
            with cpu.new_context() as ctx:
                x = ctx.from_numpy(np.ones(4, np.float32), name="x")
                y = x * 2.0
                ctx.compute(y)
                ctx.set_input("x", np.full(4, 3.0, np.float32))
                ctx.compute(y)
                assert y.numpy().tolist() == [6.0] * 4 and ctx.input_shape("x") == (4,)
            del ctx, x, y
        assert live_states() == before
    finally:
        gc.enable()
