"""Encoder cache: the cross-attention keys/values of one multimodal input, kept across batches.

Cross-attention (mllama-style) layers attend from text tokens to an image encoder's output. The
output is computed once, in the batch that carries the image, and reused by every later batch of
the sequences that see it, until a sequence is rewound to before the image.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pyggml.kvcache.base import Cache
from pyggml.kvcache.causal import check_cache_type
from pyggml.tensor import DType, Tensor

if TYPE_CHECKING:
    from pyggml.backend import Backend, Context
    from pyggml.input import Batch


class Encoder(Cache):
    """Keys/values of one encoder output, shared by the sequences that see it.

    ``put(ctx, key, value)``: key (head_dim_k, n_kv_heads, n_enc), value (head_dim_v, n_kv_heads,
    n_enc), the projections of the encoder output; only in a pass whose batch carries multimodal
    data (or a reserve pass). ``get(ctx)``: key (head_dim_k, n_enc, n_kv_heads), value
    (head_dim_v, n_enc, n_kv_heads) (views of the stored tensors) and no mask: every token of the
    batch sees the whole encoder output.

    One output is stored at a time. The batch that carries a multimodal input (its position is
    ``batch.positions[m.index]`` for the last ``MultimodalIndex`` m) gives it to that input's
    sequence, replacing whatever was stored; ``copy_prefix`` shares it; ``remove(seq, begin, ...)``
    with ``begin <= position < end`` takes it from ``seq``, and a removal before it moves its
    position down. Because ``get`` has no mask, a batch must hold either only sequences that see
    the stored output (``encoder_cached`` is then true and cross-attention uses it) or only
    sequences that do not (``encoder_cached`` false: the model skips cross-attention).
    """

    def __init__(self) -> None:
        self.backend: Backend | None = None
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}
        self._dims: dict[int, tuple[int, int, int, int]] = {}  # layer -> (head_dim_k, heads, head_dim_v, n_enc)
        self._seen: dict[int, int] = {}  # sequence -> position of the stored output in it
        self._layer = 0
        self._pass: tuple[int, int] | None = None  # (sequence, position) of the batch's multimodal input
        self._sees = False  # the current batch's sequences see the stored output
        self._reserve = False
        self._started = False
        self._graphs: dict[int, bool] = {}  # graph id -> whether its batch saw the stored output (its topology)

    # ---- set-up -------------------------------------------------------------------------------
    def init(self, backend: Backend, dtype: DType | str = DType.F16, max_sequences: int = 1, capacity: int = 4096,
             max_batch: int = 512) -> None:
        """``capacity`` and ``max_batch`` concern the text cache; the encoder output's size is the
        first ``put``'s."""
        if max_sequences < 1:
            raise ValueError("Encoder.init: max_sequences must be positive")
        self.dtype = check_cache_type("Encoder.init", backend, dtype)
        self.backend, self.max_sequences = backend, max_sequences
        self.keys, self.values, self._dims, self._seen = {}, {}, {}, {}
        self._started = False

    def close(self) -> None:
        self.keys.clear()  # the backend frees the memory when it closes
        self.values.clear()
        self._dims.clear()
        self._seen.clear()
        self.backend = None

    @property
    def encoder_cached(self) -> bool:
        """Whether the current batch's sequences see a stored encoder output (true after ``put``)."""
        return self._sees

    @property
    def reserving(self) -> bool:
        """Whether the pass in progress is a reserve pass (a model may ``put`` a worst-case output then,
        so the storage and the cross-attention graph are allocated at start-up)."""
        return self._started and self._reserve

    def position(self, seq: int) -> int | None:
        """Position of the multimodal input whose output ``seq`` sees, or None."""
        return self._seen.get(seq)

    # ---- per forward pass ---------------------------------------------------------------------
    def start_forward(self, ctx: Context, batch: Batch, reserve: bool = False) -> None:
        if self.backend is None:
            raise ValueError("Encoder.start_forward: cache is not initialised (call init)")
        self._started = False
        current, sees = self._plan(batch, reserve)
        self._pass, self._sees, self._reserve, self._started = current, sees, reserve, True
        if current is None and not reserve:
            while len(self._graphs) >= 8:  # the engine keeps a few graphs; forget the oldest
                del self._graphs[next(iter(self._graphs))]
            self._graphs[ctx.graph_id] = sees

    def refill(self, ctx: Context, batch: Batch) -> bool:
        """A graph can be computed again for a batch without multimodal data whose sequences see
        the stored output exactly when those of the graph's batch did (the model's cross-attention
        layers are in the graph or not). The encoder has no per-batch inputs to write."""
        if self.backend is None or batch.multimodal:
            return False
        current, sees = self._plan(batch, False)
        if self._graphs.get(ctx.graph_id) is not sees:
            return False
        self._pass, self._sees, self._reserve, self._started = current, sees, False, True
        return True

    def set_noncausal(self, start: int, end: int) -> None:
        """Nothing to do: every token already sees the whole encoder output."""

    def _plan(self, batch: Batch, reserve: bool) -> tuple[tuple[int, int] | None, bool]:
        """(sequence, position) of the batch's multimodal input, and whether its sequences see the
        stored output; ValueError for a batch the cache cannot serve."""
        sequences = {int(s) for s in batch.sequences}
        if not all(0 <= s < self.max_sequences for s in sequences):
            raise ValueError(f"Encoder.start_forward: sequences must lie in [0, {self.max_sequences})")
        current = None
        if batch.multimodal and not reserve:
            owners = {int(batch.sequences[m.index]) for m in batch.multimodal}
            if len(owners) > 1:
                raise ValueError(f"Encoder.start_forward: multimodal inputs of sequences {sorted(owners)} in one "
                                 "batch; the encoder cache holds one output at a time")
            index = batch.multimodal[-1].index
            current = (int(batch.sequences[index]), int(batch.positions[index]))
            if sequences != owners:
                raise ValueError(f"Encoder.start_forward: the batch's multimodal input belongs to sequence "
                                 f"{current[0]}, but the batch also holds sequences {sorted(sequences - owners)}")
            sees = False
        else:
            sees = bool(sequences) and sequences <= self._seen.keys()
            if not sees and not reserve and sequences & self._seen.keys():
                raise ValueError(f"Encoder.start_forward: sequences {sorted(sequences & self._seen.keys())} see the "
                                 f"stored encoder output and {sorted(sequences - self._seen.keys())} do not; "
                                 "batch them apart")
        return current, sees

    def set_layer(self, layer: int) -> None:
        self._layer = layer

    def put(self, ctx: Context, key: Tensor, value: Tensor) -> None:
        if not self._started:
            raise ValueError("Encoder.put: call start_forward first")
        if self._pass is None and not self._reserve:
            raise ValueError("Encoder.put: the batch carries no multimodal data (put only in the pass that does)")
        (dk, heads, n), (dv, v_heads, v_n) = _dims3(key), _dims3(value)
        if key.ndim > 3 or value.ndim > 3 or (heads, n) != (v_heads, v_n):
            raise ValueError(f"Encoder.put: need key (head_dim_k, heads, n) and value (head_dim_v, heads, n), "
                             f"got {key.shape} and {value.shape}")
        k_store, v_store = self._storage(self._layer, (dk, heads, dv, n))
        ctx.forward(_contiguous(key).reshape(dk * heads, n).copy(k_store),
                    _contiguous(value).reshape(dv * heads, n).copy(v_store))
        if not self._reserve:
            seq, pos = self._pass
            self._seen = {seq: pos}
            self._sees = True

    def get(self, ctx: Context) -> tuple[Tensor, Tensor, Tensor | None]:
        if not self._started:
            raise ValueError("Encoder.get: call start_forward first")
        layer = self._layer
        if layer not in self.keys or not (self._sees or self._reserve):
            raise ValueError(f"Encoder.get: no encoder output for this batch in layer {layer} "
                             "(check encoder_cached; put it in the batch that carries the image)")
        dk, heads, dv, n = self._dims[layer]
        k_store, v_store = self.keys[layer], self.values[layer]
        key = k_store.view(0, (dk, n, heads), (k_store.strides[1], self.dtype.row_bytes(dk)), ctx=ctx)
        value = v_store.view(0, (dv, n, heads), (v_store.strides[1], self.dtype.row_bytes(dv)), ctx=ctx)
        return key, value, None

    def _storage(self, layer: int, dims: tuple[int, int, int, int]) -> tuple[Tensor, Tensor]:
        if layer in self.keys:
            if dims != self._dims[layer]:
                raise ValueError(f"Encoder.put: layer {layer} stores (head_dim_k, heads, head_dim_v, n_enc) = "
                                 f"{self._dims[layer]}, got {dims}; encoder outputs must keep one size")
            return self.keys[layer], self.values[layer]
        dk, heads, dv, n = dims
        block = self.dtype.block_size
        if dk % block or dv % block:
            raise ValueError(f"Encoder.put: head dims ({dk}, {dv}) are not multiples of the {self.dtype.name} "
                             f"block of {block}")
        self.keys[layer] = self.backend.alloc_persistent(self.dtype, (dk * heads, n), layer=layer,
                                                         name=f"cache_xk_l{layer}")
        self.values[layer] = self.backend.alloc_persistent(self.dtype, (dv * heads, n), layer=layer,
                                                           name=f"cache_xv_l{layer}")
        self._dims[layer] = dims
        return self.keys[layer], self.values[layer]

    # ---- sequence management ------------------------------------------------------------------
    def copy_prefix(self, src_seq: int, dst_seq: int, length: int) -> None:
        self._check_seq(src_seq, dst_seq)
        pos = self._seen.get(src_seq)
        self._seen.pop(dst_seq, None)
        if pos is not None and pos < length:
            self._seen[dst_seq] = pos

    def can_resume(self, seq: int, pos: int) -> bool:
        """Always: an image before ``pos`` whose output is gone is re-encoded when its input is
        processed again, which the runner does for everything after ``pos``."""
        self._check_seq(seq)
        return True

    def plan_remove(self, seq: int, begin: int, end: int | None = None) -> Callable[[], None]:
        """Validate a removal; returns the function that does it (it cannot fail)."""
        self._check_seq(seq)
        if begin < 0 or (end is not None and end < begin):
            raise ValueError(f"Encoder.remove: need 0 <= begin <= end, got begin={begin} end={end}")

        def commit() -> None:
            pos = self._seen.get(seq)
            if pos is None or pos < begin:
                return
            if end is None or pos < end:
                del self._seen[seq]
            else:
                self._seen[seq] = pos - (end - begin)

        return commit

    def snapshot(self) -> object:
        return dict(self._seen)

    def restore(self, snapshot: object) -> None:
        self._seen = dict(snapshot)
        self._started = self._sees = False

    def _check_seq(self, *seqs: int) -> None:
        if self.backend is None:
            raise ValueError("Encoder: cache is not initialised (call init)")
        for s in seqs:
            if not 0 <= s < self.max_sequences:
                raise ValueError(f"Encoder: sequence {s} out of range [0, {self.max_sequences})")


def _dims3(t: Tensor) -> tuple[int, int, int]:
    """(head_dim, heads, n) of a key or value, trailing dims of 1 included."""
    return (t.shape + (1, 1))[:3]


def _contiguous(t: Tensor) -> Tensor:
    return t if t.is_contiguous() else t.contiguous()
