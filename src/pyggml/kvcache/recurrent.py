"""Recurrent state cache: per sequence and layer, what a recurrent layer carries from token to token.

A recurrent layer (LFM2's short convolution, later Mamba's or DeltaNet's scans) does not attend over
a history of keys; it carries a fixed-size state. Per layer this cache holds, for each of
``max_sequences`` slots, a **convolution state** (the last ``width - 1`` inputs of a causal
depthwise convolution of ``width`` taps) and a **scan state** (``state`` floats: an SSM or
delta-rule matrix), in persistent F32 tensors sized at ``init``: ``num_ctx`` does not grow them.

The layer's graph reads and writes them through index inputs only (rows of the stored states and of
the batch), so a graph's topology depends on the batch's shape alone and is refilled for the next
batch of that shape. A state is valid at exactly one position, the one after the last token it
consumed: a sequence resumes there only (``can_resume``), a batch may start a sequence over at
position 0 (the state is cleared), ``copy_prefix`` copies a state whose position is the prefix's
length, and ``remove`` can drop a whole sequence (or nothing, at its end) but no tail, raising
``NotSupportedError`` so that the runner re-evaluates instead of trusting a wrong state.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from pyggml.kvcache.base import Cache
from pyggml.kvcache.cells import NotSupportedError
from pyggml.tensor import DType, Tensor

if TYPE_CHECKING:
    from pyggml.backend import Backend, Context
    from pyggml.input import Batch

_instances = itertools.count()  # each cache names its graph inputs apart, so caches compose in one graph


class _Pass:
    """One forward pass: each batch row's sequence and index among its sequence's rows, the
    sequences in order of first appearance, and which of them start over (position 0)."""

    __slots__ = ("sequences", "order", "seqs", "fresh", "reserve", "inputs")

    def __init__(self, sequences: np.ndarray, order: np.ndarray, seqs: list[int], fresh: set[int], reserve: bool):
        self.sequences, self.order, self.seqs, self.fresh, self.reserve = sequences, order, seqs, fresh, reserve
        self.inputs: dict[str, Tensor] = {}  # index inputs made so far in this graph, by name


class Recurrent(Cache):
    """Convolution and scan states of recurrent layers (see the module docstring).

    Models call ``set_layer`` and then ``conv(ctx, x, kernel)`` (a causal depthwise convolution
    continuing each sequence's stored inputs) and/or ``get_state``/``put_state`` (a scan state per
    sequence of the batch). ``put``/``get`` (attention) are not for this cache: a hybrid puts it
    beside a ``Causal`` in a ``Wrapper`` and gives each layer the one of its kind.
    """

    def __init__(self) -> None:
        self.backend: Backend | None = None
        self.max_sequences = 0
        self.positions: np.ndarray | None = None  # per slot: the position its states are at (0: empty)
        self.conv_states: dict[int, Tensor] = {}  # layer -> (dim, (width - 1) * (max_sequences + 1))
        self.scan_states: dict[int, Tensor] = {}  # layer -> (size, max_sequences + 1)
        self._layer = 0
        self._pass: _Pass | None = None
        n = next(_instances)
        self._prefix = f"rs{n}"

    # ---- set-up -------------------------------------------------------------------------------
    def init(self, backend: Backend, dtype: DType | str = DType.F32, max_sequences: int = 1, capacity: int = 4096,
             max_batch: int = 512) -> None:
        """States for ``max_sequences`` slots (always F32: ``dtype``, ``capacity`` and ``max_batch``
        size attention caches, not states)."""
        if max_sequences < 1:
            raise ValueError("Recurrent.init: max_sequences must be positive")
        self.backend, self.max_sequences = backend, max_sequences
        self.positions = np.zeros(max_sequences, np.int64)
        self.conv_states, self.scan_states = {}, {}  # allocated at a layer's first use; the last slot stays 0
        self._pass = None

    def close(self) -> None:
        self.conv_states.clear()
        self.scan_states.clear()
        self.positions = None
        self._pass = None

    def set_layer(self, layer: int) -> None:
        self._layer = layer

    # ---- per forward pass ---------------------------------------------------------------------
    def start_forward(self, ctx: Context, batch: Batch, reserve: bool = False) -> None:
        """Check that each sequence of the batch continues its state (first position = the state's
        position) or starts over (position 0), its positions consecutive in batch order; ValueError
        otherwise, the cache unchanged. ``reserve``: worst-case shapes, nothing stored."""
        self._check_init("start_forward")
        self._pass = None
        positions = np.asarray(batch.positions, dtype=np.int64)
        sequences = np.asarray(batch.sequences, dtype=np.int64)
        if positions.shape != sequences.shape or positions.ndim != 1 or positions.size != len(batch.inputs):
            raise ValueError(f"Recurrent.start_forward: batch has {len(batch.inputs)} inputs, {positions.size} "
                             f"positions and {sequences.size} sequences")
        if reserve:
            sequences = np.zeros_like(sequences)
        elif sequences.size and (sequences.min() < 0 or sequences.max() >= self.max_sequences):
            raise ValueError(f"Recurrent.start_forward: sequence ids must be in 0..{self.max_sequences - 1}")
        seqs = list(dict.fromkeys(sequences.tolist()))
        order = np.zeros(sequences.size, np.int64)  # each row's index among its sequence's rows
        fresh, ends = set(), {}
        for seq in seqs:
            rows = np.flatnonzero(sequences == seq)
            order[rows] = np.arange(rows.size)
            if reserve:
                continue
            pos = positions[rows]
            if np.any(np.diff(pos) != 1):
                raise ValueError(f"Recurrent.start_forward: sequence {seq}'s positions {pos.tolist()} are not "
                                 "consecutive in batch order")
            if pos[0] != self.positions[seq] and pos[0] != 0:
                raise ValueError(f"Recurrent.start_forward: sequence {seq} starts at position {int(pos[0])}, but "
                                 f"its state is at position {int(self.positions[seq])} (a recurrent state cannot "
                                 "rewind; remove the sequence and re-evaluate it)")
            if pos[0] == 0:
                fresh.add(seq)
            ends[seq] = int(pos[-1]) + 1
        self._pass = _Pass(sequences, order, seqs, fresh, reserve)
        for seq, end in ends.items():
            self.positions[seq] = end

    def refill(self, ctx: Context, batch: Batch) -> bool:
        """Graph reuse: place ``batch`` and rewrite the index inputs this cache made in ``ctx``.
        False (nothing placed) when the graph read per-sequence states of another number of sequences."""
        names = [f"{self._prefix}.{kind}" for kind in ("state", "slots")]
        for store in self.conv_states.values():
            width = store.shape[1] // (self.max_sequences + 1) + 1
            names += [f"{self._prefix}.taps{width}", f"{self._prefix}.keep{width}"]
        names = [name for name in names if ctx.input_shape(name) is not None]
        previous = self.snapshot()
        self.start_forward(ctx, batch)
        arrays = {name: self._index(name, self._pass) for name in names}
        if any(ctx.input_shape(name) != a.shape[::-1] for name, a in arrays.items()):
            self.restore(previous)
            return False
        for name, array in arrays.items():
            ctx.set_input(name, array)
        self._pass = None
        return True

    # ---- what a recurrent layer calls -------------------------------------------------------------
    def conv(self, ctx: Context, x: Tensor, kernel: Tensor) -> Tensor:
        """Causal depthwise convolution of ``x`` (dim, n_tokens) in batch order with ``kernel``
        (width, dim) (ggml order; tap ``width - 1`` multiplies the token itself): each token sees the
        ``width - 1`` inputs before it in its own sequence, from the batch or from the stored state,
        which then keeps each sequence's last ``width - 1`` inputs. Returns (dim, n_tokens)."""
        p = self._started("conv")
        width, dim = kernel.shape[0], (kernel.shape + (1,))[1]
        n = x.shape[1] if x.ndim > 1 else 1
        if x.ndim > 2 or x.shape[0] != dim or n != p.sequences.size or width < 2:
            raise ValueError(f"Recurrent.conv: x {x.shape} must be (dim, n_tokens) = ({dim}, {p.sequences.size}) "
                             f"for kernel {kernel.shape} (width >= 2, dim)")
        store = self._conv_store(dim, width)
        rows = store.shape[1]
        # one table of rows: every slot's state (and the zero slot), then the batch's inputs
        table = store.view(0, (dim, rows), ctx=ctx).concat(x if x.dtype == DType.F32 else x.cast(DType.F32), 1)
        taps = table.rows(self._input(ctx, f"{self._prefix}.taps{width}", p))  # (dim, width * n), tap-major
        weights = kernel.reshape(width, dim, ctx=ctx).transpose()  # (dim, width): tap j's weights are row j
        weights = weights.contiguous() if kernel.dtype == DType.F32 else weights.cast(DType.F32)
        out = None
        for j in range(width):
            term = taps.view(j * n * taps.strides[1], (dim, n), ctx=ctx) * \
                weights.view(j * weights.strides[1], (dim, 1), ctx=ctx)
            out = term if out is None else out + term
        state = table.rows(self._input(ctx, f"{self._prefix}.keep{width}", p))  # every slot's new state
        ctx.forward(state.copy(store.view(0, (dim, rows - width + 1), ctx=ctx)))
        return out

    def get_state(self, ctx: Context, size: int) -> Tensor:
        """The scan states of the batch's sequences (size, n_seqs), in order of first appearance in
        the batch; zeros for a sequence that starts over."""
        p = self._started("get_state")
        store = self._scan_store(size)
        state = store.rows(self._input(ctx, f"{self._prefix}.state", p), ctx=ctx)
        ctx.forward(state)  # into the graph now: it reads before put_state writes
        return state

    def put_state(self, ctx: Context, state: Tensor) -> None:
        """Store the batch's sequences' new scan states (size, n_seqs), ordered as ``get_state``'s."""
        p = self._started("put_state")
        size = state.shape[0]
        if state.ndim > 2 or (state.shape + (1,))[1] != len(p.seqs):
            raise ValueError(f"Recurrent.put_state: state {state.shape} must be (size, {len(p.seqs)}) for the "
                             f"batch's {len(p.seqs)} sequences")
        store = self._scan_store(size)
        ctx.forward(store.set_rows(state, self._input(ctx, f"{self._prefix}.slots", p), ctx=ctx))

    def put(self, ctx: Context, key: Tensor, value: Tensor) -> None:
        raise ValueError("Recurrent.put: a recurrent cache stores states, not keys and values (route attention "
                         "layers to a Causal cache with a Wrapper)")

    def get(self, ctx: Context) -> tuple[Tensor, Tensor, Tensor | None]:
        raise ValueError("Recurrent.get: a recurrent cache stores states, not keys and values (route attention "
                         "layers to a Causal cache with a Wrapper)")

    def set_noncausal(self, start: int, end: int) -> None:
        pass  # no mask; a recurrent layer is causal by construction

    # ---- index inputs -----------------------------------------------------------------------------
    def _input(self, ctx: Context, name: str, p: _Pass) -> Tensor:
        tensor = p.inputs.get(name)
        if tensor is None:
            tensor = p.inputs[name] = ctx.input().from_numpy(self._index(name, p), DType.I32, name=name)
        return tensor

    def _index(self, name: str, p: _Pass) -> np.ndarray:
        """The index array an input named ``name`` holds for pass ``p``."""
        kind = name[len(self._prefix) + 1:]
        zero = self.max_sequences  # the slot that is never written
        slot = {seq: zero if seq in p.fresh else seq for seq in p.seqs}
        if kind == "state":
            return np.array([slot[s] for s in p.seqs], np.int32)
        if kind == "slots":
            return np.array(p.seqs, np.int32)
        keep = kind.startswith("keep")
        width = int(kind[4:])
        d, n, m = width - 1, p.sequences.size, self.max_sequences
        # each sequence's history as rows of the table: its state's rows, then its batch rows
        history = {seq: [slot[seq] * d + k for k in range(d)] for seq in p.seqs}
        for row in range(n):
            history[int(p.sequences[row])].append((m + 1) * d + row)
        if keep:  # every slot's new state: the last d rows of its history, or itself when not in the batch
            out = np.arange(m * d).reshape(m, d)
            if not p.reserve:
                for seq, rows in history.items():
                    out[seq] = rows[-d:]
            return out.reshape(-1).astype(np.int32)
        taps = np.empty((width, n), np.int32)
        for row in range(n):
            rows = history[int(p.sequences[row])]
            i = int(p.order[row])
            taps[:, row] = rows[i:i + width]
        return taps.reshape(-1)

    # ---- storage ------------------------------------------------------------------------------------
    def _conv_store(self, dim: int, width: int) -> Tensor:
        layer, d = self._layer, width - 1
        store = self.conv_states.get(layer)
        if store is None:
            store = self.conv_states[layer] = self.backend.alloc_persistent(
                DType.F32, (dim, d * (self.max_sequences + 1)), layer=layer, name=f"conv_state_l{layer}")
        elif store.shape != (dim, d * (self.max_sequences + 1)):
            stored = store.shape[1] // (self.max_sequences + 1)
            raise ValueError(f"Recurrent.conv: layer {layer} stores a convolution state of {stored} inputs of "
                             f"{store.shape[0]}, not {d} of {dim}")
        return store

    def _scan_store(self, size: int) -> Tensor:
        layer = self._layer
        store = self.scan_states.get(layer)
        if store is None:
            store = self.scan_states[layer] = self.backend.alloc_persistent(
                DType.F32, (size, self.max_sequences + 1), layer=layer, name=f"scan_state_l{layer}")
        elif store.shape[0] != size:
            raise ValueError(f"Recurrent: layer {layer} stores scan states of {store.shape[0]} floats, not {size}")
        return store

    # ---- sequence management ----------------------------------------------------------------------
    def copy_prefix(self, src_seq: int, dst_seq: int, length: int) -> None:
        """``dst_seq`` gets ``src_seq``'s states when ``length`` is their position; any other
        length leaves ``dst_seq`` empty (a state holds no earlier position), so it resumes at 0 only."""
        self._check_seq("copy_prefix", src_seq, dst_seq)
        if src_seq == dst_seq:
            return
        if length == 0 or length != self.positions[src_seq]:
            self.positions[dst_seq] = 0
            return
        self._copy_slot(src_seq, dst_seq)
        self.positions[dst_seq] = length

    @property
    def rewinds(self) -> bool:
        return False  # no tail can leave a state (checkpoints to roll back to are not kept yet)

    def can_resume(self, seq: int, pos: int) -> bool:
        self._check_seq("can_resume", seq)
        return pos == 0 or pos == self.positions[seq]

    def plan_remove(self, seq: int, begin: int, end: int | None = None) -> Callable[[], None]:
        """Only removals a state can express: the whole sequence (from 0 to its end), or nothing (from
        its end on). Anything else raises NotSupportedError, the cache unchanged."""
        self._check_seq("remove", seq)
        at = int(self.positions[seq])
        if begin < 0 or (end is not None and end < begin):
            raise ValueError(f"Recurrent.remove: bad range ({begin}, {end})")
        if end is not None and end <= begin or begin >= at:
            return lambda: None  # nothing stored there
        if begin == 0 and (end is None or end >= at):
            def clear() -> None:
                self.positions[seq] = 0
            return clear
        raise NotSupportedError(f"Recurrent.remove: sequence {seq}'s state is at position {at}; a recurrent state "
                                f"cannot drop positions {begin}..{'end' if end is None else end} (only the whole "
                                "sequence)")

    def snapshot(self) -> object:
        self._check_init("snapshot")
        return self.positions.copy()

    def restore(self, snapshot: object) -> None:
        self.positions = np.array(snapshot, np.int64)
        self._pass = None

    def _copy_slot(self, src: int, dst: int) -> None:
        """Copy slot ``src``'s convolution and scan states to slot ``dst`` in every layer."""
        if not self.conv_states and not self.scan_states:
            return
        with self.backend.new_context() as ctx:
            outputs = []
            for store in self.conv_states.values():
                d = store.shape[1] // (self.max_sequences + 1)
                rows = ctx.from_numpy(np.arange(src * d, src * d + d, dtype=np.int32), DType.I32)
                outputs.append(store.set_rows(store.rows(rows, ctx=ctx),
                                              ctx.from_numpy(np.arange(dst * d, dst * d + d, dtype=np.int32),
                                                             DType.I32), ctx=ctx))
            for store in self.scan_states.values():
                outputs.append(store.set_rows(store.rows(ctx.from_numpy(np.array([src], np.int32), DType.I32), ctx=ctx),
                                              ctx.from_numpy(np.array([dst], np.int32), DType.I32), ctx=ctx))
            ctx.compute(*outputs)

    def _started(self, op: str) -> _Pass:
        if self._pass is None:
            raise ValueError(f"Recurrent.{op}: call start_forward first")
        return self._pass

    def _check_init(self, op: str) -> None:
        if self.positions is None:
            raise ValueError(f"Recurrent.{op}: cache is not initialised (call init)")

    def _check_seq(self, op: str, *seqs: int) -> None:
        self._check_init(op)
        for seq in seqs:
            if not 0 <= seq < self.max_sequences:
                raise ValueError(f"Recurrent.{op}: sequence {seq} is not in 0..{self.max_sequences - 1}")
