"""The engine: one forward pass per scheduled batch, with graph reuse.

Decode steps repeat the same batch shape (one token per generating sequence, a logits row for
each), so their graphs are equal but for the inputs. The engine keeps the last few graphs and,
when the next batch has a kept graph's shape, lets the cache and ``nn.refill_batch_inputs`` write
the new inputs into it and computes it again instead of rebuilding ~40 nodes per layer in Python.
The cache declines a refill when the graph no longer fits (the attention width moved); then a new
graph is built. A graph is kept only if every input it reads is refillable (``Context.reusable``).

The Runner (and through it ``LLM``, the CLI and the server) and ``pyggml bench`` call this; no
other module builds model graphs for generation.

Sampling head (``sample_head=K``; ``Runner(device_sampling=True)``): a generation graph also ends
in each row's K largest logits (ids and values, ``top_k`` + ``rows``) and the row sums (a NaN or an
infinity anywhere shows there), so a step whose rows all sample plainly (greedy, or temperature with
top-k <= K, top-p, min-p) reads P x K numbers instead of P x vocab (``compute(read="top")``: a
``TopLogits``); the full logits stay on the device and are read only if a row needs them after all.


Images: the model's ``VisionPart`` (``model.vision``) builds an image's encoder graph
(``Engine.encode``); the engine keeps one per shape of its inputs (so images of several sizes, as a
dynamic-resolution encoder makes them, each get theirs): the next image of that shape refills the
named inputs and computes the same graph (a part that is not ``reusable`` gets one per image).
``reserve_multimodal`` builds the largest one at start-up and reserves its compute memory, so a
runner that starts can also encode an image.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pyggml import nn
from pyggml.input import Batch, Multimodal

SAMPLE_HEAD_K = 64  # logits per row a sampling head returns (top-k up to this samples from them)
# rows a step needs before the default (GPU) sampling head is used: on an H200 (issue 26, TinyLlama Q4_0, 32k
# vocabulary) it gained nothing measurable at 1-16 sequences and 20-35 % of tok/s at 64-128, where reading
# P x vocab logits and sampling them on the host is what the device waits for
AUTO_HEAD_MIN_ROWS = 32
MAX_VISION_GRAPHS = 4  # vision graphs kept, one per image input shape (most recently used last)


@dataclass(eq=False)
class Graph:
    """A built forward pass: its context and the logits tensor (vocab, rows). ``kept``: it belongs
    to the engine's pool (computed again later) rather than to the caller. ``top``: the sampling
    head's tensors (ids (K, rows), values (1, K, rows), row sums (1, rows)), or None."""

    key: tuple
    ctx: Any
    logits: Any
    kept: bool = False
    top: tuple | None = None


class TopLogits:
    """What a step with a sampling head read: per row the K largest logits (``ids``, ``vals``, (rows,
    K), in no particular order) and whether the row is finite; ``full()`` reads every logit (once)."""

    def __init__(self, ids: np.ndarray, vals: np.ndarray, finite: np.ndarray, graph: Graph):
        self.ids, self.vals, self.finite = ids, vals, finite
        self._graph, self._full = graph, None

    @property
    def vocab(self) -> int:
        return self._graph.logits.shape[0]

    def full(self) -> np.ndarray:
        if self._full is None:
            self._full = self._graph.logits.numpy()
        return self._full


def graph_key(batch: Batch) -> tuple:
    """What a graph's topology depends on besides its inputs' values (the cache checks the rest)."""
    return len(batch.inputs), tuple(batch.output_rows)


class Engine:
    """Builds, reuses and computes a model's forward passes. ``keep``: how many graphs to keep
    (two lets one compute while the next is refilled; 0 rebuilds every pass), the least recently
    used evicted first."""

    def __init__(self, model: Any, keep: int = 2, sample_head: int = 0, head_min_rows: int = 1):
        self.model = model
        self.keep = keep
        self.sample_head = sample_head  # K of the sampling head (0: none)
        self.head_min_rows = head_min_rows  # graphs with fewer logits rows get no head
        self._kept: list[Graph] = []
        self.n_nodes = 0  # nodes of the last graph built
        self.built = 0  # graphs built
        self.reused = 0  # graphs refilled and computed again
        self._vision: dict[tuple, _VisionGraph] = {}  # by input shapes (encode)
        self.vision_built = 0  # vision graphs built (encode, reserve_multimodal)
        self.vision_reused = 0  # images encoded by refilling a kept vision graph

    def build(self, batch: Batch, busy: Graph | None = None, times: dict[str, float] | None = None,
              busy_started: bool = False) -> Graph:
        """The graph of ``batch``: a kept one refilled or a new one. ``busy``, the graph computing now,
        is never closed here, and refilled only with ``busy_started``: its compute has written its
        inputs (``Context.compute``'s ``on_start``), so new ones wait for the next compute, and that
        compute of the same graph keeps ggml's allocation (another graph would need a new plan). The
        batch is placed in the cache either way. ``times`` accumulates seconds of "cache"
        (bookkeeping and refilling) and "graph" (building)."""
        t0 = time.perf_counter()
        key = graph_key(batch)
        # the most recently used first (the busy one, if it may be refilled: its plan stays); images build their own
        for graph in reversed(self._kept) if not batch.multimodal else ():
            if graph.key != key or (graph is busy and not busy_started):
                continue
            try:
                refilled = self.model.cache.refill(graph.ctx, batch)
                if refilled:
                    nn.refill_batch_inputs(graph.ctx, batch)
            except BaseException:
                self.drop(busy)
                raise
            if refilled:
                self.reused += 1
                self._kept.remove(graph)  # most recently used last: a one-off shape (a prompt's batch)
                self._kept.append(graph)  # is evicted before the decode step's graph
                _add(times, "cache", time.perf_counter() - t0)
                _add(times, "graph", 0.0)
                return graph
            if graph is not busy:  # (a busy one is evicted, and closed, once it is not)
                self._kept.remove(graph)  # it no longer fits this cache's state; nor will it later
                graph.ctx.close()
            break
        ctx = self.model.backend.new_context()
        try:
            self.model.cache.start_forward(ctx, batch)
            t1 = time.perf_counter()
            logits = self.model.forward(ctx, batch)
            ctx.forward(logits)
            wants_head = self.sample_head and len(batch.output_rows) >= max(self.head_min_rows, 1)
            top = self.head(ctx, logits) if wants_head else None
        except BaseException:
            ctx.close()
            raise
        t2 = time.perf_counter()
        _add(times, "cache", t1 - t0)
        _add(times, "graph", t2 - t1)
        self.n_nodes = ctx.n_nodes
        self.built += 1
        graph = Graph(key, ctx, logits, top=top)
        if ctx.reusable and self.keep > 0:
            self._keep(graph, busy)
        return graph

    def head(self, ctx: Any, logits: Any) -> tuple:
        """The sampling head: each row's K largest logits (ids, values) and its sum."""
        vocab, rows = logits.shape[0], logits.shape[1]
        ids = logits.top_k(min(self.sample_head, vocab))
        vals = logits.reshape(1, vocab, rows).rows(ids)
        sums = logits.sum_rows()
        ctx.forward(ids, vals, sums)
        return ids, vals, sums

    def compute(self, graph: Graph, read: bool | str = True, times: dict[str, float] | None = None,
                on_start: Callable[[], None] | None = None) -> np.ndarray | TopLogits | None:
        """Compute ``graph``; returns its logits (rows, vocab) when ``read``, or with ``read="top"``
        (a graph with a sampling head) a ``TopLogits``. A graph the engine does not keep is closed
        afterwards (its logits are read first). ``times``: seconds of "compute" and "output". ``on_start``:
        see ``Context.compute``."""
        t0 = time.perf_counter()
        try:
            graph.ctx.compute(graph.logits, *(graph.top or ()), on_start=on_start)
            t1 = time.perf_counter()
            if read == "top":
                ids, vals, sums = (t.numpy() for t in graph.top)
                out = TopLogits(ids, vals.reshape(ids.shape), np.isfinite(sums.reshape(-1)), graph)
                if not graph.kept:
                    out.full()
            else:
                out = graph.logits.numpy() if read else None
        finally:
            if not graph.kept:
                graph.ctx.close()
        if times is not None:
            _add(times, "compute", t1 - t0)
            _add(times, "output", time.perf_counter() - t1)
        return out

    def forward(self, batch: Batch, times: dict[str, float] | None = None) -> np.ndarray:
        """Build (or refill) and compute ``batch`` now: logits (len(batch.output_rows), vocab)."""
        return self.compute(self.build(batch, times=times), times=times)

    def reserve(self, batch: Batch) -> bool:
        """Reserve the compute memory of ``batch``'s graph (the largest the runner will build; the KV
        cache is allocated already); MemoryError when it does not fit. Returns whether the graph reads
        ``batch.tokens`` in place (what building ahead needs: ids written after the graph is built)."""
        with self.model.backend.new_context() as ctx:
            self.model.cache.start_forward(ctx, batch, reserve=True)
            logits = self.model.forward(ctx, batch)
            ctx.forward(logits)
            # the sampling head's outputs flagged as computes flag them (see Context.reserve)
            outputs = (logits, *self.head(ctx, logits)) if self.sample_head else ()
            in_place = reads_in_place(ctx, batch.tokens)
            ctx.reserve(*outputs)
        return in_place

    def drop(self, busy: Graph | None = None) -> None:
        """Forget the kept graphs (after a failure, or when the cache was reset). ``busy``, one
        computing now, is handed to its computation, which closes it when done."""
        for graph in self._kept:
            graph.kept = False
            if graph is not busy:
                graph.ctx.close()
        self._kept.clear()

    def close(self) -> None:
        self.drop()
        for graph in self._vision.values():
            graph.ctx.close()
        self._vision.clear()

    # ---- images --------------------------------------------------------------------------------
    def encode(self, image: bytes | Mapping[str, np.ndarray]) -> list[Multimodal]:
        """Encode one image: its file's bytes, or the arrays ``model.vision.preprocess`` made of them
        (the runner's way: decoded once, when the request came). The embeddings, as numpy arrays
        (n, hidden). ValueError for an image the model cannot take."""
        vision = self.model.vision
        if vision is None:
            raise ValueError(f"the {self.model.architecture or 'loaded'} model takes no images (it has no vision part)")
        inputs = vision.preprocess(image) if isinstance(image, (bytes, bytearray)) else image
        if not vision.reusable:  # a graph of its own per image
            with self.model.backend.new_context() as ctx:
                outputs = vision.build(ctx, inputs)
                self.vision_built += 1
                ctx.compute(*outputs)
                return [Multimodal(tensor=t.numpy()) for t in outputs]
        graph = self._vision_graph(inputs)
        graph.ctx.compute(*graph.outputs)
        return [Multimodal(tensor=t.numpy()) for t in graph.outputs]

    def reserve_multimodal(self) -> list[np.ndarray]:
        """Build the model's largest vision graph (kept for the first image of that shape) and reserve its
        compute memory now; MemoryError when it does not fit. Returns zero arrays shaped like its
        embeddings (for reserving a text batch that holds them), or [] for a part that cannot say."""
        vision = self.model.vision
        inputs = vision.worst_case() if vision is not None and vision.reusable else None
        if inputs is None:
            return []
        graph = self._vision_graph(inputs, reuse=False)
        graph.ctx.forward(*graph.outputs)
        graph.ctx.reserve()
        return [np.zeros(tuple(reversed(t.shape)), np.float32) for t in graph.outputs]

    def _vision_graph(self, inputs: dict[str, np.ndarray], reuse: bool = True) -> _VisionGraph:
        """The kept vision graph for inputs of these shapes, refilled with them, or a new one."""
        key = tuple(sorted((name, np.shape(a), np.asarray(a).dtype.str) for name, a in inputs.items()))
        graph = self._vision.pop(key, None)
        if graph is not None:
            if reuse:
                for name, array in inputs.items():
                    graph.ctx.set_input(name, array)
                self.vision_reused += 1
            self._vision[key] = graph  # the most recently used goes last
            return graph
        ctx = self.model.backend.new_context()
        try:
            outputs = list(self.model.vision.build(ctx, inputs))
            missing = [name for name in inputs if ctx.input_shape(name) is None]
            if missing:
                raise ValueError(f"{type(self.model.vision).__name__}.build read no input named {missing}")
        except BaseException:
            ctx.close()
            raise
        self.vision_built += 1
        graph = self._vision[key] = _VisionGraph(ctx, outputs)
        while len(self._vision) > MAX_VISION_GRAPHS:
            oldest = next(iter(self._vision))
            self._vision.pop(oldest).ctx.close()
        return graph

    def _keep(self, graph: Graph, busy: Graph | None) -> None:
        """Keep ``graph``, evicting the least recently used (never ``busy``, nor ``graph``)."""
        graph.kept = True
        self._kept.append(graph)
        while len(self._kept) > self.keep:
            old = next((g for g in self._kept if g is not busy and g is not graph), None)
            if old is None:
                break
            self._kept.remove(old)
            old.kept = False
            old.ctx.close()


@dataclass(eq=False)
class _VisionGraph:
    """A kept vision encoder graph: its context (inputs named as ``VisionPart.preprocess`` names them)
    and its output tensors (one per embedding the model returns for an image)."""

    ctx: Any
    outputs: list[Any]


def reads_in_place(ctx: Any, ids: np.ndarray) -> bool:
    """Whether the graph's token input is ``ids`` itself rather than a copy. The Context keeps
    its inputs' host arrays until it computes; there is no public accessor for them yet."""
    return any(np.may_share_memory(data, ids) for data in ctx._state.inputs.values())


def _add(times: dict[str, float] | None, name: str, seconds: float) -> None:
    if times is not None:
        times[name] = times.get(name, 0.0) + seconds
