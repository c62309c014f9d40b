"""Model management as Ollama does it (issue 29 item 5): Modelfiles, ``pyggml create/cp/rm/pull``, the
store written in Ollama's layout (manifest, config blob, layers by media type) and read back, and the
routes ``/api/create``, ``/api/copy``, ``/api/delete``, ``/api/blobs/:digest`` and ``/api/ps`` through the
official ``ollama`` client, on a small random-weight GGUF in temporary stores."""

from __future__ import annotations

import hashlib
import json

import pytest

from pyggml import manifest, modelfile, store
from pyggml.synthetic import write_synthetic

MODELFILE = '''# a comment
FROM ./tiny.gguf
PARAMETER temperature 0
PARAMETER stop <|im_end|>
PARAMETER stop "two words"
PARAMETER num_predict 3
SYSTEM """You are
terse."""
LICENSE MIT
message user hi
MESSAGE assistant "hello \\"you\\""
'''


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("manage") / "tiny.gguf", "tiny", "f32")


@pytest.fixture
def stores(tmp_path, monkeypatch):
    for key, var in (("pyggml", "PYGGML_MODELS"), ("ollama", "OLLAMA_MODELS"), ("hf", "HF_HUB_CACHE"),
                     ("cache", "PYGGML_CACHE_DIR")):
        (tmp_path / key).mkdir()
        monkeypatch.setenv(var, str(tmp_path / key))
    return tmp_path


def test_modelfile_parse_quotes_comments_and_repeats():
    spec = modelfile.parse(MODELFILE)
    assert spec.base == "./tiny.gguf"
    assert spec.parameters == {"temperature": 0.0, "stop": ["<|im_end|>", "two words"], "num_predict": 3}
    assert spec.system == "You are\nterse."
    assert spec.license == ["MIT"]
    assert spec.messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 'hello "you"'}]
    again = modelfile.parse(modelfile.render("x", "./tiny.gguf", system=spec.system, parameters=spec.parameters,
                                             license=spec.license, messages=spec.messages))
    assert again == spec  # what `show --modelfile` writes reads back the same
    odd = {"stop": ["\n\n", "#", 'say "x"', "a\tb"], "top_p": 0.5}
    assert modelfile.parse(modelfile.render("x", "y", parameters=odd)).parameters == odd


@pytest.mark.parametrize("text, error", [
    ("FROM x\nADAPTER ./lora.gguf", "line 2: ADAPTER is not supported"),
    ("FROM x\nQUANTIZE q4", "unknown command 'QUANTIZE'"),
    ("FROM x\nPARAMETER top_k many", "top_k must be an integer"),
    ("FROM x\nPARAMETER nosuch 1", "unknown parameter 'nosuch'"),
    ("FROM x\nMESSAGE robot hi", "MESSAGE role must be one of"),
    ('FROM x\nSYSTEM """never closed', 'line 2: SYSTEM: the """ quote is never closed'),
    ("PARAMETER temperature 1", "no FROM line"),
    ("FROM x\nSYSTEM", "SYSTEM needs a value"),
])
def test_modelfile_mistakes_name_the_line(text, error):
    with pytest.raises(ValueError, match=error.replace("(", r"\(")):
        modelfile.parse(text)


def _manifest(stores, name, tag="latest"):
    return json.loads((stores / "ollama" / "manifests" / "registry.ollama.ai" / "library" / name / tag).read_text())


def _blob_text(stores, digest):
    return (stores / "ollama" / "blobs" / digest.replace(":", "-")).read_bytes()


def test_create_writes_ollamas_layout_and_reads_it_back(stores, gguf, tmp_path, capsys):
    from pyggml.cli import main

    (tmp_path / "tiny.gguf").write_bytes(gguf.read_bytes())
    (tmp_path / "Modelfile").write_text(MODELFILE)
    assert main(["create", "mine", "-f", str(tmp_path / "Modelfile")]) == 0

    data = _manifest(stores, "mine")
    assert data["schemaVersion"] == 2 and data["mediaType"] == manifest.MANIFEST_MEDIA
    kinds = [layer["mediaType"].rsplit(".", 1)[1] for layer in data["layers"]]
    assert sorted(kinds) == ["license", "messages", "model", "params", "system"]
    for layer in data["layers"]:  # content-addressed, sizes right
        blob = _blob_text(stores, layer["digest"])
        assert "sha256:" + hashlib.sha256(blob).hexdigest() == layer["digest"] and len(blob) == layer["size"]
    config = json.loads(_blob_text(stores, data["config"]["digest"]))
    assert config["model_format"] == "gguf" and config["model_family"] == "llama" and config["file_type"] == "F32"
    assert config["rootfs"]["diff_ids"] == [layer["digest"] for layer in data["layers"]]
    model_layer = next(layer for layer in data["layers"] if layer["mediaType"].endswith(".model"))
    assert _blob_text(stores, model_layer["digest"]) == gguf.read_bytes()

    capsys.readouterr()
    assert main(["show", "mine", "--system", "--parameters"]) == 0  # as `ollama show --system --parameters`
    assert capsys.readouterr().out.splitlines() == ['temperature                   0.0',
                                                    'stop                          "<|im_end|>"',
                                                    'stop                          "two words"',
                                                    "num_predict                   3", "You are", "terse."]
    ref = store.resolve("mine")
    assert ref.source == "ollama" and ref.name == "mine:latest"
    assert ref.params == {"temperature": 0.0, "stop": ["<|im_end|>", "two words"], "num_predict": 3}
    assert ref.system == "You are\nterse." and ref.license == ["MIT"]
    assert ref.messages[1] == {"role": "assistant", "content": 'hello "you"'}

    # FROM a stored model: its layers, the new system message, parameters merged over the base's
    (tmp_path / "Child").write_text("FROM mine\nSYSTEM Be kind.\nPARAMETER top_k 5\n")
    assert main(["create", "child:v1", "-f", str(tmp_path / "Child")]) == 0
    child = store.resolve("child:v1")
    assert child.path == ref.path and child.system == "Be kind." and child.license == ["MIT"]
    assert child.params == {**ref.params, "top_k": 5}


def test_cp_rm_keep_shared_blobs_and_refuse_files(stores, gguf, tmp_path, capsys):
    from pyggml.cli import main

    (tmp_path / "Modelfile").write_text(f"FROM {gguf}\nSYSTEM one\n")
    assert main(["create", "a", "-f", str(tmp_path / "Modelfile")]) == 0
    assert main(["cp", "a", "b:tag"]) == 0
    assert store.resolve("b:tag").system == "one"
    blobs = sorted(p.name for p in (stores / "ollama" / "blobs").iterdir())
    assert main(["rm", "a"]) == 0
    assert sorted(p.name for p in (stores / "ollama" / "blobs").iterdir()) == blobs  # b:tag still uses them
    assert main(["rm", "b:tag"]) == 0
    assert list((stores / "ollama" / "blobs").iterdir()) == []
    assert list((stores / "ollama" / "manifests").iterdir()) == []
    capsys.readouterr()
    assert main(["rm", "a"]) == 1
    assert "model 'a' not found" in capsys.readouterr().err
    assert main(["rm", str(gguf)]) == 1
    assert "not a model in Ollama's store: delete the file itself" in capsys.readouterr().err
    assert gguf.is_file()
    assert main(["cp", "nosuch", "x"]) == 1
    assert main(["pull", "llama3.2"]) == 1
    assert "no network access" in capsys.readouterr().err
    (tmp_path / "Bad").write_text("FROM x\nADAPTER ./lora.gguf\n")
    with pytest.raises(SystemExit, match="ADAPTER is not supported"):
        main(["create", "c", "-f", str(tmp_path / "Bad")])
    with pytest.raises(SystemExit, match="cannot read the Modelfile"):
        main(["create", "c", "-f", str(tmp_path / "missing")])
    assert main(["cp", str(gguf), "../escape"]) == 1


def test_invalid_names_and_digests():
    for name in ("../x", "a/b/c/d", "x:../y", "-x", ""):
        with pytest.raises(ValueError):
            manifest.manifest_path(name)
    for digest in ("sha256:abc", "md5:" + "0" * 64, "sha256:" + "G" * 64, "sha256:../" + "0" * 61):
        with pytest.raises(ValueError):
            manifest.check_digest(digest)
    assert manifest.check_digest("sha256-" + "a" * 64) == "sha256:" + "a" * 64


# ---- the routes, through the official ollama client -------------------------------------------------

@pytest.fixture
def server(stores):
    pytest.importorskip("uvicorn")
    ollama = pytest.importorskip("ollama")
    from pyggml import BackendParams, models
    from pyggml.repl import params_to_options
    from pyggml.runner import Runner
    from pyggml.server import ServedModel, create_app
    from pyggml.server.models import ModelManager

    from ._server import serving

    def load(ref):
        model = models.load(ref.path, BackendParams(n_threads=1))
        served = ServedModel(Runner(model, parallel=1, num_ctx=128, batch_size=32), ref.path, name=ref.name)
        served.aliases.update(ref.aliases)
        served.defaults, served.system, served.ref = params_to_options(ref.params), ref.system, ref
        return served

    manager = ModelManager(load, max_loaded=1, tick=0.05)
    with serving(create_app(manager)) as base:
        yield base, ollama.Client(host=base)


def test_create_copy_delete_blobs_and_ps_through_the_ollama_client(server, gguf, capsys):
    import httpx
    import ollama

    from pyggml.cli import main

    base, client = server
    digest = "sha256:" + hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert httpx.head(f"{base}/api/blobs/{digest}").status_code == 404
    assert client.create_blob(gguf) == digest
    assert httpx.head(f"{base}/api/blobs/{digest}").status_code == 200
    wrong = "sha256:" + "0" * 64
    upload = {"Content-Type": "application/octet-stream"}
    r = httpx.post(f"{base}/api/blobs/{wrong}", content=b"not that", headers=upload)
    assert r.status_code == 400 and "digest mismatch" in r.json()["error"]
    assert httpx.head(f"{base}/api/blobs/{wrong}").status_code == 404

    r = client.create(model="made", files={"tiny.gguf": digest}, system="Answer briefly.",
                      parameters={"num_predict": 2, "temperature": 0, "stop": ["\n\n"]}, license="MIT")
    assert r.status == "success"
    made = store.resolve("made")
    assert made.system == "Answer briefly." and made.params["num_predict"] == 2 and made.license == ["MIT"]

    statuses = [p.status for p in client.create(model="child", from_="made", system="Other.", stream=True)]
    assert statuses[-1] == "success" and "writing manifest" in statuses
    assert store.resolve("child").system == "Other." and store.resolve("child").params == made.params

    out = client.generate(model="child", prompt="hi", options={"seed": 1})
    assert out.eval_count == 2  # num_predict from the created params layer
    assert [m.model for m in client.ps().models] == ["child:latest"]
    assert main(["ps", "--host", base]) == 0  # `pyggml ps` and `stop` ask the running server
    assert capsys.readouterr().out.splitlines()[1].split()[:1] == ["child:latest"]
    assert main(["stop", "made", "--host", base]) == 1
    assert "'made' is not loaded" in capsys.readouterr().err
    assert main(["stop", "child", "--host", base]) == 0
    assert client.ps().models == []

    show = client.show("made")  # what the layers say, as Ollama reports them
    assert httpx.post(f"{base}/api/show", json={"model": "made"}).json()["system"] == "Answer briefly."
    assert show.license == "MIT"
    assert "num_predict" in show.parameters and "num_ctx" in show.parameters
    assert 'SYSTEM """Answer briefly."""' in show.modelfile and "PARAMETER num_predict 2" in show.modelfile
    assert 'LICENSE """MIT"""' in show.modelfile and str(gguf.parent) not in show.modelfile

    turns = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]
    client.create(model="talk", from_="made", messages=turns)
    asked = [{"role": "user", "content": "hi"}]
    plain, talk = client.chat(model="made", messages=asked), client.chat(model="talk", messages=asked)
    assert talk.prompt_eval_count > plain.prompt_eval_count  # the stored turns begin the conversation
    assert httpx.post(f"{base}/api/show", json={"model": "talk"}).json()["messages"] == turns

    assert client.copy("made", "made-copy").status == "success"
    assert store.resolve("made-copy").system == "Answer briefly."
    assert client.delete("made-copy").status == "success"
    with pytest.raises(ollama.ResponseError) as err:
        client.delete("made-copy")
    assert err.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as err:
        client.copy("nosuch", "x")
    assert err.value.status_code == 404

    refusals = [
        ({"model": "x", "from": str(gguf)}, 404, "not found"),  # a path on the server is never read
        ({"model": "x", "files": {"a.safetensors": digest}}, 400, "use `pyggml convert`"),
        ({"model": "x", "files": {"a.gguf": wrong}}, 404, "upload it first"),
        ({"model": "x", "from": "made", "quantize": "q4_K_M"}, 400, "pyggml quantize"),
        ({"model": "x", "from": "made", "adapters": {"a": digest}}, 400, "LoRA"),
        ({"model": "x", "from": "made", "parameters": {"nosuch": 1}}, 400, "unknown parameter"),
        ({"model": "../x", "from": "made"}, 400, "invalid model name"),
        ({"model": "x"}, 400, "either from"),
    ]
    for body, status, text in refusals:
        r = httpx.post(f"{base}/api/create", json={**body, "stream": False})
        assert r.status_code == status and text in r.json()["error"], (body, r.text)
    r = httpx.post(f"{base}/api/create", json={"model": "x", "from": "nosuch"})  # streamed: the error is a line
    assert json.loads(r.text.splitlines()[-1])["error"].startswith("model 'nosuch' not found")
    r = httpx.post(f"{base}/api/pull", json={"model": "llama3.2"})
    assert r.status_code == 501 and "no network access" in r.json()["error"]


def test_serving_one_named_model_honours_keep_alive_and_stop(tmp_path):
    """`pyggml serve MODEL`: a request's keep_alive 0 unloads the model, the next request loads it again,
    and `pyggml stop` unloads it (before, the one model stayed loaded whatever a request said)."""
    import time

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from .test_cli_errors import _serving, _stop, cli, spawn

    proc = spawn(tmp_path, "serve", "demo", "--port", "0", "--threads", "1")
    try:
        url = _serving(proc)

        def ask(**fields):
            body = {"model": "demo", "prompt": "hi", "stream": False, "options": {"num_predict": 2}, **fields}
            r = httpx.post(f"{url}/api/generate", json=body, timeout=120)
            assert r.status_code == 200, r.text

        def loaded():
            return [(m["name"], m["expires_at"]) for m in httpx.get(f"{url}/api/ps", timeout=10).json()["models"]]

        assert loaded() == [("demo", "2999-01-01T00:00:00Z")]
        ask(keep_alive=0)
        deadline = time.monotonic() + 60
        while loaded():
            assert time.monotonic() < deadline, "keep_alive 0 did not unload the model"
            time.sleep(0.05)
        ask()  # loads it again
        assert loaded() == [("demo", "2999-01-01T00:00:00Z")]
        out = cli(tmp_path, "stop", "demo", "--host", url)
        assert out.returncode == 0, out.stderr
        assert loaded() == []
        out = cli(tmp_path, "ps", "--host", url)
        assert out.returncode == 0 and out.stdout.split() == ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]
    finally:
        err = _stop(proc)
    assert proc.returncode == 0 and "Traceback" not in err, err


def test_run_once_begins_with_a_stored_models_messages(tmp_path):
    import re

    from .test_cli_errors import cli

    store = tmp_path / "ollama"
    for name, extra in (("plain", ""), ("talker", "MESSAGE user hello there\nMESSAGE assistant hi back\n")):
        (tmp_path / name).write_text(f"FROM demo\n{extra}")
        out = cli(tmp_path, "create", name, "-f", str(tmp_path / name), OLLAMA_MODELS=str(store))
        assert out.returncode == 0, out.stderr

    def prompt_tokens(name):
        out = cli(tmp_path, "run", name, "hi", "--max-tokens", "1", "--verbose", OLLAMA_MODELS=str(store))
        assert out.returncode == 0, out.stderr
        return int(re.search(r"prompt eval count: +(\d+)", out.stderr).group(1))

    assert prompt_tokens("talker") > prompt_tokens("plain")


def _mmproj(path):
    """A minimal vision projector GGUF (llama.cpp's mmproj files say architecture "clip")."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_tensor("v.patch_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_second_from_is_the_vision_projector(stores, gguf, tmp_path, server):
    from pyggml.cli import main

    base, client = server
    mmproj = _mmproj(tmp_path / "mmproj.gguf")
    (tmp_path / "tiny.gguf").write_bytes(gguf.read_bytes())
    (tmp_path / "Modelfile").write_text("FROM ./tiny.gguf\nFROM ./mmproj.gguf\n")
    assert main(["create", "seeing", "-f", str(tmp_path / "Modelfile")]) == 0
    ref = store.resolve("seeing")
    assert ref.projector is not None and ref.projector.read_bytes() == mmproj.read_bytes()
    assert ref.path.read_bytes() == gguf.read_bytes()
    (tmp_path / "Twice").write_text(f"FROM {gguf}\nFROM {gguf}\n")
    with pytest.raises(ValueError, match="must be a vision projector"):
        manifest.create("twice", modelfile.parse((tmp_path / "Twice").read_text()))
    with pytest.raises(ValueError, match="a third FROM"):
        modelfile.parse("FROM a\nFROM b\nFROM c\n")

    # the route: of two uploaded files, the one whose architecture is "clip" is the projector
    digests = [client.create_blob(p) for p in (mmproj, gguf)]
    assert client.create(model="seen", files={"mmproj.gguf": digests[0], "model.gguf": digests[1]}).status == "success"
    seen = store.resolve("seen")
    assert seen.path.read_bytes() == gguf.read_bytes() and seen.projector.read_bytes() == mmproj.read_bytes()
