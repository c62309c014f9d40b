"""Structured output through the server: Ollama ``format`` (JSON / schema), OpenAI ``response_format``
(json_object / json_schema) and pyggml's ``grammar`` field, with the official clients, streaming and
not; invalid schemas and grammars are a 400 carrying llguidance's message."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("llguidance", reason="constrained decoding needs llguidance")
httpx = pytest.importorskip("httpx")
ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from .test_server import STORIES, openai_client, running_server  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                            "ok": {"type": "boolean"}}, "required": ["name", "ok"]}


@pytest.fixture(scope="module")
def server():
    if not STORIES.exists():
        pytest.skip(f"{STORIES} is absent")
    with running_server(STORIES, parallel=2, queue=8) as running:
        yield running


def check(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"name", "ok"} and isinstance(value["ok"], bool) and len(value["name"]) <= 8


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_format(server, stream):
    base, _ = server
    client = ollama.Client(host=base, timeout=60)
    for fmt, seed in (("json", 1), (SCHEMA, 2)):
        options = {"temperature": 1.0, "seed": seed, "num_predict": 200}
        if stream:
            text = "".join(p.response for p in client.generate(model="stories260K", prompt="Once", format=fmt,
                                                                  options=options, stream=True))
        else:
            text = client.generate(model="stories260K", prompt="Once", format=fmt, options=options).response
        if fmt is SCHEMA:
            check(text)
    reply = client.chat(model="stories260K", messages=[{"role": "user", "content": "hi"}], format=SCHEMA,
                        options={"temperature": 0.7, "seed": 3, "num_predict": 200})
    check(reply.message.content)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_response_format(server, stream):
    base, served = server
    client = openai_client(base)
    formats = [{"type": "json_object"},
               {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}]
    for i, response_format in enumerate(formats):
        kwargs = dict(model=served.name, messages=[{"role": "user", "content": "Tell me"}], max_tokens=200,
                      temperature=1.0, seed=i, response_format=response_format)
        if stream:
            chunks = list(client.chat.completions.create(**kwargs, stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            reply = client.chat.completions.create(**kwargs)
            text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
        if i:  # the schema bounds the output
            assert finish == "stop"
            check(text)
        elif finish == "stop":  # any JSON value may be longer than max_tokens
            json.loads(text)


def test_grammar_extension(server):
    base, served = server
    client = openai_client(base)
    done = client.completions.create(model=served.name, prompt="Once", max_tokens=50, temperature=1.0, seed=4,
                                     extra_body={"grammar": {"regex": "(red|blue) [0-9]{3}"}})
    assert re.fullmatch(r"(red|blue) [0-9]{3}", done.choices[0].text)
    body = {"model": "stories260K", "prompt": "Once", "stream": False, "grammar": 'root ::= "x" [a-c]{2} "."',
            "options": {"temperature": 1.0, "seed": 5}}
    response = httpx.post(f"{base}/api/generate", json=body, timeout=60).json()["response"]
    assert re.fullmatch(r"x[a-c]{2}\.", response)


LOOP = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}  # a -> b -> a


@pytest.mark.parametrize("path,body,words", [
    ("/api/generate", {"prompt": "a", "format": {"type": "object", "properties": {"a": {"type": "strin"}}}},
     "Invalid type: strin"),
    ("/api/chat", {"messages": [{"role": "user", "content": "a"}], "format": {"type": "string", "format": "nope"}},
     "Unknown format: nope"),
    ("/api/generate", {"prompt": "a", "grammar": "start: missing_rule"}, "missing_rule"),
    ("/api/generate", {"prompt": "a", "grammar": {"regex": "[a-"}}, "unclosed character class"),
    ("/api/generate", {"prompt": "a", "format": "json", "grammar": "start: \"a\""}, "not both"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "items": {"type": 3}}}}},
     "json_schema"),
    ("/v1/completions", {"prompt": "a", "grammar": {"yaml": "x"}}, "grammar must be"),
    # issue 25 item 9: valid, but no output matches (they answered 500, or an empty non-JSON 200)
    ("/api/generate", {"prompt": "a", "format": LOOP}, "matches no output"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": LOOP}}}, "matches no output"),
    ("/api/generate", {"prompt": "a", "grammar": 'start: start "a"'}, "matches no output"),
    ("/v1/completions", {"prompt": "a", "grammar": {"regex": "[^\\x00-\\U0010ffff]"}}, "matches no output"),
])
def test_invalid_grammars_are_400(server, path, body, words):
    base, _ = server
    response = httpx.post(f"{base}{path}", json={"model": "stories260K", **body}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in (error["message"] if path.startswith("/v1/") else error)

