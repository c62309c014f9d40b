"""Ollama's environment variables (OLLAMA_HOST, OLLAMA_KEEP_ALIVE, OLLAMA_NUM_PARALLEL,
OLLAMA_MAX_LOADED_MODELS, OLLAMA_CONTEXT_LENGTH, OLLAMA_MODELS, OLLAMA_ORIGINS) set what `pyggml serve`
(and `run`, where they mean something there) leaves out: flags first, then PYGGML_*, then OLLAMA_*,
then the built-in default; a bad value is an error naming the variable. One live server checks
OLLAMA_HOST end to end."""

from __future__ import annotations

import socket

import pytest

from pyggml import cli

OLLAMA = ("OLLAMA_HOST", "OLLAMA_KEEP_ALIVE", "OLLAMA_NUM_PARALLEL", "OLLAMA_MAX_LOADED_MODELS",
          "OLLAMA_CONTEXT_LENGTH", "OLLAMA_ORIGINS", "PYGGML_HOST", "PYGGML_ORIGINS", "PYGGML_ALLOWED_HOSTS")


@pytest.fixture
def environ(monkeypatch):
    """A clean slate of the variables under test; returns a setter."""
    for name in OLLAMA:
        monkeypatch.delenv(name, raising=False)
    return lambda **values: [monkeypatch.setenv(k, v) for k, v in values.items()]


def parse(*argv: str):
    return cli.build_parser().parse_args(list(argv))


def test_without_the_environment_the_built_in_defaults_hold(environ):
    args = parse("serve")
    assert (args.host, args.port, args.parallel, args.ctx, args.keep_alive, args.max_loaded, args.origins) == \
        ("127.0.0.1", None, None, None, None, None, None)
    assert cli._listen_address(args.host, args.port) == ("127.0.0.1", 11434)


def test_ollama_variables_fill_the_serve_flags(environ):
    environ(OLLAMA_HOST="http://0.0.0.0:18093/", OLLAMA_NUM_PARALLEL="2", OLLAMA_CONTEXT_LENGTH="8192",
            OLLAMA_KEEP_ALIVE="10m", OLLAMA_MAX_LOADED_MODELS="3", OLLAMA_ORIGINS="https://app.example,null")
    args = parse("serve")
    assert cli._listen_address(args.host, args.port) == ("0.0.0.0", 18093)
    assert (args.parallel, args.ctx, args.keep_alive, args.max_loaded) == (2, 8192, "10m", 3)
    assert cli._origin_list(args.origins) == ["https://app.example", "null"]
    environ(OLLAMA_MAX_LOADED_MODELS="0")  # Ollama's "let the server choose"
    assert parse("serve").max_loaded is None


def test_flags_beat_pyggml_variables_which_beat_ollamas(environ):
    environ(OLLAMA_HOST="127.0.0.1:18093", PYGGML_HOST="127.0.0.2:18094", OLLAMA_ORIGINS="https://o.example",
            PYGGML_ORIGINS="https://p.example", OLLAMA_NUM_PARALLEL="2", OLLAMA_KEEP_ALIVE="10m")
    args = parse("serve")
    assert (cli._listen_address(args.host, args.port), args.origins) == (("127.0.0.2", 18094), "https://p.example")
    args = parse("serve", "--host", "localhost", "--origins", "https://f.example", "--parallel", "5",
                 "--keep-alive", "-1")
    assert (cli._listen_address(args.host, args.port), args.origins, args.parallel, args.keep_alive) == \
        (("localhost", 11434), "https://f.example", 5, "-1")
    assert cli._listen_address(parse("serve", "--port", "9000").host, 9000) == ("127.0.0.2", 9000)


def test_run_takes_the_context_and_keep_alive_but_embed_does_not(environ):
    environ(OLLAMA_CONTEXT_LENGTH="2048", OLLAMA_KEEP_ALIVE="30s", OLLAMA_NUM_PARALLEL="x")
    args = parse("run", "m.gguf", "hi")
    assert (args.ctx, args.keep_alive) == (2048, "30s")
    assert parse("run", "m.gguf", "hi", "--ctx", "64").ctx == 64
    assert parse("embed", "m.gguf", "hi").ctx is None  # --ctx there is "most tokens per text"


def test_serve_builds_its_configuration_from_the_environment(environ, monkeypatch):
    seen = {}

    def fake_serve(engine, server):
        seen.update(engine=engine, server=server)
        return 0

    monkeypatch.setattr("pyggml.server.serve", fake_serve)
    environ(OLLAMA_HOST="127.0.0.1:18093", OLLAMA_NUM_PARALLEL="2", OLLAMA_CONTEXT_LENGTH="1024",
            OLLAMA_KEEP_ALIVE="1m", OLLAMA_MAX_LOADED_MODELS="2", OLLAMA_ORIGINS="https://app.example")
    assert cli.main(["serve", "--threads", "1"]) == 0
    engine, server = seen["engine"], seen["server"]
    assert (engine.model, engine.parallel, engine.num_ctx) == (None, 2, 1024)
    assert (server.host, server.port, server.keep_alive, server.max_loaded, list(server.origins)) == \
        ("127.0.0.1", 18093, 60.0, 2, ["https://app.example"])
    environ(OLLAMA_KEEP_ALIVE="", OLLAMA_NUM_PARALLEL="")  # empty: unset, as Ollama reads it
    assert cli.main(["serve", "--threads", "1"]) == 0
    assert (seen["engine"].parallel, seen["server"].keep_alive) == (4, 300.0)


@pytest.mark.parametrize("name, value, words", [
    ("OLLAMA_HOST", "127.0.0.1:99999", ["OLLAMA_HOST", "bad port"]),
    ("OLLAMA_HOST", "example.com:http", ["OLLAMA_HOST", "bad port"]),
    ("OLLAMA_NUM_PARALLEL", "0", ["OLLAMA_NUM_PARALLEL must be an integer >= 1"]),
    ("OLLAMA_NUM_PARALLEL", "two", ["OLLAMA_NUM_PARALLEL must be an integer >= 1"]),
    ("OLLAMA_CONTEXT_LENGTH", "1", ["OLLAMA_CONTEXT_LENGTH must be an integer >= 2"]),
    ("OLLAMA_MAX_LOADED_MODELS", "-1", ["OLLAMA_MAX_LOADED_MODELS must be an integer >= 0"]),
    ("OLLAMA_KEEP_ALIVE", "soon", ["OLLAMA_KEEP_ALIVE", "duration"]),
    ("OLLAMA_ORIGINS", "https://ok.example,example.com", ["OLLAMA_ORIGINS", "'example.com' is not an origin"]),
    ("OLLAMA_MODELS", __file__, ["OLLAMA_MODELS", "is not a directory"]),
])
def test_a_bad_value_is_an_error_naming_the_variable(environ, monkeypatch, capsys, name, value, words):
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exc:
        parse("serve")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("pyggml serve: error: ")
    for word in words:
        assert word in err, err


def test_a_bad_variable_of_another_command_is_not_in_the_way(environ):
    environ(OLLAMA_NUM_PARALLEL="two", OLLAMA_HOST="x:y")
    assert parse("list").command == "list"


def test_ollama_host_picks_the_address_a_live_server_listens_on(tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from .test_cli_errors import _serving, _stop, spawn

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = spawn(tmp_path, "serve", "demo", "--threads", "1", OLLAMA_HOST=f"http://127.0.0.1:{port}", PYGGML_HOST="")
    try:
        url = _serving(proc)
        assert url == f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/", timeout=30).text == "pyggml is running"
    finally:
        err = _stop(proc)
    assert proc.returncode == 0 and "Traceback" not in err, err
