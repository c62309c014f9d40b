"""Thinking output (issue 29 item 4): ``ThinkingSplitter`` separates a ``<think>`` block from the
answer however the output is cut into pieces; templates that think are recognised; and the server returns
the reasoning on its own: Ollama's ``thinking`` (``think``) and OpenAI's ``reasoning_content``, with a
grammar making a random-weight model write a block."""

from __future__ import annotations

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


def split(pieces: list[str], inside: bool) -> tuple[str, str]:
    s, thinking, answer = ThinkingSplitter(inside), "", ""
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
