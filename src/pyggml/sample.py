"""Choose the next token from a logits vector, vectorised with numpy over the whole vocabulary.

The chain is llama.cpp's default order: repetition penalties, logit bias, top-k,
typical, top-p, min-p, temperature, then a weighted draw. As in llama.cpp the
truncation steps see the distribution *before* temperature, so temperature only
reshapes what survives. Top-k uses ``np.argpartition`` (linear time), and nothing
loops over tokens in Python, so a 128k-vocabulary step stays well under 1 ms.
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
        # greedy without penalties, and a bias that only lowers logits: one argmax pass (``_greedy``)
        neutral = self.repeat_penalty == 1.0 and not self.presence_penalty and not self.frequency_penalty
        self._plain_greedy = self.temperature <= 0 and (neutral or self.repeat_last_n == 0) and \
            not np.any(self._bias_values > 0)
        self._bias_set = frozenset(self._bias_ids.tolist())
        self._bias_top = int(self._bias_ids.max()) if self._bias_ids.size else -1

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """Pick one token id from ``logits`` (shape ``(vocab,)``); ``history`` feeds the penalties."""
        if self._plain_greedy:
            token = self._greedy(logits)
            if token is not None:
                return token
        ids, vals = self._candidates(logits, history)
        if vals is None:
            return int(ids)
        cdf = np.cumsum(_softmax(vals / self.temperature))
        return int(ids[self._draw(cdf)])

    def distribution(self, logits: np.ndarray, history: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """(ids, probabilities) of what ``sample`` draws from (greedy: the argmax with probability 1).
        Speculative decoding's rejection sampling reads the target's probabilities here."""
        ids, vals = self._candidates(logits, history)
        if vals is None:
            return np.array([ids]), np.ones(1)
        return ids, _softmax((vals / self.temperature).astype(np.float64))

    def draw(self, probs: np.ndarray) -> int:
        """An index drawn from ``probs`` (non-negative weights) with this sampler's generator."""
        return self._draw(np.cumsum(probs))

    def uniform(self) -> float:
        return float(self._rng.random())

    def _draw(self, cdf: np.ndarray) -> int:
        i = int(np.searchsorted(cdf, self._rng.random() * cdf[-1], side="right"))
        if i == cdf.size:  # u * total rounded up to total: take the last token with weight
            i = int(np.searchsorted(cdf, cdf[-1]))
        return i

    def _greedy(self, logits: np.ndarray) -> int | None:
        """The argmax in one pass, exactly what ``_candidates`` picks when no penalty applies and no
        bias raises a logit (a lowered token other than the argmax cannot overtake it; argmax finds
        a NaN, which ``_as_logits`` refuses, as the maximum); None when the argmax is biased."""
        arr = np.asarray(logits)
        if arr.ndim != 1 or arr.size == 0 or (arr.dtype != np.float32 and arr.dtype != np.float64):
            return None  # the general path reports or converts it
        token = int(np.argmax(arr))
        top = arr[token]
        if np.isnan(top):
            raise ValueError("sample: logits contain NaN")
        if self._bias_top >= 0:
            _check(self._bias_top < arr.size, "logit_bias token id out of range for vocab", arr.size)
            if token in self._bias_set:
                return None
        if top == -math.inf:
            raise ValueError("sample: every token has logit -inf (all banned by logit_bias?)")
        if top == math.inf:
            raise ValueError("sample: logits contain +inf")
        return token

    def _candidates(self, logits: np.ndarray, history: Sequence[int]) -> tuple[Any, np.ndarray | None]:
        """The surviving (ids, logits) after penalties, bias and truncation; (argmax, None) when greedy."""
        given = _as_logits(logits)
        logits = self._penalise(given, history)
        if self._bias_ids.size:
            _check(self._bias_ids.max() < logits.size, "logit_bias token id out of range for vocab",
                   logits.size)
            if logits is given:  # never modify the caller's array
                logits = logits.copy()
            logits[self._bias_ids] += self._bias_values
        top = logits.max()
        if top == -math.inf:
            raise ValueError("sample: every token has logit -inf (all banned by logit_bias?)")
        if top == math.inf:
            raise ValueError("sample: logits contain +inf")
        if self.temperature <= 0:
            return int(np.argmax(logits)), None

        if 0 < self.top_k < logits.size:
            ids = _top_k(logits, self.top_k)
            vals = logits[ids]
        else:
            ids, vals = np.arange(logits.size), logits
        if self.typical_p < 1.0:
            ids, vals = _typical(ids, vals, self.typical_p)
        if self.top_p < 1.0:
            keep = _top_p(vals, self.top_p)
            ids, vals = ids[keep], vals[keep]
        if self.min_p > 0.0:  # p >= min_p * p_max, in logit space
            keep = vals >= vals.max() + math.log(self.min_p)
            ids, vals = ids[keep], vals[keep]
        return ids, vals

    def _penalise(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """llama.cpp's penalties: repeat (divide positive, multiply negative logits), then
        presence and frequency (subtract per distinct token / per occurrence)."""
        neutral = self.repeat_penalty == 1.0 and not self.presence_penalty and not self.frequency_penalty
        if neutral or self.repeat_last_n == 0 or len(history) == 0:
            return logits
        recent = history if self.repeat_last_n == -1 else history[-self.repeat_last_n:]
        ids, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
        if ids[0] < 0 or ids[-1] >= logits.size:
            raise ValueError(f"history holds token ids outside [0, {logits.size}): {ids[0]}..{ids[-1]}")
        out = logits.copy()
        seen = out[ids]
        seen = np.where(seen > 0, seen / self.repeat_penalty, seen * self.repeat_penalty)
        out[ids] = seen - counts * self.frequency_penalty - self.presence_penalty
        return out


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


def _top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """Ids of the ``k`` largest logits (in no particular order).

    The k-th largest value of a strided sample is a safe lower bound for the
    k-th largest logit (at least k logits reach it), so the exact argpartition
    runs only over the few logits above that bound: about 3x faster at 128k.
    """
    stride = logits.size // (64 * k)
    if stride < 2:
        return np.argpartition(logits, logits.size - k)[-k:]
    sample = logits[::stride]
    bound = np.partition(sample, sample.size - k)[sample.size - k]
    cand = np.flatnonzero(logits >= bound)
    return cand[np.argpartition(logits[cand], cand.size - k)[-k:]]


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
