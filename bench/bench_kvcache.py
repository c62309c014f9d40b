"""Per-step cost of the KV cache bookkeeping (`Cells.place` + `Cells.mask`).

Target: under 0.2 ms for a decode step of 8 sequences (one token each) sharing
4,096 cells, nearly all in use so that the mask is ~8 x 4,096.

    PYTHONPATH=src python -m pytest bench/bench_kvcache.py --benchmark-only
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pyggml.kvcache.cells import Cells

N_SEQ, CAPACITY, PROMPT = 8, 4096, 480  # 8 x 480 = 3,840 cells in use
SEQS = np.arange(N_SEQ, dtype=np.int32)


def filled(**options) -> Cells:
    cells = Cells(CAPACITY, N_SEQ, **options)
    for s in range(N_SEQ):
        cells.place(np.arange(PROMPT, dtype=np.int32), np.full(PROMPT, s, np.int32))
    return cells


def test_decode_step(benchmark):
    cells = filled()
    pos = np.full(N_SEQ, PROMPT, np.int32)

    def step() -> np.ndarray:
        cells.place(pos, SEQS)
        return cells.mask(pos, SEQS)

    def forget() -> None:  # untimed: every round places into free cells again
        for s in range(N_SEQ):
            cells.remove(s, PROMPT)

    mask = benchmark.pedantic(step, setup=forget, rounds=3000, warmup_rounds=100)
    assert mask.shape == (N_SEQ, (PROMPT + 1) * N_SEQ)


def test_decode_step_sliding_window(benchmark):
    cells = filled(swa_window=256)
    positions = itertools.count(PROMPT)

    def next_step() -> tuple[tuple[np.ndarray], dict]:
        return (np.full(N_SEQ, next(positions), np.int32),), {}

    def step(pos: np.ndarray) -> np.ndarray:
        cells.place(pos, SEQS)  # also drops each sequence's oldest cell
        return cells.mask(pos, SEQS)

    benchmark.pedantic(step, setup=next_step, rounds=3000, warmup_rounds=100)
    assert cells.free_count == CAPACITY - N_SEQ * 257


def test_prompt_batch(benchmark):
    cells = filled()
    for s in range(1, N_SEQ):
        cells.remove(s, 0)
    pos = np.arange(PROMPT, PROMPT + 512, dtype=np.int32)
    seqs = np.zeros(512, np.int32)

    def step() -> np.ndarray:
        cells.place(pos, seqs)
        return cells.mask(pos, seqs)

    def forget() -> None:
        cells.remove(0, PROMPT)

    mask = benchmark.pedantic(step, setup=forget, rounds=300, warmup_rounds=10)
    assert mask.shape == (512, PROMPT + 512)


@pytest.mark.parametrize("flash", [False, True], ids=["f32-mask", "flash-f16-mask"])
def test_causal_start_forward(benchmark, flash):
    """`Causal.start_forward` for a decode step (Cells work + the two graph inputs). Target < 0.2 ms."""
    from pyggml import Backend, BackendParams
    from pyggml.kvcache import Causal
    from pyggml.models import Batch

    backend = Backend(BackendParams(n_threads=1, flash_attention=flash))
    cache = Causal()
    cache.init(backend, max_sequences=N_SEQ, capacity=CAPACITY // N_SEQ, max_batch=512)
    assert cache.cells.capacity == CAPACITY
    for s in range(N_SEQ):
        cache.cells.place(np.arange(PROMPT, dtype=np.int32), np.full(PROMPT, s, np.int32))
    batch = Batch(inputs=[0] * N_SEQ, positions=[PROMPT] * N_SEQ, sequences=list(range(N_SEQ)))
    contexts = []

    def fresh() -> tuple[tuple, dict]:  # untimed: free the cells again and start a new graph
        for s in range(N_SEQ):
            cache.cells.remove(s, PROMPT)
        if contexts:
            contexts.pop().close()
        contexts.append(backend.new_context())
        return (contexts[-1],), {}

    benchmark.pedantic(lambda ctx: cache.start_forward(ctx, batch), setup=fresh, rounds=3000, warmup_rounds=100)
    padding = 256 if flash else 32
    assert cache._pass.n_kv == -(-(PROMPT + 1) * N_SEQ // padding) * padding
    contexts.pop().close()
    backend.close()


# ---- many sequences, each in its own stream of cells (the Runner's per-sequence cache) ----------------------
STREAMS, STREAM_CELLS, STREAM_PROMPT = 128, 512, 40


def test_streams_decode_step(benchmark):
    """One decode step of 128 sequences in streams of 512 cells: `place` and the stream mask. The streams'
    extents are kept as cells are added, not recounted from all 65,536 cells each step."""
    cells = Cells(STREAMS * STREAM_CELLS, STREAMS, per_sequence=True)
    seqs = np.arange(STREAMS, dtype=np.int32)
    for p in range(STREAM_PROMPT):
        cells.place(np.full(STREAMS, p, np.int32), seqs)
    pos = np.full(STREAMS, STREAM_PROMPT, np.int32)

    def step() -> np.ndarray:
        cells.place(pos, seqs)
        return cells.stream_mask(pos, seqs, int(cells.stream_extents(32).max()))

    def forget() -> None:  # untimed: the next round places the same position again
        for s in range(STREAMS):
            cells.remove(s, STREAM_PROMPT)

    benchmark.pedantic(step, setup=forget, rounds=500, warmup_rounds=20)


def test_streams_admission_remove(benchmark):
    """A request admitted into a used slot first forgets what the slot held (`Cache.plan_remove`, then its
    commit) at 128 sequences x 4,096 cells: checked in place, not planned on a copy of the cells (whose
    membership is 128 x 524,288 booleans)."""
    from pyggml import Backend, BackendParams
    from pyggml.kvcache import Causal

    backend = Backend(BackendParams(n_threads=1))
    cache = Causal()
    cache.init(backend, max_sequences=STREAMS, capacity=4096, max_batch=512)
    seqs = np.arange(STREAMS, dtype=np.int32)
    slot = itertools.cycle(range(STREAMS))

    def fill() -> tuple[tuple, dict]:  # untimed: the slot holds 8 positions again
        s = next(slot)
        cache.cells.place(np.arange(8, dtype=np.int32), np.full(8, s, np.int32))
        return (s,), {}

    for p in range(8):
        cache.cells.place(np.full(STREAMS, p, np.int32), seqs)
    for s in range(STREAMS):
        cache.cells.remove(s, 0)
    benchmark.pedantic(lambda s: cache.plan_remove(s, 0)(), setup=fill, rounds=200, warmup_rounds=5)
    backend.close()


def test_streams_snapshot(benchmark):
    """A snapshot of 128 per-sequence streams of 4,096 cells (what a cache wrapper takes around a graph build,
    and, before, around every refill): the cells' arrays, with no (sequences, cells) membership matrix."""
    import copy

    cells = Cells(STREAMS * 4096, STREAMS, per_sequence=True)
    seqs = np.arange(STREAMS, dtype=np.int32)
    for p in range(8):
        cells.place(np.full(STREAMS, p, np.int32), seqs)
    benchmark.pedantic(copy.deepcopy, args=(cells,), rounds=30, warmup_rounds=2)
