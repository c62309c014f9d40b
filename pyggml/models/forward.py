"""Forward passes that reuse the previous graph when they can.

A decode step has the same graph as the step before it (one token, one output, same attention
width): only five small inputs change. ``ForwardPass`` keeps the last graph and, when the next batch
has the same shape and the cache can refill its inputs (``Causal.refill``), computes it again
instead of rebuilding ~40 nodes per layer in Python.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from pyggml.models.input import Batch


class ForwardPass:
    def __init__(self, model: Any):
        self.model = model
        self._graph: tuple[tuple, Any, Any] | None = None  # (batch shape, Context, logits)
        self.n_nodes = 0  # nodes of the last graph built
        self.reused = 0  # passes that recomputed the previous graph

    def __call__(self, batch: Batch, times: dict[str, float] | None = None) -> np.ndarray:
        """Logits (len(batch.output_rows), vocab). ``times`` accumulates seconds spent in "cache"
        (bookkeeping), "graph" (building), "compute" and "output" (reading logits back)."""
        model = self.model
        t0 = time.perf_counter()
        key = (len(batch.inputs), tuple(batch.output_rows))
        graph = self._graph
        refill = getattr(model.cache, "refill", None)
        if graph is not None and graph[0] == key and refill is not None and refill(graph[1], batch):
            _, ctx, logits = graph
            ctx.set_input("tokens", batch.tokens)
            ctx.set_input("positions", list(batch.positions))
            ctx.set_input("outputs", batch.output_rows)
            self.reused += 1
            t1 = t2 = time.perf_counter()
        else:
            self.close()
            ctx = model.backend.new_context()
            try:
                model.cache.start_forward(ctx, batch)
                t1 = time.perf_counter()
                logits = model.forward(ctx, batch)
            except BaseException:
                ctx.close()
                raise
            t2 = time.perf_counter()
            ctx.forward(logits)
            self.n_nodes = ctx.n_nodes
            if ctx.reusable:  # every per-step input can be refilled by name
                self._graph = (key, ctx, logits)
        try:
            ctx.compute(logits)
            t3 = time.perf_counter()
            out = logits.numpy()
        finally:
            if self._graph is None or self._graph[1] is not ctx:
                ctx.close()
        if times is not None:
            t4 = time.perf_counter()
            for name, seconds in (("cache", t1 - t0), ("graph", t2 - t1), ("compute", t3 - t2), ("output", t4 - t3)):
                times[name] = times.get(name, 0.0) + seconds
        return out

    def close(self) -> None:
        if self._graph is not None:
            self._graph[1].close()
            self._graph = None
