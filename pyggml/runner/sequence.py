"""Requests and streamed chunks; one running sequence's sampling, detokenizing and stop logic; the
consumer's side of a completion (``CompletionStream``)."""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pyggml.constrain import Constraint
from pyggml.models import Input
from pyggml.runner.inputcache import InputCacheSlot
from pyggml.sample import Sampler, SamplingOptions, logprobs

MAX_LOGPROBS = 20


@dataclass
class CompletionRequest(SamplingOptions):
    """One completion, with the sampling options of ``SamplingOptions`` (keyword-only).
    ``max_tokens=-1`` generates until an end-of-generation token, a stop string or cancellation
    (shifting the context as needed); ``0`` only processes (and caches) the prompt. ``logprobs=n``
    reports each token's log-probability and the ``n`` most likely alternatives. ``num_keep``:
    prompt tokens kept at the start when the context shifts (-1: the whole prompt).
    ``prompt_logits=True`` evaluates the whole prompt (no cached prefix is reused) and returns the
    logits of every prompt position in the last chunk's ``prompt_logits`` (scoring, perplexity).
    ``format`` ("json" or a JSON schema dict) or ``grammar`` (a ``pyggml.constrain.Grammar``, or a
    Lark/GBNF string) constrains the output to match (see ``pyggml.constrain``); generation stops
    where the grammar ends. ``prompt_lookup=n`` decodes speculatively with drafts of up to ``n`` tokens
    looked up in the prompt and output so far (n-gram matches; same output, fewer model passes when
    the output repeats its input: summaries, edits, code).
    """

    prompt: str | Sequence[int]
    max_tokens: int = 128
    stop: str | Sequence[str] = ()
    logprobs: int = 0
    cache_prompt: bool = True
    num_keep: int = 4
    prompt_logits: bool = False
    format: Any = None
    grammar: Any = None
    prompt_lookup: int = 0

    def sampler(self) -> Sampler:
        return Sampler(**self.sampling_options())


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token, logprob), most likely first


@dataclass
class Timings:
    queued_seconds: float = 0.0  # waiting for a free sequence
    prompt_seconds: float = 0.0  # from admission to the first sampled token
    generate_seconds: float = 0.0  # from the first sampled token to the end


@dataclass
class CompletionChunk:
    """A piece of streamed output: ``text`` (always whole characters) and the token ids sampled
    since the previous chunk. The last chunk has ``done=True``, the finish reason and the counts:
    ``prompt_tokens`` (the whole prompt), ``cached_tokens`` (of which reused from the cache),
    ``generated_tokens`` (sampled, including an end-of-generation token)."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    done: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "cancelled"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    timings: Timings | None = None
    prompt_logits: np.ndarray | None = None  # (prompt tokens, vocab), for a prompt_logits request
    draft_tokens: int = 0  # speculative decoding: tokens drafted, and of those accepted
    accepted_tokens: int = 0


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index of the earliest stop string in ``text``, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def partial_stop(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class RunningSequence:
    """A request while the runner works on it. Only the runner's loop thread touches it, except
    ``cancelled`` (set by the consumer) and ``out`` (read by the consumer)."""

    def __init__(self, request: CompletionRequest, ids: list[int], tokenizer, stops: list[str], num_keep: int,
                 constraint: Constraint | None = None):
        self.request = request
        self.constraint = constraint  # the grammar the output must match
        self.prompt = [Input(token=t) for t in ids]
        self.history = list(ids)  # prompt + generated tokens, for the penalties
        self.sampler = request.sampler()
        self.tokenizer = tokenizer
        self.decoder = tokenizer.stream(skip_special=True, continuation=True)
        self.stops = stops
        self.num_keep = num_keep
        self.slot: InputCacheSlot | None = None
        self.pending: deque[Input] = deque()  # inputs still to put in a batch
        self.outputs_in_flight = 0  # outputs of this sequence in batches not yet sampled
        self.placeholder: Input | None = None  # an input in a built batch whose token the next sample gives
        self.generated = 0
        self.cached_tokens = 0
        self.cancelled = False
        self.done = False
        self.drafts: list[int] = []  # drafted tokens in the batch in flight (speculative decoding)
        self.draft_tokens = self.accepted_tokens = 0
        self.scores: list[np.ndarray] | None = [] if request.prompt_logits else None  # prompt rows' logits
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self.finished = threading.Event()
        self._text = ""  # decoded text held back (it may begin a stop string)
        self._tokens: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self.t_queued = time.perf_counter()
        self.t_start = self.t_first = 0.0

    @property
    def wants_logits(self) -> bool:
        """Whether another token will be sampled after the outputs already in flight."""
        limit = self.request.max_tokens
        return limit < 0 or self.generated + self.outputs_in_flight < limit

    def accept(self, token: int, logits: np.ndarray) -> str | None:
        """Take a sampled token: stream the text it completes; returns a finish reason or None."""
        if not self.generated:
            self.t_first = time.perf_counter()
        self.generated += 1
        if self.constraint is not None:
            self.constraint.consume(token)
        if self.tokenizer.is_eog(token):
            return "stop"
        self.history.append(token)
        self._tokens.append(token)
        if self.request.logprobs:
            lp, top = logprobs(logits, token, self.request.logprobs)
            self._logprobs.append(TokenLogprob(token, lp, top))
        self._text += self.decoder.feed(token)
        cut = find_stop(self._text, self.stops)
        if cut is not None:
            self._text = self._text[:cut]
            return "stop"
        if self.constraint is not None and self.constraint.stopped:  # the grammar is complete
            self._text += self.decoder.flush()
            return "stop"
        emit = len(self._text) - partial_stop(self._text, self.stops)
        if emit:
            self.out.put(self._chunk(self._text[:emit]))
            self._text = self._text[emit:]
        if 0 <= self.request.max_tokens <= self.generated:
            return "length"
        return None

    def finish(self, reason: str) -> None:
        """Send the held-back text and the final counts."""
        self.done = True
        if reason == "length":
            self._text += self.decoder.flush()
            cut = find_stop(self._text, self.stops)
            if cut is not None:
                self._text, reason = self._text[:cut], "stop"
        now = time.perf_counter()
        start = self.t_start or now
        first = self.t_first or now
        chunk = self._chunk(self._text)
        chunk.done, chunk.finish_reason = True, reason
        chunk.prompt_tokens, chunk.cached_tokens = len(self.prompt), self.cached_tokens
        chunk.generated_tokens = self.generated
        chunk.draft_tokens, chunk.accepted_tokens = self.draft_tokens, self.accepted_tokens
        if self.scores is not None and reason != "cancelled":
            chunk.prompt_logits = np.stack(self.scores) if self.scores else None
        chunk.timings = Timings(queued_seconds=start - self.t_queued, prompt_seconds=first - start,
                                generate_seconds=now - first)
        self._text = ""
        self.out.put(chunk)
        self.finished.set()

    def fail(self, error: BaseException) -> None:
        self.done = True
        self.out.put(error)
        self.finished.set()

    def _chunk(self, text: str) -> CompletionChunk:
        chunk = CompletionChunk(text=text, tokens=self._tokens,
                                logprobs=self._logprobs if self.request.logprobs else None)
        self._tokens, self._logprobs = [], []
        return chunk


class CompletionStream(Iterator[CompletionChunk]):
    """The chunks of one completion. ``close()``/``cancel()`` stop it and free its slot."""

    def __init__(self, seq: RunningSequence, wake: Callable[[], None], pump: Callable[[], None] | None = None):
        self._seq, self._wake, self._pump = seq, wake, pump  # pump: a runner without a loop thread
        self._over = False

    def __next__(self) -> CompletionChunk:
        if self._over:
            raise StopIteration
        if self._pump is not None:
            while self._seq.out.empty():
                self._pump()
        item = self._seq.out.get()
        if isinstance(item, BaseException):
            self._over = True
            raise item
        self._over = item.done
        return item

    def cancel(self) -> None:
        """Stop generating; the final chunk (finish_reason "cancelled") is still queued."""
        if not self._seq.finished.is_set():
            self._seq.cancelled = True
            self._wake()

    def close(self) -> None:
        """Cancel and end the iteration."""
        self.cancel()
        self._over = True

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the runner is done with this completion (its slot is free)."""
        return self._seq.finished.wait(timeout)

    def __enter__(self) -> CompletionStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.cancel()
