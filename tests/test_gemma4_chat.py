"""Gemma 4's output format: reasoning in ``<|channel>thought`` ... ``<channel|>`` (``ChannelSplitter``,
read as llama.cpp's gemma4 parser reads it, however the output is cut into pieces) and tool calls
``<|tool_call>call:NAME{key:value}<tool_call|>`` with strings between ``<|"|>`` marks (the "gemma4" tool
format); both recognised from a Gemma-4-like chat template, and end to end through ``LLM`` and the server
with a grammar making a random-weight model write them."""

from __future__ import annotations

import json

import pytest

from pyggml.thinking import (
    ChannelSplitter,
    HarmonySplitter,
    ThinkingSplitter,
    prompt_opens_thinking,
    splitter_for,
    template_thinks,
    template_variables,
)
from pyggml.tools import FORMATS, ToolCallParser, detect_format, forced_grammar, parse

from .test_thinking import split as split_with
from .test_tools import TIME, WEATHER, accepts

# A Gemma-4-like template: its markers and enable_thinking as the real one uses them (the real one writes an
# empty thought when thinking is off, so the model's output then starts with the answer)
TEMPLATE = ("{{ bos_token }}{% if enable_thinking is defined and enable_thinking %}<|turn>system\n<|think|>\n"
            "<turn|>\n{% endif %}{% for m in messages %}<|turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
            "{% if m.tool_calls %}{% for c in m.tool_calls %}<|tool_call>call:{{ c.function.name }}{}<tool_call|>"
            "{% endfor %}{% endif %}{{ m.content or '' }}<turn|>\n{% endfor %}"
            "{% if tools %}{% for t in tools %}<|tool>{{ t.function.name }}<tool|>{% endfor %}{% endif %}"
            "{% if add_generation_prompt %}<|turn>model\n{% if not enable_thinking | default(false) %}"
            "<|channel>thought\n<channel|>{% endif %}{% endif %}")

# (output, whether the prompt opened the thought, thinking, answer)
SPLITS = [
    ("<|channel>thought\nLet me see: 2 + 2.<channel|>It is 4.", False, "Let me see: 2 + 2.", "It is 4."),
    ("<|channel>thought\n\n<channel|>Empty thought.", False, "", "Empty thought."),
    ("  <|channel>thought a\n<channel|>\nb", False, "a", "b"),
    ("No thinking here.", False, "", "No thinking here."),
    ("It is 4.<|channel>thought\n<channel|>", False, "", "It is 4."),  # the empty thought after the answer
    ("It is 4.<channel|>", False, "", "It is 4."),  # a stray close ends the answer
    ("It is 4.<channel|>and what follows is dropped", False, "", "It is 4."),
    ("Half<|channel>final", False, "", "Half"),  # a channel other than the thought ends it too
    ("Cut<|channel>", False, "", "Cut"),
    ("<|channel>thought\nA<channel|>B<|channel>thought\nC<channel|>D", False, "AC", "BD"),
    ("<|channel>thought\ncut off mid-thou", False, "cut off mid-thou", ""),
    ("<|chan", False, "", "<|chan"),  # only looked like a tag
    ("a <| b <chan|nel> c", False, "", "a <| b <chan|nel> c"),
    ("<|channel>thought\n<think>x</think> a < b<channel|>y", False, "<think>x</think> a < b", "y"),
    ("\nweighing it\n<channel|>Yes.", True, "weighing it", "Yes."),  # the prompt opened the thought
    ("Sure.<|tool_call>call:f{a:<|\"|>x<|\"|>}<tool_call|>", False, "", "Sure.<|tool_call>call:f{a:<|\"|>x<|\"|>}"
     "<tool_call|>"),  # calls are the tool parser's
]


def split(pieces: list[str], inside: bool) -> tuple[str, str]:
    return split_with(pieces, inside, ChannelSplitter)


@pytest.mark.parametrize("output, inside, thinking, answer", SPLITS)
def test_split_whole_and_in_every_two_and_one_char_pieces(output, inside, thinking, answer):
    assert split([output], inside) == (thinking, answer)
    for i in range(len(output) + 1):
        assert split([output[:i], output[i:]], inside) == (thinking, answer), i
        for j in range(i, len(output) + 1, 3):
            assert split([output[:i], output[i:j], output[j:]], inside) == (thinking, answer), (i, j)
    assert split(list(output), inside) == (thinking, answer)


def test_the_template_picks_the_channel_splitter_and_enable_thinking():
    assert template_thinks(TEMPLATE)
    assert isinstance(splitter_for(TEMPLATE, "<|turn>model\n"), ChannelSplitter)
    assert template_variables(TEMPLATE, True) == {"enable_thinking": True}
    assert template_variables(TEMPLATE, False) == {"enable_thinking": False}
    with pytest.raises(ValueError, match="levels are for gpt-oss"):
        template_variables(TEMPLATE, "high")
    # the other formats keep their splitters (harmony's <|channel|> is not Gemma's <|channel>)
    assert type(splitter_for("<think></think>", "")) is ThinkingSplitter
    assert isinstance(splitter_for("<|start|>{{ m }}<|channel|>final<|message|>", ""), HarmonySplitter)
    assert splitter_for("{{ messages }}", "") is None


def test_rendered_prompts_open_or_close_the_thought():
    from pyggml.chat import ChatTemplate

    template = ChatTemplate(TEMPLATE)
    messages = [{"role": "user", "content": "Hi"}]
    off = template.render(messages, add_generation_prompt=True, enable_thinking=False)
    on = template.render(messages, add_generation_prompt=True, enable_thinking=True)
    assert off.endswith("<|channel>thought\n<channel|>") and "<|think|>" in on
    assert not prompt_opens_thinking(off, "<|channel>thought") and not prompt_opens_thinking(on, "<|channel>thought")
    assert prompt_opens_thinking("<|turn>model\n<|channel>thought\n", "<|channel>thought")
    assert split(["a<channel|>b"], prompt_opens_thinking(off + "<|channel>thought\n", "<|channel>thought")) == \
        ("a", "b")


# ---- tool calls ------------------------------------------------------------------------------------------
Q = '<|"|>'
CALLS = [
    (f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:2}}<tool_call|>", "",
     [("get_weather", {"city": "Paris", "days": 2})]),
    (f"Let me check.\n<|tool_call>call:get_weather{{city:{Q}Oslo, \"old\" town{Q},days:1}}<tool_call|>"
     "<|tool_call>call:get_time{}<tool_call|>", "Let me check.",
     [("get_weather", {"city": 'Oslo, "old" town', "days": 1}), ("get_time", {})]),
    (f"<|tool_call>call:plan{{steps:[{{at:-1.5e2,ok:true}},{{at:0,ok:false,why:null}}],tags:[{Q}a{Q},{Q}b:c{Q}],"
     f"nested:{{deeper:{{list:[[1,2],[]],text:{Q}line\nbreak{Q}}}}}}}<tool_call|>", "",
     [("plan", {"steps": [{"at": -150.0, "ok": True}, {"at": 0, "ok": False, "why": None}], "tags": ["a", "b:c"],
                "nested": {"deeper": {"list": [[1, 2], []], "text": "line\nbreak"}}})]),
    (f"<|tool_call>call:get_weather{{ city: {Q}Rome{Q}, days: 3 }}<tool_call|>", "",  # spaces as llama.cpp allows
     [("get_weather", {"city": "Rome", "days": 3})]),
    (f"<|tool_call>call:get_weather{{city:{Q}Lima{Q},days:5}}", "",  # cut off before the close
     [("get_weather", {"city": "Lima", "days": 5})]),
    ("The answer is 4.", "The answer is 4.", []),
    # malformed: no call, the output is content
    (f"<|tool_call>call:get_weather{{city:{Q}Paris}}<tool_call|>", f"<|tool_call>call:get_weather{{city:{Q}Paris}}"
     "<tool_call|>", []),
    ("Hm <|tool_call>call:f{a:1", "Hm <|tool_call>call:f{a:1", []),
    ("<|tool_call>call:f{a:1}junk", "<|tool_call>call:f{a:1}junk", []),
    ("<|tool_call>call:f{a:tru}<tool_call|>", "<|tool_call>call:f{a:tru}<tool_call|>", []),
    ("<|tool_call>call:f{a:1,:2}<tool_call|>", "<|tool_call>call:f{a:1,:2}<tool_call|>", []),
    ("<|tool_call>get_weather{}<tool_call|>", "<|tool_call>get_weather{}<tool_call|>", []),
    ("<|tool_call>call:f[1]<tool_call|>", "<|tool_call>call:f[1]<tool_call|>", []),
    ("<|tool_call>call:f{a:" + "[" * 100 + "]" * 100 + "}<tool_call|>",
     "<|tool_call>call:f{a:" + "[" * 100 + "]" * 100 + "}<tool_call|>", []),  # nested deeper than arguments may
]


@pytest.mark.parametrize("output,content,calls", CALLS)
def test_tool_calls_parsed_whole_and_streamed(output, content, calls):
    got_content, got = parse(FORMATS["gemma4"], output)
    assert [(c.name, c.arguments) for c in got] == calls
    assert got_content == content
    for c in got:  # as the APIs send them
        assert json.loads(c.openai()["function"]["arguments"]) == c.arguments
    for size in (1, 2, 5):
        parser = ToolCallParser(FORMATS["gemma4"])
        said = "".join(parser.feed(output[i:i + size]) for i in range(0, len(output), size))
        rest, streamed = parser.finish()
        assert [(c.name, c.arguments) for c in streamed] == calls
        assert (said + rest).strip() == content.strip()
        if calls:
            assert "<|tool_call>" not in said  # a call is never passed on as content


def test_a_call_nested_deep_in_json_terms_is_refused_not_a_crash():
    deep = "<|tool_call>call:f{a:" + "[" * 100_000 + "]" * 100_000 + "}<tool_call|>"
    assert parse(FORMATS["gemma4"], deep) == (deep, [])


@pytest.mark.parametrize("source,name", [
    (TEMPLATE, "gemma4"),
    ("{%- if tools %}<|tool>{{ t }}<tool|>{% endif %}<|tool_call>call:{{ n }}{}<tool_call|><|turn>model\n", "gemma4"),
    ("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}{% if tools %}<tool_call>{% endif %}", "hermes"),
    ("<start_of_turn>user\n{{ content }}<end_of_turn>", "gemma"),
    ("<|start|>{{ m }}<|channel|>final<|message|>", "harmony"),
    (None, "json"),
])
def test_format_detected_from_the_template(source, name):
    assert detect_format(source).name == name


def test_forced_call_grammar_takes_gemma4_calls_of_the_tools_as_their_schemas_say(stories_tokenizer):
    def accepted(text: str, name: str | None = None) -> bool:
        return accepts(stories_tokenizer, forced_grammar(FORMATS["gemma4"], [WEATHER, TIME], name), text)

    good = f"<|tool_call>call:get_weather{{city:{Q}Li, ma{Q},days:5}}<tool_call|>"
    assert accepted(good) and parse(FORMATS["gemma4"], good)[1][0].arguments == {"city": "Li, ma", "days": 5}
    assert accepted("<|tool_call>call:get_time{}<tool_call|>")
    assert not accepted("<|tool_call>call:get_time{}<tool_call|>", "get_weather")  # the named one only
    assert not accepted("<|tool_call>call:nope{}<tool_call|>")
    assert not accepted('{"name":"get_time","arguments":{}}')
    for args in (f"city:{Q}Lima{Q},days:9", f"city:{Q}Much too long a city{Q},days:1", f"city:{Q}Lima{Q}",
                 f"days:1,city:{Q}Lima{Q}", f"city:{Q}Lima{Q},days:1,x:1", 'city:"Lima",days:1', "city:3,days:1",
                 f"city:{Q}a{Q}b{Q},days:1"):  # out of range, too long, missing, out of order, made up, not Gemma's
        assert not accepted(f"<|tool_call>call:get_weather{{{args}}}<tool_call|>"), args


def test_forced_call_grammar_follows_optional_members_enums_and_types(stories_tokenizer):
    plan = {"type": "function", "function": {"name": "plan", "parameters": {"type": "object", "properties": {
        "mode": {"enum": ["fast", "slow"]}, "steps": {"type": "array", "items": {"type": ["number", "null"]}},
        "tag": {"anyOf": [{"type": "string"}, {"type": "boolean"}]}, "extra": {"type": "object"}},
        "required": ["steps"]}}}
    grammar = forced_grammar(FORMATS["gemma4"], [plan])
    for args in ("steps:[]", f"mode:{Q}slow{Q},steps:[1,null,-2.5]", "steps:[3],tag:true",
                 f"extra:{{a:{{b:[{Q}x{Q}]}}}},mode:{Q}fast{Q},steps:[],tag:{Q}t{Q}"):  # sorted, as the template
        text = f"<|tool_call>call:plan{{{args}}}<tool_call|>"
        assert accepts(stories_tokenizer, grammar, text), args
        assert parse(FORMATS["gemma4"], text)[1][0].name == "plan"
    for args in ("", f"mode:{Q}medium{Q},steps:[]", f"steps:[{Q}1{Q}]", "steps:[],tag:3", "steps:[],mode:true",
                 ",steps:[]", "steps:[],"):
        assert not accepts(stories_tokenizer, grammar, f"<|tool_call>call:plan{{{args}}}<tool_call|>"), args


# ---- end to end: a random model made to write Gemma 4's format by a grammar ------------------------------
GRAMMAR = ('start: "<|channel>thought\\n" /[a-z]{2,8}/ " " /[a-z]{2,8}/ "<channel|>" /[a-z]{2,8}/ '
           '"<|tool_call>call:get_weather{city:<|\\"|>" /[a-z]{2,8}/ "<|\\"|>,days:" /[1-7]/ "}<tool_call|>"\n')
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def expected_parts(text: str) -> tuple[str, str, dict]:
    """(thinking, content, call arguments) a raw output of GRAMMAR holds, read without the parsers."""
    head, _, call = text.partition("<|tool_call>call:get_weather{city:" + Q)
    thinking, _, content = head.removeprefix("<|channel>thought\n").partition("<channel|>")
    city, _, days = call.removesuffix("}<tool_call|>").partition(Q + ",days:")
    return thinking, content, {"city": city, "days": int(days)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("llguidance")
    import pyggml
    from pyggml.chat import ChatTemplate
    from pyggml.synthetic import write_synthetic

    path = write_synthetic(tmp_path_factory.mktemp("gemma4chat") / "tiny.gguf", "tiny", "f32")
    with pyggml.load(path, n_ctx=512) as llm:
        llm._template = ChatTemplate(TEMPLATE)
        yield llm


def test_llm_chat_completion_reads_reasoning_and_calls(tiny):
    from pyggml.chat import encode_prompt

    text = tiny._render_chat(MESSAGES, tools=[WEATHER])
    raw = "".join(tiny.generate(encode_prompt(tiny.tokenizer, text), stream=True, max_tokens=200, temperature=0,
                                grammar=GRAMMAR))
    thinking, content, arguments = expected_parts(raw)
    assert thinking and content
    reply = tiny.create_chat_completion(MESSAGES, tools=[WEATHER], max_tokens=200, temperature=0, grammar=GRAMMAR)
    choice = reply["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["reasoning_content"] == thinking.strip() and message["content"] == content
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == arguments
    chunks = list(tiny.create_chat_completion(MESSAGES, tools=[WEATHER], max_tokens=200, temperature=0,
                                              grammar=GRAMMAR, stream=True))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == thinking.strip()
    assert "".join(d.get("content") or "" for d in deltas) == content
    streamed = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [json.loads(c["function"]["arguments"]) for c in streamed] == [arguments]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from ._server import with_template

    with with_template(tmp_path_factory, TEMPLATE, num_ctx=512) as (base, served, _):
        yield base, served


@pytest.mark.parametrize("stream", [False, True])
def test_server_thinking_and_tool_calls(server, stream):
    import httpx

    base, served = server
    ids = served.prompt_ids(served.render(MESSAGES, tools=[WEATHER]), True)
    raw = httpx.post(f"{base}/v1/completions", json={"model": served.name, "prompt": ids, "max_tokens": 200,
                                                      "temperature": 0, "grammar": GRAMMAR}, timeout=60).json()
    thinking, content, arguments = expected_parts(raw["choices"][0]["text"])
    body = {"model": served.name, "messages": MESSAGES, "tools": [WEATHER], "stream": stream, "grammar": GRAMMAR,
            "options": {"temperature": 0, "num_predict": 200}}
    response = httpx.post(f"{base}/api/chat", json=body, timeout=60)
    parts = [json.loads(line) for line in response.text.splitlines()] if stream else [response.json()]
    assert "".join(p["message"].get("thinking", "") for p in parts) == thinking.strip()
    assert "".join(p["message"]["content"] for p in parts) == content
    calls = [c for p in parts for c in p["message"].get("tool_calls", [])]
    assert calls == [{"function": {"name": "get_weather", "arguments": arguments}}]
    show = httpx.post(f"{base}/api/show", json={"model": served.name}, timeout=60).json()
    assert "thinking" in show["capabilities"]
    openai = {"model": served.name, "messages": MESSAGES, "tools": [WEATHER], "max_tokens": 200, "temperature": 0,
              "grammar": GRAMMAR}
    message = httpx.post(f"{base}/v1/chat/completions", json=openai, timeout=60).json()["choices"][0]["message"]
    assert message["reasoning_content"] == thinking.strip() and message["content"] == content
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [arguments]


def test_cli_run_shows_the_thought_apart(tmp_path):
    """``pyggml run MODEL PROMPT`` (the REPL's one-shot path): the thought shown apart, no channel markers."""
    import os
    import subprocess
    import sys

    pytest.importorskip("llguidance")
    from pyggml.tiny import write_tiny_model

    path = write_tiny_model(tmp_path / "gemma4ish.gguf", TEMPLATE)
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "<|channel>thought\\n" /[a-z]{2,6}/ " " /[a-z]{2,6}/ "<channel|>" /[a-z]{2,6}/\n')
    env = {**os.environ, "PYGGML_CACHE_DIR": str(tmp_path)}
    for think, shows in (("--think", True), ("--think=false", False)):
        run = subprocess.run([sys.executable, "-m", "pyggml.cli", "run", str(path), "think first", think,
                              "--grammar", str(grammar), "--max-tokens", "80", "--temperature", "0", "--threads", "1"],
                             capture_output=True, text=True, env=env, timeout=120)
        assert run.returncode == 0, run.stderr
        assert ("Thinking...\n" in run.stdout and "\n...done thinking.\n\n" in run.stdout) == shows, run.stdout
        assert "channel" not in run.stdout and run.stdout.split()[-1].isalpha(), run.stdout
