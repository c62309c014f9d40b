"""Which inputs each KV-cache sequence ("slot") holds, so requests can reuse cached prompts.

Mirrors Ollama's runner cache. A slot is one sequence id of the model's cache, holding at most
``num_ctx`` inputs. A new request takes a slot and skips the prompt prefix that slot already
holds: with one user, the free slot with the longest common prefix; with many users, a slot
whose whole content is a prefix of the prompt, otherwise the least recently used free slot, into
which the longest matching prefix of any slot is forked (``cache.copy_prefix``: the cells are
shared, nothing is copied or recomputed). When a slot fills up, the older half of its history
after ``num_keep`` inputs is dropped and the rest moves down (``shift_cache_slot``).

The runner serialises every call into an ``InputCache`` with its forward passes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pyggml.kvcache import NotSupportedError
from pyggml.models import Input

if TYPE_CHECKING:
    from pyggml.kvcache import Cache

__all__ = ["InputCache", "InputCacheSlot", "NoFreeSlotError", "ReprocessInputsError", "count_common_prefix"]

log = logging.getLogger(__name__)


class NoFreeSlotError(RuntimeError):
    """Every cache slot is in use by a running sequence."""


class ReprocessInputsError(RuntimeError):
    """The cache could not drop part of a slot, so the slot was cleared: run ``inputs`` again."""

    def __init__(self, inputs: list[Input]):
        super().__init__(f"the KV cache cannot shift; {len(inputs)} inputs must be processed again")
        self.inputs = inputs


@dataclass(eq=False)
class InputCacheSlot:
    """One sequence of the KV cache: the inputs stored in it, in position order."""

    id: int
    inputs: list[Input] = field(default_factory=list)
    in_use: bool = False  # a running sequence owns it
    last_used: float = 0.0  # time.monotonic() when a sequence last took it


def count_common_prefix(a: Sequence[Input], b: Sequence[Input]) -> int:
    """Number of leading inputs ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class InputCache:
    """``num_slots`` slots of ``kv_size // num_slots`` inputs each over the model's ``cache``
    (``None``: bookkeeping only)."""

    def __init__(self, kv_size: int, num_slots: int, multi_user_cache: bool = False, cache: Cache | None = None,
                 batch_size: int = 1):
        if num_slots < 1:
            raise ValueError(f"InputCache: num_slots must be >= 1, got {num_slots}")
        self.num_ctx = kv_size // num_slots
        if self.num_ctx < max(batch_size, 1):
            raise ValueError(f"InputCache: a KV cache of {kv_size} entries gives each of {num_slots} slots "
                             f"{self.num_ctx}, less than one batch of {max(batch_size, 1)}; raise the context "
                             "size or lower the batch size or the number of parallel sequences")
        self.slots = [InputCacheSlot(i) for i in range(num_slots)]
        self.multi_user_cache = multi_user_cache
        self.cache = cache

    # ---- taking a slot for a new prompt ---------------------------------------------------------
    def load_cache_slot(self, prompt: Sequence[Input], cache_prompt: bool = True) -> tuple[InputCacheSlot, list[Input]]:
        """Take a free slot for ``prompt``; returns it and the inputs still to process.

        At least one input is always left to process (its logits start the generation). Raises
        NoFreeSlotError when every slot is in use.
        """
        if not prompt:
            raise ValueError("load_cache_slot: empty prompt")
        if self.multi_user_cache:
            slot, num_past = self._find_best_slot(prompt)
        else:
            slot, num_past = self._find_longest_slot(prompt)
        if not cache_prompt:
            num_past = 0
        slot.in_use = True
        slot.last_used = time.monotonic()
        num_past = min(num_past, len(prompt) - 1)  # leave one input to get logits from
        if self.cache is not None:
            if num_past > 0 and not self.cache.can_resume(slot.id, num_past):
                num_past = self.cache.resumable(slot.id, num_past)  # a recurrent state's checkpoint, or 0
            try:
                self.cache.remove(slot.id, num_past)
            except NotSupportedError:  # some caches cannot drop a tail: start the slot over
                self.cache.remove(slot.id, 0)
                num_past = 0
        log.debug("slot %d: %d cached inputs, prompt %d, reusing %d", slot.id, len(slot.inputs), len(prompt),
                  num_past)
        slot.inputs = list(prompt[:num_past])
        return slot, list(prompt[num_past:])

    def _find_longest_slot(self, prompt: Sequence[Input]) -> tuple[InputCacheSlot, int]:
        """The free slot sharing the longest prefix with ``prompt`` (one user: reuses the same memory)."""
        best, longest = None, -1
        for slot in self.slots:
            if slot.in_use:
                continue
            n = count_common_prefix(slot.inputs, prompt)
            if n > longest:
                best, longest = slot, n
        if best is None:
            raise NoFreeSlotError(f"all {len(self.slots)} cache slots are in use")
        return best, longest

    def _find_best_slot(self, prompt: Sequence[Input]) -> tuple[InputCacheSlot, int]:
        """A free slot whose whole content prefixes ``prompt``, else the least recently used free
        slot, given the longest prefix any slot shares with ``prompt`` (many users: more hits)."""
        longest_slot, longest = None, -1
        oldest = None
        for slot in self.slots:
            n = count_common_prefix(slot.inputs, prompt)
            # on a tie prefer a free slot that holds nothing else (taking it evicts nothing)
            if n > longest or (n == longest and _whole(slot, n) and not _whole(longest_slot, n)):
                longest_slot, longest = slot, n
            if not slot.in_use and (oldest is None or slot.last_used < oldest.last_used):
                oldest = slot
        if _whole(longest_slot, longest):
            return longest_slot, longest
        if oldest is None:
            raise NoFreeSlotError(f"all {len(self.slots)} cache slots are in use")
        if oldest.inputs:
            log.debug("evicting slot %d (%d inputs)", oldest.id, len(oldest.inputs))
        if longest > 0 and longest_slot is not oldest:
            log.debug("forking slot %d into %d: %d inputs", longest_slot.id, oldest.id, longest)
            oldest.inputs = list(longest_slot.inputs[:longest])
            if self.cache is not None:
                # one input is left to compute (load_cache_slot): a recurrent state forks where it resumes
                self.cache.copy_prefix(longest_slot.id, oldest.id, min(longest, len(prompt) - 1))
        return oldest, longest

    # ---- context shift ------------------------------------------------------------------------
    def shift_discard(self, inputs: Sequence[Input], num_keep: int) -> int:
        """How many inputs after the first ``num_keep`` to drop so that about half of what follows
        them is free; inputs that must share a batch (``same_batch``) go together."""
        target_free = max((self.num_ctx - num_keep) // 2, 1)
        free = self.num_ctx - len(inputs)
        discard = same_batch = 0
        for inp in inputs[num_keep:]:
            if same_batch <= 0 and free >= target_free:
                break
            same_batch -= 1
            free += 1
            discard += 1
            if inp.same_batch:
                same_batch = inp.same_batch
        return discard

    def shift_cache_slot(self, slot: InputCacheSlot, num_keep: int) -> None:
        """Free space in a full slot: drop the older half of its history after ``num_keep`` inputs,
        moving the newer half down. Raises ReprocessInputsError (slot cleared) when the cache
        cannot drop a range, and ValueError when ``num_keep`` leaves nothing to drop."""
        if num_keep >= self.num_ctx:
            raise ValueError(f"cannot shift the context: keeping {num_keep} inputs leaves nothing to drop in a "
                             f"context of {self.num_ctx}")
        discard = self.shift_discard(slot.inputs, num_keep)
        if discard <= 0:
            return
        log.debug("slot %d full (%d of %d): keeping %d, dropping %d", slot.id, len(slot.inputs), self.num_ctx,
                  num_keep, discard)
        if self.cache is not None:
            try:
                if any(inp.rope_step != 1 for inp in slot.inputs[num_keep:num_keep + discard]):
                    # an mRoPE image: the positions after it were moved by its shape, not by its length
                    raise NotSupportedError("an input that moves rope positions cannot be shifted out")
                self.cache.remove(slot.id, num_keep, num_keep + discard)
            except NotSupportedError:
                rest = slot.inputs[:num_keep] + slot.inputs[num_keep + discard:]
                self.cache.remove(slot.id, 0)
                slot.inputs = []
                raise ReprocessInputsError(rest) from None
        del slot.inputs[num_keep:num_keep + discard]


def _whole(slot: InputCacheSlot, common: int) -> bool:
    """A free slot whose whole content is the ``common`` prefix."""
    return not slot.in_use and common == len(slot.inputs)
