"""OpenAI's API (``/v1/...``): completions, chat completions, embeddings, models.

Streams are server-sent events (``data: {...}`` then ``data: [DONE]``); with
``stream_options.include_usage`` a last chunk with empty ``choices`` carries the usage, as
OpenAI sends it. Errors are ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import pyggml
from pyggml.compat import completion_logprobs
from pyggml.runner import CompletionChunk, CompletionRequest, TokenLogprob
from pyggml.server.chat import chat_prompt, effort_think
from pyggml.server.models import served_for
from pyggml.server.params import (
    OPENAI_COMMON,
    APIError,
    Fields,
    grammar_extension,
    ignore_eos,
    openai_max_tokens,
    openai_response_format,
    openai_sampling,
    read_json,
    runner_logprobs,
    stream_usage,
)
from pyggml.server.service import ServedModel, sse, stream_response

COMPLETION_FIELDS = OPENAI_COMMON | {"prompt", "echo", "suffix", "best_of", "grammar"}
CHAT_FIELDS = OPENAI_COMMON | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    "response_format", "store", "metadata", "service_tier", "reasoning_effort", "modalities", "grammar",
}
EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions", "user"}
FINGERPRINT = f"pyggml-{pyggml.__version__}"


def _usage(chunk: CompletionChunk) -> dict[str, Any]:
    usage = {"prompt_tokens": chunk.prompt_tokens, "completion_tokens": chunk.generated_tokens,
             "total_tokens": chunk.prompt_tokens + chunk.generated_tokens,
             "prompt_tokens_details": {"cached_tokens": chunk.cached_tokens}}
    if chunk.draft_tokens:  # speculative decoding: OpenAI's counts for predicted tokens kept and dropped
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": chunk.accepted_tokens,
                                              "rejected_prediction_tokens": chunk.draft_tokens - chunk.accepted_tokens}
    return usage


def _finish(chunk: CompletionChunk) -> str | None:
    if not chunk.done:
        return None
    return "length" if chunk.finish_reason == "length" else "stop"


Choice = Callable[[CompletionChunk, str, list[TokenLogprob], bool], dict[str, Any]]


async def _complete(request: Request, served: ServedModel, prepare: Callable[[], CompletionRequest], stream: bool,
                    usage: bool, kind: str, choice: Choice, first: dict[str, Any] | None = None) -> Response:
    """Run one completion; ``choice(chunk, text, logprobs, streaming)`` shapes the route's choice,
    ``first`` is a choice streamed before any text (chat's role announcement)."""
    job = served.start(prepare)
    await job.started()
    chat = kind.startswith("chat")
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "object": kind,
            "created": int(time.time()), "model": served.name, "system_fingerprint": FINGERPRINT}
    if not stream:
        last = await job.result(request)
        answer = choice(last, last.text, last.logprobs or [], False)
        return JSONResponse({**head, "choices": [answer], "usage": _usage(last)})

    if chat:
        head["object"] = "chat.completion.chunk"
    extra = {"usage": None} if usage else {}
    # every event is ``{**head, "choices": [choice], **extra}``: its constant parts encoded once
    before = f"data: {json.dumps(head)[:-1]}, \"choices\": ["
    after = "]" + (', "usage": null' if usage else "") + "}\n\n"

    async def events() -> AsyncIterator[str]:
        try:
            if first is not None:
                yield sse({**head, "choices": [first], **extra})
            async for chunk in job.chunks():
                if chunk.text or chunk.done or chunk.logprobs:
                    yield before + json.dumps(choice(chunk, chunk.text, chunk.logprobs or [], True)) + after
                if chunk.done and usage:
                    yield sse({**head, "choices": [], "usage": _usage(chunk)})
        except APIError as exc:
            yield sse(_error_body(exc))
        yield "data: [DONE]\n\n"

    return stream_response(job, events(), "text/event-stream")


# ---- /v1/completions ----------------------------------------------------------------------------
async def completions(request: Request) -> Response:
    body = await read_json(request)
    f = Fields(body, "the request", COMPLETION_FIELDS)
    served = await served_for(request, body.get("model"))
    f.unsupported("suffix", what="(fill-in-the-middle) is not supported by this server")
    f.unsupported("best_of", (1,), "must be 1")
    prompt = _completion_prompt(served, body.get("prompt"))
    echo = f.boolean("echo", False)
    top = f.integer("logprobs", low=0, high=5)
    if echo and top is not None:
        raise APIError(400, "echo with logprobs is not supported (prompt logprobs are not computed)",
                       param="echo")
    sampling, max_tokens = openai_sampling(f), openai_max_tokens(f, "max_tokens")
    sampling.update(grammar_extension(f))
    ignore_eos(f, served.tokenizer, sampling)
    stream = f.boolean("stream", False)
    usage = stream_usage(f)

    def prepare() -> CompletionRequest:
        ids = served.prompt_ids(prompt, False) if isinstance(prompt, str) else prompt
        return served.request(ids, max_tokens, logprobs=runner_logprobs(top), **sampling)

    prefix = [prompt if isinstance(prompt, str) else served.tokenizer.decode(prompt)] if echo else []
    offset = [0]

    def choice(chunk: CompletionChunk, text: str, lps: list[TokenLogprob], streaming: bool) -> dict[str, Any]:
        if prefix:
            text = prefix.pop() + text
        logprobs = None if top is None else completion_logprobs(lps, top, served.token_text, offset)
        return {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": _finish(chunk)}

    return await _complete(request, served, prepare, stream, usage, "text_completion", choice)


def _completion_prompt(served: ServedModel, prompt: Any) -> str | list[int]:
    """A string, a one-string array, token ids, or one array of token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        served.check_prompt_size(prompt)
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(400, "several prompts in one request are not supported: send one request per prompt",
                       param="prompt")
    raise APIError(400, "prompt must be a non-empty string or a non-empty array of token ids", param="prompt")


# ---- /v1/chat/completions -----------------------------------------------------------------------
async def chat_completions(request: Request) -> Response:
    body = await read_json(request)
    f = Fields(body, "the request", CHAT_FIELDS)
    served = await served_for(request, body.get("model"))
    f.unsupported("modalities", (["text"],), 'is not supported beyond ["text"]')
    think = effort_think(served, f.string("reasoning_effort"), "reasoning_effort")
    prompt = chat_prompt(served, body.get("messages"), f.array("tools"), body.get("tool_choice"), think=think)
    want = f.boolean("logprobs", False)
    top = f.integer("top_logprobs", low=0, high=20)
    if top is not None and not want:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    top = (top or 0) if want else None
    sampling = openai_sampling(f)
    sampling.update(openai_response_format(f))
    ignore_eos(f, served.tokenizer, sampling)
    sampling = prompt.sampling(sampling)
    max_tokens = openai_max_tokens(f, "max_completion_tokens", "max_tokens")
    stream = f.boolean("stream", False)
    usage = stream_usage(f)
    prepare = prompt.prepare(max_tokens, sampling, top)
    output = prompt.output()

    def choice(chunk: CompletionChunk, text: str, lps: list[TokenLogprob], streaming: bool) -> dict[str, Any]:
        logprobs = None
        if top is not None:
            logprobs = {"content": [_chat_logprob(served, lp, top) for lp in lps]}
        thinking, text, calls = output.feed(chunk, text)
        message = {"content": text} if streaming else {"role": "assistant", "content": text}
        if streaming and chunk.done and not text:
            message = {}
        if thinking:  # llama-server's and DeepSeek's field for the reasoning
            message["reasoning_content"] = thinking
        if calls:
            if not streaming:
                message["content"] = text or None
            message["tool_calls"] = [c.openai(i if streaming else None) for i, c in enumerate(calls)]
        finish = "tool_calls" if calls else _finish(chunk)
        return {"index": 0, "delta" if streaming else "message": message, "logprobs": logprobs,
                "finish_reason": finish}

    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    return await _complete(request, served, prepare, stream, usage, "chat.completion", choice, first)


def _chat_logprob(served: ServedModel, lp: TokenLogprob, top: int) -> dict[str, Any]:
    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = served.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, p) for t, p in lp.top[:top]]}


# ---- /v1/embeddings, /v1/models -----------------------------------------------------------------
async def embeddings(request: Request) -> Response:
    body = await read_json(request)
    f = Fields(body, "the request", EMBEDDING_FIELDS)
    served = await served_for(request, body.get("model"))
    encoding = f.string("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise APIError(400, 'encoding_format must be "float" or "base64"', param="encoding_format")
    dimensions = f.integer("dimensions", low=1)
    value = body.get("input")
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise APIError(400, "input must be a non-empty string or an array of non-empty strings", param="input")
    vectors, n = await served.embed(texts, dimensions=dimensions)
    return JSONResponse({"object": "list", "model": served.name,
                         "data": [{"object": "embedding", "index": i, "embedding": _encode(v, encoding)}
                                  for i, v in enumerate(vectors)],
                         "usage": {"prompt_tokens": n, "total_tokens": n}})


def _encode(vector: list[float], encoding: str) -> list[float] | str:
    """base64 is what OpenAI's own client asks for: little-endian float32."""
    if encoding == "float":
        return vector
    return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode()


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": request.app.state.models.openai_models()})


async def model(request: Request) -> Response:
    name = request.path_params["model"]
    for entry in request.app.state.models.openai_models():
        if entry["id"] == name:
            return JSONResponse(entry)
    served = await served_for(request, name)  # an alias of a served model, or a 404
    return JSONResponse({"id": served.name, "object": "model", "created": int(served.modified), "owned_by": "pyggml"})


def _error_body(exc: APIError) -> dict[str, Any]:
    kind = "invalid_request_error" if exc.status < 500 else "server_error"
    return {"error": {"message": exc.message, "type": kind, "param": exc.param, "code": exc.code}}


def error_response(exc: APIError) -> Response:
    return JSONResponse(_error_body(exc), status_code=exc.status, headers=exc.headers)


routes = [
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/embeddings", embeddings, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/v1/models/{model:path}", model, methods=["GET"]),
]
