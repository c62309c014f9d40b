"""The ASGI app (Starlette) and ``serve()``: one model, one Runner, uvicorn in this process.

uvicorn runs in-process with one worker and no reloader: a worker forked after ggml has computed
would hang (see DESIGN.md), and the model is loaded once, before the server starts.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from pyggml import models
from pyggml.backend import BackendParams
from pyggml.runner import Runner
from pyggml.server import ollama, openai
from pyggml.server.guard import Guard
from pyggml.server.params import APIError
from pyggml.server.service import QUEUE_TIMEOUT, ServedModel
from pyggml.tiny import TINY_VERSION, cache_dir

log = logging.getLogger(__name__)


def create_app(served: ServedModel, *, bind_host: str = "127.0.0.1", allowed_hosts: Iterable[str] | None = None,
               origins: Iterable[str] = ()) -> Starlette:
    """The app serving ``served``: Ollama's ``/api``, OpenAI's ``/v1``, ``/health`` and ``/``,
    behind the Host/Origin/Content-Type checks of ``pyggml.server.guard`` (``bind_host`` is the
    address the server listens on: loopback allows local Host names only)."""
    routes = [
        Route("/", _root, methods=["GET", "HEAD"]),
        Route("/health", _health, methods=["GET"]),
        *ollama.routes,
        *openai.routes,
    ]
    guard = Middleware(Guard, bind_host=bind_host, allowed_hosts=allowed_hosts, origins=origins)
    app = Starlette(routes=routes, middleware=[guard],
                    exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _internal_error})
    app.state.served = served
    return app


async def _root(request: Request) -> Response:
    return PlainTextResponse("pyggml is running")  # Ollama's clients probe "/" for a 200


async def _health(request: Request) -> Response:
    return JSONResponse(request.app.state.served.health())


def _error(request: Request, exc: APIError) -> Response:
    if request.url.path.startswith("/v1/"):
        return openai.error_response(exc)
    return JSONResponse({"error": exc.message}, status_code=exc.status, headers=exc.headers)


async def _api_error(request: Request, exc: Exception) -> Response:
    return _error(request, exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (no such route, wrong method) as JSON too."""
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return _error(request, APIError(exc.status_code, message, headers=exc.headers))


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("error serving %s %s", request.method, request.url.path, exc_info=exc)
    return _error(request, APIError(500, f"internal error: {type(exc).__name__}: {exc}"))


def serve(path: str | os.PathLike, *, host: str = "127.0.0.1", port: int = 11434, parallel: int = 4,
          queue: int | None = None, num_ctx: int | None = None, n_threads: int | None = None,
          batch_size: int = 512, name: str | None = None, log_level: str = "info",
          flash_attention: bool | None = None, max_predict: int | None = None,
          queue_timeout: float = QUEUE_TIMEOUT, allowed_hosts: Iterable[str] | None = None,
          origins: Iterable[str] = (), rpc: Sequence[str] | str = (),
          tensor_split: Sequence[float] | str | None = None, draft: str | os.PathLike | None = None,
          draft_max: int = 8, mmproj: str | os.PathLike | None = None) -> int:
    """Load the model and serve it until interrupted (Ctrl-C / SIGTERM). ``rpc``: remote devices
    (``pyggml rpc-server`` endpoints) that compute some of the layers. ``draft``: a smaller model with the same
    vocabulary for speculative decoding; ``mmproj``: a vision model's llama.cpp projector file."""
    import uvicorn

    if name is None and Path(path) == cache_dir() / f"pyggml-tiny-random-v{TINY_VERSION}.gguf":
        name = "demo"  # `pyggml serve demo`: clients ask for it by that name
    model = models.load(path, BackendParams(n_threads=n_threads, flash_attention=flash_attention, rpc=rpc,
                                                tensor_split=tensor_split), mmproj=mmproj)
    draft_model = None
    try:
        if draft is not None:
            draft_model = models.load(draft, BackendParams(n_threads=n_threads, flash_attention=flash_attention))
        trained = model.context_length or 4096
        runner = Runner(model, parallel=parallel, num_ctx=num_ctx or min(4096, trained), batch_size=batch_size,
                        draft=draft_model, draft_max=draft_max)
        try:
            served = ServedModel(runner, path, queue=queue, name=name, max_predict=max_predict,
                                 queue_timeout=queue_timeout)
            app = create_app(served, bind_host=host, allowed_hosts=allowed_hosts, origins=origins)
            config = uvicorn.Config(app, host=host, port=port, workers=1, log_level=log_level,
                                    timeout_graceful_shutdown=5)
            print(f"pyggml: serving {served.name} ({runner.parallel} sequences of {runner.num_ctx} tokens, "
                  f"{served.queue_limit} more may wait up to {served.queue_timeout:g} s, at most "
                  f"{served.max_predict} tokens each) on http://{host}:{port}", file=sys.stderr)
            uvicorn.Server(config).run()
        finally:
            runner.close()
    finally:
        model.close()
        if draft_model is not None:
            draft_model.close()
    return 0
