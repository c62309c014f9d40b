"""Request bodies: JSON parsing, typed field access with clear errors, and the mapping of Ollama
``options`` and OpenAI sampling fields to ``CompletionRequest`` keyword arguments.

Every check raises ``APIError`` (an HTTP status and a message naming the field); the routes turn
it into the error body their API family uses.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Collection, Mapping
from dataclasses import fields
from typing import Any

from pyggml.runner.sequence import check_stops
from pyggml.sample import SamplingOptions

MAX_BODY_BYTES = 32 << 20


class APIError(Exception):
    """An error answered to the client: HTTP ``status``, a message, optional headers."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = dict(headers or {})


async def read_json(request: Any) -> dict[str, Any]:
    """The request's body as a JSON object (400 when it is empty, malformed or not an object)."""
    data = bytearray()
    async for piece in request.stream():
        data += piece
        if len(data) > MAX_BODY_BYTES:
            raise APIError(413, f"request body is larger than {MAX_BODY_BYTES >> 20} MiB")
    if not data.strip():
        raise APIError(400, "the request body is empty: send a JSON object")
    try:
        body = json.loads(bytes(data), parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {json_type(body)}")
    return body


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def json_type(value: Any) -> str:
    for kind, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
                       (dict, "object")):
        if isinstance(value, kind):
            return name
    return "null" if value is None else type(value).__name__


class Fields:
    """Checked access to one JSON object. Unknown keys are rejected up front (a misspelled option
    must not be silently ignored); ``null`` reads as absent. ``where`` names the object in errors."""

    def __init__(self, data: Any, where: str, known: Collection[str]):
        if not isinstance(data, dict):
            raise APIError(400, f"{where} must be a JSON object, got {json_type(data)}", param=where)
        self.data, self.where = data, where
        for key in data:
            if key not in known:
                hint = difflib.get_close_matches(key, list(known), n=1, cutoff=0.7)
                suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
                raise APIError(400, f"unknown field {key!r} in {where}{suggestion}", param=key)

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def _name(self, key: str) -> str:
        return key if self.where == "the request" else f"{self.where}.{key}"

    def _bad(self, key: str, expected: str) -> APIError:
        value = self.data[key]
        return APIError(400, f"{self._name(key)} must be {expected}, got {json_type(value)} {value!r:.40}",
                        param=key)

    def string(self, key: str, default: str | None = None) -> str | None:
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self._bad(key, "a string")
        return value

    def boolean(self, key: str, default: bool | None = None) -> bool | None:
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._bad(key, "true or false")
        return value

    def integer(self, key: str, default: int | None = None, low: int | None = None,
                high: int | None = None) -> int | None:
        value = self.data.get(key)
        if value is None:
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self._bad(key, "an integer")
        self._check_range(key, value, low, high)
        return value

    def number(self, key: str, default: float | None = None, low: float | None = None,
              high: float | None = None) -> float | None:
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self._bad(key, "a number")
        self._check_range(key, value, low, high)
        return float(value)

    def _check_range(self, key: str, value: float, low: float | None, high: float | None) -> None:
        if (low is not None and value < low) or (high is not None and value > high):
            limits = f">= {low}" if high is None else f"<= {high}" if low is None else f"in [{low}, {high}]"
            raise APIError(400, f"{self._name(key)} must be {limits}, got {value!r}", param=key)

    def stops(self, key: str = "stop") -> list[str] | None:
        """A string or a list of strings, at most ``MAX_STOPS`` of at most ``MAX_STOP_CHARS``."""
        value = self.data.get(key)
        if value is None:
            return None
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise self._bad(key, "a string or an array of strings")
        try:
            check_stops(value)
        except ValueError as exc:
            raise APIError(400, f"{self._name(key)}: {exc}", param=key) from None
        return value

    def mapping(self, key: str) -> dict[str, Any] | None:
        value = self.data.get(key)
        if value is not None and not isinstance(value, dict):
            raise self._bad(key, "an object")
        return value

    def array(self, key: str) -> list[Any] | None:
        value = self.data.get(key)
        if value is not None and not isinstance(value, list):
            raise self._bad(key, "an array")
        return value

    def unsupported(self, key: str, allowed: Collection[Any] = (), what: str = "") -> None:
        """400 unless ``key`` is absent or one of the ``allowed`` (neutral) values."""
        value = self.data.get(key)
        if value is not None and value not in allowed and value != [] and value != "":
            raise APIError(400, f"{self._name(key)} {what or 'is not supported by this server'}", param=key)


# ---- the engine's sampling options ------------------------------------------------------------------
# declared once, as the fields of ``SamplingOptions``; both APIs take them under the same names. Numbers
# (``float`` fields) and integers (``int``) are read here; ``seed`` and ``logit_bias`` each API reads its own way.
SAMPLING_OPTIONS = frozenset(f.name for f in fields(SamplingOptions))
_SAMPLING_VALUES = tuple((f.name, "int" if f.type in ("int", int) else "float") for f in fields(SamplingOptions)
                         if f.type in ("float", "int", float, int))
# bounds every API shares (the rest Sampler checks): top_k 0 is off, repeat_last_n -1 is the whole history
_SAMPLING_BOUNDS: dict[str, tuple[float | None, float | None]] = {"top_k": (0, None), "repeat_last_n": (-1, None)}


def sampling_values(f: Fields, bounds: Mapping[str, tuple[float | None, float | None]] | None = None) -> dict[str, Any]:
    """The numeric sampling options present in ``f``, checked: integers where the option is an ``int``,
    each within ``bounds`` (or the shared bounds) for its key."""
    out: dict[str, Any] = {}
    for key, kind in _SAMPLING_VALUES:
        if f.has(key):
            low, high = (bounds or {}).get(key) or _SAMPLING_BOUNDS.get(key, (None, None))
            out[key] = (f.integer if kind == "int" else f.number)(key, low=low, high=high)
    return out


# ---- Ollama ---------------------------------------------------------------------------------------

# options that pick how the model is loaded: fixed when the server starts, accepted and ignored
OLLAMA_LOAD_OPTIONS = frozenset({
    "numa", "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only",
    "use_mmap", "use_mlock", "embedding_only", "num_thread",
})
OLLAMA_SAMPLING_OPTIONS = SAMPLING_OPTIONS - {"logit_bias"} | {"num_predict", "stop", "num_keep"}
OLLAMA_IGNORED_OPTIONS = frozenset({"penalize_newline", "tfs_z", "mirostat_tau", "mirostat_eta"})
# pyggml's own options (Ollama ``options``, OpenAI top level): ``prompt_lookup`` (speculative decoding
# with n-gram drafts of up to that many tokens)
PYGGML_OPTIONS = frozenset({"prompt_lookup"})
OLLAMA_OPTIONS = OLLAMA_LOAD_OPTIONS | OLLAMA_SAMPLING_OPTIONS | OLLAMA_IGNORED_OPTIONS | PYGGML_OPTIONS | {"mirostat"}


def ollama_options(options: Any) -> dict[str, Any]:
    """``CompletionRequest`` keyword arguments from Ollama's ``options`` object. ``num_predict``
    -1 (Ollama's default) and -2 become ``None``: generate up to the end of the context."""
    if options is None:
        return {}
    f = Fields(options, "options", OLLAMA_OPTIONS)
    f.unsupported("mirostat", (0,), "(mirostat sampling) is not supported; use 0")
    out = sampling_values(f)
    if f.has("seed"):
        seed = f.integer("seed")
        out["seed"] = seed if seed >= 0 else None  # Ollama: -1 is a random seed
    if f.has("num_predict"):
        n = f.integer("num_predict", low=-2)
        out["max_tokens"] = n if n >= 0 else None
    if f.has("num_keep"):
        out["num_keep"] = f.integer("num_keep", low=-1)
    if f.has("stop"):
        out["stop"] = f.stops("stop")
    out.update(prompt_lookup(f))
    return out


def prompt_lookup(f: Fields) -> dict[str, Any]:
    """pyggml's ``prompt_lookup`` (Ollama ``options``, OpenAI top level): speculative decoding with
    drafts of up to that many tokens from the prompt and output so far; 0 (the default) is off."""
    from pyggml.runner.runner import MAX_DRAFT

    n = f.integer("prompt_lookup", low=0, high=MAX_DRAFT)
    return {"prompt_lookup": n} if n else {}


def ollama_logprobs(f: Fields) -> int | None:
    """How many alternatives Ollama's ``logprobs``/``top_logprobs`` fields ask for (None: no logprobs)."""
    top = f.integer("top_logprobs", 0, low=0, high=20)
    return top if f.boolean("logprobs", False) else None


def runner_logprobs(top: int | None) -> int:
    """The runner's ``logprobs`` for ``top`` alternatives: it reports token logprobs only with at
    least one alternative (0 means none at all), so 0 alternatives asks for 1 and drops it."""
    return 0 if top is None else max(top, 1)


# ---- OpenAI ---------------------------------------------------------------------------------------

# sampling fields some OpenAI-compatible servers (llama.cpp, vLLM) accept beyond OpenAI's own
# (top_k, min_p, typical_p, repeat_penalty, repeat_last_n: the engine's sampling options, and ignore_eos)
OPENAI_COMMON = frozenset({
    "model", "stream", "stream_options", "max_tokens", "n", "stop", "user", "logprobs", "ignore_eos",
}) | SAMPLING_OPTIONS | PYGGML_OPTIONS
# OpenAI's documented ranges (the others as the engine's)
OPENAI_BOUNDS = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "presence_penalty": (-2.0, 2.0),
                 "frequency_penalty": (-2.0, 2.0), "min_p": (0.0, 1.0), "typical_p": (0.0, 1.0),
                 "repeat_penalty": (0.0, None)}
# OpenAI's defaults differ from the engine's: temperature 1 and no nucleus cut (as Ollama's OpenAI layer)
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0}


def openai_sampling(f: Fields) -> dict[str, Any]:
    """``CompletionRequest`` keyword arguments from the sampling fields both OpenAI routes share."""
    f.unsupported("n", (1,), "must be 1 (one choice per request)")
    out: dict[str, Any] = {**OPENAI_DEFAULTS, **sampling_values(f, OPENAI_BOUNDS)}
    if f.has("seed"):
        out["seed"] = f.integer("seed", low=0)
    if f.has("stop"):
        out["stop"] = f.stops("stop")
    bias = f.mapping("logit_bias")
    if bias:
        out["logit_bias"] = _logit_bias(bias)
    out.update(prompt_lookup(f))
    return out


def ignore_eos(f: Fields, tokenizer: Any, sampling: dict[str, Any]) -> None:
    """llama.cpp's ``ignore_eos: true``: ban the end-of-generation tokens (a logit bias of -inf,
    as llama-server does it), so a completion runs to ``max_tokens`` (benchmarks)."""
    if f.boolean("ignore_eos", False):
        sampling["logit_bias"] = {**(sampling.get("logit_bias") or {}), **dict.fromkeys(tokenizer.vocab.eog, -math.inf)}


def openai_max_tokens(f: Fields, *keys: str) -> int | None:
    """The first of ``keys`` given (``None``: up to the end of the context)."""
    for key in keys:
        if f.has(key):
            return f.integer(key, low=0)
    return None


def stream_usage(f: Fields) -> bool:
    """Whether ``stream_options.include_usage`` asks for a final usage chunk."""
    options = f.mapping("stream_options")
    if options is None:
        return False
    if not f.boolean("stream", False):
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    return bool(Fields(options, "stream_options", {"include_usage", "include_obfuscation"}).boolean("include_usage"))


def _logit_bias(bias: dict[str, Any]) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not -100 <= value <= 100:
            raise APIError(400, f"logit_bias[{key!r}] must be a number in [-100, 100], got {value!r}",
                           param="logit_bias")
        out[token] = float(value)
    return out


# ---- structured output -----------------------------------------------------------------------------
def _grammar(grammar: Any, field: str) -> dict[str, Any]:
    """``{"grammar": ...}`` naming ``field`` in its errors; 400 when it is beyond the size bounds
    (checked here, before the request is queued; the runner compiles it, 400 with llguidance's message)."""
    from pyggml.constrain import ConstraintError

    grammar = grammar.named(field)
    try:
        grammar.check_size()
    except ConstraintError as exc:
        raise APIError(400, str(exc), param=field.split(".")[0]) from None
    return {"grammar": grammar}


def grammar_extension(f: Fields) -> dict[str, Any]:
    """pyggml's ``grammar`` field (both APIs): a Lark or GBNF grammar string, or an object
    ``{"regex" | "lark" | "gbnf": text}``."""
    value = f.data.get("grammar")
    if value is None:
        return {}
    from pyggml.constrain import Grammar, grammar_for

    if isinstance(value, str) and value.strip():
        return _grammar(grammar_for(grammar=value), "grammar")
    if isinstance(value, dict) and len(value) == 1:
        (kind, text), = value.items()
        if kind in ("regex", "lark", "gbnf") and isinstance(text, str):
            return _grammar(Grammar(kind, text), "grammar")
    raise APIError(400, 'grammar must be a Lark or GBNF grammar string, or an object {"regex" | "lark" | "gbnf": '
                   'string}', param="grammar")


def ollama_format(f: Fields) -> dict[str, Any]:
    """Ollama's ``format``: "json" (a JSON object) or a JSON schema object (or pyggml's ``grammar``)."""
    from pyggml.constrain import grammar_for

    value = f.data.get("format")
    if value is None or value == "":
        return grammar_extension(f)
    if f.has("grammar"):
        raise APIError(400, "give format or grammar, not both", param="grammar")
    if value == "json" or isinstance(value, dict):
        return _grammar(grammar_for(format=value), "format")
    raise APIError(400, f'format must be "json" or a JSON schema object, got {json_type(value)} {value!r:.40}',
                   param="format")


def openai_response_format(f: Fields) -> dict[str, Any]:
    """OpenAI's ``response_format``: text, ``json_object`` (a JSON object) or ``json_schema``
    ({"json_schema": {"name", "schema", "strict"}}); or pyggml's ``grammar``."""
    value = f.data.get("response_format")
    if value is None:
        return grammar_extension(f)
    rf = Fields(value, "response_format", {"type", "json_schema"})
    kind = rf.string("type")
    if kind == "text":
        return grammar_extension(f)
    if f.has("grammar"):
        raise APIError(400, "give response_format or grammar, not both", param="grammar")
    if kind == "json_object":
        return json_output(None, "response_format")
    if kind == "json_schema":
        spec = Fields(rf.data.get("json_schema"), "response_format.json_schema",
                      {"name", "description", "schema", "strict"})
        return json_output(spec.data.get("schema"), "response_format.json_schema.schema")
    raise APIError(400, 'response_format.type must be "text", "json_object" or "json_schema"',
                   param="response_format")


def json_output(schema: Any, field: str) -> dict[str, Any]:
    """``{"grammar": ...}`` for output that is JSON: any object (``schema`` None) or a match of ``schema``,
    the JSON schema given as ``field``."""
    from pyggml.constrain import Grammar, grammar_for

    if schema is None:
        return _grammar(grammar_for(format="json"), field)
    if not isinstance(schema, (dict, bool)):
        raise APIError(400, f"{field} must be a JSON schema object", param=field.split(".")[0])
    return _grammar(Grammar.json(schema), field)
