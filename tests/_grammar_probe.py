"""Hostile grammars and schemas against a live server, run as a child process by
tests/test_grammar_limits.py (a crash then fails a test instead of killing the test run):

    python -m tests._grammar_probe MODEL repro
    python -m tests._grammar_probe MODEL fuzz SEED COUNT

Prints one JSON line per request ({"case", "status", "message", "seconds"}) and, for ``fuzz``, a
last line {"family": {"tried", "clean", "crash", "hang", "wrong"}}: clean is a 400 naming the field
or a 200 that matches; wrong is any other answer (a 5xx, a 200 for a grammar that matches nothing,
output that does not match); hang is no answer within the timeout; crash is a server that no
longer answers a plain request afterwards.
"""

from __future__ import annotations

import json
import re
import sys
import time

import numpy as np

TIMEOUT = 60.0


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f'r{i}: "a{i}" | r{i + 1}\n' for i in range(n)) + f'r{n}: "end"\n'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f'r{i} ::= "a{i}" | r{i + 1}\n' for i in range(n)) + f'r{n} ::= "end"\n'


def schema_chain(n: int) -> dict:
    defs = {f"d{i}": {"anyOf": [{"type": "integer"}, {"$ref": f"#/$defs/d{i + 1}"}]} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def generate(grammar_body: dict) -> tuple[str, dict]:
    return "/api/generate", {"prompt": "a", "options": {"num_predict": 8, "temperature": 1.0, "seed": 1},
                             **grammar_body}


def chat_schema(schema: dict) -> tuple[str, dict]:
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 8, "seed": 1,
                                    "response_format": {"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": schema}}}


# the issue's reproductions, and the same $ref chain inside Lark's %json
REPRO = {
    "lark 3,000 chained rules": (generate({"grammar": lark_chain(3000)}), "grammar"),
    "schema 3,000 chained $defs": (chat_schema(schema_chain(3000)), "response_format.json_schema.schema"),
    "gbnf 10,000 chained rules": (generate({"grammar": gbnf_chain(10000)}), "grammar"),
    "lark %json 3,000 chained $defs": (generate({"grammar": "start: %json " + json.dumps(schema_chain(3000))}),
                                       "grammar"),
}


class RawJSON:
    """A request field's JSON text, sent as it is."""

    def __init__(self, text: str):
        self.text = text


def post(base: str, model: str, route: str, body: dict) -> tuple[int | None, str]:
    """(status, error message or generated text); status None: no answer within TIMEOUT."""
    import httpx

    raw = {key: value.text for key, value in body.items() if isinstance(value, RawJSON)}
    content = json.dumps({"model": model, "stream": False, **{k: k if k in raw else v for k, v in body.items()}})
    for key, text in raw.items():  # nesting too deep for json.dumps, spliced in as text
        content = content.replace(f'"{key}": "{key}"', f'"{key}": {text}', 1)
    try:
        response = httpx.post(base + route, content=content, headers={"Content-Type": "application/json"},
                              timeout=TIMEOUT)
    except httpx.TimeoutException:
        return None, "timeout"
    except httpx.TransportError as exc:
        return -1, f"{type(exc).__name__}: {exc}"
    data = response.json()
    if response.status_code != 200:
        error = data["error"]
        return response.status_code, error["message"] if isinstance(error, dict) else error
    if route == "/v1/chat/completions":
        return 200, data["choices"][0]["message"]["content"]
    return 200, data["response"]


def alive(base: str, model: str) -> bool:
    status, _ = post(base, model, "/api/generate", {"prompt": "a", "options": {"num_predict": 2}})
    return status == 200


def chain_prefix(text: str) -> bool:  # what the chains match, cut short by num_predict
    return re.fullmatch(r"a\d*|e|en|end|", text) is not None


def number_or_string_prefix(text: str) -> bool:
    return re.fullmatch(r'-?\d*|".*', text, re.S) is not None


# ---- fuzz families: (name, make(rng) -> (route, body, field, check)); check(text) says whether a 200's
# text is right (None: the case must be refused, a 200 is wrong)
def _lark_chain(rng):
    n = int(rng.integers(1, 4000))
    return generate({"grammar": lark_chain(n)}) + ("grammar", chain_prefix)


def _gbnf_chain(rng):
    n = int(rng.integers(1, 3000))
    return generate({"grammar": gbnf_chain(n)}) + ("grammar", chain_prefix)


def _nested_parens(rng):
    n = int(rng.integers(1, 400))
    kind = ["lark", "regex"][int(rng.integers(2))]
    text = ("start: " if kind == "lark" else "") + "(" * n + ('"a"' if kind == "lark" else "a") + ")" * n
    return generate({"grammar": {kind: text}}) + ("grammar", lambda t: t in ("", "a"))


def _long_regex(rng):
    n = int(rng.integers(1, 20000))
    return generate({"grammar": {"regex": "|".join(f"w{i}" for i in range(n))}}) + \
        ("grammar", lambda t: t == "" or re.fullmatch(r"w\d*", t) is not None)


def _schema_chain(rng):
    n = int(rng.integers(1, 4000))
    return chat_schema(schema_chain(n)) + ("response_format.json_schema.schema", number_or_string_prefix)


def _nested_arrays(rng):
    n = int(rng.integers(1, 1200))
    schema = '{"type": "array", "items": ' * n + '{"type": "integer"}' + "}" * n
    return generate({"format": RawJSON(schema)}) + ("format", lambda t: t.startswith("["))


def _wide_object(rng):
    n = int(rng.integers(1, 3000))
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}
    return generate({"format": schema}) + ("format", lambda t: t.startswith("{"))


def _ref_loop(rng):
    n = int(rng.integers(1, 50))
    defs = {f"d{i}": {"$ref": f"#/$defs/d{(i + 1) % n}"} for i in range(n)}
    return generate({"format": {"$ref": "#/$defs/d0", "$defs": defs}}) + ("format", None)


def _lark_json_chain(rng):
    n = int(rng.integers(1, 4000))
    return generate({"grammar": "start: %json " + json.dumps(schema_chain(n))}) + \
        ("grammar", number_or_string_prefix)


FAMILIES = {"lark chain": _lark_chain, "gbnf chain": _gbnf_chain, "nested brackets": _nested_parens,
            "long regex": _long_regex, "schema $ref chain": _schema_chain, "nested arrays": _nested_arrays,
            "wide object": _wide_object, "$ref loop": _ref_loop, "lark %json chain": _lark_json_chain}


def main() -> None:
    from tests._server import running_server

    model_path, mode = sys.argv[1], sys.argv[2]
    with running_server(model_path, parallel=2, num_ctx=256) as (base, served):
        if mode == "repro":
            for case, ((route, body), field) in REPRO.items():
                start = time.monotonic()
                status, message = post(base, served.name, route, body)
                print(json.dumps({"case": case, "status": status, "message": message[:300], "field": field,
                                  "seconds": round(time.monotonic() - start, 2), "alive": alive(base, served.name)}),
                      flush=True)
            return
        seed, count = int(sys.argv[3]), int(sys.argv[4])
        rng = np.random.default_rng(seed)
        counts = {name: dict.fromkeys(("tried", "clean", "crash", "hang", "wrong"), 0) for name in FAMILIES}
        for i in range(count):
            name = list(FAMILIES)[i % len(FAMILIES)]
            route, body, field, check = FAMILIES[name](rng)
            status, message = post(base, served.name, route, body)
            verdict = ("hang" if status is None else "crash" if not alive(base, served.name)
                       else "clean" if (status == 400 and (message.startswith(field) or "nested too deeply" in message))
                       or
                       (status == 200 and check is not None and check(message)) else "wrong")
            counts[name]["tried"] += 1
            counts[name][verdict] += 1
            print(json.dumps({"case": name, "status": status, "verdict": verdict, "message": message[:200]}),
                  flush=True)
            if verdict == "crash":
                break
        print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    main()
