"""Reasoning ("thinking") output: models such as Qwen3, DeepSeek-R1 and SmolLM3 write their reasoning
between ``<think>`` and ``</think>`` before the answer; gpt-oss writes it in the ``analysis`` channel of
OpenAI's harmony format and the answer in the ``final`` channel. ``ThinkingSplitter`` and
``HarmonySplitter`` separate the two as the output streams (``splitter_for`` picks one from the chat
template), so a server can return the reasoning on its own (Ollama's ``thinking``, OpenAI's
``reasoning_content``) and the REPL can show it apart. Gemma 4 writes its reasoning in a channel,
``<|channel>thought`` ... ``<channel|>``: ``ChannelSplitter``, a ``ThinkingSplitter`` with those tags.
Ollama's ``think`` becomes the template's variables (``template_variables``): ``enable_thinking`` for
Qwen3-style and Gemma 4 templates, ``reasoning_effort``
("low", "medium", "high": the harmony system message's ``Reasoning:`` line) for gpt-oss.
"""

from __future__ import annotations

from typing import Any, Protocol

OPEN, CLOSE = "<think>", "</think>"
CHANNEL, MESSAGE, START, END = "<|channel|>", "<|message|>", "<|start|>", "<|end|>"
# Gemma 4's channels (not harmony's: no "|" before ">"); its reasoning is the channel named "thought"
GEMMA_CHANNEL, GEMMA_CLOSE = "<|channel>", "<channel|>"
GEMMA_OPEN = GEMMA_CHANNEL + "thought"
LEVELS = ("low", "medium", "high")

Think = bool | str | None  # Ollama's think: true, false, a level (gpt-oss), or absent


def template_harmony(template_source: str | None) -> bool:
    """Whether a chat template writes OpenAI's harmony format (gpt-oss): messages in named channels."""
    return CHANNEL in (template_source or "")


def template_gemma_channels(template_source: str | None) -> bool:
    """Whether a chat template writes Gemma 4's channels (``<|channel>thought`` ... ``<channel|>``)."""
    return GEMMA_CHANNEL in (template_source or "")


def template_thinks(template_source: str | None) -> bool:
    """Whether a chat template speaks of ``<think>`` blocks, harmony channels or Gemma 4's channels."""
    src = template_source or ""
    return CLOSE in src or template_harmony(src) or template_gemma_channels(src)


def check_think(value: Any, where: str = "think") -> Think:
    """Ollama's ``think``: true, false, "low", "medium" or "high" (``ValueError`` for anything else)."""
    if value is None or isinstance(value, bool) or value in LEVELS:
        return value
    raise ValueError(f"{where} must be true, false, 'low', 'medium' or 'high', got {value!r:.40}")


def template_variables(template_source: str | None, think: Think) -> dict[str, Any]:
    """The chat template variables ``think`` sets (none when absent). gpt-oss cannot stop thinking: false
    asks for the least ("low") and the thinking is then dropped by the caller. ``ValueError`` for a level
    given to a model without levels, or any thinking asked of a model that does not think."""
    if think is None:
        return {}
    if template_harmony(template_source):
        return {"reasoning_effort": think if isinstance(think, str) else "medium" if think else "low"}
    if think and not template_thinks(template_source):
        raise ValueError("the model does not think (its chat template has no <think> block or harmony channels)")
    if isinstance(think, str):
        raise ValueError(f"think {think!r}: levels are for gpt-oss (harmony); this model takes true or false")
    return {"enable_thinking": think}


class Splitter(Protocol):
    def feed(self, text: str) -> tuple[str, str]: ...

    def flush(self) -> tuple[str, str]: ...


def splitter_for(template_source: str | None, prompt: str) -> Splitter | None:
    """The splitter of a model's output after ``prompt`` (None for a model that does not think)."""
    if template_harmony(template_source):
        return HarmonySplitter()
    if template_gemma_channels(template_source):
        return ChannelSplitter(prompt_opens_thinking(prompt, GEMMA_OPEN))
    if CLOSE in (template_source or ""):
        return ThinkingSplitter(prompt_opens_thinking(prompt))
    return None


def prompt_opens_thinking(prompt: str, open_tag: str = OPEN) -> bool:
    """Whether a rendered prompt ends inside a thinking block (DeepSeek-R1's template opens it for the
    model): the output then begins with thinking."""
    tail = prompt.rstrip()
    return tail.endswith(open_tag)


class ThinkingSplitter:
    """Splits output fed in pieces into (thinking, answer). A block (``<think>`` ... ``</think>``, or
    the ``tags`` given) counts only at the start of the output (after whitespace), or from the start when
    the prompt opened it (``inside``). Whitespace around the thinking, and between the close and the
    answer, is dropped; a piece that may be the start of a tag is held until the next one decides."""

    def __init__(self, inside: bool = False, tags: tuple[str, str] = (OPEN, CLOSE)):
        self._state = "opened" if inside else "start"
        self._held = ""
        self._open, self._close = tags

    def feed(self, text: str) -> tuple[str, str]:
        thinking, answer = "", ""
        self._held += text
        while self._held:
            held = self._held
            if self._state == "start":
                stripped = held.lstrip()
                if not stripped or (self._open.startswith(stripped) and stripped != self._open):
                    break  # a block may still begin
                if stripped.startswith(self._open):
                    self._state, self._held = "opened", stripped[len(self._open):]
                else:
                    self._state = "answer"
            elif self._state in ("opened", "after"):  # whitespace before the thinking or the answer is dropped
                stripped = held.lstrip()
                if not stripped:
                    self._held = ""
                    break
                self._state, self._held = ("thinking" if self._state == "opened" else "answer"), stripped
            elif self._state == "thinking":
                end = held.find(self._close)
                if end >= 0:
                    thinking += held[:end].rstrip()
                    self._state, self._held = "after", held[end + len(self._close):]
                    continue
                keep = _tag_prefix(held, self._close)
                body = held[:len(held) - keep]
                cut = len(body.rstrip())  # trailing whitespace waits: it may precede the close
                thinking += body[:cut]
                self._held = held[cut:]
                break
            else:  # answer
                answer += self._answer(held)
                if self._held == held:
                    break  # waits for the next piece
        return thinking, answer

    def _answer(self, held: str) -> str:
        """The answer in ``held`` (what is left of it stays in ``_held``)."""
        self._held = ""
        return held

    def flush(self) -> tuple[str, str]:
        """What is held at the end: a started block's thinking, or text that only looked like a tag."""
        held, self._held = self._held, ""
        if self._state == "thinking":
            return held.rstrip(), ""
        if self._state == "start":
            return "", held
        return "", held if self._state == "answer" else ""


class ChannelSplitter(ThinkingSplitter):
    """Gemma 4's output: reasoning in ``<|channel>thought`` ... ``<channel|>`` blocks, read as llama.cpp
    reads them: a block anywhere is thinking (Gemma 4 may write an empty one after the answer), and the
    answer ends at a ``<channel|>`` that closes no block or a ``<|channel>`` that opens no thought
    (what follows is dropped)."""

    def __init__(self, inside: bool = False):
        super().__init__(inside, (GEMMA_OPEN, GEMMA_CLOSE))

    def _answer(self, held: str) -> str:
        if self._state == "ended":
            self._held = ""
            return ""
        marks = [i for i in (held.find(GEMMA_CHANNEL), held.find(GEMMA_CLOSE)) if i >= 0]
        if not marks:
            keep = max(_tag_prefix(held, GEMMA_CHANNEL), _tag_prefix(held, GEMMA_CLOSE))
            self._held = held[len(held) - keep:]
            return held[:len(held) - keep]
        at = min(marks)
        rest = held[at:]
        if rest.startswith(GEMMA_OPEN):
            self._state, self._held = "opened", rest[len(GEMMA_OPEN):]
        elif GEMMA_OPEN.startswith(rest):
            self._held = rest  # may still open a thought
        else:
            self._state, self._held = "ended", ""
        return held[:at]

    def flush(self) -> tuple[str, str]:
        if self._state in ("start", "answer") and self._held.lstrip().startswith(GEMMA_CHANNEL):
            self._held = ""  # a channel cut off opens no thought
        return super().flush()


def _tag_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that begins ``tag``."""
    return max((n for n in range(1, len(tag)) if text.endswith(tag[:n])), default=0)


class HarmonySplitter:
    """Splits harmony output fed in pieces into (thinking, answer): a message is an optional
    ``<|start|>ROLE``, a header ``<|channel|>NAME ...`` ended by ``<|message|>``, then its text up to
    the next header (``<|end|>``, a control token, is usually left out of the text). The ``analysis``
    channel is thinking; ``final`` and ``commentary`` are the answer. Output without any header is
    all answer; a header cut off at the end is dropped."""

    _MARKS = (START, CHANNEL, END)

    def __init__(self) -> None:
        self._state, self._channel, self._held = "start", "", ""

    def feed(self, text: str) -> tuple[str, str]:
        out = {"thinking": "", "answer": ""}
        self._held += text
        while self._held:
            held = self._held
            if self._state == "start":  # a header, or plain text
                if any(m.startswith(held) or held.startswith(m) for m in (START, CHANNEL)):
                    if not held.startswith((START, CHANNEL)):
                        break  # may still become a header
                    self._state = "header"
                else:
                    self._state = "plain"
            elif self._state == "header":
                end = held.find(MESSAGE)
                if end < 0:
                    break
                header, self._held = held[:end], held[end + len(MESSAGE):]
                channel = header.rpartition(CHANNEL)[2].split(" ")[0].split("<|")[0].strip()
                self._channel, self._state = channel, "body"
            elif self._state == "body":
                found = [(i, m) for m in self._MARKS if (i := held.find(m)) >= 0]
                if found:
                    i, mark = min(found)
                    out[self._role()] += held[:i]
                    self._held = held[i + len(END):] if mark == END else held[i:]
                    self._state = "header" if mark != END else "start"
                    continue
                keep = max(_tag_prefix(held, m) for m in self._MARKS)
                out[self._role()] += held[:len(held) - keep]
                self._held = held[len(held) - keep:]
                break
            else:  # plain
                out["answer"] += held
                self._held = ""
        return out["thinking"], out["answer"]

    def _role(self) -> str:
        return "thinking" if self._channel == "analysis" else "answer"

    def flush(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._state == "body":
            return (held, "") if self._role() == "thinking" else ("", held)
        return "", held if self._state in ("start", "plain") else ""
