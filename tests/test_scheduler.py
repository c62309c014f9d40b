"""The scheduler alone: no model, no engine, no thread. Plain sequences (their pending inputs, slots and
outputs in flight) go in; the packed batch, its logits rows and the moved inputs come out."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from pyggml.input import Input, Multimodal
from pyggml.runner.inputcache import InputCacheSlot
from pyggml.runner.scheduler import UNSET, Scheduler


@dataclass(eq=False)
class Seq:
    """What the scheduler reads of a running sequence."""

    slot: InputCacheSlot
    pending: deque = field(default_factory=deque)
    max_tokens: int = -1
    generated: int = 0
    outputs_in_flight: int = 0
    drafts: list = field(default_factory=list)
    scores: list | None = None
    placeholder: Input | None = None
    done: bool = False
    cancelled: bool = False
    paused: bool = False

    @property
    def wants_logits(self) -> bool:
        return self.max_tokens < 0 or self.generated + self.outputs_in_flight < self.max_tokens


def seq(slot: int, tokens, cached: int = 0, **kw) -> Seq:
    """Sequence in slot ``slot`` with ``tokens`` pending and ``cached`` inputs already in its slot."""
    return Seq(InputCacheSlot(slot, [Input(token=9)] * cached), deque(Input(token=t) for t in tokens), **kw)


def test_decode_inputs_go_first_by_slot_then_prompts_in_arrival_order():
    prompt_a, decode_2, prompt_b, decode_0 = seq(3, [10, 11, 12]), seq(2, [20], 5), seq(1, [30, 31]), seq(0, [40], 7)
    step = Scheduler(batch_size=16, num_ctx=32).schedule([prompt_a, decode_2, prompt_b, decode_0], build_ahead=False)
    assert step.tokens == [40, 20, 10, 11, 12, 30, 31]
    assert step.sequences == [0, 2, 3, 3, 3, 1, 1]
    assert step.positions == [7, 5, 0, 1, 2, 0, 1]  # where each input lands in its slot
    assert step.outputs == [0, 1, 4, 6]  # each sequence's last input: its next token is sampled there
    assert [(row, s) for row, s in step.rows] == [(0, decode_0), (1, decode_2), (2, prompt_a), (3, prompt_b)]
    assert all(not s.pending and s.outputs_in_flight == 1 for s in (prompt_a, decode_2, prompt_b, decode_0))
    assert [i.token for i in prompt_a.slot.inputs] == [10, 11, 12] and len(decode_0.slot.inputs) == 8
    assert step.batch.tokens.dtype == np.int32 and list(step.batch.tokens) == step.tokens


def test_a_prompt_longer_than_a_batch_is_split_and_sampled_after_its_last_chunk():
    s = seq(0, range(10))
    scheduler = Scheduler(batch_size=4, num_ctx=32)
    steps = [scheduler.schedule([s], build_ahead=False) for _ in range(3)]
    assert [st.tokens for st in steps] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [st.outputs for st in steps] == [[], [], [1]] and [len(st.rows) for st in steps] == [0, 0, 1]
    assert steps[2].positions == [8, 9]
    assert scheduler.schedule([s], build_ahead=False).batch is None  # nothing left: nothing to compute


def test_the_batch_is_shared_up_to_batch_size():
    a, b = seq(0, range(6)), seq(1, range(100, 106))
    step = Scheduler(batch_size=8, num_ctx=32).schedule([a, b], build_ahead=False)
    assert step.tokens == [0, 1, 2, 3, 4, 5, 100, 101] and len(b.pending) == 4
    assert [s for _, s in step.rows] == [a] and step.seqs == [a, b]


def image_prompt(before: int, run: int, after: int, slot: int = 0) -> Seq:
    """``before`` text inputs, an image of ``run`` inputs that go together (same_batch), ``after`` text inputs."""
    image = Input(multimodal=[Multimodal(tensor=np.zeros((run, 4), np.float32))], multimodal_hash=7,
                  same_batch=run - 1)
    inputs = [Input(token=t) for t in range(before)] + [image] + [Input(token=0)] * (run - 1) + \
        [Input(token=50 + t) for t in range(after)]
    return Seq(InputCacheSlot(slot), deque(inputs))


def test_an_image_is_never_split_and_one_longer_than_a_batch_grows_it():
    s = image_prompt(before=3, run=3, after=2)
    scheduler = Scheduler(batch_size=4, num_ctx=64)
    first = scheduler.schedule([s], build_ahead=False)
    assert first.tokens == [0, 1, 2] and not first.multimodal  # the image's 3 inputs would straddle two batches
    second = scheduler.schedule([s], build_ahead=False)
    assert len(second.tokens) == 4 and [m.index for m in second.multimodal] == [0]
    long = image_prompt(before=1, run=6, after=2)
    grown = Scheduler(batch_size=4, num_ctx=64)
    steps = [grown.schedule([long], build_ahead=False) for _ in range(2)]
    # the batch grows to hold the text before it and the whole image: at most batch_size - 1 + its run
    assert [len(st.tokens) for st in steps] == [7, 2] and [m.index for m in steps[0].multimodal] == [1]
    assert steps[1].tokens == [50, 51] and steps[1].rows == [(0, long)]


def test_an_image_not_encoded_yet_waits():
    s = image_prompt(before=2, run=2, after=1)
    s.pending[2].multimodal = [Multimodal(data=b"image bytes")]  # no tensor: the Images plug-in encodes it first
    step = Scheduler(batch_size=16, num_ctx=64).schedule([s], build_ahead=False)
    assert step.tokens == [0, 1] and not step.rows and len(s.pending) == 3


def test_build_ahead_gives_a_sequence_with_a_token_in_flight_a_placeholder():
    flying, idle = seq(0, [], 5, outputs_in_flight=1), seq(1, [], 5, outputs_in_flight=1)
    step = Scheduler(batch_size=8, num_ctx=32).schedule([flying], build_ahead=True)
    ((index, inp, owner),) = step.late
    assert (index, inp.token, owner) == (0, UNSET, flying) and flying.placeholder is inp
    assert step.tokens == [UNSET] and [s for _, s in step.rows] == [flying] and flying.outputs_in_flight == 2
    assert Scheduler(batch_size=8, num_ctx=32).schedule([idle], build_ahead=False).batch is None


def test_drafts_get_a_logits_row_each():
    s = seq(0, [7, 71, 72, 73], 5, drafts=[71, 72, 73])
    plain = seq(1, [8], 5)
    step = Scheduler(batch_size=16, num_ctx=32).schedule([plain, s], build_ahead=False)
    assert step.tokens == [7, 71, 72, 73, 8]  # by slot: the speculating sequence's decode input and drafts first
    assert step.outputs == [0, 1, 2, 3, 4]
    assert step.spec == [(0, s)] and step.rows == [(4, plain)]


def test_prompt_logits_rows_at_every_position():
    s = seq(0, [1, 2, 3, 4, 5], scores=[])
    scheduler = Scheduler(batch_size=3, num_ctx=32)
    first, second = scheduler.schedule([s], build_ahead=False), scheduler.schedule([s], build_ahead=False)
    assert first.outputs == [0, 1, 2] and [r for r, _ in first.scored] == [0, 1, 2] and not first.rows
    assert second.outputs == [0, 1] and [r for r, _ in second.scored] == [0, 1] and second.rows == [(1, s)]


def test_full_paused_cancelled_and_finished_sequences():
    full = seq(0, [1], cached=8)
    paused = seq(1, [2], paused=True)
    cancelled = seq(2, [3], cancelled=True)
    cancelled_in_flight = seq(3, [], cancelled=True, outputs_in_flight=1)
    done = seq(4, [5], done=True)
    last = seq(5, [6], max_tokens=2, generated=2)  # its last token is in: computed, not sampled
    step = Scheduler(batch_size=8, num_ctx=8).schedule([full, paused, cancelled, cancelled_in_flight, done, last],
                                                       build_ahead=False)
    assert step.tokens == [6] and step.finishing == [last] and not step.rows
    assert step.cancelled == [cancelled]  # released now; the other is released once its output is sampled
    assert list(full.pending) == [Input(token=1)]  # a full slot waits for the context shift


def test_wants_input_says_which_sequences_the_context_shift_must_serve():
    scheduler = Scheduler(batch_size=8, num_ctx=8)
    assert scheduler.wants_input(seq(0, [1]), build_ahead=False)
    assert not scheduler.wants_input(seq(0, []), build_ahead=False)
    assert scheduler.wants_input(seq(0, [], outputs_in_flight=1), build_ahead=True)  # a placeholder comes
    assert not scheduler.wants_input(seq(0, [1], paused=True), build_ahead=False)


def test_packing_that_fills_a_slot_says_a_slot_may_be_full():
    """The context shift looks at the slots only while one may be full (``maybe_full``): a decode input or a
    prompt that fills its slot sets it; the shift clears it once it finds none full."""
    scheduler = Scheduler(batch_size=8, num_ctx=4)
    scheduler.maybe_full = False
    s = seq(0, [1], cached=2)
    scheduler.schedule([s], build_ahead=False)  # (a slot's first packing: the general path)
    assert not scheduler.maybe_full and len(s.slot.inputs) == 3
    s.pending.append(Input(token=2))
    s.outputs_in_flight = 0
    scheduler.schedule([s], build_ahead=False)  # a decode input (the shortcut) fills it
    assert scheduler.maybe_full and len(s.slot.inputs) == 4
    scheduler.maybe_full = False
    scheduler.schedule([seq(1, range(6))], build_ahead=False)  # so does a prompt
    assert scheduler.maybe_full


def test_a_stop_ends_the_batch_there_once():
    """``stops``: a plug-in asks for a batch boundary at a slot position (a recurrent state is
    checkpointed there); the next batch goes on from it, and a stop reached at a batch's start costs nothing."""
    s, t = seq(0, range(6), cached=2), seq(1, range(10, 14))
    scheduler = Scheduler(batch_size=16, num_ctx=32)
    scheduler.stops.update({0: 7, 1: 0})
    steps = [scheduler.schedule([s, t], build_ahead=False) for _ in range(2)]
    assert [st.tokens for st in steps] == [[0, 1, 2, 3, 4, 10, 11, 12, 13], [5]]
    assert steps[0].positions[:5] == [2, 3, 4, 5, 6] and steps[1].positions == [7]
    assert [s_ for _, s_ in steps[0].rows] == [t] and [s_ for _, s_ in steps[1].rows] == [s]  # no row before the stop
    assert scheduler.stops == {}


def test_rope_positions_move_after_an_image_and_follow_a_cut_short_slot():
    """mRoPE: an image of 2 x 3 tokens (offsets (0, row, column), steps 0 and max(2, 3) for the last) moves
    the text after it to the image's start + 3; a batch of text alone at unmoved positions carries none.
    When the slot's inputs are cut short (a rejected draft) or replaced, the rope positions are counted
    again for what the slot holds."""
    image = [Input(token=7, multimodal=[Multimodal(tensor=np.zeros((6, 4)))], multimodal_hash=5, same_batch=6,
                   rope_offset=(0, 0, 0), rope_step=0)]
    image += [Input(token=7, rope_offset=(0, k // 3, k % 3), rope_step=0) for k in range(1, 6)]
    image[-1].rope_step = 3
    s = Seq(InputCacheSlot(0), deque([Input(token=1), Input(token=2), *image, Input(token=8), Input(token=3)]))
    scheduler = Scheduler(batch_size=16, num_ctx=64)
    step = scheduler.schedule([s], build_ahead=False)
    assert step.positions == list(range(10))
    assert [list(r) for r in step.batch.rope_positions] == [
        [0, 0, 0], [1, 1, 1], [2, 2, 2], [2, 2, 3], [2, 2, 4], [2, 3, 2], [2, 3, 3], [2, 3, 4], [5, 5, 5], [6, 6, 6]]
    s.outputs_in_flight = 0
    s.pending.extend([Input(token=4), Input(token=5)])
    assert [list(r) for r in scheduler.schedule([s], build_ahead=False).batch.rope_positions] == [[7] * 3, [8] * 3]
    del s.slot.inputs[10:]  # the two drafted tokens rejected
    s.outputs_in_flight = 0
    s.pending.append(Input(token=6))
    assert [list(r) for r in scheduler.schedule([s], build_ahead=False).batch.rope_positions] == [[7] * 3]
    text = seq(1, [1, 2, 3])
    assert not len(scheduler.schedule([text], build_ahead=False).batch.rope_positions)  # nothing moved


def test_the_decode_path_packs_what_the_general_path_packs():
    """``Scheduler._take_decode`` (the usual decode input in fewer calls) gives the steps, rows and slot
    contents that ``_take`` alone gives, over random runs: prompts, decode inputs with and without
    placeholders, drafts, prompt scores, stops, full slots, inputs that move the rope positions, slots cut
    short or replaced, sequences ending by length. And it is the path the decode inputs take."""
    import random

    def world(seed):
        rng = random.Random(seed)
        seqs = [seq(i, [rng.randrange(1, 100) for _ in range(rng.randrange(1, 6))], max_tokens=rng.choice((-1, 6, 20)),
                    scores=[] if rng.random() < 0.1 else None) for i in range(6)]
        seqs[0].pending.appendleft(Input(token=3, rope_step=4, rope_offset=(0, 1, 2)))  # moves what follows
        return seqs

    def run(seqs, seed, decode_path):
        rng = random.Random(seed)
        scheduler = Scheduler(batch_size=12, num_ctx=24)
        if not decode_path:
            scheduler._take_decode = lambda step, s: False
        taken = [0]
        general = scheduler._take

        def counted(*args):
            taken[0] += 1
            general(*args)
        scheduler._take = counted
        trace = []
        for _ in range(40):
            build_ahead = rng.random() < 0.5
            if rng.random() < 0.2:
                scheduler.stops[rng.randrange(6)] = rng.randrange(24)
            step = scheduler.schedule(seqs, build_ahead)
            rope = [list(r) for r in step.batch.rope_positions] if step.batch is not None else None
            trace.append((step.tokens, step.positions, step.sequences, step.outputs, step.ropes, rope,
                           [(r, s.slot.id) for r, s in step.rows], [(r, s.slot.id) for r, s in step.spec],
                           [i for i, _, _ in step.late], [s.slot.id for s in step.finishing], step.moved,
                           [(s.slot.id, [i.token for i in s.pending], len(s.slot.inputs), s.outputs_in_flight)
                            for s in seqs], dict(scheduler.stops)))
            for _, s in step.rows + step.spec:  # sampled: the token goes in the placeholder, or is the next input
                s.outputs_in_flight -= 1
                s.generated += 1 + len(s.drafts)
                token = rng.randrange(1, 100)
                if s.placeholder is not None:
                    s.placeholder.token, s.placeholder = token, None
                elif not s.pending:  # now and then one that moves the rope positions after it by 2, or (for good)
                    odd = rng.random()  # one that asks to go with more inputs than a slot holds: it waits
                    s.pending.append(Input(token=token, rope_step=2 if odd < 0.1 else 1, same_batch=30 * (odd > 0.98)))
                if s.drafts:
                    s.drafts = []
                    del s.slot.inputs[len(s.slot.inputs) - rng.randrange(2):]  # a draft rejected: the slot cut short
            for s in seqs:
                if s.max_tokens >= 0 and s.generated >= s.max_tokens and not s.outputs_in_flight:
                    s.done = True
                elif len(s.slot.inputs) >= 24 and not s.outputs_in_flight and rng.random() < 0.5:  # a context shift
                    s.slot.inputs = s.slot.inputs[:4] + s.slot.inputs[-4:]
                elif rng.random() < 0.03:  # the slot's list replaced by one as long, which counts its rope anew
                    s.slot.inputs = [Input(token=9, rope_step=2)] * len(s.slot.inputs)
                elif len(s.pending) == 1 and not s.outputs_in_flight and rng.random() < 0.1:
                    s.drafts = [rng.randrange(1, 100) for _ in range(2)]
                    s.pending.extend(Input(token=t) for t in s.drafts)
        return trace, taken[0]

    for seed in range(30):
        fast, fast_general = run(world(seed), seed, True)
        slow, slow_general = run(world(seed), seed, False)
        assert fast == slow, seed
        assert fast_general < slow_general, seed  # decode inputs did take the decode path
