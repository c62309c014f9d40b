"""One chat request, whichever API it came in by: its messages in the chat template's terms (OpenAI's
chat shape: roles, text and image parts, assistant ``tool_calls``, ``role: tool`` results), its images,
its tools and a forced call. OpenAI's chat completions, Anthropic's Messages and OpenAI's Responses each
translate their own shapes into it; the checks, the prompt, the forced-call grammar and the reading of
calls from the output live here once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pyggml.chat import validate_messages
from pyggml.image import split_chat_images
from pyggml.runner import CompletionChunk, CompletionRequest
from pyggml.server.params import APIError, runner_logprobs
from pyggml.server.service import ServedModel
from pyggml.thinking import LEVELS, Splitter, Think, splitter_for, template_harmony, template_thinks, template_variables
from pyggml.tools import (
    ToolCall,
    ToolOutput,
    check_tools,
    detect_format,
    forced_grammar,
    normalize_messages,
    tool_choice_name,
)


@dataclass
class ChatPrompt:
    """A checked chat request: ``messages`` with ``[img-N]`` markers where ``images`` go, ``tools``
    (OpenAI function tools, None without any) and ``forced``, the grammar of a call ``tool_choice`` forces."""

    served: ServedModel
    messages: list[dict[str, Any]]
    images: list[bytes]
    tools: list[dict[str, Any]] | None
    forced: Any = None
    prefill: str = ""  # the start of the answer, which the model continues
    think: Think = None  # Ollama's think (None: the template's default)
    rendered: str = ""  # the prompt as rendered (set by ``prepare``): a <think> block it opened is read on

    @property
    def thinks(self) -> bool:
        """Whether the model thinks aloud (its template speaks of ``<think>`` blocks or harmony channels)."""
        return template_thinks(self.served.template.source)

    def text(self) -> str:
        """The prompt: the rendered messages, then the prefill."""
        variables = template_variables(self.served.template.source, self.think)
        return self.served.render(self.messages, tools=self.tools, **variables) + self.prefill

    def sampling(self, options: dict[str, Any]) -> dict[str, Any]:
        """``options`` with the forced call's grammar (400 beside an output format or grammar of the request's)."""
        if self.forced is None:
            return options
        if "format" in options or "grammar" in options:
            raise APIError(400, "a forced tool call (tool_choice) cannot have an output format or grammar too",
                           param="tool_choice")
        return {**options, "grammar": self.forced}

    def prepare(self, max_tokens: int | None, options: dict[str, Any],
                logprobs: int | None = None) -> Callable[[], CompletionRequest]:
        """The job's ``prepare``: renders and tokenizes on the job's thread (``options`` from ``sampling``)."""
        served, lp = self.served, runner_logprobs(logprobs)

        def prepare() -> CompletionRequest:
            text = self.rendered = self.text()
            if self.images:
                return served.image_request(text, True, self.images, max_tokens, logprobs=lp, **options)
            return served.request(served.prompt_ids(text, True), max_tokens, logprobs=lp, **options)

        return prepare

    def output(self) -> ChatOutput:
        """A reader of this completion's output (after ``prepare`` has run)."""
        return ChatOutput(self)


class ChatOutput:
    """A chat completion's output chunk by chunk: the thinking of a model that thinks, the content, and
    at the end the tool calls (read from the content: a call inside the thinking is no call). Formats that
    read calls from the raw tokens (``ToolFormat.raw``) see the thinking too."""

    def __init__(self, prompt: ChatPrompt):
        self.prompt = prompt
        self.splitter: Splitter | None = None
        self.tools = ToolOutput(detect_format(prompt.served.template.source), prompt.served.tokenizer) \
            if prompt.tools else None

    def feed(self, chunk: CompletionChunk, text: str) -> tuple[str, str, list[ToolCall]]:
        """(thinking, content, calls) of one chunk; calls come with the last chunk only."""
        thinking = ""
        if self.prompt.thinks:
            if self.splitter is None:  # known once the prompt is rendered
                self.splitter = splitter_for(self.prompt.served.template.source, self.prompt.rendered)
            thinking, text = self.splitter.feed(text)
            if chunk.done:
                more, rest = self.splitter.flush()
                thinking, text = thinking + more, text + rest
        calls: list[ToolCall] = []
        if self.tools is not None:
            text, calls = self.tools.feed(chunk, text)
        return thinking, text, calls


def chat_prompt(served: ServedModel, messages: Any, tools: Any = None, tool_choice: Any = None,
                prefill: str = "", think: Think = None) -> ChatPrompt:
    """``messages``, ``tools`` and ``tool_choice`` in OpenAI's chat shape, checked (400 naming the field);
    ``prefill``: the start of the answer; ``think``: whether (or for gpt-oss, how much) a model that thinks
    should (None: as its template does by default; thinking asked of a model that does not think is a 400)."""
    think_variables(served, think)
    try:
        forced, name = tool_choice_name(tool_choice)
    except ValueError as exc:
        raise APIError(400, str(exc), param="tool_choice") from None
    try:
        tools = check_tools(tools) if tool_choice != "none" else []
    except ValueError as exc:
        raise APIError(400, str(exc), param="tools") from None
    try:
        messages, images = split_chat_images(messages) if isinstance(messages, list) else (messages, [])
        messages = normalize_messages(validate_messages(messages))
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from None
    grammar = None
    if forced:
        try:
            grammar = forced_grammar(detect_format(served.template.source), tools, name).named("tools")
        except ValueError as exc:
            raise APIError(400, str(exc), param="tool_choice") from None
    return ChatPrompt(served, messages, images, tools or None, grammar, prefill, think)


def think_variables(served: ServedModel, think: Think) -> dict[str, Any]:
    """The chat template variables of ``think``; 400 when the model cannot think as asked."""
    if think and not template_thinks(served.template.source):
        raise APIError(400, f"model {served.name!r} does not think (its chat template has no <think> block "
                       "or harmony channels)", param="think")
    try:
        return template_variables(served.template.source, think)
    except ValueError as exc:
        raise APIError(400, str(exc), param="think") from None


def effort_think(served: ServedModel, effort: str | None, field: str) -> Think:
    """OpenAI's reasoning effort for a model that thinks: "none" (or "minimal") turns the thinking off, any
    other level on (gpt-oss takes "low", "medium" and "high" as they are); a 400 for a model that does not think."""
    if effort is None:
        return None
    if not template_thinks(served.template.source):
        raise APIError(400, f"{field} is not supported: the model does not reason", param=field.split(".")[0])
    if template_harmony(served.template.source) and effort in LEVELS:
        return effort
    return effort not in ("none", "minimal")
