"""Speculative decoding: drafts and their verification.

A speculating sequence's decode step carries its last sampled token followed by up to
``draft_max`` drafted tokens, with a logits row at every position, so the target model checks the
whole draft in one batch. ``verify`` walks the rows: greedy keeps a draft token while it is the
argmax (the output is exactly what decoding one token at a time gives); sampling accepts draft
token ``d`` with the target's probability ``p(d)`` and on rejection draws from ``p`` without ``d``
(renormalised), which leaves the output distribution exactly ``p`` (the drafts here are
deterministic, so the usual ``min(1, p/q)`` rule with ``q(d) = 1`` is this). The first rejected
position gives the correction token, a fully accepted draft a bonus token from the last row; the
runner removes the rejected positions from the KV cache. A recurrent state cannot drop a tail: before
the verification batch its state is checkpointed (checkpoints.py), a rejection rolls it back there,
and the decode input and accepted drafts are computed again (in front of the correction token).

Drafts come from prompt lookup (``lookup_draft``: the continuation of the latest earlier
occurrence of the last n tokens of prompt + output; no second model), or from a draft model (greedy
drafts from its own runner, batched over the sequences). ``Speculation`` is the runner's step
plug-in: it queues the drafts before each batch is packed and verifies them after its logits.

Drafting needs the sampled token (and after a verified draft, the accepted length fixes the next
positions), so with build-ahead on the runner chooses per step: a batch with a speculating
sequence's row completes before the next batch is built; otherwise it builds ahead.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from pyggml.input import text_input
from pyggml.runner.plugins import StepPlugin
from pyggml.runner.sequence import CompletionRequest, RunningSequence
from pyggml.sample import Sampler

if TYPE_CHECKING:
    from pyggml.runner.runner import Runner
    from pyggml.runner.scheduler import Step

log = logging.getLogger(__name__)


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


class Speculation(StepPlugin):
    """Speculative decoding for the runner's sequences: those with ``prompt_lookup`` (n-gram drafts),
    or all of them when ``drafter`` (the draft model's own runner) is given. Before a batch is packed,
    each speculating sequence's drafted tokens go behind its decode input (the scheduler gives each a
    logits row); after the logits, ``_verify`` keeps the accepted prefix and the token after it and
    removes the rest from the cache."""

    def __init__(self, runner: Runner, drafter: Runner | None = None, draft_max: int = 8):
        self.runner, self.drafter, self.draft_max = runner, drafter, draft_max

    def before_build(self) -> None:
        r = self.runner
        if self.drafter is None and not r.prompt_lookups:
            return  # nothing drafts (nor has drafts: they are verified in the step they are computed)
        if r.in_flight is not None and self.drafts_after(r.in_flight):
            r.complete_in_flight()  # the next batch's drafts follow the tokens it samples
        self._draft_all()
        if not r.model.cache.rewinds:  # a recurrent state: keep where the drafts start, to roll back to
            drafting = [s for s in r.active if s.drafts and not s.outputs_in_flight]
            if drafting:
                r.wait_in_flight()  # the copy computes on the cache
            for seq in drafting:
                r.model.cache.checkpoint(seq.slot.id, len(seq.slot.inputs))

    def after_logits(self, step: Step, logits: np.ndarray | None) -> None:
        for first, seq in step.spec:
            self._verify(logits, first, seq)

    def close(self) -> None:
        if self.drafter is not None:
            self.drafter.close()

    def speculates(self, seq: RunningSequence) -> bool:
        """Whether ``seq`` drafts its next tokens (prompt lookup, or the runner's draft model)."""
        return not seq.done and not seq.cancelled and seq.scores is None and \
            bool(seq.request.prompt_lookup or self.drafter is not None)

    def drafts_after(self, step: Step) -> bool:
        """Whether a sequence sampled in ``step`` (in flight) drafts next. Its draft continues the
        token ``step`` samples, and after a verified draft even its positions depend on how much was
        accepted, so the next batch is built once ``step`` is done: the runner builds ahead only
        while no sampled sequence speculates (per step)."""
        return any(self.speculates(seq) for _, seq in (*step.rows, *step.spec))

    def _draft_all(self) -> None:
        """Queue drafted tokens behind each speculating sequence's decode input: from prompt lookup,
        or from the draft model (all sequences' drafts in one batched run of it)."""
        wanted = self._draft_lengths()
        streams = []
        for seq, k in wanted:
            if seq.request.prompt_lookup:
                drafts = lookup_draft(seq.history, k)
                # a shorter match is padded (the padding is rejected like any wrong guess): steps of one
                # shape reuse one graph instead of building one per draft length
                self._queue(seq, drafts + drafts[-1:] * (k - len(drafts)))
            elif len(seq.history) + k <= self.drafter.num_ctx and min(seq.history) >= 0:
                try:
                    streams.append((seq, self.drafter.completion(CompletionRequest(
                        prompt=seq.history, max_tokens=k, temperature=0.0, num_keep=0))))
                except Exception as exc:  # no draft this step; the target decodes on its own
                    log.warning("draft model refused a draft request: %r", exc)
        for seq, stream in streams:  # reading the first runs the draft model for all of them
            try:
                self._queue(seq, [t for chunk in stream for t in chunk.tokens])
            except Exception as exc:
                log.warning("draft model failed: %r", exc)

    def _draft_lengths(self) -> list[tuple[RunningSequence, int]]:
        """The sequences that draft this step, each with as many tokens as the batch (shared), the
        slot, ``max_tokens`` and the grammar leave room for."""
        r = self.runner
        seqs = [s for s in r.active if self.speculates(s) and len(s.pending) == 1 and s.generated
                and not s.outputs_in_flight]
        if not seqs:
            return []
        share = r.batch_size // len(seqs) - 1
        wanted = []
        for seq in seqs:
            k = min(seq.request.prompt_lookup or self.draft_max, share, r.num_ctx - len(seq.slot.inputs) - 1)
            if seq.request.max_tokens >= 0:
                k = min(k, seq.request.max_tokens - seq.generated - 1)
            if k > 0:
                wanted.append((seq, k))
        return wanted

    @staticmethod
    def _queue(seq: RunningSequence, drafts: list[int]) -> None:
        if drafts and seq.constraint is not None:  # the matcher is past the decode input: check the draft
            drafts = drafts[:seq.constraint.validate(drafts)]
        seq.drafts = drafts or ()
        seq.pending.extend(text_input(t) for t in drafts)

    def _verify(self, logits: np.ndarray, first: int, seq: RunningSequence) -> None:
        """Check a sequence's drafts against the target's rows ``first..first+len(drafts)``: keep the
        longest accepted prefix plus the token that follows it, and remove the rest from the cache."""
        drafts, seq.drafts = seq.drafts, ()
        seq.outputs_in_flight -= 1
        if seq.done:
            return
        slot = seq.slot
        base = len(slot.inputs) - len(drafts)  # position of the first drafted token
        seq.draft_tokens += len(drafts)
        accepted, reason, token = _accept_drafts(logits, first, seq, drafts)
        seq.accepted_tokens += accepted
        if accepted < len(drafts):  # the rejected positions leave the cache
            cache, keep = self.runner.model.cache, base + accepted
            at = cache.resumable(slot.id, keep)  # a recurrent state: the checkpoint before the drafts
            cache.remove(slot.id, at)
            seq.pending.extend(slot.inputs[at:keep])  # computed again, before the token that follows
            del slot.inputs[at:]
        if isinstance(reason, Exception):
            self.runner.release(seq, error=reason)
        elif reason:
            self.runner.release(seq, reason)
        else:  # the correction at the first rejected position, or the bonus token after a whole draft
            seq.pending.append(text_input(token))


def _accept_drafts(logits: np.ndarray, first: int, seq: RunningSequence,
                   drafts: list[int]) -> tuple[int, str | Exception | None, int | None]:
    """Walk the rows of ``seq``'s drafts: (drafts accepted, finish reason, error or None, the last
    token emitted). Each emitted token is taken by the sequence (``accept``)."""
    accepted, reason, token = 0, None, None
    biases = []  # the rows' grammar masks, computed beside the graph (plugins.Constraints)
    if seq.constraint is not None:
        biases, seq.constraint.draft_biases = seq.constraint.draft_biases, []
    try:
        for i in range(len(drafts) + 1):
            row = logits[first + i]
            bias = biases[i] if i < len(biases) else None
            scores = row if seq.constraint is None else seq.constraint.apply(row, bias)
            if i < len(drafts):
                token = verify_token(seq.sampler, scores, seq.history, drafts[i])
            else:
                token = seq.sampler.sample(scores, seq.history)
            reason = "cancelled" if seq.cancelled else seq.accept(token, row)
            if i < len(drafts) and token == drafts[i]:
                accepted += 1
                if reason:
                    break
                continue
            break
    except Exception as exc:
        reason = exc
    return accepted, reason, token
