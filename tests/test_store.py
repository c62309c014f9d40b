"""Models by name (``pyggml.store``): pyggml's model directory, a fake Ollama store (manifest +
blobs) and a fake Hugging Face hub cache built in temporary directories from a small GGUF, the
resolution order, ``pyggml list``, and the CLI using a name. Nothing touches the network."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from pyggml import store
from pyggml.synthetic import write_synthetic


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("store") / "tiny.gguf", "tiny", "f32")


def _blob(root, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(data)
    return f"sha256:{digest}"


def make_ollama(root, gguf, name="tiny", tag="latest", namespace="library", params=None, system=None,
                projector=None):
    """An Ollama store with one model: its manifest, the GGUF blob, template/params/system/projector layers."""
    layers = [{"mediaType": "application/vnd.ollama.image.model", "digest": _blob(root, gguf.read_bytes()),
               "size": gguf.stat().st_size},
              {"mediaType": "application/vnd.ollama.image.template",
               "digest": _blob(root, b"{{ .Prompt }}"), "size": 13}]
    if params is not None:
        data = json.dumps(params).encode()
        layers.append({"mediaType": "application/vnd.ollama.image.params", "digest": _blob(root, data),
                       "size": len(data)})
    if system is not None:
        layers.append({"mediaType": "application/vnd.ollama.image.system", "digest": _blob(root, system.encode()),
                       "size": len(system)})
    if projector is not None:
        layers.append({"mediaType": "application/vnd.ollama.image.projector",
                       "digest": _blob(root, projector.read_bytes()), "size": projector.stat().st_size})
    manifest = root / "manifests" / "registry.ollama.ai" / namespace / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))


def make_hf(root, gguf, repo="org/tiny-GGUF", files=("tiny-Q8_0.gguf",)):
    org, name = repo.split("/")
    repo_dir = root / f"models--{org}--{name}"
    snapshot = repo_dir / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text("abc123")
    for f in files:
        shutil.copy(gguf, snapshot / f)


@pytest.fixture
def stores(tmp_path, monkeypatch, gguf):
    """Empty pyggml, Ollama and Hugging Face stores in tmp_path (and a private cache dir)."""
    dirs = {key: tmp_path / key for key in ("pyggml", "ollama", "hf", "cache")}
    for d in dirs.values():
        d.mkdir()
    monkeypatch.setenv("PYGGML_MODELS", str(dirs["pyggml"]))
    monkeypatch.setenv("OLLAMA_MODELS", str(dirs["ollama"]))
    monkeypatch.setenv("HF_HUB_CACHE", str(dirs["hf"]))
    monkeypatch.setenv("PYGGML_CACHE_DIR", str(dirs["cache"]))
    return dirs


def test_a_file_path_wins_and_a_missing_name_says_where_it_looked(stores, gguf):
    assert store.resolve(str(gguf)).source == "file"
    with pytest.raises(store.ModelNotFoundError, match="pyggml list") as info:
        store.resolve("nothing-here")
    assert str(stores["ollama"]) in str(info.value) and str(stores["hf"]) in str(info.value)
    assert isinstance(info.value, FileNotFoundError)


def test_pyggml_directory(stores, gguf):
    shutil.copy(gguf, stores["pyggml"] / "mine.gguf")
    for name in ("mine", "mine:latest", "mine.gguf"):
        ref = store.resolve(name)
        assert (ref.source, ref.name, ref.path) == ("pyggml", "mine", stores["pyggml"] / "mine.gguf")
    shutil.copy(gguf, stores["cache"] / "secret.gguf")
    with pytest.raises(store.ModelNotFoundError):
        store.resolve("../cache/secret")  # never outside the directory


def test_ollama_store_manifest_blob_and_layers(stores, gguf):
    make_ollama(stores["ollama"], gguf, params={"stop": ["<|end|>"], "temperature": 0.2}, system="Be brief.")
    make_ollama(stores["ollama"], gguf, name="other", tag="q4", namespace="someone")
    ref = store.resolve("tiny")
    assert ref.source == "ollama" and ref.name == "tiny:latest"
    assert ref.path.read_bytes() == gguf.read_bytes() and ref.path.parent == stores["ollama"] / "blobs"
    assert ref.params == {"stop": ["<|end|>"], "temperature": 0.2} and ref.system == "Be brief."
    assert ref.template == "{{ .Prompt }}"
    assert store.resolve("tiny:latest").path == ref.path
    assert store.resolve("someone/other:q4").name == "someone/other:q4"
    with pytest.raises(store.ModelNotFoundError):
        store.resolve("tiny:nope")


def test_pyggml_directory_comes_before_ollama(stores, gguf):
    make_ollama(stores["ollama"], gguf)
    shutil.copy(gguf, stores["pyggml"] / "tiny.gguf")
    assert store.resolve("tiny").source == "pyggml"


def test_hugging_face_cache(stores, gguf):
    make_hf(stores["hf"], gguf)
    make_hf(stores["hf"], gguf, repo="org/two-GGUF", files=("two-Q4_0.gguf", "two-Q8_0.gguf"))
    ref = store.resolve("org/tiny-GGUF")
    assert ref.source == "huggingface" and ref.name == "org/tiny-GGUF:tiny-Q8_0.gguf"
    assert store.resolve("hf.co/org/two-GGUF:Q4_0").path.name == "two-Q4_0.gguf"
    assert store.resolve("org/two-GGUF:two-Q8_0.gguf").path.name == "two-Q8_0.gguf"
    with pytest.raises(store.ModelNotFoundError, match="two-Q4_0.gguf, two-Q8_0.gguf"):
        store.resolve("org/two-GGUF")


def test_hugging_face_cache_prefers_the_exact_file_name(stores, gguf):
    """``org/repo:FILE`` names one file even when other names contain it (model-Q4_K is in model-Q4_K_M)."""
    make_hf(stores["hf"], gguf, repo="org/m-GGUF", files=("model-Q4_K.gguf", "model-Q4_K_M.gguf"))
    assert store.resolve("org/m-GGUF:model-Q4_K").path.name == "model-Q4_K.gguf"
    assert store.resolve("org/m-GGUF:model-Q4_K.gguf").path.name == "model-Q4_K.gguf"
    assert store.resolve("org/m-GGUF:Q4_K_M").path.name == "model-Q4_K_M.gguf"
    with pytest.raises(store.ModelNotFoundError, match="several files"):
        store.resolve("org/m-GGUF:Q4_K")  # a tag that is no file's name: both contain it


def test_list_models_and_the_list_command(stores, gguf, capsys):
    from pyggml.cli import main

    shutil.copy(gguf, stores["pyggml"] / "mine.gguf")
    make_ollama(stores["ollama"], gguf)
    make_hf(stores["hf"], gguf)
    found = store.list_models()
    assert [(m.name, m.source) for m in found] == [
        ("mine", "pyggml"), ("org/tiny-GGUF:tiny-Q8_0.gguf", "huggingface"), ("tiny:latest", "ollama")]
    assert main(["list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:5] == ["NAME", "SIZE", "ARCH", "QUANT", "SOURCE"]
    assert any(line.split()[0] == "tiny:latest" and "llama" in line and "F32" in line and "ollama" in line
               for line in out[1:])
    assert main(["list", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["source"] for r in rows} == {"pyggml", "ollama", "huggingface"}
    assert all(r["architecture"] == "llama" and r["size"] == gguf.stat().st_size for r in rows)


def test_run_and_load_by_name(stores, gguf, capsys):
    import pyggml
    from pyggml.cli import main

    make_ollama(stores["ollama"], gguf, params={"temperature": 0, "num_predict": 3})
    with pyggml.load("tiny", n_threads=1) as llm:
        assert llm.model.config.architecture == "llama"
    assert main(["run", "tiny", "hello", "--threads", "1", "--raw"]) == 0
    assert capsys.readouterr().out.strip()


def _vocabulary_file(path, n_tokens: int):
    import gguf as gguf_py

    writer = gguf_py.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(n_tokens)])
    writer.add_uint32("llama.context_length", 4096)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_header_checks_never_parse_the_vocabulary_in_python(tmp_path, gguf, monkeypatch):
    """The checks before every load and the listings read the header natively and skip the arrays:
    Python's GGUFReader (8.5 s for a 128k vocabulary) must not run, and a 150k-token array's strings
    are never decoded, only its length read."""
    import gguf as gguf_py

    from pyggml.backend import metadata
    from pyggml.server import models as served
    from pyggml.synthetic import SHAPES

    n_params = sum(t.nelements for t in _tensors(gguf).values())  # the full load, before the patches

    def no_python_parser(*args, **kwargs):
        raise AssertionError("the GGUF header was parsed in Python")

    monkeypatch.setattr(gguf_py, "GGUFReader", no_python_parser)
    decoded = []
    real_read_kv = metadata.read_metadata
    monkeypatch.setattr(metadata, "read_metadata", lambda g, lengths=None: decoded.append(lengths is None) or
                        real_read_kv(g, lengths))
    vocab = _vocabulary_file(tmp_path / "vocab.gguf", 150_000)
    with pytest.raises(ValueError, match="holds only a vocabulary of 150000 tokens"):
        store.check_has_weights(vocab)
    summary = metadata.read_gguf_summary(vocab)
    assert summary.array_lengths["tokenizer.ggml.tokens"] == 150_000
    assert "tokenizer.ggml.tokens" not in summary.config and summary.config.uint("context_length") == 4096
    store.check_has_weights(gguf)  # a model: no error
    assert store.file_facts(gguf) == ("llama", "F32")
    ref = store.ModelRef("tiny", gguf, "file")
    shape = SHAPES["tiny"]
    assert served._parameter_count(ref) == n_params
    layers, width, heads, kv_heads = shape.n_layers, shape.hidden, shape.n_heads, shape.n_kv_heads
    assert served.estimate_memory(ref, 100) == ref.size + 2 * layers * 100 * width * kv_heads // heads * 2
    assert store.file_facts(tmp_path / "missing.gguf") == ("?", "?")
    assert decoded and not any(decoded)  # every read skipped the arrays' contents


def _tensors(path):
    from pyggml.backend import Backend, BackendParams

    backend = Backend.load(path, BackendParams(repack=False))
    try:
        return dict(backend.tensors())
    finally:
        backend.close()
