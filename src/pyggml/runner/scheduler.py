"""The scheduler: which pending inputs go in the next batch, and which of its rows need logits.

It knows no model, engine or thread: from the running sequences (their pending inputs, cache slots and
outputs in flight) and the capacity (``batch_size`` inputs a batch, ``num_ctx`` a slot) it packs one
``Step`` and moves the packed inputs from each sequence's ``pending`` into its slot. Decode inputs go
first, by slot (consecutive sequences attend as one group, see kvcache.Causal), then prompt inputs in
arrival order. An image's inputs (``same_batch``) go in one batch, which grows past ``batch_size`` for
an image longer than any batch. A logits row is asked for where a token will be sampled (a sequence's
last pending input), at every drafted position (speculation), and at every prompt position of a
``prompt_logits`` request.

What needs a model happens around it, in the runner's step plug-ins: drafts are queued and full slots
shifted before it packs, images encoded before their inputs are packed. With build-ahead, a sequence
whose next token is still being sampled gets a placeholder input (token ``UNSET``) whose id is
written into the batch's token array once sampled, just before the batch computes. A plug-in may ask
for a batch boundary at a slot position (``stops``: a recurrent state is checkpointed there).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pyggml.input import ROPE_AXES, Batch, Input, Multimodal, MultimodalIndex, SharedText, rope_positions, rope_start
from pyggml.runner.sequence import RowPlan, RunningSequence

UNSET = -1  # token id of a placeholder input whose token is not sampled yet
CLOSED = "closed"  # ``Step.chain`` once nothing more may be chained to the step


class StepBatch(Batch):
    """A batch whose token ids are one int32 array that the graph reads when it computes, so ids
    sampled from the previous batch can still be written after the graph is built."""

    def __init__(self, ids: np.ndarray, **fields):
        super().__init__(inputs=ids, **fields)

    @property
    def tokens(self) -> np.ndarray:
        return self.inputs

    @classmethod
    def largest(cls, n: int, n_out: int, embeddings: list[np.ndarray]) -> StepBatch:
        """A batch as large as the scheduler packs: ``n`` inputs, ``n_out`` logits rows, and an image's
        ``embeddings`` (as the engine's ``reserve_multimodal`` shapes them) when they fit, for reserving memory."""
        fits = embeddings and sum(len(e.reshape(-1, e.shape[-1])) for e in embeddings) <= n
        multimodal = [MultimodalIndex(0, [Multimodal(tensor=e) for e in embeddings])] if fits else []
        return cls(np.zeros(n, np.int32), outputs=list(range(n - n_out, n)), positions=list(range(n)),
                   sequences=[0] * n, multimodal=multimodal)


@dataclass(eq=False)
class Step:
    """One packed batch: its inputs, where each sequence's logits rows are, the inputs whose token ids
    are filled in just before it computes, and (once built and launched) its graph and computation."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    sequences: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)  # batch indices with a logits row
    multimodal: list[MultimodalIndex] = field(default_factory=list)
    ropes: list[int] = field(default_factory=list)  # each input's rope position (Input.rope_step)
    inputs: list[Input] = field(default_factory=list)  # each input (its rope_offset; kept apart: no tuple per input)
    rows: list[tuple[int, RunningSequence]] = field(default_factory=list)  # (logits row, sequence) to sample
    scored: list[tuple[int, RunningSequence]] = field(default_factory=list)  # prompt rows a sequence keeps
    spec: list[tuple[int, RunningSequence]] = field(default_factory=list)  # (first row, sequence) with drafts
    late: list[tuple[int, Input, RunningSequence]] = field(default_factory=list)  # placeholders by batch index
    seqs: list[RunningSequence] = field(default_factory=list)  # every sequence with inputs in the batch
    finishing: list[RunningSequence] = field(default_factory=list)  # done once the batch is computed
    cancelled: list[RunningSequence] = field(default_factory=list)  # to release: cancelled, nothing in flight
    ids: np.ndarray | None = None
    batch: StepBatch | None = None  # None: nothing to compute
    graph: Any = None
    future: Any = None  # the computation, with build-ahead
    masks: Any = None  # the grammar masks of its constrained rows, computed beside the graph
    moved: bool = False  # some input's rope position is not its position (``rope_positions`` needed)
    read: bool | str = False  # what the runner reads once it computed (``Engine.compute``'s ``read``)
    plan: RowPlan | None = None  # how its rows are sampled (``plan_rows``), made while the step before computes
    feed: tuple[np.ndarray, np.ndarray] | None = None  # ``feed_rows`` of its placeholders
    fed: bool = False  # its placeholders' ids are written (``Runner._feed``)
    # build-ahead: the next step, for the worker to launch once this one is sampled (``Runner._chain``;
    # CLOSED once the worker took this one's result), and what the worker sampled then
    chain: Any = None
    sampled: Any = None
    started: threading.Event | None = None  # set once its native compute runs (build-ahead)

    @property
    def reads_logits(self) -> bool:
        return bool(self.rows or self.scored or self.spec)

    def add(self, inp: Input, position: int, sequence: int, seq: RunningSequence, rope: int | None = None) -> None:
        token = inp.token
        if type(inp) is not SharedText:  # (a sampled token's shared input is plain text: nothing to ask it)
            if inp.multimodal:
                self.multimodal.append(MultimodalIndex(len(self.tokens), inp.multimodal))
            if token == UNSET:
                self.late.append((len(self.tokens), inp, seq))
            if inp.rope_offset:
                self.moved = True
        self.tokens.append(token)
        self.positions.append(position)
        self.sequences.append(sequence)
        if rope is None:
            rope = position
        elif rope != position:
            self.moved = True
        self.ropes.append(rope)
        self.inputs.append(inp)

    def seal(self) -> None:
        """Make the batch of what was packed (none when nothing was)."""
        if self.tokens:
            self.ids = np.array(self.tokens, np.int32)
            ropes = [rope_positions(r, inp, ROPE_AXES) for r, inp in zip(self.ropes, self.inputs, strict=True)] \
                if self.moved else ()
            # positions and sequences as int32 once: the cache and the graph's inputs take these as they are
            self.batch = StepBatch(self.ids, outputs=self.outputs, positions=np.array(self.positions, np.int32),
                                   sequences=np.array(self.sequences, np.int32), multimodal=self.multimodal,
                                   rope_positions=ropes)


def feed_rows(late: list[tuple[int, Input, RunningSequence]],
              rows: list[tuple[int, RunningSequence]]) -> tuple[np.ndarray, np.ndarray] | None:
    """Where the tokens of placeholders ``late`` (a step's, by batch index) come from: (their batch indices,
    their sequences' indices in ``rows``, the step in flight's), so that its sampled tokens are written in
    one pass. None when a placeholder's sequence has no row there, or a row's sequence has a grammar (it
    takes its token, and starts its next mask, before the next step launches)."""
    at = {}
    for j, (_, seq) in enumerate(rows):
        if seq.constraint is not None:
            return None
        at[seq] = j
    try:
        return np.array([index for index, _, _ in late], np.int64), np.array([at[seq] for _, _, seq in late], np.int64)
    except KeyError:
        return None


def placeholder() -> Input:
    """An input whose token the batch in flight samples (``UNSET`` until then). Its other fields read the class
    defaults: every generating sequence gets one each step, a write rather than the dataclass's six."""
    inp = object.__new__(Input)
    inp.token = UNSET
    return inp


_PROMPT_KEY = 1 << 62  # past every slot id


def packing_order(seq: RunningSequence) -> int:
    """Decode inputs (one token, perhaps with drafts) first, by slot; then prompts in arrival order (a stable
    sort keeps it: they share one key)."""
    return _PROMPT_KEY if len(seq.pending) - len(seq.drafts) > 1 else seq.slot.id


def encoded(inp: Input) -> bool:
    """Whether an input can go in a batch: text, or an image whose embeddings are computed."""
    return not inp.multimodal or inp.multimodal[0].tensor is not None


class Scheduler:
    """Packs batches of at most ``batch_size`` inputs (more only for an image that needs more) for
    sequences whose slots hold ``num_ctx`` inputs each."""

    def __init__(self, batch_size: int, num_ctx: int):
        self.batch_size, self.num_ctx = batch_size, num_ctx
        self.stops: dict[int, int] = {}  # slot id -> a position a batch must end at (once), e.g. a checkpoint
        # whether a slot may hold num_ctx inputs: set when packing (or an admission) may have filled one, cleared
        # by the context shift once it finds none full (so most steps it visits no slot)
        self.maybe_full = True
        # slot id -> [its inputs, n, rope_start(n)] (a list updated in place: no new object per step)
        self._ropes: dict[int, list] = {}

    @staticmethod
    def feeds(seq: RunningSequence) -> bool:
        """Whether ``seq`` may put inputs in a batch now (not over, cancelled or paused: a paused
        sequence's consumer is not reading, so it gets nothing until it does)."""
        return not (seq.done or seq.cancelled or seq.paused)

    @staticmethod
    def awaits_placeholder(seq: RunningSequence, build_ahead: bool) -> bool:
        """Whether ``seq`` goes on with the token the batch in flight samples (build-ahead)."""
        return build_ahead and not seq.pending and seq.outputs_in_flight > 0 and seq.wants_logits and \
            seq.placeholder is None

    def wants_input(self, seq: RunningSequence, build_ahead: bool) -> bool:
        """Whether ``seq`` has an input for the next batch (a pending one, or a placeholder to come)."""
        return self.feeds(seq) and bool(seq.pending or self.awaits_placeholder(seq, build_ahead))

    def schedule(self, seqs: Iterable[RunningSequence], build_ahead: bool) -> Step:
        """The next step: ``step.batch`` is None when no sequence has an input to compute."""
        step = Step()
        for seq in sorted(seqs, key=packing_order):
            if seq.done or seq.cancelled or seq.paused:  # (``feeds``, inline: every sequence, every step)
                if seq.cancelled and not seq.done and not seq.outputs_in_flight:
                    step.cancelled.append(seq)
                continue
            if build_ahead and self.awaits_placeholder(seq, build_ahead):
                seq.placeholder = placeholder()
                seq.pending.append(seq.placeholder)
            room = self.batch_size - len(step.tokens)  # < 0 after an image that made the batch grow
            if seq.pending and room > 0 and not self._take_decode(step, seq):
                self._take(step, seq, room)
        step.seal()
        return step

    def _take_decode(self, step: Step, seq: RunningSequence) -> bool:
        """``_take`` of the usual decode input in fewer calls: ``seq``'s one pending input is text (a
        sampled token or a placeholder), without drafts or prompt scores, its slot has room and no stop
        asked for, and its rope position is remembered with nothing added since. False, having done
        nothing, when any of that does not hold (``_take`` then decides)."""
        pending, slot = seq.pending, seq.slot
        inputs = slot.inputs
        n = len(inputs)
        memo = self._ropes.get(slot.id)
        if memo is None or memo[0] is not inputs or memo[1] != n or n >= self.num_ctx or len(pending) != 1 or \
                seq.drafts or seq.scores is not None or (self.stops and slot.id in self.stops):
            return False
        inp = pending[0]
        if type(inp) is not SharedText and (inp.multimodal or inp.same_batch):
            return False
        pending.popleft()
        rope = memo[2]
        step.add(inp, n, slot.id, seq, rope)
        inputs.append(inp)
        memo[1], memo[2] = n + 1, rope + inp.rope_step
        if n + 1 >= self.num_ctx:
            self.maybe_full = True
        step.seqs.append(seq)
        self._ask_logits(step, seq, len(step.tokens) - 1, 1)
        return True

    def _take(self, step: Step, seq: RunningSequence, room: int) -> None:
        """Move up to ``room`` of ``seq``'s pending inputs into the step and its slot. A full slot
        takes nothing more (the context shift makes room before the next step)."""
        slot, pending, taken, first = seq.slot, seq.pending, 0, len(step.tokens)
        inputs, stop = slot.inputs, self.stops.get(slot.id)
        rope = self._rope_start(slot)
        while pending and taken < room:
            inp = pending[0]
            if len(inputs) >= self.num_ctx:  # (the context shift makes room before the next step: it looks now)
                self.maybe_full = True
                break
            if inp.multimodal and not encoded(inp):
                break
            if stop == len(inputs):
                del self.stops[slot.id]
                stop = None
                if taken:  # the batch ends at the stop; the next one goes on from it
                    break
            if inp.same_batch:  # an image's inputs go in one batch: this one, the next one, or after a shift
                if len(inputs) + inp.same_batch >= self.num_ctx:
                    break
                if inp.same_batch >= self.batch_size:  # longer than any batch: this one grows to hold it
                    room = taken + inp.same_batch + 1
                elif inp.same_batch >= room - taken:
                    break
            pending.popleft()
            step.add(inp, len(inputs), slot.id, seq, rope)
            inputs.append(inp)
            rope += inp.rope_step
            taken += 1
        if taken:
            if len(inputs) >= self.num_ctx:
                self.maybe_full = True
            memo = self._ropes.get(slot.id)
            if memo is None:
                self._ropes[slot.id] = [inputs, len(inputs), rope]
            else:
                memo[0], memo[1], memo[2] = inputs, len(inputs), rope
            step.seqs.append(seq)
            self._ask_logits(step, seq, first, taken)

    def _rope_start(self, slot: Any) -> int:
        """The rope position after ``slot``'s inputs: remembered from the last batch and advanced over
        inputs added since (only the scheduler appends; anything that replaces or shortens the list
        makes it count from the start)."""
        inputs, n = slot.inputs, len(slot.inputs)
        memo = self._ropes.get(slot.id)
        if memo is not None and memo[0] is inputs and memo[1] <= n:
            if memo[1] == n:  # nothing added since (a decode step)
                return memo[2]
            return memo[2] + sum(inp.rope_step for inp in inputs[memo[1]:])
        return rope_start(inputs, n)

    @staticmethod
    def _ask_logits(step: Step, seq: RunningSequence, first: int, taken: int) -> None:
        """The logits rows of ``seq``'s ``taken`` inputs from batch index ``first``."""
        if seq.scores is not None:  # every prompt position gets a logits row
            step.scored.extend((len(step.outputs) + i, seq) for i in range(taken))
            step.outputs.extend(range(first, first + taken))
        if seq.pending:
            return
        end = len(step.tokens)
        if seq.drafts:  # a logits row at the decode input and every drafted position
            step.outputs.extend(range(end - len(seq.drafts) - 1, end))
            step.spec.append((len(step.outputs) - len(seq.drafts) - 1, seq))
            seq.outputs_in_flight += 1
        elif seq.wants_logits:
            if seq.scores is None:
                step.outputs.append(end - 1)
            step.rows.append((len(step.outputs) - 1, seq))
            seq.outputs_in_flight += 1
        else:
            step.finishing.append(seq)
