"""llama-cpp-python's habits on ``LLM``: ``create_completion`` / ``create_chat_completion`` /
``create_embedding`` answering the same dict shapes as ``llama_cpp.Llama`` (compared on the same file),
``from_pretrained`` from the local Hugging Face cache, llama-cpp-python's option names, logprobs kept,
``detokenize(tokenize(x)) == x``, and ``dir(pyggml)``."""

from __future__ import annotations

import base64
import json
import shutil

import numpy as np
import pytest

import pyggml
from pyggml.synthetic import write_model, write_synthetic

from .conftest import SHARED_MODELS

STORIES = SHARED_MODELS / "stories260K.gguf"
needs_stories = pytest.mark.skipif(not STORIES.exists(), reason=f"{STORIES} is absent")


def shape(x):
    """The structure of a JSON-like answer: dict keys, list item shapes, value kinds (numpy floats are floats)."""
    if isinstance(x, dict):
        return {k: shape(v) for k, v in x.items()}
    if isinstance(x, list):
        return [shape(x[0])] if x else []
    if isinstance(x, (float, np.floating)):
        return "float"
    return type(x).__name__


@pytest.fixture(scope="module")
def both():
    """(pyggml LLM, llama_cpp.Llama) on stories260K, loaded the llama-cpp-python way."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is the reference")
    if not STORIES.exists():
        pytest.skip(f"{STORIES} is absent")
    ours = pyggml.load(STORIES, n_ctx=256, n_batch=64, n_gpu_layers=0, verbose=False)
    ref = llama_cpp.Llama(str(STORIES), n_ctx=256, verbose=False, logits_all=True)
    yield ours, ref
    ours.close()
    ref.close()


def test_create_completion_answers_as_llama_cpp_python(both):
    ours, ref = both
    a = ours.create_completion("Once upon a time", max_tokens=8, temperature=0, logprobs=2)
    b = ref.create_completion("Once upon a time", max_tokens=8, temperature=0, logprobs=2)
    assert shape(a) == shape(b) and a["object"] == b["object"] == "text_completion"
    ca, cb = a["choices"][0], b["choices"][0]
    assert ca["text"] == cb["text"] and ca["finish_reason"] == cb["finish_reason"] == "length"
    assert a["usage"] == b["usage"]
    la, lb = ca["logprobs"], cb["logprobs"]
    assert la["tokens"] == lb["tokens"] and la["text_offset"] == lb["text_offset"]
    np.testing.assert_allclose(la["token_logprobs"], lb["token_logprobs"], atol=1e-3)
    assert [list(t) for t in la["top_logprobs"]] == [list(t) for t in lb["top_logprobs"]]
    assert ours(("Once upon a time"), max_tokens=8, temperature=0)["choices"][0]["text"] == ca["text"]  # __call__
    # streamed: chunks of the same shape joining to the same text
    sa = list(ours.create_completion("Once upon a time", max_tokens=8, temperature=0, stream=True))
    sb = list(ref.create_completion("Once upon a time", max_tokens=8, temperature=0, stream=True))
    assert {json.dumps(shape(c), sort_keys=True) for c in sa} == {json.dumps(shape(c), sort_keys=True) for c in sb}
    assert "".join(c["choices"][0]["text"] for c in sa) == ca["text"]
    assert sa[-1]["choices"][0]["finish_reason"] == "length"
    echo = ours.create_completion("Once upon a time", max_tokens=8, temperature=0, echo=True)
    assert echo["choices"][0]["text"] == "Once upon a time" + ca["text"]


def test_create_chat_completion_answers_as_llama_cpp_python(both):
    ours, ref = both
    messages = [{"role": "system", "content": "Tell stories."}, {"role": "user", "content": "Hi"}]
    a = ours.create_chat_completion(messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    b = ref.create_chat_completion(messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    # llama-cpp-python leaves ``bytes`` null; OpenAI (and pyggml) give the token's UTF-8 bytes
    assert json.dumps(shape(a), sort_keys=True).replace('["int"]', '"NoneType"') == json.dumps(shape(b), sort_keys=True)
    assert a["object"] == "chat.completion" and a["choices"][0]["message"]["role"] == "assistant"
    assert len(a["choices"][0]["logprobs"]["content"]) == a["usage"]["completion_tokens"] == 4
    sa = list(ours.create_chat_completion(messages, max_tokens=4, temperature=0, stream=True))
    sb = list(ref.create_chat_completion(messages, max_tokens=4, temperature=0, stream=True))
    assert shape(sa[0]) == shape(sb[0]) and sa[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert shape(sa[-1]) == shape(sb[-1]) and sa[-1]["choices"][0]["finish_reason"] == "length"
    assert {c["object"] for c in sa} == {"chat.completion.chunk"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in sa) == a["choices"][0]["message"]["content"]
    with pytest.raises(ValueError, match="mirostat_mode .*not supported"):
        ours.create_chat_completion(messages, mirostat_mode=2)
    with pytest.raises(TypeError, match="unexpected keyword argument.*nosuch"):
        ours.create_chat_completion(messages, nosuch=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_synthetic(tmp_path_factory.mktemp("compat") / "tiny.gguf", "tiny", "f32")
    with pyggml.load(path, n_ctx=512) as llm:
        yield llm


def test_chat_tools_and_response_format(tiny):
    pytest.importorskip("llguidance", reason="constrained output needs llguidance")
    from .test_tools import WEATHER, check_weather

    messages = [{"role": "user", "content": "Weather in Paris?"}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    reply = tiny.create_chat_completion(messages, tools=[WEATHER], tool_choice=forced, max_tokens=200,
                                        temperature=1.0, seed=7)
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"]
    check_weather(call["function"]["name"], json.loads(call["function"]["arguments"]))
    chunks = list(tiny.create_chat_completion(messages, tools=[WEATHER], tool_choice="required", max_tokens=200,
                                              temperature=1.0, seed=7, stream=True))
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for fmt in ({"type": "json_object", "schema": schema},  # llama-cpp-python's shape
                {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}):  # OpenAI's
        text = tiny.create_chat_completion(messages, response_format=fmt, max_tokens=64, temperature=1.0,
                                           seed=3)["choices"][0]["message"]["content"]
        assert isinstance(json.loads(text)["n"], int)


def test_create_embedding_matches_llama_cpp_python(tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is the reference")
    path = write_model(tmp_path / "bert.gguf", "bert")
    texts = ["hello world", "a b c d"]
    with pyggml.load(path) as llm:
        a = llm.create_embedding(texts)
    ref = llama_cpp.Llama(str(path), embedding=True, verbose=False)
    b = ref.create_embedding(texts)
    ref.close()
    assert shape(a) == shape(b) and a["usage"] == b["usage"]
    for x, y in zip(a["data"], b["data"], strict=True):
        assert x["index"] == y["index"]
        np.testing.assert_allclose(x["embedding"], y["embedding"], atol=2e-3)  # llama.cpp: tanh GELU


@needs_stories
def test_llama_cpp_option_names_and_typos():
    with pyggml.load(STORIES, n_ctx=128, n_batch=32, n_gpu_layers=-1, verbose=True) as llm:
        assert llm.num_ctx == 128 and llm.batch_size == 32
    with pytest.raises(TypeError, match=r"n_ctxx \(did you mean n_ctx\?\)"):
        pyggml.load(STORIES, n_ctxx=128)
    with pytest.raises(TypeError, match=r"num_ctxt \(did you mean num_ctx\?\)"):
        pyggml.load(STORIES, num_ctxt=128)
    with pytest.raises(TypeError, match="give num_ctx or its llama-cpp-python name n_ctx, not both"):
        pyggml.load(STORIES, n_ctx=128, num_ctx=64)


@needs_stories
def test_generate_keeps_logprobs_and_detokenize_inverts_tokenize():
    with pyggml.load(STORIES, num_ctx=128) as llm:
        text = llm.generate("Once upon a time", max_tokens=6, temperature=0, logprobs=3)
        lps = llm.stats.logprobs
        assert len(lps) == llm.stats.generated_tokens == 6 and [lp.token for lp in lps] == llm.stats.tokens
        assert all(len(lp.top) == 3 and lp.top[0][0] == lp.token for lp in lps)  # greedy: the best one
        assert llm.detokenize([lp.token for lp in lps]) == text
        for s in ["Hello world", " Hello  world", "a\nb", "Once upon a time, Lily."]:
            assert llm.detokenize(llm.tokenize(s)) == s
        assert llm.detokenize(llm.tokenize("Hello"), special=True) == "<s>Hello"


def test_dir_lists_the_public_api():
    names = dir(pyggml)
    assert {"load", "LLM", "Backend", "BackendParams", "Tensor", "DType", "devices", "__version__",
            "models", "quantize", "convert", "server"} <= set(names)
    assert all(hasattr(pyggml, n) for n in pyggml.__all__)


@needs_stories
def test_from_pretrained_reads_the_hugging_face_cache_only(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--someone--stories-GGUF"
    snapshot = repo / "snapshots" / "0123abcd"
    (snapshot / "sub").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    shutil.copy(STORIES, snapshot / "stories-F32.gguf")
    shutil.copy(STORIES, snapshot / "sub" / "stories-Q8_0.gguf")
    with pyggml.LLM.from_pretrained("someone/stories-GGUF", "*F32.gguf", n_ctx=64) as llm:
        assert llm.model_path == str(snapshot / "stories-F32.gguf") and llm.num_ctx == 64
    with pyggml.LLM.from_pretrained("someone/stories-GGUF", "sub/stories-Q8_0.gguf") as llm:
        assert llm.model_path.endswith("stories-Q8_0.gguf")
    with pytest.raises(FileNotFoundError, match="matches several cached files.*stories-F32.gguf, sub/stories-Q8_0"):
        pyggml.LLM.from_pretrained("someone/stories-GGUF", "*.gguf")
    with pytest.raises(FileNotFoundError, match="no file .* matches '\\*Q4_K_M.gguf'; cached: .*never downloads"):
        pyggml.LLM.from_pretrained("someone/stories-GGUF", "*Q4_K_M.gguf")
    with pytest.raises(FileNotFoundError, match="no GGUF file in the Hugging Face cache.*never downloads"):
        pyggml.LLM.from_pretrained("nobody/nothing", "x.gguf")
    with pytest.raises(TypeError, match="local_dir not supported"):
        pyggml.LLM.from_pretrained("someone/stories-GGUF", "*F32.gguf", local_dir="x")


def test_chat_completion_with_an_image_is_chat_with_that_image(tmp_path):
    from .hf_fixtures import png
    from .test_gguf_counts import base_file

    url = "data:image/png;base64," + base64.b64encode(png(0, (20, 18))).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    with pyggml.load(base_file(tmp_path, "gemma3-vision"), n_ctx=512) as llm:
        want = llm.chat(messages, max_tokens=6, temperature=0)
        got = llm.create_chat_completion(messages, max_tokens=6, temperature=0)["choices"][0]["message"]["content"]
        assert got == want and llm.stats.prompt_tokens + llm.stats.cached_tokens > 20  # the image tokens were read
