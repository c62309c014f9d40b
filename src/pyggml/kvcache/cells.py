"""Tensor-free bookkeeping of the KV cache: which cell holds which (sequence, position).

`Cells` picks the cell each token of a batch is written to and builds the attention
mask over the cells; the `Causal` cache wraps it and owns the ggml tensors (keys and
values are written with ``set_rows`` at the cells `place` returns, and read through a
view of the first ``n_kv`` cells). Everything done per step is vectorised numpy.

State, per cell ``c``: ``pos[c]`` (the token position stored there, -1 when free),
``member[s, c]`` (whether sequence ``s`` sees it; cells are shared after
`Cells.copy_prefix`) and ``count[c]`` (how many sequences see it; free iff 0).
Each (sequence, position) pair is stored in at most one cell.

With ``per_sequence=True`` the cells are split into one stream per sequence (cells
``[s * stream_size, (s + 1) * stream_size)`` belong to sequence ``s``), as llama.cpp's
non-unified cache: attention can then read each sequence's own cells instead of every
sequence's, and ``copy_prefix`` copies cells into the destination's stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

_I32 = np.iinfo(np.int32)
_NO_CELLS = np.zeros(0, np.int64)


class CacheFullError(RuntimeError):
    """Not enough free cells for a batch (or for the copies a shift needs)."""


class NotSupportedError(RuntimeError):
    """The operation needs a key shift, and the model cannot shift keys."""


@dataclass(frozen=True)
class Shift:
    """Tensor work a removal from the middle of a sequence needs, in this order.

    1. copy the K/V rows of cells ``copies[:, 0]`` to cells ``copies[:, 1]``
       (cells shared with other sequences, split off for the shifted sequence);
    2. re-rotate the keys of ``cells`` by ``delta`` positions (``delta < 0``).
    """

    copies: np.ndarray  # (n, 2) int32: source cell, destination cell
    cells: np.ndarray  # int32
    delta: int


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _as_int32(name: str, values: ArrayLike) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{name} must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    if arr.dtype != np.int32 and arr.size and (arr.min() < _I32.min or arr.max() > _I32.max):
        raise ValueError(f"{name} must fit in int32")
    return arr.astype(np.int32, copy=False)


class Cells:
    """Cell allocation and masks for a KV cache of ``capacity`` cells shared by sequences.

    Decisions:

    * Any free cell will do (writes go through ``set_rows``), lowest index first so
      that ``n_kv`` stays small: a batch fits whenever enough cells are free.
    * Placing a (sequence, position) that is already stored overwrites it: the same
      cell is reused when only that sequence sees it; a cell shared with other
      sequences keeps their data and the token gets a new cell.
    * Sliding window: before placing, each batch sequence forgets its cells more
      than ``swa_memory`` positions before its *lowest* position in the batch (the
      lowest, not the newest, so every token of a long batch still sees its window).
    * Chunked attention only masks; it frees nothing.
    * A removal from the middle moves later positions down; cells shared with other
      sequences are split (a copy for the shifted sequence), see `Shift`.
    """

    def __init__(
        self,
        capacity: int,
        max_sequences: int,
        *,
        swa_window: int | None = None,
        swa_memory: int | None = None,
        chunk_size: int | None = None,
        per_sequence: bool = False,
    ) -> None:
        if capacity < 1 or max_sequences < 1:
            raise ValueError(f"Cells: capacity ({capacity}) and max_sequences ({max_sequences}) must be >= 1")
        if per_sequence and capacity % max_sequences:
            raise ValueError(f"Cells: per_sequence needs capacity ({capacity}) to be a multiple of max_sequences "
                             f"({max_sequences})")
        if swa_window is not None and swa_window < 1:
            raise ValueError(f"Cells: swa_window must be >= 1, got {swa_window}")
        if swa_memory is not None and (swa_window is None or swa_memory < swa_window):
            raise ValueError(f"Cells: swa_memory ({swa_memory}) needs a swa_window ({swa_window}) <= it")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"Cells: chunk_size must be >= 1, got {chunk_size}")
        self.capacity = capacity
        self.max_sequences = max_sequences
        self.swa_window = swa_window
        self.swa_memory = swa_window if swa_memory is None else swa_memory
        self.chunk_size = chunk_size
        self.per_sequence = per_sequence
        self.stream_size = capacity // max_sequences if per_sequence else capacity
        self._pos = np.full(capacity, -1, np.int32)
        # which sequences see which cells (``_sees``): without streams a cell may be shared (``copy_prefix``),
        # so a (sequences, cells) matrix; with streams a cell is only its stream's sequence's, seen while used
        # (count 1), so nothing is stored: the matrix would be P x P x num_ctx booleans, copied by every snapshot
        self._member = None if per_sequence else np.zeros((max_sequences, capacity), bool)
        self._count = np.zeros(capacity, np.int32)
        self._extent: int | None = 0  # highest used cell + 1, or None: recount (numpy calls cost ~5 us here)
        # per stream (``per_sequence``) its highest used cell + 1, counted from the stream's start, or None:
        # recount (a pass over every cell); kept up to date while cells are only added, as decode steps do
        self._stream_top: np.ndarray | None = np.zeros(max_sequences, np.int64) if per_sequence else None
        # with it, per stream its used cells: as many as its top means no free cell below the top
        self._stream_used: np.ndarray | None = np.zeros(max_sequences, np.int64) if per_sequence else None
        self._stream_starts = np.arange(max_sequences, dtype=np.int64) * self.stream_size  # each stream's first cell
        # upper bound of each sequence's highest stored position (-1: none), to skip lookups
        self._top = np.full(max_sequences, -1, np.int64)

    # ---- queries -------------------------------------------------------------------

    @property
    def free_count(self) -> int:
        """Number of cells no sequence sees."""
        return int(np.count_nonzero(self._count == 0))

    @property
    def cell_positions(self) -> np.ndarray:
        """Read-only view of the position stored in each cell (-1 = free)."""
        view = self._pos.view()
        view.flags.writeable = False
        return view

    def seq_cells(self, seq: int) -> np.ndarray:
        """Cells ``seq`` sees, in position order."""
        self._check_seq(seq)
        cells = self._cells_of(seq)
        return cells[np.argsort(self._pos[cells], kind="stable")]

    def seq_positions(self, seq: int) -> np.ndarray:
        """Sorted positions stored for ``seq``."""
        return self._pos[self.seq_cells(seq)]

    def used_extent(self, padding: int = 1) -> int:
        """Cells attention must read: the highest used cell + 1, rounded up to ``padding``.

        Capped at ``capacity`` (keep ``capacity`` a multiple of ``padding``).
        """
        if padding < 1:
            raise ValueError(f"used_extent: padding must be >= 1, got {padding}")
        top = self._extent
        if top is None:
            used = np.flatnonzero(self._count)
            top = self._extent = int(used[-1]) + 1 if used.size else 0
        return min(_round_up(top, padding), self.capacity)

    def stream_extents(self, padding: int = 1) -> np.ndarray:
        """Per stream (``per_sequence``), the cells attention must read in it: its highest used
        cell (counted from the stream's start) + 1, rounded up to ``padding``, capped at the
        stream's size. Without streams, ``[used_extent(padding)]``."""
        if not self.per_sequence:
            return np.array([self.used_extent(padding)])
        return np.minimum(_round_up(self._stream_tops(), padding), self.stream_size)

    def streams_extent(self, first: int, count: int, padding: int = 1) -> int:
        """The largest of ``stream_extents(padding)`` over streams [first, first + count) (``per_sequence``),
        in one numpy call (rounding up commutes with the largest)."""
        return min(_round_up(int(self._stream_tops()[first:first + count].max()), padding), self.stream_size)

    def _stream_tops(self) -> np.ndarray:
        """Per stream its highest used cell + 1, counted from the stream's start (``per_sequence``)."""
        if self._stream_top is None:
            used = self._count.reshape(self.max_sequences, self.stream_size) != 0
            self._stream_top = np.where(used.any(axis=1), self.stream_size - np.argmax(used[:, ::-1], axis=1), 0)
            self._stream_used = np.count_nonzero(used, axis=1).astype(np.int64)
        return self._stream_top

    def can_resume(self, seq: int, pos: int) -> bool:
        """Whether generation of ``seq`` can restart at ``pos`` from what is stored.

        With a sliding window the positions ``[pos - swa_window, pos)`` must all still
        be stored (older ones may have been dropped); always true without a window.
        """
        self._check_seq(seq)
        if pos < 0:
            raise ValueError(f"can_resume: pos must be >= 0, got {pos}")
        if self.swa_window is None:
            return True
        start = max(0, pos - self.swa_window)
        stored = self._pos[self._cells_of(seq)]
        return int(np.count_nonzero((stored >= start) & (stored < pos))) == pos - start

    # ---- batch ---------------------------------------------------------------------

    def place(self, positions: ArrayLike, sequences: ArrayLike) -> np.ndarray:
        """Choose the cell for each token of a batch (int32, one per token) and record it.

        Raises `CacheFullError`, with nothing changed, when too few cells are free.
        """
        pos, seq = self._batch("place", positions, sequences)
        n = pos.size
        if n == 1 and self.swa_window is None and pos[0] > self._top[seq[0]]:
            return self._append_one(int(pos[0]), int(seq[0]))
        # one token of each sequence, in slot order (a decode step): no pair can repeat, and the
        # per-sequence updates below need no unbuffered (``ufunc.at``) or sorting passes
        distinct = bool((seq[1:] > seq[:-1]).all())
        if distinct and n and self.per_sequence and self.swa_window is None:
            cells = self._append_streams(pos, seq)
            if cells is not None:
                return cells
        if not distinct:
            keys = np.sort((seq.astype(np.int64) << 32) | pos)
            if (keys[1:] == keys[:-1]).any():
                raise ValueError("place: a (sequence, position) pair appears twice in the batch")

        # Plan on a copy of the counts (when the plan changes them: an appending batch only reads them);
        # commit only once the batch is known to fit.
        gone_seq, gone_cell = self._window_drops(pos, seq)
        tok, old = self._lookup(pos, seq)
        count = self._count.copy() if gone_cell.size or tok.size else self._count
        if gone_cell.size:
            np.subtract.at(count, gone_cell, 1)
        cells = np.full(n, -1, np.int32)  # -1: needs a free cell
        if tok.size:
            reuse = count[old] == 1  # only this sequence sees the cell: overwrite in place
            cells[tok[reuse]] = old[reuse]
            detach = ~reuse  # shared: the token gets a new cell, the others keep this one
            np.subtract.at(count, old[detach], 1)
            gone_seq = np.concatenate([gone_seq, seq[tok[detach]]])
            gone_cell = np.concatenate([gone_cell, old[detach]])
        fresh = np.flatnonzero(cells < 0)
        new = self._free_cells(count, seq[fresh], distinct)

        if gone_cell.size:
            self._leave(gone_seq, gone_cell)
            self._pos[gone_cell[count[gone_cell] == 0]] = -1
            self._changed()
        elif new.size:  # cells only added: the extents grow to hold them
            self._grown(new, distinct)
        self._count = count
        self._pos[new] = pos[fresh]
        self._join(seq[fresh], new)
        count[new] = 1
        cells[fresh] = new
        if distinct:
            self._top[seq] = np.maximum(self._top[seq], pos)
        else:
            np.maximum.at(self._top, seq, pos)
        return cells

    def _append_streams(self, pos: np.ndarray, seq: np.ndarray) -> np.ndarray | None:
        """``place`` of the usual decode step with streams, in a third of its numpy calls (each costs
        microseconds): one token of each of increasing sequences, each after every position its sequence
        stores, into its stream's top cell (``_top_cells``: the cell the general path would choose). None,
        having changed nothing, when that does not hold."""
        if not (pos > self._top[seq]).all():
            return None
        new = self._top_cells(seq)
        if new is None:
            return None
        self._pos[new] = pos
        self._count[new] = 1
        self._top[seq] = pos
        self._stream_top[seq] += 1  # (each stream once: no repeated index)
        self._stream_used[seq] += 1
        if self._extent is not None:
            self._extent = max(self._extent, int(new[-1]) + 1)  # (the increasing streams' last cell is the highest)
        return new.astype(np.int32)

    def _top_cells(self, streams: np.ndarray) -> np.ndarray | None:
        """Each of ``streams``' top cell (after its highest used one) when none of them is full or has a free
        cell below its top: then it is the stream's lowest free cell, found without a pass over the streams'
        cells (P x context). None otherwise."""
        tops = self._stream_tops()[streams]
        if not ((tops < self.stream_size).all() and (self._stream_used[streams] == tops).all()):
            return None
        cells = tops + self._stream_starts[streams]
        return None if self._count[cells].any() else cells  # (free by definition: a stale count says no)

    def _free_cells(self, count: np.ndarray, seqs: np.ndarray, distinct: bool = False) -> np.ndarray:
        """One free cell (by ``count``) for each token of sequences ``seqs``, lowest first (in each
        sequence's own stream with ``per_sequence``); CacheFullError when too few are free.
        ``distinct``: ``seqs`` is increasing (each sequence once)."""
        if not self.per_sequence:
            new = np.flatnonzero(count == 0)[: seqs.size]
            if new.size < seqs.size:
                raise CacheFullError(
                    f"place: {seqs.size} tokens need a free cell, only {new.size} of {self.capacity} are free")
            return new
        # every stream at once: a free cell is taken while fewer free cells than the stream's token
        # count come before it (a running count); tokens of a stream get its cells lowest first
        if not seqs.size:
            return np.empty(0, np.int64)
        size = self.stream_size
        if distinct:  # each stream once, in order: one cell each
            streams, inverse, wanted = seqs, None, np.ones(seqs.size, np.int64)
        else:
            streams, inverse, wanted = np.unique(seqs, return_inverse=True, return_counts=True)
        if distinct or wanted.max() == 1:  # a decode step: the lowest free cell of each stream, at or below its top
            # (``count`` may have freed cells below a top, never taken any above one)
            top = self._top_cells(streams) if count is self._count else None
            if top is not None:
                return top if inverse is None else top[inverse]
            tops = self._stream_tops()[streams]
            rows = np.arange(streams.size)
            block = count.reshape(self.max_sequences, size)[streams, :min(int(tops.max()) + 1, size)]
            taken = np.argmin(block, axis=1)  # the first 0, where there is one
            short = block[rows, taken] != 0
        else:
            free = (count.reshape(self.max_sequences, size) == 0)[streams]
            rank = np.cumsum(free, axis=1)
            short = rank[:, -1] < wanted
            rows, taken = np.nonzero(free & (rank <= wanted[:, None]))
        if short.any():
            s = int(np.flatnonzero(short)[0])
            n_free = int(np.count_nonzero(count[streams[s] * size:(streams[s] + 1) * size] == 0))
            raise CacheFullError(f"place: {wanted[s]} tokens of sequence {streams[s]} need a free cell, only "
                                 f"{n_free} of its {size} are free")
        if inverse is None:  # one cell per stream, in the order of seqs
            return taken + streams.astype(np.int64) * size
        new = np.empty(seqs.size, np.int64)
        new[np.argsort(inverse, kind="stable")] = taken + streams[rows].astype(np.int64) * size
        return new

    def _append_one(self, pos: int, seq: int) -> np.ndarray:
        """``place`` of the usual decode step without numpy's per-call overhead on 1-element arrays:
        one token after every position its sequence stores (nothing to overwrite or drop)."""
        if self.per_sequence:
            base = seq * self.stream_size
            cell = base + int(np.argmin(self._count[base:base + self.stream_size]))
            if self._count[cell]:
                raise CacheFullError(f"place: 1 tokens of sequence {seq} need a free cell, only 0 of its "
                                     f"{self.stream_size} are free")
        else:
            cell = int(np.argmin(self._count))  # the lowest free cell, when there is one
            if self._count[cell]:
                raise CacheFullError(f"place: 1 tokens need a free cell, only 0 of {self.capacity} are free")
        self._pos[cell] = pos
        self._join(seq, cell)
        self._count[cell] = 1
        self._top[seq] = pos
        if self._extent is not None and cell >= self._extent:
            self._extent = cell + 1
        if self._stream_top is not None:
            self._stream_top[seq] = max(int(self._stream_top[seq]), cell - seq * self.stream_size + 1)
            self._stream_used[seq] += 1
        return np.array([cell], np.int32)

    def _grown(self, new: np.ndarray, distinct: bool = False) -> None:
        """Cells ``new`` were taken (none freed): the extents cover them. ``distinct``: in increasing
        streams, one cell each."""
        if self._extent is not None:
            self._extent = max(self._extent, int(new.max()) + 1)
        if self._stream_top is not None:
            streams, top = np.divmod(new, self.stream_size)
            if distinct:
                self._stream_top[streams] = np.maximum(self._stream_top[streams], top + 1)
                self._stream_used[streams] += 1
            else:
                np.maximum.at(self._stream_top, streams, top + 1)
                np.add.at(self._stream_used, streams, 1)

    def _changed(self) -> None:
        """Cells were freed or moved: the extents are counted again when next asked."""
        self._extent = None
        self._stream_top = self._stream_used = None

    def mask(
        self,
        positions: ArrayLike,
        sequences: ArrayLike,
        *,
        n_kv: int | None = None,
        padding: int = 1,
        row_padding: int = 1,
        noncausal: Sequence[tuple[int, int]] = (),
        dtype: DTypeLike = np.float32,
    ) -> np.ndarray:
        """Attention mask of a placed batch, shaped (rows, n_kv): 0 visible, -inf hidden.

        Row ``i`` is batch token ``i``, column ``j`` is cell ``j``. A cell is visible when
        it holds the token's sequence at a position <= the token's; with a sliding
        window also less than ``swa_window`` positions back; with chunks also in the
        token's chunk. ``noncausal`` lists batch row ranges ``[start, end)`` (e.g. image
        tokens) whose rows also see the cells of their sequence within the positions of
        that range, in either order (window and chunk limits still apply).

        ``n_kv`` defaults to ``used_extent(padding)``; pass a larger one (up to
        ``capacity``) to keep graph shapes fixed. Rows are padded with fully hidden
        rows up to a multiple of ``row_padding`` (older ggml wanted flash-attention
        masks padded to GGML_KQ_MASK_PAD; the vendored ggml has no such constant and
        only needs ``mask rows >= batch``, so 1 suffices; its flash attention wants F16).
        """
        pos, seq = self._batch("mask", positions, sequences)
        if row_padding < 1:
            raise ValueError(f"mask: row_padding must be >= 1, got {row_padding}")
        if n_kv is None:
            n_kv = self.used_extent(padding)
        elif not self.used_extent() <= n_kv <= self.capacity:
            raise ValueError(
                f"mask: n_kv {n_kv} must cover the used cells ({self.used_extent()}) "
                f"and fit the capacity ({self.capacity})"
            )
        if pos.size == 1 and row_padding == 1 and not noncausal and self.swa_window is None and \
                self.chunk_size is None:  # a decode step: one row, in two numpy calls
            visible = self._row(int(seq[0]), n_kv) & (self._pos[:n_kv] <= pos[0])
            return np.where(visible, np.zeros(1, dtype), np.full(1, -np.inf, dtype)).reshape(1, n_kv)
        visible = self._visible(pos, seq, n_kv, noncausal)
        out = np.full((_round_up(pos.size, row_padding), n_kv), -np.inf, dtype)
        np.copyto(out[: pos.size], 0, where=visible)
        return out

    def stream_mask(self, positions: ArrayLike, sequences: ArrayLike, n_kv: int, *,
                    noncausal: Sequence[tuple[int, int]] = (), dtype: DTypeLike = np.float32) -> np.ndarray:
        """Attention mask of a placed batch over each token's own stream (``per_sequence``):
        (rows, n_kv), column j of row i being cell j of the stream of token i's sequence; 0
        visible, -inf hidden, by the rules of ``mask``."""
        pos, seq = self._batch("stream_mask", positions, sequences)
        return self.placed_stream_mask(pos, seq, n_kv, noncausal=noncausal, dtype=dtype)

    def placed_stream_mask(self, pos: np.ndarray, seq: np.ndarray, n_kv: int, *,
                           noncausal: Sequence[tuple[int, int]] = (), dtype: DTypeLike = np.float32) -> np.ndarray:
        """``stream_mask`` of the int32 arrays that ``place`` took (checked there: not again, every step)."""
        if not self.per_sequence:
            raise ValueError("stream_mask: the cells are not split per sequence (per_sequence=False)")
        if not 0 < n_kv <= self.stream_size:
            raise ValueError(f"stream_mask: n_kv {n_kv} must lie in [1, {self.stream_size}] (the stream size)")
        visible = self._visible(pos, seq, n_kv, noncausal, streams=True)
        kind = np.dtype(dtype).type
        return np.where(visible, kind(0), kind(-np.inf))

    # ---- sequence edits ------------------------------------------------------------

    def remove(self, seq: int, begin: int, end: int | None = None, *, can_shift: bool = True) -> Shift | None:
        """Forget positions ``[begin, end)`` of ``seq`` (``end=None``: to the end).

        Later positions of ``seq`` move down by ``end - begin``; the returned `Shift`
        says which keys to re-rotate (``None`` when nothing moves). With
        ``can_shift=False`` such a removal raises `NotSupportedError`; when splitting
        shared cells needs more free cells than there are, `CacheFullError`. Either
        way nothing is changed (``check_remove`` raises the same without removing).
        """
        gone, moves = self.check_remove(seq, begin, end, can_shift=can_shift)
        if moves is None:
            self._unlink(seq, gone)
            self._refresh_top(seq)
            return None
        own, shared, split = moves
        delta = begin - end
        self._unlink(seq, gone)
        self._unlink(seq, shared)
        self._pos[split] = self._pos[shared]
        self._join(seq, split)
        self._count[split] = 1
        self._changed()
        moved = np.concatenate([own, split]).astype(np.int32)
        self._pos[moved] += delta
        self._refresh_top(seq)
        copies = np.stack([shared, split], axis=1).astype(np.int32)
        return Shift(copies=copies, cells=moved, delta=delta)

    def check_remove(self, seq: int, begin: int, end: int | None = None, *,
                     can_shift: bool = True) -> tuple[np.ndarray, tuple[np.ndarray, ...] | None]:
        """Raise what ``remove`` would, changing nothing; else (the cells that go, and None when no
        later position moves, else the cells that move in place, the shared ones that are split and
        the free cells they move to)."""
        self._check_seq(seq)
        if begin < 0 or (end is not None and end < begin):
            raise ValueError(f"remove: need 0 <= begin <= end, got begin={begin} end={end}")
        cells = self._cells_of(seq)
        stored = self._pos[cells]
        later = cells[stored >= end] if end is not None else cells[:0]
        if later.size and end > begin and not can_shift:
            raise NotSupportedError(
                f"remove: positions [{begin}, {end}) of sequence {seq} are followed by others, "
                "and the model cannot shift keys; remove to the end instead"
            )
        if end is None:
            return cells[stored >= begin], None
        gone = cells[(stored >= begin) & (stored < end)]
        if not later.size or end == begin:
            return gone, None
        count = self._count.copy()
        count[gone] -= 1
        shared = later[count[later] > 1]
        own = later[count[later] == 1]
        split = np.flatnonzero(count == 0)[: shared.size]
        if split.size < shared.size:
            raise CacheFullError(
                f"remove: shifting sequence {seq} must split {shared.size} shared cells, "
                f"only {split.size} cells are free"
            )
        return gone, (own, shared, split)

    def copy_prefix(self, src: int, dst: int, length: int) -> np.ndarray:
        """Make ``dst`` exactly ``src``'s positions ``< length``. Whatever ``dst`` held before is
        forgotten, as in Ollama. Without streams ``dst`` shares ``src``'s cells (no data copied) and
        the result is empty; with ``per_sequence`` the cells are copied into ``dst``'s stream: the
        result (n, 2) lists the (source, destination) cells whose keys and values must be copied.
        """
        self._check_seq(src)
        self._check_seq(dst)
        if length < 0:
            raise ValueError(f"copy_prefix: length must be >= 0, got {length}")
        if self.per_sequence:
            cells = self._cells_of(dst)
            if src == dst:  # what lies past the prefix goes
                self._unlink(dst, cells[self._pos[cells] >= length])
                self._refresh_top(dst)
                return np.zeros((0, 2), np.int32)
            source = self._cells_of(src)
            source = source[self._pos[source] < length]
            self._unlink(dst, cells)
            target = source + (dst - src) * self.stream_size  # the same place in dst's (now empty) stream
            self._pos[target] = self._pos[source]
            self._join(dst, target)
            self._count[target] = 1
            self._refresh_top(dst)
            return np.stack([source, target], axis=1).astype(np.int32)
        prefix = self._member[src] & (self._pos < length)
        self._unlink(dst, np.flatnonzero(self._member[dst] & ~prefix))
        added = np.flatnonzero(prefix & ~self._member[dst])
        self._member[dst, added] = True
        self._count[added] += 1
        self._changed()
        self._refresh_top(dst)
        return np.zeros((0, 2), np.int32)

    def clear(self) -> None:
        """Forget everything."""
        self._pos.fill(-1)
        if self._member is not None:
            self._member.fill(False)
        self._count.fill(0)
        self._extent = 0
        self._stream_top = np.zeros(self.max_sequences, np.int64) if self.per_sequence else None
        self._stream_used = np.zeros(self.max_sequences, np.int64) if self.per_sequence else None
        self._top.fill(-1)

    # ---- internals -----------------------------------------------------------------

    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.max_sequences:
            raise ValueError(f"sequence {seq} out of range [0, {self.max_sequences})")

    def _batch(self, op: str, positions: ArrayLike, sequences: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        pos = _as_int32("positions", positions)
        seq = _as_int32("sequences", sequences)
        if pos.shape != seq.shape:
            raise ValueError(f"{op}: positions {pos.shape} and sequences {seq.shape} differ in length")
        if pos.size == 1:  # a decode step: Python ints are cheaper than numpy reductions
            if pos[0] < 0:
                raise ValueError(f"{op}: positions must be >= 0, got {pos[0]}")
            if not 0 <= seq[0] < self.max_sequences:
                raise ValueError(f"{op}: sequences must lie in [0, {self.max_sequences})")
        elif pos.size:
            if pos.min() < 0:
                raise ValueError(f"{op}: positions must be >= 0, got {pos.min()}")
            if seq.view(np.uint32).max() >= self.max_sequences:  # negatives wrap to large values
                raise ValueError(f"{op}: sequences must lie in [0, {self.max_sequences})")
        return pos, seq

    def _window_drops(self, pos: np.ndarray, seq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sequence, cell) pairs the batch leaves outside every sequence's sliding memory."""
        if self.swa_window is None or not pos.size:
            return _NO_CELLS, _NO_CELLS
        low = np.full(self.max_sequences, _I32.max, np.int64)
        np.minimum.at(low, seq, pos)
        batch_seqs = np.flatnonzero(low != _I32.max)
        limit = low[batch_seqs] - self.swa_memory
        if limit.max() <= 0:
            return _NO_CELLS, _NO_CELLS
        cand = np.flatnonzero(self._pos.view(np.uint32) < limit.max())  # free cells (-1) wrap high
        stale = self._sees(batch_seqs[:, None], cand) & (self._pos[cand] < limit[:, None])
        row, j = np.divmod(np.flatnonzero(stale), cand.size)
        return batch_seqs[row], cand[j]

    def _lookup(self, pos: np.ndarray, seq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(token index, cell) for the batch tokens whose (sequence, position) is stored."""
        if (pos > self._top[seq]).all():  # appending: the usual case
            return _NO_CELLS, _NO_CELLS
        cand = np.flatnonzero(np.isin(self._pos, pos))
        if not cand.size:
            return _NO_CELLS, _NO_CELLS
        hit = self._sees(seq[:, None], cand) & (self._pos[cand] == pos[:, None])
        tok, j = np.divmod(np.flatnonzero(hit), cand.size)
        return tok, cand[j]

    def _unlink(self, seqs: np.ndarray | int, cells: np.ndarray) -> None:
        """Take sequences out of cells (pairwise); cells nobody sees any more become free."""
        self._leave(seqs, cells)
        np.subtract.at(self._count, cells, 1)
        self._pos[cells[self._count[cells] == 0]] = -1
        self._changed()

    def _refresh_top(self, seq: int) -> None:
        self._top[seq] = int(self._pos[self._cells_of(seq)].max(initial=-1))

    # ---- membership (see ``_member``) -------------------------------------------------------

    def _sees(self, seqs: np.ndarray | int, cells: np.ndarray) -> np.ndarray:
        """Whether each sequence sees each cell (``seqs`` and ``cells`` broadcast as numpy indices)."""
        if self._member is not None:
            return self._member[seqs, cells]
        return (self._count[cells] > 0) & (cells // self.stream_size == seqs)

    def _row(self, seq: int, stop: int) -> np.ndarray:
        """Whether ``seq`` sees each of the cells [0, stop)."""
        if self._member is not None:
            return self._member[seq, :stop]
        row = np.zeros(stop, bool)
        lo, hi = seq * self.stream_size, min((seq + 1) * self.stream_size, stop)
        if lo < hi:
            row[lo:hi] = self._count[lo:hi] > 0
        return row

    def _rows(self, seqs: np.ndarray, stop: int) -> np.ndarray:
        """Whether each of ``seqs`` sees each of the cells [0, stop): (len(seqs), stop)."""
        if self._member is not None:
            return self._member[seqs, :stop]
        return (self._count[:stop] > 0) & (np.arange(stop) // self.stream_size == seqs[:, None])

    def _cells_of(self, seq: int) -> np.ndarray:
        """The cells ``seq`` sees, in ascending order."""
        if self._member is not None:
            return np.flatnonzero(self._member[seq])
        base = seq * self.stream_size
        return base + np.flatnonzero(self._count[base:base + self.stream_size])

    def _join(self, seqs: np.ndarray | int, cells: np.ndarray | int) -> None:
        if self._member is not None:
            self._member[seqs, cells] = True

    def _leave(self, seqs: np.ndarray | int, cells: np.ndarray | int) -> None:
        if self._member is not None:
            self._member[seqs, cells] = False

    def _visible(self, pos: np.ndarray, seq: np.ndarray, n_kv: int, noncausal: Sequence[tuple[int, int]],
                 streams: bool = False) -> np.ndarray:
        """Bool (n_tokens, n_kv): which cells each batch token attends to. Column j is cell j, or
        with ``streams`` cell j of the stream of row i's sequence (``per_sequence``)."""
        tok_pos = pos[:, None]
        if not streams:
            cell_pos = self._pos[:n_kv]
            visible = self._rows(seq, n_kv) & (cell_pos <= tok_pos)
        else:  # rows of (stream, cell) views: one slice per token rather than a gather per cell
            size = self.stream_size
            cell_pos = self._pos.reshape(-1, size)[seq, :n_kv]
            # a stream's used cells are its sequence's, and a free cell stores -1: as unsigned it lies past
            # every position (one pass, no count read)
            visible = cell_pos.view(np.uint32) <= pos.view(np.uint32)[:, None]
        for start, end in noncausal:
            if not 0 <= start <= end <= pos.size:
                raise ValueError(f"mask: noncausal range ({start}, {end}) outside the batch of {pos.size}")
            for s in np.unique(seq[start:end]):
                rows = start + np.flatnonzero(seq[start:end] == s)
                lo, hi = pos[rows].min(), pos[rows].max()
                if streams:  # the rows' own stream: its free cells' -1 lies below lo
                    visible[rows] |= (cell_pos[rows] >= lo) & (cell_pos[rows] <= hi)
                else:
                    visible[rows] |= self._row(int(s), n_kv) & (cell_pos >= lo) & (cell_pos <= hi)
        if self.swa_window is not None:
            visible &= tok_pos - cell_pos < self.swa_window
        if self.chunk_size is not None:
            visible &= cell_pos // self.chunk_size == tok_pos // self.chunk_size
        return visible
