"""A pyggml server in this process on 127.0.0.1 (uvicorn in a thread) for the HTTP tests, and plain
JSON calls to it (httpx: exactly the bodies the tests mean, no client library defaults)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from pyggml import BackendParams, models
from pyggml.runner import Runner


@contextlib.contextmanager
def serving(app, *, sndbuf: int | None = None, on_exit=None):
    """The base URL of ``app`` served by uvicorn in a thread on a free 127.0.0.1 port, until exit.
    ``sndbuf``: the send buffer of the connections it accepts; ``on_exit()`` runs before the server
    thread is joined (closing a runner ends whatever still streams, so the shutdown does not wait)."""
    import uvicorn

    sock = socket.socket()
    if sndbuf is not None:  # accepted sockets inherit it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        if on_exit is not None:
            on_exit()
        thread.join(20)
        sock.close()


@contextlib.contextmanager
def running_server(path, *, parallel: int = 2, num_ctx: int = 256, cache_type: str = "f16", queue: int = 16):
    """(base_url, served) of a server on a free port; stopped and unloaded on exit."""
    from pyggml.server import ServedModel, create_app

    model = models.load(path, BackendParams(n_threads=1))
    runner = Runner(model, parallel=parallel, num_ctx=num_ctx, batch_size=64, cache_type=cache_type)
    served = ServedModel(runner, path, queue=queue)
    try:
        with serving(create_app(served), on_exit=runner.close) as base:
            yield base, served
    finally:
        runner.close()
        model.close()


def post(server: tuple, route: str, body: dict) -> dict:
    """POST a JSON body (never streamed, naming the served model) to ``server`` (from
    ``running_server``) and return the JSON answer; fails on a non-200 status."""
    import httpx

    base, served = server
    body = {"stream": False, "model": served.name, **body}
    response = httpx.post(base + route, json=body, timeout=120)
    assert response.status_code == 200, f"{route}: {response.status_code} {response.text}"
    return response.json()


@contextlib.contextmanager
def with_template(tmp_path_factory, template: str, num_ctx: int = 256):
    """(base_url, served, its own template) of a server of a tiny random model whose chat template is replaced by
    ``template`` (a format's markers: thinking, tool calls), for the formats' end-to-end tests."""
    pytest.importorskip("llguidance")
    pytest.importorskip("uvicorn")
    pytest.importorskip("httpx")
    from pyggml.chat import ChatTemplate
    from pyggml.synthetic import write_synthetic

    path = write_synthetic(tmp_path_factory.mktemp("templated") / "tiny.gguf", "tiny", "f32")
    with running_server(path, parallel=1, num_ctx=num_ctx) as (base, served):
        plain = served.template
        served.template = ChatTemplate(template)
        try:
            yield base, served, plain
        finally:
            served.template = plain


def image_through_generate_and_chat(server: tuple, b64: str) -> tuple[dict, dict]:
    """The served model lists "vision" (``/api/show``) and answers "what is this?" about the image ``b64`` (base64)
    through ``/api/generate`` and ``/api/chat`` (greedy, 3 tokens): both answers."""
    import httpx

    base, served = server
    show = httpx.post(base + "/api/show", json={"model": served.name}, timeout=30).json()
    assert "vision" in show["capabilities"]
    options = {"temperature": 0, "num_predict": 3}
    gen = post(server, "/api/generate", {"prompt": "what is this?", "images": [b64], "options": options})
    chat = post(server, "/api/chat", {"messages": [{"role": "user", "content": "what is this?", "images": [b64]}],
                                      "options": options})
    return gen, chat


def image_through_chat_completions(server: tuple, b64: str) -> dict:
    """The answer of ``/v1/chat/completions`` to "what is this?" and the image ``b64`` (a data URL; greedy, 3
    tokens)."""
    return post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}}]}],
        "max_tokens": 3, "temperature": 0})


def text_of(route: str, answer: dict) -> str:
    """The generated text of a non-streamed answer from any of the four generation routes."""
    if route == "/v1/completions":
        return answer["choices"][0]["text"]
    if route == "/v1/chat/completions":
        return answer["choices"][0]["message"]["content"]
    if route == "/api/generate":
        return answer["response"]
    return answer["message"]["content"]


def finish_of(route: str, answer: dict) -> str:
    return answer["choices"][0]["finish_reason"] if route.startswith("/v1/") else answer["done_reason"]
