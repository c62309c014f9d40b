"""Several caches behind one ``Cache``: each layer uses one of them.

For models whose layers attend differently: cross-attention layers (``Encoder``) among
self-attention ones (``Causal``), or sliding-window layers among full-attention ones (two
``Causal``). Management calls go to every cache and change all of them or none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from pyggml.kvcache.base import Cache, CacheConfig, KVGroup
from pyggml.tensor import DType, Tensor

if TYPE_CHECKING:
    from pyggml.backend import Backend, Context
    from pyggml.input import Batch


class Wrapper(Cache):
    """Route layers to ``caches``: ``layer_types[layer]`` (a sequence or a function) names the
    cache index ``set_layer`` selects; without it the model selects with ``set_layer_type(index)``
    (as Ollama's WrapperCache.SetLayerType), and each ``start_forward`` selects cache 0 again.
    ``put``/``get`` shapes are those of the selected cache.

    Consistency: a ``start_forward`` or ``copy_prefix`` that fails in one cache is undone in all
    (``snapshot``/``restore``), a ``refill`` that fails or that one cache cannot do in every cache that is
    not ``places_again`` (the others keep the batch placed, which ``start_forward`` then finds), and ``remove``
    is checked in every cache before any changes (``plan_remove``: a NotSupportedError from one
    leaves all unchanged). A graph is refilled for reuse only when every cache can refill it.
    """

    def __init__(self, *caches: Cache, layer_types: Sequence[int] | Callable[[int], int] | None = None):
        if not caches:
            raise ValueError("Wrapper: needs at least one cache")
        self.caches = caches
        self.layer_types = layer_types
        self._current = 0

    # ---- routing ------------------------------------------------------------------------------
    def set_layer(self, layer: int) -> None:
        for cache in self.caches:
            cache.set_layer(layer)
        if self.layer_types is not None:
            types = self.layer_types
            self.set_layer_type(types(layer) if callable(types) else types[layer])

    def set_layer_type(self, index: int) -> None:
        """Make ``put``/``get`` use ``caches[index]`` until the next selection."""
        if not 0 <= index < len(self.caches):
            raise ValueError(f"Wrapper.set_layer_type: index {index} out of range for {len(self.caches)} caches")
        self._current = index

    @property
    def current(self) -> Cache:
        """The cache ``put``/``get`` address now."""
        return self.caches[self._current]

    def put(self, ctx: Context, key: Tensor, value: Tensor | None) -> None:
        self.current.put(ctx, key, value)

    def get(self, ctx: Context) -> tuple[Tensor, Tensor, Tensor | None]:
        return self.current.get(ctx)

    def get_groups(self, ctx: Context) -> list[KVGroup] | None:
        return self.current.get_groups(ctx)

    def set_noncausal(self, start: int, end: int) -> None:
        for cache in self.caches:
            cache.set_noncausal(start, end)

    # ---- set-up -------------------------------------------------------------------------------
    def set_config(self, config: CacheConfig) -> None:
        self.config = config
        for cache in self.caches:
            cache.set_config(config)

    def init(self, backend: Backend, dtype: DType | str = DType.F16, max_sequences: int = 1, capacity: int = 4096,
             max_batch: int = 512) -> None:
        for cache in self.caches:
            cache.init(backend, dtype, max_sequences, capacity, max_batch)

    def close(self) -> None:
        for cache in self.caches:
            cache.close()

    # ---- management: all or none ----------------------------------------------------------------
    def start_forward(self, ctx: Context, batch: Batch, reserve: bool = False) -> None:
        self._all_or_none(lambda cache: cache.start_forward(ctx, batch, reserve))
        if self.layer_types is None:
            self._current = 0

    def refill(self, ctx: Context, batch: Batch) -> bool:
        # A cache that refilled placed the batch; when another cannot refill, start_forward places it in all, so
        # the first must be undone, unless it ``places_again`` (a causal cache, whose snapshot would copy every
        # cell, each step): those are not snapshot, and refill first (their refusal comes before the others work)
        order = sorted(self.caches, key=lambda cache: not cache.places_again)
        states = [(cache, cache.snapshot()) for cache in order if not cache.places_again]
        try:
            refilled = all(cache.refill(ctx, batch) for cache in order)
        except BaseException:
            for cache, state in states:
                cache.restore(state)
            raise
        if not refilled:
            for cache, state in states:
                cache.restore(state)
        elif self.layer_types is None:
            self._current = 0
        return refilled

    def copy_prefix(self, src_seq: int, dst_seq: int, length: int) -> None:
        self._all_or_none(lambda cache: cache.copy_prefix(src_seq, dst_seq, length))

    @property
    def rewinds(self) -> bool:
        return all(cache.rewinds for cache in self.caches)

    def can_resume(self, seq: int, pos: int) -> bool:
        return all(cache.can_resume(seq, pos) for cache in self.caches)

    def resumable(self, seq: int, pos: int) -> int:
        """The longest position up to ``pos`` that every cache can resume ``seq`` from."""
        while True:
            at = min(cache.resumable(seq, pos) for cache in self.caches)
            if at == pos:
                return pos
            pos = at

    def checkpoint(self, seq: int, pos: int) -> None:
        for cache in self.caches:
            cache.checkpoint(seq, pos)

    def plan_remove(self, seq: int, begin: int, end: int | None = None) -> Callable[[], None]:
        """Check the removal in every cache (raising changes nothing); returns the function that
        does it in all."""
        commits = [cache.plan_remove(seq, begin, end) for cache in self.caches]

        def commit() -> None:
            for fn in commits:
                fn()

        return commit

    def snapshot(self) -> object:
        return [cache.snapshot() for cache in self.caches]

    def restore(self, snapshot: object) -> None:
        for cache, state in zip(self.caches, snapshot, strict=True):
            cache.restore(state)

    def _all_or_none(self, op: Callable[[Cache], None]) -> None:
        states = self.snapshot()
        try:
            for cache in self.caches:
                op(cache)
        except BaseException:
            self.restore(states)
            raise
