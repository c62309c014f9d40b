"""The served model (names, facts, admission control) and ``Job``: one completion bridged from
the runner's blocking ``CompletionStream`` to the event loop.

The event loop never waits on the model. Each completion gets a thread that renders and
tokenizes its prompt, submits it to the ``Runner`` (whose own thread computes) and waits for its
admission; from then on the runner announces new chunks to the event loop itself (one wake-up per
forward pass for all streams, sent just before the next pass computes) and the loop reads them
without blocking. Threads are bounded by admission: at most ``parallel`` running plus ``queue``
waiting completions; one more is answered 503 with ``Retry-After``.

Limits that keep one client from starving or exhausting the others:
- ``max_predict`` caps every completion's tokens (default ``10 * num_ctx``, Ollama's cap);
- a request that finds no free sequence within ``queue_timeout`` seconds gets a 503;
- a stream's chunks are buffered at most ``MAX_BACKLOG`` deep (in the runner, and for a stream
  forwarded by its thread again in the event loop); beyond that its sequence pauses, and after
  ``stall_timeout`` seconds unread it is cancelled (its client stopped reading);
- a prompt longer in bytes than ``num_ctx`` tokens can cover is refused before it is tokenized,
  and a chat template renders within operation, size and time limits (``pyggml.chat``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import json
import os
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pyggml.chat import MIN_TEMPLATE_CHARS, ChatTemplate, encode_prompt
from pyggml.image import ImageBusyError
from pyggml.models import Pooling
from pyggml.runner import CompletionChunk, CompletionRequest, Runner, RunnerClosedError
from pyggml.server.params import APIError
from pyggml.thinking import template_thinks

RETRY_AFTER_SECONDS = 1
DEFAULT_QUEUE = 512  # Ollama's OLLAMA_MAX_QUEUE
MAX_PREDICT_FACTOR = 10  # default max_predict, in contexts: Ollama caps num_predict at 10 * num_ctx
QUEUE_TIMEOUT = 60.0  # seconds a request may wait for a free sequence before its 503
STALL_TIMEOUT = 60.0  # seconds a stream may go unread before its completion is cancelled
MAX_BACKLOG = 64  # chunks of one stream buffered between the runner and the client, per stage


class ServedModel:
    """The one model a server serves: its runner, the names clients may call it by, what
    ``/api/show`` and ``/v1/models`` report, and admission control."""

    def __init__(self, runner: Runner, path: str | os.PathLike, queue: int | None = None, name: str | None = None,
                 *, max_predict: int | None = None, queue_timeout: float = QUEUE_TIMEOUT,
                 stall_timeout: float = STALL_TIMEOUT, show_path: bool = False):
        if queue is not None and (not isinstance(queue, int) or queue < 0):
            raise ValueError(f"queue must be an int >= 0, got {queue!r}")
        if max_predict is not None and (not isinstance(max_predict, int) or max_predict < 1):
            raise ValueError(f"max_predict must be an int >= 1, got {max_predict!r}")
        for key, value in (("queue_timeout", queue_timeout), ("stall_timeout", stall_timeout)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{key} must be a number of seconds > 0, got {value!r}")
        self.max_predict = max_predict or MAX_PREDICT_FACTOR * runner.num_ctx
        self.queue_timeout, self.stall_timeout = float(queue_timeout), float(stall_timeout)
        self.show_path = show_path  # /api/show names the file's absolute path only when asked to
        self.runner, self.model, self.tokenizer = runner, runner.model, runner.tokenizer
        self.path = Path(path)
        self.name = name or self.path.stem
        general = self.model.config.get("general.name")
        self.aliases = {self.name, f"{self.name}:latest", self.path.name, str(self.path)}
        if isinstance(general, str) and general:
            self.aliases.add(general)
        self.queue_limit = DEFAULT_QUEUE if queue is None else queue
        self.template = ChatTemplate.from_model(self.model)
        self.max_prompt_bytes = _max_prompt_bytes(self.tokenizer, runner.num_ctx)
        stat = self.path.stat()
        self.size, self.modified = stat.st_size, stat.st_mtime
        self.modified_at = datetime.fromtimestamp(stat.st_mtime, timezone.utc).isoformat().replace("+00:00", "Z")
        self.details = self._details()
        self._digest: str | None = None
        self._lock = threading.Lock()
        self._outstanding = 0  # completions admitted and not yet let go by the runner
        # an Ollama model's params and system layers: defaults under each request's own options
        self.defaults: dict[str, Any] = {}
        self.system: str | None = None
        self.draft: Any = None  # a draft model loaded for this one (closed with it)
        self.ref: Any = None  # the stored model it was loaded as (pyggml.store.ModelRef): /api/show reports it

    def _details(self) -> dict[str, Any]:
        arch = self.model.config.architecture or ""
        tensors = self.model.backend.tensors().values()
        self.parameters = sum(t.nelements for t in tensors)
        by_type: dict[str, int] = {}
        for t in tensors:
            by_type[t.dtype.name] = by_type.get(t.dtype.name, 0) + t.nelements
        quant = max(by_type, key=by_type.get) if by_type else ""
        return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch],
                "parameter_size": _human(self.parameters), "quantization_level": quant}

    @property
    def capabilities(self) -> list[str]:
        if not self.runner.generates:
            return ["embedding"]
        tools = ["tools"] if "tools" in self.template.source else []
        thinking = ["thinking"] if template_thinks(self.template.source) else []
        return ["completion", *tools, *(["vision"] if self.model.takes_images else []), *thinking]

    def close(self) -> None:
        """Close the runner, then the model (and its draft model) it was given."""
        try:
            self.runner.close()
        finally:
            try:
                self.model.close()
            finally:
                if self.draft is not None:
                    self.draft.close()

    def check_model(self, name: Any) -> None:
        """400 without a model name, 404 for a model this server does not serve."""
        if name is None or name == "":
            raise APIError(400, "model is required", param="model")
        if not isinstance(name, str):
            raise APIError(400, "model must be a string", param="model")
        if name not in self.aliases:
            raise APIError(404, f"model {name!r} not found; this server serves {self.name!r}",
                           code="model_not_found", param="model")

    async def digest(self) -> str:
        """sha256 of the model file, computed once (in a thread: a large file takes seconds)."""
        if self._digest is None:
            self._digest = await asyncio.to_thread(_sha256, self.path)
        return self._digest

    # ---- admission ----------------------------------------------------------------------------
    def admit(self) -> None:
        with self._lock:
            if self._outstanding >= self.runner.parallel + self.queue_limit:
                raise APIError(503, f"the server is busy: {self.runner.parallel} requests running and "
                               f"{self.queue_limit} waiting; retry later", code="server_busy",
                               headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
            self._outstanding += 1

    def release(self) -> None:
        with self._lock:
            self._outstanding -= 1

    def health(self) -> dict[str, Any]:
        with self._lock:
            outstanding = self._outstanding
        return {"status": "ok", "model": self.name, "slots_total": self.runner.parallel,
                "slots_in_use": self.runner.active_sequences, "requests": outstanding,
                "queue_limit": self.queue_limit, "max_predict": self.max_predict}

    def start(self, prepare: Callable[[], CompletionRequest]) -> Job:
        """Admit a completion (503 when full) and start it; ``prepare`` runs in the job's thread.
        400 for a model that only embeds."""
        if not self.runner.generates:
            raise APIError(400, f"model {self.name!r} is an embedding model and cannot generate text; "
                           "use /api/embed or /v1/embeddings", code="generation_not_supported")
        self.admit()
        try:
            return Job(self, prepare)
        except BaseException:
            self.release()
            raise

    def check_prompt_size(self, text: str, param: str = "prompt") -> None:
        """400 for a prompt too long to fit the context, judged by its length in bytes before it
        is tokenized (tokenizing megabytes costs gigabytes): no token of the vocabulary covers
        more than ``max_prompt_bytes / num_ctx`` bytes."""
        if self.max_prompt_bytes is None or len(text) * 4 <= self.max_prompt_bytes:  # UTF-8: <= 4 bytes a char
            return
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.max_prompt_bytes:
            raise APIError(400, f"{param} of {size} bytes does not fit the context of {self.runner.num_ctx} tokens "
                           f"(no token covers more than {self.max_prompt_bytes // self.runner.num_ctx} bytes): "
                           "shorten it", param=param)

    def prompt_ids(self, text: str, chat: bool) -> list[int]:
        """Token ids of a prompt; a rendered chat prompt may carry its own BOS text."""
        self.check_prompt_size(text)
        return encode_prompt(self.tokenizer, text) if chat else self.tokenizer.encode(text, add_special=True)

    def render(self, messages: list[dict[str, Any]], **variables: Any) -> str:
        """The chat prompt of ``messages``; the template may produce at most what can fit the
        context (and holds to ``pyggml.chat``'s operation and time limits)."""
        limit = max(self.max_prompt_bytes or 0, MIN_TEMPLATE_CHARS)
        return self.template.render(messages, max_chars=limit, **variables)

    def request(self, ids: list[int], max_tokens: int | None = None, **options: Any) -> CompletionRequest:
        """A completion of prompt ``ids``; ``max_tokens=None`` generates up to the end of the context
        (Ollama's default; the engine's context shift would otherwise let a model run forever).
        Any request is capped at ``max_predict`` tokens; the model's own defaults (an Ollama params
        layer) lie under the request's options."""
        max_tokens, options = self._with_defaults(max_tokens, options)
        if max_tokens is None:
            max_tokens = max(self.runner.num_ctx - len(ids), 0)
        return CompletionRequest(ids, max_tokens=min(max_tokens, self.max_predict), **options)

    def _with_defaults(self, max_tokens: int | None, options: dict[str, Any]) -> tuple[int | None, dict[str, Any]]:
        options = {**self.defaults, **options}
        default_max = options.pop("max_tokens", None)
        return (default_max if max_tokens is None else max_tokens), options

    def image_request(self, text: str, chat: bool, images: list[bytes], max_tokens: int | None = None,
                      **options: Any) -> CompletionRequest:
        """A completion of prompt ``text`` whose ``[img-N]`` markers place ``images``. The runner's
        ``completion`` decodes each image once, on the job's thread, so one that is not an image, or
        too large, is a 400 (ImageError, a ValueError) before any model work."""
        from pyggml.chat import strip_bos_text

        if not self.model.takes_images:
            raise APIError(400, f"model {self.name!r} takes no images (it has no vision part)")
        max_tokens, options = self._with_defaults(max_tokens, options)
        self.check_prompt_size(text)
        text = strip_bos_text(self.tokenizer, text) if chat else text  # the runner adds the BOS
        if max_tokens is None:
            max_tokens = max(self.runner.num_ctx - len(self.tokenizer.encode(text)), 0)
        return CompletionRequest(text, images=images, max_tokens=min(max_tokens, self.max_predict), **options)

    async def embed(self, texts: list[str], *, truncate: bool = False, normalize: bool = True,
                    dimensions: int | None = None) -> tuple[list[list[float]], int]:
        """One embedding per text and the number of tokens read (400 for a model without
        embeddings, or a text too long without ``truncate``). ``dimensions`` keeps the first
        that many components (re-normalised when ``normalize``), as Matryoshka models allow."""
        if self.runner.embedder is None:
            raise APIError(400, f"model {self.name!r} does not support embeddings: the "
                           f"{self.model.architecture or 'loaded'} model generates text and has no embedding "
                           "output", code="embeddings_not_supported")

        def compute() -> tuple[np.ndarray, int]:
            vectors = self.runner.embeddings(texts, normalize=False, truncate=truncate)
            return vectors, sum(len(self.runner.embedder.tokenize(t, truncate)) for t in texts)

        self.admit()
        try:
            vectors, n_tokens = await asyncio.to_thread(compute)
        except (ValueError, TypeError) as exc:  # a text too long for the context, and the like
            raise APIError(400, str(exc), param="input") from None
        except RunnerClosedError as exc:
            raise APIError(503, f"the model runner is not running: {exc}") from None
        finally:
            self.release()
        if dimensions is not None and dimensions > vectors.shape[1]:
            raise APIError(400, f"dimensions must be at most {vectors.shape[1]}, the model's embedding size",
                           param="dimensions")
        vectors = vectors[:, :dimensions] if dimensions else vectors
        if normalize:
            vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return vectors.tolist(), n_tokens

    async def rerank(self, query: str, documents: list[str], *, truncate: bool = False) -> tuple[list[float], int]:
        """Relevance scores of ``documents`` to ``query`` and the tokens read (400 for a model that is
        not a reranker, or a pair too long without ``truncate``)."""
        embedder = self.runner.embedder
        if embedder is None or self.model.pooling != Pooling.RANK:
            raise APIError(400, f"model {self.name!r} is not a reranker: reranking needs a cross-encoder such as "
                           "bge-reranker or Qwen3-Reranker (pooling_type rank)", code="rerank_not_supported")
        self.admit()
        try:
            scores, n_tokens = await asyncio.to_thread(self.runner.rerank, query, documents, truncate=truncate)
        except (ValueError, TypeError) as exc:  # a pair too long for the context, and the like
            raise APIError(400, str(exc), param="documents") from None
        except RunnerClosedError as exc:
            raise APIError(503, f"the model runner is not running: {exc}") from None
        finally:
            self.release()
        return scores.tolist(), n_tokens

    def token_text(self, token: int) -> str:
        return self.tokenizer.token_to_piece(token).decode("utf-8", "replace")


_STARTED = object()


class _LoopWaker:
    """Wakes the event loop for the jobs whose streams have new chunks: one ``call_soon_threadsafe``
    for all the jobs the runner notifies in one step, however many sequences it serves."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)  # not a strong one: the loop is this waker's key in ``_wakers``
        self._ready: collections.deque[Job] = collections.deque()
        self._scheduled = False

    def wake(self, job: Job) -> None:
        """Any thread: have ``job._on_ready()`` run on the loop soon."""
        self._ready.append(job)
        if not self._scheduled:
            self._scheduled = True  # cleared before the loop drains ``_ready``: no wake-up is lost
            loop = self._loop()
            try:
                if loop is not None:
                    loop.call_soon_threadsafe(self._run)
            except RuntimeError:  # the event loop is closed (the server stopped)
                pass

    def _run(self) -> None:
        self._scheduled = False
        while self._ready:
            self._ready.popleft()._on_ready()


_wakers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopWaker] = weakref.WeakKeyDictionary()


class Job:
    """One completion in flight. Iterate ``chunks()`` on the event loop; ``close()`` (from the
    loop, any time) cancels it. The admission is returned once the runner has let go of the
    sequence, so the 503 limit counts what really occupies the runner.

    The job's thread prepares the request and waits for its admission. Then, with a stream that
    can notify (``CompletionStream.set_notify``), the runner tells the event loop of new chunks
    itself, once per step for all streams, and the loop reads them without blocking (no thread
    hand-off per token); otherwise the thread forwards each chunk through an ``asyncio.Queue``."""

    def __init__(self, served: ServedModel, prepare: Callable[[], CompletionRequest]):
        self._served, self._prepare = served, prepare
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._room = threading.Semaphore(MAX_BACKLOG)  # chunks the event loop may hold unread
        self._stream = None
        self._closed = self._released = False
        self._release_lock = threading.Lock()
        self._direct = False  # chunks come from the stream itself, announced by the runner's notify
        self._ready = asyncio.Event()
        self._waker = _wakers.get(self._loop)
        if self._waker is None:
            self._waker = _wakers[self._loop] = _LoopWaker(self._loop)
        self._stall: asyncio.TimerHandle | None = None
        self._read = 0  # chunks read by chunks(), for the stall check
        self.request: CompletionRequest | None = None
        self.tokens: list[int] = []  # generated so far (as seen by chunks())
        threading.Thread(target=self._run, name="pyggml-server-job", daemon=True).start()

    def _put(self, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (the server stopped)
            pass

    def _run(self) -> None:
        try:
            try:
                runner = self._served.runner
                with runner.arriving():  # a burst of requests starts its prompts in one step
                    self.request = self._prepare()
                    stream = runner.completion(self.request)
            except Exception as exc:
                self._release()
                self._put(exc)
                return
            self._stream = stream
            stream.set_max_backlog(MAX_BACKLOG)
            if self._closed:  # closed while preparing (close() saw no stream yet)
                stream.close()
            if not stream.wait_admitted(self._served.queue_timeout):
                stream.close()  # the runner drops it from its queue
                self._put(APIError(503, f"the server is busy: no sequence became free within "
                                   f"{self._served.queue_timeout:g} s ({self._served.runner.parallel} requests "
                                   "running); retry later", code="server_busy",
                                   headers={"Retry-After": str(RETRY_AFTER_SECONDS)}))
                return
            if hasattr(stream, "set_notify") and hasattr(stream, "poll"):
                self._direct = True
                stream.set_notify(self._notify)
                self._put(_STARTED)
                self._notify()  # chunks (or the end) may have come before the notify was set
                return
            self._put(_STARTED)
            try:
                stalled = False
                for chunk in stream:
                    if chunk.done:  # the runner has freed the sequence: so may the next request
                        self._release()
                    if not stalled and not self._room.acquire(timeout=self._served.stall_timeout):
                        stalled = True  # the client stopped reading: cancel, the final chunk still comes
                        stream.cancel()
                    self._put(chunk)
            except Exception as exc:
                self._release()
                self._put(exc)
            stream.wait()
        finally:
            if not self._direct:
                self._release()

    def _notify(self) -> None:
        """The runner's thread (or the job's): new chunks are queued. The admission is returned
        as soon as the completion is over, before the event loop can send its end."""
        if self._stream.finished:
            self._release()
        self._waker.wake(self)

    def _on_ready(self) -> None:
        """On the loop: wake ``chunks()``; watch a stream whose client stopped reading."""
        self._ready.set()
        if self._stall is None and not self._closed and self._stream.backlog >= MAX_BACKLOG:
            self._stall = self._loop.call_later(self._served.stall_timeout, self._check_stall, self._read)

    def _check_stall(self, read: int) -> None:
        """``stall_timeout`` after the stream filled its backlog: cancel it if nothing was read since
        (the final chunk still comes); otherwise look again later."""
        self._stall = None
        if self._closed or self._stream.finished:
            return
        if self._read == read:
            self._stream.cancel()
        elif self._stream.backlog >= MAX_BACKLOG:
            self._stall = self._loop.call_later(self._served.stall_timeout, self._check_stall, self._read)

    def _release(self) -> None:
        """Return the admission before the client can see the answer, so a client that sends its
        requests one after another is never refused; once only."""
        with self._release_lock:  # the runner's thread and the job's may both get here
            if self._released:
                return
            self._released = True
        self._served.release()

    async def started(self) -> None:
        """Wait until the runner has given the request a sequence; raises ``APIError`` for a bad
        one, or a 503 when none became free in time. Cancels the job if the wait is cancelled."""
        try:
            item = await self._queue.get()
        except BaseException:
            self.close()
            raise
        if item is not _STARTED:
            raise _as_api_error(item)

    def chunks(self) -> AsyncIterator[CompletionChunk]:
        """The completion's chunks (after ``started()``), ending with the ``done`` one."""
        return self._direct_chunks() if self._direct else self._queued_chunks()

    async def _queued_chunks(self) -> AsyncIterator[CompletionChunk]:
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise _as_api_error(item)
            self._room.release()
            self.tokens += item.tokens
            yield item
            if item.done:
                return

    async def _direct_chunks(self) -> AsyncIterator[CompletionChunk]:
        while True:
            try:
                item = self._stream.poll()
            except StopIteration:  # closed (cancelled) meanwhile
                return
            except Exception as exc:
                raise _as_api_error(exc) from None
            if item is None:
                self._ready.clear()
                if self._stream.backlog:  # queued after the poll, announced before the clear
                    continue
                await self._ready.wait()
                continue
            self._read += 1
            self.tokens += item.tokens
            yield item
            if item.done:
                return

    async def collect(self, request: Any) -> list[CompletionChunk]:
        """All chunks; cancels the completion if the client disconnects first (then a 499 that
        nobody reads, and nothing logged)."""
        async def gather() -> list[CompletionChunk]:
            return [chunk async for chunk in self.chunks()]

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work, watch = asyncio.ensure_future(gather()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
                self.close()
        if work.done() and not work.cancelled():
            return work.result()
        with contextlib.suppress(asyncio.CancelledError):  # cancel() only asks: let it finish
            await work
        raise APIError(499, "client disconnected")

    async def result(self, request: Any) -> CompletionChunk:
        """The whole completion as one chunk: all its text, tokens and logprobs, and the last chunk's
        finish reason and counts (``collect``'s cancellation on disconnect)."""
        chunks = await self.collect(request)
        logprobs = [lp for c in chunks for lp in c.logprobs or ()]
        return dataclasses.replace(chunks[-1], text="".join(c.text for c in chunks),
                                   tokens=[t for c in chunks for t in c.tokens], logprobs=logprobs or None)

    def close(self) -> None:
        """Cancel the completion (a no-op once it is done); its slot frees in the runner's loop."""
        self._closed = True
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        if self._stream is not None:
            self._stream.close()
        self._room.release()  # a job thread waiting for the client to read goes on, and ends


class _JobResponse(StreamingResponse):
    """A streamed body that cancels its job however the response ends: finished, failed, or
    cut short by the client (Starlette then cancels the body before or while it iterates)."""

    def __init__(self, job: Job, content: AsyncIterator[str], media_type: str):
        super().__init__(content, media_type=media_type, headers={"Cache-Control": "no-cache"})
        self.job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.close()


def stream_response(job: Job, content: AsyncIterator[str], media_type: str) -> StreamingResponse:
    return _JobResponse(job, content, media_type)


def sse(data: Any, event: str | None = None) -> str:
    """One server-sent event: ``data`` as JSON, under the ``event`` name where the API names its events."""
    return (f"event: {event}\n" if event else "") + f"data: {json.dumps(data)}\n\n"


def _as_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RunnerClosedError):
        return APIError(503, f"the model runner is not running: {exc}")
    if isinstance(exc, ImageBusyError):  # the process-wide budget of decoded image pixels is full
        return APIError(503, str(exc), code="server_busy", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, ValueError):  # bad prompt or options (ChatTemplateError is one too)
        return APIError(400, str(exc))
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


def _max_prompt_bytes(tokenizer: Any, num_ctx: int) -> int | None:
    """The most bytes of text ``num_ctx`` tokens can cover, or None where a token may cover text
    of any length. SentencePiece and byte-level BPE turn every byte of the text into part of a
    token's piece, and no piece is longer than its vocabulary entry in UTF-8 (SentencePiece's
    "▁" and BPE's byte letters take more bytes there than the text they stand for). WordPiece
    drops whitespace and maps whole unknown words to one token: no bound."""
    if getattr(tokenizer, "model", None) not in ("llama", "gpt2"):
        return None
    longest = max((len(t.encode("utf-8", "surrogatepass")) for t in tokenizer.vocab.tokens), default=1)
    return num_ctx * max(longest, 4)  # <unk> or a byte token covers one character, up to 4 bytes


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return f"sha256:{h.hexdigest()}"


def _human(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}" if n < 10 * size else f"{n / size:.0f}{unit}"
    return str(n)
