"""Value types every layer above the cache uses: what the runner feeds a model (mirrors Ollama's model/input)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


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
    """

    token: int = 0
    multimodal: list[Multimodal] | None = None
    multimodal_hash: int = 0
    same_batch: int = 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Input) and self.token == other.token and \
            self.multimodal_hash == other.multimodal_hash

    def __hash__(self) -> int:
        return hash((self.token, self.multimodal_hash))


@dataclass(frozen=True)
class MultimodalIndex:
    """Where in a batch a multimodal input sits."""

    index: int
    multimodal: list[Multimodal]


@dataclass
class Batch:
    """One forward pass: ``inputs`` (token ids or Inputs), their ``positions`` and ``sequences``,
    the batch indices whose logits are wanted (``outputs``), and multimodal items by index."""

    inputs: Sequence[int] = ()
    outputs: Sequence[int] = ()
    positions: Sequence[int] = ()
    sequences: Sequence[int] = ()
    multimodal: Sequence[MultimodalIndex] = field(default_factory=tuple)

    @property
    def tokens(self) -> list[int]:
        return [x.token if isinstance(x, Input) else int(x) for x in self.inputs]

    @property
    def output_rows(self) -> list[int]:
        """Rows whose logits the model computes: ``outputs``, or the last row when none are wanted
        (a prompt chunk still needs a valid graph; its logits are ignored)."""
        return list(self.outputs) if len(self.outputs) else [len(self.inputs) - 1]
