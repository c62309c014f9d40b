"""``pyggml run MODEL`` as a chat REPL, driven through a pseudo-terminal (pexpect) on the demo
model: turns reuse the cached conversation, slash commands, multi-line input, Ctrl-C stops a reply
and returns to the prompt, Ctrl-D exits. Greedy decoding with the end token banned: the replies
do not depend on when a random model would stop."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect", reason="the REPL tests need pexpect (pip install pexpect)")
if sys.platform == "win32":  # pragma: no cover
    pytest.skip("pseudo-terminals need a POSIX system", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
GREEDY = ["--temperature", "0", "--threads", "1", "--logit-bias", "2=-inf"]


def spawn(tmp_path, *args: str) -> pexpect.spawn:
    env = {**os.environ, "PYGGML_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)}
    child = pexpect.spawn(sys.executable, ["-m", "pyggml.cli", "run", *args], env=env, encoding="utf-8",
                          timeout=120, dimensions=(40, 200))
    child.expect_exact(">>> ")
    return child


def finish(child: pexpect.spawn) -> int:
    child.expect(pexpect.EOF)
    child.close()
    return child.exitstatus


def test_a_conversation_reuses_the_cache_and_slash_commands_work(tmp_path):
    child = spawn(tmp_path, "demo", "--max-tokens", "6", "--verbose", *GREEDY)
    child.sendline("hello there")
    child.expect(r"prompt cache: +(\d+) token")
    assert child.match.group(1) == "0"
    child.expect_exact(">>> ")
    child.sendline("and again")  # the first turn is in the cache: only the new turn is evaluated
    child.expect(r"prompt eval count: +(\d+) token\(s\)\r\n.*\r\n.*\r\nprompt cache: +(\d+) token")
    assert int(child.match.group(2)) > 0
    child.expect_exact(">>> ")
    child.sendline('"""first line')
    child.expect_exact("... ")
    child.sendline('second line"""')
    child.expect("eval rate")
    child.expect_exact(">>> ")
    child.sendline("/set parameter top_k 7")
    child.expect_exact("Set parameter 'top_k' to '7'")
    child.sendline("/set parameter temperature -1")
    child.expect_exact("Couldn't set parameter")
    child.sendline("/show parameters")
    child.expect(r"top_k +7")
    child.sendline("/show template")
    child.expect_exact("add_generation_prompt")
    child.sendline("/show info")
    child.expect(r"architecture +llama")
    child.sendline("/set system You are terse.")
    child.expect_exact("Set system message.")
    child.sendline("/show system")
    child.expect_exact("You are terse.")
    child.sendline("/clear")
    child.expect_exact("Cleared session context")
    child.sendline("/set quiet")
    child.sendline("hello there")
    child.expect_exact(">>> ")
    child.sendline("/nonsense")
    child.expect_exact("Unknown command '/nonsense'")
    child.sendline("/?")
    child.expect_exact("/set parameter")
    child.sendline("/load no-such-model-anywhere")
    child.expect_exact("Couldn't load model")
    child.sendline("/load demo")
    child.expect_exact("Loading model 'demo'")
    child.sendline("/bye")
    assert finish(child) == 0


def test_ctrl_c_stops_the_reply_and_ctrl_d_exits(tmp_path):
    child = spawn(tmp_path, "demo", "--max-tokens", "100000000", *GREEDY)
    child.sendline("tell me everything")
    child.expect_exact("tell me everything\r\n")  # the terminal's echo
    child.expect(r"\S\S")  # the reply is being written
    child.sendintr()
    child.expect_exact("(stopped)")
    child.expect_exact(">>> ")
    child.sendintr()  # at the prompt: a hint, not an exit
    if child.expect_exact(["Use Ctrl + d or /bye to exit.", pexpect.TIMEOUT], timeout=5) == 1:
        # The prompt is written before readline waits for input: a Ctrl-C in between (a busy CPU makes
        # that window long) is seen only once a key arrives. An empty line is that key; either way the
        # hint must come and the REPL must stay.
        child.send("\r")
        child.expect_exact("Use Ctrl + d or /bye to exit.")
    child.expect_exact(">>> ")
    child.sendline("/set parameter num_predict 3")
    child.expect_exact("Set parameter 'num_predict' to '3'")
    child.expect_exact(">>> ")
    child.sendline("still here?")  # the engine is usable after the stopped reply
    child.expect_exact("still here?\r\n")
    child.expect_exact(">>> ")
    child.sendeof()
    assert finish(child) == 0
    assert "Traceback" not in (child.before or "")


def test_raw_mode_is_plain_completion(tmp_path):
    child = spawn(tmp_path, "demo", "--raw", "--max-tokens", "4", *GREEDY)
    child.sendline("/show parameters")
    child.expect(r"num_predict +4")
    child.sendline("Once upon a time")
    child.expect_exact(">>> ")
    child.sendline("/bye")
    assert finish(child) == 0


# ---- the pieces, in-process ----------------------------------------------------------------------------

@pytest.mark.parametrize("value, seconds", [
    (None, None), (0, 0.0), ("0", 0.0), (-1, None), ("-1", None), ("-5m", None), (30, 30.0), ("30s", 30.0),
    ("5m", 300.0), ("1h30m", 5400.0), ("250ms", 0.25), (1.5, 1.5),
])
def test_keep_alive_durations_as_ollama_reads_them(value, seconds):
    from pyggml.repl import parse_duration

    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5x", "m5", "", True, [1], float("inf")])
def test_bad_keep_alive_durations_are_refused(value):
    from pyggml.repl import parse_duration

    with pytest.raises(ValueError, match="keep_alive"):
        parse_duration(value)


def test_keep_alive_unloads_an_idle_model_and_the_next_turn_reloads_it():
    from pyggml.repl import Session

    class Fake:
        closed = False

        def close(self):
            self.closed = True

    loaded = []
    session = Session(load=lambda ref: loaded.append(Fake()) or loaded[-1], model_ref="x", options={},
                      keep_alive=0.0)
    first = session.ensure_loaded()
    session._arm_keep_alive()
    session._timer.join(10)
    assert session.llm is None and first.closed
    assert session.ensure_loaded() is loaded[1] and len(loaded) == 2


def test_each_turn_evaluates_only_the_new_text(tmp_path, monkeypatch):
    """The conversation's earlier turns, the replies included, are sent as the ids the runner already
    holds: the KV cache covers all of them and only the new turn is evaluated."""
    import io

    import pyggml
    from pyggml.chat import ChatTemplate
    from pyggml.repl import Session
    from pyggml.tiny import default_model_path

    monkeypatch.setenv("PYGGML_CACHE_DIR", str(tmp_path))
    out = io.StringIO()
    with pyggml.load(default_model_path(), n_threads=1) as llm:
        session = Session(load=lambda ref: llm, model_ref="demo", out=out, err=out,
                          options={"max_tokens": 6, "temperature": 0, "logit_bias": {2: float("-inf")}})
        # a template whose generation prompt is where the reply goes (as real chat templates are)
        session._template = (llm, ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                                               "{% if add_generation_prompt %}<assistant>{% endif %}"))
        session.ensure_loaded()
        session.reply("hello there")
        held = len(session._history[1])  # the first prompt and the 6 generated tokens
        session.reply("and again")
        assert llm.stats.cached_tokens == held - 1  # all but the last reply token, which was never evaluated
        held = len(session._history[1])
        session.command("/set system be brief")  # a new conversation: nothing of it is cached
        session.reply("hi")
        assert llm.stats.cached_tokens < held - 1


# ---- thinking, settings, stored models (issue 29 items 4 and 7) -----------------------------------------
THINKING_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                     "{% if add_generation_prompt %}assistant:{% if enable_thinking is defined and "
                     "not enable_thinking %}<think></think>{% endif %}{% endif %}")
THINK_GRAMMAR = 'start: "<think>" /[a-z]{2,6}/ " " /[a-z]{2,6}/ "</think>" /[a-z]{2,6}/\n'


@pytest.fixture
def thinker(tmp_path):
    """A demo-sized model whose template thinks, a grammar making it write a block, and private stores."""
    from pyggml.tiny import write_tiny_model

    path = write_tiny_model(tmp_path / "thinker.gguf", THINKING_TEMPLATE)
    (tmp_path / "think.lark").write_text(THINK_GRAMMAR)
    return path, tmp_path / "think.lark"


@pytest.fixture
def stores(tmp_path, monkeypatch):
    for key, var in (("ollama", "OLLAMA_MODELS"), ("pyggml", "PYGGML_MODELS"), ("hf", "HF_HUB_CACHE")):
        (tmp_path / key).mkdir()
        monkeypatch.setenv(var, str(tmp_path / key))
    monkeypatch.setenv("PYGGML_CACHE_DIR", str(tmp_path))


def test_thinking_is_shown_apart_and_set_nothink_hides_it(tmp_path, thinker, stores):
    path, grammar = thinker
    child = spawn(tmp_path, str(path), "--grammar", str(grammar), "--max-tokens", "80", *GREEDY)
    child.sendline("think first")
    child.expect(r"Thinking\.\.\.\r\n([a-z]+ [a-z]+)\r\n\.\.\.done thinking\.\r\n\r\n([a-z]+)\r\n")
    thought, said = child.match.groups()
    child.expect_exact(">>> ")
    child.sendline("/save thought")  # the conversation keeps the answer as the turn's content
    child.expect_exact("Created new model 'thought'")
    child.sendline("/set think high")
    child.expect_exact("Couldn't set thinking: think 'high': levels are for gpt-oss")
    child.sendline("/set nothink")
    child.expect_exact("Set 'nothink' mode.")
    child.expect_exact(">>> ")
    child.sendline("again")
    child.expect_exact(">>> ")
    assert "Thinking" not in child.before and "<think>" not in child.before
    child.sendline("/set think")
    child.expect_exact("Set 'think' mode.")
    child.sendline("/bye")
    assert finish(child) == 0
    from pyggml import store

    assert store.resolve("thought").messages == [{"role": "user", "content": "think first"},
                                                 {"role": "assistant", "content": said}]
    assert thought

    env = {**os.environ, "PYGGML_CACHE_DIR": str(tmp_path)}
    import subprocess

    for think, shows in (("--think", True), ("--think=false", False)):
        run = subprocess.run([sys.executable, "-m", "pyggml.cli", "run", str(path), "think first", think,
                              "--grammar", str(grammar), "--max-tokens", "80", *GREEDY],
                             capture_output=True, text=True, env=env, timeout=120)
        assert run.returncode == 0, run.stderr
        assert ("Thinking...\n" in run.stdout and "\n...done thinking.\n\n" in run.stdout) == shows, run.stdout
        assert "<think>" not in run.stdout


def test_settings_save_and_load_a_stored_model(tmp_path, stores):
    from pyggml import manifest, modelfile, store

    manifest.create("stored", modelfile.parse("FROM demo\nSYSTEM Be brief.\nPARAMETER top_k 7\nPARAMETER num_ctx 96\n"
                                              "LICENSE Demo licence.\nMESSAGE user hello there\n"
                                              "MESSAGE assistant hi back\n"))
    child = spawn(tmp_path, "demo", "--max-tokens", "4", *GREEDY)
    child.sendline("/load stored")  # the stored model's parameters, system message, context and first turns
    child.expect_exact("Loading model 'stored'")
    child.expect_exact(">>> hello there\r\nhi back")
    child.sendline("/show system")
    child.expect_exact("Be brief.")
    child.sendline("/show parameters")
    child.expect(r"top_k +7")
    child.sendline("/show license")
    child.expect_exact("Demo licence.")
    child.sendline("/show info")
    child.expect(r"context +96 ")
    child.sendline("/show modelfile")
    child.expect_exact('SYSTEM """Be brief."""')
    child.expect_exact("PARAMETER num_ctx 96")
    child.expect_exact('MESSAGE user """hello there"""')
    child.sendline("/set parameter num_ctx 64")
    child.expect_exact("Set parameter 'num_ctx' to '64'")
    child.sendline("/show info")
    child.expect(r"context +64 ")
    child.sendline("/set parameter top_k 3")
    child.sendline("/set format json")
    child.expect_exact("Set format to 'json' mode.")
    child.sendline("/set noformat")
    child.expect_exact("Disabled format.")
    for mode in ("nowordwrap", "wordwrap", "nohistory", "history"):
        child.sendline(f"/set {mode}")
        child.expect_exact(f"Set '{mode}' mode.")
    child.sendline("how are you")
    child.expect_exact("how are you\r\n")
    child.expect_exact(">>> ")
    child.sendline("/save saved:v1")
    child.expect_exact("Created new model 'saved:v1'")
    child.sendline("/bye")
    assert finish(child) == 0

    saved = store.resolve("saved:v1")
    assert saved.system == "Be brief." and saved.params["top_k"] == 3 and saved.params["num_ctx"] == 64
    assert saved.params["temperature"] == 0 and "format" not in saved.params
    assert [m["role"] for m in saved.messages] == ["user", "assistant", "user", "assistant"]
    assert saved.messages[2]["content"] == "how are you" and saved.license == ["Demo licence."]


def test_word_wrap_breaks_between_words():
    from pyggml.repl import WordWrap

    wrap = WordWrap(10)
    pieces = ["hel", "lo there my", " fri", "end\nsupercalifragilistic x"]
    wrapped = "".join(wrap.feed(p) for p in pieces) + wrap.flush()
    assert wrapped == "hello \nthere my \nfriend\nsupercalif\nragilistic \nx"
    assert WordWrap(10).feed("x" * 25) == "x" * 10 + "\n" + "x" * 10  # a long run is written as it comes
