"""pyggml.sample: each filter on crafted distributions, and draws against softmax."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pyggml.sample import Sampler, logprobs


def logits_of(probs) -> np.ndarray:
    return np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)


def support(sampler: Sampler, logits: np.ndarray, n: int = 2000, history=()) -> set[int]:
    return {sampler.sample(logits, history) for _ in range(n)}


def frequencies(sampler: Sampler, logits: np.ndarray, n: int) -> np.ndarray:
    draws = [sampler.sample(logits) for _ in range(n)]
    return np.bincount(draws, minlength=logits.size) / n


def test_greedy_is_argmax_and_ignores_seed():
    logits = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    for temp in (0.0, -1.0):
        assert Sampler(temperature=temp).sample(logits) == int(np.argmax(logits))
    assert Sampler(temperature=0.0, seed=1).sample(logits) == Sampler(temperature=0.0, seed=2).sample(logits)


def test_top_k_1_equals_greedy():
    rng = np.random.default_rng(1)
    for _ in range(20):
        logits = rng.standard_normal(5000).astype(np.float32)
        s = Sampler(temperature=1.5, top_k=1, top_p=1.0, seed=0)
        assert s.sample(logits) == int(np.argmax(logits))


def test_seed_reproducible_and_different_seeds_differ():
    logits = np.random.default_rng(2).standard_normal(500).astype(np.float32)
    kw = dict(temperature=1.0, top_k=0, top_p=1.0)
    s1, s2, s3 = Sampler(**kw, seed=7), Sampler(**kw, seed=7), Sampler(**kw, seed=8)
    seq1 = [s1.sample(logits) for _ in range(50)]
    assert seq1 == [s2.sample(logits) for _ in range(50)]
    assert seq1 != [s3.sample(logits) for _ in range(50)]


def test_top_k_keeps_exactly_the_k_largest_on_a_large_vocab():
    logits = np.random.default_rng(3).permutation(np.arange(128_000, dtype=np.float32) / 1000)
    s = Sampler(temperature=100.0, top_k=5, top_p=1.0, seed=0)  # hot: all 5 get drawn
    assert support(s, logits, 500) == set(np.argsort(logits)[-5:].tolist())


@pytest.mark.parametrize("vocab", [4096, 32000, 32003, 151_936, 262_145])
def test_top_k_by_groups_equals_the_sorted_reference(vocab):
    """Large vocabularies take their top-k by groups (``_top_k_groups``); the result must be exactly the
    reference's: the k largest of each row, largest first, ties by lower id, whatever the ties, the -inf
    (banned) logits and a vocabulary that does not divide into groups."""
    from pyggml.sample import _GROUP_DEPTH, _top_k_groups

    rng = np.random.default_rng(vocab)
    m = (3 * rng.standard_normal((6, vocab))).astype(np.float32)
    m[0, 100:180] = 9.0  # 80 equal logits at the top
    m[1] = np.round(m[1])  # few distinct values: ties everywhere
    m[2, : vocab - 50] = -np.inf  # only 50 finite logits (fewer than some k)
    m[3, -3:] = 20.0  # the largest in the last, partial group
    m[4] = -m[4]
    m[5, ::7] = 0.0
    for k in (1, 40, 64):
        if vocab // _GROUP_DEPTH < k:
            continue
        ids, vals = _top_k_groups(m, k)
        order = np.lexsort((np.tile(np.arange(vocab), (6, 1)), -m), axis=1)[:, :k]  # value desc, then id
        np.testing.assert_array_equal(ids, order)
        np.testing.assert_array_equal(vals, np.take_along_axis(m, order, axis=1))


def test_top_p_keeps_smallest_prefix_reaching_p():
    logits = logits_of([0.5, 0.3, 0.1, 0.06, 0.04])
    s = lambda p: Sampler(temperature=1.0, top_k=0, top_p=p, seed=0)  # noqa: E731
    assert support(s(0.5), logits) == {0}
    assert support(s(0.75), logits) == {0, 1}
    assert support(s(0.85), logits) == {0, 1, 2}
    assert support(s(1.0), logits) == {0, 1, 2, 3, 4}
    # the same on a 50k vocabulary where the mass sits in three tokens among thousands of tiny ones
    big = np.full(50_000, -20.0, dtype=np.float32)
    big[[10, 20_000, 49_999]] = [3.0, 2.0, 1.0]
    assert support(s(0.7), big, 100) == {10, 20_000}


def test_top_p_nucleus_of_hundreds_of_tokens_is_whole():
    """A flat-ish 1000-token distribution: the nucleus holds ~800 tokens, every one drawable."""
    rng = np.random.default_rng(5)
    logits = rng.permutation(-np.arange(1000) * 0.002).astype(np.float32)
    probs = np.exp(logits.astype(np.float64) - logits.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    cum = np.cumsum(probs[order])
    p = float(cum[799] + cum[800]) / 2  # halfway between two prefix masses: 801 tokens, no rounding doubt
    hot = Sampler(temperature=1000.0, top_k=0, top_p=p, seed=0)  # flat over what top-p keeps
    assert support(hot, logits, 20_000) == set(order[:801].tolist())


def test_min_p_keeps_tokens_above_a_fraction_of_the_best():
    logits = logits_of([0.4, 0.3, 0.15, 0.1, 0.05])
    s = lambda m: Sampler(temperature=1.0, top_k=0, top_p=1.0, min_p=m, seed=0)  # noqa: E731
    assert support(s(0.5), logits) == {0, 1}  # >= 0.2
    assert support(s(0.25), logits) == {0, 1, 2, 3}  # >= 0.1
    assert support(s(1.0), logits) == {0}


def test_min_p_judges_the_probabilities_before_temperature():
    # token 1 has e^-1 = 0.37 of the best's probability: kept under min_p 0.3, as llama.cpp's chain
    # (min_p, then temperature) does; judged after a temperature of 0.5 it would have e^-2 = 0.14 and go
    logits = np.array([0.0, -1.0], np.float32)
    assert support(Sampler(temperature=0.5, top_k=0, top_p=1.0, min_p=0.3, seed=0), logits) == {0, 1}
    # and a hot sampler cannot bring back what min_p dropped: e^-3 = 0.05 < 0.3
    assert support(Sampler(temperature=4.0, top_k=0, top_p=1.0, min_p=0.3, seed=0),
                   np.array([0.0, -3.0], np.float32)) == {0}


def test_typical_keeps_tokens_closest_to_entropy():
    probs = np.array([0.6, 0.2, 0.1, 0.05, 0.05])
    entropy = -(probs * np.log(probs)).sum()
    order = np.argsort(np.abs(-np.log(probs) - entropy), kind="stable")
    s = Sampler(temperature=1.0, top_k=0, top_p=1.0, typical_p=0.25, seed=0)
    assert support(s, logits_of(probs)) == {int(order[0]), int(order[1])}  # 0.2 alone is not > 0.25


def test_filters_apply_before_temperature():
    # top_p at 0.6 keeps {0, 1} whatever the temperature: a very hot sampler still never picks 2..4
    logits = logits_of([0.5, 0.3, 0.1, 0.06, 0.04])
    assert support(Sampler(temperature=50.0, top_k=0, top_p=0.6, seed=0), logits) == {0, 1}


def test_repeat_presence_and_frequency_penalties():
    logits = np.array([2.0, 1.9, -1.0, 0.5], dtype=np.float32)
    greedy = dict(temperature=0.0)
    assert Sampler(**greedy).sample(logits, history=[0]) == 0
    assert Sampler(**greedy, repeat_penalty=1.1).sample(logits, history=[0]) == 1  # 2.0/1.1 < 1.9
    assert Sampler(**greedy, presence_penalty=0.2).sample(logits, history=[0, 0, 0]) == 1
    s = Sampler(**greedy, frequency_penalty=0.3)
    assert s.sample(logits, history=[0]) == 1 and s.sample(logits, history=[0, 1]) == 0
    # only the last repeat_last_n tokens count; -1 means the whole history
    hist = [0] + [3] * 10
    assert Sampler(**greedy, repeat_penalty=2.0, repeat_last_n=5).sample(logits, hist) == 0
    assert Sampler(**greedy, repeat_penalty=2.0, repeat_last_n=-1).sample(logits, hist) == 1
    assert Sampler(**greedy, repeat_penalty=2.0, repeat_last_n=0).sample(logits, hist) == 0
    # exactly the last n: token 0 is the sixth most recent
    assert Sampler(**greedy, repeat_penalty=2.0, repeat_last_n=5).sample(logits, [0] + [3] * 5) == 0
    assert Sampler(**greedy, repeat_penalty=2.0, repeat_last_n=6).sample(logits, [0] + [3] * 5) == 1
    # negative logits are pushed further down (multiplied), not towards zero
    neg = np.array([-1.0, -1.05], dtype=np.float32)
    assert Sampler(**greedy, repeat_penalty=1.2).sample(neg, history=[0]) == 1
    # the caller's array is never modified
    before = logits.copy()
    Sampler(**greedy, repeat_penalty=1.5, logit_bias={2: 5.0}).sample(logits, history=[0, 1])
    np.testing.assert_array_equal(logits, before)


def test_logit_bias_bans_and_boosts():
    logits = np.array([3.0, 2.0, 1.0], dtype=np.float32)
    assert Sampler(temperature=0.0, logit_bias={0: -math.inf}).sample(logits) == 1
    assert Sampler(temperature=0.0, logit_bias={2: 2.5}).sample(logits) == 2
    banned = Sampler(temperature=1.0, top_k=0, top_p=1.0, logit_bias={0: -math.inf, 1: -math.inf}, seed=0)
    assert support(banned, logits, 200) == {2}
    with pytest.raises(ValueError, match="-inf"):
        Sampler(logit_bias={0: -math.inf, 1: -math.inf, 2: -math.inf}).sample(logits)
    with pytest.raises(ValueError, match="out of range"):
        Sampler(logit_bias={3: 1.0}).sample(logits)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_draws_follow_softmax(temperature):
    logits = np.random.default_rng(4).standard_normal(12).astype(np.float32)
    want = np.exp(logits / temperature) / np.exp(logits / temperature).sum()
    n = 20_000
    got = frequencies(Sampler(temperature=temperature, top_k=0, top_p=1.0, seed=123), logits, n)
    # 5 standard errors per token: a wrong distribution fails, sampling noise does not
    assert np.all(np.abs(got - want) <= 5 * np.sqrt(want * (1 - want) / n) + 1e-9)


def test_draws_within_top_k_follow_renormalised_softmax():
    logits = np.random.default_rng(5).standard_normal(200).astype(np.float32)
    top = np.argsort(logits)[-4:]
    want = np.zeros(200)
    want[top] = np.exp(logits[top]) / np.exp(logits[top]).sum()
    n = 20_000
    got = frequencies(Sampler(temperature=1.0, top_k=4, top_p=1.0, seed=9), logits, n)
    assert np.all(np.abs(got - want) <= 5 * np.sqrt(want * (1 - want) / n) + 1e-9)


def test_logprobs():
    logits = np.array([1.0, 2.0, 3.0, 0.5], dtype=np.float32)
    ref = logits - np.log(np.exp(logits.astype(np.float64)).sum())
    lp, top = logprobs(logits, 1, top_n=2)
    assert lp == pytest.approx(ref[1], abs=1e-6)
    assert [i for i, _ in top] == [2, 1]
    assert [v for _, v in top] == pytest.approx([ref[2], ref[1]], abs=1e-6)
    assert logprobs(logits, 0)[1] == []
    assert len(logprobs(logits, 0, top_n=10)[1]) == 4
    with pytest.raises(ValueError):
        logprobs(logits, 4)


@pytest.mark.parametrize("options", [
    dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=-0.1), dict(min_p=2.0),
    dict(typical_p=0.0), dict(repeat_penalty=0.0), dict(repeat_last_n=-2), dict(temperature=math.nan),
    dict(presence_penalty=math.inf), dict(logit_bias={-1: 1.0}), dict(logit_bias={0: math.nan}),
    dict(top_k=2.5),
])
def test_invalid_options_raise(options):
    with pytest.raises(ValueError, match="Sampler"):
        Sampler(**options)


def test_invalid_inputs_raise():
    s = Sampler(repeat_penalty=1.1)
    with pytest.raises(ValueError, match="1-D"):
        s.sample(np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="NaN"):
        s.sample(np.array([0.0, np.nan], dtype=np.float32))
    with pytest.raises(ValueError, match="history"):
        s.sample(np.zeros(4, dtype=np.float32), history=[7])


def test_the_one_pass_greedy_picks_what_the_full_chain_picks():
    """``Sampler._greedy`` (greedy, no penalty, only lowering biases) against ``_candidates``: ties,
    a banned argmax, lowered runners-up, every token banned, NaN."""
    rng = np.random.default_rng(3)
    for trial in range(200):
        logits = rng.integers(-3, 4, size=50).astype(np.float32)  # many ties
        banned = rng.choice(50, size=int(rng.integers(0, 5)), replace=False)
        bias = {int(t): (-math.inf if k % 2 else -float(rng.integers(0, 3))) for k, t in enumerate(banned)}
        sampler = Sampler(temperature=0, logit_bias=bias)
        assert sampler._plain_greedy
        assert sampler.sample(logits) == int(sampler._candidates(logits, [])[0]), (trial, bias)
    everything = Sampler(temperature=0, logit_bias={t: -math.inf for t in range(4)})
    with pytest.raises(ValueError, match="-inf"):
        everything.sample(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="NaN"):
        Sampler(temperature=0).sample(np.array([0.0, np.nan, 1.0], np.float32))
    assert not Sampler(temperature=0, logit_bias={1: 2.0})._plain_greedy  # a raised logit takes the full chain
    assert not Sampler(temperature=0, repeat_penalty=1.1)._plain_greedy


# ---- many sequences at once (sample_rows) ---------------------------------------------------------------
def _option_grid() -> list[dict]:
    """Every sampling option in combination (a seeded sample of the full product, plus each axis alone)."""
    import itertools

    axes = dict(temperature=[0.0, 0.7, 1.5], top_k=[0, 1, 5, 40, 100_000], top_p=[1.0, 0.9, 0.3],
                min_p=[0.0, 0.05], typical_p=[1.0, 0.7], repeat_penalty=[1.0, 1.3], presence_penalty=[0.0, 0.5],
                frequency_penalty=[0.0, 0.2], repeat_last_n=[64, -1, 0],
                logit_bias=[None, {3: -math.inf, 7: -2.0}, {5: 4.0, 2: -math.inf}])
    everything = [dict(zip(axes, combo, strict=True)) for combo in itertools.product(*axes.values())]
    picked = np.random.default_rng(11).choice(len(everything), size=300, replace=False)
    return [everything[i] for i in picked] + [{name: v} for name, values in axes.items() for v in values]


@pytest.mark.parametrize("vocab", [50, 600, 9000])
def test_batched_sampling_equals_each_sequence_alone(vocab):
    """sample_rows over a batch of every option combination gives each row the token its own Sampler
    (same seed) gives it alone, step after step (the generators advance alike); ties included."""
    from pyggml.sample import sample_rows

    options = _option_grid()
    rng = np.random.default_rng(vocab)
    batch = [Sampler(**o, seed=i) for i, o in enumerate(options)]
    alone = [Sampler(**o, seed=i) for i, o in enumerate(options)]
    histories = [rng.integers(0, vocab, size=int(rng.integers(0, 90))).tolist() for _ in options]
    for step in range(3):
        logits = (rng.standard_normal((len(options), vocab)) * 2).astype(np.float32)
        logits[::4] = np.round(logits[::4])  # many ties in every fourth row
        given = logits.copy()
        tokens, errors = sample_rows(batch, logits, histories)
        assert not errors
        assert np.array_equal(logits, given)  # penalties and bias were undone
        expected = [s.sample(logits[i], histories[i]) for i, s in enumerate(alone)]
        mismatched = [(options[i], int(t), e) for i, (t, e) in enumerate(zip(tokens, expected, strict=True)) if t != e]
        assert not mismatched, (step, mismatched[:3])
        for history, token in zip(histories, tokens.tolist(), strict=True):
            history.append(token)


def test_one_top_k_row_refuses_what_the_batch_refuses():
    """A single row sampled with top-k (its shortcut past ``sample_rows``) raises for NaN and +inf
    anywhere in the row, as the batch does, for a row of -inf, and for a bias that bans everything or
    names a token past the vocabulary."""
    row = np.random.default_rng(1).standard_normal(20_000).astype(np.float32)
    for bad, match in ((np.nan, "NaN"), (np.inf, r"\+inf")):
        broken = row.copy()
        broken[12_345] = bad
        with pytest.raises(ValueError, match=match):
            Sampler(temperature=0.8, top_k=40, top_p=0.9, seed=2).sample(broken)
    with pytest.raises(ValueError, match="-inf"):
        Sampler(temperature=0.8, top_k=40, seed=2).sample(np.full(20_000, -np.inf, np.float32))
    with pytest.raises(ValueError, match="-inf"):  # every token banned by the bias
        Sampler(top_k=3, logit_bias=dict.fromkeys(range(20), -math.inf), seed=2).sample(row[:20])
    with pytest.raises(ValueError, match="out of range"):
        Sampler(top_k=3, logit_bias={25: 1.0}, seed=2).sample(row[:20])
    given = row.copy()  # a biased draw leaves the caller's row as it was
    assert Sampler(top_k=3, logit_bias={7: 50.0}, temperature=0.1, seed=2).sample(row) == 7
    assert np.array_equal(row, given)


def test_batched_sampling_fails_rows_alone():
    """A row that cannot be sampled (NaN, everything banned, +inf, a bias past the vocabulary) gets its
    error; the other rows are sampled as usual."""
    from pyggml.sample import sample_rows

    logits = np.random.default_rng(0).standard_normal((6, 20)).astype(np.float32)
    logits[1, 4] = np.nan
    logits[3, 2] = np.inf
    ban_all = {t: -math.inf for t in range(20)}
    samplers = [Sampler(temperature=0), Sampler(seed=1), Sampler(temperature=0, logit_bias=ban_all), Sampler(seed=3),
                Sampler(temperature=0, logit_bias={25: 1.0}), Sampler(temperature=0)]
    tokens, errors = sample_rows(samplers, logits)
    assert set(errors) == {1, 2, 3, 4}
    assert "NaN" in str(errors[1]) and "-inf" in str(errors[2]) and "+inf" in str(errors[3])
    assert "out of range" in str(errors[4])
    assert tokens.tolist()[0] == int(np.argmax(logits[0])) and tokens[5] == int(np.argmax(logits[5]))
    assert tokens[1] == tokens[2] == tokens[3] == tokens[4] == -1


def test_sampling_from_the_k_largest_equals_sampling_from_all():
    """sample_top (a sampling head's K largest logits per row, in any order) gives the tokens sample_rows
    gives from the full rows; rows it cannot decide (a tie at the K-th value, NaN/inf) are handed back."""
    from pyggml.sample import sample_rows, sample_top

    rng = np.random.default_rng(21)
    options = [dict(temperature=0.0), dict(), dict(temperature=1.5, top_k=5, min_p=0.05), dict(top_k=63, top_p=1.0),
               dict(temperature=0.9, top_k=40, top_p=0.5), dict(temperature=0.7, top_k=1)]
    n, vocab, k = 60, 3000, 64
    logits = (rng.standard_normal((n, vocab)) * 2).astype(np.float32)
    logits[7] = np.round(logits[7])  # ties at the K-th value: must be handed back
    logits[9, 11] = np.nan
    for row in (13, 19, 25):  # two equal maxima in a drawn row: drawn in id order, the lower id first
        logits[row, [40, 30]] = logits[row].max() + 0.5
    finite = np.isfinite(logits.sum(axis=1))
    ids = np.argpartition(logits, vocab - k, axis=1)[:, -k:]
    ids = rng.permuted(ids, axis=1)  # a device's order is its own
    vals = np.take_along_axis(logits, ids, axis=1)
    pick = [options[i % len(options)] for i in range(n)]
    samplers = [Sampler(**o, seed=i) for i, o in enumerate(pick)]
    top_tokens, redo = sample_top(samplers, ids, vals, finite, vocab)
    full_tokens, errors = sample_rows([Sampler(**o, seed=i) for i, o in enumerate(pick)], logits)
    assert 7 in redo and 9 in redo and 9 in errors
    # a row handed back drew nothing from its generator (the runner samples it from its full row next)
    assert pick[7].get("temperature", 0.8) > 0 and samplers[7].uniform() == Sampler(**pick[7], seed=7).uniform()
    decided = [i for i in range(n) if i not in redo]
    assert len(decided) >= n - 3
    assert top_tokens[decided].tolist() == full_tokens[decided].tolist()
    assert all(Sampler(**o).fits_top(k) for o in options)
    assert not Sampler(top_k=0).fits_top(k) and not Sampler(repeat_penalty=1.1).fits_top(k)
    assert not Sampler(logit_bias={1: 1.0}).fits_top(k) and not Sampler(top_k=64).fits_top(k)


def test_greedy_from_the_k_largest_is_the_argmax():
    """All-greedy rows take sample_top's short path: the argmax (lowest id among equal maxima) of the full
    row; a row whose K values are all equal (the maximum may hide outside them) is handed back."""
    from pyggml.sample import sample_top

    rng = np.random.default_rng(5)
    logits = np.round(rng.standard_normal((40, 500)) * 2, 1).astype(np.float32)  # equal values
    logits[:, 17] = logits.max(axis=1)  # every row's maximum at least twice
    logits[3] = 1.0
    ids = rng.permuted(np.argpartition(logits, 500 - 16, axis=1)[:, -16:], axis=1)
    vals = np.take_along_axis(logits, ids, axis=1)
    tokens, redo = sample_top([Sampler(temperature=0) for _ in range(40)], ids, vals, np.ones(40, bool), 500)
    assert 3 in redo
    # the argmax is in the K whenever the K hold a value below the maximum (every maximum is then in)
    assert len(redo) < 5
    for i in range(40):
        if i not in redo:
            assert tokens[i] == int(np.argmax(logits[i])), i
    # distinct maxima (the one-pass path), then the same with one tied row and one non-finite row
    logits = rng.standard_normal((40, 500)).astype(np.float32)
    ids = rng.permuted(np.argpartition(logits, 500 - 16, axis=1)[:, -16:], axis=1)
    vals = np.take_along_axis(logits, ids, axis=1)
    tokens, redo = sample_top([Sampler(temperature=0) for _ in range(40)], ids, vals, np.ones(40, bool), 500)
    assert redo == [] and tokens.tolist() == np.argmax(logits, axis=1).tolist()
    logits[5, 300] = logits[5, 200] = logits[5].max() + 1  # a tie: the lower id
    logits[9, 0] = np.inf
    ids = rng.permuted(np.argpartition(logits, 500 - 16, axis=1)[:, -16:], axis=1)
    vals = np.take_along_axis(logits, ids, axis=1)
    finite = np.isfinite(logits.sum(axis=1))
    tokens, redo = sample_top([Sampler(temperature=0) for _ in range(40)], ids, vals, finite, 500)
    assert redo == [9] and tokens[5] == 200
    others = [i for i in range(40) if i != 9]
    assert tokens[others].tolist() == np.argmax(logits[others], axis=1).tolist()


def test_rows_sampled_by_a_plan_made_earlier_give_the_same_tokens():
    """sample_sequences with a plan_rows made when the step was packed (the runner makes it beside the
    step computing before) gives the tokens it gives without one: rows in logits order or not, full logits
    or a sampling head's K, a grammar's mask applied to a copy (the logits stay as they were)."""
    from types import SimpleNamespace

    from pyggml.runner.engine import TopLogits
    from pyggml.runner.sequence import plan_rows, sample_sequences

    class Forbid:  # a grammar that forbids one token
        def __init__(self, token):
            self.token = token

        def apply(self, row):
            row = row.copy()
            row[self.token] = -np.inf
            return row

    rng = np.random.default_rng(9)
    vocab, k = 300, 16
    logits = rng.standard_normal((6, vocab)).astype(np.float32)
    kept = logits.copy()
    ids = np.argpartition(logits, vocab - k, axis=1)[:, -k:]
    top = TopLogits(ids, np.take_along_axis(logits, ids, axis=1), np.ones(6, bool),
                    SimpleNamespace(logits=SimpleNamespace(shape=(vocab, 6), numpy=lambda: logits)))

    def seq(temperature, constraint=None):
        sampler = Sampler(temperature=temperature, top_k=8, seed=3)
        return SimpleNamespace(sampler=sampler, constraint=constraint, history=[], greedy=temperature <= 0,
                               top_need=0 if constraint is not None else sampler.top_need)

    greedy = [seq(0.0) for _ in range(6)]
    for rows in ([(i, greedy[i]) for i in range(6)], [(4, greedy[0]), (1, greedy[1]), (5, greedy[2])]):
        want = [int(np.argmax(logits[r])) for r, _ in rows]
        for scores in (logits, top):
            assert sample_sequences(rows, scores) == want
            assert sample_sequences(rows, scores, plan_rows(rows)) == want
    assert plan_rows(rows).top_need == 1 and plan_rows(rows).from_top(1)  # greedy: the largest logit decides
    best = int(np.argmax(logits[1]))
    masked = [(1, seq(0.0, Forbid(best))), (2, seq(0.0))]
    assert not plan_rows(masked).from_top(vocab)  # a grammar's row needs its full logits
    assert sample_sequences(masked, logits, plan_rows(masked))[0] == int(np.argsort(logits[1])[-2])
    np.testing.assert_array_equal(logits, kept)
    mixed = [(0, seq(0.8)), (1, seq(0.0)), (2, seq(1.2))]
    first = sample_sequences(mixed, logits)
    mixed = [(0, seq(0.8)), (1, seq(0.0)), (2, seq(1.2))]  # the same seeds again
    assert sample_sequences(mixed, logits, plan_rows(mixed)) == first
    assert plan_rows(mixed).top_need == 9 and not plan_rows(mixed).from_top(8)  # top-k 8 must see a 9th below


def test_uniform_is_the_generators_stream_one_by_one():
    """A sampler fetches its generator's numbers in blocks (``Sampler.uniform``): the same numbers in the same order
    as one call each, across refills, so a seed draws what it drew before."""
    sampler, generator = Sampler(seed=3), np.random.default_rng(3)
    assert [sampler.uniform() for _ in range(150)] == [float(generator.random()) for _ in range(150)]
