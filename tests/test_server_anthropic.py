"""Anthropic's Messages API (``/v1/messages``) through the official ``anthropic`` client, unmodified,
against a server in this process on a random-weight model: the same greedy text as OpenAI's chat route
for the same conversation (system, multi-turn, tool calls and results, a prefill), the stream's events in
Anthropic's order, the stop reasons that can be forced (max_tokens, stop_sequence, tool_use), usage,
structured output, count_tokens, and Anthropic-shaped errors."""

from __future__ import annotations

import json

import pytest

from .test_tools import WEATHER, check_weather

_NEEDS = "the Anthropic route tests need: pip install starlette uvicorn httpx openai anthropic"
pytest.importorskip("starlette", reason=_NEEDS)
pytest.importorskip("uvicorn", reason=_NEEDS)
httpx = pytest.importorskip("httpx", reason=_NEEDS)
anthropic = pytest.importorskip("anthropic", reason=_NEEDS)
openai = pytest.importorskip("openai", reason=_NEEDS)

GREEDY = {"temperature": 0}  # no longer among the client's own parameters: sent as extra_body
TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}
SYSTEM = "You answer briefly."
# one conversation in both APIs' shapes: a tool call and its result, then a question
ANTHROPIC_TURNS = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                      {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                       "input": {"city": "Oslo", "days": 1}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"},
                                 {"type": "text", "text": "And tomorrow?"}]},
]
OPENAI_TURNS = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "toolu_1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": '{"city": "Oslo", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21 C"},
    {"role": "user", "content": "And tomorrow?"},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from pyggml.synthetic import write_synthetic

    from ._server import running_server

    path = write_synthetic(tmp_path_factory.mktemp("anthropic") / "tiny.gguf", "tiny", "f32")
    with running_server(path, parallel=2, num_ctx=512) as running:
        yield running


def clients(server) -> tuple[anthropic.Anthropic, openai.OpenAI, str]:
    base, served = server
    return (anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=60),
            openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60), served.name)


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


@pytest.mark.parametrize("system", [SYSTEM, [{"type": "text", "text": SYSTEM}]])
def test_text_and_usage_equal_the_openai_route(server, system):
    claude, oai, name = clients(server)
    message = claude.messages.create(model=name, max_tokens=12, system=system, messages=ANTHROPIC_TURNS,
                                     extra_body=GREEDY)
    chat = oai.chat.completions.create(model=name, max_tokens=12, messages=OPENAI_TURNS, **GREEDY)
    assert chat.choices[0].finish_reason == "length"
    assert text_of(message) == chat.choices[0].message.content and text_of(message)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens == 12


def test_stream_events_come_in_anthropic_order(server):
    claude, _, name = clients(server)
    kwargs = dict(model=name, max_tokens=10, system=SYSTEM, messages=ANTHROPIC_TURNS, extra_body=GREEDY)
    whole = claude.messages.create(**kwargs)
    events = list(claude.messages.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.content == [] and events[0].message.stop_reason is None
    assert events[1].index == 0 and events[1].content_block.type == "text"
    assert "".join(e.delta.text for e in events[2:-3]) == text_of(whole)
    delta = events[-2]
    assert delta.delta.stop_reason == "max_tokens" and delta.usage.output_tokens == 10
    assert delta.usage.input_tokens + delta.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    with claude.messages.stream(**kwargs) as stream:  # the client's own accumulator
        final = stream.get_final_message()
    assert text_of(final) == text_of(whole) and final.stop_reason == "max_tokens"


def test_raw_stream_has_named_events_and_a_ping(server):
    base, served = server
    body = {"model": served.name, "max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    with httpx.stream("POST", f"{base}/v1/messages", json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in datas] and names[:2] == ["message_start", "ping"]


def test_stop_sequence_is_named(server):
    claude, oai, name = clients(server)
    messages = [{"role": "user", "content": "Count."}]
    free = claude.messages.create(model=name, max_tokens=12, messages=messages, extra_body=GREEDY)
    text = text_of(free)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert len(stop) == 3
    cut = claude.messages.create(model=name, max_tokens=12, messages=messages, stop_sequences=["@@never", stop],
                                 extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert text_of(cut) == text[:text.index(stop)]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_forced_tool_call(server, stream, choice):
    pytest.importorskip("llguidance")
    claude, _, name = clients(server)
    tools = [TOOL, {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}] \
        if choice["type"] == "tool" else [TOOL]
    kwargs = dict(model=name, max_tokens=200, messages=[{"role": "user", "content": "Weather in Paris?"}],
                  tools=tools, tool_choice=choice, extra_body={"temperature": 1.0})
    if stream:
        events = list(claude.messages.create(**kwargs, stream=True))
        starts = [e for e in events if e.type == "content_block_start"]
        assert [s.content_block.type for s in starts] == ["tool_use"] and starts[0].content_block.input == {}
        deltas = [e.delta for e in events if e.type == "content_block_delta"]
        assert [d.type for d in deltas] == ["input_json_delta"]
        arguments = json.loads(deltas[0].partial_json)
        assert events[-2].delta.stop_reason == "tool_use"
        with claude.messages.stream(**kwargs) as s:  # the client joins the input deltas itself
            final = s.get_final_message()
        assert final.content[-1].type == "tool_use" and final.stop_reason == "tool_use"
        call = final.content[-1]
    else:
        message = claude.messages.create(**kwargs)
        assert message.stop_reason == "tool_use" and [b.type for b in message.content] == ["tool_use"]
        call = message.content[0]
        arguments = call.input
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    check_weather(call.name, arguments)


def test_tool_results_reach_the_prompt(server):
    base, served = server
    with_result = {"model": served.name, "messages": ANTHROPIC_TURNS, "tools": [TOOL]}
    turns = [*ANTHROPIC_TURNS[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny, 21 C"}],
         "is_error": True}, {"type": "text", "text": "And tomorrow?"}]}]
    counts = [httpx.post(f"{base}/v1/messages/count_tokens", json=body, timeout=60).json()["input_tokens"]
              for body in (with_result, {**with_result, "messages": turns},
                           {**with_result, "messages": [ANTHROPIC_TURNS[0]]})]
    assert counts[1] > counts[0] > counts[2]  # "Error: " is said; the shorter conversation counts fewer


def test_count_tokens_equals_the_prompt_a_message_reads(server):
    claude, oai, name = clients(server)
    counted = claude.messages.count_tokens(model=name, system=SYSTEM, messages=ANTHROPIC_TURNS)
    chat = oai.chat.completions.create(model=name, max_tokens=1, messages=OPENAI_TURNS)
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_consecutive_turns_are_combined(server):
    """As Anthropic does (many templates insist that roles alternate): two user turns read as one."""
    claude, oai, name = clients(server)
    message = claude.messages.create(model=name, max_tokens=6, extra_body=GREEDY, messages=[
        {"role": "user", "content": "Hello."}, {"role": "user", "content": [{"type": "text", "text": "Again."}]}])
    chat = oai.chat.completions.create(model=name, max_tokens=6, messages=[
        {"role": "user", "content": "Hello.\nAgain."}], **GREEDY)
    assert text_of(message) == chat.choices[0].message.content


def test_count_tokens_refuses_images(server):
    claude, _, name = clients(server)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "bm90IGFuIGltYWdl"}}
    with pytest.raises(anthropic.BadRequestError, match="cannot count images"):
        claude.messages.count_tokens(model=name, messages=[{"role": "user", "content": [image]}])


def test_prefill_is_continued(server):
    """A last assistant message is the start of the answer: the text equals a raw completion of the
    rendered conversation followed by the prefill."""
    claude, oai, name = clients(server)
    _, served = server
    prefill = "The answer is"
    message = claude.messages.create(model=name, max_tokens=8, extra_body=GREEDY, messages=[
        {"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": prefill}])
    ids = served.prompt_ids(served.render([{"role": "user", "content": "What is 2 + 2?"}]) + prefill, True)
    raw = oai.completions.create(model=name, prompt=ids, max_tokens=8, **GREEDY)
    assert text_of(message) == raw.choices[0].text


def test_structured_output(server):
    pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")
    claude, _, name = clients(server)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    message = claude.messages.create(model=name, max_tokens=60, messages=[{"role": "user", "content": "A digit?"}],
                                     output_config={"format": {"type": "json_schema", "schema": schema}},
                                     extra_body={"temperature": 1.0})
    assert message.stop_reason == "end_turn"  # the grammar ended the output
    jsonschema.validate(json.loads(text_of(message)), schema)


@pytest.mark.parametrize("body, status, kind, words", [
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error", "max_tokens is required"),
    ({"model": "nope"}, 404, "not_found_error", "not found"),
    ({"max_tokens": -1}, 400, "invalid_request_error", "max_tokens must be >= 0"),
    ({"temperature": 1.5}, 400, "invalid_request_error", "temperature must be in [0.0, 1.0]"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, 400, "invalid_request_error", "does not think"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, 400,
     "invalid_request_error", "messages[0].content[0]"),
    ({"messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error", "messages[0].role"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error",
     "not supported"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [TOOL]}, 400, "invalid_request_error",
     "not among the tools"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "url", "url": "https://example.com/cat.png"}}]}]}, 400, "invalid_request_error", "not fetched"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "bm90IGFuIGltYWdl"}}]}]}, 400, "invalid_request_error",
     "takes no images"),
    ({"stop_sequences": [1]}, 400, "invalid_request_error", "stop_sequences must be"),
    ({"top_p": 0.5, "speling": 1}, 400, "invalid_request_error", "unknown field 'speling'"),
])
def test_errors_are_anthropic_shaped(server, body, status, kind, words):
    base, served = server
    body = {"model": served.name, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **body}
    if "max_tokens is required" in words:
        del body["max_tokens"]
    response = httpx.post(f"{base}/v1/messages", json=body, timeout=60)
    assert response.status_code == status, response.text
    answer = response.json()
    assert answer["type"] == "error" and answer["error"]["type"] == kind and words in answer["error"]["message"]


def test_the_client_raises_its_own_errors(server):
    claude, _, name = clients(server)
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="does not think"):
        claude.messages.create(model=name, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                               thinking={"type": "enabled", "budget_tokens": 2048})
    base, _ = server
    wrong = httpx.get(f"{base}/v1/messages", timeout=60)  # Starlette's own errors take the shape too
    assert wrong.status_code == 405 and wrong.json()["type"] == "error"
