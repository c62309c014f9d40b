"""Chat prompts end to end: what ``LLM.chat``, ``/api/chat`` and ``/v1/chat/completions`` feed the
model is the multi-turn conversation rendered by the model's template exactly as Hugging Face renders
it (transformers' ``render_jinja_template``, else jinja2 with the same settings), tokenized.

Observed through effects only: the prompt token count each route reports, and the greedy reply, which
must equal a plain completion of the reference prompt's token ids (stories260K is a trained model:
its greedy text depends on the prompt it was given).
"""

from __future__ import annotations

import pytest

import pyggml
from pyggml.chat import ChatTemplate

from ._models import with_chat_template
from ._server import post, running_server, text_of
from .conftest import CI, SHARED_MODELS

STORIES = SHARED_MODELS / "stories260K.gguf"
# newlines after block tags: trim_blocks / lstrip_blocks (Hugging Face's settings) change the text
TEMPLATE = """{{ bos_token }}
{%- for m in messages %}
  {% if m['role'] == 'system' %}
{{ m['content'] }}

  {% else %}
{{ m['role'] | capitalize }}: {{ m['content'] }}
  {% endif %}
{% endfor %}
{% if add_generation_prompt %}Assistant:{% endif %}"""
MESSAGES = [
    {"role": "system", "content": "Stories for children."},
    {"role": "user", "content": "Tell me about Lily."},
    {"role": "assistant", "content": "Lily was a little girl who loved her dog."},
    {"role": "user", "content": "What did the dog do?"},
]
N = 24


def reference_render(messages, bos: str, eos: str) -> str:
    """The template rendered as Hugging Face does (both ways when transformers is there)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    direct = env.from_string(TEMPLATE).render(messages=messages, add_generation_prompt=True, bos_token=bos,
                                              eos_token=eos)
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:
        if CI:
            raise
        return direct
    rendered, _ = render_jinja_template(conversations=[messages], chat_template=TEMPLATE,
                                        add_generation_prompt=True, bos_token=bos, eos_token=eos)
    assert rendered[0] == direct
    return direct


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    if not STORIES.exists():
        pytest.skip(f"{STORIES} is absent")
    return with_chat_template(STORIES, tmp_path_factory.mktemp("chat") / "stories-chat.gguf", TEMPLATE)


@pytest.fixture(scope="module")
def llm(path):
    with pyggml.load(path, n_threads=1, num_ctx=256) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference_ids(llm):
    text = reference_render(MESSAGES, "<s>", "</s>")
    assert text == ("<s>Stories for children.\n\nUser: Tell me about Lily.\nAssistant: Lily was a little girl who "
                    "loved her dog.\nUser: What did the dog do?\nAssistant:")
    ids = llm.tokenize(text)
    assert ids[:2] == [1, 1]  # the tokenizer's BOS and the template's
    return ids[1:]


def test_chat_template_renders_like_hugging_face(llm):
    assert ChatTemplate(TEMPLATE, bos_token="<s>", eos_token="</s>").render(MESSAGES) == \
        reference_render(MESSAGES, "<s>", "</s>")


def test_llm_chat_replies_to_the_rendered_conversation(llm, reference_ids):
    reply = llm.chat(MESSAGES, max_tokens=N, temperature=0)
    assert reply == llm.generate(reference_ids, max_tokens=N, temperature=0)
    streamed = "".join(llm.chat(MESSAGES, max_tokens=N, temperature=0, stream=True))
    assert streamed == reply


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/api/chat"])
def test_chat_routes_reply_to_the_rendered_conversation(path, reference_ids, route):
    pytest.importorskip("starlette", reason="the server tests need: pip install '.[server]'")
    pytest.importorskip("uvicorn", reason="the server tests need: pip install '.[server]'")
    with running_server(path, parallel=1, num_ctx=256) as server:
        plain = post(server, "/v1/completions", {"prompt": reference_ids, "max_tokens": N, "temperature": 0})
        if route == "/api/chat":
            answer = post(server, route, {"messages": MESSAGES, "options": {"temperature": 0, "num_predict": N}})
            assert answer["prompt_eval_count"] == len(reference_ids)
        else:
            answer = post(server, route, {"messages": MESSAGES, "max_tokens": N, "temperature": 0})
            assert answer["usage"]["prompt_tokens"] == len(reference_ids)
    assert text_of(route, answer) == text_of("/v1/completions", plain)
