"""Causal KV cache (with optional sliding window or chunked attention) over ggml tensors.

Keys and values of layer L live in two persistent tensors of shape (head_dim * n_kv_heads, cells)
on that layer's device, allocated at the layer's first ``put`` (a ``reserve`` pass counts); with
``value_from_key`` only the keys (the values are views of them). Each
forward pass writes the batch's rows with ``set_rows`` at the cells ``Cells.place`` chose (any free
cells, so no fragmentation) and attends over a view of the first ``n_kv`` cells, ``n_kv`` rounded
up to ``config.padding`` so the graph's shape changes rarely. Per step the graph gets exactly two
new inputs: the cell index of each token and the mask.

Several sequences: each has a stream of its own cells (llama.cpp's non-unified cache), and
``get_groups`` lets attention read only a sequence's own stream. The batch is cut into groups of
consecutive sequences with equally many tokens each (a decode step of sequences 0..7 is one
group); a group attends over a 4-d view (head_dim, n_kv, heads, n_seqs) of its streams with
``n_kv`` the longest of them, so a decode step over P sequences costs P histories, not P x P.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from pyggml.kvcache.base import Cache, CacheConfig, KVGroup, ShiftFn
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

    __slots__ = ("positions", "sequences", "cells", "mask", "n_kv", "reserve", "noncausal", "groups",
                 "group_masks", "index", "element_index")

    def __init__(self, positions: np.ndarray, sequences: np.ndarray, cells: Tensor, mask: Tensor | None,
                 n_kv: int | None, reserve: bool, groups: list[_Group] | None = None,
                 group_masks: list[Tensor] | None = None):
        self.positions, self.sequences, self.cells = positions, sequences, cells
        self.mask, self.n_kv, self.reserve = mask, n_kv, reserve
        self.noncausal: list[tuple[int, int]] = []
        self.groups, self.group_masks = groups, group_masks
        self.index: np.ndarray | None = None  # the cells, as numpy
        self.element_index: dict[int, Tensor] = {}  # permuted_v: set_rows index by values per cell


def _elements(cells: np.ndarray, width: int, capacity: int) -> np.ndarray:
    """Flat indices into a transposed V (width rows of ``capacity`` cells) of each token's values,
    token-major: token t's value e is element e * capacity + cells[t]."""
    return (_row_starts(width, capacity) + cells[:, None]).reshape(-1)


@functools.lru_cache(maxsize=32)
def _row_starts(width: int, capacity: int) -> np.ndarray:
    """(1, width): where each of a transposed V's rows starts (made once: every decode step asks)."""
    starts = np.arange(width, dtype=np.int32)[None, :] * capacity
    starts.flags.writeable = False
    return starts


class _Group:
    """Batch rows [start, start + n_seqs * n_tokens) of streams [stream, stream + n_seqs), attending
    over ``n_kv`` cells of each stream."""

    __slots__ = ("start", "stream", "n_seqs", "n_tokens", "n_kv")

    def __init__(self, start: int, stream: int, n_seqs: int, n_tokens: int, n_kv: int = 0):
        self.start, self.stream, self.n_seqs, self.n_tokens, self.n_kv = start, stream, n_seqs, n_tokens, n_kv

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.n_seqs * self.n_tokens)

    def mask_name(self, prefix: str) -> str:
        """The mask input's name: it says which rows and streams the graph's views read."""
        return f"{prefix}@{self.start}:{self.stream}+{self.n_seqs}x{self.n_tokens}"


def _plan_groups(sequences: np.ndarray) -> list[_Group] | None:
    """Cut a batch into groups: runs of consecutive sequences (0, 1, 2, ...) whose tokens are
    contiguous in the batch and equally many. None when a sequence's tokens are not contiguous."""
    n = sequences.size
    if n == 1:
        return [_Group(0, int(sequences[0]), 1, 1)]
    if (sequences[1:] > sequences[:-1]).all():  # one token of each sequence (a decode step)
        if int(sequences[-1]) - int(sequences[0]) == n - 1:  # of slots in a row: one group
            return [_Group(0, int(sequences[0]), n, 1)]
        first = np.flatnonzero(_edges(sequences[1:] != sequences[:-1] + 1)).tolist()
        ends = [*first[1:], n]
        return [_Group(start, int(sequences[start]), end - start, 1) for start, end in zip(first, ends, strict=True)]
    starts = np.flatnonzero(_edges(sequences[1:] != sequences[:-1]))
    seqs = sequences[starts]
    # each sequence once: increasing (a decode step, by slot), or else no value repeated
    if not (seqs[1:] > seqs[:-1]).all() and np.unique(seqs).size != seqs.size:
        return None
    lengths = np.diff(starts, append=n)
    # a group ends where the next sequence is not the next stream or has another token count
    first = np.flatnonzero(_edges((seqs[1:] != seqs[:-1] + 1) | (lengths[1:] != lengths[:-1])))
    counts = np.diff(first, append=seqs.size)
    return [_Group(start, seq, count, length) for start, seq, count, length in
            zip(starts[first].tolist(), seqs[first].tolist(), counts.tolist(), lengths[first].tolist(), strict=True)]


def _edges(breaks: np.ndarray) -> np.ndarray:
    """``[True, *breaks]``: where runs start, given where each element differs from the one before."""
    out = np.empty(breaks.size + 1, bool)
    out[0] = True
    out[1:] = breaks
    return out


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

    Several sequences get a stream of cells each (see the module docstring); ``unified=True``
    pools the cells instead (llama.cpp's ``kv_unified``): ``copy_prefix`` then shares cells rather
    than copying them, but every token's attention reads every sequence's cells.

    ``value_from_key=N``: a cell stores only its key; its value is the first N elements of each
    head's key, read as a view (``put(ctx, key, None)``). That is latent attention's cache
    (DeepSeek's MLA: one compressed vector per token is both the value and, with the shared rope
    key after it, the key), at the memory of the key alone, as llama.cpp's V-as-a-view-of-K cache.
    """

    places_again = True  # placing a stored (sequence, position) again is a no-op (see ``refill``)

    def __init__(self, shift_fn: ShiftFn | None = None, *, swa_window: int | None = None,
                 swa_memory: int | None = None, chunk_size: int | None = None, unified: bool = False,
                 value_from_key: int | None = None):
        if value_from_key is not None and value_from_key < 1:
            raise ValueError(f"Causal: value_from_key must be positive, got {value_from_key}")
        self.shift_fn = shift_fn
        self.unified = unified
        self.value_from_key = value_from_key
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
        flash = backend.flash_attention
        config = self._config_override or CacheConfig(padding=256 if flash else 32, permuted_v=not flash,
                                                      mask_dtype=DType.F16 if flash else DType.F32)
        if self.value_from_key is not None:  # no V of its own to store transposed
            config = dataclasses.replace(config, permuted_v=False)
        if config.permuted_v and (flash or dtype.is_quantized):
            raise ValueError("Causal.init: permuted_v is for the plain attention path (no flash attention) with an "
                             "F16 or F32 cache")
        if config.padding < 1 or config.mask_dtype not in (DType.F32, DType.F16):
            raise ValueError(f"Causal.init: bad config {config} (padding >= 1, mask F32 or F16)")
        per_seq, memory = capacity, None
        if self.swa_window is not None:
            memory = self.swa_memory or self.swa_window + max_batch
            per_seq = min(capacity, memory + max_batch)
        # one stream of cells per sequence (several sequences): attention reads only a sequence's own
        streams = max_sequences > 1 and not self.unified
        if streams:
            n_cells = -(-per_seq // config.padding) * config.padding * max_sequences
        else:
            n_cells = -(-per_seq * max_sequences // config.padding) * config.padding
        cells = Cells(n_cells, max_sequences, swa_window=self.swa_window, swa_memory=memory,
                      chunk_size=self.chunk_size, per_sequence=streams)
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

    def _storage(self, layer: int, key: Tensor, value: Tensor | None) -> tuple[Tensor, Tensor | None]:
        if value is None:  # the value is a view of the key (value_from_key)
            dims = (key.shape[0], (key.shape + (1,))[1], self.value_from_key)
            if dims[2] > dims[0]:
                raise ValueError(f"Causal.put: values of {dims[2]} elements cannot come from keys {key.shape}")
        else:
            dims = (key.shape[0], (key.shape + (1,))[1], value.shape[0])
        if value is not None and dims[1] != (value.shape + (1,))[1]:
            raise ValueError(f"Causal.put: key {key.shape} and value {value.shape} differ in heads (dim 1)")
        if layer in self.keys:
            if dims != self._dims[layer]:
                raise ValueError(f"Causal.put: layer {layer} stores (head_dim_k, heads, head_dim_v) = "
                                 f"{self._dims[layer]}, got key {key.shape} and value "
                                 f"{None if value is None else value.shape}")
            return self.keys[layer], self.values.get(layer)
        block = self.dtype.block_size
        if dims[0] % block or dims[2] % block:
            raise ValueError(f"Causal.put: head dims ({dims[0]}, {dims[2]}) are not multiples of the {self.dtype.name} "
                             f"block of {block}")
        n = self.cells.capacity
        if self.config.permuted_v and n * dims[2] * dims[1] >= 2**31:
            raise ValueError(f"Causal.put: a transposed V of {n} cells x {dims[2] * dims[1]} values has more "
                             "elements than int32 indexes (use flash attention, or a smaller num_ctx or parallel)")
        self.keys[layer] = self.backend.alloc_persistent(self.dtype, (dims[0] * dims[1], n), layer=layer,
                                                         name=f"cache_k_l{layer}")
        self._dims[layer] = dims
        if value is None:
            return self.keys[layer], None
        # permuted_v: V stored transposed, a row of cells per (dim, head), so attention's V^T is a view
        v_shape = (n, dims[2] * dims[1]) if self.config.permuted_v else (dims[2] * dims[1], n)
        self.values[layer] = self.backend.alloc_persistent(self.dtype, v_shape, layer=layer, name=f"cache_v_l{layer}")
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
        groups = None
        if reserve:
            n_kv = cells.capacity
            index = np.arange(n, dtype=np.int32) % n_kv
            mask = np.zeros((n, n_kv), self._mask_dtype)
            if cells.per_sequence and n:  # the worst case: the whole batch in one full stream
                groups = [_Group(0, 0, 1, n, cells.stream_size)]
                mask = None
        else:
            self._check_positions(positions, "start_forward")
            index = cells.place(positions, sequences)
            if cells.per_sequence and n:
                groups = self._plan(positions, sequences)
            if groups is None:
                mask = cells.mask(positions, sequences, padding=self.config.padding, dtype=self._mask_dtype)
                n_kv = mask.shape[1]  # the used cells rounded up to the padding
            else:
                mask, n_kv = None, None  # get_groups serves it; get (if a model calls it) counts the cells
        if not n:  # nothing to attend with; put/get refuse such a pass
            self._pass = _Pass(positions, sequences, None, None, n_kv, reserve)
            return
        inputs = ctx.input()
        group_masks = None
        if groups is not None:
            arrays = self._group_masks(positions, sequences, groups, reserve)
            group_masks = [inputs.from_numpy(a, self.config.mask_dtype, name=g.mask_name(self._mask_name))
                           for g, a in zip(groups, arrays, strict=True)]
        self._pass = _Pass(positions, sequences, inputs.from_numpy(index, DType.I32, name=self._cells_name),
                           None if mask is None else inputs.from_numpy(mask, self.config.mask_dtype,
                                                                       name=self._mask_name),
                           n_kv, reserve, groups, group_masks)
        self._pass.index = index

    def _plan(self, positions: np.ndarray, sequences: np.ndarray) -> list[_Group] | None:
        """The groups of a placed batch, each with the attention width of its longest stream."""
        groups = _plan_groups(sequences)
        for g in groups or ():
            g.n_kv = max(self.cells.streams_extent(g.stream, g.n_seqs, self.config.padding), 1)
        return groups

    def _group_masks(self, positions: np.ndarray, sequences: np.ndarray, groups: list[_Group], reserve: bool = False,
                     noncausal: list[tuple[int, int]] | None = None) -> list[np.ndarray]:
        """Each group's mask as numpy (n_seqs, 1, n_tokens, n_kv) (ggml: (n_kv, n_tokens, 1, n_seqs))."""
        if reserve:
            return [np.zeros((g.n_seqs, 1, g.n_tokens, g.n_kv), self._mask_dtype) for g in groups]
        full = self.cells.placed_stream_mask(positions, sequences, max(g.n_kv for g in groups),
                                             noncausal=noncausal or (), dtype=self._mask_dtype)
        return [full[g.rows, :g.n_kv].reshape(g.n_seqs, 1, g.n_tokens, g.n_kv) for g in groups]

    def refill(self, ctx: Context, batch: Batch) -> bool:
        """Place ``batch`` and write its cells and mask into the graph (see ``Cache.refill``).
        False when the attention width (``n_kv``) moved past the graph's; ``start_forward`` then
        finds the batch already placed (placing a stored (sequence, position) again is a no-op)."""
        positions = np.asarray(batch.positions, dtype=np.int32)
        if self.cells is None or not positions.size:
            return False
        sequences = np.asarray(batch.sequences, dtype=np.int32)
        shape = ctx.input_shape(self._mask_name)
        if shape is None:  # a graph of groups (streams): the new batch must cut into the same groups
            if not self.cells.per_sequence:
                return False
            self._check_positions(positions, "refill")
            index = self.cells.place(positions, sequences)
            groups = self._plan(positions, sequences)
            if groups is None or any(ctx.input_shape(g.mask_name(self._mask_name)) != (g.n_kv, g.n_tokens, 1, g.n_seqs)
                                     for g in groups):
                return False
            self._set_index(ctx, index)
            for g, mask in zip(groups, self._group_masks(positions, sequences, groups), strict=True):
                ctx.set_input(g.mask_name(self._mask_name), mask)
            self._pass = None
            return True
        if positions.size != shape[1]:
            return False
        self._check_positions(positions, "refill")
        index = self.cells.place(positions, sequences)
        if self.cells.used_extent(self.config.padding) != shape[0] or \
                (self.cells.per_sequence and _plan_groups(sequences) is not None):
            return False
        mask = self.cells.mask(positions, sequences, n_kv=shape[0], dtype=self._mask_dtype)
        self._set_index(ctx, index)
        ctx.set_input(self._mask_name, mask)
        self._pass = None
        return True

    def _set_index(self, ctx: Context, index: np.ndarray) -> None:
        ctx.set_input(self._cells_name, index)
        for width in {dims[2] * dims[1] for dims in self._dims.values()} if self.config.permuted_v else ():
            name = f"{self._cells_name}x{width}"
            if ctx.input_shape(name) is not None:
                ctx.set_input(name, _elements(index, width, self.cells.capacity))

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
            p.group_masks = None  # and by the next get_groups

    def set_layer(self, layer: int) -> None:
        self._layer = layer

    def put(self, ctx: Context, key: Tensor, value: Tensor | None) -> None:
        p = self._pass
        if p is None:
            raise ValueError("Causal.put: call start_forward first")
        if (value is None) != (self.value_from_key is not None):
            raise ValueError("Causal.put: a value_from_key cache takes put(ctx, key, None); any other a value")
        n = p.positions.size
        values = () if value is None else (value,)
        if any(t.ndim > 3 or (t.shape + (1, 1))[2] != n for t in (key, *values)):
            raise ValueError(f"Causal.put: key {key.shape} / value {None if value is None else value.shape} must be "
                             f"(head_dim, heads, {n}) for the batch of {n} tokens")
        k_store, v_store = self._storage(self._layer, key, value)
        k_write = k_store.set_rows(key.reshape(k_store.shape[0], n), p.cells)
        if value is None:
            ctx.forward(k_write)
            return
        if self.config.permuted_v:  # each value element is a row of its own (llama.cpp's v_trans)
            width = v_store.shape[1]
            if not value.is_contiguous():
                value = value.contiguous()
            flat = v_store.reshape(1, v_store.shape[0] * width, ctx=ctx)
            v_write = flat.set_rows(value.reshape(1, width * n), self._element_index(ctx, p, width))
        else:
            v_write = v_store.set_rows(value.reshape(v_store.shape[0], n), p.cells)
        ctx.forward(k_write, v_write)

    def _element_index(self, ctx: Context, p: _Pass, width: int) -> Tensor:
        """The set_rows index of a transposed V of ``width`` values per cell (one input per width)."""
        name = f"{self._cells_name}x{width}"
        tensor = p.element_index.get(width)
        if tensor is None:
            tensor = p.element_index[width] = ctx.input().from_numpy(
                _elements(p.index, width, self.cells.capacity), DType.I32, name=name)
        return tensor

    def get(self, ctx: Context) -> tuple[Tensor, Tensor, Tensor | None]:
        p = self._pass
        if p is None:
            raise ValueError("Causal.get: call start_forward first")
        if p.cells is None:
            raise ValueError("Causal.get: the batch is empty")
        layer = self._layer
        if layer not in self.keys:
            raise ValueError(f"Causal.get: layer {layer} has nothing stored (put comes first)")
        if p.n_kv is None:
            p.n_kv = self.cells.used_extent(self.config.padding)
        if p.mask is None:
            mask = self.cells.mask(p.positions, p.sequences, n_kv=p.n_kv, noncausal=p.noncausal,
                                   dtype=self._mask_dtype)
            p.mask = ctx.input().from_numpy(mask, self.config.mask_dtype)
        k_store, v_store, v_head = self._stores(layer)
        dk, heads, dv = self._dims[layer]
        # a cell's row holds (head_dim, heads): view it as (head_dim, cells, heads) directly
        key = k_store.view(0, (dk, p.n_kv, heads), (k_store.strides[1], self.dtype.row_bytes(dk)), ctx=ctx)
        if self.config.permuted_v:  # (cells, dim, head) transposed back: a view whose dim 1 is contiguous
            row = v_store.strides[1]
            value = v_store.view(0, (p.n_kv, dv, heads), (row, dv * row), ctx=ctx).permute(1, 0, 2, 3)
        else:
            value = v_store.view(0, (dv, p.n_kv, heads), (v_store.strides[1], v_head), ctx=ctx)
        return key, value, p.mask

    def _stores(self, layer: int) -> tuple[Tensor, Tensor, int]:
        """The layer's key and value stores and the bytes from one head's values to the next (a
        ``value_from_key`` cache reads its values from the keys)."""
        if self.value_from_key is not None:
            return self.keys[layer], self.keys[layer], self.dtype.row_bytes(self._dims[layer][0])
        return self.keys[layer], self.values[layer], self.dtype.row_bytes(self._dims[layer][2])

    def get_groups(self, ctx: Context) -> list[KVGroup] | None:
        p = self._pass
        if p is None or p.groups is None:
            return None
        layer = self._layer
        if layer not in self.keys:
            raise ValueError(f"Causal.get_groups: layer {layer} has nothing stored (put comes first)")
        if p.group_masks is None:
            arrays = self._group_masks(p.positions, p.sequences, p.groups, p.reserve, p.noncausal)
            p.group_masks = [ctx.input().from_numpy(a, self.config.mask_dtype) for a in arrays]
        k_store, v_store, v_head = self._stores(layer)
        dk, heads, dv = self._dims[layer]
        k_row, v_row, size = k_store.strides[1], v_store.strides[1], self.cells.stream_size
        out = []
        for g, mask in zip(p.groups, p.group_masks, strict=True):
            # streams [stream, stream + n_seqs) as (head_dim, cells, heads, streams), no copy
            key = k_store.view(g.stream * size * k_row, (dk, g.n_kv, heads, g.n_seqs),
                               (k_row, self.dtype.row_bytes(dk), size * k_row), ctx=ctx)
            if self.config.permuted_v:
                cell = self.dtype.row_bytes(1)
                value = v_store.view(g.stream * size * cell, (g.n_kv, dv, heads, g.n_seqs),
                                     (v_row, dv * v_row, size * cell), ctx=ctx).permute(1, 0, 2, 3)
            else:
                value = v_store.view(g.stream * size * v_row, (dv, g.n_kv, heads, g.n_seqs),
                                     (v_row, v_head, size * v_row), ctx=ctx)
            out.append(KVGroup(g.start, g.n_tokens, g.n_seqs, key, value, mask))
        return out

    # ---- sequence management ------------------------------------------------------------------
    def copy_prefix(self, src_seq: int, dst_seq: int, length: int) -> None:
        """Streams (several sequences): the prefix's keys and values are copied into ``dst_seq``'s."""
        self._check_init("copy_prefix")
        copies = self.cells.copy_prefix(src_seq, dst_seq, length)
        if copies.size and self.keys:
            self._copy_cells(copies)

    def can_resume(self, seq: int, pos: int) -> bool:
        self._check_init("can_resume")
        return self.cells.can_resume(seq, pos)

    def plan_remove(self, seq: int, begin: int, end: int | None = None) -> Callable[[], None]:
        """Plan forgetting positions [begin, end) of ``seq`` (see ``Cache.plan_remove``); later
        positions move down, their keys re-rotated by ``shift_fn`` (split cells copied first), in
        graphs of their own. NotSupportedError (no ``shift_fn``) or CacheFullError (no room to split
        shared cells) leave everything unchanged."""
        self._check_init("remove")
        can_shift = self.shift_fn is not None
        # checked in place rather than planned on a copy: the cells' membership is sequences x cells
        # booleans (67 MB at 128 x 4096), which a request admitted into a used slot would copy
        self.cells.check_remove(seq, begin, end, can_shift=can_shift)

        def commit() -> None:
            shift = self.cells.remove(seq, begin, end, can_shift=can_shift)
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
            self._copy_cells(shift.copies)
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

    def _copy_cells(self, copies: np.ndarray) -> None:
        """Copy the keys and values of cells ``copies[:, 0]`` to cells ``copies[:, 1]`` in every layer: a graph
        per device. (ggml's scheduler leaves a view node, the flat V below, in the split before it: on another
        device, an RPC server got a graph naming a tensor it does not hold, and the copies crossed the network.)"""
        devices: dict[int, list[int]] = {}
        for layer in self.keys:
            devices.setdefault(self.backend._layer_backend(f"blk.{layer}."), []).append(layer)
        for layers in devices.values():
            self._copy_layer_cells(copies, layers)

    def _copy_layer_cells(self, copies: np.ndarray, layers: list[int]) -> None:
        with self.backend.new_context() as ctx:
            src = ctx.from_numpy(copies[:, 0], DType.I32)
            dst = ctx.from_numpy(copies[:, 1], DType.I32)
            stores = [self.keys[i] for i in layers] + [self.values[i] for i in layers
                                                       if i in self.values and not self.config.permuted_v]
            outputs = [store.set_rows(store.rows(src), dst) for store in stores]
            if self.config.permuted_v:  # a transposed V copies element by element
                n = self.cells.capacity
                for store in (self.values[i] for i in layers):
                    width = store.shape[1]
                    flat = store.reshape(1, n * width, ctx=ctx)
                    src_e = ctx.from_numpy(_elements(copies[:, 0], width, n), DType.I32)
                    dst_e = ctx.from_numpy(_elements(copies[:, 1], width, n), DType.I32)
                    outputs.append(flat.set_rows(flat.rows(src_e), dst_e))
            ctx.compute(*outputs)

    def _check_init(self, op: str) -> None:
        if self.cells is None:
            raise ValueError(f"Causal.{op}: cache is not initialised (call init)")
