"""kvcache.Recurrent on the real CPU backend: the short convolution across batches and sequences, scan
states, which positions a state can resume from, removal and forks, graph reuse, and Wrapper with Causal.

Inputs are digit-coded: a token of sequence s at position p feeds ``10 * s + p + 1`` (one value per
channel, times the channel number), and the convolution's taps weigh 10000, 100 and 1, so an output
reads as its window, oldest first, two digits a token: 10203 is positions 0, 1, 2 of sequence 0 and
1112 is sequence 1's positions 0 and 1 after a cleared (zero) state.
"""

from __future__ import annotations

import numpy as np
import pytest

from pyggml import DType
from pyggml.kvcache import CacheConfig, Causal, NotSupportedError, Recurrent, Wrapper
from pyggml.models import Batch

WIDTH, DIM = 3, 2
KERNEL = np.array([[10000, 100, 1], [20000, 200, 2]], np.float32)  # numpy (dim, width) = ggml (width, dim)


def make(backend, max_sequences=2) -> Recurrent:
    cache = Recurrent()
    cache.init(backend, DType.F32, max_sequences=max_sequences, capacity=16, max_batch=8)
    return cache


def coded(pairs) -> np.ndarray:
    """numpy (n_tokens, dim): token (seq, pos) feeds 10 * seq + pos + 1 on channel 0, twice that on channel 1."""
    return np.array([[(10 * s + p + 1) * (c + 1) for c in range(DIM)] for s, p in pairs], np.float32)


def batch_of(pairs) -> Batch:
    return Batch(inputs=[0] * len(pairs), positions=[p for _, p in pairs], sequences=[s for s, _ in pairs])


def conv(cache, backend, *pairs, layers=(0,)) -> list[int]:
    """One pass of the convolution in ``layers``; channel 0 of the last layer's output per token."""
    with backend.new_context() as ctx:
        cache.start_forward(ctx, batch_of(pairs))
        for layer in layers:
            cache.set_layer(layer)
            out = cache.conv(ctx, ctx.from_numpy(coded(pairs)), ctx.from_numpy(KERNEL))
        ctx.compute(out)
        result = out.numpy()
    np.testing.assert_array_equal(result[:, 1], 4 * result[:, 0])  # channel 1: twice the input, twice the taps
    return [int(v) for v in result[:, 0]]


def test_conv_continues_each_sequence_across_batches(cpu):
    cache = make(cpu)
    assert conv(cache, cpu, (0, 0), (0, 1), (0, 2), (0, 3)) == [1, 102, 10203, 20304]
    assert conv(cache, cpu, (0, 4)) == [30405]
    assert conv(cache, cpu, (0, 5), (0, 6)) == [40506, 50607]
    assert cache.positions.tolist() == [7, 0]


def test_interleaved_sequences_each_see_their_own_history(cpu):
    cache = make(cpu)
    assert conv(cache, cpu, (0, 0), (1, 0), (0, 1), (1, 1), (1, 2)) == [1, 11, 102, 1112, 111213]
    assert conv(cache, cpu, (1, 3), (0, 2)) == [121314, 10203]
    assert cache.positions.tolist() == [3, 4]


def test_position_zero_starts_over_with_a_cleared_state(cpu):
    cache = make(cpu)
    conv(cache, cpu, (0, 0), (0, 1), (0, 2))
    assert conv(cache, cpu, (0, 0)) == [1]  # not 20301: the old state is not read
    assert cache.positions.tolist() == [1, 0]


def test_layers_have_their_own_states(cpu):
    cache = make(cpu)
    conv(cache, cpu, (0, 0), (0, 1), layers=(0, 1))
    assert sorted(cache.conv_states) == [0, 1]
    assert conv(cache, cpu, (0, 2), layers=(1,)) == [10203]


def test_a_batch_that_does_not_continue_the_state_is_refused_unchanged(cpu):
    cache = make(cpu)
    conv(cache, cpu, (0, 0), (0, 1), (0, 2))
    for pairs in ([(0, 2)], [(0, 4)], [(0, 3), (0, 5)], [(1, 1)]):
        with cpu.new_context() as ctx, pytest.raises(ValueError, match="position|consecutive"):
            cache.start_forward(ctx, batch_of(pairs))
        assert cache.positions.tolist() == [3, 0]
    assert conv(cache, cpu, (0, 3)) == [20304]


def test_resume_only_at_the_state_position(cpu):
    cache = make(cpu)
    conv(cache, cpu, (0, 0), (0, 1), (0, 2))
    assert [cache.can_resume(0, p) for p in range(5)] == [True, False, False, True, False]
    assert cache.can_resume(1, 0) and not cache.can_resume(1, 1)


def test_remove_drops_whole_sequences_only(cpu):
    cache = make(cpu)
    conv(cache, cpu, (0, 0), (0, 1), (0, 2), (1, 0))
    for begin, end in ((1, None), (2, 3), (0, 2), (1, 2)):
        with pytest.raises(NotSupportedError, match="cannot drop"):
            cache.remove(0, begin, end)
        assert cache.positions.tolist() == [3, 1]
    cache.remove(0, 3)  # from its end: nothing stored there
    cache.remove(0, 5, 9)
    assert cache.positions.tolist() == [3, 1]
    cache.remove(0, 0)
    assert cache.positions.tolist() == [0, 1]
    assert conv(cache, cpu, (0, 0), (1, 1)) == [1, 1112]


def test_copy_prefix_copies_the_state_at_its_position_only(cpu):
    cache = make(cpu, max_sequences=3)
    conv(cache, cpu, (0, 0), (0, 1), (0, 2))
    cache.copy_prefix(0, 1, 3)
    assert cache.positions.tolist() == [3, 3, 0]
    assert conv(cache, cpu, (1, 3), (0, 3)) == [20314, 20304]  # sequence 1 continues 0's history
    cache.copy_prefix(0, 2, 2)  # a state holds no earlier position: the copy is empty
    assert cache.positions.tolist() == [4, 4, 0] and not cache.can_resume(2, 2)


def test_scan_states_per_sequence(cpu):
    cache = make(cpu, max_sequences=3)
    for pairs, new in (([(2, 0), (0, 0), (2, 1)], [[211, 212], [11, 12]]), ([(0, 1), (2, 2)], [[21, 22], [221, 222]])):
        with cpu.new_context() as ctx:
            cache.start_forward(ctx, batch_of(pairs))
            old = cache.get_state(ctx, 2)
            cache.put_state(ctx, ctx.from_numpy(np.array(new, np.float32)))
            ctx.compute(old)
            seen = old.numpy().tolist()
        if pairs[0][1] == 0:
            assert seen == [[0, 0], [0, 0]]  # both start over: order of first appearance, 2 then 0
        else:
            assert seen == [[11, 12], [211, 212]]  # 0 then 2, as stored by the previous pass
    with cpu.new_context() as ctx:
        cache.start_forward(ctx, batch_of([(2, 0)]))
        zero = cache.get_state(ctx, 2)
        ctx.compute(zero)
        assert zero.numpy().tolist() == [[0, 0]]


def test_reserve_stores_nothing(cpu):
    cache = make(cpu)
    conv(cache, cpu, (0, 0), (0, 1))
    with cpu.new_context() as ctx:
        cache.start_forward(ctx, batch_of([(0, 0)] * 6), reserve=True)
        out = cache.conv(ctx, ctx.from_numpy(coded([(1, 7)] * 6)), ctx.from_numpy(KERNEL))
        ctx.compute(out)
    assert cache.positions.tolist() == [2, 0]
    assert conv(cache, cpu, (0, 2)) == [10203]


def test_refill_reuses_a_decode_graph(cpu):
    cache = make(cpu)
    conv(cache, cpu, (0, 0), (0, 1), (1, 0))
    with cpu.new_context() as ctx:
        cache.start_forward(ctx, batch_of([(0, 2), (1, 1)]))
        x = ctx.from_numpy(coded([(0, 2), (1, 1)]), name="x")
        out = cache.conv(ctx, x, ctx.from_numpy(KERNEL))
        ctx.compute(out)
        assert out.numpy()[:, 0].tolist() == [10203, 1112]
        for pairs, expected in (([(1, 2), (0, 3)], [111213, 20304]), ([(0, 4), (1, 3)], [30405, 121314]),
                                ([(0, 5), (0, 6)], [40506, 50607])):  # the shape counts, not the sequences
            assert cache.refill(ctx, batch_of(pairs))
            ctx.set_input("x", coded(pairs))
            ctx.compute(out)
            assert out.numpy()[:, 0].tolist() == expected
    assert cache.positions.tolist() == [7, 4]


def test_refill_refuses_scan_states_of_another_number_of_sequences(cpu):
    cache = make(cpu)
    with cpu.new_context() as ctx:
        cache.start_forward(ctx, batch_of([(0, 0), (1, 0)]))
        cache.put_state(ctx, cache.get_state(ctx, 2) + 1.0)
        ctx.compute()
        assert not cache.refill(ctx, batch_of([(0, 1), (0, 2)]))
        assert cache.positions.tolist() == [1, 1]  # nothing placed
        assert cache.refill(ctx, batch_of([(1, 1), (0, 1)]))
        assert cache.positions.tolist() == [2, 2]


def test_wrapper_with_causal_removes_in_both_or_neither(cpu):
    causal = Causal(lambda ctx, layer, key, shift: key, unified=True)
    causal.set_config(CacheConfig(padding=1))
    states = Recurrent()
    cache = Wrapper(causal, states, layer_types=[1, 0])
    cache.init(cpu, DType.F32, max_sequences=1, capacity=8, max_batch=8)
    pairs = [(0, 0), (0, 1), (0, 2)]
    with cpu.new_context() as ctx:
        cache.start_forward(ctx, batch_of(pairs))
        cache.set_layer(0)
        out = states.conv(ctx, ctx.from_numpy(coded(pairs)), ctx.from_numpy(KERNEL))
        cache.set_layer(1)
        kv = ctx.from_numpy(np.ones((3, 1, 4), np.float32))
        cache.put(ctx, kv, kv)
        ctx.compute(out)
    cells = causal.cells.cell_positions.copy()
    with pytest.raises(NotSupportedError):
        cache.remove(0, 1)  # Causal could; Recurrent cannot: neither changes
    np.testing.assert_array_equal(causal.cells.cell_positions, cells)
    assert states.positions.tolist() == [3]
    assert cache.can_resume(0, 3) and not cache.can_resume(0, 2)
    cache.remove(0, 0)
    assert states.positions.tolist() == [0] and (causal.cells.cell_positions < 0).all()


def test_wrapper_refill_undoes_only_what_start_forward_cannot_redo(cpu, monkeypatch):
    """``Wrapper.refill`` of a recurrent state listed before a causal cache whose attention width moves every two
    positions: the causal cache (``places_again``) refills first and is never snapshot (a snapshot copies all its
    cells); when its width moves the refill is refused before the recurrent state advanced, and the new graph's
    ``start_forward`` goes on from that state: every step's convolution is the one a continuous state gives."""
    causal = Causal(lambda ctx, layer, key, shift: key)
    causal.set_config(CacheConfig(padding=2))
    states = Recurrent()
    cache = Wrapper(states, causal, layer_types=[0, 1])
    cache.init(cpu, DType.F32, max_sequences=1, capacity=16, max_batch=8)

    def build(pairs):
        ctx = cpu.new_context()
        cache.start_forward(ctx, batch_of(pairs))
        cache.set_layer(0)
        out = states.conv(ctx, ctx.from_numpy(coded(pairs), name="x"), ctx.from_numpy(KERNEL))
        cache.set_layer(1)
        kv = ctx.from_numpy(np.ones((len(pairs), 1, 4), np.float32))
        cache.put(ctx, kv, kv)
        cache.get(ctx)
        return ctx, out

    ctx, out = build([(0, 0), (0, 1)])
    ctx.compute(out)
    snapshot = Causal.snapshot
    refused = 0
    for p in range(2, 9):
        monkeypatch.setattr(Causal, "snapshot", lambda self: pytest.fail("Wrapper.refill snapshot a causal cache"))
        refilled = cache.refill(ctx, batch_of([(0, p)]))
        monkeypatch.setattr(Causal, "snapshot", snapshot)
        if refilled:
            ctx.set_input("x", coded([(0, p)]))
        else:
            refused += 1
            assert states.positions.tolist() == [p]  # not advanced by the refused refill
            ctx.close()
            ctx, out = build([(0, p)])
        ctx.compute(out)
        assert out.numpy()[:, 0].tolist() == [10000 * (p - 1) + 100 * p + p + 1], p
    ctx.close()
    assert refused >= 2 and states.positions.tolist() == [9]


# ---- checkpoints: prefix reuse and speculative rollback ---------------------------------------------------
def test_a_checkpoint_is_resumed_and_rolled_back_to(cpu):
    cache = make(cpu)
    conv(cache, cpu, (0, 0), (0, 1), (0, 2))
    cache.checkpoint(0, 3)
    assert conv(cache, cpu, (0, 3), (0, 4)) == [20304, 30405]
    assert [cache.resumable(0, p) for p in range(7)] == [0, 0, 0, 3, 3, 5, 5]
    assert cache.can_resume(0, 3) and not cache.can_resume(0, 4)
    with pytest.raises(NotSupportedError, match="checkpoint"):
        cache.remove(0, 4)  # no checkpoint there
    cache.remove(0, 3)
    assert cache.positions.tolist() == [3, 0]
    assert conv(cache, cpu, (0, 3)) == [20304]  # the checkpoint's inputs 1 and 2, not the later 3 and 4
    assert conv(cache, cpu, (0, 4), (0, 5)) == [30405, 40506]  # then its own state again
    cache.remove(0, 0)
    assert cache.resumable(0, 3) == 0  # the whole sequence went, and its checkpoints with it


def test_a_checkpoint_keeps_the_scan_state_too(cpu):
    cache = make(cpu)

    def step(pos: int, new: float) -> list[float]:
        with cpu.new_context() as ctx:
            cache.start_forward(ctx, batch_of([(0, pos)]))
            old = cache.get_state(ctx, 2)
            cache.put_state(ctx, ctx.from_numpy(np.array([[new, new + 1]], np.float32)))
            ctx.compute(old)
            return old.numpy()[0].tolist()

    step(0, 11)
    cache.checkpoint(0, 1)
    assert step(1, 21) == [11, 12]
    cache.remove(0, 1)
    assert step(1, 31) == [11, 12]  # not 21, 22
    assert step(2, 41) == [31, 32]


def test_checkpoints_are_bounded_and_stay_spread(cpu):
    cache = Recurrent(checkpoints=3)
    cache.init(cpu, DType.F32, max_sequences=2, capacity=32, max_batch=8)
    ends = [5, 6, 7, 12, 13]
    pos = 0
    for end in ends:
        conv(cache, cpu, *[(1, p) for p in range(pos, end)])
        cache.checkpoint(1, end)
        pos = end
    # 5, 6, 7 fill the 3 units; 12 drops 6 (1 after 5), then 13 drops 7 (2 after 5, the closest left)
    assert sorted(cache.saved[1].values()) == [5, 12, 13] and not cache.saved[0]
    cache.remove(1, 5)
    assert conv(cache, cpu, (1, 5)) == [141516]
    with pytest.raises(ValueError, match="position"):
        cache.checkpoint(1, 9)  # the state is at 6


def test_copy_prefix_forks_from_the_longest_checkpoint_within_the_prefix(cpu):
    cache = make(cpu, max_sequences=3)
    conv(cache, cpu, (0, 0), (0, 1), (0, 2))
    cache.checkpoint(0, 3)
    conv(cache, cpu, (0, 3), (0, 4))
    cache.checkpoint(2, 0)  # nothing to keep at position 0
    cache.copy_prefix(0, 1, 4)
    assert cache.positions.tolist() == [5, 3, 0] and cache.can_resume(1, 3)
    assert conv(cache, cpu, (1, 3)) == [20314]  # sequence 0's inputs 1 and 2, then its own
    cache.copy_prefix(0, 2, 2)  # no checkpoint within 2: empty
    assert cache.positions.tolist() == [5, 4, 0]


def test_wrapper_resumes_where_every_cache_can(cpu):
    causal = Causal(lambda ctx, layer, key, shift: key, unified=True)
    causal.set_config(CacheConfig(padding=1))
    states = Recurrent()
    cache = Wrapper(causal, states, layer_types=[1, 0])
    cache.init(cpu, DType.F32, max_sequences=1, capacity=8, max_batch=8)

    def forward(pairs):
        with cpu.new_context() as ctx:
            cache.start_forward(ctx, batch_of(pairs))
            cache.set_layer(0)
            out = states.conv(ctx, ctx.from_numpy(coded(pairs)), ctx.from_numpy(KERNEL))
            cache.set_layer(1)
            kv = ctx.from_numpy(np.ones((len(pairs), 1, 4), np.float32))
            cache.put(ctx, kv, kv)
            ctx.compute(out)

    forward([(0, 0), (0, 1)])
    cache.checkpoint(0, 2)
    forward([(0, 2), (0, 3), (0, 4)])
    assert [cache.resumable(0, p) for p in (1, 2, 4, 5)] == [0, 2, 2, 5]
    cache.remove(0, cache.resumable(0, 4))
    assert states.positions.tolist() == [2] and causal.cells.cell_positions.max() == 1


def test_by_sequence_lays_each_sequence_out_in_turn_and_by_batch_brings_the_rows_back(cpu):
    """A batch of sequences 1, 0, 1, 2, 1 (positions 0, 0, 1, 0, 2) as a (T, N) grid: T = 3 rows per
    sequence, N = 3 sequences in order of first appearance (1, 0, 2), shorter ones padded with a copy of
    the batch's first row, or with zeros; and back in batch order."""
    cache = make(cpu, max_sequences=3)
    pairs = [(1, 0), (0, 0), (1, 1), (2, 0), (1, 2)]
    with cpu.new_context() as ctx:
        cache.start_forward(ctx, batch_of(pairs))
        x = ctx.from_numpy(coded(pairs))
        grid, steps, seqs = cache.by_sequence(ctx, x)
        zeros, _, _ = cache.by_sequence(ctx, x, zero_padding=True)
        back = cache.by_batch(ctx, grid)
        ctx.compute(grid, zeros, back)
        assert (steps, seqs) == (3, 3)
        assert grid.numpy()[:, 0].tolist() == [11, 12, 13, 1, 11, 11, 21, 11, 11]
        assert zeros.numpy()[:, 0].tolist() == [11, 12, 13, 1, 0, 0, 21, 0, 0]
        np.testing.assert_array_equal(back.numpy(), coded(pairs))


def test_a_reserving_pass_lays_out_the_largest_sequence_grid(cpu):
    """Reserving (worst-case memory, nothing computed) for a batch of 8 with 3 slots: the grid of one
    long sequence beside two single tokens (6 steps by 3 sequences), the largest a batch of 8 can need."""
    cache = make(cpu, max_sequences=3)
    with cpu.new_context() as ctx:
        cache.start_forward(ctx, batch_of([(0, p) for p in range(8)]), reserve=True)
        grid, steps, seqs = cache.by_sequence(ctx, ctx.from_numpy(coded([(0, p) for p in range(8)])))
        assert (steps, seqs) == (6, 3) and grid.shape == (DIM, 18)
        assert cache.get_state(ctx, 4).shape == (4, 3)
    assert cache.positions.tolist() == [0, 0, 0]
