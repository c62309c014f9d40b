"""Recurrent state cache: per sequence and layer, what a recurrent layer carries from token to token.

A recurrent layer (LFM2's short convolution, later Mamba's or DeltaNet's scans) does not attend over
a history of keys; it carries a fixed-size state. Per layer this cache holds, for each of
``max_sequences`` slots, a **convolution state** (the last ``width - 1`` inputs of a causal
depthwise convolution of ``width`` taps) and a **scan state** (``state`` floats: an SSM or
delta-rule matrix), in persistent F32 tensors sized at ``init``: ``num_ctx`` does not grow them.

The layer's graph reads and writes them through index inputs only (rows of the stored states and of
the batch), so a graph's topology depends on the batch's shape alone and is refilled for the next
batch of that shape; it reads and writes only the states of the batch's sequences. A state is valid
at exactly one position, the one after the last token it consumed: a sequence resumes there
(``can_resume``), or at position 0 (the state is cleared).

**Checkpoints** give a state earlier positions to go back to: ``checkpoint(seq, pos)`` copies the
slot's states (at ``pos``) into one of its ``checkpoints`` spare units (bounded memory: when all are
taken, the one closest after another is dropped, so they stay spread over the history). Then
``resumable``/``can_resume`` also answer a checkpoint's position, ``remove(seq, pos)`` rolls the
sequence back to a checkpoint at ``pos`` (its next pass reads the checkpoint's states instead of its
own: no copy), and ``copy_prefix`` forks from the longest checkpoint within the prefix. Any other
removal but the whole sequence raises ``NotSupportedError``, so that the runner re-evaluates instead
of trusting a wrong state. The runner checkpoints where prompts end, before their last input and every
few hundred positions (prefix reuse: runner/checkpoints.py) and before verifying drafts (speculative
rollback: runner/speculative.py).

Storage per layer: units of states, ``max_sequences`` slots, then one that stays zero (a fresh
sequence reads it), then ``checkpoints`` per slot (``checkpoints + 1`` times the memory of the
slots' states alone).
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
    sequences in order of first appearance, which of them start over (position 0), and the unit
    each reads its states from."""

    __slots__ = ("sequences", "order", "seqs", "fresh", "reserve", "reads", "inputs")

    def __init__(self, sequences: np.ndarray, order: np.ndarray, seqs: list[int], fresh: set[int], reserve: bool,
                 reads: dict[int, int]):
        self.sequences, self.order, self.seqs, self.fresh, self.reserve = sequences, order, seqs, fresh, reserve
        self.reads = reads  # per sequence: the unit whose states it continues (its slot, zero, a checkpoint)
        self.inputs: dict[str, Tensor] = {}  # index inputs made so far in this graph, by name


class Recurrent(Cache):
    """Convolution and scan states of recurrent layers (see the module docstring).

    Models call ``set_layer`` and then ``conv(ctx, x, kernel)`` (a causal depthwise convolution
    continuing each sequence's stored inputs) and/or ``get_state``/``put_state`` (a scan state per
    sequence of the batch, of any size: an SSM's, or a delta rule's heads of state_size squared), with
    ``by_sequence``/``by_batch`` to run a scan over the batch laid out per sequence. ``put``/``get``
    (attention) are not for this cache: a hybrid puts it beside a ``Causal`` in a ``Wrapper`` and gives
    each layer the one of its kind.
    """

    def __init__(self, checkpoints: int = 4) -> None:
        if not isinstance(checkpoints, int) or checkpoints < 0:
            raise ValueError(f"Recurrent: checkpoints must be an int >= 0 (per slot), got {checkpoints!r}")
        self.checkpoints = checkpoints
        self.backend: Backend | None = None
        self.max_sequences = 0
        self.units = 0  # state units per layer: slots, the zero unit, checkpoints
        self.positions: np.ndarray | None = None  # per slot: the position its states are at (0: empty)
        self.sources: np.ndarray | None = None  # per slot: the unit its next pass reads (itself, or a checkpoint)
        self.saved: list[dict[int, int]] = []  # per slot: checkpoint unit -> the position it holds
        self.conv_states: dict[int, Tensor] = {}  # layer -> (dim, (width - 1) * units)
        self.scan_states: dict[int, Tensor] = {}  # layer -> (size, units)
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
        self.units = max_sequences * (1 + self.checkpoints) + 1
        self.positions = np.zeros(max_sequences, np.int64)
        self.sources = np.arange(max_sequences)
        self.saved = [{} for _ in range(max_sequences)]
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
        if reserve and sequences.size:  # the largest (T, N) grid of ``by_sequence``: one long sequence, single tokens
            k = min(self.max_sequences, sequences.size)
            sequences = np.concatenate([np.zeros(sequences.size - k + 1, np.int64), np.arange(1, k)])
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
        self._pass = _Pass(sequences, order, seqs, fresh, reserve,
                           {seq: self.max_sequences if seq in fresh else int(self.sources[seq]) for seq in seqs})
        for seq, end in ends.items():
            self.positions[seq] = end
            self.sources[seq] = seq  # a restored checkpoint is read by this pass only

    def refill(self, ctx: Context, batch: Batch) -> bool:
        """Graph reuse: place ``batch`` and rewrite the index inputs this cache made in ``ctx``.
        False (nothing placed) when the graph read per-sequence states of another number of sequences."""
        names = [f"{self._prefix}.{kind}" for kind in ("state", "slots", "seqrows", "seqzero", "batchrows")]
        for width in sorted({store.shape[1] // self.units + 1 for store in self.conv_states.values()}):
            names += [f"{self._prefix}.{kind}{width}" for kind in ("past", "taps", "keep", "dst")]  # shared by layers
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
        # one table of rows: the stored inputs each sequence continues (as many blocks as a batch of n can
        # have sequences, padded with the zero unit: the shape depends on n only), then the batch's inputs
        past = store.rows(self._input(ctx, f"{self._prefix}.past{width}", p), ctx=ctx)
        table = past.concat(x if x.dtype == DType.F32 else x.cast(DType.F32), 1)
        taps = table.rows(self._input(ctx, f"{self._prefix}.taps{width}", p))  # (dim, width * n), tap-major
        weights = kernel.reshape(width, dim, ctx=ctx).transpose()  # (dim, width): tap j's weights are row j
        weights = weights.contiguous() if kernel.dtype == DType.F32 else weights.cast(DType.F32)
        out = None
        for j in range(width):
            term = taps.view(j * n * taps.strides[1], (dim, n), ctx=ctx) * \
                weights.view(j * weights.strides[1], (dim, 1), ctx=ctx)
            out = term if out is None else out + term
        state = table.rows(self._input(ctx, f"{self._prefix}.keep{width}", p))  # each sequence's new state
        ctx.forward(store.set_rows(state, self._input(ctx, f"{self._prefix}.dst{width}", p), ctx=ctx))
        return out

    def get_state(self, ctx: Context, size: int) -> Tensor:
        """The scan states of the batch's sequences (size, n_seqs), in order of first appearance in
        the batch; zeros for a sequence that starts over."""
        p = self._started("get_state")
        store = self._scan_store(size)
        state = store.rows(self._input(ctx, f"{self._prefix}.state", p), ctx=ctx)
        ctx.forward(state)  # into the graph now: it reads before put_state writes
        return state

    def state_store(self, ctx: Context, size: int) -> tuple[Tensor, Tensor]:
        """For an op that gathers its own states (``ssm_scan``): the layer's whole scan-state store
        (size, units) and the unit each of the batch's sequences continues (I32 (n_seqs,), ordered as
        ``get_state``'s; the zero unit for a sequence that starts over). Store new states with ``put_state``."""
        p = self._started("state_store")
        return self._scan_store(size), self._input(ctx, f"{self._prefix}.state", p)

    def put_state(self, ctx: Context, state: Tensor) -> None:
        """Store the batch's sequences' new scan states (size, n_seqs), ordered as ``get_state``'s."""
        p = self._started("put_state")
        size = state.shape[0]
        if state.ndim > 2 or (state.shape + (1,))[1] != len(p.seqs):
            raise ValueError(f"Recurrent.put_state: state {state.shape} must be (size, {len(p.seqs)}) for the "
                             f"batch's {len(p.seqs)} sequences")
        store = self._scan_store(size)
        ctx.forward(store.set_rows(state, self._input(ctx, f"{self._prefix}.slots", p), ctx=ctx))

    def by_sequence(self, ctx: Context, x: Tensor, zero_padding: bool = False) -> tuple[Tensor, int, int]:
        """``x`` (dim, n_tokens) in batch order as (dim, T * N): the batch's N sequences (ordered as
        ``get_state``'s) one after another, each T rows long (T: the most rows any of them has in the
        batch), a shorter one padded after its last row with copies of a batch row, or with zeros
        (``zero_padding``: a scan step of zero gate and zero strength leaves a state unchanged). Returns
        (the grid, T, N); ``by_batch`` brings rows back. A scan then runs over (..., T, N) at once."""
        p = self._started("by_sequence")
        n = p.sequences.size
        if x.ndim > 2 or (x.shape + (1,))[1] != n:
            raise ValueError(f"Recurrent.by_sequence: x {x.shape} must be (dim, {n}) for the batch's {n} tokens")
        if zero_padding:  # one zero row after the batch's: the padding's index
            x = x.concat(x.view(0, (x.shape[0], 1)).scale(0.0), 1)
        name = f"{self._prefix}.{'seqzero' if zero_padding else 'seqrows'}"
        return x.rows(self._input(ctx, name, p)), int(p.order.max()) + 1 if n else 0, len(p.seqs)

    def by_batch(self, ctx: Context, y: Tensor) -> Tensor:
        """The rows of ``y`` (dim, T * N), laid out as ``by_sequence`` gives them, back in batch order:
        (dim, n_tokens)."""
        return y.rows(self._input(ctx, f"{self._prefix}.batchrows", self._started("by_batch")))

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
        slot = p.reads
        if kind == "state":
            return np.array([slot[s] for s in p.seqs], np.int32)
        if kind == "slots":
            return np.array(p.seqs, np.int32)
        if kind in ("seqrows", "seqzero", "batchrows"):  # the (T, N) grid of by_sequence
            n, steps = p.sequences.size, int(p.order.max()) + 1 if p.sequences.size else 0
            column = {seq: i for i, seq in enumerate(p.seqs)}
            cells = np.array([column[s] for s in p.sequences.tolist()], np.int64) * steps + p.order
            if kind == "batchrows":
                return cells.astype(np.int32)
            grid = np.full(steps * len(p.seqs), n if kind == "seqzero" else 0, np.int32)
            grid[cells] = np.arange(n)
            return grid
        width = int(kind[len(kind.rstrip("0123456789")):])
        kind = kind.rstrip("0123456789")
        d, n = width - 1, p.sequences.size
        blocks = min(n, self.max_sequences)  # the table's state blocks: the batch's sequences, then zero units
        pad = blocks - len(p.seqs)
        units = [slot[s] for s in p.seqs] + [self.max_sequences] * pad
        block_rows = np.arange(blocks * d).reshape(blocks, d)
        if kind == "past":
            return (np.array(units)[:, None] * d + np.arange(d)).reshape(-1).astype(np.int32)
        if kind == "dst":  # each sequence's slot (reserving: the units read, rewritten unchanged); padding: zero
            targets = units if p.reserve else list(p.seqs) + [self.max_sequences] * pad
            return (np.array(targets)[:, None] * d + np.arange(d)).reshape(-1).astype(np.int32)
        # each sequence's history as rows of the table: its block, then its batch rows
        history = {seq: block_rows[i].tolist() for i, seq in enumerate(p.seqs)}
        for row in range(n):
            history[int(p.sequences[row])].append(blocks * d + row)
        if kind == "keep":  # the last d rows of each history (reserving: the blocks themselves); padding: zero
            if not p.reserve:
                for i, seq in enumerate(p.seqs):
                    block_rows[i] = history[seq][-d:]
            return block_rows.reshape(-1).astype(np.int32)
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
                DType.F32, (dim, d * self.units), layer=layer, name=f"conv_state_l{layer}")
        elif store.shape != (dim, d * self.units):
            stored = store.shape[1] // self.units
            raise ValueError(f"Recurrent.conv: layer {layer} stores a convolution state of {stored} inputs of "
                             f"{store.shape[0]}, not {d} of {dim}")
        return store

    def _scan_store(self, size: int) -> Tensor:
        layer = self._layer
        store = self.scan_states.get(layer)
        if store is None:
            store = self.scan_states[layer] = self.backend.alloc_persistent(
                DType.F32, (size, self.units), layer=layer, name=f"scan_state_l{layer}")
        elif store.shape[0] != size:
            raise ValueError(f"Recurrent: layer {layer} stores scan states of {store.shape[0]} floats, not {size}")
        return store

    # ---- sequence management ----------------------------------------------------------------------
    def copy_prefix(self, src_seq: int, dst_seq: int, length: int) -> None:
        """``dst_seq`` gets ``src_seq``'s states at the longest position up to ``length`` that
        ``src_seq`` can resume from (its own position, or a checkpoint's), else starts empty; its
        checkpoints are dropped (they belonged to its old history). ``can_resume``/``resumable`` on
        ``dst_seq`` then say where it continues."""
        self._check_seq("copy_prefix", src_seq, dst_seq)
        if src_seq == dst_seq:
            return
        at = self.resumable(src_seq, length)
        unit = int(self.sources[src_seq]) if at == self.positions[src_seq] else self._unit_at(src_seq, at)
        self.saved[dst_seq].clear()
        self.sources[dst_seq], self.positions[dst_seq] = dst_seq, 0
        if at > 0 and unit is not None:
            self._copy_unit(unit, dst_seq)
            self.positions[dst_seq] = at

    @property
    def rewinds(self) -> bool:
        return False  # a tail leaves a state only back to a checkpoint (``resumable``), not anywhere

    def can_resume(self, seq: int, pos: int) -> bool:
        self._check_seq("can_resume", seq)
        return pos == 0 or pos == self.positions[seq] or self._unit_at(seq, pos) is not None

    def resumable(self, seq: int, pos: int) -> int:
        """The longest position up to ``pos`` that ``seq`` can resume from: its state's, or a checkpoint's."""
        self._check_seq("resumable", seq)
        held = [int(self.positions[seq]), *self.saved[seq].values()]
        return max((p for p in held if p <= pos), default=0)

    def checkpoint(self, seq: int, pos: int) -> None:
        """Keep a copy of ``seq``'s states, which the caller knows are at position ``pos`` (computed,
        and no later pass of ``seq`` computed yet), so that ``seq`` can resume at ``pos`` again later.
        With all of the slot's units taken, the older checkpoint closest after its predecessor is
        dropped: they stay spread over the history (a prompt's end outlives a run of decode steps')."""
        self._check_seq("checkpoint", seq)
        if pos > self.positions[seq]:
            raise ValueError(f"Recurrent.checkpoint: sequence {seq}'s state is at position "
                             f"{int(self.positions[seq])}, not {pos}")
        saved = self.saved[seq]
        if self.checkpoints == 0 or pos <= 0 or pos in saved.values():
            return
        free = [u for u in self._units_of(seq) if u not in saved]
        if not free:
            entries = sorted([(p, u) for u, p in saved.items()] + [(pos, -1)])
            gaps = np.diff([0] + [p for p, _ in entries])
            candidates = [i for i, (_, u) in enumerate(entries) if u not in (-1, self.sources[seq])]
            if not candidates:
                return  # the only other one is about to be read
            drop = entries[min(candidates, key=lambda i: gaps[i])][1]
            del saved[drop]
            free = [drop]
        self._copy_unit(seq, free[0])
        saved[free[0]] = pos

    def plan_remove(self, seq: int, begin: int, end: int | None = None) -> Callable[[], None]:
        """Only removals a state can express: the whole sequence (from 0 to its end), nothing (from
        its end on), or the tail after a checkpoint (back to the checkpoint at ``begin``). Anything
        else raises NotSupportedError, the cache unchanged. Checkpoints past ``begin`` are dropped."""
        self._check_seq("remove", seq)
        at = int(self.positions[seq])
        if begin < 0 or (end is not None and end < begin):
            raise ValueError(f"Recurrent.remove: bad range ({begin}, {end})")
        if end is not None and end <= begin or begin >= at:
            return lambda: None  # nothing stored there
        unit = self._unit_at(seq, begin)
        if (begin == 0 or unit is not None) and (end is None or end >= at):
            def roll_back() -> None:
                self.positions[seq] = begin
                self.sources[seq] = seq if begin == 0 else unit  # the next pass continues the checkpoint
                self.saved[seq] = {u: p for u, p in self.saved[seq].items() if p <= begin}
            return roll_back
        raise NotSupportedError(f"Recurrent.remove: sequence {seq}'s state is at position {at}; a recurrent state "
                                f"cannot drop positions {begin}..{'end' if end is None else end} (only the whole "
                                "sequence, or back to a checkpoint)")

    def snapshot(self) -> object:
        self._check_init("snapshot")
        return self.positions.copy(), self.sources.copy(), [dict(s) for s in self.saved]

    def restore(self, snapshot: object) -> None:
        positions, sources, saved = snapshot
        self.positions, self.sources = positions.copy(), sources.copy()
        self.saved = [dict(s) for s in saved]
        self._pass = None

    def _units_of(self, seq: int) -> range:
        first = self.max_sequences + 1 + seq * self.checkpoints
        return range(first, first + self.checkpoints)

    def _unit_at(self, seq: int, pos: int) -> int | None:
        """The checkpoint unit of ``seq`` holding position ``pos``, if any."""
        return next((u for u, p in self.saved[seq].items() if p == pos), None)

    def _copy_unit(self, src: int, dst: int) -> None:
        """Copy unit ``src``'s convolution and scan states to unit ``dst`` in every layer."""
        if not self.conv_states and not self.scan_states:
            return
        with self.backend.new_context() as ctx:
            def rows(unit: int, d: int) -> Tensor:
                return ctx.from_numpy(np.arange(unit * d, unit * d + d, dtype=np.int32), DType.I32)

            outputs = [store.set_rows(store.rows(rows(src, d), ctx=ctx), rows(dst, d), ctx=ctx)
                       for store, d in [(s, s.shape[1] // self.units) for s in self.conv_states.values()]
                       + [(s, 1) for s in self.scan_states.values()]]
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
