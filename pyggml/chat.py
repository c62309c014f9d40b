"""Chat prompts: render a list of messages with the model's chat template.

GGUF files carry the Hugging Face Jinja template under ``tokenizer.chat_template`` (named
variants under ``tokenizer.chat_template.<name>``). Templates come from model files, so they
run in jinja2's immutable sandbox: no attribute starting with ``_``, no mutation of the
messages, no file or module access. The variables are those Hugging Face provides:
``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``tools``, the
``raise_exception(msg)`` and ``strftime_now(fmt)`` functions and a ``tojson`` filter that
keeps non-ASCII text as it is. A model without a template gets ``FALLBACK_TEMPLATE``: a plain
transcript (a model without one was not trained on chat markup).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

__all__ = ["FALLBACK_TEMPLATE", "ROLES", "ChatTemplate", "ChatTemplateError", "encode_prompt", "validate_messages"]

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "ipython"})

FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% else %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


class ChatTemplateError(ValueError):
    """A template that does not compile, fails while rendering, or rejects the messages."""


class ChatTemplate:
    """A compiled chat template. ``source=None`` uses ``FALLBACK_TEMPLATE``."""

    def __init__(self, source: str | None = None, *, bos_token: str = "", eos_token: str = ""):
        self.source = source if source else FALLBACK_TEMPLATE
        self.is_fallback = not source
        self.bos_token, self.eos_token = bos_token, eos_token
        self._template = _compile(self.source)

    @classmethod
    def from_model(cls, model: Any, name: str | None = None) -> ChatTemplate:
        """The template of a loaded model (``model.config``, ``model.tokenizer``); ``name`` picks a
        named variant such as "tool_use" when the file has one."""
        config = model.config
        key = f"tokenizer.chat_template.{name}" if name else "tokenizer.chat_template"
        if name and key not in config:
            raise ChatTemplateError(f"the model has no chat template named {name!r}")
        source = config.get(key) or None
        tokenizer = getattr(model, "tokenizer", None)
        return cls(source, bos_token=_token_text(tokenizer, "bos"), eos_token=_token_text(tokenizer, "eos"))

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **variables: Any) -> str:
        """The prompt text for ``messages`` (checked with ``validate_messages``)."""
        messages = validate_messages(messages)
        if tools is not None and (isinstance(tools, (str, Mapping)) or not isinstance(tools, Sequence)):
            raise ValueError("tools must be a list of tool definitions")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token,
                                         tools=list(tools) if tools is not None else None, **variables)
        except ChatTemplateError:
            raise
        except Exception as exc:  # jinja2's SecurityError, UndefinedError, TypeError from the template, ...
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check chat messages and return plain-dict copies; text-part lists become one string.

    Each message is a mapping with a ``role`` in ``ROLES`` and a ``content`` that is a string,
    a list of ``{"type": "text", "text": ...}`` parts, or (for an assistant message with
    ``tool_calls``) None. Other keys (``name``, ``tool_calls``, ``tool_call_id``) pass through.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of messages, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must not be empty")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ValueError(f"{where} must be a mapping with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}: role must be one of {', '.join(sorted(ROLES))}; got {role!r}")
        message = dict(message)
        content = message.get("content")
        if content is None:
            if not (role == "assistant" and message.get("tool_calls")):
                raise ValueError(f"{where}: content is missing (only an assistant message with tool_calls may "
                                 "have none)")
        elif isinstance(content, str):
            pass
        elif isinstance(content, Sequence) and not isinstance(content, bytes):
            message["content"] = _join_parts(content, where)
        else:
            raise ValueError(f"{where}: content must be a string or a list of text parts, got "
                             f"{type(content).__name__}")
        calls = message.get("tool_calls")
        if calls is not None and (isinstance(calls, (str, Mapping)) or not isinstance(calls, Sequence)):
            raise ValueError(f"{where}: tool_calls must be a list")
        out.append(message)
    return out


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a rendered prompt: special-token texts become tokens, and the BOS the
    tokenizer adds is not doubled when the template already wrote one."""
    ids = tokenizer.encode(text, add_special=True)
    if len(ids) > 1 and tokenizer.bos is not None and ids[0] == ids[1] == tokenizer.bos:
        del ids[0]
    return ids


def _join_parts(parts: Sequence[Any], where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(f"{where}.content[{j}]: only {{'type': 'text', 'text': str}} parts are supported, "
                             f"got {kind!r}")
        texts.append(part["text"])
    return "\n".join(texts)


def _token_text(tokenizer: Any, which: str) -> str:
    tid = getattr(tokenizer, which, None)
    return tokenizer.vocab.tokens[tid] if tid is not None else ""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    try:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:  # pragma: no cover - jinja2 is a dependency
        raise ImportError("chat templates need jinja2 (pip install jinja2)") from exc
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    env.filters["tojson"] = _tojson
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
