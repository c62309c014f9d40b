"""The cache interface models and the runner program against (mirrors Ollama's kvcache.Cache)."""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pyggml.kvcache.cells import CacheFullError, NotSupportedError
from pyggml.tensor import DType, Tensor

if TYPE_CHECKING:
    from pyggml.backend import Backend, Context
    from pyggml.input import Batch

__all__ = ["Cache", "CacheConfig", "CacheFullError", "KVGroup", "NotSupportedError", "ShiftFn"]

# shift_fn(ctx, layer, key, shift) -> key re-rotated by ``shift`` positions (I32, one per key row)
ShiftFn = Callable[["Context", int, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class CacheConfig:
    """What the backend's attention kernels need from the cache.

    ``padding``: the number of cells attention reads is rounded up to a multiple of this, so
    graph shapes change rarely. ``permuted_v``: store V transposed (for the non-flash path).
    ``mask_dtype``: F16 for flash attention, F32 otherwise.
    """

    padding: int = 1
    permuted_v: bool = False
    mask_dtype: DType = DType.F32


@dataclass(frozen=True)
class KVGroup:
    """Batch rows ``[start, start + n_seqs * n_tokens)``: ``n_tokens`` rows of each of ``n_seqs``
    sequences in turn, attending only over their own cells: ``key`` (head_dim_k, n_kv,
    n_kv_heads, n_seqs), ``value`` (head_dim_v, n_kv, n_kv_heads, n_seqs) and ``mask`` (n_kv,
    n_tokens, 1, n_seqs). Attention over a group costs what each sequence's own history costs,
    not what every sequence's does (llama.cpp's non-unified KV cache)."""

    start: int
    n_tokens: int
    n_seqs: int
    key: Tensor
    value: Tensor
    mask: Tensor


class Cache(abc.ABC):
    """A KV cache shared by several sequences.

    Models call ``set_layer``, ``put`` and ``get``; the runner calls the rest. Shapes (ggml order):
    ``put(ctx, key, value)`` takes key (head_dim_k, n_kv_heads, n_tokens) and value
    (head_dim_v, n_kv_heads, n_tokens); ``get`` returns key (head_dim_k, n_kv, n_kv_heads),
    value (head_dim_v, n_kv, n_kv_heads) and mask (n_kv, n_tokens) with 0 where a token may attend
    and -inf where not.
    """

    @abc.abstractmethod
    def init(self, backend: Backend, dtype: DType, max_sequences: int, capacity: int, max_batch: int) -> None:
        """Set up for ``max_sequences`` sequences of up to ``capacity`` positions each."""

    def set_config(self, config: CacheConfig) -> None:
        """Override the backend's default cache configuration (call before ``init``)."""
        self.config = config

    @abc.abstractmethod
    def close(self) -> None:
        """Release the cache's memory."""

    @abc.abstractmethod
    def start_forward(self, ctx: Context, batch: Batch, reserve: bool = False) -> None:
        """Place the batch's tokens; raises CacheFullError (cache unchanged) when there is no room.
        ``reserve=True`` builds worst-case shapes and stores nothing."""

    @abc.abstractmethod
    def set_layer(self, layer: int) -> None:
        """Select the layer that following ``put``/``get`` calls address."""

    @abc.abstractmethod
    def put(self, ctx: Context, key: Tensor, value: Tensor | None) -> None:
        """Store the batch's keys and values for the current layer (value None: a cache whose values
        are views of its keys, ``Causal(value_from_key=...)``)."""

    @abc.abstractmethod
    def get(self, ctx: Context) -> tuple[Tensor, Tensor, Tensor | None]:
        """Keys, values and mask of the current layer's history (see class docstring)."""

    def get_groups(self, ctx: Context) -> list[KVGroup] | None:
        """The current layer's history split by sequence (see ``KVGroup``), covering the batch in
        order; None when this cache cannot (then ``get`` serves the whole batch)."""
        return None

    @property
    def rewinds(self) -> bool:
        """Whether ``remove`` can drop any tail of a sequence; a recurrent state can only go back to the
        positions ``resumable`` names (its checkpoints)."""
        return True

    @abc.abstractmethod
    def copy_prefix(self, src_seq: int, dst_seq: int, length: int) -> None:
        """Make ``dst_seq`` hold exactly positions [0, length) of ``src_seq`` (sharing or copying them)."""

    @abc.abstractmethod
    def can_resume(self, seq: int, pos: int) -> bool:
        """Whether ``seq`` can continue from ``pos`` with what is stored."""

    def resumable(self, seq: int, pos: int) -> int:
        """The longest position up to ``pos`` that ``seq`` can continue from (0: start over); a
        recurrent state answers its checkpoints' positions (kvcache.Recurrent)."""
        return pos if self.can_resume(seq, pos) else 0

    def checkpoint(self, seq: int, pos: int) -> None:
        """``seq``'s stored history is computed up to ``pos``: keep what resuming there later needs. Only a
        cache that cannot drop a tail (``rewinds`` False) keeps anything; the others can rewind anyway."""
        return  # nothing to keep: any tail can be removed

    def remove(self, seq: int, begin: int, end: int | None = None) -> None:
        """Forget positions [begin, end) of ``seq`` (``None``: to the end); later positions shift
        down. Raises NotSupportedError (cache unchanged) when that needs a shift the model lacks."""
        self.plan_remove(seq, begin, end)()

    @abc.abstractmethod
    def plan_remove(self, seq: int, begin: int, end: int | None = None) -> Callable[[], None]:
        """Check a removal without doing it: raises as ``remove`` would, else returns the function
        that does it and cannot fail (call it before anything else touches the cache). This is
        how a ``Wrapper`` changes all its caches or none."""

    # True for a cache whose ``refill`` leaves its batch placed whether or not it fits, and whose
    # ``start_forward`` of a placed batch places nothing more (a ``Wrapper`` need not undo its refill)
    places_again: bool = False

    @abc.abstractmethod
    def refill(self, ctx: Context, batch: Batch) -> bool:
        """Graph reuse: place ``batch`` and write this cache's per-batch inputs into ``ctx``, a graph
        that this cache's ``start_forward`` set up for an earlier batch of the same shape, so the
        graph can be computed again unchanged. False when the graph does not fit the batch (the
        attention width moved, an encoder output arrived): then the engine builds a new graph with
        ``start_forward``, which accepts a batch that ``refill`` already placed."""

    @abc.abstractmethod
    def snapshot(self) -> object:
        """The bookkeeping (not the tensors), for ``restore`` after a failed multi-cache step."""

    @abc.abstractmethod
    def restore(self, snapshot: object) -> None:
        """Return to a ``snapshot`` (the forward pass in progress is forgotten)."""

    @abc.abstractmethod
    def set_noncausal(self, start: int, end: int) -> None:
        """Let batch rows [start, end) of the forward pass in progress also see each other in both
        directions (an image's tokens); called from the model's forward after ``start_forward``,
        reset by the next ``start_forward``. A cache without a causal mask ignores it."""
