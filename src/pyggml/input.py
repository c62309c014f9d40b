"""Value types every layer above the cache uses: what the runner feeds a model (mirrors Ollama's model/input)."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

ROPE_AXES = 3  # the axes of multi-axis rotary positions a batch carries (mRoPE: temporal, height, width)

@dataclass(frozen=True)
class Multimodal:
    """A model-specific piece of multimodal data (e.g. an image embedding tensor)."""

    tensor: Any = None
    data: Any = None


@dataclass(eq=False)
class Input:
    """One element of the input stream: a token, or a multimodal item standing in its place.

    Equal when ``token`` and ``multimodal_hash`` are equal (so prompt caches compare inputs).
    ``same_batch`` asks that this many following inputs go in the same batch (an image's tokens).

    Multi-axis rotary positions (Qwen-VL's mRoPE: temporal, height, width): a sequence's rope position
    starts at 0 and moves on by each input's ``rope_step`` (1 for text); an input's position on each
    axis is that rope position plus its ``rope_offset`` on the axis (() : zero on every axis). An
    image of h x w tokens gives its tokens offsets (0, row, column), steps of 0 and max(h, w) for the
    last, so the text after it goes on from the image's largest position + 1 (see ``rope_positions``).
    """

    token: int = 0
    multimodal: list[Multimodal] | None = None
    multimodal_hash: int = 0
    same_batch: int = 0
    rope_offset: tuple[int, ...] = ()
    rope_step: int = 1

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Input) and self.token == other.token and \
            self.multimodal_hash == other.multimodal_hash

    def __hash__(self) -> int:
        return hash((self.token, self.multimodal_hash))


class SharedText(Input):
    """A plain text token's input, one object per id shared by every sequence (``text_input``):
    changing it would change every slot's history, so it refuses."""

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Input.{name}: a shared text input (text_input) cannot change; make an Input")


_TEXT_INPUTS: list[Input | None] = []  # by id: a list, one memory read per lookup (see Tokenizer._texts)
_MAX_SHARED_ID = 1 << 20  # ids past any vocabulary get their own input (the table stays bounded)


def text_input(token: int) -> Input:
    """The input of text token ``token`` (as ``Input(token=token)``): one shared, unchangeable object
    per id, so a decode step allocates none (each allocation is an object the garbage collector
    traces while it lives, and slot histories keep theirs)."""
    try:
        inp = _TEXT_INPUTS[token] if token >= 0 else None
    except (IndexError, TypeError):  # not made yet, or not an int (refused below)
        inp = None
    if inp is None:
        token = operator.index(token)  # an int (a numpy integer becomes one; a float is refused)
        if not 0 <= token < _MAX_SHARED_ID:
            return Input(token=token)
        if token >= len(_TEXT_INPUTS):  # grow by doubling: few copies while the ids of a vocabulary come
            size = min(max(token + 1, 2 * len(_TEXT_INPUTS)), _MAX_SHARED_ID)
            _TEXT_INPUTS.extend([None] * (size - len(_TEXT_INPUTS)))
        inp = object.__new__(SharedText)
        object.__setattr__(inp, "token", token)  # the other fields read the class defaults
        _TEXT_INPUTS[token] = inp
    return inp


@dataclass(frozen=True)
class MultimodalIndex:
    """Where in a batch a multimodal input sits."""

    index: int
    multimodal: list[Multimodal]


@dataclass
class Batch:
    """One forward pass: ``inputs`` (token ids or Inputs), their ``positions`` and ``sequences``,
    the batch indices whose logits are wanted (``outputs``), and multimodal items by index.
    ``rope_positions``: per input its position on each rotary axis (mRoPE: t, h, w), where some input
    of the batch's sequences moved them off ``positions`` (an image); empty: every axis is ``positions``."""

    inputs: Sequence[int] = ()
    outputs: Sequence[int] = ()
    positions: Sequence[int] = ()
    sequences: Sequence[int] = ()
    multimodal: Sequence[MultimodalIndex] = field(default_factory=tuple)
    rope_positions: Sequence[Sequence[int]] = ()

    @property
    def tokens(self) -> list[int]:
        return [x.token if isinstance(x, Input) else int(x) for x in self.inputs]

    @property
    def output_rows(self) -> list[int]:
        """Rows whose logits the model computes: ``outputs``, or the last row when none are wanted
        (a prompt chunk still needs a valid graph; its logits are ignored)."""
        return list(self.outputs) if len(self.outputs) else [len(self.inputs) - 1]


def rope_start(inputs: Sequence[Input], n: int) -> int:
    """The rope position of a sequence's input at position ``n`` (after ``inputs[:n]``)."""
    return sum(inp.rope_step for inp in inputs[:n])


def rope_positions(start: int, inp: Input, axes: int) -> tuple[int, ...]:
    """``inp``'s position on each of ``axes`` rotary axes when its rope position is ``start``."""
    offset = inp.rope_offset
    return tuple(start + (offset[a] if a < len(offset) else 0) for a in range(axes))
