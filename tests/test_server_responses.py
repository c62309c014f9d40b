"""OpenAI's Responses API (``/v1/responses``, stateless) through ``openai``'s ``client.responses.create``
against a server in this process on a random-weight model: the same greedy text as the chat route for
the same conversation (instructions, input items, function calls and their outputs), the stream's events
in order, forced function calls, ``text.format`` JSON schema, usage, and errors."""

from __future__ import annotations

import json

import pytest

from .test_tools import WEATHER, check_weather

_NEEDS = "the Responses route tests need: pip install starlette uvicorn httpx openai"
pytest.importorskip("starlette", reason=_NEEDS)
pytest.importorskip("uvicorn", reason=_NEEDS)
httpx = pytest.importorskip("httpx", reason=_NEEDS)
openai = pytest.importorskip("openai", reason=_NEEDS)

GREEDY = {"temperature": 0}
TOOL = {"type": "function", **WEATHER["function"]}  # Responses' function tools are flat
INSTRUCTIONS = "You answer briefly."
ITEMS = [
    {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
    {"role": "user", "content": "And tomorrow?"},
]
CHAT = [
    {"role": "system", "content": INSTRUCTIONS},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Oslo", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    {"role": "user", "content": "And tomorrow?"},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from pyggml.synthetic import write_synthetic

    from ._server import running_server

    path = write_synthetic(tmp_path_factory.mktemp("responses") / "tiny.gguf", "tiny", "f32")
    with running_server(path, parallel=2, num_ctx=512) as running:
        yield running


def client(server) -> tuple[openai.OpenAI, str]:
    base, served = server
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60), served.name


@pytest.mark.parametrize("string_input", [True, False])
def test_text_and_usage_equal_the_chat_route(server, string_input):
    oai, name = client(server)
    if string_input:
        kwargs, chat_messages = dict(input="Weather in Oslo?"), CHAT[:2]
    else:
        kwargs, chat_messages = dict(input=ITEMS, tools=[TOOL]), CHAT
    response = oai.responses.create(model=name, instructions=INSTRUCTIONS, max_output_tokens=12, **kwargs, **GREEDY)
    chat = oai.chat.completions.create(model=name, messages=chat_messages, max_tokens=12, **GREEDY,
                                       **({} if string_input else {"tools": [WEATHER]}))
    assert chat.choices[0].finish_reason == "length"
    assert response.output_text == chat.choices[0].message.content and response.output_text
    assert response.object == "response" and response.id.startswith("resp_") and response.store is False
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == 12 and response.usage.total_tokens == chat.usage.total_tokens


def test_stream_events_come_in_order(server):
    oai, name = client(server)
    kwargs = dict(model=name, input=ITEMS, instructions=INSTRUCTIONS, max_output_tokens=10, **GREEDY)
    whole = oai.responses.create(**kwargs)
    events = list(oai.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done",
            "response.incomplete"]
    assert kinds[:4] == head and kinds[-4:] == tail and set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    deltas = "".join(e.delta for e in events[4:-4])
    assert deltas == events[-4].text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == 10
    assert events[2].item.id == events[4].item_id == final.output[0].id


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_forced_function_call(server, stream, choice):
    pytest.importorskip("llguidance")
    oai, name = client(server)
    tools = [TOOL, {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}] \
        if isinstance(choice, dict) else [TOOL]
    kwargs = dict(model=name, input="Weather in Paris?", tools=tools, tool_choice=choice, max_output_tokens=200,
                  temperature=1.0)
    if stream:
        events = list(oai.responses.create(**kwargs, stream=True))
        kinds = [e.type for e in events]
        assert kinds[-5:] == ["response.output_item.added", "response.function_call_arguments.delta",
                              "response.function_call_arguments.done", "response.output_item.done",
                              "response.completed"]
        assert events[-3].arguments == events[-4].delta
        response = events[-1].response
    else:
        response = oai.responses.create(**kwargs)
    assert response.status == "completed"
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    check_weather(calls[0].name, json.loads(calls[0].arguments))


def test_text_format_json_schema(server):
    pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")
    oai, name = client(server)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    for stream in (False, True):
        kwargs = dict(model=name, input="A digit?", max_output_tokens=60, temperature=1.0,
                      text={"format": {"type": "json_schema", "name": "digit", "schema": schema, "strict": True}})
        if stream:
            response = list(oai.responses.create(**kwargs, stream=True))[-1].response
        else:
            response = oai.responses.create(**kwargs)
        assert response.status == "completed"
        jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.parametrize("body, words", [
    ({"previous_response_id": "resp_1"}, "stores no responses"),
    ({"input": []}, "input must be"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "'item_reference' items are not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/cat.png"}]}]},
     "not fetched"),
    ({"input": [{"role": "user", "content": [{"type": "input_image",
                                              "image_url": "data:image/png;base64,bm90IGFuIGltYWdl"}]}]},
     "takes no images"),
    ({"tools": [{"type": "web_search"}]}, 'only "function" tools'),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [TOOL]}, "not among the tools"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type must be"),
    ({"reasoning": {"effort": "high"}}, "does not reason"),
    ({"max_output_tokens": -1}, "max_output_tokens must be >= 0"),
    ({"temperature": 3}, "temperature must be in"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "needs call_id, name and arguments"),
])
def test_errors_are_400(server, body, words):
    base, served = server
    response = httpx.post(f"{base}/v1/responses", json={"model": served.name, "input": "hi", **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]


def test_the_client_raises_on_errors(server):
    oai, name = client(server)
    with pytest.raises(openai.BadRequestError, match="stores no responses"):
        oai.responses.create(model=name, input="hi", previous_response_id="resp_1")
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="nope", input="hi")
