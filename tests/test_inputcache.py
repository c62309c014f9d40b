"""InputCache: slot choice (longest prefix, best slot with LRU eviction and forking), prompt reuse
rules, and context shifting, against a fake cache that records what it is asked to do."""

from __future__ import annotations

import numpy as np
import pytest

from pyggml.kvcache import NotSupportedError
from pyggml.models import Input
from pyggml.runner import InputCache, NoFreeSlotError, ReprocessInputsError, count_common_prefix


class FakeCache:
    """Records the cache calls InputCache makes; can refuse partial removal or resuming."""

    def __init__(self, partial_remove: bool = True, resume: bool = True):
        self.partial_remove, self.resume = partial_remove, resume
        self.calls: list[tuple] = []

    def remove(self, seq, begin, end=None):
        if not self.partial_remove and (begin > 0 or end is not None):
            self.calls.append(("remove refused", seq, begin, end))
            raise NotSupportedError("no partial removal")
        self.calls.append(("remove", seq, begin, end))

    def copy_prefix(self, src, dst, length):
        self.calls.append(("copy_prefix", src, dst, length))

    def can_resume(self, seq, pos):
        self.calls.append(("can_resume", seq, pos))
        return self.resume

    def resumable(self, seq, pos):
        return pos if self.resume else 0


def inputs(*tokens: int) -> list[Input]:
    return [Input(token=t) for t in tokens]


def tokens(xs) -> list[int]:
    return [x.token for x in xs]


def test_num_ctx_is_the_kv_size_per_slot():
    cache = InputCache(kv_size=100, num_slots=3)
    assert cache.num_ctx == 33
    assert [s.id for s in cache.slots] == [0, 1, 2]
    assert all(not s.in_use and s.inputs == [] for s in cache.slots)


def test_a_slot_must_hold_at_least_one_batch():
    with pytest.raises(ValueError, match="less than one batch of 8"):
        InputCache(kv_size=16, num_slots=4, batch_size=8)
    with pytest.raises(ValueError, match="less than one batch"):
        InputCache(kv_size=3, num_slots=4)
    with pytest.raises(ValueError, match="num_slots"):
        InputCache(kv_size=16, num_slots=0)


def test_count_common_prefix_compares_token_and_multimodal_hash():
    assert count_common_prefix(inputs(1, 2, 3), inputs(1, 2, 4)) == 2
    assert count_common_prefix(inputs(1, 2), inputs(1, 2, 3)) == 2
    assert count_common_prefix([], inputs(1)) == 0
    image = [Input(token=0, multimodal_hash=7), Input(token=5)]
    assert count_common_prefix(image, [Input(token=0, multimodal_hash=8), Input(token=5)]) == 0
    assert count_common_prefix(image, [Input(token=0, multimodal_hash=7, same_batch=3), Input(token=5)]) == 2


def test_single_user_takes_the_free_slot_with_the_longest_prefix():
    fake = FakeCache()
    cache = InputCache(40, 4, multi_user_cache=False, cache=fake)
    cache.slots[0].inputs = inputs(1, 2)
    cache.slots[1].inputs = inputs(1, 2, 3, 4, 5)
    cache.slots[1].in_use = True  # longest, but busy
    cache.slots[2].inputs = inputs(1, 2, 3, 9)
    slot, rest = cache.load_cache_slot(inputs(1, 2, 3, 4, 6), cache_prompt=True)
    assert slot.id == 2
    assert tokens(slot.inputs) == [1, 2, 3] and tokens(rest) == [4, 6]
    assert ("remove", 2, 3, None) in fake.calls  # the tail that differs is dropped
    assert not any(c[0] == "copy_prefix" for c in fake.calls)


def test_single_user_without_a_free_slot_raises():
    cache = InputCache(20, 2, multi_user_cache=False)
    for s in cache.slots:
        s.in_use = True
    with pytest.raises(NoFreeSlotError, match="all 2 cache slots are in use"):
        cache.load_cache_slot(inputs(1, 2), cache_prompt=True)


def test_multi_user_reuses_a_slot_whose_whole_content_prefixes_the_prompt():
    fake = FakeCache()
    cache = InputCache(40, 4, multi_user_cache=True, cache=fake)
    cache.slots[0].inputs = inputs(1, 2, 3, 7)
    cache.slots[0].last_used = 1.0
    cache.slots[3].inputs = inputs(1, 2, 3)
    cache.slots[3].last_used = 5.0
    slot, rest = cache.load_cache_slot(inputs(1, 2, 3, 4), cache_prompt=True)
    assert slot.id == 3 and tokens(rest) == [4]
    assert not any(c[0] == "copy_prefix" for c in fake.calls)


def test_multi_user_forks_the_longest_prefix_into_the_least_recently_used_slot():
    fake = FakeCache()
    cache = InputCache(40, 3, multi_user_cache=True, cache=fake)
    cache.slots[0].inputs, cache.slots[0].last_used = inputs(1, 2, 3, 8, 8), 3.0
    cache.slots[1].inputs, cache.slots[1].last_used = inputs(5, 5), 1.0  # least recently used
    cache.slots[2].inputs, cache.slots[2].last_used = inputs(1, 9), 2.0
    slot, rest = cache.load_cache_slot(inputs(1, 2, 3, 4, 5), cache_prompt=True)
    assert slot.id == 1
    assert ("copy_prefix", 0, 1, 3) in fake.calls
    assert tokens(slot.inputs) == [1, 2, 3] and tokens(rest) == [4, 5]
    assert tokens(cache.slots[0].inputs) == [1, 2, 3, 8, 8]  # the source keeps its content


def test_multi_user_forks_from_a_slot_in_use():
    fake = FakeCache()
    cache = InputCache(40, 2, multi_user_cache=True, cache=fake)
    cache.slots[0].inputs, cache.slots[0].in_use = inputs(1, 2, 3), True
    slot, rest = cache.load_cache_slot(inputs(1, 2, 3, 4), cache_prompt=True)
    assert slot.id == 1 and tokens(rest) == [4]
    assert ("copy_prefix", 0, 1, 3) in fake.calls


def test_multi_user_evicts_the_least_recently_used_free_slot():
    cache = InputCache(30, 3, multi_user_cache=True, cache=FakeCache())
    for slot, t, used in zip(cache.slots, (10, 20, 30), (2.0, 1.0, 3.0), strict=True):
        slot.inputs, slot.last_used = inputs(t, t), used
    cache.slots[1].in_use = True  # the oldest, but busy
    slot, rest = cache.load_cache_slot(inputs(40, 41), cache_prompt=True)
    assert slot.id == 0 and tokens(rest) == [40, 41] and slot.inputs == []
    assert slot.in_use and slot.last_used > 3.0


def test_multi_user_without_a_free_slot_raises():
    cache = InputCache(20, 2, multi_user_cache=True)
    for s in cache.slots:
        s.in_use = True
    with pytest.raises(NoFreeSlotError):
        cache.load_cache_slot(inputs(1), cache_prompt=True)


@pytest.mark.parametrize("multi_user", [False, True])
def test_cache_prompt_false_reuses_nothing(multi_user):
    fake = FakeCache()
    cache = InputCache(20, 1, multi_user_cache=multi_user, cache=fake)
    cache.slots[0].inputs = inputs(1, 2, 3)
    slot, rest = cache.load_cache_slot(inputs(1, 2, 3, 4), cache_prompt=False)
    assert tokens(rest) == [1, 2, 3, 4] and slot.inputs == []
    assert fake.calls[-1] == ("remove", 0, 0, None)


def test_a_fully_cached_prompt_leaves_one_input_to_process():
    fake = FakeCache()
    cache = InputCache(20, 1, cache=fake)
    cache.slots[0].inputs = inputs(1, 2, 3, 4)
    slot, rest = cache.load_cache_slot(inputs(1, 2, 3), cache_prompt=True)
    assert tokens(slot.inputs) == [1, 2] and tokens(rest) == [3]
    assert fake.calls[-1] == ("remove", 0, 2, None)


def test_a_cache_that_cannot_drop_a_tail_is_cleared_and_the_prompt_reprocessed():
    fake = FakeCache(partial_remove=False)
    cache = InputCache(20, 1, cache=fake)
    cache.slots[0].inputs = inputs(1, 2, 3, 4)
    slot, rest = cache.load_cache_slot(inputs(1, 2, 9), cache_prompt=True)
    assert fake.calls[-2:] == [("remove refused", 0, 2, None), ("remove", 0, 0, None)]
    assert slot.inputs == [] and tokens(rest) == [1, 2, 9]


def test_a_slot_that_cannot_resume_starts_over():
    fake = FakeCache(resume=False)
    cache = InputCache(20, 1, cache=fake)
    cache.slots[0].inputs = inputs(1, 2, 3)
    slot, rest = cache.load_cache_slot(inputs(1, 2, 3, 4), cache_prompt=True)
    assert ("can_resume", 0, 3) in fake.calls and fake.calls[-1] == ("remove", 0, 0, None)
    assert tokens(rest) == [1, 2, 3, 4]


def test_loading_marks_the_slot_used_and_works_without_a_cache():
    cache = InputCache(20, 2, multi_user_cache=True)
    first, _ = cache.load_cache_slot(inputs(1, 2), cache_prompt=True)
    second, _ = cache.load_cache_slot(inputs(3), cache_prompt=True)
    assert first.in_use and second.in_use and first is not second
    assert second.last_used >= first.last_used > 0
    with pytest.raises(ValueError, match="empty prompt"):
        cache.load_cache_slot([], cache_prompt=True)


def test_shift_discard_frees_half_of_what_follows_num_keep():
    cache = InputCache(20, 1)
    assert cache.shift_discard(inputs(*range(20)), num_keep=4) == 8  # (20 - 4) / 2
    assert cache.shift_discard(inputs(*range(15)), num_keep=4) == 3  # 5 are free already
    assert cache.shift_discard(inputs(*range(5)), num_keep=4) == 0
    assert cache.shift_discard(inputs(*range(20)), num_keep=19) == 1  # always at least one


def test_shift_discard_never_splits_a_same_batch_run():
    cache = InputCache(20, 1)
    run = inputs(*range(20))
    run[9].same_batch = 3  # inputs 9..12 go in one batch: discarding 9 discards through 12
    assert cache.shift_discard(run, num_keep=4) == 9
    run[9].same_batch, run[11].same_batch = 0, 4  # 11..15; the discard of 8 ends at 11
    assert cache.shift_discard(run, num_keep=4) == 12


def test_shift_cache_slot_drops_the_oldest_half_after_num_keep():
    fake = FakeCache()
    cache = InputCache(10, 1, cache=fake)
    slot = cache.slots[0]
    slot.inputs = inputs(*range(10))
    cache.shift_cache_slot(slot, num_keep=2)
    assert fake.calls == [("remove", 0, 2, 6)]
    assert tokens(slot.inputs) == [0, 1, 6, 7, 8, 9]


def test_shift_with_room_to_spare_does_nothing():
    fake = FakeCache()
    cache = InputCache(10, 1, cache=fake)
    cache.slots[0].inputs = inputs(1, 2)
    cache.shift_cache_slot(cache.slots[0], num_keep=1)
    assert fake.calls == [] and tokens(cache.slots[0].inputs) == [1, 2]


def test_shift_needs_num_keep_below_the_context():
    cache = InputCache(10, 1, cache=FakeCache())
    cache.slots[0].inputs = inputs(*range(10))
    with pytest.raises(ValueError, match="keeping 10 inputs leaves nothing to drop"):
        cache.shift_cache_slot(cache.slots[0], num_keep=10)


def test_shift_the_cache_cannot_do_clears_the_slot_and_returns_inputs_to_reprocess():
    fake = FakeCache(partial_remove=False)
    cache = InputCache(10, 1, cache=fake)
    slot = cache.slots[0]
    slot.inputs = inputs(*range(10))
    with pytest.raises(ReprocessInputsError) as err:
        cache.shift_cache_slot(slot, num_keep=2)
    assert tokens(err.value.inputs) == [0, 1, 6, 7, 8, 9]
    assert slot.inputs == []
    assert fake.calls == [("remove refused", 0, 2, 6), ("remove", 0, 0, None)]


def test_text_inputs_are_shared_and_cannot_change():
    """text_input gives one object per token id (a decode step allocates no input), equal to and hashing
    as Input(token=...); it refuses changes (every slot holding it would change); ids outside the shared
    table get an input of their own."""
    from pyggml.input import text_input

    a = text_input(17)
    assert text_input(17) is a and a == Input(token=17) and hash(a) == hash(Input(token=17))
    assert (a.multimodal, a.multimodal_hash, a.same_batch, a.rope_offset, a.rope_step) == (None, 0, 0, (), 1)
    assert count_common_prefix([text_input(t) for t in (1, 2, 3)], [Input(token=t) for t in (1, 2, 9)]) == 2
    with pytest.raises(AttributeError, match="shared text input"):
        a.token = 18
    assert a.token == 17
    for far in (-1, 1 << 40):
        assert text_input(far) is not text_input(far) and text_input(far) == Input(token=far)
    assert type(text_input(np.int64(123457)).token) is int and text_input(123457) is text_input(np.int64(123457))
    with pytest.raises(TypeError):
        text_input(2.5)
