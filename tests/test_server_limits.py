"""Server hardening (issue 13, items 5-11): a capped ``max_tokens``, a bounded wait for a sequence,
bounded stop lists, prompts refused by size before tokenizing, back-pressure on unread streams,
bounded chat templates, quiet disconnects, nested JSON, and the Host/Origin/Content-Type guard.

Every load test here is bounded and deterministic: long generations come from a random-weight
model with its end-of-generation tokens banned, and no assertion depends on how fast it runs
(timeouts only bound how long a failure takes to show)."""

from __future__ import annotations

import json
import logging
import socket
import time

import pytest

from pyggml.chat import MAX_TEMPLATE_OPS, ChatTemplate, ChatTemplateError
from pyggml.runner.sequence import MAX_STOP_CHARS, MAX_STOPS
from pyggml.synthetic import write_synthetic

from .test_server import httpx, long_stream, running_server, wait_idle


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("limits") / "tiny.gguf", "tiny", "f32")


@pytest.fixture(scope="module")
def guarded(tiny_path):
    """One sequence, one waiting request that may wait 1 s, a stream may stay unread 2 s, and
    connections with a small send buffer (an unread stream fills it in a few hundred tokens)."""
    with running_server(tiny_path, parallel=1, queue=1, num_ctx=128, sndbuf=4096, max_predict=100_000,
                        queue_timeout=1.0, stall_timeout=2.0) as server:
        yield server


def ban_eog(served) -> dict[str, float]:
    return {str(t): -100 for t in served.tokenizer.vocab.eog}


# ---- 5: max_predict and a bounded wait for a sequence ----------------------------------------------

def test_max_predict_caps_every_request(guarded, monkeypatch):
    base, served = guarded
    wait_idle(base)
    monkeypatch.setattr(served, "max_predict", 40)
    body = {"model": served.name, "prompt": "hello", "max_tokens": 10**12, "temperature": 0,
            "logit_bias": ban_eog(served)}
    done = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
    assert done["usage"]["completion_tokens"] == 40 and done["choices"][0]["finish_reason"] == "length"
    body = {"model": served.name, "prompt": "hello", "stream": False, "options": {"num_predict": 10**12}}
    assert httpx.post(f"{base}/api/generate", json=body, timeout=60).json()["eval_count"] <= 40


def test_the_default_max_predict_is_ten_contexts(tiny_path):
    with running_server(tiny_path, parallel=1, queue=0, num_ctx=128) as (base, served):
        assert served.max_predict == 1280 and httpx.get(f"{base}/health").json()["max_predict"] == 1280


def test_a_request_that_finds_no_free_sequence_in_time_gets_a_503(guarded):
    base, served = guarded
    wait_idle(base)
    with long_stream(base, served) as lines:  # holds the only sequence for 100,000 tokens
        start = time.monotonic()
        response = httpx.post(f"{base}/v1/completions", timeout=30,
                              json={"model": served.name, "prompt": "a", "max_tokens": 2})
        assert response.status_code == 503 and int(response.headers["retry-after"]) >= 1
        assert "no sequence became free within 1 s" in response.json()["error"]["message"]
        assert time.monotonic() - start >= 1.0
        assert httpx.get(f"{base}/health").json()["requests"] == 1  # its admission was returned
        next(lines)  # the long stream goes on
    wait_idle(base)
    response = httpx.post(f"{base}/v1/completions", json={"model": served.name, "prompt": "a", "max_tokens": 2},
                          timeout=30)
    assert response.status_code == 200


# ---- 6: stop lists ---------------------------------------------------------------------------------

def test_stop_lists_are_bounded(guarded):
    base, served = guarded
    too_many = [f"s{i}" for i in range(MAX_STOPS + 1)]
    too_long = "x" * (MAX_STOP_CHARS + 1)
    for path, body, stop_field in (
            ("/v1/completions", {"prompt": "a", "max_tokens": 1}, "stop"),
            ("/api/generate", {"prompt": "a", "stream": False, "options": {"num_predict": 1}}, "options")):
        for stop in (too_many, too_long):
            request = json.loads(json.dumps(body))
            target = request["options"] if stop_field == "options" else request
            target["stop"] = stop
            response = httpx.post(f"{base}{path}", json={"model": served.name, **request}, timeout=30)
            assert response.status_code == 400, response.text
            assert f"at most {MAX_STOPS if stop is too_many else MAX_STOP_CHARS}" in response.text
    fine = ["y" * MAX_STOP_CHARS] * MAX_STOPS
    response = httpx.post(f"{base}/v1/completions", timeout=30,
                          json={"model": served.name, "prompt": "a", "max_tokens": 4, "stop": fine})
    assert response.status_code == 200


def test_stop_matching_finds_what_a_full_scan_finds():
    """The automaton, fed a piece at a time with the text held back as the runner holds it, cuts
    where ``find_stop`` over the held text cuts and holds back what ``partial_stop`` says."""
    import random

    from pyggml.runner.sequence import StopMatcher, check_stops, find_stop, partial_stop

    rng = random.Random(13)
    for _ in range(20_000):
        stops = check_stops(["".join(rng.choice("abc") for _ in range(rng.randint(1, 5)))
                             for _ in range(rng.randint(1, 4))])
        matcher, held = StopMatcher(stops), ""
        for _ in range(rng.randint(1, 8)):
            piece = "".join(rng.choice("abc") for _ in range(rng.randint(0, 3)))
            cut = matcher.feed(piece, len(held))
            held += piece
            assert cut == find_stop(held, stops), (stops, held)
            if cut is not None:
                break
            assert matcher.partial == partial_stop(held, stops), (stops, held)
            held = held[len(held) - matcher.partial:]
    with pytest.raises(ValueError, match="stop must be"):
        check_stops([1])


# ---- 7: prompt size before tokenizing ----------------------------------------------------------------

def test_an_oversized_prompt_is_refused_before_it_is_tokenized(guarded, monkeypatch):
    base, served = guarded
    wait_idle(base)
    seen = []
    encode = served.tokenizer.encode

    def spy(text, *args, **kwargs):
        seen.append(len(text))
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(served.tokenizer, "encode", spy)
    huge = "word " * (served.max_prompt_bytes // 5 + 1)
    for path, body in (("/v1/completions", {"prompt": huge}), ("/api/generate", {"prompt": huge, "stream": False}),
                       ("/api/chat", {"messages": [{"role": "user", "content": huge}], "stream": False}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]})):
        response = httpx.post(f"{base}{path}", json={"model": served.name, **body}, timeout=30)
        assert response.status_code == 400 and "bytes does not fit the context of 128 tokens" in response.text
    assert all(n <= served.max_prompt_bytes for n in seen)  # nothing too long reached the tokenizer
    assert httpx.get(f"{base}/health").json()["requests"] == 0


# ---- 8: back-pressure ------------------------------------------------------------------------------

def test_an_unread_stream_pauses_its_sequence(tiny_path):
    from pyggml import BackendParams, models
    from pyggml.runner import CompletionRequest, Runner

    model = models.load(tiny_path, BackendParams(n_threads=1))
    try:
        with Runner(model, parallel=1, num_ctx=128) as runner:
            bias = {t: -100.0 for t in model.tokenizer.vocab.eog}
            stream = runner.completion(CompletionRequest("hello", max_tokens=60, temperature=0, logit_bias=bias))
            stream.set_max_backlog(3)
            assert not stream.wait(timeout=1.0)  # paused after 3 unread chunks: 60 tokens never come
            assert runner.active_sequences == 1
            chunks = list(stream)  # reading resumes it
            assert chunks[-1].done and chunks[-1].generated_tokens == 60 and chunks[-1].finish_reason == "length"
    finally:
        model.close()


def test_a_stream_nobody_reads_is_paused_then_cancelled(guarded):
    base, served = guarded
    wait_idle(base)
    body = json.dumps({"model": served.name, "prompt": "hello", "max_tokens": 100_000, "temperature": 0,
                       "stream": True, "logit_bias": ban_eog(served)}).encode()
    port = int(base.rsplit(":", 1)[1])
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect(("127.0.0.1", port))
    try:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 30
        while httpx.get(f"{base}/health").json()["slots_in_use"] == 0:  # it starts ...
            assert time.monotonic() < deadline, "the stream never started"
            time.sleep(0.05)
        # ... and, never read, stops holding its sequence long before 100,000 tokens
        assert wait_idle(base, timeout=120)["requests"] == 0
    finally:
        client.close()


# ---- 9: chat templates -----------------------------------------------------------------------------

RUNAWAY_TEMPLATES = [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "operations"),
    ("{% macro f(n) %}{% if n < 60 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}{% endmacro %}{{ f(0) }}", "operations"),
    ("{{ 'a' * 300000000 }}", "repetition"),
    ("{{ ([1] * 100000000) | length }}", "repetition"),
    ("{{ 2 ** 100000000 }}", "integer"),
    ("{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "characters"),
    ("{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "characters"),
    ("{{ 'a' | center(1000000000) }}", "center"),
    ("{{ 'a'.ljust(1000000000) }}", "padded"),
    ("{{ '%0999999999d' % 1 }}", "width"),
    ("{{ '{:>999999999}'.format(1) }}", "spec"),
    ("{{ ('a' * 100000).replace('a', 'b' * 100000) }}", "replaced"),
    ("{{ ('x' * 100000).join(range(100000) | map('string') | list) }}", "joined"),
    ("{% for i in range(1000) %}{{ 'a' * 100000 }}{% endfor %}", "output"),
    ("{{ ('\n' * 100000) | indent(100000) }}", "indented"),
]


@pytest.fixture
def few_ops(monkeypatch):
    """A lower operation limit, so that a runaway template meets it in milliseconds, far from the
    time limit however slow the machine."""
    from pyggml import chat

    monkeypatch.setattr(chat, "MAX_TEMPLATE_OPS", 10_000)


@pytest.mark.parametrize("source, words", RUNAWAY_TEMPLATES, ids=[w for _, w in RUNAWAY_TEMPLATES])
def test_a_runaway_chat_template_stops_at_its_limits(source, words, few_ops):
    with pytest.raises(ChatTemplateError) as info:
        ChatTemplate(source).render([{"role": "user", "content": "hi"}], max_chars=1 << 24)
    assert words in str(info.value)


def test_template_limits_leave_ordinary_templates_alone():
    source = ("{% for m in messages if m.role != 'system' %}{{ loop.index }}:{{ m['content'] | trim }}"
              "{% if loop.last %}.{% endif %}{% endfor %}{{ (tools or []) | tojson }}")
    messages = [{"role": "user" if i % 2 else "assistant", "content": f" m{i} "} for i in range(2000)]
    text = ChatTemplate(source).render(messages, tools=[{"type": "function"}])
    assert text.startswith("1:m0") and text.endswith('.[{"type": "function"}]')
    with pytest.raises(ChatTemplateError, match="output"):
        ChatTemplate(source).render(messages, max_chars=1000)
    assert MAX_TEMPLATE_OPS >= 100 * len(messages)  # the real limit, not few_ops's


def test_a_runaway_template_answers_400_and_returns_its_admission(guarded, monkeypatch, few_ops):
    base, served = guarded
    wait_idle(base)
    monkeypatch.setattr(served, "template", ChatTemplate(RUNAWAY_TEMPLATES[0][0]))
    body = {"model": served.name, "messages": [{"role": "user", "content": "hi"}], "stream": False}
    for _ in range(3):  # more than parallel + queue: each must have returned its admission
        response = httpx.post(f"{base}/api/chat", json=body, timeout=60)
        assert response.status_code == 400 and "operations" in response.text
    monkeypatch.setattr(served, "template", ChatTemplate(None))
    body["options"] = {"num_predict": 2}
    assert httpx.post(f"{base}/api/chat", json=body, timeout=60).status_code == 200


# ---- 10: disconnects and nested JSON ---------------------------------------------------------------

class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_a_non_streamed_client_that_disconnects_logs_nothing(guarded):
    base, served = guarded
    wait_idle(base)
    handler = _Records()
    loggers = [logging.getLogger(n) for n in ("pyggml.server.app", "uvicorn.error", "asyncio")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        for _ in range(2):
            with pytest.raises(httpx.TimeoutException):
                httpx.post(f"{base}/v1/completions", timeout=0.5,
                           json={"model": served.name, "prompt": "hello", "max_tokens": 100_000, "temperature": 0,
                                 "logit_bias": ban_eog(served)})
            wait_idle(base, timeout=60)
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    assert [r.getMessage() for r in handler.records] == []


def test_deeply_nested_json_is_a_400(guarded):
    base, _ = guarded
    for path in ("/api/generate", "/v1/chat/completions"):
        response = httpx.post(f"{base}{path}", content="[" * 100_000 + "]" * 100_000, timeout=30)
        assert response.status_code == 400 and "nested too deeply" in response.text


# ---- 11: Host, Origin, Content-Type, paths ----------------------------------------------------------

def test_cross_site_requests_are_refused(guarded):
    base, served = guarded
    generate = {"model": served.name, "prompt": "a", "stream": False, "options": {"num_predict": 1}}
    # DNS rebinding: a name that is not local
    assert httpx.get(f"{base}/api/version", headers={"Host": "attacker.example"}).status_code == 403
    for host in ("localhost:11434", "127.0.0.1", "app.localhost", "[::1]:80"):
        assert httpx.get(f"{base}/api/version", headers={"Host": host}).status_code == 200, host
    # a page on another site
    response = httpx.post(f"{base}/api/generate", json=generate, headers={"Origin": "https://attacker.example"})
    assert response.status_code == 403 and "Origin" in response.json()["error"]
    response = httpx.post(f"{base}/api/generate", json=generate, headers={"Origin": "http://localhost:3000"},
                          timeout=30)
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == "http://localhost:3000"
    preflight = httpx.options(f"{base}/v1/chat/completions", headers={
        "Origin": "http://127.0.0.1:8080", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,authorization"})
    assert preflight.status_code == 204 and "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "content-type,authorization"
    # bodies a form or a no-preflight fetch can send
    for kind in ("text/plain", "multipart/form-data; boundary=x"):
        response = httpx.post(f"{base}/api/generate", content=json.dumps(generate), headers={"Content-Type": kind})
        assert response.status_code == 415 and "application/json" in response.text
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    assert httpx.post(f"{base}/api/generate", content=json.dumps(generate), headers=form,
                      timeout=30).status_code == 200  # curl -d
    assert httpx.post(f"{base}/api/generate", content=json.dumps(generate),
                      headers={**form, "Origin": "http://localhost"}).status_code == 415
    # /api/show names the file, not where it lives
    shown = httpx.post(f"{base}/api/show", json={"model": served.name}).text
    assert str(served.path.parent) not in shown and served.path.name in shown


def _guarded_app(**options):
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from pyggml.server.guard import Guard

    async def ok(request):
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/", ok, methods=["GET", "POST"])], middleware=[Middleware(Guard, **options)])
    return TestClient(app, base_url="http://127.0.0.1")


@pytest.mark.parametrize("options, host, allowed", [
    ({}, "evil.example", False),
    ({}, "my.internal:8080", True),
    ({"bind_host": "0.0.0.0"}, "evil.example", True),  # Ollama: a server bound beyond loopback answers any name
    ({"bind_host": "0.0.0.0", "allowed_hosts": ["api.example"]}, "evil.example", False),
    ({"allowed_hosts": ["api.example"]}, "API.example:443", True),
    ({"allowed_hosts": ["*.example.com"]}, "a.b.example.com", True),
    ({"allowed_hosts": ["*.example.com"]}, "example.com.evil", False),
    ({"allowed_hosts": ["*"]}, "anything", True),
])
def test_host_allow_list(options, host, allowed):
    assert (_guarded_app(**options).get("/", headers={"Host": host}).status_code == 200) == allowed


@pytest.mark.parametrize("origins, origin, allowed", [
    ((), "http://localhost:5173", True),
    ((), "vscode-webview://abc", True),
    ((), "null", False),
    ((), "http://localhost.evil.example", False),
    ((), "http://localhost:80@evil.example", False),  # user info: the host is evil.example
    ((), "http://127.0.0.1:1@evil.example:80", False),
    (("https://*.myapp.com",), "https://evil.example/.myapp.com", False),
    (("https://*.myapp.com",), "https://evil.example#.myapp.com", False),
    (("https://*.myapp.com",), "https://chat.myapp.com", True),
    (("https://*.myapp.com",), "https://myapp.com.evil", False),
    (("*",), "https://anywhere.example", True),
])
def test_origin_allow_list(origins, origin, allowed):
    response = _guarded_app(origins=origins).get("/", headers={"Origin": origin})
    assert (response.status_code == 200) == allowed
    assert (response.headers.get("access-control-allow-origin") == origin) == allowed


def test_cli_serve_limits_and_guard_options():
    from pyggml.cli import _listen_address, build_parser

    args = build_parser().parse_args(["serve", "m.gguf", "--max-predict", "500", "--queue-timeout", "5",
                                      "--allowed-hosts", "a.example,b.example", "--origins", "https://x.example"])
    assert (args.max_predict, args.queue_timeout, args.allowed_hosts, args.origins) == \
        (500, 5.0, "a.example,b.example", "https://x.example")
    assert _listen_address("0.0.0.0:8080", None) == ("0.0.0.0", 8080)
    assert _listen_address("[::1]", None) == ("::1", 11434)
    assert _listen_address("http://localhost:7/", 9) == ("localhost", 9)
