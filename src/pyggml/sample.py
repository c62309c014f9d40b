"""Choose the next token from a logits vector, vectorised with numpy over the whole vocabulary.

The chain is llama.cpp's default order: repetition penalties, logit bias, top-k,
typical, top-p, min-p, temperature, then a weighted draw. As in llama.cpp the
truncation steps see the distribution *before* temperature, so temperature only
reshapes what survives. ``sample_rows`` samples the rows of many sequences together (a batch's
decode step) in a few array passes, and a single ``Sampler.sample`` is that with one row, so a
token never depends on which other sequences shared its step. Nothing loops over tokens in Python.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np


@dataclass(kw_only=True)
class SamplingOptions:
    """The sampling options of a request (``CompletionRequest`` has them too) and their defaults.

    ``temperature <= 0`` is greedy (argmax after penalties and bias). ``top_k=0``,
    ``top_p=1``, ``min_p=0`` and ``typical_p=1`` disable those filters.
    ``repeat_last_n`` is how many recent history tokens the penalties look at
    (0: none, -1: all). ``logit_bias`` maps token id to an additive bias
    (``-math.inf`` bans the token).
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.9
    min_p: float = 0.0
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    seed: int | None = None

    def sampling_options(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(SamplingOptions)}


_UNIFORMS_AT_ONCE = 64  # a sampler's generator draws this many numbers per call (``Sampler.uniform``)


@dataclass
class Sampler(SamplingOptions):
    """Sampling options (checked) plus a private random generator (seeded: reproducible draws)."""

    _rng: np.random.Generator = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        integer = (int, np.integer)
        _check(math.isfinite(self.temperature), "temperature must be a finite number", self.temperature)
        _check(isinstance(self.top_k, integer) and self.top_k >= 0, "top_k must be an int >= 0 (0: off)",
               self.top_k)
        _check(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", self.top_p)
        _check(0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]", self.min_p)
        _check(0.0 < self.typical_p <= 1.0, "typical_p must be in (0, 1]", self.typical_p)
        _check(math.isfinite(self.repeat_penalty) and self.repeat_penalty > 0,
               "repeat_penalty must be > 0 (1: off)", self.repeat_penalty)
        _check(isinstance(self.repeat_last_n, integer) and self.repeat_last_n >= -1,
               "repeat_last_n must be an int >= -1 (-1: whole history, 0: off)", self.repeat_last_n)
        for name in ("presence_penalty", "frequency_penalty"):
            _check(math.isfinite(getattr(self, name)), f"{name} must be finite", getattr(self, name))
        bias = dict(self.logit_bias or {})
        self._bias_ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
        self._bias_values = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
        _check(not np.any(self._bias_ids < 0), "logit_bias token ids must be >= 0", bias)
        _check(not np.any(np.isnan(self._bias_values)), "logit_bias values must not be NaN", bias)
        self._rng = np.random.default_rng(self.seed)
        self._uniforms: list[float] = []  # drawn from _rng ahead, _UNIFORMS_AT_ONCE at a time (``uniform``)
        self._next_uniform = 0
        neutral = self.repeat_penalty == 1.0 and not self.presence_penalty and not self.frequency_penalty
        self._penalises = not neutral and self.repeat_last_n != 0
        # greedy without penalties, and a bias that only lowers logits: the argmax of the logits as they are
        self._plain_greedy = self.temperature <= 0 and not self._penalises and not np.any(self._bias_values > 0)
        self._bias_top = int(self._bias_ids.max()) if self._bias_ids.size else -1
        self._bias_set = frozenset(self._bias_ids.tolist())
        # the fewest of a row's largest logits this sampler decides from (``fits_top``; read by the runner's
        # sampling plan); 0: it needs them all
        plain = not self._penalises and not self._bias_ids.size and self.typical_p >= 1.0
        self.top_need = 0 if not plain else 1 if self.temperature <= 0 else self.top_k + 1 if self.top_k > 0 else 0
        # a drawn top-k row with nothing but a bias to apply (``_draw_top_k``)
        self._top_k_alone = self.temperature > 0 and self.top_k > 0 and not self._penalises and self.typical_p >= 1.0

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """Pick one token id from ``logits`` (shape ``(vocab,)``); ``history`` feeds the penalties."""
        row = _as_row(logits)
        if self._plain_greedy:
            errors: dict[int, Exception] = {}
            token = self._argmax(row, errors)
            if errors:
                raise errors[0]
            if token is not None:
                return token
        elif self._top_k_alone and self.top_k < row.size and self._bias_top < row.size and row.flags.writeable:
            token = self._draw_top_k(row)  # the usual sampled row, without the batch's bookkeeping
            if token is not None:
                return token
        tokens, errors = sample_rows([self], row[None], [history])
        if errors:
            raise errors[0]
        return int(tokens[0])

    def distribution(self, logits: np.ndarray, history: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """(ids, probabilities) of what ``sample`` draws from (greedy: the argmax with probability 1).
        Speculative decoding's rejection sampling reads the target's probabilities here."""
        ids, vals = self._candidates(logits, history)
        if vals is None:
            return np.array([ids]), np.ones(1)
        return ids, _softmax((vals / self.temperature).astype(np.float64))

    def draw(self, probs: np.ndarray) -> int:
        """An index drawn from ``probs`` (non-negative weights) with this sampler's generator."""
        cdf = np.cumsum(probs)
        return int(_pick(cdf[None], np.array([self.uniform()]))[0])

    def uniform(self) -> float:
        """The next number in [0, 1) of this sampler's generator: fetched _UNIFORMS_AT_ONCE at a time, the same
        numbers in the same order as one call each (a sampled row per step costs one list read, not a call
        into the generator)."""
        i = self._next_uniform
        if i == len(self._uniforms):
            self._uniforms, i = self._rng.random(_UNIFORMS_AT_ONCE).tolist(), 0
        self._next_uniform = i + 1
        return self._uniforms[i]

    def _argmax(self, row: np.ndarray, errors: dict[int, Exception]) -> int | None:
        """A plain greedy row (``_plain_greedy``) in scalars: its argmax, None when a bias lowers it
        or names a token past the vocabulary (the full chain decides); an error for a NaN/inf top."""
        best = int(row.argmax())
        if self._bias_ids.size and (best in self._bias_set or self._bias_top >= row.size):
            return None
        top = float(row[best])
        if not math.isfinite(top):
            _check_tops(row[None], [0], errors, np.array([top]))
        return best

    def _draw_top_k(self, row: np.ndarray) -> int | None:
        """``sample_rows`` of one row for a top-k sampler without penalties or typical sampling: its
        bias written in (and undone), the same candidates, truncation and draw, in fewer calls. None
        when the row's largest logit is not finite (``sample_rows`` says why)."""
        biased = self._bias_ids
        if biased.size:
            old = row[biased]
            row[biased] = old + self._bias_values
        try:
            if not math.isfinite(row.max()):
                return None
            ids, vals = _top_k_rows(row[None], [0], self.top_k)
        finally:
            if biased.size:
                row[biased] = old
        n = _prefix_kept(self, vals[0])
        return int(ids[0, _draw_one(vals[0, :n], self.temperature, self.uniform())])

    def fits_top(self, k: int) -> bool:
        """Whether a row's K largest logits (``k``) are all this sampler needs (``sample_top``): no
        penalties, bias or typical sampling, and greedy or a top-k below ``k`` (the k-th value must be
        seen to be above the K-th, so that no equal logit hides outside the K)."""
        return 0 < self.top_need <= k

    def _candidates(self, logits: np.ndarray, history: Sequence[int]) -> tuple[Any, np.ndarray | None]:
        """The surviving (ids, logits) in drawing order after penalties, bias and truncation;
        (argmax, None) when greedy."""
        row = _as_logits(logits)[None].copy()  # adjusted in place
        errors: dict[int, Exception] = {}
        _adjust([self], row, [history], errors)
        if errors:
            raise errors[0]
        _check_tops(row, [0], errors)
        if errors:
            raise errors[0]
        if self.temperature <= 0:
            return int(np.argmax(row[0])), None
        pool = _pools([self], RowParams.of([self]), row, [0])[0]
        keep = slice(None) if pool.keep is None else pool.keep[0]
        ids = np.arange(row.shape[1]) if pool.ids is None else pool.ids[0]
        return ids[keep], pool.vals[0][keep]


_CACHED_LOGITS = 1 << 18  # logits per slice of rows in top-k (1 MiB of float32)


@dataclass
class _Pool:
    """Candidates of some sampled rows, in drawing order: ``vals`` (rows, width) with their token
    ``ids`` (None: the whole vocabulary in id order) and ``keep`` (None: all kept)."""

    rows: list[int]
    ids: np.ndarray | None
    vals: np.ndarray
    keep: np.ndarray | None
    n_keep: np.ndarray | None = None  # top-p/min-p of a sorted pool: how many lead entries are kept


@dataclass(frozen=True, eq=False)
class RowParams:
    """The settings of a batch's samplers as arrays, indexed like its rows: what drawing and truncating read
    for every row, gathered once (``of``) rather than in a Python pass per row and step (a runner's row plan
    keeps them while its rows stay the same)."""

    temperature: np.ndarray  # float32, the dtype the draw divides by
    top_k: np.ndarray
    top_p: np.ndarray  # float64: the mass bound is compared in float64
    min_p: np.ndarray
    typical: np.ndarray  # bool: typical_p < 1

    @classmethod
    def of(cls, samplers: Sequence[Sampler]) -> RowParams:
        return cls(np.array([s.temperature for s in samplers], np.float32), np.array([s.top_k for s in samplers]),
                   np.array([s.top_p for s in samplers], np.float64),
                   np.array([s.min_p for s in samplers], np.float64),
                   np.array([s.typical_p < 1.0 for s in samplers], bool))

    def rows(self, rows: list[int]) -> RowParams:
        """Those of ``rows`` (distinct, increasing): itself when they are all of them (the usual pool)."""
        if len(rows) == len(self.temperature):
            return self
        at = np.array(rows, np.intp)
        return RowParams(self.temperature[at], self.top_k[at], self.top_p[at], self.min_p[at], self.typical[at])


def sample_rows(samplers: Sequence[Sampler], logits: np.ndarray,
                histories: Sequence[Sequence[int]] | None = None) -> tuple[np.ndarray, dict[int, Exception]]:
    """One token per row of ``logits`` (rows, vocab), row i chosen by ``samplers[i]`` (distinct
    samplers) with the penalties of ``histories[i]``: the whole batch in a few array passes, and
    the same tokens as sampling each row alone (each sampler draws once from its generator).

    Candidates are ordered canonically (top-k, top-p: most likely first, ties by lower id; no
    truncation: id order), so a draw does not depend on how a selection algorithm happened to order
    them. Penalties and bias are applied in place and undone before returning (only the touched
    entries), so the caller's array is unchanged without copying it. Returns the tokens (-1 where a
    row failed) and the errors of failed rows by row index (NaN logits, every token banned, ...)."""
    n = len(samplers)
    if logits.ndim != 2 or logits.shape[0] != n or logits.shape[1] == 0:
        raise ValueError(f"sample_rows: logits must be ({n}, vocab), got shape {logits.shape}")
    if not logits.flags.writeable:  # penalties and bias are written into it (and undone)
        logits = logits.copy()
    histories = histories if histories is not None else [()] * n
    tokens = np.full(n, -1, np.int64)
    errors: dict[int, Exception] = {}
    rest = _plain_argmax(samplers, logits, tokens, errors)
    if not rest:
        return tokens, errors
    undo = _adjust(samplers, logits, histories, errors, rest)
    try:
        ok = [i for i in rest if i not in errors]
        greedy = [i for i in ok if samplers[i].temperature <= 0]
        if greedy:
            best = _rowwise(np.argmax, logits, greedy)
            tokens[greedy] = best
            _check_tops(logits, greedy, errors, logits[greedy, best])
        drawn = [i for i in ok if samplers[i].temperature > 0]
        maxima = None  # the drawn rows' group maxima, when their candidates come by groups (_top_k_groups)
        if drawn:
            if _by_groups(samplers, drawn, logits.shape[1]):  # one pass gives the groups' and the rows' maxima
                maxima = _group_maxima(_take(logits, drawn))
                _check_tops(logits, drawn, errors, maxima.max(axis=1))
            else:
                _check_tops(logits, drawn, errors)
            if errors:
                kept = [j for j, i in enumerate(drawn) if i not in errors]
                drawn = [drawn[j] for j in kept]
                maxima = maxima[kept] if maxima is not None else None
        params = RowParams.of(samplers) if drawn else None
        for pool in _pools(samplers, params, logits, drawn, maxima):
            _draw_pool(samplers, params, pool, tokens)
    finally:
        undo()
    if errors:
        tokens[list(errors)] = -1
    return tokens, errors


def sample_top(samplers: Sequence[Sampler], ids: np.ndarray, vals: np.ndarray, finite: np.ndarray,
               vocab: int, greedy: bool | None = None, params: RowParams | None = None) -> tuple[np.ndarray, list[int]]:
    """``sample_rows`` from each row's K largest logits only (``ids``, ``vals``: (rows, K), any
    order; ``finite``: whether the whole row is), for samplers that ``fits_top(K)``: the same tokens,
    as the candidates are the same once put in the canonical order. Rows it cannot decide get -1 and
    are listed for ``sample_rows`` on their full logits: a NaN or infinity in the row, or a tie at the
    K-th value that could hide an equal logit outside the K. ``greedy``: whether every sampler is
    (None: found here). ``params``: ``RowParams.of(samplers)``, if made already."""
    n, k_top = ids.shape
    if greedy is None:
        greedy = all(s.temperature <= 0 for s in samplers)
    if greedy:  # greedy: the largest value, the lowest id among equals
        # (found by argmax: numpy's max along rows as short as K costs three times as much)
        top = vals[np.arange(n), vals.argmax(axis=1)][:, None]
        largest = vals == top
        # the usual case, each row's largest value once (then, with K >= 2, below it lies the K-th): its
        # id, the one marked in its row (few numpy calls: each costs microseconds on caches a compute left cold)
        if k_top >= 2 and np.count_nonzero(largest) == n:
            tokens = ids[largest].astype(np.int64)  # (one per row, in row order)
            if finite.all():
                return tokens, []
            tokens[~finite] = -1
            return tokens, np.flatnonzero(~finite).tolist()
        tokens = np.where(largest, ids, vocab).min(axis=1).astype(np.int64)
        decided = finite & ((top[:, 0] > vals.min(axis=1)) | (k_top >= vocab))
        tokens[~decided] = -1
        return tokens, np.flatnonzero(~decided).tolist()
    ids, vals = _sorted_by_value_id(vals, ids)
    if params is None:
        params = RowParams.of(samplers)
    drawn, top_k = params.temperature > 0, params.top_k
    need = np.where(drawn, top_k, 1)
    decided = finite & ((vals[np.arange(n), need - 1] > vals[:, -1]) | (k_top >= vocab)) & \
        (need < vocab)  # a top-k of the whole vocabulary samples in id order (``_pools``)
    tokens = np.full(n, -1, np.int64)
    redo = np.flatnonzero(~decided).tolist()
    greedy = np.flatnonzero(decided & ~drawn)
    tokens[greedy] = ids[greedy, 0]
    drawn &= decided
    for k in np.unique(top_k[drawn]).tolist():  # (rows of one top-k go together; usually all of them)
        rows = np.flatnonzero(drawn & (top_k == k)).tolist()
        for pool in _truncate(samplers, params, _Pool(rows, ids[rows, :k], vals[rows, :k], None)):
            _draw_pool(samplers, params, pool, tokens)
    return tokens, redo


def _plain_argmax(samplers: Sequence[Sampler], logits: np.ndarray, tokens: np.ndarray,
                  errors: dict[int, Exception]) -> list[int]:
    """Greedy rows without penalties or raising biases: the argmax of the logits as they are, unless
    a bias lowers it (a lowered runner-up cannot overtake it) or names a token past the vocabulary.
    Returns the rows left to sample."""
    if len(samplers) == 1 and samplers[0]._plain_greedy:  # one row (P = 1): in scalars
        best = samplers[0]._argmax(logits[0], errors)
        if best is not None:
            tokens[0] = best
            return []
    plain = [i for i, s in enumerate(samplers) if s._plain_greedy]
    if not plain:
        return list(range(len(samplers)))
    best = _rowwise(np.argmax, logits, plain)
    redo = {i for i, b in zip(plain, best.tolist(), strict=True)
            if samplers[i]._bias_ids.size and (b in samplers[i]._bias_set or samplers[i]._bias_top >= logits.shape[1])}
    tokens[plain] = best
    if len(plain) == 1 and not redo:  # one row (``Sampler.sample``): Python scalars cost less than arrays
        top = float(logits[plain[0], best[0]])
        if not math.isfinite(top):
            _check_tops(logits, plain, errors, np.array([top]))
        return [i for i in range(len(samplers)) if i != plain[0]]
    if redo:
        keep = [j for j, i in enumerate(plain) if i not in redo]
        plain, best = [plain[j] for j in keep], best[keep]
    _check_tops(logits, plain, errors, logits[plain, best])
    done = set(plain)
    return [i for i in range(len(samplers)) if i not in done]


def _rowwise(fn, logits: np.ndarray, rows: list[int]) -> np.ndarray:
    """``fn(logits[rows], axis=1)`` without copying the rows out."""
    return fn(_take(logits, rows), axis=1)


def _take(logits: np.ndarray, rows: list[int]) -> np.ndarray:
    """``logits[rows]``: a view when the rows are consecutive (the usual case), else a copy."""
    if rows and rows[-1] - rows[0] == len(rows) - 1 and (len(rows) < 3 or rows == list(range(rows[0], rows[-1] + 1))):
        return logits[rows[0]:rows[-1] + 1]
    return logits[rows]


def _check_tops(logits: np.ndarray, rows: list[int], errors: dict[int, Exception],
                tops: np.ndarray | None = None) -> None:
    """Record an error for rows whose largest logit is NaN or infinite (``tops``: those values,
    when known; an argmax finds a NaN as the largest)."""
    if tops is None:
        tops = _rowwise(np.max, logits, rows)
    if np.isfinite(tops).all():
        return
    bad = ~np.isfinite(tops)
    for i, top in zip(np.asarray(rows)[bad].tolist(), tops[bad].tolist(), strict=True):
        if math.isnan(top):
            errors[i] = ValueError("sample: logits contain NaN")
        elif top < 0:
            errors[i] = ValueError("sample: every token has logit -inf (all banned by logit_bias?)")
        else:
            errors[i] = ValueError("sample: logits contain +inf")


def _adjust(samplers: Sequence[Sampler], logits: np.ndarray, histories: Sequence[Sequence[int]],
            errors: dict[int, Exception], rows: Sequence[int] | None = None):
    """llama.cpp's penalties (repeat: divide positive, multiply negative logits; then presence and
    frequency: subtract per distinct token / per occurrence) and the logit bias, written into
    ``logits`` for all ``rows`` at once; returns the function that restores the touched entries."""
    vocab = logits.shape[1]
    rows = range(len(samplers)) if rows is None else rows
    changes: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (rows, columns, original values)
    penalised = [i for i in rows if samplers[i]._penalises and len(histories[i])]
    recents = []
    for i in penalised:
        s, history = samplers[i], histories[i]
        recent = np.asarray(history if s.repeat_last_n == -1 else history[-s.repeat_last_n:], dtype=np.int64)
        if recent.min() < 0 or recent.max() >= vocab:
            errors[i] = ValueError(f"history holds token ids outside [0, {vocab}): {recent.min()}..{recent.max()}")
        recents.append(recent)
    biased = [i for i in rows if samplers[i]._bias_ids.size and i not in errors]
    for i in biased:
        if samplers[i]._bias_top >= vocab:
            errors[i] = ValueError(f"Sampler: logit_bias token id out of range for vocab, got {vocab!r}")
    kept = [(i, r) for i, r in zip(penalised, recents, strict=True) if i not in errors]
    if kept:
        rows = np.repeat([i for i, _ in kept], [r.size for _, r in kept])
        keys, counts = np.unique(rows * vocab + np.concatenate([r for _, r in kept]), return_counts=True)
        r, c = np.divmod(keys, vocab)
        old = logits[r, c]
        repeat = np.array([s.repeat_penalty for s in samplers], np.float32)[r]
        frequency = np.array([s.frequency_penalty for s in samplers])[r]
        presence = np.array([s.presence_penalty for s in samplers])[r]
        logits[r, c] = np.where(old > 0, old / repeat, old * repeat) - counts * frequency - presence
        changes.append((r, c, old))
    biased = [i for i in biased if i not in errors]
    if len(biased) == 1 and not kept:  # one row (P = 1): no arrays of rows to build
        i = biased[0]
        ids = samplers[i]._bias_ids
        old = logits[i, ids]
        logits[i, ids] = old + samplers[i]._bias_values

        def undo_one() -> None:
            logits[i, ids] = old
        return undo_one
    if biased:
        r = np.repeat(biased, [samplers[i]._bias_ids.size for i in biased])
        c = np.concatenate([samplers[i]._bias_ids for i in biased])
        old = logits[r, c]
        logits[r, c] = old + np.concatenate([samplers[i]._bias_values for i in biased])
        changes.append((r, c, old))

    def undo() -> None:
        for r, c, old in reversed(changes):
            logits[r, c] = old
    return undo


def _pools(samplers: Sequence[Sampler], params: RowParams, logits: np.ndarray, rows: list[int],
           maxima: np.ndarray | None = None) -> list[_Pool]:
    """The candidates of the sampled ``rows``: top-k rows of one k together (most likely first),
    untruncated rows together (id order), and rows with typical sampling, or top-p over the whole
    vocabulary, one by one. ``maxima``: the rows' group maxima (``_by_groups`` said they are one pool)."""
    vocab = logits.shape[1]
    by_k: dict[int, list[int]] = {}
    for i in rows:
        s = samplers[i]
        k = s.top_k if 0 < s.top_k < vocab else 0
        by_k.setdefault(k if k or (s.top_p >= 1.0 and s.typical_p >= 1.0) else -1, []).append(i)
    pools = []
    for k, group in by_k.items():
        if k > 0:
            ids, vals = _top_k_rows(logits, group, k) if maxima is None else _top_k_groups(_take(logits, group), k,
                                                                                           maxima)
            pools += _truncate(samplers, params, _Pool(group, ids, vals, None))
        elif k == 0:  # no truncation but min-p: the whole vocabulary in id order
            vals = _take(logits, group)
            min_p = params.min_p[group]
            keep = None
            if min_p.any():
                with np.errstate(divide="ignore"):
                    keep = vals >= (vals.max(axis=1) + np.log(min_p).astype(vals.dtype))[:, None]
            pools.append(_Pool(group, None, vals, keep))
        else:  # top-p or typical over the whole vocabulary: one row at a time
            for i in group:
                pools.append(_truncate_one(samplers[i], i, np.arange(vocab), logits[i]))
    return pools


def _top_k_rows(logits: np.ndarray, rows: list[int], k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, logits), each (len(rows), k): the k largest logits of each row, largest first, ties by
    lower id. Large vocabularies by groups (``_top_k_groups``); else rows go in slices that stay in the
    CPU's cache (each pass over the slice is then cheap)."""
    vocab = logits.shape[1]
    if _by_groups_pays(vocab, k, len(rows)):
        return _top_k_groups(_take(logits, rows), k)
    chunk = max(1, _CACHED_LOGITS // vocab)
    parts = [_top_k_slice(_take(logits, rows[i:i + chunk]), k) for i in range(0, len(rows), chunk)]
    if len(parts) == 1:
        return parts[0]
    return np.concatenate([ids for ids, _ in parts]), np.concatenate([vals for _, vals in parts])


def _top_k_slice(m: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``_top_k_rows`` of the rows of ``m``. The k-th largest value of a strided sample is a lower
    bound for the k-th largest logit (at least k logits reach it), so only the few logits above it
    are sorted."""
    n, vocab = m.shape
    stride = vocab // (64 * k)
    if n == 1 and stride < 2:  # one row of a small vocabulary (P = 1): fewer numpy calls
        c = np.argpartition(m[0], vocab - k)[vocab - k:]
        v = m[0, c]
        if np.count_nonzero(m[0] >= v.min()) == k:  # no logit outside equals the k-th: the set is canonical
            top = np.lexsort((c, -v))
            return c[top][None], v[top][None]
    if stride >= 2:
        sample = m[:, ::stride]
        bound = np.partition(sample, sample.shape[1] - k, axis=1)[:, sample.shape[1] - k]
    else:
        bound = np.partition(m, vocab - k, axis=1)[:, vocab - k]
    if n == 1:  # one row: its candidates, the k first in canonical order
        c = np.flatnonzero(m[0] >= bound[0])
        v = m[0, c]
        if c.size > k:  # sort only the k largest (a partition, then k entries), unless the k-th value has a twin
            kth = np.argpartition(v, c.size - k)[c.size - k:]
            if np.count_nonzero(v >= v[kth].min()) == k:
                c, v = c[kth], v[kth]
        top = _by_row_value_id(None, v, c, vocab)[:k]
        return c[top][None], v[top][None]
    r, c = np.divmod(np.flatnonzero(m >= bound[:, None]), vocab)  # by row, then id
    v = m[r, c]
    order = _by_row_value_id(r, v, c, vocab)
    r, c, v = r[order], c[order], v[order]
    rank = np.arange(r.size) - np.searchsorted(r, np.arange(n))[r]
    top = rank < k
    return c[top].reshape(n, k), v[top].reshape(n, k)


_GROUP_DEPTH = 64  # logits per group in ``_top_k_groups``
# a single row's top-k takes groups above this vocabulary (one row, strided bound vs groups: 32k 26 vs 45 us,
# 64k even, 128k 188 vs 59 us)
_GROUPS_FOR_ONE_ROW = 1 << 16


def _by_groups_pays(vocab: int, k: int, n_rows: int) -> bool:
    """Whether ``_top_k_rows`` takes the top-k of ``n_rows`` rows by groups (``_top_k_groups``)."""
    return vocab // _GROUP_DEPTH >= 4 * k and (n_rows > 1 or vocab > _GROUPS_FOR_ONE_ROW)


def _by_groups(samplers: Sequence[Sampler], rows: list[int], vocab: int) -> bool:
    """Whether ``_pools`` makes ``rows`` one top-k pool whose candidates come by groups (``_top_k_rows``)."""
    ks = {samplers[i].top_k for i in rows}
    k = ks.pop() if len(ks) == 1 else 0
    return 0 < k < vocab and _by_groups_pays(vocab, k, len(rows))


def _group_maxima(m: np.ndarray) -> np.ndarray:
    """Per row of ``m`` the maxima of its groups (``_top_k_groups``): (rows, groups), the last logits that
    fill no whole group being one more group at the end."""
    n, vocab = m.shape
    groups = vocab // _GROUP_DEPTH
    maxima = m[:, :groups * _GROUP_DEPTH].reshape(n, _GROUP_DEPTH, groups).max(axis=1)
    if vocab > groups * _GROUP_DEPTH:
        maxima = np.concatenate([maxima, m[:, groups * _GROUP_DEPTH:].max(axis=1, keepdims=True)], axis=1)
    return maxima


def _top_k_groups(m: np.ndarray, k: int, maxima: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``_top_k_rows`` of the rows of ``m`` (at least k groups of ``_GROUP_DEPTH`` logits each). Each row's
    logits j, j + g, j + 2 g, ... form group j: their maxima take one vectorised pass, and the k-th largest
    maximum bounds the k-th largest logit from below (k distinct logits reach it), so only the groups whose
    maximum reaches it are searched, and only their logits above it are sorted: a few k per row."""
    n, vocab = m.shape
    groups, depth = vocab // _GROUP_DEPTH, _GROUP_DEPTH
    body = m[:, :groups * depth].reshape(n, depth, groups)  # a view: row r's logit d * groups + j at [r, d, j]
    if maxima is None:
        maxima = _group_maxima(m)
    tail = vocab - groups * depth  # the last logits, a group of their own
    width = maxima.shape[1]
    bound = np.partition(maxima, width - k, axis=1)[:, width - k]
    r, g = np.divmod(np.flatnonzero(maxima >= bound[:, None]), width)  # flatnonzero: far faster than 2-d nonzero
    grouped = g < groups
    rg, gg = r[grouped], g[grouped]
    vals = body[rg, :, gg]  # (groups found, depth)
    found, d = np.divmod(np.flatnonzero(vals >= bound[rg, None]), depth)
    rows, ids, v = rg[found], d * groups + gg[found], vals[found, d]
    if tail:
        rt = r[~grouped]
        last = m[rt, groups * depth:]
        found, d = np.divmod(np.flatnonzero(last >= bound[rt, None]), tail)
        rows, ids = np.concatenate([rows, rt[found]]), np.concatenate([ids, groups * depth + d])
        v = np.concatenate([v, last[found, d]])
    by_id = np.lexsort((ids, rows))  # by row, then id: the order ``_by_row_value_id`` takes
    rows, ids, v = rows[by_id], ids[by_id], v[by_id]
    order = _by_row_value_id(rows, v, ids, vocab)
    rows, ids, v = rows[order], ids[order], v[order]
    rank = np.arange(rows.size) - np.searchsorted(rows, np.arange(n))[rows]
    top = rank < k
    return ids[top].reshape(n, k), v[top].reshape(n, k)


def _sorted_by_value_id(vals: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row of (rows, K) ``vals`` and their ``ids`` (ids in 0..2**31) ordered by value, largest first, then by
    id: (ids, vals). For float32 one sort of int64 keys per row (the value's bits made monotonic, then the id), each
    row's sort staying in the CPU's cache, and the sorted keys give back both (no gather by sorted index)."""
    if vals.dtype != np.float32:
        at = np.lexsort((ids, -vals), axis=-1)
        return np.take_along_axis(ids, at, axis=1), np.take_along_axis(vals, at, axis=1)
    bits = (vals + np.float32(0.0)).view(np.int32)  # + 0: -0.0 becomes 0.0, equal values equal bits
    monotonic = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).astype(np.int64)  # ordered like the floats
    keys = np.sort(((0x7FFFFFFF - monotonic) << 31) | ids, axis=1)  # (< 2**32 << 31: within int64)
    monotonic = (0x7FFFFFFF - (keys >> 31)).astype(np.int32)
    bits = monotonic ^ ((monotonic >> 31) & 0x7FFFFFFF)  # (the same transform undoes itself)
    return (keys & 0x7FFFFFFF).astype(ids.dtype), bits.view(np.float32)


def _by_row_value_id(r: np.ndarray | None, v: np.ndarray, c: np.ndarray, vocab: int) -> np.ndarray:
    """The order of entries (ids ``c`` ascending within a row) by row (None: all in one), then value
    (largest first), then id. For float32 one sort of unique int64 keys (row, the value's bits made
    monotonic, id); one row: a lexsort; else two stable sorts."""
    if r is None:
        return np.lexsort((c, -v))
    if v.dtype != np.float32 or vocab > 1 << 18 or r.size and r[-1] >= 1 << 13:
        order = np.argsort(-v, kind="stable")  # ids come in ascending order: stable keeps ties so
        return order[np.argsort(r[order], kind="stable")]
    bits = (v + np.float32(0.0)).view(np.int32)  # + 0: -0.0 becomes 0.0, equal values equal bits
    monotonic = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).astype(np.int64)  # ordered like the floats
    keys = ((0x7FFFFFFF - monotonic) << 18) | c
    if r is not None:
        keys |= r.astype(np.int64) << 50
    return np.argsort(keys)


def _truncate(samplers: Sequence[Sampler], params: RowParams, pool: _Pool) -> list[_Pool]:
    """Top-p and min-p on a pool of rows sorted most likely first (both keep a prefix); a row with
    typical sampling goes its own way."""
    singles, own = [], params.rows(pool.rows)
    if own.typical.any():
        typical = np.flatnonzero(own.typical).tolist()
        singles = [_truncate_one(samplers[pool.rows[j]], pool.rows[j], pool.ids[j], pool.vals[j]) for j in typical]
        rest = [j for j in range(len(pool.rows)) if j not in set(typical)]
        if not rest:
            return singles
        pool = _Pool([pool.rows[j] for j in rest], pool.ids[rest], pool.vals[rest], None)
        own = params.rows(pool.rows)
    vals = pool.vals
    width = vals.shape[1]
    if len(pool.rows) == 1:
        pool.n_keep = np.array([_prefix_kept(samplers[pool.rows[0]], vals[0])])
        return [pool, *singles]
    n_keep = None
    p = own.top_p
    if p.min() < 1.0:
        cum = np.cumsum(np.exp(vals - vals[:, :1]), axis=1)
        reach = np.minimum((cum < p[:, None] * cum[:, -1:]).sum(axis=1) + 1, width)
        n_keep = np.where(p < 1.0, reach, width)
    m = own.min_p
    if m.max() > 0.0:
        with np.errstate(divide="ignore"):
            above = (vals >= (vals[:, 0] + np.log(m).astype(vals.dtype))[:, None]).sum(axis=1)
        n_keep = np.where(m > 0, np.minimum(width if n_keep is None else n_keep, above), n_keep)
    if n_keep is not None:
        pool.keep, pool.n_keep = np.arange(width) < n_keep[:, None], n_keep
    return [pool, *singles]


def _prefix_kept(s: Sampler, vals: np.ndarray) -> int:
    """``_truncate`` of one sorted row in scalars: the same arithmetic (float32 sums, float64 mass
    bound, a float32 min-p threshold), fewer numpy calls."""
    n = vals.size
    if s.top_p < 1.0:
        cum = np.cumsum(np.exp(vals - vals[0]))
        n = min(int(np.count_nonzero(cum < np.float64(s.top_p) * np.float64(cum[-1]))) + 1, n)
    if s.min_p > 0.0:
        threshold = vals[0] + np.log(np.array([s.min_p])).astype(vals.dtype)[0]
        n = min(n, int(np.count_nonzero(vals >= threshold)))
    return n


def _truncate_one(s: Sampler, row: int, ids: np.ndarray, vals: np.ndarray) -> _Pool:
    """Typical, top-p and min-p for one row's candidates (any order)."""
    if s.typical_p < 1.0:
        ids, vals = _typical(ids, vals, s.typical_p)
    if s.top_p < 1.0:
        keep = _top_p(vals, s.top_p)
        ids, vals = ids[keep], vals[keep]
    if s.min_p > 0.0:  # p >= min_p * p_max, in logit space
        keep = vals >= vals.max() + math.log(s.min_p)
        ids, vals = ids[keep], vals[keep]
    return _Pool([row], ids[None], vals[None], None)


def _draw_pool(samplers: Sequence[Sampler], params: RowParams, pool: _Pool, tokens: np.ndarray) -> None:
    """Draw each row of ``pool`` (one uniform number from its sampler's generator) into ``tokens``."""
    if len(pool.rows) == 1 and (pool.keep is None or pool.n_keep is not None):
        s = samplers[pool.rows[0]]
        n = pool.vals.shape[1] if pool.n_keep is None else int(pool.n_keep[0])
        index = _draw_one(pool.vals[0, :n], s.temperature, s.uniform())
        tokens[pool.rows[0]] = index if pool.ids is None else pool.ids[0, index]
        return
    u = np.array([samplers[i].uniform() for i in pool.rows])
    index = _draw(pool.vals, pool.keep, params.rows(pool.rows).temperature, u)
    tokens[pool.rows] = index if pool.ids is None else pool.ids[np.arange(len(pool.rows)), index]


def _draw(vals: np.ndarray, keep: np.ndarray | None, temps: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Per row, the index drawn from softmax(vals / temperature) over the kept entries with the
    uniform number ``u``: cumulative weights summed in order, so a row's draw is the same in any
    batch (no normalisation, whose sum would depend on the width)."""
    scaled = vals / temps[:, None]
    if keep is not None:
        scaled = np.where(keep, scaled, -np.inf)
    top = scaled[np.arange(scaled.shape[0]), scaled.argmax(axis=1)]  # (the rows' maxima: cheaper than max)
    return _pick(np.cumsum(np.exp(scaled - top[:, None]), axis=1), u)


def _draw_one(vals: np.ndarray, temperature: float, u: float) -> int:
    """``_draw`` of one row's kept entries, in scalars (the same arithmetic: float32 weights summed in
    order, a float64 threshold)."""
    scaled = vals / np.float32(temperature)
    cdf = np.cumsum(np.exp(scaled - scaled.max()))
    total = np.float64(cdf[-1])
    index = int(np.count_nonzero(cdf <= np.float64(u) * total))
    return index if index < cdf.size else int(np.argmax(cdf >= total))


def _pick(cdf: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Per row, the first index whose cumulative weight exceeds u * total (u * total rounded up to
    the total: the first index that reaches it, which has weight)."""
    total = cdf[:, -1]
    index = (cdf <= (u * total)[:, None]).sum(axis=1)
    over = index >= cdf.shape[1]
    if over.any():
        index[over] = np.argmax(cdf[over] >= total[over, None], axis=1)
    return index


def logprobs(logits: np.ndarray, token: int, top_n: int = 0) -> tuple[float, list[tuple[int, float]]]:
    """Log-probability of ``token`` under softmax(logits), and the ``top_n`` most likely tokens.

    Uses the raw logits (no temperature or filters), as OpenAI-style logprobs do.
    """
    logits = _as_logits(logits)
    if not 0 <= token < logits.size:
        raise ValueError(f"logprobs: token {token} outside [0, {logits.size})")
    if top_n < 0:
        raise ValueError(f"logprobs: top_n must be >= 0, got {top_n}")
    m = float(logits.max())
    lse = m + math.log(float(np.sum(np.exp(logits - m), dtype=np.float64)))
    top: list[tuple[int, float]] = []
    if top_n:
        n = min(top_n, logits.size)
        best = np.argpartition(logits, logits.size - n)[-n:]
        best = best[np.argsort(-logits[best], kind="stable")]
        top = [(int(i), float(logits[i]) - lse) for i in best]
    return float(logits[token]) - lse, top


def _top_p(vals: np.ndarray, p: float) -> np.ndarray:
    """Indices (most likely first) of the smallest set of ``vals`` whose probability mass reaches p.

    Sorts only a top slice, growing it until it holds mass p, so a full-vocabulary
    nucleus costs a partition rather than a 128k sort when the mass is concentrated.
    """
    probs = _softmax(vals)
    k = min(64, probs.size)
    while True:
        top = np.argpartition(probs, probs.size - k)[-k:] if k < probs.size else np.arange(k)
        top = top[np.argsort(-probs[top], kind="stable")]
        cum = np.cumsum(probs[top])
        if cum[-1] >= p or k == probs.size:
            return top[: int(np.searchsorted(cum, p)) + 1]  # first prefix with mass >= p
        k = min(8 * k, probs.size)


def _typical(ids: np.ndarray, vals: np.ndarray, p: float) -> tuple[np.ndarray, np.ndarray]:
    """Locally typical sampling: keep tokens whose surprise is closest to the entropy, up to mass p."""
    probs = _softmax(vals)
    with np.errstate(divide="ignore"):
        logp = np.log(probs)
    entropy = -np.sum(probs * np.where(probs > 0, logp, 0.0))
    order = np.argsort(np.abs(-logp - entropy), kind="stable")
    cum = np.cumsum(probs[order])
    order = order[: int(np.searchsorted(cum, p, side="right")) + 1]  # first prefix with mass > p
    return ids[order], vals[order]


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _as_row(logits: np.ndarray) -> np.ndarray:
    """``logits`` as a 1-D float array (the NaN check is the sampler's)."""
    arr = np.asarray(logits)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"sample: logits must be a non-empty 1-D array (vocab,), got shape {arr.shape}")
    if arr.dtype != np.float32 and arr.dtype != np.float64:
        arr = arr.astype(np.float32)
    return arr


def _as_logits(logits: np.ndarray) -> np.ndarray:
    arr = np.asarray(logits)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"sample: logits must be a non-empty 1-D array (vocab,), got shape {arr.shape}")
    if arr.dtype != np.float32 and arr.dtype != np.float64:
        arr = arr.astype(np.float32)
    if np.isnan(arr.max()):  # max propagates NaN: one pass instead of two
        raise ValueError("sample: logits contain NaN")
    return arr


def _check(ok: bool, message: str, value: object) -> None:
    if not ok:
        raise ValueError(f"Sampler: {message}, got {value!r}")
