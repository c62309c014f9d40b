"""The ASGI app (Starlette) and ``serve()``: one model (or several, loaded on demand by a
``ModelManager``), a Runner each, uvicorn in this process.

uvicorn runs in-process with one worker and no reloader: a worker forked after ggml has computed
would hang (see DESIGN.md); a model named on the command line is loaded once, before the server starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import socket
import sys
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from pyggml import models
from pyggml.backend import BackendParams
from pyggml.repl import params_to_options
from pyggml.runner import Runner
from pyggml.server import ollama, openai
from pyggml.server.guard import Guard
from pyggml.server.models import DEFAULT_KEEP_ALIVE, ModelManager, SingleModel, estimate_memory
from pyggml.server.params import APIError
from pyggml.server.service import QUEUE_TIMEOUT, ServedModel
from pyggml.store import ModelRef, check_has_weights
from pyggml.tiny import TINY_VERSION, cache_dir

log = logging.getLogger(__name__)


def create_app(served: ServedModel | ModelManager | SingleModel, *, bind_host: str = "127.0.0.1",
               allowed_hosts: Iterable[str] | None = None, origins: Iterable[str] = ()) -> Starlette:
    """The app serving ``served`` (one loaded model, or a ``ModelManager`` loading models by name):
    Ollama's ``/api``, OpenAI's ``/v1``, ``/health`` and ``/``, behind the Host/Origin/Content-Type
    checks of ``pyggml.server.guard`` (``bind_host`` is the address the server listens on: loopback
    allows local Host names only)."""
    routes = [
        Route("/", _root, methods=["GET", "HEAD"]),
        Route("/health", _health, methods=["GET"]),
        *ollama.routes,
        *openai.routes,
    ]
    manager = SingleModel(served) if isinstance(served, ServedModel) else served

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await manager.close()  # unloads what a ModelManager loaded

    guard = Middleware(Guard, bind_host=bind_host, allowed_hosts=allowed_hosts, origins=origins)
    app = Starlette(routes=routes, middleware=[guard], lifespan=lifespan,
                    exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _internal_error})
    app.state.models = manager
    if isinstance(manager, SingleModel):
        app.state.served = manager.served
    return app


async def _root(request: Request) -> Response:
    return PlainTextResponse("pyggml is running")  # Ollama's clients probe "/" for a 200


async def _health(request: Request) -> Response:
    return JSONResponse(request.app.state.models.health())


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


def serve(path: str | os.PathLike | None, *, host: str = "127.0.0.1", port: int = 11434, parallel: int = 4,
          queue: int | None = None, num_ctx: int | None = None, n_threads: int | None = None,
          batch_size: int = 512, name: str | None = None, log_level: str = "info",
          flash_attention: bool | None = None, max_predict: int | None = None,
          queue_timeout: float = QUEUE_TIMEOUT, allowed_hosts: Iterable[str] | None = None,
          origins: Iterable[str] = (), rpc: Sequence[str] | str = (),
          tensor_split: Sequence[float] | str | None = None, draft: str | os.PathLike | None = None,
          draft_max: int = 8, mmproj: str | os.PathLike | None = None, max_loaded: int | None = None,
          keep_alive: float | None = DEFAULT_KEEP_ALIVE, model_ref: ModelRef | None = None,
          poll: int = BackendParams.poll, adapt_threads: bool = BackendParams.adapt_threads) -> int:
    """Serve until interrupted (Ctrl-C / SIGTERM): the model at ``path`` (loaded first), or with
    ``path=None`` every model ``pyggml list`` finds, loaded on demand (``ModelManager``). The port
    is bound before anything is loaded or announced: a port in use fails at once. ``rpc``: remote
    devices (``pyggml rpc-server`` endpoints) that compute some of the layers. ``draft``: a smaller
    model with the same vocabulary for speculative decoding; ``mmproj``: a vision model's llama.cpp
    projector file (``draft`` and ``mmproj`` go with the model at ``path``). ``model_ref``: what
    ``pyggml.store`` found for ``path`` (an Ollama model's params, system message and aliases).
    ``poll``: the CPU threadpool's poll level (``BackendParams.poll``: 0 lets idle workers sleep at once,
    kinder to other busy processes on a machine serving a tiny model; see docs/server.md).
    ``adapt_threads``: compute with a thread fewer per core other processes keep busy
    (``BackendParams.adapt_threads``; False: always ``n_threads``)."""
    import uvicorn

    if path is None and (draft is not None or mmproj is not None):
        raise ValueError("--draft and --mmproj need a model to go with: name it (pyggml serve MODEL ...)")
    sock = bind(host, port)
    try:
        def load(ref: ModelRef, draft: str | os.PathLike | None = None,
                 mmproj: str | os.PathLike | None = None) -> ServedModel:
            check_has_weights(ref.path)
            params = BackendParams(n_threads=n_threads, flash_attention=flash_attention, rpc=rpc,
                                   tensor_split=tensor_split, poll=poll, adapt_threads=adapt_threads)
            try:  # an Ollama vision model's projector layer is its mmproj
                model = models.load(ref.path, params, mmproj=mmproj or ref.projector)
            except ValueError as exc:
                if mmproj is not None or ref.projector is None:
                    raise
                log.warning("%s: its projector cannot be used (%s); serving it without images", ref.name, exc)
                model = models.load(ref.path, params)
            draft_model = None
            try:
                if draft is not None:
                    draft_model = models.load(draft, BackendParams(n_threads=n_threads, poll=poll,
                                                                   adapt_threads=adapt_threads,
                                                                   flash_attention=flash_attention))
                trained = model.context_length or 4096
                runner = Runner(model, parallel=parallel, num_ctx=num_ctx or min(4096, trained),
                                batch_size=batch_size, draft=draft_model, draft_max=draft_max)
                try:
                    served = ServedModel(runner, ref.path, queue=queue, name=ref.name, max_predict=max_predict,
                                         queue_timeout=queue_timeout)
                    served.aliases.update(ref.aliases)
                    served.defaults, served.system = params_to_options(ref.params), ref.system
                    served.draft = draft_model
                    return served
                except BaseException:
                    runner.close()
                    raise
            except BaseException:
                model.close()
                if draft_model is not None:
                    draft_model.close()
                raise

        if path is None:
            if max_loaded is None:  # Ollama: 1 model at a time on a CPU, 3 per GPU
                from pyggml.backend import devices

                max_loaded = 3 if any(d.kind in ("gpu", "igpu") for d in devices()) else 1
            tokens = parallel * (num_ctx or 4096)  # the KV cache one model will hold (at most)
            served = ModelManager(load, max_loaded=max_loaded, keep_alive=keep_alive,
                                  memory_needed=lambda ref: estimate_memory(ref, tokens))
            idle = "kept loaded" if keep_alive is None else f"unloaded after {keep_alive:g} s idle"
            what = (f"the {len(served.catalog())} models `pyggml list` finds, loaded on demand (at most "
                    f"{max_loaded} at a time, {idle})")
        else:
            if name is None and Path(path) == cache_dir() / f"pyggml-tiny-random-v{TINY_VERSION}.gguf":
                name = "demo"  # `pyggml serve demo`: clients ask for it by that name
            ref = model_ref or ModelRef(name or Path(path).stem, Path(path), "file")
            if name is not None:
                ref = dataclasses.replace(ref, name=name)
            served = load(ref, draft, mmproj)
            what = (f"{served.name} ({served.runner.parallel} sequences of {served.runner.num_ctx} tokens, "
                    f"{served.queue_limit} more may wait up to {served.queue_timeout:g} s, at most "
                    f"{served.max_predict} tokens each)")
        try:
            app = create_app(served, bind_host=host, allowed_hosts=allowed_hosts, origins=origins)
            config = uvicorn.Config(app, workers=1, log_level=log_level, timeout_graceful_shutdown=5)
            print(f"pyggml: serving {what} on http://{_url_host(host)}:{sock.getsockname()[1]}", file=sys.stderr)
            uvicorn.Server(config).run(sockets=[sock])
        finally:
            if isinstance(served, ServedModel):
                served.close()
    finally:
        sock.close()
    return 0


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (``OSError`` with a message that says what to do)."""
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535, got {port!r}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise OSError(f"cannot listen on {host!r}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        # listening now: a client that connects as soon as the URL is announced waits in the backlog until
        # uvicorn accepts, instead of being refused (seen as a flaky 'connection refused' in the tests)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise OSError(f"port {port} on {host} is already in use (another server is running there?); "
                          "choose another with --port") from None
        if exc.errno == errno.EACCES:
            raise OSError(f"no permission to listen on port {port} (ports below 1024 need privileges); "
                          "choose another with --port") from None
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
