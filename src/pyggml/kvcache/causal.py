"""Causal KV cache (with optional sliding window or chunked attention) over ggml tensors.

Keys and values of layer L live in two persistent tensors of shape (head_dim * n_kv_heads, cells)
on that layer's device, allocated at the layer's first ``put`` (a ``reserve`` pass counts). Each
forward pass writes the batch's rows with ``set_rows`` at the cells ``Cells.place`` chose (any free
cells, so no fragmentation) and attends over a view of the first ``n_kv`` cells, ``n_kv`` rounded
up to ``config.padding`` so the graph's shape changes rarely. Per step the graph gets exactly two
new inputs: the cell index of each token and the mask.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from pyggml.kvcache.base import Cache, CacheConfig, ShiftFn
from pyggml.kvcache.cells import Cells, Shift
from pyggml.tensor import DType, Tensor

if TYPE_CHECKING:
    from pyggml.backend import Backend, Context
    from pyggml.input import Batch

CACHE_TYPES = (DType.F16, DType.F32, DType.Q8_0, DType.Q4_0)
_instances = itertools.count()  # each cache names its graph inputs apart, so caches compose in one graph


def check_cache_type(op: str, backend: Backend, dtype: DType | str) -> DType:
    """The cache types pyggml supports; quantized ones only where attention is flash attention
    (the plain path would dequantize the whole history every step)."""
    dtype = DType.parse(dtype)
    if dtype not in CACHE_TYPES:
        raise ValueError(f"{op}: cache type {dtype.name} not supported (F16, F32, Q8_0, Q4_0)")
    if dtype.is_quantized and not backend.flash_attention:
        raise ValueError(f"{op}: a {dtype.name} cache needs flash attention (BackendParams(flash_attention=True))")
    return dtype


class _Pass:
    """What one forward pass placed: the batch, its cells, the mask and the ranges that bend it."""

    __slots__ = ("positions", "sequences", "cells", "mask", "n_kv", "reserve", "noncausal")

    def __init__(self, positions: np.ndarray, sequences: np.ndarray, cells: Tensor, mask: Tensor | None,
                 n_kv: int, reserve: bool):
        self.positions, self.sequences, self.cells = positions, sequences, cells
        self.mask, self.n_kv, self.reserve = mask, n_kv, reserve
        self.noncausal: list[tuple[int, int]] = []


class Causal(Cache):
    """Decoder self-attention cache shared by ``max_sequences`` sequences.

    ``put(ctx, key, value)``: key (head_dim_k, n_kv_heads, n_tokens), value (head_dim_v,
    n_kv_heads, n_tokens), in batch order. ``get(ctx)``: key (head_dim_k, n_kv, n_kv_heads), value
    (head_dim_v, n_kv, n_kv_heads) (strided views of the cache, no copy) and mask (n_kv, n_tokens)
    in ``config.mask_dtype``, 0 where a token may attend and -inf where not.

    ``swa_window``/``swa_memory``: sliding-window attention; a sequence keeps ``swa_memory``
    positions before its batch, so its storage is ``swa_memory + max_batch`` cells. The default
    memory is the window plus ``max_batch``: a sequence can then be resumed (a cached prompt reused,
    see ``can_resume``) from any position up to a batch before its newest, as a new request sharing
    a long prompt, or a regenerated reply, needs; ``swa_memory=swa_window`` is the least memory.
    ``chunk_size``: chunked attention (a token sees only its chunk; nothing is freed early).
    """

    def __init__(self, shift_fn: ShiftFn | None = None, *, swa_window: int | None = None,
                 swa_memory: int | None = None, chunk_size: int | None = None):
        self.shift_fn = shift_fn
        self.swa_window = swa_window
        self.swa_memory = swa_memory
        self.chunk_size = chunk_size
        self.config: CacheConfig | None = None
        self._config_override: CacheConfig | None = None
        self.backend: Backend | None = None
        self.cells: Cells | None = None
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}
        self._dims: dict[int, tuple[int, int, int]] = {}  # layer -> (head_dim_k, n_kv_heads, head_dim_v)
        self._layer = 0
        self._pass: _Pass | None = None
        n = next(_instances)
        self._cells_name, self._mask_name = f"kv{n}.cells", f"kv{n}.mask"

    # ---- set-up -------------------------------------------------------------------------------
    def set_config(self, config: CacheConfig) -> None:
        """Override the backend's default configuration (before ``init``; kept by later inits)."""
        self.config = self._config_override = config

    def init(self, backend: Backend, dtype: DType | str = DType.F16, max_sequences: int = 1, capacity: int = 4096,
             max_batch: int = 512) -> None:
        if max_sequences < 1 or capacity < 1 or max_batch < 1:
            raise ValueError("Causal.init: max_sequences, capacity and max_batch must be positive")
        dtype = check_cache_type("Causal.init", backend, dtype)
        config = self._config_override or CacheConfig(padding=256 if backend.flash_attention else 32,
                                                      mask_dtype=DType.F16 if backend.flash_attention else DType.F32)
        if config.permuted_v:
            raise ValueError("Causal.init: permuted_v is not supported (attention lays V out itself)")
        if config.padding < 1 or config.mask_dtype not in (DType.F32, DType.F16):
            raise ValueError(f"Causal.init: bad config {config} (padding >= 1, mask F32 or F16)")
        per_seq, memory = capacity, None
        if self.swa_window is not None:
            memory = self.swa_memory or self.swa_window + max_batch
            per_seq = min(capacity, memory + max_batch)
        n_cells = -(-per_seq * max_sequences // config.padding) * config.padding
        cells = Cells(n_cells, max_sequences, swa_window=self.swa_window, swa_memory=memory,
                      chunk_size=self.chunk_size)
        self.config, self.backend, self.dtype, self.cells = config, backend, dtype, cells
        self.max_sequences, self.capacity, self.max_batch = max_sequences, capacity, max_batch
        self._mask_dtype = np.dtype(config.mask_dtype.numpy_dtype)
        self.keys, self.values, self._dims = {}, {}, {}  # a new init never reuses another size's tensors
        self._pass = None

    def close(self) -> None:
        self.keys.clear()  # the backend frees the memory when it closes
        self.values.clear()
        self._dims.clear()
        self.cells = None
        self._pass = None

    def _storage(self, layer: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        dims = (key.shape[0], (key.shape + (1,))[1], value.shape[0])
        if dims[1] != (value.shape + (1,))[1]:
            raise ValueError(f"Causal.put: key {key.shape} and value {value.shape} differ in heads (dim 1)")
        if layer in self.keys:
            if dims != self._dims[layer]:
                raise ValueError(f"Causal.put: layer {layer} stores (head_dim_k, heads, head_dim_v) = "
                                 f"{self._dims[layer]}, got key {key.shape} and value {value.shape}")
            return self.keys[layer], self.values[layer]
        block = self.dtype.block_size
        if dims[0] % block or dims[2] % block:
            raise ValueError(f"Causal.put: head dims ({dims[0]}, {dims[2]}) are not multiples of the {self.dtype.name} "
                             f"block of {block}")
        n = self.cells.capacity
        self.keys[layer] = self.backend.alloc_persistent(self.dtype, (dims[0] * dims[1], n), layer=layer,
                                                         name=f"cache_k_l{layer}")
        self.values[layer] = self.backend.alloc_persistent(self.dtype, (dims[2] * dims[1], n), layer=layer,
                                                           name=f"cache_v_l{layer}")
        self._dims[layer] = dims
        return self.keys[layer], self.values[layer]

    # ---- per forward pass ---------------------------------------------------------------------
    def start_forward(self, ctx: Context, batch: Batch, reserve: bool = False) -> None:
        """Place the batch (``reserve``: a worst-case pass over every cell that places nothing).

        Raises CacheFullError, or ValueError for a bad batch, with the cache unchanged."""
        cells = self.cells
        if cells is None:
            raise ValueError("Causal.start_forward: cache is not initialised (call init)")
        self._pass = None
        positions = np.asarray(batch.positions, dtype=np.int32)
        sequences = np.asarray(batch.sequences, dtype=np.int32)
        n = positions.size
        if positions.shape != sequences.shape or n != len(batch.inputs) or positions.ndim != 1:
            raise ValueError(f"Causal.start_forward: batch has {len(batch.inputs)} inputs, {n} positions and "
                             f"{sequences.size} sequences")
        if n > self.max_batch:
            raise ValueError(f"Causal.start_forward: batch of {n} tokens exceeds the cache's max_batch "
                             f"{self.max_batch}")
        if reserve:
            n_kv = cells.capacity
            index = np.arange(n, dtype=np.int32) % n_kv
            mask = np.zeros((n, n_kv), self._mask_dtype)
        else:
            self._check_positions(positions, "start_forward")
            index = cells.place(positions, sequences)
            mask = cells.mask(positions, sequences, padding=self.config.padding, dtype=self._mask_dtype)
            n_kv = mask.shape[1]  # the used cells rounded up to the padding
        if not n:  # nothing to attend with; put/get refuse such a pass
            self._pass = _Pass(positions, sequences, None, None, n_kv, reserve)
            return
        inputs = ctx.input()
        self._pass = _Pass(positions, sequences, inputs.from_numpy(index, DType.I32, name=self._cells_name),
                           inputs.from_numpy(mask, self.config.mask_dtype, name=self._mask_name), n_kv, reserve)

    def refill(self, ctx: Context, batch: Batch) -> bool:
        """Place ``batch`` and write its cells and mask into the graph (see ``Cache.refill``).
        False when the attention width (``n_kv``) moved past the graph's; ``start_forward`` then
        finds the batch already placed (placing a stored (sequence, position) again is a no-op)."""
        shape = ctx.input_shape(self._mask_name)
        positions = np.asarray(batch.positions, dtype=np.int32)
        if shape is None or self.cells is None or positions.size != shape[1]:
            return False
        sequences = np.asarray(batch.sequences, dtype=np.int32)
        self._check_positions(positions, "refill")
        index = self.cells.place(positions, sequences)
        if self.cells.used_extent(self.config.padding) != shape[0]:
            return False
        mask = self.cells.mask(positions, sequences, n_kv=shape[0], dtype=self._mask_dtype)
        ctx.set_input(self._cells_name, index)
        ctx.set_input(self._mask_name, mask)
        self._pass = None
        return True

    def _check_positions(self, positions: np.ndarray, op: str) -> None:
        if self.swa_window is None and positions.size and int(positions.max()) >= self.capacity:
            raise ValueError(f"Causal.{op}: position {int(positions.max())} is beyond the cache's context of "
                             f"{self.capacity} positions per sequence (raise num_ctx, or shift the context)")

    def set_noncausal(self, start: int, end: int) -> None:
        """Let batch rows [start, end) of the forward pass in progress also see each other's
        positions in both directions (an image's tokens). Call it after ``start_forward`` (from the
        model's forward, as Ollama's SetCausal); ``get`` calls after it get the bent mask. The next
        ``start_forward`` resets it."""
        p = self._pass
        if p is None:
            raise ValueError("Causal.set_noncausal: call start_forward first")
        if not 0 <= start <= end <= p.positions.size:
            raise ValueError(f"Causal.set_noncausal: range ({start}, {end}) outside the batch of "
                             f"{p.positions.size} tokens")
        if not p.reserve and end > start:
            p.noncausal.append((start, end))
            p.mask = None  # rebuilt by the next get

    def set_layer(self, layer: int) -> None:
        self._layer = layer

    def put(self, ctx: Context, key: Tensor, value: Tensor) -> None:
        p = self._pass
        if p is None:
            raise ValueError("Causal.put: call start_forward first")
        n = p.positions.size
        if key.ndim > 3 or value.ndim > 3 or (key.shape + (1, 1))[2] != n or (value.shape + (1, 1))[2] != n:
            raise ValueError(f"Causal.put: key {key.shape} / value {value.shape} must be (head_dim, heads, {n}) "
                             f"for the batch of {n} tokens")
        k_store, v_store = self._storage(self._layer, key, value)
        ctx.forward(k_store.set_rows(key.reshape(k_store.shape[0], n), p.cells),
                    v_store.set_rows(value.reshape(v_store.shape[0], n), p.cells))

    def get(self, ctx: Context) -> tuple[Tensor, Tensor, Tensor | None]:
        p = self._pass
        if p is None:
            raise ValueError("Causal.get: call start_forward first")
        if p.cells is None:
            raise ValueError("Causal.get: the batch is empty")
        layer = self._layer
        if layer not in self.keys:
            raise ValueError(f"Causal.get: layer {layer} has nothing stored (put comes first)")
        if p.mask is None:
            mask = self.cells.mask(p.positions, p.sequences, n_kv=p.n_kv, noncausal=p.noncausal,
                                   dtype=self._mask_dtype)
            p.mask = ctx.input().from_numpy(mask, self.config.mask_dtype)
        k_store, v_store = self.keys[layer], self.values[layer]
        dk, heads, dv = self._dims[layer]
        # a cell's row holds (head_dim, heads): view it as (head_dim, cells, heads) directly
        key = k_store.view(0, (dk, p.n_kv, heads), (k_store.strides[1], self.dtype.row_bytes(dk)), ctx=ctx)
        value = v_store.view(0, (dv, p.n_kv, heads), (v_store.strides[1], self.dtype.row_bytes(dv)), ctx=ctx)
        return key, value, p.mask

    # ---- sequence management ------------------------------------------------------------------
    def copy_prefix(self, src_seq: int, dst_seq: int, length: int) -> None:
        self._check_init("copy_prefix")
        self.cells.copy_prefix(src_seq, dst_seq, length)

    def can_resume(self, seq: int, pos: int) -> bool:
        self._check_init("can_resume")
        return self.cells.can_resume(seq, pos)

    def plan_remove(self, seq: int, begin: int, end: int | None = None) -> Callable[[], None]:
        """Plan forgetting positions [begin, end) of ``seq`` (see ``Cache.plan_remove``); later
        positions move down, their keys re-rotated by ``shift_fn`` (split cells copied first), in
        graphs of their own. NotSupportedError (no ``shift_fn``) or CacheFullError (no room to split
        shared cells) leave everything unchanged."""
        self._check_init("remove")
        planned = copy.deepcopy(self.cells)
        shift = planned.remove(seq, begin, end, can_shift=self.shift_fn is not None)

        def commit() -> None:
            self.cells = planned
            if shift is not None and self.keys:
                self._apply_shift(shift)

        return commit

    def snapshot(self) -> object:
        self._check_init("snapshot")
        return copy.deepcopy(self.cells)

    def restore(self, snapshot: object) -> None:
        self.cells = snapshot
        self._pass = None

    def _apply_shift(self, shift: Shift) -> None:
        """Copy the split cells, then re-rotate the moved keys by ``shift.delta`` (graphs of their own)."""
        if shift.copies.size:
            with self.backend.new_context() as ctx:
                src = ctx.from_numpy(shift.copies[:, 0], DType.I32)
                dst = ctx.from_numpy(shift.copies[:, 1], DType.I32)
                ctx.compute(*[store.set_rows(store.rows(src), dst)
                              for stores in (self.keys, self.values) for store in stores.values()])
        n = shift.cells.size
        with self.backend.new_context() as ctx:
            moved = ctx.from_numpy(shift.cells, DType.I32)
            delta = ctx.from_numpy(np.full(n, shift.delta, np.int32), DType.I32)
            outputs = []
            for layer, store in self.keys.items():
                dk, heads, _ = self._dims[layer]
                rotated = self.shift_fn(ctx, layer, store.rows(moved).reshape(dk, heads, n), delta)
                outputs.append(store.set_rows(rotated.reshape(dk * heads, n), moved))
            ctx.compute(*outputs)

    def _check_init(self, op: str) -> None:
        if self.cells is None:
            raise ValueError(f"Causal.{op}: cache is not initialised (call init)")
