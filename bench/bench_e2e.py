"""End-to-end speed: prompt processing and generation through ``pyggml.bench.Session``, the code
``pyggml bench`` times (wall time around each whole step, Python graph building included).

    python -m pytest bench/bench_e2e.py --benchmark-only [--benchmark-json out.json]

Always on the "tiny" synthetic model (2 layers, width 256, Q4_0). A bigger model is added by
``PYGGML_BENCH_MODEL=path.gguf`` or ``PYGGML_BENCH_SHAPE=tinyllama-1.1b`` (a synthetic shape, with
``PYGGML_BENCH_TYPE``, default q4_0, written once into the pyggml cache directory).
``PYGGML_BENCH_THREADS`` sets the thread count (default: physical cores). Each benchmark records
tokens/s and the Python share of a step in ``extra_info``.
"""

from __future__ import annotations

import os

import pytest

from pyggml.bench import Sample, Session, synthetic_model

N_PROMPT, N_GEN, N_BATCH = 128, 32, 512


def _models() -> list:
    models = [pytest.param(("tiny", "q4_0"), id="tiny-q4_0")]
    if os.environ.get("PYGGML_BENCH_SHAPE"):
        shape, dtype = os.environ["PYGGML_BENCH_SHAPE"], os.environ.get("PYGGML_BENCH_TYPE", "q4_0")
        models.append(pytest.param((shape, dtype), id=f"{shape}-{dtype}"))
    if os.environ.get("PYGGML_BENCH_MODEL"):
        path = os.environ["PYGGML_BENCH_MODEL"]
        models.append(pytest.param(path, id=os.path.basename(path)))
    return models


@pytest.fixture(scope="module", params=_models())
def session(request):
    spec = request.param
    path = synthetic_model(*spec) if isinstance(spec, tuple) else spec
    threads = int(os.environ["PYGGML_BENCH_THREADS"]) if os.environ.get("PYGGML_BENCH_THREADS") else None
    s = Session(path, n_threads=threads, n_ctx=N_PROMPT + N_GEN, max_batch=N_BATCH)
    s.big = not (isinstance(spec, tuple) and spec[0] == "tiny")
    yield s
    s.close()


def _record(benchmark, sample: Sample) -> None:
    p = sample.parts
    seconds = benchmark.stats.stats.mean
    benchmark.extra_info.update(tokens=sample.tokens, tokens_per_s=sample.tokens / seconds,
                                python_share=1.0 - p.compute * 1e9 / sample.wall_ns, graph_nodes=p.nodes)


def test_pp(benchmark, session):
    sample = benchmark.pedantic(session.prompt, args=(N_PROMPT, N_BATCH), rounds=3 if session.big else 20,
                                warmup_rounds=1)
    _record(benchmark, sample)


def test_tg(benchmark, session):
    session.generate(1)  # warm-up, as llama-bench does for tg
    sample = benchmark.pedantic(session.generate, args=(N_GEN,), rounds=3 if session.big else 10)
    _record(benchmark, sample)
