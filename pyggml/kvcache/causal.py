"""Causal KV cache (with optional sliding window or chunked attention) over ggml tensors.

Keys and values of layer L live in two persistent tensors of shape (head_dim * n_kv_heads, cells)
on that layer's device. Each forward pass writes the batch's rows with ``set_rows`` at the cells
``Cells.place`` chose (any free cells, so no fragmentation) and attends over a view of the first
``n_kv`` cells, ``n_kv`` rounded up to ``config.padding`` so the graph's shape changes rarely.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pyggml.kvcache.base import Cache, CacheConfig, NotSupportedError, ShiftFn
from pyggml.kvcache.cells import Cells, Shift
from pyggml.tensor import DType, Tensor

if TYPE_CHECKING:
    from pyggml.backend import Backend, Context
    from pyggml.models.input import Batch


class Causal(Cache):
    def __init__(self, shift_fn: ShiftFn | None = None, *, swa_window: int | None = None,
                 swa_memory: int | None = None, chunk_size: int | None = None):
        self.shift_fn = shift_fn
        self.swa_window = swa_window
        self.swa_memory = swa_memory
        self.chunk_size = chunk_size
        self.config: CacheConfig | None = None
        self.backend: Backend | None = None
        self.cells: Cells | None = None
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}
        self._layer = 0
        self._noncausal: list[tuple[int, int]] = []
        self._cur: tuple[Tensor, Tensor | None, int] | None = None  # (cell indices, mask, n_kv)

    # ---- set-up -------------------------------------------------------------------------------
    def init(self, backend: Backend, dtype: DType = DType.F16, max_sequences: int = 1, capacity: int = 4096,
             max_batch: int = 512) -> None:
        if max_sequences < 1 or capacity < 1 or max_batch < 1:
            raise ValueError("Causal.init: max_sequences, capacity and max_batch must be positive")
        dtype = DType.parse(dtype)
        if dtype not in (DType.F16, DType.F32, DType.Q8_0, DType.Q4_0):
            raise ValueError(f"Causal.init: cache type {dtype.name} not supported (F16, F32, Q8_0, Q4_0)")
        if dtype.is_quantized and not backend.flash_attention:
            raise ValueError(f"Causal.init: a {dtype.name} cache needs flash attention")
        if self.config is None:
            self.config = CacheConfig(padding=256 if backend.flash_attention else 32,
                                      mask_dtype=DType.F16 if backend.flash_attention else DType.F32)
        per_seq = capacity
        if self.swa_window is not None:
            per_seq = min(capacity, (self.swa_memory or self.swa_window) + max_batch)
        cells = per_seq * max_sequences
        pad = self.config.padding
        cells = -(-cells // pad) * pad
        self.backend, self.dtype = backend, dtype
        self.max_sequences, self.capacity, self.max_batch = max_sequences, capacity, max_batch
        self.cells = Cells(cells, max_sequences, swa_window=self.swa_window, swa_memory=self.swa_memory,
                           chunk_size=self.chunk_size)

    def close(self) -> None:
        self.keys.clear()  # the backend frees the memory when it closes
        self.values.clear()
        self.cells = None

    def _storage(self, layer: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        if layer not in self.keys:
            n = self.cells.capacity
            k_row, v_row = key.shape[0] * key.shape[1], value.shape[0] * value.shape[1]
            if self.dtype.is_quantized and (k_row % self.dtype.block_size or v_row % self.dtype.block_size):
                raise ValueError(f"cache rows ({k_row}, {v_row}) are not multiples of the {self.dtype.name} block")
            self.keys[layer] = self.backend.alloc_persistent(self.dtype, (k_row, n), layer=layer,
                                                             name=f"cache_k_l{layer}")
            self.values[layer] = self.backend.alloc_persistent(self.dtype, (v_row, n), layer=layer,
                                                               name=f"cache_v_l{layer}")
        return self.keys[layer], self.values[layer]

    # ---- per forward pass ---------------------------------------------------------------------
    def start_forward(self, ctx: Context, batch: Batch, reserve: bool = False) -> None:
        if self.cells is None:
            raise ValueError("cache is not initialised (call init)")
        positions = np.asarray(batch.positions, dtype=np.int32)
        sequences = np.asarray(batch.sequences, dtype=np.int32)
        if positions.shape != sequences.shape or positions.size != len(batch.inputs):
            raise ValueError(f"batch has {len(batch.inputs)} inputs, {positions.size} positions and "
                             f"{sequences.size} sequences")
        if positions.size > self.max_batch:
            raise ValueError(f"batch of {positions.size} tokens exceeds the cache's max_batch {self.max_batch}")
        if reserve:
            n_kv = self.cells.capacity
            cells = np.arange(positions.size, dtype=np.int32) % n_kv
            mask = np.zeros((positions.size, n_kv), np.float32)
        else:
            if self.swa_window is None and positions.size and int(positions.max()) >= self.capacity:
                raise ValueError(f"position {int(positions.max())} is beyond the cache's context of "
                                 f"{self.capacity} positions per sequence")
            cells = self.cells.place(positions, sequences)
            n_kv = self.cells.used_extent(self.config.padding)
            mask = self.cells.mask(positions, sequences, n_kv=n_kv, noncausal=self._noncausal)
        self._noncausal = []
        mask_t = ctx.input().from_numpy(mask, self.config.mask_dtype)
        self._cur = (ctx.input().from_numpy(cells, DType.I32), mask_t, n_kv)

    def set_noncausal(self, start: int, end: int) -> None:
        """Let batch rows [start, end) attend to each other both ways in the next forward pass
        (image tokens); reset after that pass."""
        self._noncausal.append((start, end))

    def set_layer(self, layer: int) -> None:
        self._layer = layer

    def put(self, ctx: Context, key: Tensor, value: Tensor) -> None:
        if self._cur is None:
            raise ValueError("put: call start_forward first")
        cells = self._cur[0]
        k_store, v_store = self._storage(self._layer, key, value)
        n = key.shape[2]
        if n != cells.shape[0] or value.shape[2] != n:
            raise ValueError(f"put: key {key.shape} / value {value.shape} do not match the batch of "
                             f"{cells.shape[0]} tokens")
        ctx.forward(k_store.set_rows(key.reshape(k_store.shape[0], n), cells),
                    v_store.set_rows(value.reshape(v_store.shape[0], n), cells))
        self._head_dims = (key.shape[0], key.shape[1], value.shape[0])

    def get(self, ctx: Context) -> tuple[Tensor, Tensor, Tensor | None]:
        if self._cur is None:
            raise ValueError("get: call start_forward first")
        _, mask, n_kv = self._cur
        k_store, v_store = self.keys[self._layer], self.values[self._layer]
        dk, heads, dv = self._head_dims
        # rows hold (head_dim, heads) per cell: view them as (head_dim, cells, heads) directly
        key = k_store.view(0, (dk, n_kv, heads), (k_store.strides[1], self.dtype.row_bytes(dk)), ctx=ctx)
        value = v_store.view(0, (dv, n_kv, heads), (v_store.strides[1], self.dtype.row_bytes(dv)), ctx=ctx)
        return key, value, mask

    # ---- sequence management ------------------------------------------------------------------
    def copy_prefix(self, src_seq: int, dst_seq: int, length: int) -> None:
        self.cells.copy_prefix(src_seq, dst_seq, length)

    def can_resume(self, seq: int, pos: int) -> bool:
        return self.cells.can_resume(seq, pos)

    def remove(self, seq: int, begin: int, end: int | None = None) -> None:
        shift = self.cells.remove(seq, begin, end, can_shift=self.shift_fn is not None)
        if shift is None or not self.keys:
            return
        self._apply_shift(shift)

    def _apply_shift(self, shift: Shift) -> None:
        """Copy the split cells, then re-rotate the moved keys by ``shift.delta`` (graphs of their own)."""
        if shift.copies.size:
            with self.backend.new_context() as ctx:
                src = ctx.from_numpy(shift.copies[:, 0], DType.I32)
                dst = ctx.from_numpy(shift.copies[:, 1], DType.I32)
                ctx.compute(*[store.set_rows(store.rows(src), dst)
                              for stores in (self.keys, self.values) for store in stores.values()])
        with self.backend.new_context() as ctx:
            moved = ctx.from_numpy(shift.cells, DType.I32)
            delta = ctx.from_numpy(np.full(shift.cells.size, shift.delta, np.int32), DType.I32)
            dk, heads, _ = self._head_dims
            outputs = []
            for layer, store in self.keys.items():
                keys = store.rows(moved).reshape(dk, heads, shift.cells.size)
                rotated = self.shift_fn(ctx, layer, keys, delta)
                outputs.append(store.set_rows(rotated.reshape(dk * heads, shift.cells.size), moved))
            ctx.compute(*outputs)
