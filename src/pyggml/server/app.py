"""The ASGI app (Starlette) and ``serve()``: one model (or several, loaded on demand by a
``ModelManager``), an engine each (``open_engine``), uvicorn in this process.

uvicorn runs in-process with one worker and no reloader: a worker forked after ggml has computed
would hang (ggml's thread pool does not survive a fork); a model named on the command line is loaded
once, before the server starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import socket
import sys
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from pyggml.repl import params_to_options
from pyggml.runner.config import DEFAULT_CONTEXT, EngineConfig, close_engine, open_engine
from pyggml.server import anthropic, manage, ollama, openai, rerank, responses
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
    Ollama's ``/api``, OpenAI's ``/v1`` (with Responses), Anthropic's ``/v1/messages``, ``/health`` and
    ``/``, behind the Host/Origin/Content-Type checks of ``pyggml.server.guard`` (``bind_host`` is the
    address the server listens on: loopback allows local Host names only)."""
    routes = [
        Route("/", _root, methods=["GET", "HEAD"]),
        Route("/health", _health, methods=["GET"]),
        *ollama.routes,
        *manage.routes,
        *openai.routes,
        *anthropic.routes,
        *responses.routes,
        *rerank.routes,
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
    if request.url.path.startswith("/v1/messages"):
        return anthropic.error_response(exc)
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


@dataclass
class ServerConfig:
    """How ``serve`` answers: where it listens, who may ask, how requests queue, and (without a model of
    its own) which models it loads on demand."""

    host: str = "127.0.0.1"
    port: int = 11434
    name: str | None = None  # the model's name for clients (default: the file's stem)
    model_ref: ModelRef | None = None  # what pyggml.store found for the model (an Ollama model's params, aliases)
    queue: int | None = None  # requests that may wait for a free sequence (default: ServedModel's)
    queue_timeout: float = QUEUE_TIMEOUT
    max_predict: int | None = None  # most tokens one request may generate
    allowed_hosts: Iterable[str] | None = None
    origins: Iterable[str] = ()
    max_loaded: int | None = None  # without a model: most models loaded at once (default: 1 on CPU, 3 with a GPU)
    keep_alive: float | None = DEFAULT_KEEP_ALIVE  # without a model: seconds an idle model stays loaded
    # with a model: seconds it stays loaded idle (None: for ever); either way a request's keep_alive counts
    # (0 unloads it after the request) and the next request loads it again
    model_keep_alive: float | None = None
    log_level: str = "info"


def serve(engine: EngineConfig | str | os.PathLike | None, server: ServerConfig | None = None, **options: Any) -> int:
    """Serve until interrupted (Ctrl-C / SIGTERM) the engine ``engine`` describes: its model (loaded
    first), or with no model (``None``) every model ``pyggml list`` finds, loaded on demand
    (``ModelManager``), each opened with ``engine``'s options. ``engine`` may be a path (or None) and
    ``options`` the fields of ``EngineConfig``, ``BackendParams`` and ``ServerConfig`` by name. The port
    is bound before anything is loaded or announced: a port in use fails at once. See ``EngineConfig``
    for ``draft`` and ``mmproj`` (they go with the named model) and ``BackendParams`` for ``rpc``,
    ``poll`` and ``adapt_threads`` (docs/server.md)."""
    import uvicorn

    engine, server = _configs(engine, server, options)
    if engine.model is None and (engine.draft is not None or engine.mmproj is not None):
        raise ValueError("--draft and --mmproj need a model to go with: name it (pyggml serve MODEL ...)")
    sock = bind(server.host, server.port)
    try:
        def load(ref: ModelRef) -> ServedModel:
            """``ref`` served by the engine ``engine`` describes (an Ollama model's projector layer is its
            mmproj, dropped with a warning when it cannot be used)."""
            check_has_weights(ref.path)
            stored_ctx = ref.params.get("num_ctx")  # a stored model's PARAMETER num_ctx, unless --ctx says
            num_ctx = engine.num_ctx or (stored_ctx if isinstance(stored_ctx, int) and stored_ctx > 1 else None)
            runner = open_engine(dataclasses.replace(engine, model=ref.path, mmproj=engine.mmproj or ref.projector,
                                                     mmproj_optional=engine.mmproj is None, num_ctx=num_ctx))
            try:
                served = ServedModel(runner, ref.path, queue=server.queue, name=ref.name,
                                     max_predict=server.max_predict, queue_timeout=server.queue_timeout)
                served.aliases.update(ref.aliases)
                served.defaults, served.system, served.ref = params_to_options(ref.params), ref.system, ref
                served.draft = runner.drafter.model if runner.drafter is not None else None
                return served
            except BaseException:
                close_engine(runner)
                raise

        tokens = engine.parallel * (engine.num_ctx or DEFAULT_CONTEXT)  # the KV cache one model holds (at most)
        if engine.model is None:
            max_loaded = server.max_loaded
            if max_loaded is None:  # Ollama: 1 model at a time on a CPU, 3 per GPU
                from pyggml.backend.hardware import devices

                max_loaded = 3 if any(d.kind in ("gpu", "igpu") for d in devices()) else 1
            served = ModelManager(load, max_loaded=max_loaded, keep_alive=server.keep_alive,
                                  memory_needed=lambda ref: estimate_memory(ref, tokens))
            idle = "kept loaded" if server.keep_alive is None else f"unloaded after {server.keep_alive:g} s idle"
            what = (f"the {len(served.catalog())} models `pyggml list` finds, loaded on demand (at most "
                    f"{max_loaded} at a time, {idle})")
        else:
            path, name = Path(engine.model), server.name
            if name is None and path == cache_dir() / f"pyggml-tiny-random-v{TINY_VERSION}.gguf":
                name = "demo"  # `pyggml serve demo`: clients ask for it by that name
            ref = server.model_ref or ModelRef(name or path.stem, path, "file")
            if name is not None:
                ref = dataclasses.replace(ref, name=name)
            model = load(ref)
            what = (f"{model.name} ({model.runner.parallel} sequences of {model.runner.num_ctx} tokens, "
                    f"{model.queue_limit} more may wait up to {model.queue_timeout:g} s, at most "
                    f"{model.max_predict} tokens each)")
            # a manager of this one model: a request's keep_alive unloads it, the next request loads it again
            ref = dataclasses.replace(ref, aliases=tuple(sorted(model.aliases - {ref.name})))
            served = ModelManager(load, catalog=lambda: [ref], keep_alive=server.model_keep_alive,
                                  memory_needed=lambda ref: estimate_memory(ref, tokens))
            served.adopt(ref, model)
        try:
            app = create_app(served, bind_host=server.host, allowed_hosts=server.allowed_hosts,
                             origins=server.origins)
            config = uvicorn.Config(app, workers=1, log_level=server.log_level, timeout_graceful_shutdown=5)
            print(f"pyggml: serving {what} on http://{_url_host(server.host)}:{sock.getsockname()[1]}",
                  file=sys.stderr)
            uvicorn.Server(config).run(sockets=[sock])
        finally:
            import asyncio

            asyncio.run(served.close())  # what the app's shutdown has not closed (it did not start, say)
    finally:
        sock.close()
    return 0


def _configs(engine: EngineConfig | str | os.PathLike | None, server: ServerConfig | None,
             options: dict[str, Any]) -> tuple[EngineConfig, ServerConfig]:
    """``serve``'s two configurations: as given, or from a path and flat options named like their fields."""
    server_names = {f.name for f in dataclasses.fields(ServerConfig)}
    if server is None:
        server = ServerConfig(**{k: v for k, v in options.items() if k in server_names})
    elif server_names & set(options):
        raise TypeError(f"serve: {', '.join(sorted(server_names & set(options)))} given twice (server= and options)")
    rest = {k: v for k, v in options.items() if k not in server_names}
    if isinstance(engine, EngineConfig):
        if rest:
            raise TypeError(f"serve: options {', '.join(sorted(rest))} beside an EngineConfig; set them in it")
        return engine, server
    return EngineConfig.from_options(engine, **rest), server


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
