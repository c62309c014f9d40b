"""Tool calling: how each model family writes a tool call, read back into structured calls.

The chat template renders the tool definitions (templates receive ``tools``) and earlier calls and
results (assistant ``tool_calls``, ``role: tool`` messages). What the model writes back follows its
family's convention, recognised from the template's source, not the model's name:

- hermes (template has ``<tool_call>``: Qwen 2.5/3, Hermes):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
- mistral (``[TOOL_CALLS]``): ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` or ``[TOOL_CALLS]name[ARGS]{...}``
- harmony (``<|channel|>``: gpt-oss):
  ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``
- llama3 (``<|python_tag|>`` or Llama 3 headers with tools): ``{"name": ..., "parameters": {...}}``, ``;`` between
- gemma4 (``<|tool_call>``: Gemma 4): ``<|tool_call>call:NAME{key:value,...}<tool_call|>``, its values
  JSON-like with unquoted keys and strings between ``<|"|>`` marks (``city:<|"|>Paris<|"|>``)
- gemma (``tool_code`` or ``<start_of_turn>``): ```` ```tool_code\nname(a=1, b="x")\n``` ````
- json (anything else): ``{"name": ..., "arguments": {...}}`` or a list of them

``ToolCallParser`` reads the output as it streams: text before a call is content (passed on as it
comes), a call is held back and parsed at the end; output that does not parse stays content.
``forced_grammar`` makes the output one call (``tool_choice: "required"`` or a named function)
with the grammar machinery of ``pyggml.constrain``.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pyggml.constrain import Grammar, closed_objects


@dataclass(frozen=True)
class ToolFormat:
    name: str
    starts: tuple[str, ...]  # texts that begin a call anywhere in the output
    leading: tuple[str, ...] = ()  # texts that begin a call only at the start of the output
    raw: bool = False  # reads the output with its special tokens written out


FORMATS = {
    "hermes": ToolFormat("hermes", ("<tool_call>",), ("{",)),
    "mistral": ToolFormat("mistral", ("[TOOL_CALLS]",), ("[{", "{"), raw=True),
    "harmony": ToolFormat("harmony", ("<|channel|>commentary to=", "<|start|>assistant<|channel|>commentary"),
                          raw=True),
    "llama3": ToolFormat("llama3", ("<|python_tag|>",), ("{",), raw=True),
    "gemma4": ToolFormat("gemma4", ("<|tool_call>",)),
    "gemma": ToolFormat("gemma", ("```tool_code",), ("{",)),
    "json": ToolFormat("json", ("<tool_call>",), ("{", "[")),
}


def detect_format(template_source: str | None) -> ToolFormat:
    """The tool-call format a chat template's source speaks."""
    src = template_source or ""
    if "<|tool_call>" in src:
        return FORMATS["gemma4"]
    if "<tool_call>" in src:
        return FORMATS["hermes"]
    if "[TOOL_CALLS]" in src:
        return FORMATS["mistral"]
    if "<|channel|>" in src:
        return FORMATS["harmony"]
    if "<|python_tag|>" in src or ("<|start_header_id|>" in src and "tools" in src):
        return FORMATS["llama3"]
    if "tool_code" in src or "<start_of_turn>" in src:
        return FORMATS["gemma"]
    return FORMATS["json"]


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"call_{uuid.uuid4().hex[:24]}"

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}
        return out if index is None else {"index": index, **out}

    def ollama(self) -> dict[str, Any]:
        return {"function": {"name": self.name, "arguments": self.arguments}}


# ---- parsing ---------------------------------------------------------------------------------------
def parse(fmt: ToolFormat, text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output in format ``fmt``. Output that holds no well-formed call
    is all content."""
    try:
        content, calls = _PARSERS[fmt.name](text)
    except (ValueError, SyntaxError, TypeError, KeyError):
        return text, []
    if not calls:
        return (_harmony_content(text) if fmt.name == "harmony" else text), []
    return content, calls


def _call(obj: Any) -> ToolCall:
    if not isinstance(obj, Mapping) or not isinstance(obj.get("name"), str):
        raise ValueError("not a call")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    if not isinstance(args, Mapping):
        raise ValueError("arguments must be an object")
    return ToolCall(obj["name"], dict(args))


def _json_values(text: str) -> list[Any]:
    """The JSON values in ``text`` one after another (separated by whitespace, ``;`` or ``,``)."""
    decoder, out, i = json.JSONDecoder(), [], 0
    text = text.strip()
    while i < len(text):
        value, i = decoder.raw_decode(text, i)
        out.append(value)
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
    return out


def _calls_of(values: list[Any]) -> list[ToolCall]:
    calls = []
    for value in values:
        calls += [_call(v) for v in value] if isinstance(value, list) else [_call(value)]
    return calls


def _parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    if "<tool_call>" not in text:
        return "", _calls_of(_json_values(text))
    first = text.index("<tool_call>")
    calls = []
    for block in text[first:].split("<tool_call>")[1:]:
        body = block.split("</tool_call>")[0]
        calls += _calls_of(_json_values(body))
    return text[:first].strip(), calls


def _parse_mistral(text: str) -> tuple[str, list[ToolCall]]:
    text = text.replace("</s>", "")
    at = text.find("[TOOL_CALLS]")
    content, rest = (text[:at].strip(), text[at + len("[TOOL_CALLS]"):]) if at >= 0 else ("", text)
    if "[ARGS]" in rest:  # name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
        calls = []
        for part in rest.split("[TOOL_CALLS]"):
            name, _, args = part.partition("[ARGS]")
            calls.append(ToolCall(name.strip(), dict(json.loads(args))))
        return content, calls
    return content, _calls_of(_json_values(rest))


def _parse_llama3(text: str) -> tuple[str, list[ToolCall]]:
    text = text.replace("<|eom_id|>", "").replace("<|eot_id|>", "")
    at = text.find("<|python_tag|>")
    content, rest = (text[:at].strip(), text[at + len("<|python_tag|>"):]) if at >= 0 else ("", text)
    return content, _calls_of(_json_values(rest))


def _parse_gemma(text: str) -> tuple[str, list[ToolCall]]:
    at = text.find("```tool_code")
    if at < 0:
        return "", _calls_of(_json_values(text))
    body = text[at + len("```tool_code"):].split("```")[0]
    calls = []
    for node in ast.parse(body.strip()).body:
        call = node.value if isinstance(node, ast.Expr) else None
        if not isinstance(call, ast.Call) or call.args or not isinstance(call.func, (ast.Name, ast.Attribute)):
            raise ValueError("not a function call with keyword arguments")
        name = ast.unparse(call.func)
        calls.append(ToolCall(name, {k.arg: ast.literal_eval(k.value) for k in call.keywords}))
    return text[:at].strip(), calls


GEMMA4_CALL, GEMMA4_END, GEMMA4_QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_GEMMA4_NAME = re.compile(r"\s*call:([^{}<>\s]+)\s*(?=\{)")
_GEMMA4_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_GEMMA4_WORDS = {"true": True, "false": False, "null": None}


def _parse_gemma4(text: str) -> tuple[str, list[ToolCall]]:
    first = text.find(GEMMA4_CALL)
    if first < 0:
        return text, []
    calls, at = [], first
    while at >= 0:  # text between and after the calls is dropped (as for hermes)
        name = _GEMMA4_NAME.match(text, at + len(GEMMA4_CALL))
        if name is None:
            raise ValueError("not call:NAME{...}")
        args, i = _gemma4_value(text, name.end())
        i = _skip_space(text, i)
        if text.startswith(GEMMA4_END, i):
            i += len(GEMMA4_END)
        elif text[i:].strip():  # only a call cut off at the end may lack its close
            raise ValueError(f"{GEMMA4_END} expected after the arguments")
        calls.append(ToolCall(name.group(1), args))
        at = text.find(GEMMA4_CALL, i)
    return text[:first].strip(), calls


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _gemma4_value(text: str, i: int, depth: int = 0) -> tuple[Any, int]:
    """The value in Gemma 4's argument syntax at ``text[i:]`` (after whitespace), and where it ends:
    strings between ``<|"|>`` marks (as written, no escapes), objects with unquoted keys, arrays,
    JSON numbers, true, false, null. ``ValueError`` for anything else, or nesting deeper than JSON
    arguments may (``MAX_NESTING``)."""
    if depth >= MAX_NESTING:
        raise ValueError(f"arguments nest more than {MAX_NESTING} levels deep")
    i = _skip_space(text, i)
    if text.startswith(GEMMA4_QUOTE, i):
        end = text.find(GEMMA4_QUOTE, i + len(GEMMA4_QUOTE))
        if end < 0:
            raise ValueError("a string is not closed")
        return text[i + len(GEMMA4_QUOTE):end], end + len(GEMMA4_QUOTE)
    if text.startswith(("{", "["), i):
        close = "}" if text[i] == "{" else "]"
        items: list[Any] = []
        i = _skip_space(text, i + 1)
        while not text.startswith(close, i):
            if close == "}":
                colon = text.find(":", i)
                key = text[i:colon].strip() if colon >= 0 else ""
                if len(key) > 2 * len(GEMMA4_QUOTE) and key.startswith(GEMMA4_QUOTE) and key.endswith(GEMMA4_QUOTE):
                    key = key[len(GEMMA4_QUOTE):-len(GEMMA4_QUOTE)]  # keys are unquoted, but may come quoted
                if not key or "}" in key:
                    raise ValueError("an object member is not KEY:VALUE")
                value, i = _gemma4_value(text, colon + 1, depth + 1)
                items.append((key, value))
            else:
                value, i = _gemma4_value(text, i, depth + 1)
                items.append(value)
            i = _skip_space(text, i)
            if text.startswith(",", i):
                i = _skip_space(text, i + 1)
            elif not text.startswith(close, i):
                raise ValueError(f"',' or {close!r} expected")
        return (dict(items) if close == "}" else items), i + 1
    if number := _GEMMA4_NUMBER.match(text, i):
        return json.loads(number.group()), number.end()
    for word, value in _GEMMA4_WORDS.items():
        if text.startswith(word, i):
            return value, i + len(word)
    raise ValueError(f"no value at {text[i:i + 20]!r}")


_HARMONY_CALL = re.compile(r"<\|channel\|>commentary to=functions\.([\w.\-]+)[^<]*(?:<\|constrain\|>[^<]*)?"
                           r"<\|message\|>(.*?)(?:<\|call\|>|<\|end\|>|$)", re.S)


def _harmony_content(text: str) -> str:
    finals = re.findall(r"<\|channel\|>final<\|message\|>(.*?)(?:<\|end\|>|<\|return\|>|$)", text, re.S)
    if finals:
        return "".join(finals)
    return text if "<|channel|>" not in text else ""


def _parse_harmony(text: str) -> tuple[str, list[ToolCall]]:
    calls = [ToolCall(name, dict(json.loads(args))) for name, args in _HARMONY_CALL.findall(text)]
    return _harmony_content(text), calls


def _parse_json(text: str) -> tuple[str, list[ToolCall]]:
    if "<tool_call>" in text:
        return _parse_hermes(text)
    return "", _calls_of(_json_values(text))


_PARSERS = {"hermes": _parse_hermes, "mistral": _parse_mistral, "llama3": _parse_llama3, "gemma": _parse_gemma,
            "gemma4": _parse_gemma4, "harmony": _parse_harmony, "json": _parse_json}


class ToolCallParser:
    """Splits streamed output into content (returned by ``feed`` as soon as it cannot begin a
    call) and calls (``finish``). Harmony output is held to the end (its content is a channel)."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self._text = ""
        self._emitted = 0  # characters of _text passed on as content
        self._call_at: int | None = None  # where a call begins

    def feed(self, text: str) -> str:
        self._text += text
        if self._call_at is not None or self.fmt.name == "harmony":
            return ""
        hits = [i for i in (self._text.find(s, self._emitted) for s in self.fmt.starts) if i >= 0]
        stripped = self._text.lstrip()
        if not stripped.strip():
            return ""  # leading whitespace: a call may still come
        if self._emitted == 0 and any(stripped.startswith(s) or s.startswith(stripped) for s in self.fmt.leading):
            if any(stripped.startswith(s) for s in self.fmt.leading):
                self._call_at = 0
            return ""
        if hits:
            self._call_at = min(hits)
            return self._emit(self._call_at)
        hold = max((n for s in self.fmt.starts for n in range(1, len(s)) if self._text.endswith(s[:n])), default=0)
        return self._emit(len(self._text) - hold)

    def _emit(self, end: int) -> str:
        out = self._text[self._emitted:end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not passed on yet, calls)."""
        content, calls = parse(self.fmt, self._text)
        said = self._text[:self._emitted]
        if calls:
            rest = content[len(said):] if content.startswith(said) else ""
            return rest, calls
        return (content[len(said):] if content.startswith(said) else self._text[self._emitted:]), []


# ---- forcing a call ---------------------------------------------------------------------------------
def check_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI/Ollama function tools as given (ValueError naming what is wrong)."""
    if tools is None:
        return []
    if isinstance(tools, (str, Mapping)) or not isinstance(tools, Sequence):
        raise ValueError("tools must be an array of tool definitions")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                             '"parameters": {...}}}')
        if tool.get("type", "function") != "function":
            raise ValueError(f'tools[{i}].type must be "function"')
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], Mapping):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        check_nesting(tool, f"tools[{i}]")
        if fn.get("parameters") is not None:  # the size bounds of the schema a forced call compiles
            Grammar.json(dict(fn["parameters"])).named(f"tools[{i}].function.parameters").check_size()
    return [dict(t) for t in tools]


def forced_grammar(fmt: ToolFormat, tools: Sequence[Mapping[str, Any]], name: str | None = None) -> Grammar:
    """A grammar whose every output is one call of ``name`` (or of any of ``tools``) in ``fmt``, its
    JSON compact (no whitespace between tokens)."""
    fns = [t["function"] for t in tools]
    if name is not None:
        fns = [f for f in fns if f["name"] == name]
        if not fns:
            raise ValueError(f"tool_choice names function {name!r}, which is not among the tools")
    if not fns:
        raise ValueError('tool_choice "required" needs tools')
    key = "parameters" if fmt.name == "llama3" else "arguments"

    def params(fn: Mapping[str, Any]) -> dict[str, Any]:
        return dict(fn.get("parameters") or {"type": "object"})

    def compact(schema: dict[str, Any]) -> str:  # no whitespace between JSON tokens (Lark's %json allows
        # any) and no made-up keys: a weak model could otherwise pad until max_tokens instead of calling
        return json.dumps({**closed_objects(schema), "x-guidance": {"whitespace_flexible": False}})

    if fmt.name == "gemma4":
        rules = _Gemma4Rules()
        alts = " | ".join(f"{json.dumps(f['name'])} {rules.of(params(f))}" for f in fns)
        return Grammar.lark(f'start: "{GEMMA4_CALL}call:" ({alts}) "{GEMMA4_END}"\n{rules.text()}')
    if fmt.name == "harmony":
        alts = " | ".join(f'"{f["name"]}" " <|constrain|>json<|message|>" args_{i}' for i, f in enumerate(fns))
        rules = "\n".join(f"args_{i}: %json {compact(params(f))}" for i, f in enumerate(fns))
        return Grammar.lark(f'start: "<|channel|>commentary to=functions." ({alts}) "<|call|>"\n{rules}\n')
    schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": f["name"]}, key: params(f)},
                         "required": ["name", key], "additionalProperties": False} for f in fns]}
    if len(fns) == 1:
        schema = schema["anyOf"][0]
    body = f"call: %json {compact(schema)}\n"
    prefix, suffix = {"hermes": ('"<tool_call>\\n" ', ' "\\n</tool_call>"'), "mistral": ('"[TOOL_CALLS][" ', ' "]"'),
                      "gemma": ("", ""), "llama3": ("", ""), "json": ("", "")}[fmt.name]
    return Grammar.lark(f"start: {prefix}call{suffix}\n{body}")


# Gemma 4's argument syntax, compact (no whitespace); a string is one lexeme, so its text cannot swallow the
# closing mark
_GEMMA4_GRAMMAR = r"""object: "{" (member ("," member)*)? "}"
member: KEY ":" value
array: "[" (value ("," value)*)? "]"
value: STRING | object | array | NUMBER | "true" | "false" | "null"
KEY: /[A-Za-z_][A-Za-z0-9_.\-]*/
NUMBER: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/
STRING: "<|\"|>" TEXT "<|\"|>"
TEXT: /(?s:.*)/ & ~/(?s:.*)<\|"\|>(?s:.*)/
"""

def _gemma4_text(value: Any) -> str:
    """``value`` written in Gemma 4's argument syntax."""
    if isinstance(value, str):
        return GEMMA4_QUOTE + value + GEMMA4_QUOTE
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{_gemma4_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_gemma4_text(v) for v in value) + "]"
    return json.dumps(value)


class _Gemma4Rules:
    """Lark rules of arguments in Gemma 4's syntax that follow a JSON schema: objects with their
    ``properties`` (in sorted order, as Gemma 4's template writes them; ``required`` ones always, no
    others), arrays of ``items``, strings (``minLength``/``maxLength``), ``enum``/``const``, ``anyOf``/
    ``oneOf``, a list of types, and numbers, booleans and null by llguidance's JSON schema (they are
    written as in JSON). Other schema keywords (``pattern``, ``$ref``, ...) are not enforced: that
    part takes any value (llama.cpp enforces no schema on Gemma 4's calls)."""

    _NUMERIC = ("type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")

    def __init__(self) -> None:
        self._rules: list[str] = []

    def text(self) -> str:
        return "\n".join(self._rules) + "\n" + _GEMMA4_GRAMMAR

    def _add(self, body: str, terminal: bool = False) -> str:
        name = f"{'G' if terminal else 'g'}{len(self._rules)}"
        self._rules.append(f"{name}: {body}")
        return name

    def of(self, schema: Any, depth: int = 0) -> str:
        """A Lark expression of the values ``schema`` allows."""
        if not isinstance(schema, Mapping) or depth > MAX_NESTING:
            return "value"
        if "enum" in schema or "const" in schema:
            values = schema["enum"] if "enum" in schema else [schema["const"]]
            if not isinstance(values, list) or not values:
                return "value"
            return "(" + " | ".join(json.dumps(_gemma4_text(v), ensure_ascii=False) for v in values) + ")"
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                return "(" + " | ".join(self.of(s, depth + 1) for s in schema[key]) + ")"
        kind = schema.get("type")
        if isinstance(kind, list) and kind:
            return "(" + " | ".join(self.of({**schema, "type": t}, depth + 1) for t in kind) + ")"
        if kind in ("integer", "number", "boolean", "null"):
            number = {k: schema[k] for k in self._NUMERIC if k in schema}
            return self._add(f"%json {json.dumps({**number, 'x-guidance': {'whitespace_flexible': False}})}")
        if kind == "string":
            low, high = schema.get("minLength", 0), schema.get("maxLength", "")
            if not isinstance(low, int) or not isinstance(high, (int, str)):
                return "STRING"
            text = self._add(f'/(?s:.{{{low},{high}}})/ & ~/(?s:.*)<\\|"\\|>(?s:.*)/', terminal=True)
            return self._add(f'"<|\\"|>" {text} "<|\\"|>"', terminal=True)
        if kind == "array":
            item = self.of(schema.get("items"), depth + 1)
            return f'"[" ({item} ("," {item})*)? "]"'
        if kind == "object" and isinstance(schema.get("properties"), Mapping):
            return self._object(schema, depth)
        return "object" if kind == "object" else "value"

    def _object(self, schema: Mapping[str, Any], depth: int) -> str:
        """``{`` the properties in sorted order, each required one present, then ``}``: rule ``r[i][first]``
        is the members from the i-th on (``first``: no member before it, so no comma)."""
        props = sorted(schema["properties"].items())
        required = set(schema.get("required") or ())
        members = [f'{json.dumps(k + ":", ensure_ascii=False)} {self.of(v, depth + 1)}' for k, v in props]
        optional_from = [all(k not in required for k, _ in props[i:]) for i in range(len(props) + 1)]
        names: dict[tuple[int, bool], str] = {}

        def ref(i: int, first: bool, skippable: bool = True) -> str:
            if i == len(props):
                return ""
            if (i, first) not in names:
                take = f'{"" if first else chr(34) + "," + chr(34)} {members[i]} {ref(i + 1, False)}'
                skip = f" | {ref(i + 1, first, False)}" if props[i][0] not in required and i + 1 < len(props) else ""
                names[i, first] = self._add(f"({take}){skip}")
            return names[i, first] + ("?" if skippable and optional_from[i] else "")

        return f'"{{" {ref(0, True)} "}}"'


# how deeply a request's tool arguments and parameter schemas may nest (real ones nest a few levels;
# the chat template renders them recursively)
MAX_NESTING = 64


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant ``tool_calls`` checked (ValueError naming the call) and with their ``arguments``
    as objects (OpenAI sends JSON strings; templates index into them)."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_request_call(call, f"messages[{i}].tool_calls[{j}]")
                                                 for j, call in enumerate(calls)]}
        out.append(message)
    return out


def _request_call(call: Any, where: str) -> dict[str, Any]:
    """One earlier call of a chat request: ``{"function": {"name", "arguments"}}`` with the
    arguments an object (or a JSON string of one) nested at most ``MAX_NESTING`` deep."""
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise ValueError(f'{where} must be {{"function": {{"name": ..., "arguments": {{...}}}}}}')
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            raise ValueError(f"{where}.function.arguments is not JSON: {args!r:.60}") from None
    if args is None:
        args = {}
    if not isinstance(args, Mapping):
        raise ValueError(f"{where}.function.arguments must be an object (or a JSON string of one)")
    check_nesting(args, f"{where}.function.arguments")
    return {**call, "function": {**fn, "arguments": args}}


def check_nesting(value: Any, where: str, limit: int = MAX_NESTING) -> None:
    """ValueError when the JSON ``value`` nests objects/arrays deeper than ``limit``."""
    level, depth = [value], 0
    while level:
        depth += 1
        if depth > limit:
            raise ValueError(f"{where} nests more than {limit} levels deep")
        level = [v for x in level if isinstance(x, (Mapping, list))
                 for v in (x.values() if isinstance(x, Mapping) else x)]
        level = [v for v in level if isinstance(v, (Mapping, list))]


class ToolOutput:
    """A chat completion's output, chunk by chunk, as content and (at the end) tool calls. Formats
    whose markers are special tokens read the chunks' token ids with those written out."""

    def __init__(self, fmt: ToolFormat, tokenizer: Any):
        self.fmt = fmt
        self.parser = ToolCallParser(fmt)
        self.decoder = tokenizer.stream(skip_special=False, continuation=True) if fmt.raw else None

    def feed(self, chunk: Any, text: str) -> tuple[str, list[ToolCall]]:
        """(content to pass on, the calls: only on the last chunk, and only if there are any)."""
        if self.decoder is not None:
            text = "".join(self.decoder.feed(t) for t in chunk.tokens) + (self.decoder.flush() if chunk.done else "")
        out = self.parser.feed(text)
        if not chunk.done:
            return out, []
        rest, calls = self.parser.finish()
        return out + rest, calls


def tool_choice_name(tool_choice: Any) -> tuple[bool, str | None]:
    """(whether a call is forced, the function it must be) for an OpenAI ``tool_choice``."""
    if tool_choice in (None, "auto", "none"):
        return False, None
    if tool_choice == "required":
        return True, None
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function" and \
            isinstance((tool_choice.get("function") or {}).get("name"), str):
        return True, tool_choice["function"]["name"]
    raise ValueError('tool_choice must be "auto", "none", "required" or {"type": "function", "function": '
                     '{"name": ...}}')
