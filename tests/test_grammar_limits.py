"""Issue 25 item 1: grammars and schemas are bounded before llguidance sees them (400 naming the
request field), and compiled first in a worker process with a time limit, so a grammar that crashes
or outlasts the compiler costs that request, not the server. The server runs in a child process
(tests/_grammar_probe.py): before the fix one of these requests killed it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llguidance", reason="constrained decoding needs llguidance")

from pyggml.constrain import (  # noqa: E402
    MAX_NESTING,
    MAX_OPTIONAL_PROPERTIES,
    MAX_RULES,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_NODES,
    ConstraintError,
    Grammar,
    check,
)
from pyggml.grammar_worker import GrammarWorker  # noqa: E402

from . import _grammar_probe as probe  # noqa: E402
from .conftest import SHARED_MODELS  # noqa: E402

STORIES = SHARED_MODELS / "stories260K.gguf"
ROOT = Path(__file__).resolve().parent.parent


def run_probe(*args: str, timeout: int = 600) -> list[dict]:
    pytest.importorskip("uvicorn")
    pytest.importorskip("httpx")
    if not STORIES.exists():
        pytest.skip(f"{STORIES} is not there")
    env = dict(os.environ, GGML_NO_BACKTRACE="1", PYTHONFAULTHANDLER="1")
    proc = subprocess.run([sys.executable, "-m", "tests._grammar_probe", str(STORIES), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    tail = proc.stdout[-3000:] + "\n--- stderr ---\n" + proc.stderr[-3000:]
    assert proc.returncode == 0, f"the server's process died with {proc.returncode}\n{tail}"
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_the_issue_reproductions_answer_400_and_the_server_lives():
    """3,000 chained Lark rules, a 3,000-long $ref/anyOf chain, 10,000 chained GBNF rules, and a $ref
    chain inside Lark's %json: each refused by the size bounds, naming the field."""
    results = run_probe("repro")
    assert [r["case"] for r in results] == list(probe.REPRO)
    for r in results:
        assert r["status"] == 400 and r["message"].startswith(r["field"] + ": "), r
        assert r["alive"], r
    assert "a %json schema in the lark grammar" in results[-1]["message"]


def test_a_grammar_that_crashes_the_compiler_costs_only_the_worker(tokenizer):
    """The worker itself compiles what it is given (the bounds are ``check``'s): the issue's 3,000
    chained rules crash llguidance there, and the caller gets a ConstraintError."""
    worker = GrammarWorker(seconds=300)
    try:
        with pytest.raises(ConstraintError, match=r"crashed the grammar compiler \(signal SIGSEGV\)"):
            worker.check(Grammar.lark(probe.lark_chain(3000)), tokenizer)
        assert worker.check(Grammar.regex("[ab]{3}"), tokenizer)  # a new worker
    finally:
        worker.stop()


def test_grammar_and_schema_size_fuzz():
    """Every family (chains, nesting, width, loops) gives a clean 400 or matching output: no
    crash, no hang, no wrong answer. The counts go to the report (pytest -s shows them)."""
    results = run_probe("fuzz", "25", str(2 * len(probe.FAMILIES)))
    counts = results[-1]
    print(json.dumps(counts, indent=1))
    for family, c in counts.items():
        cases = [r for r in results if r.get("case") == family]
        assert c["tried"] == 2 and c["clean"] == c["tried"], (family, c, cases)


# ---- the bounds, one by one -----------------------------------------------------------------------
def refused(grammar: Grammar, words: str) -> None:
    with pytest.raises(ConstraintError, match=words):
        grammar.named("field").check_size()
    with pytest.raises(ConstraintError, match="^field: "):
        grammar.named("field").check_size()


def test_size_bounds():
    refused(Grammar.lark(probe.lark_chain(MAX_RULES)), "rules, more than")
    refused(Grammar.gbnf(probe.gbnf_chain(MAX_RULES)), "rules, more than")
    refused(Grammar.lark("start: " + "(" * (MAX_NESTING + 1) + '"a"' + ")" * (MAX_NESTING + 1)), "nests brackets")
    refused(Grammar.regex("(" * (MAX_NESTING + 1) + "a" + ")" * (MAX_NESTING + 1)), "nests brackets")
    refused(Grammar.regex("a" * (65 << 10)), "characters, more than")
    refused(Grammar.json(probe.schema_chain(MAX_SCHEMA_DEPTH)), r"levels deep \(counting the schemas each \$ref")
    refused(Grammar.json({"anyOf": [{"type": "array"} for _ in range(MAX_SCHEMA_NODES)]}), "objects and arrays")
    refused(Grammar.json({"const": {1, 2}}), "not JSON")
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(MAX_OPTIONAL_PROPERTIES + 1)}}
    refused(Grammar.json(wide), "optional properties, more than")
    Grammar.json({**wide, "required": ["p0"]}).check_size()
    refused(Grammar.lark("start: %json " + json.dumps(probe.schema_chain(3000))), "a %json schema in the lark grammar")
    nested: dict = {"type": "integer"}
    for _ in range(MAX_SCHEMA_DEPTH):
        nested = {"items": nested}
    refused(Grammar.json(nested), "levels deep")
    # what stays allowed: brackets in strings, regexes and classes do not count, nor a $ref cycle
    Grammar.lark('start: "((((((" /[(((((]+/ // ((((((((\n' * 30).check_size()
    Grammar.gbnf('root ::= [(((((] "((((((" # ((((((((\n' * 30).check_size()
    Grammar.json({"$ref": "#/$defs/t", "$defs": {"t": {"type": "array", "items": {"$ref": "#/$defs/t"}}}}).check_size()
    Grammar.lark(probe.lark_chain(MAX_RULES - 3)).check_size()
    Grammar.json(probe.schema_chain(30)).check_size()


@pytest.fixture(scope="module")
def tokenizer():
    import gguf

    from pyggml.tokenizer import from_metadata

    if not STORIES.exists():
        pytest.skip(f"{STORIES} is not there")
    reader = gguf.GGUFReader(STORIES)
    return from_metadata({f.name: f.contents() for f in reader.fields.values()})


def test_the_worker_time_limit_and_restart(tokenizer):
    """A grammar that outlasts the limit (converting 990 chained GBNF rules takes seconds) is a
    ConstraintError; the worker is replaced, the next grammar compiles, and so does the slow one
    under a longer limit (a timeout depends on the load: it is not cached)."""
    worker = GrammarWorker(seconds=60)
    try:
        worker.check(Grammar.regex("warm|up"), tokenizer)  # started, tokenizer sent: a busy CPU may be slow
        worker.seconds = 0.05  # 30x less than the conversion below takes here
        with pytest.raises(ConstraintError, match="took longer than 0.05 s"):
            worker.check(Grammar.gbnf(probe.gbnf_chain(990)), tokenizer)
        worker.seconds = 60
        assert worker.check(Grammar.regex("[ab]{3}"), tokenizer)
        assert worker.check(Grammar.gbnf(probe.gbnf_chain(990)), tokenizer)  # a timeout is not remembered
    finally:
        worker.stop()


def test_checked_grammars_are_cached_per_tokenizer(tokenizer):
    worker = GrammarWorker()
    try:
        text = worker.check(Grammar.json({"type": "object"}), tokenizer)
        worker.stop()  # the answer is remembered: no worker needed for the same grammar
        assert worker.check(Grammar.json({"type": "object"}), tokenizer) == text and worker._proc is None
    finally:
        worker.stop()


def test_check_names_the_field_in_compile_errors(tokenizer):
    with pytest.raises(ConstraintError, match="^response_format: invalid json_schema grammar"):
        check(Grammar.json({"type": "strin"}).named("response_format"), tokenizer)
