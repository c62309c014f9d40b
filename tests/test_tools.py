"""Tool calling: the format table (detected from chat templates), each family's parser fed
hand-written outputs (whole and streamed in pieces), forced-call grammars, tool messages through a
template, and the official ``openai``/``ollama`` clients against the server with a call forced on a
random-weight model, streaming and not."""

from __future__ import annotations

import json

import pytest

from pyggml.chat import ChatTemplate
from pyggml.tools import FORMATS, ToolCallParser, check_tools, detect_format, forced_grammar, parse

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

# (format, output, content, calls) written from each format's documentation
OUTPUTS = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>', "",
     [("get_weather", {"city": "Paris", "days": 2})]),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me check.",
     [("get_weather", {"city": "Oslo", "days": 1}), ("get_time", {})]),
    ("hermes", "Just words, no call.", "Just words, no call.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}]', "",
     [("get_weather", {"city": "Rome", "days": 3})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 3}[TOOL_CALLS]get_time[ARGS]{}', "",
     [("get_weather", {"city": "Rome", "days": 3}), ("get_time", {})]),
    ("mistral", '[{"name": "get_time", "arguments": {}}]', "", [("get_time", {})]),  # [TOOL_CALLS] skipped
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Lima", "days": 5}}', "",
     [("get_weather", {"city": "Lima", "days": 5})]),
    ("llama3", '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": '
               '{"city": "Kyiv", "days": 1}}', "", [("get_time", {}), ("get_weather", {"city": "Kyiv", "days": 1})]),
    ("llama3", "The answer is 4.", "The answer is 4.", []),
    ("gemma", 'Sure.\n```tool_code\nget_weather(city="Bern", days=4)\n```', "Sure.",
     [("get_weather", {"city": "Bern", "days": 4})]),
    ("gemma", "```tool_code\nprint(open('x'))\n```", "```tool_code\nprint(open('x'))\n```", []),
    ("gemma4", 'Sure.<|tool_call>call:get_weather{city:<|"|>Bern<|"|>,days:4}<tool_call|>', "Sure.",
     [("get_weather", {"city": "Bern", "days": 4})]),
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>Bern}<tool_call|>',
     '<|tool_call>call:get_weather{city:<|"|>Bern}<tool_call|>', []),
    ("harmony", '<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Cairo", "days": 2}<|call|>', "",
     [("get_weather", {"city": "Cairo", "days": 2})]),
    ("harmony", "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Hi!",
     "Hi!", []),
    ("json", '{"name": "get_weather", "arguments": {"city": "Quito", "days": 6}}', "",
     [("get_weather", {"city": "Quito", "days": 6})]),
    ("json", '[{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": "{}"}]', "",
     [("get_time", {}), ("get_time", {})]),
    ("json", '{"name": "broken", "arguments": {', '{"name": "broken", "arguments": {', []),
]


@pytest.mark.parametrize("fmt,output,content,calls", OUTPUTS)
def test_parsers(fmt, output, content, calls):
    got_content, got = parse(FORMATS[fmt], output)
    assert [(c.name, c.arguments) for c in got] == calls
    assert got_content == content
    # streamed in small pieces: the content passed on plus the rest equals the whole
    for size in (1, 3, 7):
        parser = ToolCallParser(FORMATS[fmt])
        said = "".join(parser.feed(output[i:i + size]) for i in range(0, len(output), size))
        rest, streamed = parser.finish()
        assert [(c.name, c.arguments) for c in streamed] == calls
        assert (said + rest).strip() == content.strip()


@pytest.mark.parametrize("source,name", [
    ("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}{% if tools %}<tool_call>{% endif %}", "hermes"),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", "mistral"),
    ("<|start|>{{ m }}<|channel|>final<|message|>", "harmony"),
    ("<|start_header_id|>ipython<|end_header_id|>{% if tools %}{{ tools }}{% endif %}<|python_tag|>", "llama3"),
    ("<start_of_turn>user\n{{ content }}<end_of_turn>", "gemma"),
    ("<|turn>model\n{% for c in m.tool_calls %}<|tool_call>call:{{ c.function.name }}{}<tool_call|>{% endfor %}",
     "gemma4"),
    (None, "json"),
])
def test_format_detected_from_the_template(source, name):
    assert detect_format(source).name == name


def test_tool_messages_go_back_into_the_template():
    source = ("{% for m in messages %}{% if m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>"
              "{% elif m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>"
              "{% endfor %}{% else %}{{ m.role }}: {{ m.content }}{% endif %}{% endfor %}"
              "{% if tools %}TOOLS{{ tools | tojson }}{% endif %}")
    from pyggml.tools import normalize_messages
    messages = normalize_messages([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    text = ChatTemplate(source).render(messages, tools=[WEATHER])
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    assert "<tool_response>sunny</tool_response>" in text and '"get_weather"' in text.split("TOOLS")[1]


def test_check_tools():
    assert check_tools(None) == [] and check_tools([WEATHER]) == [WEATHER]
    for bad in ("x", [{"type": "function"}], [{"type": "function", "function": {"name": "f", "parameters": 3}}]):
        with pytest.raises(ValueError):
            check_tools(bad)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_forced_grammars_compile(fmt):
    pytest.importorskip("llguidance")
    from pyggml.constrain import check
    from pyggml.tokenizer import from_metadata

    from .conftest import SHARED_MODELS
    path = SHARED_MODELS / "stories260K.gguf"
    if not path.exists():
        pytest.skip("no stories260K")
    import gguf
    reader = gguf.GGUFReader(path)
    meta = {f.name: f.contents() for f in reader.fields.values()}
    tokenizer = from_metadata(meta)
    for name in (None, "get_time"):
        check(forced_grammar(FORMATS[fmt], [WEATHER, TIME], name), tokenizer)
    with pytest.raises(ValueError, match="not among"):
        forced_grammar(FORMATS[fmt], [WEATHER], "nope")


def accepts(tokenizer, grammar, text: str) -> bool:
    """Whether the constraint of ``grammar`` takes ``text`` (as tokens) whole and is then complete."""
    from pyggml.constrain import Constraint

    constraint = Constraint(grammar, tokenizer)
    tokens = tokenizer.encode(text, add_special=False)
    if tokenizer.decode(tokens[:1]) == "":
        tokens = tokens[1:]  # SentencePiece's space prefix
    if constraint.validate(tokens) != len(tokens):
        return False
    for token in tokens:
        constraint.consume(token)
    return constraint.accepting


def test_forced_llama3_call_takes_parameters(stories_tokenizer):
    """Llama 3's tool calls name their arguments "parameters" (its template and parser say so): the
    forced grammar accepts that call, and not one with "arguments"."""
    def accepted(text: str) -> bool:
        return accepts(stories_tokenizer, forced_grammar(FORMATS["llama3"], [WEATHER]), text)

    assert accepted('{"name":"get_weather","parameters":{"city":"Lima","days":5}}')
    assert not accepted('{"name":"get_weather","arguments":{"city":"Lima","days":5}}')


# ---- through the server, with the official clients --------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("llguidance")
    pytest.importorskip("uvicorn")
    from pyggml.synthetic import write_synthetic

    from .test_server import running_server
    path = write_synthetic(tmp_path_factory.mktemp("tools") / "tiny.gguf", "tiny", "f32")
    with running_server(path, parallel=2, queue=4, num_ctx=512) as running:
        yield running


def check_weather(name: str, arguments: dict) -> None:
    assert name == "get_weather"
    assert set(arguments) == {"city", "days"} and len(arguments["city"]) <= 12 and 1 <= arguments["days"] <= 7


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_openai_client_forced_call_on_a_random_model(server, stream, choice):
    openai = pytest.importorskip("openai")
    base, served = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
    tools = [WEATHER] if choice == "required" else [WEATHER, TIME]
    kwargs = dict(model=served.name, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
                  tool_choice=choice, max_tokens=200, temperature=1.0, seed=7)
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        calls = [c for chunk in chunks for c in (chunk.choices[0].delta.tool_calls or [])] if chunks else []
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert len(calls) == 1 and calls[0].index == 0 and calls[0].id and calls[0].type == "function"
        fn = calls[0].function
    else:
        reply = client.chat.completions.create(**kwargs)
        assert reply.choices[0].finish_reason == "tool_calls"
        calls = reply.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].id.startswith("call_")
        fn = calls[0].function
    check_weather(fn.name, json.loads(fn.arguments))


def test_openai_tool_messages_and_bad_tool_choice(server):
    httpx = pytest.importorskip("httpx")
    base, served = server
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Oslo", "days": 1}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    body = {"model": served.name, "messages": messages, "tools": [WEATHER], "max_tokens": 4}
    assert httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).status_code == 200
    for choice, words in (({"type": "function", "function": {"name": "nope"}}, "not among"), ("always", "must be")):
        response = httpx.post(f"{base}/v1/chat/completions", json={**body, "tool_choice": choice}, timeout=60)
        assert response.status_code == 400 and words in response.json()["error"]["message"]


DEEP = "[" * 100_000


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/api/chat"])
@pytest.mark.parametrize("call, words", [
    ({"function": 5}, "messages[1].tool_calls[0] must be"),
    (7, "messages[1].tool_calls[0] must be"),
    ({"function": {"name": "f", "arguments": DEEP}}, "arguments is not JSON"),
    ({"function": {"name": "f", "arguments": "[1, 2]"}}, "must be an object"),
    ({"function": {"name": "f", "arguments": {"a": json.loads("[" * 200 + "]" * 200)}}}, "more than 64 levels"),
])
def test_malformed_tool_calls_in_a_request_are_400(server, route, call, words):
    """Issue 25 item 9: earlier calls a request sends back are checked like any other field."""
    httpx = pytest.importorskip("httpx")
    base, served = server
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    body = {"model": served.name, "messages": messages, "stream": False}
    response = httpx.post(f"{base}{route}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in (error["message"] if route.startswith("/v1/") else error)


def test_deeply_nested_tool_parameters_are_400(server):
    httpx = pytest.importorskip("httpx")
    base, served = server
    deep = json.loads('{"type": "array", "items": ' * 300 + "{}" + "}" * 300)
    tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    body = {"model": served.name, "messages": [{"role": "user", "content": "x"}], "tools": [tool], "stream": False}
    for route in ("/v1/chat/completions", "/api/chat"):
        response = httpx.post(f"{base}{route}", json=body, timeout=60)
        assert response.status_code == 400 and "levels deep" in response.text, response.text


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_client_tool_calls(server, stream):
    """Ollama's API has no tool_choice: a format schema of the call makes the random model write one,
    and the reply carries it as message.tool_calls."""
    ollama = pytest.importorskip("ollama")
    base, served = server
    client = ollama.Client(host=base, timeout=60)
    schema = {"type": "object", "properties": {"name": {"const": "get_weather"},
                                               "arguments": WEATHER["function"]["parameters"]},
              "required": ["name", "arguments"]}
    kwargs = dict(model=served.name, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
                  format=schema, options={"temperature": 1.0, "seed": 3, "num_predict": 200})
    if stream:
        parts = list(client.chat(**kwargs, stream=True))
        calls = [c for p in parts for c in (p.message.tool_calls or [])]
    else:
        calls = client.chat(**kwargs).message.tool_calls
    assert len(calls) == 1
    check_weather(calls[0].function.name, dict(calls[0].function.arguments))


def whitespace_first_walk(grammar, tokenizer, limit: int, seed: int = 0) -> tuple[str, bool]:
    """(text, finished) of a walk through ``grammar`` that takes a whitespace-only token whenever
    one is allowed (a weak model's habit), otherwise a random allowed one; at most ``limit`` tokens."""
    import numpy as np

    from pyggml.constrain import Constraint

    rng, c, ids = np.random.default_rng(seed), Constraint(grammar, tokenizer), []
    c.compute_mask()
    eog = set(tokenizer.vocab.eog)
    while len(ids) < limit and not c.stopped:
        allowed = [int(t) for t in np.flatnonzero(c.allowed()) if t not in eog]
        if not allowed:
            break  # only the end may follow
        blank = [t for t in allowed if not tokenizer.token_to_piece(t).strip()]
        ids.append(blank[0] if blank else int(rng.choice(allowed)))
        c.consume(ids[-1])
        c.compute_mask()
    return b"".join(tokenizer.token_to_piece(t) for t in ids).decode("utf-8", "replace"), c.accepting


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_forced_calls_leave_no_room_for_whitespace(fmt, stories_tokenizer):
    """Issue 25 item 10: a forced call is compact JSON with no made-up keys, so even a model that
    writes whitespace wherever it may finishes the call within a bounded number of tokens."""
    for name, tools in ((None, [WEATHER]), ("get_weather", [WEATHER, TIME])):
        for seed in range(3):
            text, finished = whitespace_first_walk(forced_grammar(FORMATS[fmt], tools, name), stories_tokenizer,
                                                   300, seed)
            assert finished, (fmt, text[:200])
            if fmt != "harmony":  # harmony's markers are special tokens: its parser reads them written out
                content, calls = parse(FORMATS[fmt], text)
                assert len(calls) == 1, (fmt, text)
                check_weather(calls[0].name, calls[0].arguments)
