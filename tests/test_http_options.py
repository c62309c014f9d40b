"""The HTTP request options have their effect, on every route that accepts them.

- ``stop`` (OpenAI and Ollama): the text ends right before the stop string, finish reason "stop";
- ``seed`` (OpenAI and Ollama): a sampled request gives the same text for the same seed and a
  different text for a different seed;
- ``num_keep`` (Ollama): after the context shifts, the model sees the first ``num_keep`` prompt tokens
  plus the newer half, exactly: every reported top logprob equals a from-scratch computation of that
  token list (a one-layer model, see test_shift_e2e.py).

Each is a check of the *effect*: a server that accepted the field and dropped it fails them.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import pyggml

from ._models import (
    CONCAT_TEMPLATE,
    ROPE_FREQS,
    cache_states,
    letters_llama,
    letters_to_ids,
    log_softmax,
    with_chat_template,
)
from ._server import finish_of, post, running_server, text_of
from .conftest import SHARED_MODELS

pytest.importorskip("starlette", reason="the server tests need: pip install '.[server]'")
pytest.importorskip("uvicorn", reason="the server tests need: pip install '.[server]'")
pytest.importorskip("httpx", reason="the server tests need httpx")

STORIES = SHARED_MODELS / "stories260K.gguf"
ROUTES = ["/v1/completions", "/v1/chat/completions", "/api/generate", "/api/chat"]
# a multi-turn template for stories260K (a trained model without one)
STORY_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% else %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
MESSAGES = [{"role": "system", "content": "A story for children."},
            {"role": "user", "content": "Once upon a time"}]


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    if not STORIES.exists():
        pytest.skip(f"{STORIES} is absent")
    path = with_chat_template(STORIES, tmp_path_factory.mktemp("http") / "stories-chat.gguf", STORY_TEMPLATE)
    with running_server(path, parallel=2, num_ctx=256) as server:
        yield server


def ask(server: tuple, route: str, n: int, **options) -> dict:
    """One non-streamed request to ``route`` with sampling ``options`` put where that API wants them."""
    if route.startswith("/v1/"):
        body = {"max_tokens": n, **options}
    else:
        body = {"options": {"num_predict": n, **options}}
    if route.endswith("chat/completions") or route == "/api/chat":
        body["messages"] = MESSAGES
    else:
        body["prompt"] = "Once upon a time"
    return post(server, route, body)


@pytest.mark.parametrize("route", ROUTES)
def test_stop_string_ends_the_text(stories, route):
    whole = text_of(route, ask(stories, route, 40, temperature=0))
    # the first word of 3+ letters starting after the 5th character, at its first occurrence
    stop = next(m.group() for m in re.finditer(r"[A-Za-z]{3,}", whole) if m.start() >= 5
                and whole.index(m.group()) == m.start())
    answer = ask(stories, route, 40, temperature=0, stop=[stop])
    assert text_of(route, answer) == whole[:whole.index(stop)], f"stop {stop!r} in {whole!r}"
    assert finish_of(route, answer) == "stop"
    single = ask(stories, route, 40, temperature=0, stop=stop) if route.startswith("/v1/") else answer
    assert text_of(route, single) == whole[:whole.index(stop)]  # OpenAI also takes one string


@pytest.mark.parametrize("route", ROUTES)
def test_same_seed_same_text_and_another_seed_another_text(stories, route):
    sampled = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
    a = text_of(route, ask(stories, route, 30, seed=11, **sampled))
    b = text_of(route, ask(stories, route, 30, seed=11, **sampled))
    c = text_of(route, ask(stories, route, 30, seed=12, **sampled))
    assert a == b, "the same seed gave two texts"
    assert a != c, "two seeds gave the same 30-token sampled text"


# ---- num_keep -----------------------------------------------------------------------------------

NUM_CTX = 32
NUM_KEEP = 8  # not the default 4
PROMPT = "thequickbrownfox"
# measured: max |logprob - reference| 3.1e-5 (F32 cache; see test_shift_e2e.py)
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def letters(tmp_path_factory):
    path = letters_llama(tmp_path_factory.mktemp("http") / "letters.gguf", rope_freqs=ROPE_FREQS,
                         chat_template=CONCAT_TEMPLATE)
    with pyggml.load(path, n_threads=1, num_ctx=128, cache_type="f32") as reference, \
            running_server(path, parallel=1, num_ctx=NUM_CTX, cache_type="f32") as server:
        yield server, reference


@pytest.mark.parametrize("route", ["/api/generate", "/api/chat"])
def test_num_keep_survives_a_context_shift(letters, route):
    server, reference = letters
    body = {"logprobs": True, "top_logprobs": 5,
            "options": {"temperature": 0, "num_predict": 40, "num_keep": NUM_KEEP}}
    if route == "/api/generate":
        body.update(prompt=PROMPT, raw=True)
    else:  # the template concatenates the contents: the same prompt
        body["messages"] = [{"role": "user", "content": "thequick"}, {"role": "assistant", "content": "brown"},
                            {"role": "user", "content": "fox"}]
    answer = post(server, route, body)
    prompt = reference.tokenize(PROMPT)
    generated = letters_to_ids(text_of(route, answer))
    if route == "/api/generate":
        assert answer["context"] == prompt + generated
    assert len(generated) == len(answer["logprobs"]) == 40 and answer["prompt_eval_count"] == len(prompt)
    states, shifts = cache_states(prompt, generated, NUM_CTX, NUM_KEEP)
    assert shifts >= 2
    for i, (state, reported) in enumerate(zip(states, answer["logprobs"], strict=True)):
        got = sorted((e["logprob"] for e in reported["top_logprobs"]), reverse=True)
        expected = np.sort(log_softmax(reference.logits(state)[-1]))[::-1][:5]
        np.testing.assert_allclose(got, expected, rtol=0, atol=LOGPROB_TOL,
                                   err_msg=f"token {i}: the cache held {len(state)} tokens, the first "
                                           f"{NUM_KEEP} of the prompt kept")
