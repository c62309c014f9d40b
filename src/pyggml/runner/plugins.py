"""Step plug-ins: the features of the decode loop that act around the scheduler and the sampler.

Each turn of the runner's loop calls, on every plug-in in order, ``before_build()`` (before the
scheduler packs the next batch: queue drafts, make room in full slots, encode images),
``launched(step)`` (the step's graph starts computing: work that can run beside it) and, once the
step's logits are read, ``after_logits(step, logits)`` (before its plain rows are sampled: grammar
masks ready, drafts verified). A new feature (e.g. recurrent-state checkpoints) is one more plug-in;
the loop does not change. The plug-ins here: ``ContextShift`` and ``Constraints``; ``Speculation``
is in speculative.py, ``Images`` in images.py.

A plug-in gets the runner it serves; it may read its ``active`` sequences, ``scheduler``,
``input_cache``, ``num_ctx``/``batch_size``/``build_ahead``, wait for or complete the batch in
flight (``wait_in_flight``, ``complete_in_flight``) and end sequences (``release``, ``fail_sequence``).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from pyggml.constrain import Constraint
from pyggml.runner.inputcache import ReprocessInputsError

if TYPE_CHECKING:
    from pyggml.runner.runner import Runner
    from pyggml.runner.scheduler import Step

log = logging.getLogger(__name__)

class StepPlugin:
    """The hooks of one loop feature; each does nothing unless overridden."""

    def before_build(self) -> None:
        """Before the scheduler packs the next batch (the previous one may still compute)."""

    def launched(self, step: Step) -> None:
        """``step``'s token ids are final and its graph starts computing (a step the worker launched
        itself, ``Runner._chain``: has just started)."""

    def after_logits(self, step: Step, logits: np.ndarray | None) -> None:
        """``step`` computed (``logits``: its rows, or None when none were read); its plain rows
        are sampled after every plug-in's ``after_logits``, except in a step the worker sampled
        (``Runner._chain``: one without grammar masks, drafts or prompt rows)."""

    def close(self) -> None:
        """The runner closes: stop any worker of the plug-in's own."""


class ContextShift(StepPlugin):
    """Make room in a full slot before the scheduler packs it: drop old inputs after ``num_keep`` and
    re-rotate the kept keys (``InputCache.shift_cache_slot``), or, when the cache cannot shift,
    re-queue the inputs to keep. Moving keys computes on the cache, so the batch in flight (built
    before the move) must have written its keys and values first."""

    def __init__(self, runner: Runner):
        self.runner = runner

    def before_build(self) -> None:
        r = self.runner
        if not r.scheduler.maybe_full:  # no slot can be full: no pass over them
            return
        num_ctx = r.num_ctx
        full = [s for s in r.active if len(s.slot.inputs) >= num_ctx]
        if not full:
            r.scheduler.maybe_full = False
        for seq in full:
            if r.scheduler.wants_input(seq, r.build_ahead):
                r.wait_in_flight()
                try:
                    r.input_cache.shift_cache_slot(seq.slot, seq.num_keep)
                except ReprocessInputsError as exc:
                    seq.pending.extendleft(reversed(exc.inputs))


class Constraints(StepPlugin):
    """Grammar masks (``format``/``grammar`` requests): the masks of a batch's constrained rows are
    computed in a worker while its graph computes (llguidance releases the GIL); every token they
    follow is consumed by then. The sampler applies them (``Constraint.apply``)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None  # started with the first constraint

    def launched(self, step: Step) -> None:
        jobs = [(seq.constraint, None) for _, seq in step.rows if seq.constraint is not None]
        jobs += [(seq.constraint, list(seq.drafts)) for _, seq in step.spec if seq.constraint is not None]
        if not jobs:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="pyggml-grammar")
        step.masks = self._pool.submit(compute_masks, jobs)

    def after_logits(self, step: Step, logits: np.ndarray | None) -> None:
        if step.masks is not None:
            try:
                step.masks.result()
            except Exception as exc:  # a grammar failure: sampling recomputes and reports it
                log.error("grammar masks failed: %r", exc)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


def compute_masks(jobs: list[tuple[Constraint, list[int] | None]]) -> None:
    """The next-token masks of a batch's constrained rows: one per sampled row, and for a
    speculating sequence one per verified row (its drafts stepped through and rolled back)."""
    for constraint, drafts in jobs:
        if drafts is None:
            constraint.compute_mask()
        else:
            constraint.compute_draft_masks(drafts)
