"""Chat templates: rendering real GGUF templates, the sandbox, the fallback, message checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pyggml.chat import FALLBACK_TEMPLATE, ChatTemplate, ChatTemplateError, encode_prompt, validate_messages

from .hf_fixtures import CHAT_TEMPLATE

# Meta's Llama 3 instruct template, as stored in the GGUF files of those models
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Mistral-style: roles must alternate, enforced with raise_exception
ALTERNATING_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


def test_llama3_template_renders_with_bos_and_generation_prompt():
    template = ChatTemplate(LLAMA3_TEMPLATE, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    assert template.render(CHAT) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert not template.render(CHAT, add_generation_prompt=False).endswith("assistant<|end_header_id|>\n\n")


def test_fixture_template_renders():
    assert ChatTemplate(CHAT_TEMPLATE).render(CHAT) == "<|system|>Be brief.\n<|user|>Hi!\n<|assistant|>"


def test_raise_exception_in_a_template_is_a_chat_template_error():
    template = ChatTemplate(ALTERNATING_TEMPLATE, bos_token="<s>", eos_token="</s>")
    assert template.render([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]) == \
        "<s>[INST] a [/INST]b</s>"
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_strftime_now_tojson_and_loop_controls_are_available():
    template = ChatTemplate("{{ strftime_now('%Y') | length }}|{{ messages[0] | tojson }}|"
                            "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}"
                            "{% endfor %}")
    assert template.render([{"role": "user", "content": "café"}, {"role": "user", "content": "x"}]) == \
        '4|{"role": "user", "content": "café"}|user'


def test_the_sandbox_blocks_dunder_attributes():
    escape = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError, match="SecurityError|UndefinedError"):
        escape.render(CHAT)
    # reading an unsafe attribute gives an empty undefined value, never the object
    assert ChatTemplate("{{ raise_exception.__globals__ }}{{ ''.__class__ }}").render(CHAT) == ""


def test_the_sandbox_blocks_mutating_the_messages():
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        ChatTemplate("{% set _ = messages.append({'role': 'user'}) %}").render(CHAT)


def test_a_template_that_does_not_compile_is_reported():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_fallback_template_is_a_plain_transcript():
    template = ChatTemplate(None)
    assert template.is_fallback and template.source == FALLBACK_TEMPLATE
    text = template.render(CHAT + [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}])
    assert text == "Be brief.\n\nUser: Hi!\n\nAssistant: Hello.\n\nUser: Bye\n\nAssistant:"


def test_from_model_reads_the_gguf_key_and_token_texts():
    tokenizer = SimpleNamespace(bos=0, eos=1, vocab=SimpleNamespace(tokens=["<s>", "</s>"]))
    model = SimpleNamespace(config={"tokenizer.chat_template": ALTERNATING_TEMPLATE,
                                    "tokenizer.chat_template.tool_use": "tools:{{ tools | length }}"},
                            tokenizer=tokenizer)
    template = ChatTemplate.from_model(model)
    assert template.render([{"role": "user", "content": "a"}]) == "<s>[INST] a [/INST]"
    tools = ChatTemplate.from_model(model, "tool_use")
    assert tools.render(CHAT, tools=[{"type": "function"}]) == "tools:1"
    with pytest.raises(ChatTemplateError, match="no chat template named 'rag'"):
        ChatTemplate.from_model(model, "rag")
    assert ChatTemplate.from_model(SimpleNamespace(config={}, tokenizer=None)).is_fallback


@pytest.mark.parametrize("messages, match", [
    ("hello", "must be a list of messages"),
    ([], "must not be empty"),
    (["hi"], r"messages\[0\] must be a mapping"),
    ([{"role": "bot", "content": "x"}], r"messages\[0\]: role must be one of"),
    ([{"content": "x"}], "role must be one of"),
    ([{"role": "user"}], "content is missing"),
    ([{"role": "user", "content": 5}], "content must be a string or a list of text parts"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "only .* parts are supported"),
    ([{"role": "assistant", "content": None, "tool_calls": "f()"}], "tool_calls must be a list"),
])
def test_bad_messages_are_clear_errors(messages, match):
    with pytest.raises(ValueError, match=match):
        validate_messages(messages)
    with pytest.raises(ValueError, match=match):
        ChatTemplate(CHAT_TEMPLATE).render(messages)


def test_text_parts_are_joined_and_tool_call_messages_accepted():
    messages = validate_messages([
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]},
    ])
    assert messages[0]["content"] == "a\nb" and messages[1]["tool_calls"][0]["function"]["name"] == "f"


def test_encode_prompt_does_not_double_bos():
    class Tok:
        bos = 1

        def encode(self, text, add_special=True):
            ids = [1] if add_special else []
            return ids + ([1] if text.startswith("<s>") else []) + [7]

    assert encode_prompt(Tok(), "<s>hi") == [1, 7]
    assert encode_prompt(Tok(), "hi") == [1, 7]
