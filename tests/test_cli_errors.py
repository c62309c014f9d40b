"""The rough edges a new user hits on the command line, each as a subprocess test: Ctrl-C (SIGINT)
stops a reply or a server cleanly, every listed mistake is a one-line message without a traceback,
hints name the flags, thread counts / temperature / ctx are checked alike, a vocabulary-only GGUF
says so, ``show`` formats small parameter counts, the demo model's first build is announced, and
``pyggml serve`` with no model serves a (fake) Ollama store by name."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import SHARED_MODELS

ROOT = Path(__file__).resolve().parents[1]


def env_for(tmp_path, **extra):
    return {**os.environ, "PYGGML_CACHE_DIR": str(tmp_path / "cache"), "PYGGML_MODELS": str(tmp_path / "none"),
            "OLLAMA_MODELS": str(tmp_path / "none"), "HF_HUB_CACHE": str(tmp_path / "none"),
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p), **extra}


def cli(tmp_path, *args, **extra):
    return subprocess.run([sys.executable, "-m", "pyggml.cli", *args], capture_output=True, text=True, timeout=300,
                          env=env_for(tmp_path, **extra))


def spawn(tmp_path, *args, **extra):
    return subprocess.Popen([sys.executable, "-m", "pyggml.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env_for(tmp_path, **extra))


def clean(out, code: int, *words: str) -> None:
    """Exit status ``code``, a message holding ``words`` on stderr, and no traceback."""
    assert out.returncode == code, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    for word in words:
        assert word in out.stderr, out.stderr


def test_first_use_of_the_demo_model_is_announced_and_show_formats_parameters(tmp_path):
    out = cli(tmp_path, "show", "demo")
    clean(out, 0, "building the demo model")
    line = next(line for line in out.stdout.splitlines() if line.strip().startswith("parameters"))
    assert "0.00 B" not in line and re.search(r"\(\d+(\.\d)?K\)", line), line
    assert "building" not in cli(tmp_path, "show", "demo").stderr  # only the first time


@pytest.mark.parametrize("args, code, words", [
    (["embed", "demo", "hello"], 1, ["`pyggml embed` needs an embedding model", "pyggml run"]),
    (["serve", "demo", "--port", "99999"], 2, ["0 to 65535"]),
    (["run", "demo", "hi", "--threads", "0"], 2, ["--threads must be an integer >= 1"]),
    (["embed", "demo", "hi", "--threads", "-2"], 2, ["--threads must be an integer >= 1"]),
    (["serve", "demo", "--threads", "0"], 2, ["--threads must be an integer >= 1"]),
    (["serve", "demo", "--poll", "101"], 2, ["--poll must be an integer from 0 to 100"]),
    (["serve", "demo", "--poll", "x"], 2, ["--poll must be an integer from 0 to 100"]),
    (["run", "demo", "hi", "--temperature", "-1"], 2, ["--temperature must be a number >= 0"]),
    (["run", "demo", "hi", "--ctx", "1"], 2, ["--ctx must be an integer >= 2"]),
    (["run", "demo", "hi", "--gpu-layers", "some"], 2, ["--gpu-layers must be an integer >= 0"]),
    (["run", "demo", "hi", "--top-p", "5"], 1, ["--top-p must be in (0, 1]"]),
    (["run", "demo", "word " * 40, "--ctx", "16", "--raw"], 1, ["raise --ctx"]),
    (["run", "no/such/model.gguf", "hi"], 1, ["no such model file", "pyggml list"]),
    (["serve", "demo", "--keep-alive", "soon"], 1, ["--keep-alive"]),
])
def test_mistakes_get_one_clear_line(tmp_path, args, code, words):
    clean(cli(tmp_path, *args), code, *words)


def test_cli_hints_name_the_flags():
    from pyggml.cli import cli_hint

    assert cli_hint("too long (shorten it, or truncate it)", "embed") == "too long (shorten it, or pass --truncate)"
    assert cli_hint("needs flash attention (BackendParams(flash_attention=True))", "bench").endswith("(-fa 1)")
    assert cli_hint("needs flash attention (BackendParams(flash_attention=True))", "run").endswith(
        "(--flash-attn on)")


def test_ctx_above_the_trained_context_warns(tmp_path):
    out = cli(tmp_path, "run", "demo", "hi", "--ctx", "1024", "--max-tokens", "2", "--threads", "1")
    clean(out, 0, "warning: --ctx 1024 is above the 512 tokens the model was trained on")


def _vocab_only(tmp_path) -> Path:
    shared = SHARED_MODELS / "vocab" / "ggml-vocab-llama-spm.gguf"
    if shared.exists():
        return shared
    import gguf

    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", "a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_vocabulary_only_file_says_so(tmp_path):
    out = cli(tmp_path, "run", str(_vocab_only(tmp_path)), "hi")
    clean(out, 1, "holds only a vocabulary of", "no weights")
    assert "missing tensors" not in out.stderr


def test_ctrl_c_stops_a_one_shot_reply_quietly(tmp_path):
    proc = spawn(tmp_path, "run", "demo", "tell me", "--max-tokens", "100000000", "--logit-bias", "2=-inf",
                 "--temperature", "0", "--threads", "1")
    try:
        assert proc.stdout.read(8)  # the reply is being written
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err


def _serving(proc) -> str:
    """The URL a starting `pyggml serve` announces (its first line of stderr that says so)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        assert line, "the server exited before announcing itself"
        found = re.search(r"on (http://\S+)", line)
        if found:
            return found.group(1)
    raise AssertionError("no announcement")


def _stop(proc) -> str:
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return err


def test_serve_ctrl_c_and_a_port_in_use(tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        out = cli(tmp_path, "serve", "demo", "--port", str(taken.getsockname()[1]))
        clean(out, 1, "already in use", "--port")
        assert "serving" not in out.stderr  # failed before announcing anything
    finally:
        taken.close()
    proc = spawn(tmp_path, "serve", "demo", "--port", "0", "--threads", "1")
    url = _serving(proc)
    assert httpx.get(f"{url}/health", timeout=30).json()["status"] == "ok"
    err = _stop(proc)
    assert proc.returncode == 0 and "Traceback" not in err, err


def _ollama_store(tmp_path, **layers):
    """An Ollama model store under tmp_path holding a tiny random model as "tiny:latest"."""
    from pyggml.synthetic import write_synthetic

    from .test_store import make_ollama

    store = tmp_path / "ollama"
    store.mkdir()
    make_ollama(store, write_synthetic(tmp_path / "tiny.gguf", "tiny", "f32"), **layers)
    return store


def test_serve_without_a_model_serves_the_store_by_name(tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    store = _ollama_store(tmp_path)
    proc = spawn(tmp_path, "serve", "--port", "0", "--threads", "1", "--keep-alive", "-1", OLLAMA_MODELS=str(store))
    try:
        url = _serving(proc)
        assert [m["name"] for m in httpx.get(f"{url}/api/tags", timeout=30).json()["models"]] == ["tiny:latest"]
        r = httpx.post(f"{url}/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False,
                                                      "options": {"num_predict": 2, "temperature": 0}}, timeout=120)
        assert r.status_code == 200, r.text
        ps = httpx.get(f"{url}/api/ps", timeout=10).json()["models"]
        assert [(m["name"], m["expires_at"]) for m in ps] == [("tiny:latest", "2999-01-01T00:00:00Z")]
    finally:
        err = _stop(proc)
    assert proc.returncode == 0 and "Traceback" not in err, err


def test_serve_one_stored_model_by_name_keeps_its_ollama_layers(tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    store = _ollama_store(tmp_path, params={"num_predict": 2})
    proc = spawn(tmp_path, "serve", "tiny", "--port", "0", "--threads", "1", OLLAMA_MODELS=str(store))
    try:
        url = _serving(proc)
        for name in ("tiny", "tiny:latest"):  # the store's name and its alias
            r = httpx.post(f"{url}/api/generate", json={"model": name, "prompt": "hi", "stream": False,
                                                          "options": {"temperature": 0}}, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["eval_count"] <= 2  # the params layer's num_predict is the default
    finally:
        err = _stop(proc)
    assert proc.returncode == 0 and "Traceback" not in err, err


# ---- frictions of issue 29 (item 10) ---------------------------------------------------------------
def test_texts_after_an_option_are_embedded(tmp_path):
    from pyggml.synthetic import write_model

    bert = write_model(tmp_path / "bert.gguf", "bert")
    out = cli(tmp_path, "embed", str(bert), "first", "--pooling", "mean", "second", "third")
    clean(out, 0)
    assert len(out.stdout.splitlines()) == 3


@pytest.mark.parametrize("argv, words", [
    (["run", "demo", "hi", "--temprature", "0"], ["pyggml run: error", "(did you mean --temperature?)"]),
    (["serve", "--paralel", "2"], ["pyggml serve: error", "(did you mean --parallel?)"]),
    (["rnu", "demo"], ["(did you mean run?)"]),
    (["embed", "m.gguf", "--pooling", "maen", "x"], ["(did you mean mean?)"]),
])
def test_a_typo_gets_a_suggestion(capsys, argv, words):
    from pyggml.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    for word in words:
        assert word in err, err


def test_errors_name_flags_not_python_keywords(tmp_path):
    from pyggml.cli import cli_hint

    memory = "not enough memory for 4 sequences of 100000000 tokens and batches of 512: lower parallel, num_ctx or " \
             "batch_size (Unable to allocate 763. GiB)"
    assert "lower --ctx (" in cli_hint(memory, "run") and "num_ctx" not in cli_hint(memory, "run")
    assert "lower --parallel, --ctx or --batch-size" in cli_hint(memory, "serve")
    pooling = "the model's pooling gives no single vector per text; pass pooling='mean', 'cls' or 'last'"
    assert cli_hint(pooling, "embed").endswith("pass --pooling mean, cls or last")
    assert cli_hint("a Q8_0 cache needs more (use flash attention, or a smaller num_ctx or parallel)", "run") \
        .endswith("(use --flash-attn on, or a smaller --ctx)")
    out = cli(tmp_path, "run", "demo", "hi", "--threads", "100000")
    clean(out, 1, "--threads 100000 is more than")
    assert "n_threads" not in out.stderr


def test_format_and_grammar_files_name_their_flag(tmp_path):
    from pyggml.cli import _structured, build_parser

    def structured(*flags):
        return _structured(build_parser().parse_args(["run", "m.gguf", "hi", *flags]))

    with pytest.raises(ValueError, match=r"^--format nosuch\.json: cannot read it \(No such file"):
        structured("--format", "nosuch.json")
    (tmp_path / "bad.json").write_text("{bad")
    with pytest.raises(ValueError, match=r"^--format .*bad\.json: not a JSON schema"):
        structured("--format", str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match=r"^--grammar .*: cannot read it"):
        structured("--grammar", str(tmp_path))
    (tmp_path / "ok.json").write_text('{"type": "object"}')
    assert structured("--format", str(tmp_path / "ok.json")) == {"format": {"type": "object"}}


def test_a_truncated_gguf_is_one_line(tmp_path):
    source = SHARED_MODELS / "stories260K.gguf"
    if not source.exists():
        from pyggml.synthetic import write_synthetic

        source = write_synthetic(tmp_path / "tiny.gguf", "tiny", "f32")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(source.read_bytes()[:5000])  # inside the vocabulary
    out = cli(tmp_path, "run", str(truncated), "hi")
    clean(out, 1, "is not a valid GGUF file (corrupt or truncated): failed to read key-value pairs")
    assert out.stderr.count("\n") == 1 and "\nggml:" not in out.stderr, out.stderr


def test_verbose_total_includes_the_load():
    """`ollama run --verbose`'s total covers the load of the reply that loaded the model (which happens
    before the reply's own clock starts)."""
    import io

    from pyggml.llm import Stats
    from pyggml.repl import print_stats

    out = io.StringIO()
    print_stats(Stats(load_seconds=2.0, prompt_seconds=0.1, generate_seconds=0.3), 0.5, out)
    assert "total duration:       2.500s" in out.getvalue() and "load duration:        2.000s" in out.getvalue()


def test_only_the_first_reply_after_a_load_counts_the_load():
    from pyggml import LLM
    from pyggml.tiny import default_model_path

    with LLM.load(default_model_path(), n_threads=1) as llm:
        assert llm.stats.load_seconds > 0
        llm.generate("hi", max_tokens=1)
        assert llm.stats.load_seconds > 0
        llm.generate("hi", max_tokens=1)
        assert llm.stats.load_seconds == 0.0


def test_serve_without_the_server_extra_names_it(monkeypatch):
    from pyggml.cli import main

    monkeypatch.setitem(sys.modules, "pyggml.server", None)  # as if starlette/uvicorn were absent
    with pytest.raises(SystemExit) as exc:
        main(["serve", "demo"])
    assert 'pip install "pyggml[server]"' in str(exc.value)


def test_llguidance_loads_only_when_a_format_is_asked(tmp_path):
    pytest.importorskip("llguidance")
    code = ("import sys\nfrom pyggml.cli import main\n"
            "main(['run', 'demo', 'hi', '--max-tokens', '2', '--threads', '1'])\n"
            "print('plain', any(m.startswith('llguidance') for m in sys.modules))\n"
            "main(['run', 'demo', 'hi', '--max-tokens', '2', '--threads', '1', '--format', 'json'])\n"
            "print('format', any(m.startswith('llguidance') for m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=env_for(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "plain False" in out.stdout and "format True" in out.stdout, out.stdout
