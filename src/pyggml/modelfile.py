"""Ollama's Modelfile: ``parse`` reads one (``pyggml create NAME -f Modelfile``), ``render`` writes the
one ``ollama show --modelfile`` prints for a stored model, and ``check_parameters`` types a model's
parameters as Ollama's options do (the params layer holds them as JSON numbers, booleans and a list
of stop strings).

Commands (case-insensitive), one per line, ``#`` starts a comment: ``FROM`` (a GGUF file or a stored
model; a second ``FROM``: a vision model's projector GGUF), ``PARAMETER NAME VALUE`` (``stop`` may
repeat), ``SYSTEM``, ``TEMPLATE``, ``LICENSE`` (may repeat), ``MESSAGE ROLE TEXT``; a value may be
quoted, ``\"\"\"`` quotes span lines. ``ADAPTER`` (LoRA) is refused: pyggml does not apply adapters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

INT_PARAMETERS = frozenset({"num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "num_keep", "seed",
                            "num_predict", "top_k", "repeat_last_n"})
FLOAT_PARAMETERS = frozenset({"temperature", "top_p", "min_p", "typical_p", "repeat_penalty", "presence_penalty",
                              "frequency_penalty"})
BOOL_PARAMETERS = frozenset({"use_mmap"})
PARAMETER_NAMES = INT_PARAMETERS | FLOAT_PARAMETERS | BOOL_PARAMETERS | {"stop"}
MESSAGE_ROLES = ("system", "user", "assistant", "tool")
COMMANDS = ("from", "parameter", "system", "template", "license", "message", "adapter")


@dataclass
class Modelfile:
    """What a Modelfile (or a ``/api/create`` request) asks for; ``None`` and empty mean "as the base"."""

    base: str | None = None  # FROM: a GGUF path or a stored model's name
    projector: str | None = None  # a second FROM: a vision model's projector (mmproj) GGUF
    parameters: dict[str, Any] = field(default_factory=dict)
    system: str | None = None
    template: str | None = None
    license: list[str] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)


def parse(text: str) -> Modelfile:
    """The ``Modelfile`` of ``text``; ``ValueError`` naming the line of the first mistake."""
    out, params = Modelfile(), []
    reader = _Reader(text)
    while reader.next_command():
        line, command = reader.line, reader.word().lower()
        if command not in COMMANDS:
            raise ValueError(f"Modelfile line {line}: unknown command {command.upper()!r} (known: "
                             f"{', '.join(c.upper() for c in COMMANDS)})")
        if command == "adapter":
            raise ValueError(f"Modelfile line {line}: ADAPTER is not supported: pyggml does not apply LoRA "
                             "adapters (merge the adapter into the weights, then use FROM)")
        if command == "parameter":
            name = reader.word()
            params.append((name, reader.value(f"PARAMETER {name}")))
        elif command == "message":
            role = reader.word().lower()
            if role not in MESSAGE_ROLES:
                raise ValueError(f"Modelfile line {line}: MESSAGE role must be one of {', '.join(MESSAGE_ROLES)}, "
                                 f"got {role!r}")
            out.messages.append({"role": role, "content": reader.value("MESSAGE")})
        elif command == "license":
            out.license.append(reader.value("LICENSE"))
        else:
            value = reader.value(command.upper())
            if command == "from" and out.base is None:
                out.base = value
            elif command == "from" and out.projector is None:
                out.projector = value
            elif command == "from":
                raise ValueError(f"Modelfile line {line}: a third FROM: give the model, then at most a vision "
                                 "projector (mmproj) GGUF")
            else:
                setattr(out, command, value)
    if out.base is None:
        raise ValueError("the Modelfile has no FROM line: name a GGUF file or a stored model (FROM ./model.gguf)")
    out.parameters = parse_parameters(params)
    return out


def parse_parameters(pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """``PARAMETER`` lines (name, text) as the params layer's JSON values; ``stop`` lines gather in a list."""
    out: dict[str, Any] = {}
    for name, text in pairs:
        if name == "stop":
            out.setdefault("stop", []).append(text)
        else:
            out[name] = _typed(name, text)
    return check_parameters(out)


def check_parameters(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` (JSON values, or text from a Modelfile) typed as Ollama's options; ``ValueError`` for an
    unknown name or a value of the wrong type."""
    out: dict[str, Any] = {}
    for name, value in params.items():
        if name not in PARAMETER_NAMES:
            raise ValueError(f"unknown parameter {name!r} (known: {', '.join(sorted(PARAMETER_NAMES))})")
        if name == "stop":
            stops = [value] if isinstance(value, str) else value
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
                raise ValueError(f"parameter stop must be a string or a list of strings, got {value!r:.60}")
            out[name] = list(stops)
        else:
            out[name] = _typed(name, value)
    return out


def _typed(name: str, value: Any) -> Any:
    if name not in PARAMETER_NAMES or name == "stop":
        raise ValueError(f"unknown parameter {name!r} (known: {', '.join(sorted(PARAMETER_NAMES))})")
    try:
        if name in BOOL_PARAMETERS:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "false"):
                return str(value).lower() == "true"
            raise ValueError
        if isinstance(value, bool):
            raise ValueError
        if name in INT_PARAMETERS:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value) if not isinstance(value, str) else int(value.strip())
        number = float(value)
        if number != number or number in (float("inf"), float("-inf")):
            raise ValueError
        return number
    except (TypeError, ValueError):
        kind = "an integer" if name in INT_PARAMETERS else "true or false" if name in BOOL_PARAMETERS else "a number"
        raise ValueError(f"parameter {name} must be {kind}, got {value!r:.60}") from None


def render(name: str, path: str, *, template: str | None = None, system: str | None = None,
           parameters: dict[str, Any] | None = None, license: list[str] | str | None = None,
           messages: list[dict[str, Any]] | None = None) -> str:
    """The Modelfile of a stored model, as ``ollama show --modelfile`` writes it."""
    lines = ["# Modelfile generated by \"pyggml show\"", "# To build a new Modelfile based on this, replace FROM with:",
             f"# FROM {name}", "", f"FROM {path}"]
    if template:
        lines.append(f'TEMPLATE {_quote(template)}')
    if system:
        lines.append(f'SYSTEM {_quote(system)}')
    for key, value in (parameters or {}).items():
        for item in value if isinstance(value, list) else [value]:
            text = json.dumps(item) if isinstance(item, bool) else str(item)
            needs_quotes = not text or any(c.isspace() or c in '#"' for c in text)
            lines.append(f"PARAMETER {key} {_quote(text) if needs_quotes else text}")
    for text in [license] if isinstance(license, str) else license or []:
        lines.append(f"LICENSE {_quote(text)}")
    for message in messages or []:
        lines.append(f"MESSAGE {message.get('role')} {_quote(str(message.get('content', '')))}")
    return "\n".join(lines) + "\n"


def parameters_text(parameters: dict[str, Any]) -> str:
    """``/api/show``'s ``parameters``: one ``name value`` line per value, names padded as Ollama pads them."""
    rows = [(k, json.dumps(v) if isinstance(v, (str, bool)) else str(v))
            for k, values in parameters.items() for v in (values if isinstance(values, list) else [values])]
    return "\n".join(f"{k:<30}{v}" for k, v in rows)


def _quote(text: str) -> str:
    return f'"""{text}"""' if '"""' not in text and not text.endswith('"') else json.dumps(text)


class _Reader:
    """Walks a Modelfile: commands at line starts, words, and values (bare to the end of the line,
    ``"quoted"`` or ``\"\"\"quoted over lines\"\"\"``)."""

    def __init__(self, text: str):
        self.text, self.pos, self.line = text.replace("\r\n", "\n"), 0, 1

    def next_command(self) -> bool:
        """Skip blank lines and comments; whether a command follows."""
        while self.pos < len(self.text):
            char = self.text[self.pos]
            if char == "\n":
                self.line += 1
                self.pos += 1
            elif char.isspace():
                self.pos += 1
            elif char == "#":
                end = self.text.find("\n", self.pos)
                self.pos = len(self.text) if end < 0 else end
            else:
                return True
        return False

    def _skip_blanks(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \t":
            self.pos += 1

    def word(self) -> str:
        self._skip_blanks()
        start = self.pos
        while self.pos < len(self.text) and not self.text[self.pos].isspace():
            self.pos += 1
        return self.text[start:self.pos]

    def value(self, what: str) -> str:
        self._skip_blanks()
        rest, line = self.text[self.pos:], self.line
        if rest.startswith('"""'):
            end = rest.find('"""', 3)
            if end < 0:
                raise ValueError(f"Modelfile line {line}: {what}: the \"\"\" quote is never closed")
            value, self.pos = rest[3:end], self.pos + end + 3
        elif rest.startswith('"'):
            try:
                value, length = json.JSONDecoder().raw_decode(rest)
            except ValueError:
                raise ValueError(f"Modelfile line {line}: {what}: the quote is never closed") from None
            self.pos += length
        else:
            end = rest.find("\n")
            value = (rest if end < 0 else rest[:end]).strip()
            self.pos += len(rest) if end < 0 else end
        self.line += value.count("\n")
        if not value:
            raise ValueError(f"Modelfile line {line}: {what} needs a value")
        return value
