"""OpenAI's Responses API, stateless: ``POST /v1/responses``.

``input`` (a string, or input items: messages with ``input_text``/``input_image`` parts, earlier
``function_call`` and ``function_call_output`` items) and ``instructions`` become a chat request in the
template's terms (``pyggml.server.chat``), as chat completions do; ``text.format`` constrains the output
as ``response_format`` does. Nothing is stored: ``previous_response_id`` is refused (send the whole
conversation), and the answer says ``store: false``. Streams are server-sent events named by their
``type`` (response.created, response.output_item.added, response.output_text.delta, ...,
response.completed or response.incomplete); tool calls are read from the output as it ends, so
``function_call`` items stream after the message; a thinking model's reasoning is a ``reasoning`` item
before it (``pyggml.thinking``). Errors are OpenAI's ``{"error": {...}}``; one in a
stream is an ``error`` event.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pyggml.runner import CompletionChunk
from pyggml.server.chat import ChatPrompt, chat_prompt, effort_think
from pyggml.server.models import served_for
from pyggml.server.params import (
    PYGGML_OPTIONS,
    SAMPLING_OPTIONS,
    APIError,
    Fields,
    grammar_extension,
    json_output,
    openai_max_tokens,
    openai_sampling,
    read_json,
)
from pyggml.server.service import sse, stream_response
from pyggml.tools import ToolCall

RESPONSE_FIELDS = SAMPLING_OPTIONS | PYGGML_OPTIONS | {
    "model", "input", "instructions", "tools", "tool_choice", "text", "max_output_tokens", "stream", "store",
    "metadata", "parallel_tool_calls", "previous_response_id", "reasoning", "truncation", "user", "include",
    "background", "top_logprobs", "service_tier", "prompt_cache_key", "safety_identifier", "stream_options",
    "conversation", "prompt", "max_tool_calls", "grammar",
}


async def responses(request: Request) -> Response:
    body = await read_json(request)
    f = Fields(body, "the request", RESPONSE_FIELDS)
    served = await served_for(request, body.get("model"))
    _check_fields(f)
    reasoning = Fields(f.mapping("reasoning") or {}, "reasoning", {"effort", "summary", "generate_summary"})
    prompt = _prompt(f, served, effort_think(served, reasoning.string("effort"), "reasoning.effort"))
    sampling = openai_sampling(f)
    sampling.update(_text_format(f))
    sampling = prompt.sampling(sampling)
    max_tokens = openai_max_tokens(f, "max_output_tokens")
    job = served.start(prompt.prepare(max_tokens, sampling))
    await job.started()
    snapshot = {
        "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
        "max_output_tokens": max_tokens, "model": served.name, "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True), "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None}, "store": False, "temperature": sampling.get("temperature"),
        "text": {"format": _format_echo(f)}, "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [], "top_p": sampling.get("top_p"), "truncation": "disabled", "usage": None,
        "user": body.get("user"), "metadata": body.get("metadata") or {},
    }
    ids = {"reasoning": f"rs_{uuid.uuid4().hex}", "message": f"msg_{uuid.uuid4().hex}"}
    output = prompt.output()

    def finished(chunk: CompletionChunk, thinking: str, text: str, calls: list[ToolCall]) -> dict[str, Any]:
        """The response once ``chunk`` ends it."""
        incomplete = chunk.finish_reason == "length" and not calls
        items = [_reasoning(ids["reasoning"], thinking)] if thinking else []
        items += [_message(ids["message"], text, incomplete)] if text or not calls else []
        return {**snapshot, "status": "incomplete" if incomplete else "completed",
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "output": items + [_function_call(c) for c in calls], "usage": _usage(chunk)}

    if not f.boolean("stream", False):
        last = await job.result(request)
        return JSONResponse(finished(last, *output.feed(last, last.text)))

    async def events() -> AsyncIterator[str]:
        numbers = iter(range(1 << 62))

        def event(kind: str, **fields: Any) -> str:
            return sse({"type": kind, "sequence_number": next(numbers), **fields}, kind)

        def begin(kind: str, index: int) -> list[str]:
            """The events that open the item of ``kind`` (reasoning or message) at ``index``."""
            where = {"item_id": ids[kind], "output_index": index, "content_index": 0}
            if kind == "reasoning":
                return [event("response.output_item.added", output_index=index,
                              item={**_reasoning(ids[kind], ""), "content": [], "status": "in_progress"})]
            return [event("response.output_item.added", output_index=index,
                          item={**_message(ids[kind], "", False), "status": "in_progress", "content": []}),
                    event("response.content_part.added", **where, part=_text_part(""))]

        def delta(kind: str, index: int, piece: str) -> str:
            where = {"item_id": ids[kind], "output_index": index, "content_index": 0}
            if kind == "reasoning":
                return event("response.reasoning_text.delta", **where, delta=piece)
            return event("response.output_text.delta", **where, delta=piece, logprobs=[])

        def end(item: dict[str, Any], index: int) -> list[str]:
            """The events that close ``item`` (as the response holds it) at ``index``."""
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            text = item["content"][0]["text"]
            if item["type"] == "reasoning":
                done = [event("response.reasoning_text.done", **where, text=text)]
            else:
                done = [event("response.output_text.done", **where, text=text, logprobs=[]),
                        event("response.content_part.done", **where, part=item["content"][0])]
            return [*done, event("response.output_item.done", output_index=index, item=item)]

        yield event("response.created", response=snapshot)
        yield event("response.in_progress", response=snapshot)
        opened: list[str] = []  # the kinds of the items opened, the last one still open
        said = {"reasoning": "", "message": ""}
        try:
            async for chunk in job.chunks():
                thinking, text, calls = output.feed(chunk, chunk.text)
                for kind, piece in (("reasoning", thinking), ("message", text)):
                    if not piece:
                        continue
                    if not opened or opened[-1] != kind:
                        for e in [*(end(_reasoning(ids["reasoning"], said["reasoning"]), 0) if opened else []),
                                  *begin(kind, len(opened))]:
                            yield e
                        opened.append(kind)
                    said[kind] += piece
                    yield delta(kind, len(opened) - 1, piece)
                if not chunk.done:
                    continue
                answer = finished(chunk, said["reasoning"], said["message"], calls)
                items = answer["output"]
                for index, item in enumerate(items):
                    kind = item["type"]
                    if kind in ("reasoning", "message"):
                        if index >= len(opened):  # an item with no text streamed (an empty answer)
                            for e in begin(kind, index):
                                yield e
                            opened.append(kind)
                        if index == len(opened) - 1:  # the one still open
                            for e in end(item, index):
                                yield e
                        continue
                    at = {"item_id": item["id"], "output_index": index}
                    yield event("response.output_item.added", output_index=index,
                                item={**item, "arguments": "", "status": "in_progress"})
                    yield event("response.function_call_arguments.delta", **at, delta=item["arguments"])
                    yield event("response.function_call_arguments.done", **at, name=item["name"],
                                arguments=item["arguments"])
                    yield event("response.output_item.done", output_index=index, item=item)
                yield event(f"response.{answer['status']}", response=answer)
        except APIError as exc:
            yield event("error", code=exc.code, message=exc.message, param=exc.param)

    return stream_response(job, events(), "text/event-stream")


def _reasoning(item_id: str, text: str) -> dict[str, Any]:
    """A model's thinking (its own words, not a summary)."""
    return {"type": "reasoning", "id": item_id, "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": text}]}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(item_id: str, text: str, incomplete: bool) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": "incomplete" if incomplete else "completed",
            "role": "assistant", "content": [_text_part(text)]}


def _function_call(call: ToolCall) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}", "call_id": call.id,
            "name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False), "status": "completed"}


def _usage(chunk: CompletionChunk) -> dict[str, Any]:
    return {"input_tokens": chunk.prompt_tokens, "input_tokens_details": {"cached_tokens": chunk.cached_tokens},
            "output_tokens": chunk.generated_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chunk.prompt_tokens + chunk.generated_tokens}


def _check_fields(f: Fields) -> None:
    """The fields this server reads only to echo or ignore, checked; those it cannot honour refused."""
    f.boolean("store"), f.boolean("parallel_tool_calls"), f.mapping("metadata"), f.string("user")
    Fields(f.mapping("stream_options") or {}, "stream_options", {"include_obfuscation"})
    f.unsupported("previous_response_id", what="is not supported: this server stores no responses; send the "
                  "whole conversation as input items")
    f.unsupported("conversation", what="is not supported: this server stores no conversations; send the whole "
                  "conversation as input items")
    f.unsupported("prompt", what="(stored prompt templates) is not supported by this server")
    f.unsupported("background", (False,), "is not supported: responses are answered in the request")
    f.unsupported("include", what="is not supported by this server (no reasoning, logprobs or tool outputs "
                  "to include)")
    f.unsupported("top_logprobs", (0,), "is not supported on /v1/responses; use /v1/chat/completions")
    f.unsupported("truncation", ("disabled",), 'must be "disabled"')
    f.unsupported("max_tool_calls", what="is not supported by this server")


# ---- the request in chat-template terms -------------------------------------------------------------
def _prompt(f: Fields, served: Any, think: bool | None) -> ChatPrompt:
    instructions = f.string("instructions")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    value = f.data.get("input")
    if isinstance(value, str) and value:
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list) and value:
        for i, item in enumerate(value):
            _item(messages, item, f"input[{i}]")
    else:
        raise APIError(400, "input must be a non-empty string or a non-empty array of input items", param="input")
    tools = [_tool(t, i) for i, t in enumerate(f.array("tools") or [])]
    return chat_prompt(served, messages, tools, _tool_choice(f.data.get("tool_choice")), think=think)


def _item(messages: list[dict[str, Any]], item: Any, where: str) -> None:
    """Add one input item to the chat ``messages``: a message, or a call (joined to the assistant
    message before it) or its output (a ``role: tool`` message)."""
    kind = item.get("type", "message") if isinstance(item, dict) else None
    if kind == "message":
        m = Fields(item, where, {"type", "role", "content", "id", "status"})
        role = m.data.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise APIError(400, f'{where}.role must be "user", "assistant", "system" or "developer", got '
                           f"{role!r:.40}", param="input")
        messages.append({"role": role, "content": _content(m.data.get("content"), f"{where}.content")})
    elif kind == "function_call":
        c = Fields(item, where, {"type", "call_id", "name", "arguments", "id", "status"})
        if not c.string("call_id") or not c.string("name") or c.string("arguments") is None:
            raise APIError(400, f"{where}: a function_call item needs call_id, name and arguments", param="input")
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        if messages and messages[-1]["role"] == "assistant":  # the text the model wrote before, or another call
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        o = Fields(item, where, {"type", "call_id", "output", "id", "status"})
        if not o.string("call_id") or o.data.get("output") is None:
            raise APIError(400, f"{where}: a function_call_output item needs call_id and output", param="input")
        messages.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": _content(item["output"], f"{where}.output")})
    elif kind == "reasoning":
        return  # earlier reasoning is not part of the prompt (chat templates drop it too)
    else:
        raise APIError(400, f"{where}: {kind!r:.40} items are not supported (this server takes messages, "
                       "function_call and function_call_output items)", param="input")


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content in chat parts: ``input_text``/``output_text``/``refusal`` text, ``input_image``
    images (a data: URL; remote ones are refused where images are read)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or an array of content parts", param="input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise APIError(400, f"{where}[{j}] must be an input_text, output_text or input_image part (an image "
                           "as a data: URL in image_url)", param="input")
    return parts


def _tool(tool: Any, i: int) -> dict[str, Any]:
    """A Responses function tool (flat: name, parameters) as a chat one; built-in tools are refused."""
    t = Fields(tool, f"tools[{i}]", {"type", "name", "description", "parameters", "strict"})
    if t.string("type") != "function":
        raise APIError(400, f'tools[{i}]: only "function" tools are supported (built-in tools run on OpenAI\'s '
                       "servers)", param="tools")
    fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _tool_choice(choice: Any) -> Any:
    """A Responses ``tool_choice`` in chat terms."""
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    raise APIError(400, 'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
                   param="tool_choice")


# ---- text.format ---------------------------------------------------------------------------------------
def _text_format(f: Fields) -> dict[str, Any]:
    """``text.format``: text, ``json_object`` or ``json_schema`` (flat: name, schema, strict); or pyggml's
    ``grammar``."""
    fmt = Fields(f.mapping("text") or {}, "text", {"format", "verbosity"}).mapping("format")
    kind = Fields(fmt, "text.format", {"type", "name", "schema", "strict", "description"}).string("type") \
        if fmt is not None else "text"
    if kind == "text":
        return grammar_extension(f)
    if f.has("grammar"):
        raise APIError(400, "give text.format or grammar, not both", param="grammar")
    if kind == "json_object":
        return json_output(None, "text.format")
    if kind == "json_schema":
        return json_output(fmt.get("schema"), "text.format.schema")
    raise APIError(400, 'text.format.type must be "text", "json_object" or "json_schema"', param="text")


def _format_echo(f: Fields) -> dict[str, Any]:
    return ((f.data.get("text") or {}).get("format")) or {"type": "text"}


routes = [Route("/v1/responses", responses, methods=["POST"])]
