"""Thinking output (issue 29 item 4): ``ThinkingSplitter`` separates a ``<think>`` block from the
answer however the output is cut into pieces; templates that think are recognised; and the server returns
the reasoning on its own: Ollama's ``thinking`` (``think``) and OpenAI's ``reasoning_content``, with a
grammar making a random-weight model write a block."""

from __future__ import annotations

import json

import pytest

from pyggml.thinking import ThinkingSplitter, prompt_opens_thinking, template_thinks

# (output, whether the prompt opened the block, thinking, answer)
CASES = [
    ("<think>\nLet me see: 2 + 2.\n</think>\n\nIt is 4.", False, "Let me see: 2 + 2.", "It is 4."),
    ("  <think>a</think>b", False, "a", "b"),
    ("No thinking here.", False, "", "No thinking here."),
    ("<thinking is a word", False, "", "<thinking is a word"),
    ("<thi", False, "", "<thi"),  # only looked like a tag
    ("Answer, then <think>late</think>", False, "", "Answer, then <think>late</think>"),  # only at the start
    ("\nweighing it\n</think>\n\nYes.", True, "weighing it", "Yes."),  # DeepSeek-R1: the prompt opened it
    ("<think>\n\n</think>\n\nEmpty thought.", False, "", "Empty thought."),
    ("<think>cut off mid-thou", False, "cut off mid-thou", ""),
    ("<think>a < b </thin and </think>c", False, "a < b </thin and", "c"),
]


def split(pieces: list[str], inside: bool, splitter: type = ThinkingSplitter) -> tuple[str, str]:
    s, thinking, answer = splitter(inside), "", ""
    for piece in pieces:
        t, a = s.feed(piece)
        thinking, answer = thinking + t, answer + a
    t, a = s.flush()
    return thinking + t, answer + a


@pytest.mark.parametrize("output, inside, thinking, answer", CASES)
def test_split_whole_and_in_every_two_and_one_char_pieces(output, inside, thinking, answer):
    assert split([output], inside) == (thinking, answer)
    for i in range(len(output) + 1):
        assert split([output[:i], output[i:]], inside) == (thinking, answer), i
    assert split(list(output), inside) == (thinking, answer)


def test_templates_and_prompts():
    assert template_thinks("{% if enable_thinking %}<think>\n\n</think>{% endif %}")
    assert not template_thinks("{{ messages }}") and not template_thinks(None)
    assert prompt_opens_thinking("<|Assistant|><think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")


# ---- through the server: a template that thinks, and a grammar that makes a random model write a block
THINKING_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and "
                     "not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
GRAMMAR = 'start: "<think>" /[a-z]{2,8}/ " " /[a-z]{2,8}/ "</think>" /[a-z]{2,8}/\n'
MESSAGES = [{"role": "user", "content": "Think first."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from ._server import with_template

    with with_template(tmp_path_factory, THINKING_TEMPLATE) as served:
        yield served


def expected(server) -> tuple[str, str, dict]:
    """(thinking, answer) the greedy constrained output holds, read from a plain completion of the same
    prompt (no splitting there), and the request fields that make it."""
    import httpx

    base, served, _ = server
    ids = served.prompt_ids(served.render(MESSAGES), True)
    raw = httpx.post(f"{base}/v1/completions", json={"model": served.name, "prompt": ids, "max_tokens": 40,
                                                      "temperature": 0, "grammar": GRAMMAR}, timeout=60).json()
    text = raw["choices"][0]["text"]
    assert text.startswith("<think>") and "</think>" in text, text
    thinking, answer = text.removeprefix("<think>").split("</think>")
    return thinking.strip(), answer.strip(), {"temperature": 0, "grammar": GRAMMAR}


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_think(server, stream):
    import httpx

    base, served, _ = server
    thinking, answer, fields = expected(server)
    body = {"model": served.name, "messages": MESSAGES, "stream": stream, "grammar": GRAMMAR,
            "options": {"temperature": 0, "num_predict": 40}}
    for think in (True, None):
        request = {**body, **({"think": think} if think is not None else {})}
        response = httpx.post(f"{base}/api/chat", json=request, timeout=60)
        parts = [json.loads(line) for line in response.text.splitlines()] if stream else [response.json()]
        assert "".join(p["message"].get("thinking", "") for p in parts) == thinking
        assert "".join(p["message"]["content"] for p in parts) == answer
    show = httpx.post(f"{base}/api/show", json={"model": served.name}, timeout=60).json()
    assert "thinking" in show["capabilities"]


def test_ollama_think_false_renders_the_empty_block_and_drops_thinking(server):
    import httpx

    base, served, _ = server
    body = {"model": served.name, "messages": MESSAGES, "stream": False, "grammar": GRAMMAR,
            "options": {"temperature": 0, "num_predict": 40}}
    on = httpx.post(f"{base}/api/chat", json={**body, "think": True}, timeout=60).json()
    off = httpx.post(f"{base}/api/chat", json={**body, "think": False}, timeout=60).json()
    assert off["prompt_eval_count"] > on["prompt_eval_count"]  # the template wrote <think></think> itself
    assert "thinking" not in off["message"] and on["message"]["thinking"]
    level = httpx.post(f"{base}/api/chat", json={**body, "think": "high"}, timeout=60)
    assert level.status_code == 400 and "levels are for gpt-oss" in level.json()["error"]


@pytest.mark.parametrize("stream", [False, True])
def test_openai_reasoning_content(server, stream):
    openai = pytest.importorskip("openai")
    base, served, _ = server
    thinking, answer, fields = expected(server)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
    kwargs = dict(model=served.name, messages=MESSAGES, max_tokens=40, temperature=0,
                  extra_body={"grammar": GRAMMAR})
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        got = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas), \
            "".join(d.content or "" for d in deltas)
    else:
        message = client.chat.completions.create(**kwargs).choices[0].message
        got = message.reasoning_content, message.content
    assert got == (thinking, answer)


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_thinking_blocks(server, stream):
    anthropic = pytest.importorskip("anthropic")
    base, served, _ = server
    thinking, answer, _ = expected(server)
    client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=60)
    kwargs = dict(model=served.name, max_tokens=40, messages=MESSAGES, thinking={"type": "adaptive"},
                  extra_body={"temperature": 0, "grammar": GRAMMAR})
    if stream:
        events = list(client.messages.create(**kwargs, stream=True))
        starts = [e.content_block.type for e in events if e.type == "content_block_start"]
        assert starts == ["thinking", "text"]
        with client.messages.stream(**kwargs) as s:
            message = s.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == thinking and message.content[1].text == answer


@pytest.mark.parametrize("stream", [False, True])
def test_responses_reasoning_items(server, stream):
    openai = pytest.importorskip("openai")
    base, served, _ = server
    thinking, answer, _ = expected(server)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
    kwargs = dict(model=served.name, input=MESSAGES[0]["content"], max_output_tokens=40, temperature=0,
                  extra_body={"grammar": GRAMMAR})
    if stream:
        events = list(client.responses.create(**kwargs, stream=True))
        kinds = [e.type for e in events]
        assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thinking
        response = events[-1].response
    else:
        response = client.responses.create(**kwargs)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == thinking and response.output_text == answer


def test_a_model_that_does_not_think_refuses_to(server):
    import httpx

    base, served, plain = server
    think = served.template
    served.template = plain
    try:
        body = {"model": served.name, "messages": MESSAGES, "stream": False, "think": True}
        response = httpx.post(f"{base}/api/chat", json=body, timeout=60)
        assert response.status_code == 400 and "does not think" in response.json()["error"]
        body = {"model": served.name, "messages": MESSAGES, "reasoning_effort": "high"}
        response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 400 and "does not reason" in response.text
    finally:
        served.template = think


# ---- gpt-oss's harmony channels -------------------------------------------------------------------------
from pyggml.thinking import HarmonySplitter, template_variables  # noqa: E402

HARMONY = [
    ("<|channel|>analysis<|message|>Weigh it.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.",
     "Weigh it.", "It is 4."),
    # the runner leaves <|end|> (a control token) out of the text
    ("<|channel|>analysis<|message|>Weigh it.<|start|>assistant<|channel|>final<|message|>It is 4.",
     "Weigh it.", "It is 4."),
    ("<|channel|>final<|message|>Only an answer.", "", "Only an answer."),
    ("Plain text, no header.", "", "Plain text, no header."),
    ("<|chan", "", "<|chan"),  # only looked like a header
    ("<|channel|>analysis<|message|>cut off mid-thou", "cut off mid-thou", ""),
    ("<|channel|>analysis<|message|>a <| b<|start|>assistant<|channel|>commentary<|message|>c", "a <| b", "c"),
    ("<|channel|>analysis<|message|>x<|start|>assistant<|channel|>fin", "x", ""),  # a header cut off is dropped
]


def harmony_split(pieces: list[str]) -> tuple[str, str]:
    s, thinking, answer = HarmonySplitter(), "", ""
    for piece in pieces:
        t, a = s.feed(piece)
        thinking, answer = thinking + t, answer + a
    t, a = s.flush()
    return thinking + t, answer + a


@pytest.mark.parametrize("output, thinking, answer", HARMONY)
def test_harmony_split_whole_and_in_every_two_and_one_char_pieces(output, thinking, answer):
    assert harmony_split([output]) == (thinking, answer)
    for i in range(len(output) + 1):
        assert harmony_split([output[:i], output[i:]]) == (thinking, answer), i
    assert harmony_split(list(output)) == (thinking, answer)


def test_think_levels_become_template_variables():
    harmony, qwen = "<|start|>{{ reasoning_effort }}<|channel|>", "<think></think>"
    assert template_variables(harmony, "high") == {"reasoning_effort": "high"}
    assert template_variables(harmony, True) == {"reasoning_effort": "medium"}
    assert template_variables(harmony, False) == {"reasoning_effort": "low"}
    assert template_variables(qwen, False) == {"enable_thinking": False} and template_variables(qwen, None) == {}
    with pytest.raises(ValueError, match="levels are for gpt-oss"):
        template_variables(qwen, "low")
    with pytest.raises(ValueError, match="does not think"):
        template_variables("{{ messages }}", True)


def test_harmony_vocabulary_shows_headers_and_keeps_going_after_end():
    """As llama.cpp: gpt-oss's message headers are written out and ``<|end|>`` (the end of the analysis
    message) does not end generation when ``<|return|>`` and ``<|call|>`` do."""
    from pyggml.tokenizer import from_metadata
    from pyggml.tokenizer.vocab import TokenType, Vocab

    special = ["<|return|>", "<|call|>", "<|end|>", "<|channel|>", "<|message|>", "<|start|>"]
    tokens = [chr(c) for c in range(97, 123)] + special
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["a b"],
            "tokenizer.ggml.token_type": [TokenType.NORMAL] * 26 + [TokenType.CONTROL] * len(special),
            "tokenizer.ggml.eos_token_id": tokens.index("<|return|>")}
    vocab = Vocab.from_metadata(meta)
    ids = {t: tokens.index(t) for t in special}
    assert vocab.eog == {ids["<|return|>"], ids["<|call|>"]}
    output = [ids["<|channel|>"], 0, ids["<|message|>"], 1, ids["<|end|>"], ids["<|start|>"]]
    stream = from_metadata(meta).decode(output, skip_special=True)
    assert stream == "<|channel|>a<|message|>b<|start|>"
    plain = Vocab.from_metadata({**meta, "tokenizer.ggml.tokens": [t if t != "<|call|>" else "q" for t in tokens]})
    assert ids["<|end|>"] in plain.eog  # without <|call|> the vocabulary is not harmony's: <|end|> ends


HARMONY_TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final"
                    "{% endif %}<|message|>{{ m.content }}<|end|>{% endfor %}"
                    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
                    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
HARMONY_GRAMMAR = ('start: "<|channel|>analysis<|message|>" /[a-z]{2,8}/ " " /[a-z]{2,8}/ '
                   '"<|start|>assistant<|channel|>final<|message|>" /[a-z]{2,8}/\n')


@pytest.mark.parametrize("stream", [False, True])
def test_harmony_channels_and_levels_through_the_ollama_routes(server, stream):
    import httpx

    from pyggml.chat import ChatTemplate
    from pyggml.server.chat import chat_prompt

    base, served, _ = server
    thinking_template = served.template
    served.template = ChatTemplate(HARMONY_TEMPLATE)
    try:
        assert "Reasoning: high" in chat_prompt(served, MESSAGES, think="high").text()
        assert "Reasoning: medium" in chat_prompt(served, MESSAGES).text()
        options = {"temperature": 0, "num_predict": 160}
        for think in ("high", True, None):
            body = {"model": served.name, "messages": MESSAGES, "stream": stream, "grammar": HARMONY_GRAMMAR,
                    "options": options, **({"think": think} if think is not None else {})}
            response = httpx.post(f"{base}/api/chat", json=body, timeout=60)
            parts = [json.loads(line) for line in response.text.splitlines()] if stream else [response.json()]
            thinking = "".join(p["message"].get("thinking", "") for p in parts)
            content = "".join(p["message"]["content"] for p in parts)
            assert len(thinking.split(" ")) == 2 and content.isalpha() and "<|" not in thinking + content, parts
            body = {"model": served.name, "prompt": MESSAGES[0]["content"], "stream": stream,
                    "grammar": HARMONY_GRAMMAR, "options": options, **({"think": think} if think is not None else {})}
            response = httpx.post(f"{base}/api/generate", json=body, timeout=60)
            parts = [json.loads(line) for line in response.text.splitlines()] if stream else [response.json()]
            assert "".join(p.get("thinking", "") for p in parts) == thinking
            assert "".join(p["response"] for p in parts) == content
        off = httpx.post(f"{base}/api/generate", json={**body, "stream": False, "think": False}, timeout=60).json()
        assert "thinking" not in off and off["response"].isalpha()
        bad = httpx.post(f"{base}/api/generate", json={**body, "think": "extreme"}, timeout=60)
        assert bad.status_code == 400 and "think must be" in bad.json()["error"]
    finally:
        served.template = thinking_template


@pytest.mark.parametrize("stream", [False, True])
def test_generate_splits_think_blocks(server, stream):
    import httpx

    base, served, _ = server
    thinking, answer, fields = expected(server)
    body = {"model": served.name, "prompt": MESSAGES[0]["content"], "stream": stream, "grammar": GRAMMAR,
            "think": True, "options": {"temperature": 0, "num_predict": 40}}
    response = httpx.post(f"{base}/api/generate", json=body, timeout=60)
    parts = [json.loads(line) for line in response.text.splitlines()] if stream else [response.json()]
    assert "".join(p.get("thinking", "") for p in parts) == thinking
    assert "".join(p["response"] for p in parts) == answer
    raw = httpx.post(f"{base}/api/generate", json={**body, "raw": True}, timeout=60)
    assert raw.status_code == 400 and "think needs the model's chat template" in raw.json()["error"]
