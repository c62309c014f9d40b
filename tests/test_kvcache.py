"""KV caches on the real CPU backend: Causal (stored data, masks, removal, shift, reserve), Encoder,
Wrapper, and the llama model generating through the cache.

Keys are digit-coded so stored tables read directly: ``code(seq, pos, dim, head) =
seq·dim·head·pos`` as decimal digits (the last two for the position), e.g. 11203 is sequence 1,
dim 1, head 2, position 3; values are the negated codes. ``contents`` names each cell "seq:pos"
from its stored key ("-" when free). Mask tables are one string per batch row, one character per
cell: ``x`` visible, ``.`` hidden.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import pyggml
from pyggml import Backend, BackendParams, DType
from pyggml.kvcache import CacheConfig, CacheFullError, Causal, Cells, Encoder, NotSupportedError, Wrapper
from pyggml.models import Batch, Multimodal, MultimodalIndex
from pyggml.synthetic import write_model

from ._models import scaled_error

DK, HEADS, DV = 4, 2, 2
ROPE = 10000.0
QK_SCALE = 0.5


def rope_shift(ctx, layer, key, shift):
    return key.rope(shift, DK, ROPE)


def code(seq: int, pos: int, dim: int, head: int) -> int:
    return 10000 * seq + 1000 * (dim + 1) + 100 * (head + 1) + pos


def coded_keys(pairs) -> np.ndarray:
    """numpy (n, HEADS, DK), i.e. ggml (DK, HEADS, n)."""
    return np.array([[[code(s, p, d, h) for d in range(DK)] for h in range(HEADS)] for s, p in pairs], np.float32)


def coded_values(pairs) -> np.ndarray:
    return -coded_keys(pairs)[:, :, :DV]


def table(mask: np.ndarray) -> list[str]:
    return ["".join("x" if v == 0 else "." for v in row) for row in mask]


def make(backend, dtype=DType.F32, *, shift_fn=rope_shift, max_sequences=1, capacity=8, max_batch=8, padding=1,
         unified=True, **options) -> Causal:
    """A cache whose cells all sequences share (``unified``), so that tables show them side by side."""
    cache = Causal(shift_fn, unified=unified, **options)
    cache.set_config(CacheConfig(padding=padding))
    cache.init(backend, dtype, max_sequences=max_sequences, capacity=capacity, max_batch=max_batch)
    return cache


def batch_of(pairs, **extra) -> Batch:
    return Batch(inputs=[0] * len(pairs), positions=[p for _, p in pairs], sequences=[s for s, _ in pairs], **extra)


def step(cache, backend, *pairs, noncausal=(), layers=(0,), keys=None, values=None):
    """One forward pass storing coded keys/values in ``layers``; returns what ``get`` gave for the
    last layer: (mask, key view, value view) as numpy."""
    keys = coded_keys(pairs) if keys is None else keys
    values = coded_values(pairs) if values is None else values
    with backend.new_context() as ctx:
        cache.start_forward(ctx, batch_of(pairs))
        for start, end in noncausal:
            cache.set_noncausal(start, end)
        for layer in layers:
            cache.set_layer(layer)
            cache.put(ctx, ctx.from_numpy(keys + 100000 * layer), ctx.from_numpy(values - 100000 * layer))
            key, value, mask = cache.get(ctx)
        ctx.compute(key, value, mask)
        return mask.numpy(), key.numpy(), value.numpy()


def contents(cache, layer=0) -> list[str]:
    """Each cell as "seq:pos" decoded from its stored key, "-" when free."""
    keys = cache.keys[layer].numpy()[:, 0] - 100000 * layer
    used = cache.cells.cell_positions >= 0
    return [f"{int(k) // 10000}:{int(k) % 100}" if u else "-" for k, u in zip(keys, used, strict=True)]


def state(cache) -> dict[str, np.ndarray]:
    """Bookkeeping arrays and tensor data, to check that a failed call changed nothing."""
    out = {f"cells.{k}": v.copy() for k, v in vars(cache.cells).items() if isinstance(v, np.ndarray)}
    for layer in cache.keys:
        out[f"k{layer}"], out[f"v{layer}"] = cache.keys[layer].numpy(), cache.values[layer].numpy()
    return out


def assert_same(before: dict[str, np.ndarray], cache) -> None:
    after = state(cache)
    assert before.keys() == after.keys()
    for k in before:
        np.testing.assert_array_equal(before[k], after[k], err_msg=k)


@pytest.fixture(scope="module")
def flash():
    backend = Backend(BackendParams(n_threads=1, flash_attention=True))
    yield backend
    backend.close()


# ---- Causal: data, masks, positions ---------------------------------------------------------


def test_single_sequence(cpu):
    cache = make(cpu, capacity=6)
    mask, key, value = step(cache, cpu, (0, 0), (0, 1), (0, 2))
    assert table(mask) == ["x..", "xx.", "xxx"]
    assert contents(cache) == ["0:0", "0:1", "0:2", "-", "-", "-"]
    # get's views are (head_dim, cells, heads): numpy (heads, cells, head_dim), no copy needed
    assert key.shape == (HEADS, 3, DK) and value.shape == (HEADS, 3, DV)
    assert key[1, 2].tolist() == [1202, 2202, 3202, 4202]  # head 1, position 2, dims 0..3
    assert value[0, 1].tolist() == [-1101, -2101]
    mask, key, _ = step(cache, cpu, (0, 3))
    assert table(mask) == ["xxxx"]
    assert key[0, :, 0].tolist() == [1100, 1101, 1102, 1103]
    assert cache.cells.seq_positions(0).tolist() == [0, 1, 2, 3]


def test_several_sequences_interleaved_in_one_batch(cpu):
    cache = make(cpu, max_sequences=3, capacity=4)
    mask, _, _ = step(cache, cpu, (0, 0), (1, 0), (0, 1), (1, 1), (2, 0))
    # fmt: off
    assert table(mask) == [
        "x....",
        ".x...",
        "x.x..",
        ".x.x.",
        "....x",
    ]
    # fmt: on
    assert contents(cache)[:5] == ["0:0", "1:0", "0:1", "1:1", "2:0"]
    mask, _, _ = step(cache, cpu, (2, 1), (0, 2))
    assert table(mask) == ["....xx.", "x.x...x"]


def test_overwriting_a_position_reuses_its_cell(cpu):
    cache = make(cpu)
    step(cache, cpu, (0, 0), (0, 1), (0, 2))
    keys = coded_keys([(0, 1)]) + 50
    mask, key, _ = step(cache, cpu, (0, 1), keys=keys, values=-keys[:, :, :DV])
    assert table(mask) == ["xx."]  # position 1 sees 0 and itself, not 2
    assert key[0, :, 0].tolist() == [1100, 1151, 1102]


def test_default_config_pads_the_mask_and_stores_f16(cpu, flash):
    cache = Causal(rope_shift, unified=True)
    cache.init(cpu, max_sequences=2, capacity=40, max_batch=8)  # F16 by default; CPU: padding 32, F32 mask
    assert cache.dtype == DType.F16 and cache.cells.capacity == 96
    mask, key, _ = step(cache, cpu, (0, 0), (1, 0), (0, 1))
    assert mask.dtype == np.float32 and mask.shape == (3, 32)
    assert table(mask)[2] == "x.x" + "." * 29
    assert cache.keys[0].dtype == DType.F16 and key[1, 2, 0] == 1201  # (F16 is exact up to 2048)
    cache = Causal(rope_shift)
    cache.init(flash, max_sequences=1, capacity=40, max_batch=8)  # flash attention: padding 256, F16 mask
    mask, _, _ = step(cache, flash, (0, 0), (0, 1))
    assert mask.dtype == np.float16 and mask.shape == (2, 256)
    assert table(mask) == ["x" + "." * 255, "xx" + "." * 254]


def test_init_again_starts_over_with_the_new_backend(cpu, flash):
    cache = Causal()
    cache.init(cpu, DType.F32, capacity=8)
    step(cache, cpu, (0, 0))
    cache.init(flash, DType.F16, capacity=8)  # no config set: the new backend's defaults
    assert cache.config.padding == 256 and cache.config.mask_dtype == DType.F16
    assert not cache.keys and cache.cells.free_count == 256
    cache.set_config(CacheConfig(padding=4))
    cache.init(flash, DType.F16, capacity=8)
    assert cache.cells.capacity == 8
    cache.close()
    with pytest.raises(ValueError, match="init"):
        step(cache, flash, (0, 0))


def test_cache_types(cpu, flash):
    for dtype in ("q8_0", "q4_0", "bf16", "q4_k"):
        with pytest.raises(ValueError, match="flash attention|not supported"):
            Causal().init(cpu, dtype)
    for dtype in (DType.F32, DType.F16, DType.Q8_0, DType.Q4_0):
        Causal().init(flash, dtype, capacity=16)
    with pytest.raises(ValueError, match="not supported"):
        Causal().init(flash, DType.BF16)
    bad = Causal()
    bad.set_config(CacheConfig(permuted_v=True))
    with pytest.raises(ValueError, match="permuted_v"):
        bad.init(flash)


def test_quantized_cache_keeps_values_to_block_precision(flash):
    cache = Causal()
    cache.set_config(CacheConfig(padding=1, mask_dtype=DType.F16))
    cache.init(flash, DType.Q8_0, capacity=4, max_batch=4)
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((2, HEADS, 32)).astype(np.float32)
    values = rng.standard_normal((2, HEADS, 32)).astype(np.float32)
    with flash.new_context() as ctx:
        cache.start_forward(ctx, batch_of([(0, 0), (0, 1)]))
        cache.put(ctx, ctx.from_numpy(keys), ctx.from_numpy(values))
        ctx.compute()
    stored = cache.keys[0].numpy()[:2].reshape(2, HEADS, 32)
    np.testing.assert_allclose(stored, keys, atol=0.02)
    with pytest.raises(ValueError, match="block"):
        with flash.new_context() as ctx:
            cache.set_layer(1)
            cache.start_forward(ctx, batch_of([(0, 2)]))
            cache.put(ctx, ctx.from_numpy(coded_keys([(0, 2)])), ctx.from_numpy(coded_values([(0, 2)])))


def test_sliding_window_drops_old_positions_and_can_resume(cpu):
    cache = make(cpu, swa_window=2, swa_memory=2, capacity=100, max_batch=2)
    assert cache.cells.capacity == 4  # memory + max_batch per sequence, whatever the context
    mask, _, _ = step(cache, cpu, (0, 0), (0, 1))
    assert table(mask) == ["x.", "xx"]
    mask, _, _ = step(cache, cpu, (0, 2), (0, 3))
    assert table(mask) == [".xx.", "..xx"]  # a row sees itself and one position back
    mask, _, _ = step(cache, cpu, (0, 4))
    assert contents(cache) == ["0:4", "-", "0:2", "0:3"]  # positions before 4 - 2 are gone
    assert table(mask) == ["x..x"]
    assert cache.can_resume(0, 5) and cache.can_resume(0, 4)
    assert not cache.can_resume(0, 2)  # would need positions 0 and 1 again
    step(cache, cpu, *[(0, p) for p in (5, 6)])
    step(cache, cpu, (0, 100))  # positions beyond the cells are fine: memory stays bounded
    assert cache.cells.seq_positions(0).tolist() == [100]


def test_sliding_window_memory_keeps_more_than_the_window(cpu):
    cache = make(cpu, swa_window=2, swa_memory=3, capacity=100, max_batch=1)
    for p in range(5):
        mask, _, _ = step(cache, cpu, (0, p))
    assert cache.cells.seq_positions(0).tolist() == [1, 2, 3, 4]
    assert contents(cache) == ["0:4", "0:1", "0:2", "0:3"] and table(mask) == ["x..x"]
    assert cache.can_resume(0, 3)  # the window of 3 is [1, 3): stored


def test_sliding_window_memory_defaults_to_the_window_plus_a_batch(cpu):
    """So that a sequence can resume (a cached prompt be reused) up to a batch before its newest position."""
    cache = make(cpu, swa_window=2, capacity=100, max_batch=3)
    assert cache.cells.capacity == 2 + 3 + 3 and cache.cells.swa_memory == 5
    for p in range(10):
        step(cache, cpu, (0, p))
    assert cache.cells.seq_positions(0).tolist() == [4, 5, 6, 7, 8, 9]  # 9 - 5 and later
    assert cache.can_resume(0, 10) and cache.can_resume(0, 7) and cache.can_resume(0, 6)
    assert not cache.can_resume(0, 5)  # its window [3, 5) is gone
    cache.remove(0, 7)  # a request sharing the first 7 positions goes on from there
    mask, _, _ = step(cache, cpu, (0, 7), (0, 8))
    assert cache.cells.seq_positions(0).tolist() == [4, 5, 6, 7, 8]
    assert [row.count("x") for row in table(mask)] == [2, 2]  # each row: itself and one back


def test_chunk_boundaries(cpu):
    cache = make(cpu, chunk_size=3)
    mask, _, _ = step(cache, cpu, *[(0, p) for p in range(7)])
    # fmt: off
    assert table(mask) == [
        "x......",
        "xx.....",
        "xxx....",
        "...x...",
        "...xx..",
        "...xxx.",
        "......x",
    ]
    # fmt: on
    mask, _, _ = step(cache, cpu, (0, 7))
    assert table(mask) == ["......xx"]  # nothing freed: chunks only mask


def test_noncausal_range_applies_to_the_pass_in_progress_only(cpu):
    cache = make(cpu)
    step(cache, cpu, (0, 0))
    mask, _, _ = step(cache, cpu, (0, 1), (0, 2), (0, 3), (0, 4), noncausal=[(1, 3)])
    # rows 1-2 (positions 2-3, an image) see each other both ways
    assert table(mask) == ["xx...", "xxxx.", "xxxx.", "xxxxx"]
    mask, _, _ = step(cache, cpu, (0, 5))
    assert table(mask) == ["xxxxxx"]
    with pytest.raises(ValueError, match="outside the batch"):
        step(cache, cpu, (0, 6), noncausal=[(0, 2)])
    with pytest.raises(ValueError, match="start_forward"):
        make(cpu).set_noncausal(0, 1)


def test_two_layers_have_their_own_storage(cpu):
    cache = make(cpu)
    step(cache, cpu, (0, 0), (0, 1), layers=(0, 1))
    assert contents(cache, 0)[:2] == contents(cache, 1)[:2] == ["0:0", "0:1"]
    assert cache.keys[1].numpy()[1, 0] == 100000 + 1101


# ---- Causal: removal, shift, sharing ----------------------------------------------------------


def test_remove_tail(cpu):
    cache = make(cpu)
    step(cache, cpu, *[(0, p) for p in range(4)])
    cache.remove(0, 2)
    assert contents(cache)[:4] == ["0:0", "0:1", "-", "-"]
    mask, key, _ = step(cache, cpu, (0, 2))
    assert table(mask) == ["xxx"] and key[0, :, 0].tolist() == [1100, 1101, 1102]
    cache.remove(0, 0)
    assert cache.cells.free_count == cache.cells.capacity


def roped(backend, raw: np.ndarray, positions) -> np.ndarray:
    """Keys (numpy (n, HEADS, DK)) rotated at ``positions`` from scratch."""
    with backend.new_context() as ctx:
        out = ctx.from_numpy(raw).rope(ctx.from_numpy(np.asarray(positions, np.int32)), DK, ROPE)
        ctx.compute(out)
        return out.numpy()


def put_roped(cache, backend, seq, raw, positions, layers=(0, 1)):
    """Store keys ``raw`` rotated at their positions (as a model does), values = raw[..., :DV]."""
    pairs = [(seq, p) for p in positions]
    with backend.new_context() as ctx:
        cache.start_forward(ctx, batch_of(pairs))
        pos = ctx.from_numpy(np.asarray(positions, np.int32))
        for layer in layers:
            cache.set_layer(layer)
            cache.put(ctx, ctx.from_numpy(raw + layer).rope(pos, DK, ROPE), ctx.from_numpy(raw[:, :, :DV] + layer))
            cache.get(ctx)
        ctx.compute()


def stored_keys(cache, seq, layer=0) -> np.ndarray:
    cells = cache.cells.seq_cells(seq)
    return cache.keys[layer].numpy()[cells].reshape(-1, HEADS, DK)


def test_remove_middle_shifts_and_rerotates_keys(cpu):
    cache = make(cpu)
    raw = np.random.default_rng(1).standard_normal((6, HEADS, DK)).astype(np.float32)
    put_roped(cache, cpu, 0, raw, range(6))
    cache.remove(0, 1, 3)  # positions 3, 4, 5 become 1, 2, 3
    assert cache.cells.seq_positions(0).tolist() == [0, 1, 2, 3]
    kept = raw[[0, 3, 4, 5]]
    for layer in (0, 1):  # every layer re-rotated
        np.testing.assert_allclose(stored_keys(cache, 0, layer), roped(cpu, kept + layer, range(4)), atol=1e-5)
    values = cache.values[0].numpy()[cache.cells.seq_cells(0)].reshape(-1, HEADS, DV)
    np.testing.assert_array_equal(values, kept[:, :, :DV])  # values move unchanged
    mask, _, _ = step(cache, cpu, (0, 4), layers=(0, 1))
    assert cache.cells.cell_positions[:6].tolist() == [0, 4, -1, 1, 2, 3]  # freed cell 1 reused
    assert table(mask) == ["xx.xxx"]


def test_remove_middle_of_a_shared_prefix_splits_cells(cpu):
    cache = make(cpu, max_sequences=2)
    raw = np.random.default_rng(2).standard_normal((5, HEADS, DK)).astype(np.float32)
    put_roped(cache, cpu, 0, raw, range(5))
    cache.copy_prefix(0, 1, 5)
    before_1 = stored_keys(cache, 1)
    cache.remove(0, 1, 2)
    np.testing.assert_array_equal(stored_keys(cache, 1), before_1)  # the other sequence keeps its keys
    np.testing.assert_allclose(stored_keys(cache, 0), roped(cpu, raw[[0, 2, 3, 4]], range(4)), atol=1e-5)
    assert cache.cells.seq_positions(1).tolist() == [0, 1, 2, 3, 4]
    assert len(set(cache.cells.seq_cells(0)) & set(cache.cells.seq_cells(1))) == 1  # only position 0 shared


def test_remove_middle_without_shift_support(cpu):
    cache = make(cpu, shift_fn=None)
    step(cache, cpu, *[(0, p) for p in range(4)])
    before = state(cache)
    with pytest.raises(NotSupportedError):
        cache.remove(0, 1, 2)
    assert_same(before, cache)
    cache.remove(0, 3, 10)  # nothing after the range: no shift needed
    cache.remove(0, 1)  # to the end: fine
    assert contents(cache)[:4] == ["0:0", "-", "-", "-"]
    mask, _, _ = step(cache, cpu, (0, 1))
    assert table(mask) == ["xx"]


def test_copy_prefix_then_diverging_sequences(cpu):
    cache = make(cpu, max_sequences=2)
    step(cache, cpu, *[(0, p) for p in range(4)])
    cache.copy_prefix(0, 1, 2)
    mask, key, _ = step(cache, cpu, (1, 2), (1, 3), (0, 4))
    assert contents(cache)[:7] == ["0:0", "0:1", "0:2", "0:3", "1:2", "1:3", "0:4"]
    # fmt: off
    assert table(mask) == [
        "xx..x..",
        "xx..xx.",
        "xxxx..x",
    ]
    # fmt: on
    cache.remove(1, 0)
    assert contents(cache)[:7] == ["0:0", "0:1", "0:2", "0:3", "-", "-", "0:4"]
    assert cache.can_resume(1, 0)


def test_cache_full_leaves_the_cache_unchanged(cpu):
    # every sequence has room for its own context, so only a sliding-window cache (cells for the
    # window + a batch) rewound without remove can run out
    cache = make(cpu, swa_window=1, swa_memory=1, capacity=100, max_batch=1)
    step(cache, cpu, (0, 5))
    step(cache, cpu, (0, 6))
    assert contents(cache) == ["0:5", "0:6"]
    before = state(cache)
    with cpu.new_context() as ctx, pytest.raises(CacheFullError):
        cache.start_forward(ctx, batch_of([(0, 3)]))
    assert_same(before, cache)
    with cpu.new_context() as ctx, pytest.raises(ValueError, match="start_forward"):
        cache.put(ctx, ctx.from_numpy(coded_keys([(0, 3)])), ctx.from_numpy(coded_values([(0, 3)])))
    mask, _, _ = step(cache, cpu, (0, 7))
    assert contents(cache) == ["0:7", "0:6"] and table(mask) == ["x."]


def test_position_beyond_the_context_is_refused_unchanged(cpu):
    cache = make(cpu, max_sequences=2, capacity=2)
    step(cache, cpu, (0, 0), (0, 1), (1, 0))
    before = state(cache)
    with pytest.raises(ValueError, match="beyond the cache's context"):
        step(cache, cpu, (1, 1), (1, 2))
    assert_same(before, cache)


def test_reserve_builds_worst_case_shapes_and_stores_nothing(cpu):
    cache = make(cpu, dtype=DType.F16, max_sequences=2, capacity=8, max_batch=4, padding=4)
    pairs = [(0, 0), (1, 0), (0, 1), (1, 1)]
    with cpu.new_context() as ctx:
        cache.start_forward(ctx, batch_of(pairs), reserve=True)
        cache.put(ctx, ctx.from_numpy(coded_keys(pairs)), ctx.from_numpy(coded_values(pairs)))
        key, value, mask = cache.get(ctx)
        assert key.shape == (DK, 16, HEADS) and value.shape == (DV, 16, HEADS) and mask.shape == (16, 4)
        ctx.forward(key.mulmat(ctx.from_numpy(np.ones((HEADS, 4, DK), np.float32))))
        ctx.reserve()
    assert cache.cells.free_count == 16
    assert not cache.keys[0].numpy().any()  # storage allocated (reserve counts as first put), still zero
    mask, _, _ = step(cache, cpu, *pairs)
    assert mask.shape == (4, 4)


def test_churn_with_many_sequences(cpu):
    n_seq, rng = 12, np.random.default_rng(3)
    cache = make(cpu, max_sequences=n_seq, capacity=6, max_batch=12)  # 72 cells
    model: dict[int, list[int]] = {s: [] for s in range(n_seq)}
    for _ in range(60):
        seqs = rng.choice(n_seq, size=rng.integers(1, 6), replace=False)
        pairs = []
        for s in seqs:
            if len(model[s]) >= 6 or rng.random() < 0.2:
                cut = int(rng.integers(0, len(model[s]) + 1))
                cache.remove(int(s), cut)
                del model[s][cut:]
            if len(model[s]) < 6:
                pairs.append((int(s), len(model[s])))
                model[s].append(len(model[s]))
        if not pairs:
            continue
        mask, _, _ = step(cache, cpu, *pairs)
        cells = contents(cache)
        for row, (s, p) in zip(mask, pairs, strict=True):
            assert sorted(cells[c] for c in np.flatnonzero(row == 0)) == sorted(f"{s}:{q}" for q in range(p + 1))
        assert sorted(c for c in cells if c != "-") == sorted(f"{s}:{q}" for s in model for q in model[s])


# ---- Causal: one stream of cells per sequence -------------------------------------------------


def test_streams_keep_each_sequence_in_its_own_cells(cpu):
    cache = make(cpu, max_sequences=3, capacity=4, unified=False)
    step(cache, cpu, (0, 0), (1, 0), (0, 1), (1, 1), (2, 0))
    assert contents(cache) == ["0:0", "0:1", "-", "-", "1:0", "1:1", "-", "-", "2:0", "-", "-", "-"]
    cells = Cells(8, 2, per_sequence=True)  # a full stream is full, whatever the other streams hold
    cells.place([0, 1, 2], [0, 0, 0])
    with pytest.raises(CacheFullError, match="sequence 0 need a free cell, only 1 of its 4"):
        cells.place([3, 4], [0, 0])
    cache.copy_prefix(0, 2, 1)  # copied into sequence 2's stream, not shared
    assert contents(cache) == ["0:0", "0:1", "-", "-", "1:0", "1:1", "-", "-", "0:0", "-", "-", "-"]
    assert cache.cells.seq_positions(2).tolist() == [0]


def attention_outputs(cache, backend, steps, flash=False):
    """nn.attention through ``cache`` for each batch of (sequence, position) pairs in ``steps`` (or a
    ("copy", src, dst, length) instruction), with queries, keys and values drawn from the pairs:
    the outputs (n_tokens, heads * DV) per batch."""
    from pyggml import nn

    outs = []
    for pairs in steps:
        if pairs[0] == "copy":
            cache.copy_prefix(*pairs[1:])
            continue
        rng = np.random.default_rng([s * 1000 + p for s, p in pairs])
        q = rng.standard_normal((len(pairs), 2 * HEADS, DK), dtype=np.float32)
        k = coded_keys(pairs) / 50000.0 + rng.standard_normal((len(pairs), HEADS, DK), dtype=np.float32)
        v = rng.standard_normal((len(pairs), HEADS, DV), dtype=np.float32)
        with backend.new_context() as ctx:
            cache.start_forward(ctx, batch_of(pairs))
            cache.set_layer(0)
            out = nn.attention(ctx, ctx.from_numpy(q), ctx.from_numpy(k), ctx.from_numpy(v), cache, QK_SCALE,
                               flash=flash)
            ctx.compute(out)
            outs.append(out.numpy())
    return outs


STREAM_STEPS = [
    [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)],  # two groups: 4 tokens of 0, then 2 of 1
    [(2, 0), (2, 1), (0, 4)],  # sequence 2 before 0: two groups
    [(0, 5), (1, 2), (2, 2)],  # a decode step: one group of three streams
    [(1, 3), (0, 6)],  # 1 before 0: two groups
    [(0, 7), (1, 4), (0, 8)],  # sequence 0's tokens apart: no groups (attention over every cell)
    ("copy", 0, 2, 5),  # sequence 2 becomes 0's first five positions: copied across streams
    [(0, 9), (1, 5), (2, 5)],
]


@pytest.mark.parametrize("flash", [False, True])
def test_streams_attend_like_one_pool_of_cells(flash):
    backend = Backend(BackendParams(n_threads=2, flash_attention=flash))
    try:
        streams = Causal(rope_shift)
        streams.init(backend, DType.F32, max_sequences=3, capacity=16, max_batch=8)
        pooled = Causal(rope_shift, unified=True)
        pooled.init(backend, DType.F32, max_sequences=3, capacity=16, max_batch=8)
        assert streams.cells.per_sequence and not pooled.cells.per_sequence
        assert streams.config.permuted_v == (not flash)  # plain attention reads V^T from the cache itself
        got, want = attention_outputs(streams, backend, STREAM_STEPS), attention_outputs(pooled, backend, STREAM_STEPS)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    finally:
        backend.close()


@pytest.mark.parametrize("flash", [False, True])
def test_a_group_attends_over_its_longest_stream(flash):
    """A decode step whose first sequence is the shortest: the group's width is its longest stream's
    (issue 25 item 8: the first stream's width cut the others' histories). Padding 1, so that the widths
    differ."""
    backend = Backend(BackendParams(n_threads=1, flash_attention=flash))
    try:
        steps = [[(0, 0)], [(1, p) for p in range(6)], [(0, 1), (1, 6)], [(0, 2), (1, 7), (2, 0)]]
        caches = [make(backend, max_sequences=3, capacity=16, unified=unified) for unified in (False, True)]
        assert caches[0].cells.per_sequence and not caches[1].cells.per_sequence
        got, want = (attention_outputs(c, backend, steps, flash) for c in caches)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    finally:
        backend.close()


@pytest.mark.parametrize("flash", [False, True])
def test_a_cache_of_keys_alone_reads_values_from_them(flash):
    """``value_from_key=DV``: cells hold keys only and the value is each head's first DV key elements (a view;
    DeepSeek's latent cache). Attention through it equals attention through a cache given those values
    explicitly, across streams, groups, ungrouped batches and a prefix copied to another sequence's stream."""
    from pyggml import nn

    backend = Backend(BackendParams(n_threads=2, flash_attention=flash))
    try:
        caches = [Causal(rope_shift, value_from_key=DV), Causal(rope_shift)]
        for cache in caches:
            cache.init(backend, DType.F32, max_sequences=3, capacity=16, max_batch=8)
        assert not caches[0].config.permuted_v  # no V of its own to store transposed
        outs = [[], []]
        for pairs in STREAM_STEPS:
            for cache, out in zip(caches, outs, strict=True):
                if pairs[0] == "copy":
                    cache.copy_prefix(*pairs[1:])
                    continue
                rng = np.random.default_rng([s * 1000 + p for s, p in pairs])
                q = rng.standard_normal((len(pairs), 2 * HEADS, DK), dtype=np.float32)
                k = rng.standard_normal((len(pairs), HEADS, DK), dtype=np.float32)
                with backend.new_context() as ctx:
                    cache.start_forward(ctx, batch_of(pairs))
                    cache.set_layer(0)
                    value = None if cache.value_from_key else ctx.from_numpy(np.ascontiguousarray(k[:, :, :DV]))
                    result = nn.attention(ctx, ctx.from_numpy(q), ctx.from_numpy(k), value, cache, QK_SCALE,
                                          flash=flash)
                    ctx.compute(result)
                    out.append(result.numpy())
        for a, b in zip(*outs, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        assert not caches[0].values and caches[1].values  # and so half the memory here
        with backend.new_context() as ctx, pytest.raises(ValueError, match="value_from_key cache takes"):
            caches[0].start_forward(ctx, batch_of([(0, 10)]))
            keys = ctx.from_numpy(coded_keys([(0, 10)]))
            caches[0].put(ctx, keys, keys)
    finally:
        backend.close()


def test_groups_cut_the_batch_by_consecutive_sequences(cpu):
    cache = Causal(rope_shift)
    cache.init(cpu, DType.F32, max_sequences=4, capacity=8, max_batch=8)

    def groups(*pairs):
        with cpu.new_context() as ctx:
            cache.start_forward(ctx, batch_of(pairs))
            cache.put(ctx, ctx.from_numpy(coded_keys(pairs)), ctx.from_numpy(coded_values(pairs)))
            got = cache.get_groups(ctx)
            return None if got is None else [(g.start, g.n_tokens, g.n_seqs, g.key.shape, g.mask.shape) for g in got]

    assert groups((0, 0), (0, 1), (1, 0), (1, 1), (3, 0)) == [
        (0, 2, 2, (DK, 32, HEADS, 2), (32, 2, 1, 2)), (4, 1, 1, (DK, 32, HEADS, 1), (32, 1, 1, 1))]
    assert groups((0, 2), (1, 2), (2, 0), (3, 1)) == [(0, 1, 4, (DK, 32, HEADS, 4), (32, 1, 1, 4))]
    assert groups((1, 3), (0, 3)) == [(0, 1, 1, (DK, 32, HEADS, 1), (32, 1, 1, 1)),
                                      (1, 1, 1, (DK, 32, HEADS, 1), (32, 1, 1, 1))]
    assert groups((0, 4), (1, 4), (0, 5)) is None  # a sequence's tokens apart: get serves the batch


def test_streams_refill_a_decode_graph(cpu):
    """A kept decode graph is refilled while the streams' width stays within the padding, and gives
    what new graphs give."""
    from pyggml import nn

    prompts = [[(0, 0), (0, 1), (0, 2)], [(1, 0)]]
    decodes = [[(0, 3), (1, 1)], [(0, 4), (1, 2)], [(0, 5), (1, 3)]]
    rng = np.random.default_rng(0)
    data = [(rng.standard_normal((2, 2 * HEADS, DK), dtype=np.float32),
             rng.standard_normal((2, HEADS, DK), dtype=np.float32),
             rng.standard_normal((2, HEADS, DV), dtype=np.float32)) for _ in decodes]

    def run(reuse: bool) -> list[np.ndarray]:
        cache = Causal(rope_shift)
        cache.init(cpu, DType.F32, max_sequences=2, capacity=40, max_batch=8)
        attention_outputs(cache, cpu, prompts)
        outs, ctx = [], None
        for pairs, arrays in zip(decodes, data, strict=True):
            if reuse and ctx is not None:
                assert cache.refill(ctx, batch_of(pairs))
                for array, name in zip(arrays, "qkv", strict=True):
                    ctx.set_input(name, array)
            else:
                if ctx is not None:
                    ctx.close()
                ctx = cpu.new_context()
                cache.start_forward(ctx, batch_of(pairs))
                cache.set_layer(0)
                out = nn.attention(ctx, *[ctx.from_numpy(a, name=n) for a, n in zip(arrays, "qkv", strict=True)],
                                   cache, QK_SCALE)
                assert ctx.reusable
            ctx.compute(out)
            outs.append(out.numpy())
        assert cache.refill(ctx, batch_of([(1, 4)])) is False  # another shape: a new graph
        ctx.close()
        return outs

    for a, b in zip(run(True), run(False), strict=True):
        np.testing.assert_array_equal(a, b)


# ---- Causal: property test against a model of visible positions ------------------------------


class CausalMachine(RuleBasedStateMachine):
    """Random passes, removals (shift by an identity shift_fn) and prefix copies; every pass's mask
    and value views must show each row exactly the positions a pure-Python model allows."""

    backend = None

    @initialize(options=st.sampled_from([{}, {"swa_window": 3, "swa_memory": 3}, {"chunk_size": 3}]))
    def setup(self, options):
        if CausalMachine.backend is None:
            CausalMachine.backend = Backend.cpu(1)
        self.options = options
        self.cache = make(self.backend, shift_fn=lambda ctx, layer, key, shift: key, max_sequences=3,
                          capacity=8, max_batch=4, **options)
        self.model: dict[int, dict[int, int]] = {s: {} for s in range(3)}  # seq -> position -> token id
        self.next_id = 1

    @rule(seqs=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def forward(self, seqs):
        pairs, ids = [], []
        for s in seqs:
            p = max(self.model[s], default=-1) + 1 + sum(1 for t, _ in pairs if t == s)
            if p < 8:
                pairs.append((s, p))
                ids.append(self.next_id)
                self.next_id += 1
        if not pairs:
            return
        window = self.options.get("swa_window")
        values = np.repeat(np.array(ids, np.float32)[:, None, None], HEADS, 1).repeat(DV, 2)
        try:
            mask, _, value = step(self.cache, self.backend, *pairs, values=values)
        except CacheFullError:
            return
        for s in {s for s, _ in pairs}:
            low = min(p for t, p in pairs if t == s)
            if window:
                self.model[s] = {q: t for q, t in self.model[s].items() if q >= low - window}
        for (s, p), i in zip(pairs, ids, strict=True):
            self.model[s][p] = i
        chunk = self.options.get("chunk_size")
        for row, (s, p) in zip(mask, pairs, strict=True):
            want = {t for q, t in self.model[s].items() if q <= p and (not window or p - q < window)
                    and (not chunk or q // chunk == p // chunk)}
            assert set(value[0, row == 0, 0].astype(int).tolist()) == want

    @rule(seq=st.integers(0, 2), begin=st.integers(0, 7), length=st.integers(-1, 3))
    def remove(self, seq, begin, length):
        end = None if length < 0 else begin + length
        try:
            self.cache.remove(seq, begin, end)
        except CacheFullError:
            return
        stop = 1 << 30 if end is None else end
        self.model[seq] = {q - (stop - begin) if q >= stop else q: t for q, t in self.model[seq].items()
                           if not begin <= q < stop}

    @rule(src=st.integers(0, 2), dst=st.integers(0, 2), length=st.integers(0, 8))
    def copy_prefix(self, src, dst, length):
        self.cache.copy_prefix(src, dst, length)
        self.model[dst] = {q: t for q, t in self.model[src].items() if q < length}

    @invariant()
    def positions_match(self):
        if hasattr(self, "cache"):
            for s in range(3):
                assert self.cache.cells.seq_positions(s).tolist() == sorted(self.model[s])


TestCausalMachine = CausalMachine.TestCase
TestCausalMachine.settings = settings(max_examples=25, stateful_step_count=12, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])


# ---- Encoder ----------------------------------------------------------------------------------


def image_batch(pairs, index):
    return batch_of(pairs, multimodal=[MultimodalIndex(index=index, multimodal=[Multimodal(data=b"img")])])


def encoder_step(cache, backend, batch, keys=None):
    """A pass: put ``keys`` (numpy (n_enc, HEADS, DK)) if given, then get; returns get's numpy or None."""
    with backend.new_context() as ctx:
        cache.start_forward(ctx, batch)
        cache.set_layer(0)
        if keys is not None:
            cache.put(ctx, ctx.from_numpy(keys), ctx.from_numpy(-keys[:, :, :DV]))
        if not cache.encoder_cached:
            return None
        key, value, mask = cache.get(ctx)
        assert mask is None
        ctx.compute(key, value)
        return key.numpy(), value.numpy()


def test_encoder_stores_reuses_and_drops(cpu):
    enc = Encoder()
    enc.init(cpu, DType.F32, max_sequences=2)
    image = coded_keys([(0, p) for p in range(3)])  # 3 encoder tokens
    key, value = encoder_step(enc, cpu, image_batch([(0, 5), (0, 6), (0, 7)], index=1), image)
    assert key.shape == (HEADS, 3, DK) and value.shape == (HEADS, 3, DV)  # ggml (DK, n_enc, HEADS)
    assert key[1, 2].tolist() == [1202, 2202, 3202, 4202]
    assert enc.position(0) == 6  # batch.positions[index]
    key2, _ = encoder_step(enc, cpu, batch_of([(0, 8)]))  # a later text batch reuses it
    np.testing.assert_array_equal(key2, key)
    with pytest.raises(ValueError, match="no multimodal"):
        encoder_step(enc, cpu, batch_of([(0, 9)]), image)
    enc.remove(0, 7)  # rewinding after the image keeps it
    assert encoder_step(enc, cpu, batch_of([(0, 7)])) is not None
    enc.remove(0, 2, 4)  # a removal before it moves it down
    assert enc.position(0) == 4
    enc.remove(0, 4)  # rewinding to its position drops it
    assert enc.position(0) is None
    assert encoder_step(enc, cpu, batch_of([(0, 4)])) is None
    with cpu.new_context() as ctx:
        enc.start_forward(ctx, batch_of([(0, 4)]))
        with pytest.raises(ValueError, match="encoder_cached"):
            enc.get(ctx)


def test_encoder_sharing_and_batches(cpu):
    enc = Encoder()
    enc.init(cpu, DType.F16, max_sequences=3)
    image = coded_keys([(0, 0), (0, 1)])
    encoder_step(enc, cpu, image_batch([(0, 0), (0, 1)], index=0), image)
    enc.copy_prefix(0, 1, 1)  # the image (position 0) is in the prefix
    enc.copy_prefix(0, 2, 0)
    assert (enc.position(1), enc.position(2)) == (0, None)
    assert encoder_step(enc, cpu, batch_of([(0, 2), (1, 1)])) is not None
    assert encoder_step(enc, cpu, batch_of([(2, 0)])) is None  # sees no image: cross-attention skipped
    with pytest.raises(ValueError, match="batch them apart"):
        encoder_step(enc, cpu, batch_of([(0, 3), (2, 1)]))
    with pytest.raises(ValueError, match="also holds"):
        encoder_step(enc, cpu, image_batch([(2, 1), (1, 2)], index=0), image)
    with pytest.raises(ValueError, match="one size"):
        encoder_step(enc, cpu, image_batch([(2, 1)], index=0), coded_keys([(2, 0)]))
    encoder_step(enc, cpu, image_batch([(2, 1)], index=0), image + 1)  # a new image replaces the old
    assert (enc.position(0), enc.position(2)) == (None, 1)
    assert enc.can_resume(0, 5)


def test_encoder_reserve_stores_nothing(cpu):
    enc = Encoder()
    enc.init(cpu, DType.F32)
    with cpu.new_context() as ctx:
        enc.start_forward(ctx, batch_of([(0, 0)]), reserve=True)
        keys = coded_keys([(0, 0), (0, 1)])
        enc.put(ctx, ctx.from_numpy(keys), ctx.from_numpy(keys[:, :, :DV]))
        key, _, _ = enc.get(ctx)
        ctx.forward(key.mulmat(ctx.from_numpy(np.ones((HEADS, 1, DK), np.float32))))
        ctx.reserve()
    assert enc.position(0) is None and not enc.keys[0].numpy().any()


# ---- Wrapper ----------------------------------------------------------------------------------


def test_wrapper_routes_layers(cpu):
    enc, causal = Encoder(), Causal(rope_shift)
    cache = Wrapper(enc, causal, layer_types=[1, 0, 1])  # layer 1 is cross-attention
    cache.set_config(CacheConfig(padding=1))
    cache.init(cpu, DType.F32, max_sequences=1, capacity=8, max_batch=4)
    image = coded_keys([(0, 7), (0, 8), (0, 9)])
    pairs = [(0, 0), (0, 1)]
    with cpu.new_context() as ctx:
        cache.start_forward(ctx, image_batch(pairs, index=1))
        outs = []
        for layer in range(3):
            cache.set_layer(layer)
            keys = image if layer == 1 else coded_keys(pairs) + 100000 * layer
            cache.put(ctx, ctx.from_numpy(keys), ctx.from_numpy(-keys[:, :, :DV]))
            outs.append(cache.get(ctx))
        ctx.compute(*[t for out in outs for t in out if t is not None])
        assert [o[0].shape for o in outs] == [(DK, 2, HEADS), (DK, 3, HEADS), (DK, 2, HEADS)]
        assert outs[1][2] is None and table(outs[0][2].numpy()) == ["x.", "xx"]
    assert sorted(causal.keys) == [0, 2] and sorted(enc.keys) == [1]
    assert contents(causal, 2)[:2] == ["0:0", "0:1"] and enc.position(0) == 1
    # without layer_types the model picks the cache (Ollama's SetLayerType); start_forward picks 0
    hooked = Wrapper(Causal(), Encoder())
    hooked.set_layer_type(1)
    assert hooked.current is hooked.caches[1]
    hooked.init(cpu, DType.F32, capacity=8)
    with cpu.new_context() as ctx:
        hooked.start_forward(ctx, batch_of([(0, 0)]))
    assert hooked.current is hooked.caches[0]
    with pytest.raises(ValueError, match="out of range"):
        hooked.set_layer_type(2)


def test_wrapper_forwards_management_to_all(cpu):
    enc, causal = Encoder(), Causal(rope_shift)
    cache = Wrapper(enc, causal, layer_types=lambda layer: layer % 2)
    cache.set_config(CacheConfig(padding=1))
    cache.init(cpu, DType.F32, max_sequences=2, capacity=8, max_batch=4)
    with cpu.new_context() as ctx:
        cache.start_forward(ctx, image_batch([(0, 0), (0, 1), (0, 2)], index=0))
        for layer in (0, 1):
            cache.set_layer(layer)
            keys = coded_keys([(0, 0), (0, 1), (0, 2)])
            cache.put(ctx, ctx.from_numpy(keys), ctx.from_numpy(-keys[:, :, :DV]))
        ctx.compute()
    cache.copy_prefix(0, 1, 2)
    assert enc.position(1) == 0 and causal.cells.seq_positions(1).tolist() == [0, 1]
    cache.remove(0, 0, 1)  # shifts the causal keys and drops the image (at position 0)
    assert enc.position(0) is None and causal.cells.seq_positions(0).tolist() == [0, 1]
    assert cache.can_resume(1, 2)
    cache.close()
    assert causal.cells is None and not enc.keys


def test_wrapper_changes_all_caches_or_none(cpu):
    enc, causal = Encoder(), Causal(None)  # a model that cannot shift
    cache = Wrapper(enc, causal, layer_types=[0, 1])
    cache.set_config(CacheConfig(padding=1))
    cache.init(cpu, DType.F32, max_sequences=1, capacity=4, max_batch=4)
    with cpu.new_context() as ctx:
        cache.start_forward(ctx, image_batch([(0, 0), (0, 1), (0, 2)], index=1))
        for layer in (0, 1):
            cache.set_layer(layer)
            keys = coded_keys([(0, 0), (0, 1), (0, 2)])
            cache.put(ctx, ctx.from_numpy(keys), ctx.from_numpy(-keys[:, :, :DV]))
        ctx.compute()
    before = state(causal)
    with pytest.raises(NotSupportedError):
        cache.remove(0, 0, 2)  # the encoder would drop its image; checked everywhere first
    assert enc.position(0) == 1
    assert_same(before, causal)
    # start_forward failing in the second cache is undone in the first
    two = Wrapper(make(cpu, capacity=4), make(cpu, capacity=2))
    step(two.caches[0], cpu, (0, 0))
    step(two.caches[1], cpu, (0, 0))
    before = [state(c) for c in two.caches]
    with cpu.new_context() as ctx, pytest.raises(ValueError, match="beyond"):
        two.start_forward(ctx, batch_of([(0, 1), (0, 2)]))
    for b, c in zip(before, two.caches, strict=True):
        assert_same(b, c)


# ---- end to end: llama through the cache -------------------------------------------------------


def write_sharp_llama(path, layers=2, seed=0):
    """A llama whose attention is peaked (large q/k weights), so that which positions a
    token sees and how keys are rotated change the logits; the default random weights give
    near-uniform attention that neither masks nor RoPE visibly affect."""
    hparams = {"block_count": layers, "embedding_length": 128, "feed_forward_length": 128,  # head_dim 32: one
               "attention.head_count": 4, "attention.head_count_kv": 2, "context_length": 256,  # Q8_0/Q4_0 block
               "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": ROPE, "vocab_size": 128}

    def init(name, shape, rng):
        scale = QK_SCALE if "attn_q" in name or "attn_k" in name else 0.2
        return np.ones(shape) if len(shape) == 1 else scale * rng.standard_normal(shape)

    return write_model(path, "llama", hparams, "f32", seed=seed, init=init)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_sharp_llama(tmp_path_factory.mktemp("sharp") / "sharp.gguf")


def load(path, dtype=DType.F32, flash=False, **init):
    model = pyggml.models.load(path, BackendParams(n_threads=1, flash_attention=flash))
    model.cache.init(model.backend, dtype, **{"max_sequences": 1, "capacity": 64, "max_batch": 32, **init})
    return model


def forward(model, tokens, positions, sequences, outputs) -> np.ndarray:
    batch = Batch(inputs=list(tokens), outputs=list(outputs), positions=list(positions), sequences=list(sequences))
    with model.backend.new_context() as ctx:
        model.cache.start_forward(ctx, batch)
        logits = model.forward(ctx, batch)
        ctx.compute(logits)
        return logits.numpy()


def fresh_logits(model, tokens) -> np.ndarray:
    """Last-position logits of ``tokens`` recomputed from scratch in one batch (sequence 0)."""
    model.cache.remove(0, 0)
    out = forward(model, tokens, range(len(tokens)), [0] * len(tokens), [len(tokens) - 1])[0]
    model.cache.remove(0, 0)
    return out


def test_generation_of_several_sequences_matches_recomputing(tiny_model):
    model, ref = load(tiny_model, max_sequences=3), load(tiny_model)
    try:
        prompts = [[1, 17, 42, 99, 5], [1, 50, 31], [1, 7, 64, 12]]
        # the prompts interleaved in one batch, by position
        order = sorted((p, s) for s in range(3) for p in range(len(prompts[s])))
        tokens = [prompts[s][p] for p, s in order]
        last = [max(i for i, (_, t) in enumerate(order) if t == s) for s in range(3)]
        logits = forward(model, tokens, [p for p, _ in order], [s for _, s in order], last)
        history = [list(p) for p in prompts]
        for _ in range(4):
            for s in range(3):
                assert scaled_error(logits[s], fresh_logits(ref, history[s])) < 1e-4
            nxt = [int(np.argmax(row)) for row in logits]
            for s in range(3):
                history[s].append(nxt[s])
            logits = forward(model, nxt, [len(h) - 1 for h in history], range(3), range(3))
    finally:
        model.close()
        ref.close()


@pytest.fixture(scope="module")
def one_layer_model(tmp_path_factory):
    return write_sharp_llama(tmp_path_factory.mktemp("sharp1") / "sharp1.gguf", layers=1)


def test_context_shift_matches_a_fresh_run(one_layer_model):
    # one layer: a kept token's keys/values depend only on it and its position, so the shifted cache
    # equals a fresh run's (deeper layers' keys also saw the removed tokens)
    model, ref = load(one_layer_model), load(one_layer_model)
    try:
        tokens = [1, 17, 42, 99, 5, 50, 31, 7, 64, 12]
        forward(model, tokens, range(10), [0] * 10, [9])
        model.cache.remove(0, 2, 5)  # drop positions 2..4; 5..9 move to 2..6, keys re-rotated
        shifted = tokens[:2] + tokens[5:]
        got = forward(model, [3], [7], [0], [0])[0]
        assert scaled_error(got, fresh_logits(ref, shifted + [3])) < 1e-4
    finally:
        model.close()
        ref.close()


def test_reserve_on_the_model_then_generate(tiny_model):
    model, ref = load(tiny_model, max_sequences=2), load(tiny_model)
    try:
        batch = Batch(inputs=[0] * 32, outputs=range(32), positions=[i // 2 for i in range(32)],
                      sequences=[i % 2 for i in range(32)])
        with model.backend.new_context() as ctx:
            model.cache.start_forward(ctx, batch, reserve=True)
            ctx.forward(model.forward(ctx, batch))
            ctx.reserve()
        assert model.backend.memory()["CPU"]["graph"] > 0
        assert model.cache.cells.free_count == model.cache.cells.capacity
        assert all(not k.numpy().any() for k in model.cache.keys.values())
        got = forward(model, [1, 17, 42], range(3), [1] * 3, [2])[0]
        assert scaled_error(got, fresh_logits(ref, [1, 17, 42])) < 1e-4
    finally:
        model.close()
        ref.close()


def test_flash_attention_with_a_quantized_cache(tiny_model):
    ref = load(tiny_model)
    try:
        want = fresh_logits(ref, [1, 17, 42, 99, 5])
    finally:
        ref.close()
    # F32 through flash attention (F16 mask padded to 256) is exact to float error; the peaked
    # attention of this model amplifies F16/Q8_0 rounding of keys (and of queries, which ggml
    # quantizes like K for the dot products)
    for dtype, bound in ((DType.F32, 1e-5), (DType.F16, 2e-2), (DType.Q8_0, 0.15)):
        model = load(tiny_model, dtype, flash=True)
        try:
            forward(model, [1, 17, 42, 99], range(4), [0] * 4, [3])
            got = forward(model, [5], [4], [0], [0])[0]  # decode step over the quantized history
            assert scaled_error(got, want) < bound, dtype.name
        finally:
            model.close()


def test_batch_groups_are_runs_of_consecutive_streams_with_equal_token_counts():
    """_plan_groups against the rule written out: a group continues while the next sequence is the next
    stream and has as many tokens; a sequence whose tokens are not contiguous gives None."""
    from pyggml.kvcache.causal import _plan_groups

    rng = np.random.default_rng(8)
    for _ in range(300):
        order = rng.permutation(12)[: rng.integers(1, 12)] if rng.random() < 0.3 else \
            rng.integers(0, 4) + np.arange(rng.integers(1, 12))
        counts = rng.integers(1, 3, size=order.size) if rng.random() < 0.5 else np.ones(order.size, int)
        sequences = np.repeat(order, counts).astype(np.int32)
        expected, start = [], 0
        for seq, count in zip(order.tolist(), counts.tolist(), strict=True):
            last = expected[-1] if expected else None
            if last is not None and last[3] == count and last[1] + last[2] == seq:
                last[2] += 1
            else:
                expected.append([start, seq, 1, count])
            start += count
        got = _plan_groups(sequences)
        assert [[g.start, g.stream, g.n_seqs, g.n_tokens] for g in got] == expected, sequences
    assert _plan_groups(np.array([0, 1, 0], np.int32)) is None
    # as many entries as from the first to the last sequence, but not one each: not the one-group shortcut
    for sequences, expected in (([0, 0, 2], [[0, 0, 1, 2], [2, 2, 1, 1]]), ([3, 5, 4], [[0, 3, 1, 1], [1, 5, 1, 1],
                                                                                     [2, 4, 1, 1]])):
        got = _plan_groups(np.array(sequences, np.int32))
        assert [[g.start, g.stream, g.n_seqs, g.n_tokens] for g in got] == expected, sequences
