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
from pyggml.runner import CompletionRequest
from pyggml.server.params import APIError, runner_logprobs
from pyggml.server.service import ServedModel
from pyggml.tools import (
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

    def text(self) -> str:
        """The prompt: the rendered messages, then the prefill."""
        return self.served.render(self.messages, tools=self.tools) + self.prefill

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
            text = self.text()
            if self.images:
                return served.image_request(text, True, self.images, max_tokens, logprobs=lp, **options)
            return served.request(served.prompt_ids(text, True), max_tokens, logprobs=lp, **options)

        return prepare

    def tool_output(self) -> ToolOutput | None:
        """A reader of this completion's calls (None without tools: all output is content)."""
        if not self.tools:
            return None
        return ToolOutput(detect_format(self.served.template.source), self.served.tokenizer)


def chat_prompt(served: ServedModel, messages: Any, tools: Any = None, tool_choice: Any = None,
                prefill: str = "") -> ChatPrompt:
    """``messages``, ``tools`` and ``tool_choice`` in OpenAI's chat shape, checked (400 naming the field);
    ``prefill``: the start of the answer."""
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
    return ChatPrompt(served, messages, images, tools or None, grammar, prefill)
