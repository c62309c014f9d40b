"""Graph-building cost: the Python time to build one llama decode graph, and per graph node.

    python -m pytest bench/bench_graph.py --benchmark-only

Weights do not matter here, only the topology, so the models are synthetic and narrow: "tiny"
(2 layers) and a TinyLlama-depth one (22 layers, 32 heads / 4 KV heads, width 256). Each round
builds the graph of one decode step (``model.forward`` + ``ctx.forward``) without computing it;
``extra_info`` holds the node count and microseconds per node. Cache bookkeeping
(``cache.start_forward``) is timed separately.
"""

from __future__ import annotations

import pytest

from pyggml.bench import Session
from pyggml.models import Batch
from pyggml.synthetic import Shape, write_synthetic
from pyggml.tiny import cache_dir

SHAPES = {
    "tiny-2l": Shape(2, 256, 512, 8, 4, 1024, 1024, 10000.0, False),
    "tinyllama-22l-narrow": Shape(22, 256, 512, 32, 4, 1024, 2048, 10000.0, False),
}
POSITION = 100  # decode the token after a 100-token history


@pytest.fixture(scope="module", params=list(SHAPES))
def session(request):
    path = cache_dir() / f"bench-graph-{request.param}-f16.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_synthetic(path, SHAPES[request.param], "f16")
    s = Session(path, n_threads=1, n_ctx=POSITION + 1, max_batch=POSITION)
    s.prompt(POSITION, POSITION)  # a history in the cache, so the mask and KV views have real sizes
    yield s
    s.close()


def _batch() -> Batch:
    return Batch(inputs=[7], outputs=[0], positions=[POSITION], sequences=[0])


def test_decode_graph(benchmark, session):
    model, batch = session.model, _batch()
    contexts = []  # closed between rounds: an open context holds a few MiB of ggml metadata

    def setup():
        for ctx in contexts:
            ctx.close()
        contexts.clear()
        model.cache.remove(0, POSITION)
        ctx = model.backend.new_context()
        model.cache.start_forward(ctx, batch)
        contexts.append(ctx)
        return (ctx,), {}

    def build(ctx):
        ctx.forward(model.forward(ctx, batch))
        return ctx.n_nodes

    nodes = benchmark.pedantic(build, setup=setup, rounds=200, warmup_rounds=5)
    contexts.clear()
    benchmark.extra_info.update(graph_nodes=nodes, us_per_node=benchmark.stats.stats.mean * 1e6 / nodes)


def test_cache_start_forward(benchmark, session):
    model, batch = session.model, _batch()

    def setup():
        model.cache.remove(0, POSITION)
        return (model.backend.new_context(),), {}

    def start(ctx):
        model.cache.start_forward(ctx, batch)
        ctx.close()

    benchmark.pedantic(start, setup=setup, rounds=500, warmup_rounds=10)
