"""Speculative decoding: drafts and their verification.

A speculating sequence's decode step carries its last sampled token followed by up to
``draft_max`` drafted tokens, with a logits row at every position, so the target model checks the
whole draft in one batch. ``verify`` walks the rows: greedy keeps a draft token while it is the
argmax (the output is exactly what decoding one token at a time gives); sampling accepts draft
token ``d`` with the target's probability ``p(d)`` and on rejection draws from ``p`` without ``d``
(renormalised), which leaves the output distribution exactly ``p`` (the drafts here are
deterministic, so the usual ``min(1, p/q)`` rule with ``q(d) = 1`` is this). The first rejected
position gives the correction token, a fully accepted draft a bonus token from the last row; the
runner removes the rejected positions from the KV cache.

Drafts come from prompt lookup (``lookup_draft``: the continuation of the latest earlier
occurrence of the last n tokens of prompt + output; no second model).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pyggml.sample import Sampler


def lookup_draft(history: Sequence[int], k: int, ngram_max: int = 3, ngram_min: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix
    (``ngram_max`` down to ``ngram_min`` tokens) of ``history``; [] when none recurs."""
    if k <= 0 or len(history) < 2:
        return []
    h = np.asarray(history, dtype=np.int64)
    n_all = h.size
    ends = np.flatnonzero(h[:-1] == h[-1])  # where an earlier match would end: the last token's earlier places
    for n in range(min(ngram_max, n_all - 1), ngram_min - 1, -1):
        hits = ends[ends >= n - 1]
        for j in range(1, n):  # the match's other tokens, checked on the few candidates left
            hits = hits[h[hits - j] == h[n_all - 1 - j]]
        if hits.size:
            start = int(hits[-1]) + 1
            return h[start:start + k].tolist()
    return []


def verify_token(sampler: Sampler, scores: np.ndarray, history: Sequence[int], draft: int) -> int:
    """The token the target emits at a position whose draft is ``draft``: ``draft`` itself when
    accepted, else a replacement drawn so that the output is distributed as ``sampler`` samples."""
    if sampler.temperature <= 0:
        return sampler.sample(scores, history)
    ids, probs = sampler.distribution(scores, history)
    where = np.flatnonzero(ids == draft)
    p_draft = float(probs[where[0]]) if where.size else 0.0
    if p_draft > 0 and sampler.uniform() < p_draft:
        return draft
    if where.size:
        probs = probs.copy()
        probs[where[0]] = 0.0
        if probs.sum() <= 0:
            return draft
    return int(ids[sampler.draw(probs)])
