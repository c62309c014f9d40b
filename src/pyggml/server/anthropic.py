"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A request's ``system``, ``messages`` (text, base64 images, ``tool_use`` and ``tool_result`` blocks) and
``tools`` become a chat request in the template's terms (``pyggml.server.chat``), as OpenAI's chat
completions do. A last assistant message is a prefill: the answer continues it. Streams are
server-sent events named as Anthropic names them (message_start, content_block_start/delta/stop,
message_delta, message_stop); tool calls are read from the output as it ends, so a ``tool_use`` block
streams after the text, its input as one ``input_json_delta``; a thinking model's reasoning comes first,
as a ``thinking`` block (``pyggml.thinking``). Usage: ``input_tokens`` are the prompt
tokens computed, ``cache_read_input_tokens`` those reused from the cache (their sum is the prompt).
Errors are ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pyggml.runner import CompletionChunk
from pyggml.server.chat import ChatPrompt, chat_prompt
from pyggml.server.models import served_for
from pyggml.server.params import (
    OPENAI_DEFAULTS,
    APIError,
    Fields,
    grammar_extension,
    json_output,
    read_json,
    sampling_values,
)
from pyggml.server.service import sse, stream_response
from pyggml.tools import ToolCall

_COMMON = {"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config", "metadata",
           "service_tier", "speed", "inference_geo", "cache_control", "diagnostics", "container", "mcp_servers",
           "context_management"}
# temperature, top_p and top_k: no longer in the client's own parameters (send them in extra_body)
MESSAGES_FIELDS = _COMMON | {"max_tokens", "stop_sequences", "stream", "temperature", "top_p", "top_k", "grammar"}
COUNT_FIELDS = _COMMON
BOUNDS = {"temperature": (0.0, 1.0), "top_p": (0.0, 1.0)}  # Anthropic's ranges
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               504: "timeout_error"}


async def messages(request: Request) -> Response:
    body = await read_json(request)
    f = Fields(body, "the request", MESSAGES_FIELDS)
    served = await served_for(request, body.get("model"))
    prompt = _prompt(f, served)
    if not f.has("max_tokens"):
        raise APIError(400, "max_tokens is required", param="max_tokens")
    max_tokens = f.integer("max_tokens", low=0)  # 0: only read the prompt into the cache
    sampling = {**OPENAI_DEFAULTS, **sampling_values(f, BOUNDS), **_output_format(f)}
    if f.has("stop_sequences"):
        sampling["stop"] = f.stops("stop_sequences")
    sampling = prompt.sampling(sampling)
    job = served.start(prompt.prepare(max_tokens, sampling))
    await job.started()
    head = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": served.name}
    output = prompt.output()
    if not f.boolean("stream", False):
        last = await job.result(request)
        thinking, text, calls = output.feed(last, last.text)
        content = ([_thinking_block(thinking)] if thinking else []) + \
            ([{"type": "text", "text": text}] if text else []) + [_tool_use(c) for c in calls]
        return JSONResponse({**head, "content": content, **_stop(last, calls), "usage": _usage(last)})

    async def events() -> AsyncIterator[str]:
        prompt_ids = job.request.prompt if isinstance(job.request.prompt, list) else []
        start = {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": len(prompt_ids), "output_tokens": 0}}
        yield sse({"type": "message_start", "message": start}, "message_start")
        yield sse({"type": "ping"}, "ping")
        opened: list[str] = []  # the kinds of the content blocks opened, the last one still open
        try:
            async for chunk in job.chunks():
                thinking, text, calls = output.feed(chunk, chunk.text)
                for kind, piece in (("thinking", thinking), ("text", text)):
                    if not piece:
                        continue
                    if not opened or opened[-1] != kind:  # a new block: close the one before
                        if opened:
                            yield _event("content_block_stop", index=len(opened) - 1)
                        opened.append(kind)
                        block = _thinking_block("") if kind == "thinking" else {"type": "text", "text": ""}
                        yield _event("content_block_start", index=len(opened) - 1, content_block=block)
                    yield _event("content_block_delta", index=len(opened) - 1,
                                 delta={"type": f"{kind}_delta", kind: piece})
                if not chunk.done:
                    continue
                if opened:
                    yield _event("content_block_stop", index=len(opened) - 1)
                for index, call in enumerate(calls, start=len(opened)):
                    yield _event("content_block_start", index=index, content_block={**_tool_use(call), "input": {}})
                    yield _event("content_block_delta", index=index,
                                 delta={"type": "input_json_delta", "partial_json": json.dumps(call.arguments)})
                    yield _event("content_block_stop", index=index)
                yield _event("message_delta", delta=_stop(chunk, calls), usage=_usage(chunk))
                yield _event("message_stop")
        except APIError as exc:
            yield sse(_error_body(exc), "error")

    return stream_response(job, events(), "text/event-stream")


async def count_tokens(request: Request) -> Response:
    """The prompt's tokens, counted in a thread (the event loop never tokenizes); a 400 with images, whose
    tokens are known only once the model reads them."""
    body = await read_json(request)
    f = Fields(body, "the request", COUNT_FIELDS)
    served = await served_for(request, body.get("model"))
    prompt = _prompt(f, served)
    if prompt.images:
        raise APIError(400, "count_tokens cannot count images (their tokens are known only when the model "
                       "reads them); count the text without them", param="messages")
    ids = await asyncio.to_thread(lambda: served.prompt_ids(prompt.text(), True))
    return JSONResponse({"input_tokens": len(ids)})


def _event(kind: str, **fields: Any) -> str:
    return sse({"type": kind, **fields}, kind)


def _thinking_block(thinking: str) -> dict[str, Any]:
    """A model's reasoning (unsigned: the signature is Anthropic's own, for its models)."""
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": f"toolu_{call.id.removeprefix('call_')}", "name": call.name,
            "input": call.arguments}


def _stop(chunk: CompletionChunk, calls: list[ToolCall]) -> dict[str, Any]:
    """``stop_reason`` and ``stop_sequence`` of a finished completion."""
    if calls:
        reason = "tool_use"
    elif chunk.finish_reason == "length":
        reason = "max_tokens"
    else:
        reason = "stop_sequence" if chunk.stop_sequence is not None else "end_turn"
    return {"stop_reason": reason, "stop_sequence": chunk.stop_sequence}


def _usage(chunk: CompletionChunk) -> dict[str, Any]:
    return {"input_tokens": chunk.prompt_tokens - chunk.cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": chunk.cached_tokens, "output_tokens": chunk.generated_tokens}


# ---- the request in chat-template terms -------------------------------------------------------------
def _prompt(f: Fields, served: Any) -> ChatPrompt:
    """The chat request of a Messages body; a last assistant message is its prefill."""
    thinking = Fields(f.mapping("thinking") or {}, "thinking", {"type", "budget_tokens", "display"}).string("type")
    if thinking not in (None, "enabled", "disabled", "adaptive"):
        raise APIError(400, 'thinking.type must be "enabled", "disabled" or "adaptive"', param="thinking")
    f.unsupported("container", what="is not supported by this server")
    f.unsupported("mcp_servers", what="(remote MCP servers) are not supported by this server")
    f.unsupported("context_management", what="is not supported by this server")
    raw = f.array("messages")
    if not raw:
        raise APIError(400, "messages must be a non-empty array", param="messages")
    chat = _system(f.data.get("system")) + _joined([m for i, message in enumerate(raw) for m in _message(message, i)])
    prefill = ""
    if raw[-1].get("role") == "assistant":
        last = chat.pop()
        if last.get("tool_calls"):
            raise APIError(400, "the last message is an assistant message with tool_use: answer it with a user "
                           "message of tool_result blocks", param="messages")
        prefill = last["content"]
    tools = [_tool(t, i) for i, t in enumerate(f.array("tools") or [])]
    think = {"enabled": True, "disabled": False}.get(thinking)  # adaptive: as the template does by default
    return chat_prompt(served, chat, tools, _tool_choice(f.mapping("tool_choice")), prefill, think)


def _output_format(f: Fields) -> dict[str, Any]:
    """``output_config.format`` (structured outputs: ``{"type": "json_schema", "schema": ...}``) as a grammar,
    or pyggml's ``grammar``; ``output_config.effort`` is a hint this server has no use for."""
    config = Fields(f.mapping("output_config") or {}, "output_config", {"effort", "format"})
    fmt = config.mapping("format")
    if fmt is None:
        return grammar_extension(f)
    if f.has("grammar"):
        raise APIError(400, "give output_config.format or grammar, not both", param="grammar")
    if Fields(fmt, "output_config.format", {"type", "schema"}).string("type") != "json_schema":
        raise APIError(400, 'output_config.format.type must be "json_schema"', param="output_config")
    return json_output(fmt.get("schema"), "output_config.format.schema")


def _joined(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive user turns as one, and an assistant's text followed by another assistant turn, as
    Anthropic combines them (many chat templates insist that roles alternate)."""
    out: list[dict[str, Any]] = []
    for message in chat:
        last = out[-1] if out else {}
        if last.get("role") == message["role"] == "user":
            last["content"] = _parts(last["content"]) + _parts(message["content"])
        elif last.get("role") == message["role"] == "assistant" and not last.get("tool_calls"):
            out[-1] = {**message, "content": last["content"] + (message["content"] or "")}
        else:
            out.append(message)
    return out


def _parts(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None or system == "":
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if isinstance(system, list) and all(isinstance(b, dict) and b.get("type") == "text" and isinstance(
            b.get("text"), str) for b in system):
        return [{"role": "system", "content": "\n".join(b["text"] for b in system)}]
    raise APIError(400, 'system must be a string or an array of {"type": "text", "text": ...} blocks', param="system")


def _message(message: Any, i: int) -> list[dict[str, Any]]:
    """The chat messages of one Anthropic message: a user message's ``tool_result`` blocks become
    ``role: tool`` messages (before its other blocks), an assistant's ``tool_use`` blocks its ``tool_calls``."""
    where = f"messages[{i}]"
    m = Fields(message, where, {"role", "content"})
    role, content = m.data.get("role"), m.data.get("content")
    if role not in ("user", "assistant"):
        raise APIError(400, f'{where}.role must be "user" or "assistant", got {role!r:.40}', param="messages")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list) or not content:
        raise APIError(400, f"{where}.content must be a string or a non-empty array of content blocks",
                       param="messages")
    parts, calls, results = [], [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and role == "user":
            parts.append(_image(block, at))
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input"), dict):
                raise APIError(400, f'{at}: a tool_use block needs a "name" and an "input" object', param="messages")
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": block["name"], "arguments": block["input"]}})
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, at))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier reasoning is not part of the prompt (chat templates drop it too)
        else:
            raise APIError(400, f"{at}: a {role} message cannot hold a {kind!r:.40} block here (this server "
                           "takes text, image, tool_use and tool_result blocks)", param="messages")
    if role == "assistant":
        text = "".join(p["text"] for p in parts)
        return [{"role": "assistant", "content": text or None, "tool_calls": calls} if calls else
                {"role": "assistant", "content": text}]
    return results + ([{"role": "user", "content": parts}] if parts else [])


def _image(block: dict[str, Any], at: str) -> dict[str, Any]:
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str):
        return {"type": "image", "image": source["data"]}
    if kind == "url" and isinstance(source.get("url"), str):  # refused with a clear message: never fetched
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise APIError(400, f'{at}: an image block needs a source {{"type": "base64", "media_type": ..., "data": ...}}',
                   param="messages")


def _tool_result(block: dict[str, Any], at: str) -> dict[str, Any]:
    content = block.get("content", "")
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image":
                parts.append(_image(part, f"{at}.content[{k}]"))
            else:
                raise APIError(400, f"{at}.content[{k}] must be a text or image block", param="messages")
        content = parts
    elif not isinstance(content, str):
        raise APIError(400, f"{at}.content must be a string or an array of blocks", param="messages")
    if block.get("is_error") is True:  # the templates have no error flag: say it in the text
        content = [{"type": "text", "text": "Error: "}, *content] if isinstance(content, list) else f"Error: {content}"
    if not isinstance(block.get("tool_use_id"), str):
        raise APIError(400, f"{at}: a tool_result block needs its tool_use_id", param="messages")
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _tool(tool: Any, i: int) -> dict[str, Any]:
    """An Anthropic client tool as an OpenAI function tool (server tools are refused)."""
    t = Fields(tool, f"tools[{i}]", {"name", "description", "input_schema", "type", "cache_control", "strict",
                                     "allowed_callers", "defer_loading", "eager_input_streaming", "input_examples"})
    if t.string("type", "custom") != "custom":
        raise APIError(400, f"tools[{i}]: {tool['type']!r:.40} tools (run by Anthropic's servers) are not "
                       "supported; give client tools with a name and an input_schema", param="tools")
    schema = t.mapping("input_schema")
    if schema is None or not t.string("name"):
        raise APIError(400, f"tools[{i}] needs a name and an input_schema", param="tools")
    return {"type": "function", "function": {"name": tool["name"], "description": t.string("description", ""),
                                             "parameters": schema}}


def _tool_choice(choice: dict[str, Any] | None) -> Any:
    """Anthropic's ``tool_choice`` in OpenAI's terms."""
    if choice is None:
        return None
    c = Fields(choice, "tool_choice", {"type", "name", "disable_parallel_tool_use"})
    kind = c.string("type")
    if kind == "tool" and c.string("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    if kind in ("auto", "none", "any"):
        return "required" if kind == "any" else kind
    raise APIError(400, 'tool_choice must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}',
                   param="tool_choice")


# ---- errors ------------------------------------------------------------------------------------------
def _error_body(exc: APIError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def error_response(exc: APIError) -> Response:
    return JSONResponse(_error_body(exc), status_code=exc.status, headers=exc.headers)


routes = [
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
