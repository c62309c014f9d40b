"""pyggml.load() -> LLM: generation, streaming, stops, seeds, prompt reuse, context shift, errors, CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import pyggml
from pyggml.runner.sequence import partial_stop
from pyggml.tiny import default_model_path

from .conftest import SHARED_MODELS

STORIES = SHARED_MODELS / "stories260K.gguf"
needs_stories = pytest.mark.skipif(not STORIES.exists(), reason=f"{STORIES} is absent")


@pytest.fixture(scope="module")
def stories():
    if not STORIES.exists():
        pytest.skip(f"{STORIES} is absent")
    llm = pyggml.load(STORIES, n_threads=2, num_ctx=256)
    yield llm
    llm.close()


def test_demo_model_generates(tmp_path, monkeypatch):
    monkeypatch.setenv("PYGGML_CACHE_DIR", str(tmp_path))
    with pyggml.load(default_model_path(), n_threads=1) as llm:
        no_end = {2: -float("inf")}  # random weights: ban the end token rather than depend on it
        text = llm.generate("Once upon a time", max_tokens=8, temperature=0, logit_bias=no_end)
        assert text and llm.stats.generated_tokens == 8
        assert llm.generate("Once upon a time", max_tokens=8, temperature=0, logit_bias=no_end) == text
        assert "".join(llm.generate("Once upon a time", max_tokens=8, temperature=0, logit_bias=no_end,
                                    stream=True)) == text


def test_greedy_text_of_stories260k(stories):
    text = stories.generate("Once upon a time", max_tokens=24, temperature=0)
    assert text.startswith(", there was a little girl named Lily.")


def test_stream_joins_to_the_same_text(stories):
    whole = stories.generate("Once upon a time", max_tokens=30, temperature=0)
    pieces = list(stories.generate("Once upon a time", max_tokens=30, temperature=0, stream=True))
    assert "".join(pieces) == whole and len(pieces) > 1


def test_same_seed_same_text_different_seed_differs(stories):
    a = stories.generate("Lily", max_tokens=40, temperature=1.0, top_k=0, top_p=1.0, seed=7)
    b = stories.generate("Lily", max_tokens=40, temperature=1.0, top_k=0, top_p=1.0, seed=7)
    c = stories.generate("Lily", max_tokens=40, temperature=1.0, top_k=0, top_p=1.0, seed=8)
    assert a == b and a != c


def test_stop_strings_are_cut_and_held_back(stories):
    whole = stories.generate("Once upon a time", max_tokens=40, temperature=0)
    cut = stories.generate("Once upon a time", max_tokens=40, temperature=0, stop=["Lily"])
    assert cut == whole[: whole.index("Lily")]
    assert stories.stats.finish_reason == "stop"
    streamed = "".join(stories.generate("Once upon a time", max_tokens=40, temperature=0, stop=["girl named"],
                                        stream=True))
    assert streamed == whole[: whole.index("girl named")]


def test_chat_uses_the_template_or_the_fallback(stories):
    from pyggml.chat import ChatTemplate

    messages = [{"role": "user", "content": "Tell me a story"}]
    reply = stories.chat(messages, max_tokens=8, temperature=0)
    rendered = "User: Tell me a story\n\nAssistant:"  # stories260K has no template: the plain transcript
    assert ChatTemplate(None).render(messages) == rendered
    assert reply and reply == stories.generate(rendered, max_tokens=8, temperature=0)
    with pytest.raises(ValueError):
        stories.chat([{"role": "wizard", "content": 1}])
    with pytest.raises(NotImplementedError, match="embeddings"):
        stories.embed("hello")


def test_partial_stop_suffix():
    assert partial_stop("hello Li", ["Lily"]) == 2
    assert partial_stop("hello", ["Lily"]) == 0
    assert partial_stop("abc", ["c", "bcd"]) == 2


def test_prompt_prefix_is_reused(stories):
    stories.generate("Once upon a time there was", max_tokens=4, temperature=0)
    stories.generate("Once upon a time there was a dog", max_tokens=4, temperature=0)
    assert stories.stats.cached_tokens >= len(stories.tokenize("Once upon a time there was")) - 1
    assert stories.stats.prompt_tokens < len(stories.tokenize("Once upon a time there was a dog"))


def test_reused_prefix_gives_the_same_logits_as_a_fresh_run(stories):
    tokens = stories.tokenize("Once upon a time, Lily")
    fresh = stories.logits(tokens)
    stories.generate("Once upon a time, Lily went", max_tokens=3, temperature=0)  # leaves a longer history
    again = stories.logits(tokens)
    np.testing.assert_allclose(again, fresh, rtol=1e-4, atol=1e-4)


def test_generation_continues_past_the_context_by_shifting():
    if not STORIES.exists():
        pytest.skip(f"{STORIES} is absent")
    with pyggml.load(STORIES, n_threads=2, num_ctx=32) as llm:
        llm.generate("Once upon a time", max_tokens=80, temperature=0)
        assert llm.stats.generated_tokens == 80
        assert len(llm.runner.input_cache.slots[0].inputs) <= 32


def test_bad_requests(stories):
    with pytest.raises(ValueError, match="empty prompt"):
        stories.generate("")
    with pytest.raises(ValueError, match="does not fit the context"):
        stories.generate("Lily " * 400)
    with pytest.raises(ValueError, match="out of range"):
        stories.logits([1, 99999])
    with pytest.raises(ValueError, match="top_p"):
        stories.generate("Lily", top_p=2.0)
    with pytest.raises(TypeError, match="unknown option"):
        pyggml.load(STORIES, bogus=1)


def test_missing_and_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        pyggml.load(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model at all")
    with pytest.raises(pyggml.GGUFError, match="not a GGUF file"):
        pyggml.load(bad)


def run_cli(*args, **env):
    return subprocess.run([sys.executable, "-m", "pyggml.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})


def test_cli_run_demo(tmp_path):
    out = run_cli("run", "demo", "Once upon a time", "--max-tokens", "5", "--verbose", "--threads", "1",
                  PYGGML_CACHE_DIR=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "random weights" in out.stderr and "tokens/s" in out.stderr


@needs_stories
def test_cli_run_and_show_real_model():
    out = run_cli("run", str(STORIES), "Once upon a time", "--max-tokens", "12", "--temperature", "0")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(", there was a little girl")
    out = run_cli("show", str(STORIES))
    assert out.returncode == 0, out.stderr
    assert "llama" in out.stdout and "blk.0.attn_q.weight" in out.stdout and "context length" in out.stdout


def test_cli_errors_are_messages_not_tracebacks(tmp_path):
    out = run_cli("run", str(tmp_path / "missing.gguf"), "hi")
    assert out.returncode != 0 and "no such model file" in out.stderr and "Traceback" not in out.stderr
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    out = run_cli("show", str(bad))
    assert out.returncode == 1 and "error" in out.stderr and "Traceback" not in out.stderr
