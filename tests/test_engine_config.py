"""One engine configuration: ``EngineConfig`` and ``open_engine`` behind ``pyggml.load``, ``pyggml run`` and
``pyggml serve``; the sampling options declared once (``SamplingOptions``) and read by both HTTP APIs."""

from __future__ import annotations

import dataclasses

import pytest

from pyggml import BackendParams, models
from pyggml.runner.config import EngineConfig, close_engine, open_engine
from pyggml.sample import SamplingOptions
from pyggml.synthetic import write_synthetic


def test_flat_options_split_into_backend_and_engine_fields():
    config = EngineConfig.from_options("m.gguf", n_threads=3, poll=0, num_ctx=256, parallel=2, draft_max=4)
    assert (config.backend.n_threads, config.backend.poll) == (3, 0)
    assert (config.num_ctx, config.parallel, config.draft_max) == (256, 2, 4)
    with pytest.raises(TypeError, match="unknown option.*n_thread\\b"):
        EngineConfig.from_options("m.gguf", n_thread=3)


class _Loaded(Exception):
    pass


def _record_loads(monkeypatch) -> list[tuple[str, BackendParams, dict]]:
    seen = []

    def fake_load(path, params, **options):
        seen.append((str(path), params, options))
        raise _Loaded

    monkeypatch.setattr(models, "load", fake_load)
    return seen


def test_load_run_and_serve_open_the_engine_from_one_configuration(monkeypatch, tmp_path):
    """pyggml.load, `pyggml run` and `pyggml serve` reach models.load through open_engine with the same
    backend parameters for the same flags."""
    import pyggml
    from pyggml.cli import build_parser
    from pyggml.server import app

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    seen = _record_loads(monkeypatch)
    with pytest.raises(_Loaded):
        pyggml.load(str(model), n_threads=2, flash_attention=False)
    args = build_parser().parse_args(["run", str(model), "hi", "--threads", "2", "--flash-attn", "off"])
    monkeypatch.setattr("pyggml.store.check_has_weights", lambda path: None)
    with pytest.raises(_Loaded):
        args.func(args)
    monkeypatch.setattr(app, "check_has_weights", lambda path: None)
    with pytest.raises(_Loaded):
        app.serve(model, port=0, n_threads=2, flash_attention=False)
    assert len(seen) == 3
    backends = [dataclasses.replace(params) for _, params, _ in seen]
    assert all((b.n_threads, b.flash_attention) == (2, False) for b in backends)
    assert backends[0] == backends[1] == backends[2]


def test_the_draft_loads_on_local_devices_with_the_models_other_parameters(monkeypatch, tmp_path):
    calls = []

    def fake_load(path, params, **options):
        calls.append((str(path), params))
        if len(calls) == 2:
            raise _Loaded

        class Model:
            def close(self):
                calls.append(("closed", None))

        return Model()

    monkeypatch.setattr(models, "load", fake_load)
    config = EngineConfig.from_options("m.gguf", n_threads=2, rpc="127.0.0.1:50052", draft="d.gguf")
    with pytest.raises(_Loaded):
        open_engine(config)
    (_, main), (draft_path, draft), closed = calls
    assert main.rpc and draft_path == "d.gguf" and not draft.rpc and draft.tensor_split is None
    assert draft.n_threads == 2 and closed == ("closed", None)  # the model loaded first is closed again


def test_open_engine_gives_a_runner_that_close_engine_ends(tmp_path):
    path = write_synthetic(tmp_path / "tiny.gguf", "llama", "f32",
                           hparams={"block_count": 1, "embedding_length": 32, "attention.head_count": 2,
                                    "feed_forward_length": 64, "vocab_size": 64, "context_length": 64})
    runner = open_engine(EngineConfig.from_options(path, n_threads=1, parallel=2, batch_size=8))
    try:
        assert (runner.parallel, runner.num_ctx, runner.batch_size) == (2, 64, 8)  # num_ctx: the trained 64
    finally:
        close_engine(runner)
    assert runner.model.cache is None  # the model was closed with it


@pytest.mark.parametrize("api", ["ollama", "openai"])
def test_both_apis_take_every_numeric_sampling_option(api):
    from pyggml.server.params import Fields, ollama_options, openai_sampling

    numeric = {f.name: (3 if f.type == "int" else 0.5) for f in dataclasses.fields(SamplingOptions)
               if f.type in ("int", "float")}
    assert {"temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty"} <= set(numeric)
    if api == "ollama":
        out = ollama_options(numeric)
    else:
        out = openai_sampling(Fields(numeric, "request", set(numeric)))
    assert {k: out[k] for k in numeric} == numeric
