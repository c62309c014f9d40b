"""``pyggml serve`` with no model: every model of the catalog served by name through
``ModelManager`` (on-demand loading, --max-loaded, keep_alive incl. 0 and -1, /api/ps, /api/tags,
/api/show by name, requests waiting for a loading model, 503/507), on synthetic random-weight
models in a fake Ollama store; and the command line around it (queue default, bad port, port in
use announced as an error before anything is served)."""

from __future__ import annotations

import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pyggml import BackendParams, models
from pyggml.runner import Runner
from pyggml.store import ModelRef
from pyggml.synthetic import write_synthetic

_NEEDS = "the server tests need: pip install starlette uvicorn httpx"
pytest.importorskip("starlette", reason=_NEEDS)
httpx = pytest.importorskip("httpx", reason=_NEEDS)
uvicorn = pytest.importorskip("uvicorn", reason=_NEEDS)

from pyggml.server import ServedModel, create_app  # noqa: E402
from pyggml.server.models import FOREVER, ModelManager  # noqa: E402

from ._server import serving  # noqa: E402

NO_END = {"temperature": 0}


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    path = write_synthetic(root / "a.gguf", "tiny", "f32")
    shutil.copy(path, root / "b.gguf")
    return [ModelRef("a:latest", root / "a.gguf", "ollama", aliases=("a",)),
            ModelRef("b:latest", root / "b.gguf", "ollama", aliases=("b",))]


class Loads:
    """The manager's load function, counting calls."""

    def __init__(self):
        self.count: dict[str, int] = {}
        self.lock = threading.Lock()

    def __call__(self, ref: ModelRef) -> ServedModel:
        with self.lock:
            self.count[ref.name] = self.count.get(ref.name, 0) + 1
        time.sleep(0.2)  # a load takes a while: concurrent requests must wait for it, not load twice
        model = models.load(ref.path, BackendParams(n_threads=1))
        runner = Runner(model, parallel=2, num_ctx=128, batch_size=32)
        served = ServedModel(runner, ref.path, queue=4, name=ref.name)
        served.aliases.update(ref.aliases)
        return served


def running(manager: ModelManager):
    return serving(create_app(manager))


def generate(base, model, **body):
    body = {"model": model, "prompt": "hello", "stream": False, "options": {"num_predict": 2, **NO_END}, **body}
    return httpx.post(f"{base}/api/generate", json=body, timeout=60)


def loaded(base) -> list[str]:
    return sorted(m["name"] for m in httpx.get(f"{base}/api/ps", timeout=10).json()["models"])


def wait_for(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_models_load_on_demand_one_at_a_time(refs):
    loads = Loads()
    manager = ModelManager(loads, catalog=lambda: refs, max_loaded=1, keep_alive=300, tick=0.05)
    with running(manager) as base:
        tags = httpx.get(f"{base}/api/tags", timeout=30).json()["models"]
        assert [t["name"] for t in tags] == ["a:latest", "b:latest"]
        assert tags[0]["details"]["family"] == "llama" and tags[0]["size"] == refs[0].size
        assert [m["id"] for m in httpx.get(f"{base}/v1/models", timeout=10).json()["data"]] == ["a:latest", "b:latest"]
        assert loaded(base) == []
        r = generate(base, "a")
        assert r.status_code == 200 and r.json()["done"] and r.json()["model"] == "a:latest"
        assert loaded(base) == ["a:latest"]
        assert generate(base, "b:latest").status_code == 200  # a is idle: unloaded to make room
        assert loaded(base) == ["b:latest"]
        show = httpx.post(f"{base}/api/show", json={"model": "a"}, timeout=30)
        assert show.status_code == 200 and show.json()["details"]["family"] == "llama"
        r = generate(base, "c")
        assert r.status_code == 404 and "a:latest, b:latest" in r.json()["error"]
        r = httpx.post(f"{base}/v1/chat/completions", json={"model": "zzz", "messages": [
            {"role": "user", "content": "hi"}]}, timeout=10)
        assert r.status_code == 404
        assert generate(base, "a", keep_alive="soon").status_code == 400
        assert loaded(base) == ["a:latest"] and loads.count == {"a:latest": 2, "b:latest": 1}
        # requests for a model that is loading wait for it: one load for four requests
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: generate(base, "b"), range(4)))
        assert [a.status_code for a in answers] == [200] * 4
        assert loads.count == {"a:latest": 2, "b:latest": 2}


def test_keep_alive_zero_minus_one_and_durations(refs):
    manager = ModelManager(Loads(), catalog=lambda: refs, max_loaded=2, keep_alive=300, tick=0.05)
    with running(manager) as base:
        assert generate(base, "a", keep_alive=-1).status_code == 200
        assert generate(base, "b", keep_alive="10m").status_code == 200
        ps = {m["name"]: m for m in httpx.get(f"{base}/api/ps", timeout=10).json()["models"]}
        assert ps["a:latest"]["expires_at"] == FOREVER and ps["b:latest"]["expires_at"] != FOREVER
        assert ps["a:latest"]["context_length"] == 128
        assert generate(base, "b", keep_alive=0).status_code == 200  # unloaded once the request is done
        wait_for(lambda: loaded(base) == ["a:latest"])
        r = httpx.post(f"{base}/api/generate", json={"model": "a", "keep_alive": 0}, timeout=30)
        assert r.json()["done_reason"] == "unload"
        assert loaded(base) == []
        r = httpx.post(f"{base}/api/chat", json={"model": "b", "messages": []}, timeout=30)
        assert r.json()["done_reason"] == "load" and loaded(base) == ["b:latest"]
        assert httpx.get(f"{base}/health", timeout=10).json()["models_loaded"] == ["b:latest"]
    assert manager._loaded == {}  # the server's shutdown unloaded everything


def test_busy_models_and_memory_get_clear_errors(refs):
    manager = ModelManager(Loads(), catalog=lambda: refs, max_loaded=1, keep_alive=300, tick=0.05)
    with running(manager) as base:
        assert generate(base, "a").status_code == 200
        served = manager.loaded_model("a")
        served.admit()  # a request of a's in flight (deterministic: no race with a reply's end)
        try:
            r = generate(base, "b")
            assert r.status_code == 503 and "all are busy" in r.json()["error"] and r.headers["Retry-After"]
            manager.reap(now=time.monotonic() + 10**6)  # a busy model outlives its keep_alive
            assert manager.loaded_model("a") is served
        finally:
            served.release()
        wait_for(lambda: generate(base, "b").status_code == 200)
    small = ModelManager(Loads(), catalog=lambda: refs, memory_available=lambda: 1000, tick=0.05)
    with running(small) as base:
        r = generate(base, "a")
        assert r.status_code == 507 and "not enough memory" in r.json()["error"] and "GiB" in r.json()["error"]


def test_the_default_queue_is_ollamas(refs):
    from pyggml.server.service import DEFAULT_QUEUE

    model = models.load(refs[0].path, BackendParams(n_threads=1))
    with Runner(model, parallel=1, num_ctx=64) as runner:
        assert ServedModel(runner, refs[0].path).queue_limit == DEFAULT_QUEUE == 512
    model.close()


def test_an_ollama_models_params_and_system_layers_are_request_defaults(refs):
    with_layers = ModelRef("c:latest", refs[0].path, "ollama", params={"num_predict": 3, "temperature": 0},
                           system="You answer in one word, always.", aliases=("c",))
    catalog = [refs[0], with_layers]
    from pyggml.repl import params_to_options

    def load(ref):
        served = Loads()(ref)
        served.defaults, served.system = params_to_options(ref.params), ref.system
        return served

    manager = ModelManager(load, catalog=lambda: catalog, max_loaded=2, tick=0.05)
    with running(manager) as base:
        def ask(model, **options):
            body = {"model": model, "prompt": "hello", "stream": False, "options": options}
            return httpx.post(f"{base}/api/generate", json=body, timeout=60).json()

        plain, layered = ask("a", num_predict=3, temperature=0), ask("c")
        assert layered["eval_count"] == 3  # num_predict from the params layer
        assert layered["prompt_eval_count"] > plain["prompt_eval_count"]  # the system layer's message
        r = ask("c", num_predict=1)
        assert r.get("eval_count") == 1, r  # the request's own options win


_BROKEN_STORE = r"""
import json, sys
from pathlib import Path
from pyggml.server.models import ModelManager
from pyggml.store import ModelRef
from tests.test_gguf_counts import base_file, write_variant
from tests.test_server_models import Loads, generate, running

root = Path(sys.argv[1])
write_variant(base_file(root, "gemma3-vision"), root / "broken.gguf", "clip.vision.block_count", 2**31)
refs = [ModelRef("a:latest", Path(sys.argv[2]), "ollama", aliases=("a",)),
        ModelRef("broken:latest", root / "broken.gguf", "ollama", aliases=("broken",))]
manager = ModelManager(Loads(), catalog=lambda: refs, max_loaded=1)
out = {}
with running(manager) as base:
    for name in ("broken", "a", "broken", "a"):  # the failure frees its slot every time
        r = generate(base, name)
        out.setdefault(name, []).append([r.status_code, r.text[:300]])
    out["health"] = manager.health()
print(json.dumps(out))
"""


def test_a_model_that_fails_to_load_frees_its_slot(refs, tmp_path):
    """A store model whose vision part claims 2**31 layers: its requests get a clear error at once, the
    other models keep answering (it hung the load, and every other model got 503 until a restart)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _BROKEN_STORE, str(tmp_path), str(refs[0].path)], cwd=root,
                          env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for status, text in out["broken"]:
        assert status == 500 and "could not load model" in text and "clip.vision.block_count" in text, text
    assert [status for status, _ in out["a"]] == [200, 200], out["a"]
    assert out["health"]["models_loading"] == [] and out["health"]["models_loaded"] == ["a:latest"]
