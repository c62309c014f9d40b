"""Recurrent-state checkpoints: how a model whose cache cannot drop a tail (``kvcache.Recurrent``: a
state holds one position only) still reuses prompt prefixes.

After a step computes, ``Checkpoints`` asks the cache to keep each sequence's state where its prompt
ended, just before the prompt's last input and every ``every`` positions (``Cache.checkpoint``; the
cache bounds how many it keeps per slot). A later prompt that shares a prefix with the slot's inputs
then resumes from the longest checkpoint at or before the common prefix (``InputCache.load_cache_slot``
asks ``Cache.resumable``) and recomputes the rest. The one before the last input is what the same
prompt again needs (regenerating an answer): one input is always left to compute, for its logits; to
have a state there, the batches of a prompt with at least ``SPLIT_AFTER`` new inputs end there
(``Scheduler.stops``), which costs one more pass of one input (a shorter one is cheap to recompute
from an earlier checkpoint; a draft model's prompts are that short). Speculative decoding snapshots
the same way before verifying drafts (speculative.py): rejected drafts roll back to that checkpoint
and the accepted ones are recomputed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pyggml.runner.engine import TopLogits
from pyggml.runner.plugins import StepPlugin

if TYPE_CHECKING:
    from pyggml.runner.runner import Runner
    from pyggml.runner.scheduler import Step
    from pyggml.runner.sequence import RunningSequence

CHECKPOINT_EVERY = 256  # positions between two checkpoints of a long prompt or generation
SPLIT_AFTER = 32  # new prompt inputs from which a checkpoint is taken before the last one


class Checkpoints(StepPlugin):
    """Checkpoint each sequence of a computed step where its prompt ended (its first token is sampled
    from the step), before its prompt's last input, and where it crossed a multiple of ``every``
    positions. Drafted steps are left to speculation (their tail may be rolled back)."""

    def __init__(self, runner: Runner, every: int = CHECKPOINT_EVERY, split_after: int = SPLIT_AFTER):
        if every < 1 or split_after < 2:
            raise ValueError(f"Checkpoints: every must be >= 1 and split_after >= 2, got {every}, {split_after}")
        self.runner, self.every, self.split_after = runner, every, split_after
        self._before_last: dict[int, tuple[RunningSequence, int]] = {}  # slot id -> (prompt's sequence, position)

    def before_build(self) -> None:
        """End a new prompt's batches before its last input (``Scheduler.stops``): a state to resume
        the same prompt from. Not for a short one, nor for image inputs (they must share a batch)."""
        for seq in self.runner.active:
            slot, pending = seq.slot, seq.pending
            marked = self._before_last.get(slot.id)
            if seq.generated or len(pending) < self.split_after or (marked and marked[0] is seq) or \
                    any(inp.multimodal for inp in pending):
                continue
            pos = len(slot.inputs) + len(pending) - 1
            self._before_last[slot.id] = (seq, pos)
            self.runner.scheduler.stops[slot.id] = pos

    def after_logits(self, step: Step, logits: np.ndarray | None) -> None:
        starts, ends = {}, {}
        for slot, pos in zip(step.sequences, step.positions, strict=True):
            starts.setdefault(slot, pos)
            ends[slot] = pos + 1
        prompt_ends = {seq.slot.id for _, seq in step.rows if not seq.generated}
        drafted = {seq.slot.id for _, seq in step.spec}
        due = [(slot, end) for slot, end in ends.items() if slot not in drafted and (
            slot in prompt_ends or self._before_last.get(slot, (None, -1))[1] == end
            or end // self.every > starts[slot] // self.every)]
        if due and isinstance(logits, TopLogits):
            logits.full()  # a copy computes on the backend: read the step's logits while they are there
        for slot, end in due:
            self.runner.model.cache.checkpoint(slot, end)
