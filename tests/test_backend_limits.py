"""Backend-level limits (issue 25, items 3 and 9): graph sizes are bounded and checked before ggml
allocates, a result is never read after another thread's compute overwrote it, and integer inputs
that do not fit their tensor type are refused instead of wrapped around."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import pyggml
from pyggml import Backend


def run_child(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)


def test_huge_max_nodes_is_refused_not_aborted():
    """``new_context(max_nodes=2**28)`` asked ggml_init for ~100 GB and aborted in GGML_ASSERT."""
    done = run_child("""
        import resource
        import pyggml
        from pyggml import Backend
        backend = Backend.cpu(n_threads=1)
        for n in (2**28, 2**40, 1.5, True, "8"):
            try:
                backend.new_context(max_nodes=n)
                print("accepted", n)
            except ValueError as e:
                assert "max_nodes" in str(e), e
        # under a memory limit, the largest allowed graph is a MemoryError, not an abort
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        try:
            backend.new_context(max_nodes=pyggml.backend.MAX_GRAPH_NODES)
        except MemoryError as e:
            assert "bytes for a graph" in str(e), e
        print("done")
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "accepted" not in done.stdout and "done" in done.stdout


def test_largest_graph_still_builds(cpu):
    with cpu.new_context(max_nodes=pyggml.backend.MAX_GRAPH_NODES) as ctx:
        x = ctx.from_numpy(np.arange(4, dtype=np.float32))
        y = x * 2
        ctx.compute(y)
        np.testing.assert_array_equal(y.numpy(), [0, 2, 4, 6])


# ---- item 9: threads sharing one Backend ------------------------------------------------------------
class _ComputeDuringRead:
    """Stands in for the cffi ``lib`` of pyggml.tensor: before the first result copy it lets another
    thread compute a graph of the same shape on the same backend (the interleaving that returned
    another thread's result), waiting at most a second for it."""

    def __init__(self, real, other: threading.Thread):
        self._real, self._other = real, other

    def __getattr__(self, name):
        value = getattr(self._real, name)
        if name != "ggml_backend_tensor_get" or self._other is None:
            return value
        other, self._other = self._other, None
        other.start()
        other.join(timeout=1.0)  # with the read holding the backend, the other compute waits
        return value


def test_a_result_is_never_another_threads(monkeypatch):
    import pyggml.tensor

    backend = Backend.cpu(n_threads=1)
    results = {}

    def compute(k: float):
        with backend.new_context() as ctx:
            y = ctx.from_numpy(np.arange(64, dtype=np.float32)) * k
            ctx.compute(y)
            try:
                results[k] = y.numpy()
            except ValueError as e:  # refused: also allowed, never someone else's numbers
                results[k] = e

    other = threading.Thread(target=compute, args=(3.0,))
    monkeypatch.setattr(pyggml.tensor, "lib", _ComputeDuringRead(pyggml.tensor.lib, other))
    compute(2.0)
    other.join()
    monkeypatch.undo()
    for k, got in results.items():
        if not isinstance(got, ValueError):
            np.testing.assert_array_equal(got, np.arange(64) * k)
    assert not isinstance(results[2.0], ValueError)  # serialised: the first read finished before the compute
    backend.close()


def test_threads_on_one_backend_get_their_own_results_or_a_refusal():
    backend = Backend.cpu(n_threads=1)
    wrong, refused = [], []

    def worker(k: int):
        for _ in range(30):
            with backend.new_context() as ctx:
                y = ctx.from_numpy(np.full(4096, k, dtype=np.float32)) + 0.0
                ctx.compute(y)
                try:
                    got = y.numpy()
                except ValueError as e:
                    assert "another graph" in str(e)
                    refused.append(k)
                    continue
                if not (got == k).all():
                    wrong.append(k)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    backend.close()
    assert wrong == []


# ---- item 9: integer inputs ------------------------------------------------------------------------
@pytest.mark.parametrize("values, dtype", [([2**62], "i32"), ([-(2**31) - 1], "i32"), ([2**31], "i32"),
                                           ([2**63 - 1], "i16"), ([300], "i8"), ([2**64 - 1], "i32")])
def test_integers_that_do_not_fit_are_refused(cpu, values, dtype):
    """2**62 given for an I32 input became 0 (numpy's astype wraps around)."""
    with cpu.new_context() as ctx:
        source = np.array(values, dtype=np.uint64 if values[0] >= 2**63 else np.int64)
        with pytest.raises(ValueError, match="do not fit"):
            ctx.from_numpy(source, dtype)
        ctx.from_numpy(np.zeros(len(values), np.int8), dtype, name="ids")
        with pytest.raises(ValueError, match="do not fit"):
            ctx.set_input("ids", source)


def test_integers_that_fit_are_converted(cpu):
    with cpu.new_context() as ctx:
        x = ctx.from_numpy(np.array([-(2**31), 5, 2**31 - 1], dtype=np.int64), "i32")
        ctx.compute(x)
        np.testing.assert_array_equal(x.numpy(), [-(2**31), 5, 2**31 - 1])
        assert x.numpy().dtype == np.int32
