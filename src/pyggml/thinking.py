"""Reasoning ("thinking") output: models such as Qwen3, DeepSeek-R1 and SmolLM3 write their reasoning
between ``<think>`` and ``</think>`` before the answer. ``ThinkingSplitter`` separates the two as the
output streams, so a server can return the reasoning on its own (Ollama's ``thinking``, OpenAI's
``reasoning_content``). Whether a model thinks this way is read from its chat template, which names the
tags (Qwen3's also takes ``enable_thinking``). gpt-oss's harmony channels are not read here.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def template_thinks(template_source: str | None) -> bool:
    """Whether a chat template speaks of ``<think>`` blocks."""
    return CLOSE in (template_source or "")


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt ends inside a ``<think>`` block (DeepSeek-R1's template opens it for the
    model): the output then begins with thinking."""
    tail = prompt.rstrip()
    return tail.endswith(OPEN)


class ThinkingSplitter:
    """Splits output fed in pieces into (thinking, answer). A ``<think>`` block counts only at the start
    of the output (after whitespace), or from the start when the prompt opened it (``inside``). Whitespace
    around the thinking, and between ``</think>`` and the answer, is dropped; a piece that may be the
    start of a tag is held until the next one decides."""

    def __init__(self, inside: bool = False):
        self._state = "opened" if inside else "start"
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        thinking, answer = "", ""
        self._held += text
        while self._held:
            held = self._held
            if self._state == "start":
                stripped = held.lstrip()
                if not stripped or (OPEN.startswith(stripped) and stripped != OPEN):
                    break  # a block may still begin
                if stripped.startswith(OPEN):
                    self._state, self._held = "opened", stripped[len(OPEN):]
                else:
                    self._state = "answer"
            elif self._state in ("opened", "after"):  # whitespace before the thinking or the answer is dropped
                stripped = held.lstrip()
                if not stripped:
                    self._held = ""
                    break
                self._state, self._held = ("thinking" if self._state == "opened" else "answer"), stripped
            elif self._state == "thinking":
                end = held.find(CLOSE)
                if end >= 0:
                    thinking += held[:end].rstrip()
                    self._state, self._held = "after", held[end + len(CLOSE):]
                    continue
                keep = _tag_prefix(held, CLOSE)
                body = held[:len(held) - keep]
                cut = len(body.rstrip())  # trailing whitespace waits: it may precede the close
                thinking += body[:cut]
                self._held = held[cut:]
                break
            else:  # answer
                answer += held
                self._held = ""
        return thinking, answer

    def flush(self) -> tuple[str, str]:
        """What is held at the end: a started block's thinking, or text that only looked like a tag."""
        held, self._held = self._held, ""
        if self._state == "thinking":
            return held.rstrip(), ""
        if self._state == "start":
            return "", held
        return "", held if self._state == "answer" else ""


def _tag_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that begins ``tag``."""
    return max((n for n in range(1, len(tag)) if text.endswith(tag[:n])), default=0)
