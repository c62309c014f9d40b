"""Chat prompts: render a list of messages with the model's chat template.

GGUF files carry the Hugging Face Jinja template under ``tokenizer.chat_template`` (named
variants under ``tokenizer.chat_template.<name>``). Templates come from model files, so they
run in jinja2's immutable sandbox: no attribute starting with ``_``, no mutation of the
messages, no file or module access. The variables are those Hugging Face provides:
``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``tools``, the
``raise_exception(msg)`` and ``strftime_now(fmt)`` functions and a ``tojson`` filter that
keeps non-ASCII text as it is. A model without a template gets ``FALLBACK_TEMPLATE``: a plain
transcript (a model without one was not trained on chat markup).

A template is a program from a file, so rendering is bounded: at most ``MAX_TEMPLATE_OPS`` loop
steps and calls, for at most ``MAX_TEMPLATE_SECONDS``, and no string, list
or output grows past ``max_chars`` (operators, filters and string methods that could make one
larger are refused before they run); breaking a limit raises ``ChatTemplateError``.
"""

from __future__ import annotations

import datetime
import functools
import json
import re
import threading
import time
from collections.abc import Mapping, Sequence, Sized
from functools import lru_cache
from typing import Any

__all__ = ["FALLBACK_TEMPLATE", "MAX_TEMPLATE_CHARS", "MAX_TEMPLATE_OPS", "MAX_TEMPLATE_SECONDS", "ROLES",
           "ChatTemplate", "ChatTemplateError", "encode_prompt", "validate_messages"]

MAX_TEMPLATE_OPS = 1_000_000  # loop steps and calls one render may make
MAX_TEMPLATE_SECONDS = 5.0  # and for how long
MAX_TEMPLATE_CHARS = 1 << 24  # default bound on the output and on any string or list made on the way
MIN_TEMPLATE_CHARS = 1 << 20  # the least room a caller should give (real templates build their prompt in less)
_MAX_INT_BITS = 1 << 16  # integers a template may compute

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
               tools: Sequence[Mapping[str, Any]] | None = None, *, max_chars: int = MAX_TEMPLATE_CHARS,
               **variables: Any) -> str:
        """The prompt text for ``messages`` (checked with ``validate_messages``), at most
        ``max_chars`` characters long, rendered within the module's operation and time limits."""
        messages = validate_messages(messages)
        if tools is not None and (isinstance(tools, (str, Mapping)) or not isinstance(tools, Sequence)):
            raise ValueError("tools must be a list of tool definitions")
        budget = _Budget(max_chars)
        try:
            with budget:
                text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                             bos_token=self.bos_token, eos_token=self.eos_token,
                                             tools=list(tools) if tools is not None else None, **variables)
        except ChatTemplateError:
            raise
        except Exception as exc:  # jinja2's SecurityError, UndefinedError, TypeError from the template, ...
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        if budget.broken is not None:  # the template caught the error: the limit still holds
            raise budget.broken
        return text


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


def fill_in_the_middle(tokenizer: Any, prefix: str, suffix: str) -> list[int]:
    """Token ids of a fill-in-the-middle prompt, in the prefix-suffix-middle order code models are trained
    on (``<|fim_prefix|>`` prefix ``<|fim_suffix|>`` suffix ``<|fim_middle|>``, or the vocabulary's own
    tokens): the model then writes the middle. The texts' own special-token texts stay text.
    ``ValueError`` for a vocabulary without such tokens."""
    fim = tokenizer.vocab.fim
    if not all(role in fim for role in ("fim_pre", "fim_suf", "fim_mid")):
        raise ValueError("suffix (fill-in-the-middle) needs a model whose vocabulary has fill-in-the-middle "
                         "tokens (<|fim_prefix|>, <|fim_suffix|>, <|fim_middle|> or the like), as code models do; "
                         "this one has none")
    bos = [tokenizer.bos] if tokenizer.vocab.add_bos and tokenizer.bos is not None else []
    text = lambda t: tokenizer.encode(t, add_special=False, parse_special=False)  # noqa: E731
    return [*bos, fim["fim_pre"], *text(prefix), fim["fim_suf"], *text(suffix), fim["fim_mid"]]


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a rendered prompt: special-token texts become tokens, and the BOS the
    tokenizer adds is not doubled when the template already wrote one."""
    ids = tokenizer.encode(text, add_special=True)
    if len(ids) > 1 and tokenizer.bos is not None and ids[0] == ids[1] == tokenizer.bos:
        del ids[0]
    return ids


def strip_bos_text(tokenizer: Any, text: str) -> str:
    """A rendered prompt without the BOS text its template wrote, for a caller whose encoding adds the BOS."""
    bos = _token_text(tokenizer, "bos")
    return text[len(bos):] if bos and text.startswith(bos) else text


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


# ---- bounded rendering -----------------------------------------------------------------------------

_current = threading.local()  # the _Budget of the render running in this thread
_WIDTHS = re.compile(r"%[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")  # printf-style width and precision
_FORMAT_SPEC = re.compile(r"\{[^{}]*:([^{}]*)\}")


class _Budget:
    """The limits of one render: loop iterations and calls (the only ways a template repeats
    work), a deadline, and the size of what it makes. Installed for the render's thread."""

    def __init__(self, max_chars: int):
        if not isinstance(max_chars, int) or max_chars < 1:
            raise ValueError(f"max_chars must be an int >= 1, got {max_chars!r}")
        self.max_chars = max_chars
        self.ops = 0
        self.deadline = 0.0
        self.broken: ChatTemplateError | None = None

    def __enter__(self) -> _Budget:
        self.deadline = time.monotonic() + MAX_TEMPLATE_SECONDS
        self._previous = getattr(_current, "budget", None)
        _current.budget = self
        return self

    def __exit__(self, *exc: object) -> None:
        _current.budget = self._previous

    def tick(self) -> None:
        self.ops += 1
        if self.ops > MAX_TEMPLATE_OPS:
            self.fail(f"ran more than {MAX_TEMPLATE_OPS} operations (loop steps and calls)")
        if not self.ops & 255 and time.monotonic() > self.deadline:
            self.fail(f"ran longer than {MAX_TEMPLATE_SECONDS:g} s")

    def counted(self, iterable: Any) -> Any:
        for item in iterable:
            self.tick()
            yield item

    def fail(self, what: str) -> None:
        self.broken = ChatTemplateError(f"chat template {what}; it is not usable as it is")
        raise self.broken

    def size(self, n: int, what: str = "a value") -> None:
        if n > self.max_chars:
            self.fail(f"made {what} of {n} characters or items, more than its limit of {self.max_chars}")

    def result(self, value: Any) -> Any:
        """``value`` if it is within the size limits."""
        if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)):
            self.size(len(value))
        elif isinstance(value, int) and value.bit_length() > _MAX_INT_BITS:
            self.fail(f"made an integer of {value.bit_length()} bits")
        return value

    def before_binop(self, op: str, left: Any, right: Any) -> None:
        if op == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    self.size(len(seq) * n, "a repetition")
            if isinstance(left, int) and isinstance(right, int):
                self.bits(left.bit_length() + right.bit_length())
        elif op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            self.bits(max(left.bit_length() - 1, 0) * right)
        elif op == "%" and isinstance(left, str):
            self.printf(left)

    def bits(self, n: int) -> None:
        if n > _MAX_INT_BITS:
            self.fail(f"computed an integer of about {n} bits")

    def printf(self, fmt: str) -> None:
        for match in _WIDTHS.finditer(fmt):
            for field in match.groups():
                if field == "*" or (field and int(field) > self.max_chars):
                    self.fail(f"formatted with a width of {field}")

    def before_call(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Refuse the str methods that could make a string past the limit before they run."""
        func = getattr(func, "__wrapped__", func)  # the sandbox wraps str.format
        owner, name = getattr(func, "__self__", None), getattr(func, "__name__", "")
        if not isinstance(owner, str):
            return
        if name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
            self.size(args[0], "a padded string")
        elif name == "expandtabs":
            tab = args[0] if args else kwargs.get("tabsize", 8)
            if isinstance(tab, int):
                self.size(len(owner) + owner.count("\t") * tab, "an expanded string")
        elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
            self.replacement(owner, *args[:3])
        elif name == "join" and args and isinstance(args[0], (list, tuple)):
            self.joined(owner, args[0])
        elif name == "join":
            self.fail("joined something other than a list (use |list first)")
        elif name in ("format", "format_map"):
            for spec in _FORMAT_SPEC.findall(owner):
                if any(int(d) > self.max_chars for d in re.findall(r"\d+", spec)):
                    self.fail(f"formatted with the spec {spec[:20]!r}")
            for value in (*args, *kwargs.values()):
                if isinstance(value, int) and value > self.max_chars:
                    self.fail(f"formatted with an argument of {value}")

    def replacement(self, text: str, old: str, new: str, count: Any = -1) -> None:
        n = text.count(old) if old else len(text) + 1
        if isinstance(count, int) and count >= 0:
            n = min(n, count)
        self.size(len(text) + n * len(new), "a replaced string")

    def joined(self, sep: Any, items: Any) -> None:
        if isinstance(items, Sized) and isinstance(sep, str):
            self.size(len(sep) * len(items), "a joined string")
            if isinstance(items, (list, tuple)):
                self.size(sum(len(x) for x in items if isinstance(x, str)), "a joined string")

    def before_filter(self, name: str, args: tuple, kwargs: dict) -> None:
        """Filters get the value first, then their arguments: check the ones that size the result."""
        value, rest = (args[0], args[1:]) if args else (None, ())
        for extra in (*rest, *kwargs.values()):
            if isinstance(extra, int) and not isinstance(extra, bool) and extra > self.max_chars:
                self.fail(f"called the {name} filter with {extra}")
        if name == "indent" and isinstance(value, str):
            width = rest[0] if rest else kwargs.get("width", 4)
            pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
            self.size(len(value) + (value.count("\n") + 1) * pad, "an indented string")
        elif name == "replace" and isinstance(value, str) and len(rest) >= 2:
            self.replacement(value, str(rest[0]), str(rest[1]), rest[2] if len(rest) > 2 else -1)
        elif name == "join" and value is not None:
            self.joined(rest[0] if rest else kwargs.get("d", ""), value)
        elif name == "format" and isinstance(value, str):
            self.printf(value)


def _budget() -> _Budget | None:
    return getattr(_current, "budget", None)


def _bounded_filter(name: str, func: Any) -> Any:
    @functools.wraps(func)  # keeps jinja's pass_context/pass_environment marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        if budget is None:
            return func(*args, **kwargs)
        skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0
        if name == "join" and len(args) > skip and not isinstance(args[skip], Sized):
            args = (*args[:skip], list(args[skip]), *args[skip + 1:])  # a generator: size it first
        budget.before_filter(name, args[skip:], kwargs)
        return budget.result(func(*args, **kwargs))

    return bounded


@lru_cache(maxsize=1)
def _environment_class() -> type:
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generator(CodeGenerator):
        def visit_For(self, node: Any, frame: Any) -> None:  # every loop step counts
            counted = nodes.EnvironmentAttribute("counted", lineno=node.lineno)
            node.iter = nodes.Call(counted, [node.iter], [], None, None, lineno=node.lineno)
            super().visit_For(node, frame)

        def visit_Concat(self, node: Any, frame: Any) -> None:  # `a ~ b`: its result is checked too
            self.write("environment.bounded(")
            super().visit_Concat(node, frame)
            self.write(")")

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        """The immutable sandbox, with every call, sized operator and concatenation checked
        against the running render's ``_Budget``."""

        code_generator_class = Generator
        intercepted_binops = frozenset({"*", "**", "%", "+"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            budget = _budget()
            if budget is not None:
                budget.before_binop(operator, left, right)
            return self.bounded(super().call_binop(context, operator, left, right))

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            budget = _budget()
            if budget is not None:
                budget.tick()
                budget.before_call(__obj, args, kwargs)
            return __self.bounded(super().call(__context, __obj, *args, **kwargs))

        def counted(self, iterable: Any) -> Any:
            budget = _budget()
            return iterable if budget is None else budget.counted(iterable)

        def bounded(self, value: Any) -> Any:
            budget = _budget()
            return value if budget is None else budget.result(value)

        def concat(self, pieces: Any) -> str:  # the output, and every block or macro body
            budget = _budget()
            if budget is None:
                return "".join(pieces)
            out, size, limit = [], 0, budget.max_chars
            for piece in pieces:
                size += len(piece)
                if size > limit:
                    budget.size(size, "an output")
                out.append(piece)
            return "".join(out)

    return BoundedEnvironment


@lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    try:
        import jinja2
        from jinja2.ext import loopcontrols
    except ImportError as exc:  # pragma: no cover - jinja2 is a dependency
        raise ImportError("chat templates need jinja2 (pip install jinja2)") from exc
    env = _environment_class()(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    env.filters["tojson"] = _tojson
    for name, func in list(env.filters.items()):
        env.filters[name] = _bounded_filter(name, func)
    try:
        with _Budget(MAX_TEMPLATE_CHARS):  # jinja folds constant expressions while compiling: bound those too
            return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
