"""Ollama's API (``/api/...``): generate, chat, embed, tags, show, ps, version.

Streams are NDJSON, one JSON object per line, ``stream`` defaulting to true as in Ollama; errors
are ``{"error": "..."}`` (also as the last line of a stream that fails midway).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import pyggml
from pyggml.chat import fill_in_the_middle
from pyggml.image import image_bytes
from pyggml.modelfile import parameters_text
from pyggml.modelfile import render as render_modelfile
from pyggml.repl import parse_duration
from pyggml.runner import CompletionChunk, CompletionRequest
from pyggml.server.chat import chat_prompt, think_variables
from pyggml.server.models import served_for
from pyggml.server.params import (
    APIError,
    Fields,
    ollama_format,
    ollama_logprobs,
    ollama_options,
    read_json,
    runner_logprobs,
)
from pyggml.server.service import Job, ServedModel, stream_response
from pyggml.thinking import Splitter, Think, check_think, splitter_for

NDJSON = "application/x-ndjson"
_COMMON = {"model", "options", "stream", "keep_alive", "format", "think", "logprobs", "top_logprobs", "grammar"}
GENERATE_FIELDS = _COMMON | {"prompt", "suffix", "system", "template", "context", "raw", "images"}
CHAT_FIELDS = _COMMON | {"messages", "tools"}
EMBED_FIELDS = {"model", "input", "truncate", "options", "keep_alive", "dimensions"}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _think(f: Fields) -> Think:
    """Ollama's ``think``: true, false, or a level ("low", "medium", "high": gpt-oss)."""
    try:
        return check_think(f.data.get("think"))
    except ValueError as exc:
        raise APIError(400, str(exc), param="think") from None


async def generate(request: Request) -> Response:
    body = await read_json(request)
    f = Fields(body, "the request", GENERATE_FIELDS)
    served = await served_for(request, body.get("model"), body.get("keep_alive"))
    think, suffix = _think(f), f.string("suffix")
    f.unsupported("template", what="is not supported: the model's own chat template is used")
    prompt, system, raw = f.string("prompt", ""), f.string("system") or served.system, f.boolean("raw", False)
    chat = not raw and not served.template.is_fallback
    if think is not None and not chat:
        raise APIError(400, "think needs the model's chat template (not raw, and a model that has one)",
                       param="think")
    variables = think_variables(served, think) if chat else {}
    rendered: list[str] = []
    images = _images(f.array("images") or [], "images")
    if images and "[img-" not in prompt:  # Ollama puts a prompt's images before its text
        prompt = "".join(f"[img-{i}]" for i in range(len(images))) + prompt
    context = f.array("context") or []
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in context):
        raise APIError(400, "context must be an array of token ids", param="context")
    options, logprobs = ollama_options(body.get("options")), ollama_logprobs(f)
    options.update(ollama_format(f))
    served.check_prompt_size(prompt)
    if len(context) > served.runner.num_ctx:
        raise APIError(400, f"context of {len(context)} tokens does not fit the context of {served.runner.num_ctx} "
                       "tokens", param="context")
    if not prompt and not context and not suffix:  # Ollama's way to load (or, with keep_alive 0, unload) a model
        return JSONResponse({"model": served.name, "created_at": _now(), "response": "", "done": True,
                             "done_reason": await _load_or_unload(request, body)})
    if suffix:
        return await _fill_in_the_middle(request, served, f, prompt, suffix, options, logprobs)

    def prepare() -> CompletionRequest:
        text = prompt
        if chat:
            messages = ([{"role": "system", "content": system}] if system else []) + \
                       [{"role": "user", "content": prompt}]
            text = served.render(messages, **variables)
            rendered.append(text)
        elif system and not raw:
            text = f"{system}\n\n{prompt}"
        if context:
            text = served.tokenizer.decode(context, skip_special=True) + text
        if images:
            return served.image_request(text, chat, images, logprobs=runner_logprobs(logprobs), **options)
        return served.request(served.prompt_ids(text, chat), logprobs=runner_logprobs(logprobs), **options)

    splitter: list[Splitter | None] = []

    def piece(served: ServedModel, job: Job, chunk: CompletionChunk, text: str) -> dict[str, Any]:
        if not splitter:  # known once the prompt is rendered
            splitter.append(splitter_for(served.template.source, rendered[0]) if rendered else None)
        thinking = ""
        if splitter[0] is not None:
            thinking, text = splitter[0].feed(text)
            if chunk.done:
                more, rest = splitter[0].flush()
                thinking, text = thinking + more, text + rest
        out = _generate_piece(served, job, chunk, text)
        if thinking and think is not False:  # as on /api/chat: think false drops what a model thinks anyway
            out["thinking"] = thinking
        return out

    return await _complete(request, served, prepare, f.boolean("stream", True), logprobs, piece)


async def _fill_in_the_middle(request: Request, served: ServedModel, f: Fields, prompt: str, suffix: str,
                              options: dict[str, Any], logprobs: int | None) -> Response:
    """``suffix``: the text between ``prompt`` and ``suffix`` (a code model's fill-in-the-middle tokens;
    no template, no system message)."""
    for key in ("images", "context", "think"):
        f.unsupported(key, (False,), "cannot go with suffix (fill-in-the-middle)")
    served.check_prompt_size(prompt + suffix)
    try:
        ids = fill_in_the_middle(served.tokenizer, prompt, suffix)
    except ValueError as exc:
        raise APIError(400, str(exc), param="suffix") from None

    def prepare() -> CompletionRequest:
        return served.request(ids, logprobs=runner_logprobs(logprobs), **options)

    return await _complete(request, served, prepare, f.boolean("stream", True), logprobs, _generate_piece)


async def _load_or_unload(request: Request, body: dict[str, Any]) -> str:
    if body.get("keep_alive") is not None and parse_duration(body["keep_alive"]) == 0:
        if await request.app.state.models.unload(body["model"]):  # a server's only model stays loaded
            return "unload"
    return "load"


def _images(items: list[Any], where: str) -> list[bytes]:
    """Base64 images (Ollama's ``images``) as bytes; 400 for anything else."""
    try:
        return [image_bytes(x, f"{where}[{i}]") for i, x in enumerate(items)]
    except ValueError as exc:
        raise APIError(400, str(exc), param=where) from None


def _generate_piece(served: ServedModel, job: Job, chunk: CompletionChunk, text: str) -> dict[str, Any]:
    out: dict[str, Any] = {"model": served.name, "created_at": _now(), "response": text, "done": chunk.done}
    if chunk.done:
        out["context"] = list(job.request.prompt) + job.tokens
    return out


async def chat(request: Request) -> Response:
    body = await read_json(request)
    f = Fields(body, "the request", CHAT_FIELDS)
    served = await served_for(request, body.get("model"), body.get("keep_alive"))
    think = _think(f)
    options, logprobs = ollama_options(body.get("options")), ollama_logprobs(f)
    options.update(ollama_format(f))
    raw_messages, tools = f.array("messages"), f.array("tools")
    if not raw_messages:  # Ollama's way to load (or, with keep_alive 0, unload) a model
        return JSONResponse({"model": served.name, "created_at": _now(),
                             "message": {"role": "assistant", "content": ""}, "done": True,
                             "done_reason": await _load_or_unload(request, body)})
    prompt = chat_prompt(served, raw_messages, tools, think=think)
    if served.ref is not None and served.ref.messages:  # a stored model's MESSAGE turns begin the conversation
        first = 1 if prompt.messages and prompt.messages[0]["role"] == "system" else 0
        prompt.messages[first:first] = [dict(m) for m in served.ref.messages]
    if served.system and not any(m["role"] == "system" for m in prompt.messages):  # the model's default system message
        prompt.messages.insert(0, {"role": "system", "content": served.system})
    prepare = prompt.prepare(options.pop("max_tokens", None), options, logprobs)
    output = prompt.output()

    def piece(served: ServedModel, job: Job, chunk: CompletionChunk, text: str) -> dict[str, Any]:
        thinking, text, calls = output.feed(chunk, text)
        message = {"role": "assistant", "content": text}
        if thinking and think is not False:  # think: false drops what a model thinks anyway, as Ollama does
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = [c.ollama() for c in calls]
        return {"model": served.name, "created_at": _now(), "message": message, "done": chunk.done}

    return await _complete(request, served, prepare, f.boolean("stream", True), logprobs, piece)


Piece = Callable[[ServedModel, Job, CompletionChunk, str], dict[str, Any]]


async def _complete(request: Request, served: ServedModel, prepare: Callable[[], CompletionRequest], stream: bool,
                    logprobs: int | None, piece: Piece) -> Response:
    start = time.perf_counter()
    job = served.start(prepare)
    await job.started()

    def render(chunk: CompletionChunk, text: str, lps: list) -> dict[str, Any]:
        out = piece(served, job, chunk, text)
        if logprobs is not None:
            out["logprobs"] = [_logprob(served, lp, logprobs) for lp in lps]
        if chunk.done:
            out.update(_final_stats(chunk, start))
        return out

    if not stream:
        last = await job.result(request)
        return JSONResponse(render(last, last.text, last.logprobs or []))

    async def lines() -> AsyncIterator[str]:
        try:
            async for chunk in job.chunks():
                if chunk.text or chunk.done or chunk.logprobs:
                    yield json.dumps(render(chunk, chunk.text, chunk.logprobs or [])) + "\n"
        except APIError as exc:
            yield json.dumps({"error": exc.message}) + "\n"

    return stream_response(job, lines(), NDJSON)


def _final_stats(chunk: CompletionChunk, start: float) -> dict[str, Any]:
    t = chunk.timings
    ns = 1_000_000_000
    return {"done_reason": "length" if chunk.finish_reason == "length" else "stop",
            "total_duration": int((time.perf_counter() - start) * ns), "load_duration": 0,
            "prompt_eval_count": chunk.prompt_tokens, "prompt_eval_duration": int(t.prompt_seconds * ns) if t else 0,
            "eval_count": chunk.generated_tokens, "eval_duration": int(t.generate_seconds * ns) if t else 0}


def _logprob(served: ServedModel, lp: Any, top: int) -> dict[str, Any]:
    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = served.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    out = entry(lp.token, lp.logprob)
    if top:
        out["top_logprobs"] = [entry(t, p) for t, p in lp.top[:top]]
    return out


async def embed(request: Request) -> Response:
    body = await read_json(request)
    f = Fields(body, "the request", EMBED_FIELDS)
    served = await served_for(request, body.get("model"), body.get("keep_alive"))
    dimensions, truncate = f.integer("dimensions", low=1), f.boolean("truncate", True)
    ollama_options(body.get("options"))
    texts = _embed_inputs(body.get("input"))
    start = time.perf_counter()
    vectors, n_tokens = await served.embed(texts, truncate=truncate, dimensions=dimensions)
    return JSONResponse({"model": served.name, "embeddings": vectors,
                         "total_duration": int((time.perf_counter() - start) * 1e9), "load_duration": 0,
                         "prompt_eval_count": n_tokens})


async def embeddings(request: Request) -> Response:
    """The older single-text route; as in Ollama, its vector is not normalised."""
    body = await read_json(request)
    f = Fields(body, "the request", {"model", "prompt", "options", "keep_alive"})
    served = await served_for(request, body.get("model"), body.get("keep_alive"))
    ollama_options(body.get("options"))
    text = f.string("prompt")
    if not text:
        raise APIError(400, "prompt is required", param="prompt")
    vectors, _ = await served.embed([text], truncate=True, normalize=False)
    return JSONResponse({"embedding": vectors[0]})


def _embed_inputs(value: Any) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise APIError(400, "input must be a non-empty string or an array of non-empty strings", param="input")
    return texts


async def tags(request: Request) -> Response:
    return JSONResponse({"models": await request.app.state.models.tags()})


async def ps(request: Request) -> Response:
    return JSONResponse({"models": await request.app.state.models.ps()})


async def show(request: Request) -> Response:
    body = await read_json(request)
    f = Fields(body, "the request", {"model", "name", "verbose", "system", "template", "options"})
    served = await served_for(request, body.get("model") or body.get("name"))
    verbose = f.boolean("verbose", False)
    info: dict[str, Any] = {"general.parameter_count": served.parameters}
    for key, value in served.model.config.items():
        info[key] = value if verbose or not isinstance(value, list) else None
    ref = served.ref
    stored = {k: v for k, v in (ref.params if ref is not None else {}).items() if k != "num_ctx"}
    params = {**stored, "num_ctx": served.runner.num_ctx}  # the context it runs with
    licenses = list(ref.license) if ref is not None and ref.license else []
    messages = list(ref.messages) if ref is not None else []
    out = {
        "license": "\n\n".join(licenses) or served.model.config.get("general.license") or "",
        "modelfile": render_modelfile(served.name, str(served.path if served.show_path else served.path.name),
                                      template=ref.template if ref is not None else None, system=served.system,
                                      parameters=params, license=licenses, messages=messages),
        "parameters": parameters_text(params),
        "template": served.template.source,
        "details": served.details,
        "model_info": info,
        "capabilities": served.capabilities,
        "modified_at": served.modified_at,
    }
    if served.system:
        out["system"] = served.system
    if messages:
        out["messages"] = messages
    return JSONResponse(out)


async def version(request: Request) -> Response:
    return JSONResponse({"version": pyggml.__version__})


routes = [
    Route("/api/generate", generate, methods=["POST"]),
    Route("/api/chat", chat, methods=["POST"]),
    Route("/api/embed", embed, methods=["POST"]),
    Route("/api/embeddings", embeddings, methods=["POST"]),
    Route("/api/tags", tags, methods=["GET"]),
    Route("/api/ps", ps, methods=["GET"]),
    Route("/api/show", show, methods=["POST"]),
    Route("/api/version", version, methods=["GET"]),
]
