"""Per-request prompt lookup (speculative decoding with n-gram drafts) through the server: Ollama
``options.prompt_lookup`` and OpenAI's extension field ``prompt_lookup`` (``extra_body`` in the
official client) give the same greedy output as plain decoding, report the drafted/accepted counts
(OpenAI ``usage.completion_tokens_details``), and bad values are a 400."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from ._server import running_server  # noqa: E402
from .conftest import SHARED_MODELS  # noqa: E402

STORIES = SHARED_MODELS / "stories260K.gguf"
PROMPT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
          "One day, Lily saw a big red ball in the park. Lily said, ")


@pytest.fixture(scope="module")
def server():
    if not STORIES.exists():
        pytest.skip(f"{STORIES} is absent")
    with running_server(STORIES, parallel=2, num_ctx=512) as running:
        yield running


def _post(base: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(base + route, json={"stream": False, "model": "stories260K", **body}, timeout=120)


def test_openai_prompt_lookup_is_greedy_equivalent(server):
    base, served = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
    no_eog = {str(t): -100 for t in served.tokenizer.vocab.eog}
    kwargs = dict(model=served.name, prompt=PROMPT, max_tokens=80, temperature=0, logit_bias=no_eog)
    plain = client.completions.create(**kwargs)
    spec = client.completions.create(**kwargs, extra_body={"prompt_lookup": 5})
    assert spec.choices[0].text == plain.choices[0].text and spec.usage.completion_tokens == 80
    details = spec.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens >= 0
    assert plain.usage.completion_tokens_details is None  # nothing drafted
    streamed = client.completions.create(**kwargs, stream=True, extra_body={"prompt_lookup": 3})
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text
    messages = [{"role": "user", "content": PROMPT}]
    chat = [client.chat.completions.create(model=served.name, messages=messages, max_tokens=60, temperature=0,
                                           logit_bias=no_eog, **extra).choices[0].message.content
            for extra in ({}, {"extra_body": {"prompt_lookup": 4}})]
    assert chat[0] == chat[1]


def test_ollama_prompt_lookup_is_greedy_equivalent(server, monkeypatch):
    base, served = server
    client = ollama.Client(host=base, timeout=120)
    seen = []  # the requests the runner gets, and how much they drafted
    completion = served.runner.completion

    def spy(request):
        stream = completion(request)
        seen.append((request.prompt_lookup, stream))
        return stream

    monkeypatch.setattr(served.runner, "completion", spy)
    answers = [client.generate(model="stories260K", prompt=PROMPT, raw=True,
                               options={"temperature": 0, "num_predict": 80, **extra})
               for extra in ({}, {"prompt_lookup": 6}, {"prompt_lookup": 0})]
    assert answers[0].response == answers[1].response == answers[2].response
    assert answers[0].eval_count == answers[1].eval_count
    assert [n for n, _ in seen] == [0, 6, 0]
    assert seen[1][1]._seq.draft_tokens > 0 or answers[1].eval_count < 5  # it drafted (unless it ended at once)
    chat = [client.chat(model="stories260K", messages=[{"role": "user", "content": PROMPT}],
                        options={"temperature": 0, "num_predict": 60, **extra}).message.content
            for extra in ({}, {"prompt_lookup": 2})]
    assert chat[0] == chat[1]


@pytest.mark.parametrize("value", [-1, 33, "4", True, 2.5])
def test_bad_prompt_lookup_is_a_400(server, value):
    base, _ = server
    for route, body in (("/v1/completions", {"prompt": "a", "prompt_lookup": value}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                                  "prompt_lookup": value}),
                        ("/api/generate", {"prompt": "a", "options": {"prompt_lookup": value}}),
                        ("/api/chat", {"messages": [{"role": "user", "content": "a"}],
                                       "options": {"prompt_lookup": value}})):
        response = _post(base, route, body)
        assert response.status_code == 400, (route, response.text)
        assert "prompt_lookup" in response.text
