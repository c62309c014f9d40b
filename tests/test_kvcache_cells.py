"""Cell bookkeeping of the KV cache: placement, masks, removal, sharing.

Mask tables are written one string per batch row, one character per cell:
``x`` visible, ``.`` hidden.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pyggml.kvcache.cells import CacheFullError, Cells, NotSupportedError, Shift


def table(mask: np.ndarray) -> list[str]:
    return ["".join("x" if v == 0 else "." for v in row) for row in mask]


def batch(*pairs: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(positions, sequences) from (seq, pos) pairs."""
    seqs, pos = zip(*pairs, strict=True) if pairs else ((), ())
    return np.array(pos, np.int32), np.array(seqs, np.int32)


def place(c: Cells, *pairs: tuple[int, int]) -> list[int]:
    return c.place(*batch(*pairs)).tolist()


def mask(c: Cells, *pairs: tuple[int, int], **kw) -> list[str]:
    return table(c.mask(*batch(*pairs), **kw))


def state(c: Cells) -> dict[str, np.ndarray]:
    """Every array of the object, to check that a failed call changed nothing (but for the stream
    extents, a cache that a call may count and keep; ``matches_model`` checks it)."""
    return {k: v.copy() for k, v in vars(c).items() if isinstance(v, np.ndarray) and k != "_stream_top"}


def assert_same_state(before: dict[str, np.ndarray], c: Cells) -> None:
    after = state(c)
    assert before.keys() == after.keys()
    for k in before:
        np.testing.assert_array_equal(before[k], after[k], err_msg=k)


# ---- placement and causal masks ------------------------------------------------------


def test_single_sequence():
    c = Cells(6, 1)
    assert place(c, (0, 0), (0, 1), (0, 2)) == [0, 1, 2]
    assert mask(c, (0, 0), (0, 1), (0, 2)) == ["x..", "xx.", "xxx"]
    assert place(c, (0, 3)) == [3]
    assert mask(c, (0, 3)) == ["xxxx"]
    assert c.seq_positions(0).tolist() == [0, 1, 2, 3]
    assert c.free_count == 2
    assert c.used_extent() == 4
    assert place(c) == []  # an empty batch changes nothing
    assert c.free_count == 2


def test_interleaved_sequences_in_one_batch():
    c = Cells(8, 3)
    tokens = [(0, 0), (1, 0), (0, 1), (1, 1), (2, 5)]
    assert place(c, *tokens) == [0, 1, 2, 3, 4]
    # fmt: off
    assert mask(c, *tokens) == [
        "x....",
        ".x...",
        "x.x..",
        ".x.x.",
        "....x",
    ]
    # fmt: on


def test_placing_a_stored_pair_overwrites_its_cell():
    c = Cells(4, 1)
    place(c, (0, 0), (0, 1), (0, 2))
    assert place(c, (0, 1), (0, 3)) == [1, 3]
    assert c.seq_positions(0).tolist() == [0, 1, 2, 3]
    assert c.free_count == 0


def test_free_cells_anywhere_are_used_lowest_first():
    c = Cells(6, 2)
    place(c, (0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2))
    c.remove(1, 0)  # frees cells 1, 3, 5
    assert place(c, (0, 3), (0, 4), (0, 5)) == [1, 3, 5]
    assert mask(c, (0, 5)) == ["xxxxxx"]


def test_padding_of_columns_and_rows():
    c = Cells(16, 1)
    place(c, (0, 0), (0, 1), (0, 2))
    assert c.used_extent(4) == 4
    m = c.mask(*batch((0, 1), (0, 2)), padding=4, row_padding=8, dtype=np.float16)
    assert m.dtype == np.float16 and m.shape == (8, 4)
    assert table(m) == ["xx..", "xxx."] + ["...."] * 6
    assert np.isneginf(m[2:]).all()
    assert c.mask(*batch((0, 2)), n_kv=16).shape == (1, 16)
    with pytest.raises(ValueError, match="n_kv"):
        c.mask(*batch((0, 2)), n_kv=2)
    assert Cells(10, 1).used_extent(4) == 0
    place(full := Cells(10, 1), *[(0, p) for p in range(9)])
    assert full.used_extent(4) == 10  # capped at the capacity


# ---- sliding window ------------------------------------------------------------------


def test_sliding_window_masks_and_drops():
    c = Cells(8, 1, swa_window=3)
    place(c, *[(0, p) for p in range(6)])
    assert mask(c, (0, 0), (0, 3), (0, 5)) == ["x.....", ".xxx..", "...xxx"]
    assert place(c, (0, 6)) == [0]  # positions 0..2 are 3+ back from 6: dropped, cell 0 reused
    assert c.seq_positions(0).tolist() == [3, 4, 5, 6]
    assert c.free_count == 4
    assert mask(c, (0, 6)) == ["x...xx"]


def test_a_long_batch_keeps_what_its_first_token_needs():
    c = Cells(16, 1, swa_window=3)
    place(c, *[(0, p) for p in range(4)])
    place(c, *[(0, p) for p in range(4, 10)])  # drops by the lowest position, 4: keeps 1..3
    assert c.seq_positions(0).tolist() == list(range(1, 10))
    assert c.seq_cells(0).tolist() == [1, 2, 3, 0, 4, 5, 6, 7, 8]  # 4 went to the freed cell 0
    assert mask(c, (0, 4)) == ["x.xx....."]


def test_sliding_window_memory_keeps_more():
    c = Cells(8, 1, swa_window=2, swa_memory=4)
    place(c, *[(0, p) for p in range(6)])
    place(c, (0, 6))
    assert c.seq_positions(0).tolist() == [2, 3, 4, 5, 6]
    assert mask(c, (0, 6)) == ["x....x"]  # the window still hides all but 5 and 6


def test_sliding_window_serves_a_long_sequence_from_few_cells():
    c = Cells(8, 2, swa_window=3)  # each sequence holds its window + 1 (for can_resume)
    for p in range(200):
        c.place(*batch((0, p), (1, p)))
    assert c.seq_positions(1).tolist() == [196, 197, 198, 199]
    assert [len(r.replace(".", "")) for r in mask(c, (0, 200), (1, 200))] == [2, 2]


def test_can_resume():
    c = Cells(8, 1, swa_window=3)
    place(c, *[(0, p) for p in range(6)])
    place(c, (0, 6))  # stores 3..6
    assert c.can_resume(0, 6) and c.can_resume(0, 7)
    assert not c.can_resume(0, 5)  # needs 2
    assert not c.can_resume(0, 8)  # needs 7, never stored
    assert Cells(8, 1, swa_window=3).can_resume(0, 0)
    nowindow = Cells(8, 1)
    assert nowindow.can_resume(0, 100)


# ---- chunks and noncausal ranges ----------------------------------------------------


def test_chunk_boundaries():
    c = Cells(10, 1, chunk_size=4)
    tokens = [(0, p) for p in range(10)]
    place(c, *tokens)
    # fmt: off
    assert mask(c, *tokens) == [
        "x.........",
        "xx........",
        "xxx.......",
        "xxxx......",
        "....x.....",
        "....xx....",
        "....xxx...",
        "....xxxx..",
        "........x.",
        "........xx",
    ]
    # fmt: on


def test_noncausal_range_sees_itself_both_ways():
    c = Cells(8, 2)
    tokens = [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (0, 5)]
    place(c, *tokens)
    # fmt: off
    assert mask(c, *tokens, noncausal=[(1, 4)]) == [
        "x.....",
        "xxxx..",
        "xxxx..",
        "xxxx..",
        "xxxxx.",
        "xxxxxx",
    ]
    # fmt: on


def test_noncausal_range_is_per_sequence_and_respects_window():
    c = Cells(8, 2, swa_window=2)
    tokens = [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    place(c, *tokens)
    # rows 0..3 (positions 0 and 1 of both sequences) see each other within their sequence
    # fmt: off
    assert mask(c, *tokens, noncausal=[(0, 4)]) == [
        "x.x...",
        ".x.x..",
        "x.x...",
        ".x.x..",
        "..x.x.",
        "...x.x",
    ]
    # fmt: on


# ---- removal -------------------------------------------------------------------------


def test_remove_tail():
    c = Cells(8, 1)
    place(c, *[(0, p) for p in range(6)])
    assert c.remove(0, 3) is None
    assert c.seq_positions(0).tolist() == [0, 1, 2]
    assert c.free_count == 5
    assert c.remove(0, 0, 100, can_shift=False) is None
    assert c.free_count == 8


def test_remove_middle_shifts_later_positions():
    c = Cells(8, 1)
    place(c, *[(0, p) for p in range(6)])
    shift = c.remove(0, 1, 3)
    assert isinstance(shift, Shift)
    assert shift.delta == -2
    assert shift.cells.tolist() == [3, 4, 5]
    assert shift.copies.shape == (0, 2)
    assert c.cell_positions.tolist() == [0, -1, -1, 1, 2, 3, -1, -1]
    assert place(c, (0, 4)) == [1]
    assert mask(c, (0, 4)) == ["xx.xxx"]


def test_remove_middle_without_shift_support_changes_nothing():
    c = Cells(8, 1)
    place(c, *[(0, p) for p in range(6)])
    before = state(c)
    with pytest.raises(NotSupportedError):
        c.remove(0, 1, 3, can_shift=False)
    assert_same_state(before, c)
    assert c.remove(0, 5, 9, can_shift=False) is None  # nothing after: fine
    assert c.seq_positions(0).tolist() == [0, 1, 2, 3, 4]


def test_shifting_shared_cells_splits_them():
    c = Cells(10, 2)
    place(c, *[(0, p) for p in range(6)])
    c.copy_prefix(0, 1, 6)
    shift = c.remove(1, 1, 3)
    # cells 3..5 stay at 3..5 for sequence 0; sequence 1 gets copies moved down by 2
    assert shift.copies.tolist() == [[3, 6], [4, 7], [5, 8]]
    assert shift.cells.tolist() == [6, 7, 8]
    assert shift.delta == -2
    assert c.seq_positions(0).tolist() == [0, 1, 2, 3, 4, 5]
    assert c.seq_cells(1).tolist() == [0, 6, 7, 8]
    assert c.seq_positions(1).tolist() == [0, 1, 2, 3]
    assert mask(c, (0, 6), (1, 4)) == ["xxxxxx...", "x.....xxx"]


def test_shift_that_cannot_split_shared_cells_changes_nothing():
    c = Cells(7, 2)
    place(c, *[(0, p) for p in range(6)])
    c.copy_prefix(0, 1, 6)
    before = state(c)
    with pytest.raises(CacheFullError):
        c.remove(1, 1, 3)  # needs 3 free cells, has 1
    assert_same_state(before, c)


# ---- sharing -------------------------------------------------------------------------


def test_overwriting_a_shared_cell_detaches_it():
    c = Cells(6, 2)
    place(c, (0, 0), (0, 1), (0, 2))
    c.copy_prefix(0, 1, 3)
    assert c.free_count == 3
    assert place(c, (1, 2)) == [3]  # sequence 0 keeps its data in cell 2
    assert mask(c, (0, 2), (1, 2)) == ["xxx.", "xx.x"]
    assert place(c, (0, 2)) == [2]  # now only sequence 0 sees cell 2: reused


def test_both_sharers_overwriting_frees_the_old_cell():
    c = Cells(4, 2)
    place(c, (0, 0), (0, 1))
    c.copy_prefix(0, 1, 2)
    assert place(c, (0, 1), (1, 1)) == [1, 2]  # the old cell 1 became free in the same batch
    assert c.free_count == 1


def test_copy_prefix_then_diverge():
    c = Cells(10, 2)
    place(c, *[(0, p) for p in range(5)])
    c.copy_prefix(0, 1, 3)
    assert c.free_count == 5
    assert place(c, (1, 3), (1, 4), (0, 5)) == [5, 6, 7]
    assert mask(c, (0, 5), (1, 4)) == ["xxxxx..x", "xxx..xx."]


def test_copy_prefix_replaces_destination():
    c = Cells(10, 2)
    place(c, *[(1, p) for p in range(4)], (0, 0), (0, 1), (0, 2))
    c.copy_prefix(0, 1, 2)
    assert c.seq_cells(1).tolist() == [4, 5]
    assert c.free_count == 7
    c.copy_prefix(0, 0, 1)  # onto itself: truncates
    assert c.seq_positions(0).tolist() == [0]


# ---- errors --------------------------------------------------------------------------


def test_cache_full_changes_nothing():
    c = Cells(4, 2)
    place(c, (0, 0), (0, 1), (1, 0))
    before = state(c)
    with pytest.raises(CacheFullError):
        place(c, (0, 2), (1, 1))
    assert_same_state(before, c)


def test_cache_full_keeps_window_drops_unapplied():
    c = Cells(4, 1, swa_window=2)
    place(c, (0, 0), (0, 1), (0, 2), (0, 3))
    before = state(c)
    with pytest.raises(CacheFullError):
        place(c, *[(0, p) for p in range(4, 9)])  # would free 2 cells, needs 5
    assert_same_state(before, c)


@pytest.mark.parametrize(
    ("positions", "sequences", "match"),
    [
        ([0, 1], [0], "differ"),
        ([0], [2], "sequences"),
        ([0], [-1], "sequences"),
        ([-1], [0], "positions"),
        ([1, 1], [0, 0], "twice"),
        ([[0]], [[0]], "1-D"),
        ([0.5], [0], "integer"),
    ],
)
def test_invalid_batches(positions, sequences, match):
    c = Cells(4, 2)
    with pytest.raises(ValueError, match=match):
        c.place(positions, sequences)
    assert c.free_count == 4


def test_invalid_arguments():
    for kw in [{"swa_window": 0}, {"swa_memory": 4}, {"swa_window": 4, "swa_memory": 2}, {"chunk_size": 0}]:
        with pytest.raises(ValueError):
            Cells(4, 1, **kw)
    with pytest.raises(ValueError):
        Cells(0, 1)
    c = Cells(4, 2)
    place(c, (0, 0), (0, 1))
    for call in [
        lambda: c.remove(2, 0),
        lambda: c.remove(0, 2, 1),
        lambda: c.copy_prefix(0, 5, 1),
        lambda: c.can_resume(0, -1),
        lambda: c.mask(*batch((0, 1)), noncausal=[(0, 2)]),
    ]:
        with pytest.raises(ValueError):
            call()


def test_clear():
    c = Cells(4, 2)
    place(c, (0, 0), (1, 0))
    c.clear()
    assert c.free_count == 4 and c.used_extent() == 0
    assert place(c, (1, 0)) == [0]


# ---- churn ---------------------------------------------------------------------------


def test_churn_never_fails_while_enough_is_free():
    rng = np.random.default_rng(0)
    n_seq, capacity = 8, 256
    c = Cells(capacity, n_seq)
    length = [0] * n_seq
    for _ in range(4000):
        growth = {s: int(rng.integers(1, 4)) for s in range(n_seq) if rng.random() < 0.7}
        while sum(growth.values()) > c.free_count:  # make room as a runner would
            s = int(rng.integers(n_seq))
            if length[s] > 8:  # context shift: keep 4, drop half of the rest
                discard = (length[s] - 4) // 2
                c.remove(s, 4, 4 + discard)
                length[s] -= discard
            else:
                c.remove(s, 0)
                length[s] = 0
        pairs = [(s, length[s] + i) for s, k in growth.items() for i in range(k)]
        pairs = [pairs[i] for i in rng.permutation(len(pairs))]
        cells = c.place(*batch(*pairs))
        assert len(set(cells.tolist())) == len(pairs)
        for s, k in growth.items():
            length[s] += k
        if rng.random() < 0.05:  # a client goes away or rewinds
            s = int(rng.integers(n_seq))
            length[s] = int(rng.integers(length[s] + 1))
            c.remove(s, length[s])
    for s in range(n_seq):
        assert c.seq_positions(s).tolist() == list(range(length[s]))
    assert c.free_count == capacity - sum(length)


# ---- property test against a reference model -----------------------------------------

N_SEQ = 4
CAPACITY = 24
CONFIGS = [{}, {"swa_window": 3}, {"swa_window": 2, "swa_memory": 4}, {"chunk_size": 4},
           {"per_sequence": True}, {"per_sequence": True, "swa_window": 3}]


class CellsMachine(RuleBasedStateMachine):
    """Random place/remove/copy_prefix against a model: seq -> {position: token id}.

    A fake tensor layer follows the instructions `Cells` returns: ``value[cell]`` is
    the token id written there, ``key[cell]`` its rotated position; both must stay
    consistent with the model.
    """

    @initialize(
        config=st.sampled_from(CONFIGS),
        prompt=st.integers(1, 8),
        forks=st.lists(st.integers(0, 8), min_size=N_SEQ - 1, max_size=N_SEQ - 1),
    )
    def setup(self, config, prompt, forks):
        """Sequence 0 holds a prompt, the others share prefixes of it."""
        self.config = config
        self.cells = Cells(CAPACITY, N_SEQ, **config)
        self.model: dict[int, dict[int, int]] = {s: {} for s in range(N_SEQ)}
        self.value = np.full(CAPACITY, -1)
        self.key = np.full(CAPACITY, -1)
        self.next_id = 0
        self.place_pairs([(0, p) for p in range(prompt)])
        for dst, length in enumerate(forks, start=1):
            self.copy_prefix_of(0, dst, length)

    @rule(
        data=st.data(),
        seqs=st.lists(st.integers(0, N_SEQ - 1), min_size=1, max_size=3, unique=True),
    )
    def place(self, data, seqs):
        pairs = []
        for s in seqs:
            end = max(self.model[s], default=-1) + 1
            start = data.draw(st.integers(max(0, end - 4), end))  # overwrite some, or append
            pairs += [(s, p) for p in range(start, start + data.draw(st.integers(1, 4)))]
        order = data.draw(st.permutations(range(len(pairs))))
        self.place_pairs([pairs[i] for i in order])

    @rule(data=st.data())
    def decode(self, data):
        """A decode step as the runner packs it: one token after the end of each of some sequences, in
        increasing order (with streams, ``place`` takes its shortcut, ``_append_streams``, when it can)."""
        seqs = data.draw(st.lists(st.integers(0, N_SEQ - 1), min_size=1, max_size=N_SEQ, unique=True))
        count = state(self.cells)["_count"]
        pairs = [(s, max(self.model[s], default=-1) + 1) for s in sorted(seqs)]
        cells = self.place_pairs(pairs)
        if cells is not None and self.cells.per_sequence and not self.config.get("swa_window"):
            size = self.cells.stream_size  # each token in its stream's lowest cell free before the step
            assert cells.tolist() == [s * size + int(np.flatnonzero(count[s * size:(s + 1) * size] == 0)[0])
                                      for s, _ in pairs]

    def place_pairs(self, pairs: list[tuple[int, int]]) -> np.ndarray | None:
        """Place ``pairs`` (checking it against the model); the cells, or None when the cache was full."""
        before = state(self.cells)
        free = self.cells.free_count
        general = copy.deepcopy(self.cells)  # the same batch without the decode shortcut: the same cells and state
        general._append_streams = lambda pos, seq: None
        try:
            cells = self.cells.place(*batch(*pairs))
            np.testing.assert_array_equal(cells, general.place(*batch(*pairs)))
            assert_same_state(state(general), self.cells)
            assert self.cells.stream_extents().tolist() == general.stream_extents().tolist()
            assert self.cells.used_extent() == general.used_extent()
        except CacheFullError:
            event("place: cache full")
            if self.cells.per_sequence:  # some stream has too few free cells
                size = self.cells.stream_size
                free_in = (before["_count"].reshape(N_SEQ, size) == 0).sum(axis=1)
                assert any(free_in[s] < sum(q == s for q, _ in pairs) for s, _ in pairs)
            else:
                assert free < len(pairs)
            assert_same_state(before, self.cells)
            return None
        memory = self.cells.swa_memory
        for s in {s for s, _ in pairs}:
            low = min(p for q, p in pairs if q == s)
            if memory is not None:
                self.model[s] = {p: t for p, t in self.model[s].items() if p >= low - memory}
        for (s, p), cell in zip(pairs, cells.tolist(), strict=True):
            self.model[s][p] = self.next_id
            self.value[cell], self.key[cell] = self.next_id, p
            self.next_id += 1
        self.check_masks(pairs)
        return cells

    def stored_seq(self, data) -> int:
        """A sequence that holds something, when there is one."""
        return data.draw(st.sampled_from([s for s in range(N_SEQ) if self.model[s]] or [0]))

    @rule(data=st.data(), length=st.integers(-1, 4), can_shift=st.booleans())
    def remove(self, data, length, can_shift):
        seq = self.stored_seq(data)
        begin = data.draw(st.sampled_from(sorted(self.model[seq]) or [0]))
        end = None if length < 0 else begin + length
        before = state(self.cells)
        try:
            self.cells.check_remove(seq, begin, end, can_shift=can_shift)  # raises as remove does, changes nothing
            assert_same_state(before, self.cells)
            shift = self.cells.remove(seq, begin, end, can_shift=can_shift)
        except NotSupportedError:
            event("remove: not supported")
            assert not can_shift and any(p >= end for p in self.model[seq])
            assert_same_state(before, self.cells)
            return
        except CacheFullError:
            event("remove: no room to split")
            assert_same_state(before, self.cells)
            return
        stop = end if end is not None else 1 << 30
        old = self.model[seq]
        self.model[seq] = {p - (stop - begin) if p >= stop else p: t for p, t in old.items() if not begin <= p < stop}
        if shift is not None:
            event(f"remove: shift, {'with' if len(shift.copies) else 'no'} splits")
            src, dst = shift.copies.T
            self.value[dst], self.key[dst] = self.value[src], self.key[src]
            self.key[shift.cells] += shift.delta

    @rule(data=st.data(), dst=st.integers(0, N_SEQ - 1))
    def copy_prefix(self, data, dst):
        src = self.stored_seq(data)
        self.copy_prefix_of(src, dst, data.draw(st.sampled_from(range(max(self.model[src], default=0) + 3))))

    def copy_prefix_of(self, src: int, dst: int, length: int) -> None:
        copies = self.cells.copy_prefix(src, dst, length)
        if copies.size:  # streams: the prefix is copied into dst's cells
            source, target = copies.T
            self.value[target], self.key[target] = self.value[source], self.key[source]
        self.model[dst] = {p: t for p, t in self.model[src].items() if p < length}

    @precondition(lambda self: hasattr(self, "cells"))
    @invariant()
    def matches_model(self):
        c = self.cells
        for s in range(N_SEQ):
            cells = c.seq_cells(s)
            assert c.cell_positions[cells].tolist() == sorted(self.model[s])
            assert self.value[cells].tolist() == [self.model[s][p] for p in sorted(self.model[s])]
        used = c.cell_positions >= 0
        np.testing.assert_array_equal(self.key[used], c.cell_positions[used])
        assert c.free_count == CAPACITY - len({int(x) for s in range(N_SEQ) for x in c.seq_cells(s)})
        occupied = np.flatnonzero(c.cell_positions >= 0)  # used_extent is kept up to date, not recounted
        assert c.used_extent() == (int(occupied[-1]) + 1 if occupied.size else 0)
        if c.per_sequence:  # and so are the streams' extents
            used = c.cell_positions.reshape(N_SEQ, -1) >= 0
            assert c.stream_extents().tolist() == [int(np.flatnonzero(u)[-1]) + 1 if u.any() else 0 for u in used]
            for first, count, padding in ((0, N_SEQ, 1), (1, 2, 4), (N_SEQ - 1, 1, 3)):
                assert c.streams_extent(first, count, padding) == \
                    int(c.stream_extents(padding)[first:first + count].max())
        window = self.config.get("swa_window")
        for s in range(N_SEQ):
            top = max(self.model[s], default=-1)
            for p in range(top + 3):
                needed = range(max(0, p - window), p) if window else range(0)
                assert c.can_resume(s, p) == all(q in self.model[s] for q in needed)
            if self.model[s]:
                self.check_masks([(s, top + 1), (s, (top + 1) // 2)])
                # the one-token mask (a shortcut without window/chunk) equals the general one; an
                # empty noncausal range forces the general path
                one = batch((s, top + 1))
                np.testing.assert_array_equal(c.mask(*one), c.mask(*one, noncausal=[(0, 0)]))

    def check_masks(self, pairs):
        """Each row sees exactly the model's positions the rules allow, noncausal rows included."""
        c = self.cells
        pos, seq = batch(*pairs)
        rng = (0, len(pairs) // 2)
        m = c.mask(pos, seq, n_kv=CAPACITY, noncausal=[rng])
        if c.per_sequence:  # each row of the stream mask is the full mask's columns of its stream
            size = c.stream_size
            for dtype in (np.float32, np.float16):
                sm = c.stream_mask(pos, seq, size, noncausal=[rng], dtype=dtype)
                assert sm.dtype == dtype
                for i, s in enumerate(seq.tolist()):
                    np.testing.assert_array_equal(sm[i], m[i, s * size:(s + 1) * size])
        window, chunk = self.config.get("swa_window"), self.config.get("chunk_size")
        for i, (s, p) in enumerate(pairs):
            if rng[0] <= i < rng[1]:
                span = [q for j, (t, q) in enumerate(pairs) if t == s and rng[0] <= j < rng[1]]
                extra = range(min(span), max(span) + 1)
            else:
                extra = range(0)
            want = {
                q
                for q in self.model[s]
                if (q <= p or q in extra)
                and (window is None or p - q < window)
                and (chunk is None or q // chunk == p // chunk)
            }
            cols = np.flatnonzero(m[i] == 0)
            assert sorted(c.cell_positions[cols].tolist()) == sorted(want)
            assert self.value[cols].tolist() == [self.model[s][q] for q in c.cell_positions[cols].tolist()]


TestCellsMachine = CellsMachine.TestCase
TestCellsMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_an_empty_batch_places_nothing():
    for cells in (Cells(64, 4), Cells(64, 4, per_sequence=True), Cells(64, 4, per_sequence=True, swa_window=3)):
        before = state(cells)
        assert cells.place(np.array([], np.int32), np.array([], np.int32)).tolist() == []
        assert_same_state(before, cells)


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [2, 1, 3, 0]])
def test_a_decode_step_fills_a_hole_below_a_streams_top(order):
    """A stream whose middle was removed has a free cell below its top: a decode step (in slot order, and
    not) puts that stream's token there, the others' after their last cell."""
    cells = Cells(4 * 8, 4, per_sequence=True)
    cells.place(*batch(*[(s, p) for s in range(4) for p in range(4)]))
    cells.remove(1, 1, 2)  # stream 1: position 1's cell (9) is free, later positions move down
    placed = cells.place(*batch(*[(s, 3 if s == 1 else 4) for s in order]))
    assert dict(zip(order, placed.tolist(), strict=True)) == {0: 4, 1: 9, 2: 20, 3: 28}


def test_streams_take_their_lowest_free_cells_in_batch_order():
    """per_sequence: each new token gets the lowest free cell of its own stream, a sequence's tokens in
    batch order, for decode steps (one token each) and mixed batches; a full stream refuses the batch
    and changes nothing."""
    rng = np.random.default_rng(4)
    cells = Cells(4 * 32, 4, per_sequence=True)
    top = [0, 0, 0, 0]
    for step in range(12):
        counts = [1, 1, 1, 1] if step % 2 else rng.integers(0, 4, size=4).tolist()
        seqs = np.repeat(np.arange(4), counts)
        rng.shuffle(seqs)
        positions = []
        for s in seqs.tolist():
            positions.append(top[s])
            top[s] += 1
        before = cells._count.copy()
        placed = cells.place(positions, seqs)
        for s in range(4):  # the reference: the stream's free cells, lowest first, in batch order
            free = [c for c in range(32 * s, 32 * s + 32) if before[c] == 0]
            assert placed[seqs == s].tolist() == free[:counts[s]], (step, s)
        if step == 3:
            cells.remove(2, 0, 2)  # frees the two lowest cells of stream 2: they are taken next
    again = cells.place([0, 1], [0, 0])  # stored positions: their own cells, no free cell needed
    assert again.tolist() == cells.seq_cells(0)[:2].tolist()
    with pytest.raises(CacheFullError, match="sequence 1"):
        cells.place(list(range(top[1], top[1] + 32)), [1] * 32)
