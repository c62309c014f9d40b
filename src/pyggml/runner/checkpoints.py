"""Recurrent-state checkpoints: how a model whose cache cannot drop a tail (``kvcache.Recurrent``: a
state holds one position only) still reuses prompt prefixes.

After a step computes, ``Checkpoints`` asks the cache to keep each sequence's state where its prompt
ended and every ``every`` positions (``Cache.checkpoint``; the cache bounds how many it keeps per
slot). A later prompt that shares a prefix with the slot's inputs then resumes from the longest
checkpoint at or before the common prefix (``InputCache.load_cache_slot`` asks ``Cache.resumable``)
and recomputes the rest. Speculative decoding snapshots the same way before verifying drafts
(speculative.py): rejected drafts roll back to that checkpoint and the accepted ones are recomputed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pyggml.runner.plugins import StepPlugin

if TYPE_CHECKING:
    from pyggml.runner.runner import Runner
    from pyggml.runner.scheduler import Step

CHECKPOINT_EVERY = 256  # positions between two checkpoints of a long prompt or generation


class Checkpoints(StepPlugin):
    """Checkpoint each sequence of a computed step where its prompt ended (a chunk of several inputs
    ending in a logits row to sample) and where it crossed a multiple of ``every`` positions. Drafted
    steps are left to speculation (their tail may be rolled back)."""

    def __init__(self, runner: Runner, every: int = CHECKPOINT_EVERY):
        if every < 1:
            raise ValueError(f"Checkpoints: every must be >= 1, got {every}")
        self.runner, self.every = runner, every

    def after_logits(self, step: Step, logits: np.ndarray | None) -> None:
        starts, ends = {}, {}
        for slot, pos in zip(step.sequences, step.positions, strict=True):
            starts.setdefault(slot, pos)
            ends[slot] = pos + 1
        sampled = {seq.slot.id for _, seq in step.rows}
        drafted = {seq.slot.id for _, seq in step.spec}
        cache = self.runner.model.cache
        for slot, end in ends.items():
            prompt_end = slot in sampled and end - starts[slot] > 1
            if slot not in drafted and (prompt_end or end // self.every > starts[slot] // self.every):
                cache.checkpoint(slot, end)
