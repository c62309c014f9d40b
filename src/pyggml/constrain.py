"""Constrained decoding: output that matches a JSON schema, any JSON, a regex or a Lark grammar.

The grammar engine is llguidance (``pip install llguidance``). Its tokenizer is built once per
``Tokenizer`` from our vocabulary (the bytes of every token, special tokens marked, plus our own
``encode`` as the tokenize callback), so any GGUF tokenizer serves. Per sequence a ``Constraint``
holds an ``LLMatcher`` that advances with every accepted token; its next-token mask is a bitmask
over the vocabulary (``compute_mask``: llguidance's Rust code, which releases the GIL, so the
runner computes it while the graph computes) and ``apply`` turns the disallowed logits to -inf
with one vectorised numpy operation.

Grammar sources (``grammar_for``): ``format="json"`` (a JSON object) or a JSON schema dict (Ollama's
``format``, OpenAI's ``response_format``), and ``grammar`` as a ``Grammar`` or a string: a Lark
grammar, or a GBNF one (recognised by its ``::=`` rules) converted to Lark. Invalid schemas and
grammars, schema keywords llguidance cannot enforce and grammars no output can match are a
``ConstraintError`` (a ``ValueError``) with its message, naming the request field a grammar came
from (``Grammar.named``). Grammars beyond the size bounds below are refused before llguidance sees
them, and each new grammar is compiled first in a worker process (``pyggml.grammar_worker``), where
a crash or a runaway costs that grammar, not this process.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pyggml.tokenizer.vocab import TokenType

# tokens llguidance treats as special (never text): control and unknown ones. User-defined tokens
# (Qwen's <tool_call>) are text, as our tokenizer matches them in text.
_MARKED = frozenset({TokenType.CONTROL, TokenType.UNKNOWN})
_BIAS = np.array([-np.inf, 0.0], dtype=np.float32)  # by mask bit
# what llguidance's errors say when a grammar reaches its ParserLimits while generating (a row of
# more than max_items_in_row Earley items: an object of a few thousand optional properties)
_LIMIT_WORDS = ("max is", "fuel", "limit", "too many", "too large")


class ConstraintError(ValueError):
    """A grammar or schema that cannot be compiled or enforced."""


# Bounds checked before a grammar reaches llguidance (far beyond real grammars and schemas; its
# compiler recurses along rule and $ref chains and overflowed the stack at ~2,500 chained rules)
MAX_GRAMMAR_CHARS = 256 << 10  # Lark, GBNF
MAX_REGEX_CHARS = 64 << 10
MAX_RULES = 1000  # Lark or GBNF rule definitions
MAX_NESTING = 100  # brackets inside a grammar or regex
MAX_SCHEMA_CHARS = 1 << 20  # a JSON schema, as JSON
MAX_SCHEMA_NODES = 20_000  # its objects and arrays
MAX_SCHEMA_DEPTH = 128  # objects and arrays on any path, following $ref (llguidance's JSON parser's limit)
MAX_OPTIONAL_PROPERTIES = 500  # in one object: llguidance's parser gives up at ~650 while generating


@dataclass(frozen=True)
class Grammar:
    """A grammar in one of llguidance's source kinds: ``kind`` is "json_schema" (``source`` a schema
    dict, or None for any JSON value), "regex", "lark" or "gbnf"."""

    kind: str
    source: Any = None
    field: str = dataclasses.field(default="", compare=False)  # where a request gave it, for errors

    def named(self, field: str) -> Grammar:
        """This grammar, its errors naming ``field`` (a request field such as ``response_format``)."""
        return dataclasses.replace(self, field=field)

    def where(self, message: str) -> str:
        return f"{self.field}: {message}" if self.field else message

    def check_size(self) -> None:
        """``ConstraintError`` (naming the field) when the grammar is beyond the bounds above."""
        problem = _size_problem(self.kind, self.source)
        if problem:
            raise ConstraintError(self.where(problem))

    @classmethod
    def json(cls, schema: Mapping[str, Any] | bool | None = None) -> Grammar:
        return cls("json_schema", schema)

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        return cls("regex", pattern)

    @classmethod
    def lark(cls, text: str) -> Grammar:
        return cls("lark", text)

    @classmethod
    def gbnf(cls, text: str) -> Grammar:
        return cls("gbnf", text)

    def compile(self) -> str:
        """llguidance's grammar text (raises ``ConstraintError`` for a source it cannot read)."""
        m = _llguidance().LLMatcher
        kind, source = self.kind, self.source
        try:
            if kind == "json_schema":
                if source is None:
                    source = {}
                if not isinstance(source, (dict, bool)):
                    raise ConstraintError(f"a JSON schema must be an object, got {type(source).__name__}")
                if isinstance(source, bool):
                    source = {} if source else {"not": {}}
                source = closed_objects(source)
                return m.grammar_from_json_schema(json.dumps(source), {"whitespace_flexible": False})
            if not isinstance(source, str) or not source.strip():
                raise ConstraintError(f"a {kind} grammar must be a non-empty string")
            if kind == "regex":
                return m.grammar_from_regex(source)
            if kind == "lark":
                return m.grammar_from_lark(source)
            if kind == "gbnf":
                from llguidance.gbnf_to_lark import gbnf_to_lark
                return m.grammar_from_lark(gbnf_to_lark(source))
        except ConstraintError as exc:
            raise ConstraintError(self.where(str(exc))) from None
        except Exception as exc:  # llguidance raises ValueError/RuntimeError/its own errors
            raise ConstraintError(self.where(f"invalid {kind} grammar: {exc}")) from None
        raise ConstraintError(f"unknown grammar kind {kind!r} (json_schema, regex, lark, gbnf)")


def _size_problem(kind: str, source: Any) -> str | None:
    """What makes a grammar too big for the bounds above, or None."""
    if kind == "json_schema":
        return _schema_problem(source)
    if not isinstance(source, str):
        return None  # compile() says what is wrong
    limit = MAX_REGEX_CHARS if kind == "regex" else MAX_GRAMMAR_CHARS
    if len(source) > limit:
        return f"the {kind} grammar has {len(source)} characters, more than the {limit} allowed"
    if kind in ("lark", "gbnf"):
        rule = r"^\s*[\w-]+\s*::=" if kind == "gbnf" else r"^\s*[?!]?\w+(?:\.-?\d+)?\s*:"
        rules = len(re.findall(rule, source, re.M))
        if rules > MAX_RULES:
            return f"the {kind} grammar has {rules} rules, more than the {MAX_RULES} allowed"
    for schema in _embedded_schemas(source) if kind == "lark" else ():
        problem = _schema_problem(schema)
        if problem:
            return f"a %json schema in the lark grammar: {problem}"
    depth = _bracket_depth(source, kind)
    if depth > MAX_NESTING:
        return f"the {kind} grammar nests brackets {depth} deep, more than the {MAX_NESTING} allowed"
    return None


def _embedded_schemas(text: str) -> list[Any]:
    """The JSON schemas of a Lark grammar's ``%json {...}`` rules (the ones that parse as JSON)."""
    decoder, out = json.JSONDecoder(), []
    for found in re.finditer(r"%json\s*", text):
        try:
            out.append(decoder.raw_decode(text, found.end())[0])
        except (ValueError, RecursionError):
            pass  # llguidance reports what is wrong with it
    return out


def _bracket_depth(text: str, kind: str) -> int:
    """How deeply ( [ { nest in a grammar's text, outside strings, regex literals, character
    classes, escapes and comments."""
    depth = deepest = i = 0
    skip = {'"': '"', "/": "/"} if kind == "lark" else {'"': '"', "[": "]"} if kind == "gbnf" else {"[": "]"}
    comment = "//" if kind == "lark" else "#" if kind == "gbnf" else None
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if comment and text.startswith(comment, i):
            i = text.find("\n", i)
            i = len(text) if i < 0 else i
        elif c in skip:  # to the closing character, past escapes
            i += 1
            while i < len(text) and text[i] != skip[c]:
                i += 2 if text[i] == "\\" else 1
        elif c in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in ")]}":
            depth = max(depth - 1, 0)
        i += 1
    return deepest


def _schema_problem(schema: Any) -> str | None:
    """Size, node count and depth (following local ``$ref``) of a JSON schema, against the bounds."""
    if schema is None or isinstance(schema, bool):
        return None
    try:
        size = len(json.dumps(schema))
    except (TypeError, ValueError):
        return "the JSON schema is not JSON (only objects, arrays, strings, numbers, booleans and null)"
    except RecursionError:
        return f"the JSON schema nests more than {MAX_SCHEMA_DEPTH} levels deep"
    if size > MAX_SCHEMA_CHARS:
        return f"the JSON schema has {size} characters, more than the {MAX_SCHEMA_CHARS} allowed"
    heights: dict[int, int] = {}  # id -> the deepest path below it; 0 while on the current path
    nodes = 0
    too_deep = (f"the JSON schema nests more than {MAX_SCHEMA_DEPTH} levels deep (counting the schemas each "
                "$ref leads to)")

    def height(node: Any, depth: int) -> int:
        nonlocal nodes
        known = heights.get(id(node))
        if depth + (known or 0) > MAX_SCHEMA_DEPTH:
            raise ConstraintError(too_deep)
        if known is not None:
            return known  # seen before: below a $ref cycle, on the current path, counts 0
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise ConstraintError(f"the JSON schema has more than {MAX_SCHEMA_NODES} objects and arrays")
        heights[id(node)] = 0
        optional = _optional_properties(node)
        if optional > MAX_OPTIONAL_PROPERTIES:
            raise ConstraintError(f"an object in the JSON schema has {optional} optional properties, more than the "
                                  f"{MAX_OPTIONAL_PROPERTIES} allowed (list the ones it must have in required)")
        children = list(node.values() if isinstance(node, dict) else node)
        if isinstance(node, dict) and isinstance(node.get("$ref"), str):
            children.append(_resolve(schema, node["$ref"]))
        below = max((height(c, depth + 1) for c in children if isinstance(c, (dict, list))), default=0)
        heights[id(node)] = below + 1
        return below + 1

    try:
        height(schema, 1)
    except ConstraintError as exc:
        return str(exc)
    return None


def _optional_properties(node: Any) -> int:
    properties = node.get("properties") if isinstance(node, dict) else None
    if not isinstance(properties, dict):
        return 0
    required = node.get("required")
    return len(set(properties) - set(required if isinstance(required, list) else ()))


def _resolve(schema: Any, ref: str) -> Any:
    """The part of ``schema`` a local ``$ref`` ("#/$defs/x") points at (None where it does not)."""
    if not ref.startswith("#"):
        return None
    node = schema
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example", "required"})


def closed_objects(schema: Any) -> Any:
    """The schema with ``additionalProperties: false`` on each object schema that lists
    ``properties`` and says nothing about extra ones (as llama.cpp and Ollama read schemas: only
    the named properties), so a model is not invited to ramble on in made-up keys."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _DATA_KEYWORDS else closed_objects(v)) for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema \
            and "patternProperties" not in schema and "unevaluatedProperties" not in schema:
        out["additionalProperties"] = False
    if isinstance(schema.get("properties"), dict):  # property names are not schema keywords
        out["properties"] = {k: closed_objects(v) for k, v in schema["properties"].items()}
    return out


def grammar_for(format: Any = None, grammar: Any = None) -> Grammar | None:
    """The grammar a request asks for: ``format`` "json" (an object) or a JSON schema, or ``grammar`` (a
    ``Grammar``, or a Lark/GBNF string). None when neither is set; both is an error."""
    if format is not None and grammar is not None:
        raise ConstraintError("give format or grammar, not both")
    if format is not None:
        if format == "json":  # an object, as Ollama and OpenAI's json_object promise
            return Grammar.json({"type": "object"})
        if isinstance(format, Mapping):
            return Grammar.json(dict(format))
        if format == "":
            return None
        raise ConstraintError(f'format must be "json" or a JSON schema object, got {format!r:.60}')
    if grammar is None:
        return None
    if isinstance(grammar, Grammar):
        return grammar
    if isinstance(grammar, str):
        return Grammar.gbnf(grammar) if re.search(r"^\s*[\w-]+\s*::=", grammar, re.M) else Grammar.lark(grammar)
    raise ConstraintError(f"grammar must be a Grammar or a Lark/GBNF string, got {type(grammar).__name__}")


_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def ll_tokenizer(tokenizer) -> Any:
    """llguidance's tokenizer for one of ours (built once per tokenizer: a pass over the vocabulary)."""
    _llguidance()
    with _LOCK:
        found = _TOKENIZERS.get(tokenizer)
        if found is None:
            found = _TOKENIZERS[tokenizer] = _build_tokenizer(tokenizer)
        return found


class _Wrapper:
    """What ``llguidance.TokenizerWrapper`` reads: token bytes (special ones prefixed with 0xff, as
    llguidance marks them), EOS and BOS, and a tokenize callback on bytes."""

    def __init__(self, tokenizer):
        types = tokenizer.vocab.types
        self.tokens = [(b"\xff" if types[i] in _MARKED else b"") + tokenizer.token_to_piece(i)
                       for i in range(tokenizer.vocab_size)]
        eog = sorted(tokenizer.vocab.eog)
        self.eos_token_id = eog[0] if tokenizer.eos is None else tokenizer.eos
        self.bos_token_id = tokenizer.bos
        self.special_token_ids = [i for i in range(tokenizer.vocab_size) if types[i] in _MARKED]
        self._tokenizer = tokenizer

    def __call__(self, text: bytes) -> list[int]:
        out: list[int] = []  # plain text, no space prefix: the ids whose bytes are exactly ``text``
        self._tokenizer._encode_text(text.decode("utf-8", errors="replace"), False, out)
        return out


def _build_tokenizer(tokenizer) -> Any:
    wrapper = _Wrapper(tokenizer)
    eog = sorted(tokenizer.vocab.eog) or [wrapper.eos_token_id]
    llguidance = _llguidance()
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrapper), n_vocab=tokenizer.vocab_size,
                                  eos_token=eog)


def check(grammar: Grammar, tokenizer) -> str:
    """Compile and validate ``grammar`` for ``tokenizer``: llguidance's grammar text, or a
    ``ConstraintError`` with its message (too big, invalid, using features it cannot enforce,
    matching no output, or crashing or outlasting the compiler, which runs in a worker process:
    see ``pyggml.grammar_worker``)."""
    from pyggml import grammar_worker

    _llguidance()
    grammar.check_size()
    return grammar_worker.check(grammar, tokenizer)


def compile_here(grammar: Grammar, tokenizer) -> str:
    """What ``check`` does after the size bounds, in this process (the grammar worker's side)."""
    text = grammar.compile()
    is_error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(text, ll_tokenizer(tokenizer))
    if is_error:
        raise ConstraintError(grammar.where(f"invalid {grammar.kind} grammar: "
                                            f"{messages[0] if messages else 'unknown error'}"))
    first = Constraint(grammar, tokenizer, text)
    first.compute_mask()  # the first mask shows a grammar that matches nothing
    if first.matcher.is_error() or (first.stopped and not first.accepting):
        raise ConstraintError(grammar.where(f"the {grammar.kind} grammar matches no output (a rule defined only "
                                            "through itself, or one no text can satisfy, such as a $ref loop)"))
    return text


class Constraint:
    """One sequence's matcher and its next-token mask. Only the runner's threads touch it: the
    mask is computed (``compute_mask``) while no token is being consumed."""

    def __init__(self, grammar: Grammar, tokenizer, text: str | None = None):
        self.tokenizer = tokenizer
        self.grammar = grammar
        if text is None:  # compiled and checked (``check``) unless given
            text = check(grammar, tokenizer)
        self.matcher = _llguidance().LLMatcher(ll_tokenizer(tokenizer), text, log_level=0)
        if self.matcher.is_error():
            raise ConstraintError(grammar.where(f"invalid {grammar.kind} grammar: {self.matcher.get_error()}"))
        self.vocab_size = tokenizer.vocab_size
        self.mask = np.full((self.vocab_size + 31) // 32, -1, dtype=np.int32)
        self.mask_ready = False
        self.bias: np.ndarray | None = None
        self.draft_biases: list[np.ndarray] = []  # precomputed rows of a speculative step

    def compute_mask(self) -> None:
        """Fill the bitmask of tokens allowed next (llguidance releases the GIL meanwhile) and turn
        it into ``bias`` (vocab,) float32: 0 where allowed, -inf where not; applying it is one add."""
        self.matcher.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.mask.nbytes)
        self.bias = np.take(_BIAS, np.unpackbits(self.mask.view(np.uint8), bitorder="little")[:self.vocab_size])
        self.mask_ready = True

    def allowed(self) -> np.ndarray:
        """Bool (vocab,) of the tokens allowed next (the mask must be computed)."""
        return np.unpackbits(self.mask.view(np.uint8), bitorder="little")[:self.vocab_size].view(bool)

    def compute_draft_masks(self, drafts: list[int]) -> list[np.ndarray]:
        """The biases of a speculative step's rows, computed ahead (in the runner's worker, while the
        graph computes): row ``i`` follows ``drafts[:i]``, so the matcher steps through the draft
        (validated when it was queued), computing each mask, and is rolled back to where it was.
        Stops early where the draft leaves the grammar or ends it; the rows past that compute their
        mask when sampled. Returns them and keeps them in ``draft_biases``."""
        biases: list[np.ndarray] = []
        consumed = 0
        try:
            for i in range(len(drafts) + 1):
                if self.matcher.is_stopped() or self.matcher.is_error():
                    break
                self.compute_mask()
                biases.append(self.bias)
                if i == len(drafts) or not self.matcher.try_consume_tokens([drafts[i]]):
                    break
                consumed += 1
        finally:
            if consumed:
                self.matcher.rollback(consumed)
            self.mask_ready = bool(biases) and not consumed  # the shared mask is the first row's only then
            self.bias = biases[0] if biases else None
            self.draft_biases = biases
        return biases

    def apply(self, logits: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        """``logits`` (a new array) with every token the grammar forbids at -inf (rows past the
        tokenizer's vocabulary too): one vectorised add of the precomputed bias (``bias``: one
        from ``compute_draft_masks`` instead of the current state's)."""
        if bias is None:
            if not self.mask_ready:
                self.compute_mask()
            bias = self.bias
        if logits.shape[-1] == self.vocab_size:
            return logits + bias
        out = np.full(logits.shape, -np.inf, dtype=np.float32)
        n = min(logits.shape[-1], self.vocab_size)
        np.add(logits[:n], bias[:n], out=out[:n])
        return out

    def consume(self, token: int) -> None:
        """Advance past an accepted token (a forbidden one is an internal error)."""
        self.mask_ready = False
        self.bias = None
        if not self.matcher.consume_token(token):
            error = self.matcher.get_error()
            if any(word in error for word in _LIMIT_WORDS):  # the grammar outgrew llguidance's parser limits
                raise ConstraintError(self.grammar.where(f"the {self.grammar.kind} grammar is too large to follow "
                                                         f"(llguidance: {error.splitlines()[0]})"))
            raise RuntimeError(f"constrained decoding: token {token} was not allowed by the grammar ({error})")

    def validate(self, tokens: list[int]) -> int:
        """How many of ``tokens`` (a draft) the grammar accepts from here."""
        return self.matcher.validate_tokens(tokens)

    @property
    def stopped(self) -> bool:
        """The grammar is complete and nothing may follow (generation stops)."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()


def _llguidance() -> Any:
    """llguidance, imported on first use: a run without a grammar never loads it (~60 ms)."""
    try:
        import llguidance
    except ImportError:  # pragma: no cover - llguidance is a dependency
        raise ConstraintError("constrained decoding needs the llguidance package: pip install llguidance") from None
    return llguidance
