"""Requests and streamed chunks; a request checked and tokenized into a running sequence (``prepare``,
on the caller's thread); one running sequence's sampling, detokenizing and stop logic; the consumer's
side of a completion (``CompletionStream``)."""

from __future__ import annotations

import functools
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pyggml.constrain import Constraint, grammar_for
from pyggml.input import Input, text_input
from pyggml.runner.engine import TopLogits
from pyggml.runner.inputcache import InputCacheSlot
from pyggml.sample import RowParams, Sampler, SamplingOptions, logprobs, sample_rows, sample_top

MAX_LOGPROBS = 20
MAX_DRAFT = 32  # most tokens drafted per step (speculative decoding)
# Stop strings are checked on the runner's thread after every token of their sequence, so one
# request's list must not be able to slow the others: at most MAX_STOPS strings (OpenAI allows 4,
# Ollama clients send a handful) of at most MAX_STOP_CHARS characters each.
MAX_STOPS = 16
MAX_STOP_CHARS = 256


@dataclass
class CompletionRequest(SamplingOptions):
    """One completion, with the sampling options of ``SamplingOptions`` (keyword-only).
    ``max_tokens=-1`` generates until an end-of-generation token, a stop string or cancellation
    (shifting the context as needed); ``0`` only processes (and caches) the prompt. ``logprobs=n``
    reports each token's log-probability and the ``n`` most likely alternatives. ``num_keep``:
    prompt tokens kept at the start when the context shifts (-1: the whole prompt).
    ``images``: image files' bytes for a vision model; a string prompt marks where each goes with
    ``[img-N]`` (N from 0; without markers the images come first).
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
    images: Sequence[bytes] = ()
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
    stop_sequence: str | None = None  # the stop string that ended the output ("stop"), if one did
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    timings: Timings | None = None
    prompt_logits: np.ndarray | None = None  # (prompt tokens, vocab), for a prompt_logits request
    draft_tokens: int = 0  # speculative decoding: tokens drafted, and of those accepted
    accepted_tokens: int = 0

    @classmethod
    def streamed(cls, text: str, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> CompletionChunk:
        """A chunk with only ``text``, ``tokens`` and ``logprobs`` set: every other field reads its class
        default (a sequence makes one per step: three writes and a small instance, not fourteen)."""
        chunk = object.__new__(cls)
        chunk.text, chunk.tokens = text, tokens
        if logprobs is not None:
            chunk.logprobs = logprobs
        return chunk


def check_stops(stop: object) -> list[str]:
    """The stop strings of a request's ``stop`` (a string or a sequence of strings; empty ones
    dropped), or ValueError when it is not one or exceeds ``MAX_STOPS``/``MAX_STOP_CHARS``."""
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, Sequence) or not all(isinstance(s, str) for s in stops):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r:.80}")
    if len(stops) > MAX_STOPS:
        raise ValueError(f"{len(stops)} stop strings given; at most {MAX_STOPS} are allowed")
    long = next((s for s in stops if len(s) > MAX_STOP_CHARS), None)
    if long is not None:
        raise ValueError(f"a stop string of {len(long)} characters given; at most {MAX_STOP_CHARS} are allowed")
    return [s for s in stops if s]


ImageInputs = Callable[[str | Sequence[int], Sequence[bytes]], list[Input]]


def prepare(request: CompletionRequest, tokenizer, num_ctx: int, images: ImageInputs) -> RunningSequence:
    """The sequence of ``request`` for a runner whose slots hold ``num_ctx`` inputs; ``images`` turns
    a prompt with images into its inputs."""
    if not isinstance(request, CompletionRequest):
        raise TypeError(f"completion: expected a CompletionRequest, got {type(request).__name__}")
    ids = _prompt_ids(request.prompt, tokenizer)
    inputs = images(request.prompt, request.images) if request.images else [text_input(t) for t in ids]
    if len(inputs) > num_ctx:
        raise ValueError(f"prompt of {len(inputs)} tokens does not fit the context of {num_ctx} tokens "
                         "(raise num_ctx or shorten the prompt)")
    check_int("max_tokens", request.max_tokens, -1)
    check_int("num_keep", request.num_keep, -1)
    check_int("logprobs", request.logprobs, 0, MAX_LOGPROBS)
    check_int("prompt_lookup", request.prompt_lookup, 0, MAX_DRAFT)
    stops = check_stops(request.stop)
    _check_bias(request.logit_bias, tokenizer.vocab_size)
    if request.seed is not None:
        check_int("seed", request.seed, 0)
    num_keep = len(inputs) if request.num_keep < 0 else request.num_keep
    grammar = grammar_for(request.format, request.grammar)  # ConstraintError is a ValueError
    constraint = Constraint(grammar, tokenizer) if grammar is not None else None
    try:  # the Sampler checks the sampling options
        return RunningSequence(request, inputs, tokenizer, [s for s in stops if s], min(num_keep, num_ctx - 1),
                               constraint)
    except TypeError as exc:
        raise ValueError(f"bad sampling option: {exc}") from exc


def _prompt_ids(prompt: object, tokenizer) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("empty prompt")
        ids = tokenizer.encode(prompt, add_special=True)
    elif isinstance(prompt, Sequence) and all(isinstance(t, (int, np.integer)) for t in prompt):
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range 0..{tokenizer.vocab_size - 1}: {bad[:5]}")
    else:
        raise ValueError("prompt must be a string or a list of token ids")
    if not ids:
        raise ValueError("empty prompt")
    return ids


def _check_bias(logit_bias: object, vocab_size: int) -> None:
    bias = dict(logit_bias or {})
    if any(not isinstance(t, (int, np.integer)) or not 0 <= t < vocab_size for t in bias):
        raise ValueError(f"logit_bias keys must be token ids in 0..{vocab_size - 1}")
    if any(not isinstance(v, (int, float)) or math.isnan(v) for v in bias.values()):
        raise ValueError("logit_bias values must be numbers")


def check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low or \
            (high is not None and value > high):
        limits = f">= {low}" if high is None else f"in {low}..{high}"
        raise ValueError(f"{name} must be an int {limits}, got {value!r}")


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index of the earliest stop string in ``text``, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def partial_stop(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string.
    Only the places where a stop's first character occurs near the end are tried, so the cost is
    about the number of stops, not the product of their lengths."""
    best = 0
    for s in stops:
        end = len(text) - best  # suffixes longer than best and shorter than s
        i = text.find(s[0], max(len(text) - len(s) + 1, 0), end)
        while i >= 0:
            if s.startswith(text[i:]):
                best = len(text) - i
                break
            i = text.find(s[0], i + 1, end)
    return best


@functools.lru_cache(maxsize=64)
def _automaton(stops: tuple[str, ...]) -> tuple[list[dict[str, int]], list[int], list[tuple[int, ...]], list[int],
                                                 frozenset[str]]:
    """The Aho-Corasick tables of ``stops`` (goto, fail, the lengths of the stops ending at each state, each
    state's depth) and the stops' first characters; shared by every ``StopMatcher`` of these stops, which
    only read them."""
    goto: list[dict[str, int]] = [{}]
    fail, ends, depth = [0], [()], [0]
    for stop in stops:
        state = 0
        for ch in stop:
            nxt = goto[state].get(ch)
            if nxt is None:
                nxt = len(goto)
                goto[state][ch] = nxt
                goto.append({})
                fail.append(0)
                ends.append(())
                depth.append(depth[state] + 1)
            state = nxt
        ends[state] += (len(stop),)
    todo = deque(goto[0].values())
    while todo:  # breadth first: a state's fallback is shallower, so already linked
        state = todo.popleft()
        for ch, child in goto[state].items():
            f = fail[state]
            while f and ch not in goto[f]:
                f = fail[f]
            back = goto[f].get(ch, 0)
            fail[child] = back if back != child else 0
            ends[child] += ends[fail[child]]
            todo.append(child)
    return goto, fail, ends, depth, frozenset(goto[0])


class StopMatcher:
    """Finds stop strings in text fed a piece at a time (an Aho-Corasick automaton over the
    stops): each character costs the same however many and however long the stops are. Built
    in the caller's thread; ``feed`` runs on the runner's thread. Matchers of the same stops share
    one automaton (``_automaton``: requests of one chat template all stop at its strings), so a
    step's sequences read the same tables, not one copy each."""

    __slots__ = ("state", "starts", "_goto", "_fail", "_ends", "_depth")  # (state and starts: read every step)

    def __init__(self, stops: Sequence[str]):
        self._goto, self._fail, self._ends, self._depth, self.starts = _automaton(tuple(stops))
        self.state = 0  # 0: no stop string begun (``accept`` reads it, and ``starts``, before calling ``feed``)

    @property
    def partial(self) -> int:
        """Length of the longest suffix of the text fed so far that begins a stop string."""
        return self._depth[self.state]

    def feed(self, piece: str, offset: int = 0) -> int | None:
        """Feed the next ``piece`` of text, which starts at index ``offset`` of the caller's
        buffer; returns the buffer index where the earliest-starting stop ending in it starts."""
        if not self.state and self.starts.isdisjoint(piece):  # no stop can begin in it (the usual token)
            return None
        goto, fail, ends = self._goto, self._fail, self._ends
        state, cut = self.state, None
        for j, ch in enumerate(piece, offset):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            for n in ends[state]:
                if cut is None or j - n + 1 < cut:
                    cut = j - n + 1
        self.state = state
        return cut


class RunningSequence:
    """A request while the runner works on it. Only the runner's loop thread touches it, except
    ``cancelled`` and ``max_backlog`` (set by the consumer) and ``out`` (read by the consumer)."""

    # slots: the runner reads a dozen of these per sequence every step; more attributes than an instance
    # dict shares keys for (30) would make each read a hash lookup in a dict of its own. Those read every
    # step come first (they share a few cache lines)
    __slots__ = ("pending", "slot", "done", "cancelled", "outputs_in_flight", "placeholder", "generated",
                 "_max_tokens", "drafts", "scores", "max_backlog", "top_need", "sampler", "greedy", "constraint",
                 "n_logprobs", "prompt_lookup", "_eog", "history", "_unsent", "decoder", "matcher", "_text", "out",
                 "notify", "request", "prompt", "tokenizer", "stops", "num_keep", "admitted", "draft_tokens",
                 "accepted_tokens", "due", "finished", "_notify_due", "stop_sequence", "_logprobs", "t_queued",
                 "t_start", "t_first", "cached_tokens")

    def __init__(self, request: CompletionRequest, prompt: list[Input], tokenizer, stops: list[str], num_keep: int,
                 constraint: Constraint | None = None):
        self.request = request
        self.constraint = constraint  # the grammar the output must match
        self.prompt = prompt
        self.history = [inp.token for inp in prompt]  # prompt + generated tokens, for the penalties
        self.sampler = request.sampler()
        self.greedy = self.sampler.temperature <= 0  # (its sampler picks the largest logit)
        self.tokenizer = tokenizer
        # what ``accept`` and the runner read for every token, kept as attributes (not read through the request
        # or the sampler: fewer objects to visit per sequence and step)
        self._eog, self.n_logprobs, self._max_tokens = tokenizer.vocab.eog, request.logprobs, request.max_tokens
        self.prompt_lookup = request.prompt_lookup
        # the fewest of its row's largest logits that decide its next token (``sample_top``, a sampling head):
        # its sampler's ``top_need``; 0 (all of them) with a grammar or logprobs
        self.top_need = self.sampler.top_need if constraint is None and not self.n_logprobs else 0
        self.decoder = tokenizer.stream(skip_special=True, continuation=True)
        self.stops = stops
        self.matcher = StopMatcher(stops)
        self.num_keep = num_keep
        self.admitted = threading.Event()  # set once it has a slot (or is over)
        self.slot: InputCacheSlot | None = None  # given by the runner when it admits the sequence (``admit``)
        self.pending: deque[Input] = deque()  # inputs still to put in a batch
        self.outputs_in_flight = 0  # outputs of this sequence in batches not yet sampled
        self.placeholder: Input | None = None  # an input in a built batch whose token the next sample gives
        self.generated = 0
        self.cached_tokens = 0
        self.cancelled = False
        self.done = False
        # drafted tokens in the batch in flight (speculative decoding); () when none: one shared object, not a
        # list per sequence for every step to visit
        self.drafts: Sequence[int] = ()
        self.draft_tokens = self.accepted_tokens = 0
        self.scores: list[np.ndarray] | None = [] if request.prompt_logits else None  # prompt rows' logits
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self.max_backlog: int | None = None  # pause while this many chunks wait unread (None: never)
        # a consumer that does not block on ``out`` (the server's event loop) is told of new chunks by
        # ``notify()``; the runner calls it for the sequences in ``due``, once per step, just before it
        # starts computing the next batch (see ``Runner._notify``)
        self.notify: Callable[[], None] | None = None
        self.due: list[RunningSequence] | None = None  # the runner's list of sequences to notify
        self.finished = threading.Event()
        self._notify_due = False
        self._text = ""  # decoded text held back (it may begin a stop string)
        self.stop_sequence: str | None = None  # the stop string that ended the output
        self._unsent = 0  # generated tokens (the end of ``history``) no chunk has carried yet
        self._logprobs: list[TokenLogprob] = []
        self.t_queued = time.perf_counter()
        self.t_start = self.t_first = 0.0

    @property
    def paused(self) -> bool:
        """Whether its consumer has left ``max_backlog`` chunks unread: the runner generates no
        more for it until they are taken (back-pressure; a cancelled sequence is never paused)."""
        return self.max_backlog is not None and not self.cancelled and self.out.qsize() >= self.max_backlog

    @property
    def wants_logits(self) -> bool:
        """Whether another token will be sampled after the outputs already in flight."""
        limit = self._max_tokens
        return limit < 0 or self.generated + self.outputs_in_flight < limit

    def accept(self, token: int, logits: np.ndarray | None) -> str | None:
        """Take a sampled token: stream the text it completes; returns a finish reason or None.
        ``logits``: its row's logits (needed only for ``logprobs``). Every generating sequence
        comes here once per step: what most tokens need (no stop string begun, nothing held back)
        takes the fewest calls."""
        if not self.generated:
            self.t_first = time.perf_counter()
        self.generated += 1
        if self.constraint is not None:
            self.constraint.consume(token)
        if token in self._eog:
            return "stop"
        self.history.append(token)
        self._unsent += 1
        if self.n_logprobs:
            lp, top = logprobs(logits, token, self.n_logprobs)
            self._logprobs.append(TokenLogprob(token, lp, top))
        piece = self.decoder.feed(token)
        matcher = self.matcher
        if matcher.state or not matcher.starts.isdisjoint(piece):  # a stop string may begin or go on
            cut = matcher.feed(piece, len(self._text))
            self._text += piece
            if cut is not None:
                self._cut_at_stop(cut)
                return "stop"
        else:
            self._text += piece
        if self.constraint is not None and self.constraint.stopped:  # the grammar is complete
            piece = self.decoder.flush()
            cut = matcher.feed(piece, len(self._text))
            self._text += piece
            if cut is not None:
                self._cut_at_stop(cut)
            return "stop"
        text = self._text
        if text:
            if matcher.state:  # hold back what may begin a stop string
                emit = len(text) - matcher.partial
                if emit:
                    self._send(text[:emit])
                    self._text = text[emit:]
            else:
                self._send(text)
                self._text = ""
        if 0 <= self._max_tokens <= self.generated:
            return "length"
        return None

    def finish(self, reason: str) -> None:
        """Send the held-back text and the final counts."""
        self.done = True
        if reason == "length":
            piece = self.decoder.flush()
            cut = self.matcher.feed(piece, len(self._text))
            self._text += piece
            if cut is not None:
                self._cut_at_stop(cut)
                reason = "stop"
        now = time.perf_counter()
        start = self.t_start or now
        first = self.t_first or now
        tokens = self.history[-self._unsent:] if self._unsent else []
        chunk = CompletionChunk.streamed(self._text, tokens, self._logprobs if self.n_logprobs else None)
        chunk.done, chunk.finish_reason, chunk.stop_sequence = True, reason, self.stop_sequence
        chunk.prompt_tokens, chunk.cached_tokens = len(self.prompt), self.cached_tokens
        chunk.generated_tokens = self.generated
        chunk.draft_tokens, chunk.accepted_tokens = self.draft_tokens, self.accepted_tokens
        if self.scores is not None and reason != "cancelled":
            chunk.prompt_logits = np.stack(self.scores) if self.scores else None
        chunk.timings = Timings(queued_seconds=start - self.t_queued, prompt_seconds=first - start,
                                generate_seconds=now - first)
        self._text, self._unsent, self._logprobs = "", 0, []
        self.out.put(chunk)
        self.admitted.set()
        self.finished.set()
        self._due()

    def fail(self, error: BaseException) -> None:
        self.done = True
        self.out.put(error)
        self.admitted.set()
        self.finished.set()
        self._due()

    def _send(self, text: str) -> None:
        """Queue a chunk of ``text`` with the tokens (and logprobs) since the last one, and have its consumer
        told (``_due``) if it asked."""
        n_logprobs, unsent, self._unsent = self.n_logprobs, self._unsent, 0
        tokens = self.history[-unsent:] if unsent else []  # (the tokens generated since the last chunk)
        self.out.put(CompletionChunk.streamed(text, tokens, self._logprobs if n_logprobs else None))
        if n_logprobs:
            self._logprobs = []
        if self.notify is not None:
            self._due()

    def _due(self) -> None:
        """Queue a ``notify`` for the runner to send (a consumer set one and none is queued yet)."""
        if self.notify is not None and self.due is not None and not self._notify_due:
            self._notify_due = True
            self.due.append(self)

    def _cut_at_stop(self, cut: int) -> None:
        """Drop the held text from where a stop string begins (the matcher found one ending in it),
        remembering which stop it was (the first to end: the shortest there)."""
        self.stop_sequence = min((s for s in self.stops if self._text.startswith(s, cut)), key=len)
        self._text = self._text[:cut]


@dataclass(eq=False)
class RowPlan:
    """What sampling a step's rows needs that is known once the step is packed (``plan_rows``): where
    they lie in the logits (a slice when consecutive, the usual case), their samplers, whether all are
    greedy. The runner makes it beside the compute in flight; once that is done, the array passes are
    what is left to wait for."""

    pick: slice | list[int]
    samplers: list[Sampler]
    greedy: bool
    top_need: int  # the fewest largest logits per row that decide every row (0: some row needs them all)

    @functools.cached_property
    def params(self) -> RowParams:
        """Its samplers' settings as arrays (``RowParams``): made once, for every step of these rows."""
        return RowParams.of(self.samplers)

    def from_top(self, k: int) -> bool:
        """Whether a sampling head's ``k`` largest logits per row are all the rows need."""
        return 0 < self.top_need <= k


def plan_rows(rows: Sequence[tuple[int, RunningSequence]]) -> RowPlan:
    """The ``RowPlan`` of (logits row, sequence) pairs."""
    if not rows:
        return RowPlan(slice(0, 0), [], True, 0)
    index, seqs = zip(*rows, strict=True)
    first = index[0]
    consecutive = index == tuple(range(first, first + len(index)))
    needs = [seq.top_need for seq in seqs]
    return RowPlan(slice(first, first + len(index)) if consecutive else list(index), [seq.sampler for seq in seqs],
                   all([seq.greedy for seq in seqs]), max(needs) if min(needs) > 0 else 0)


def sample_sequences(rows: Sequence[tuple[int, RunningSequence]], logits: np.ndarray | TopLogits,
                     plan: RowPlan | None = None) -> list[int | Exception]:
    """The next token of each (logits row, sequence), all sampled together (``sample_rows``; from a
    sampling head's ``TopLogits``, ``sample_top``, reading the full logits only for rows it cannot
    decide); a sequence's grammar masks its row first. An entry is the exception instead for a
    sequence whose row cannot be sampled (the others go on). ``plan``: ``plan_rows(rows)``, made
    earlier."""
    if not rows:
        return []
    if len(rows) == 1 and not isinstance(logits, TopLogits):  # one sequence: no batch to build
        row, seq = rows[0]
        try:
            scores = logits[row] if seq.constraint is None else seq.constraint.apply(logits[row])
            return [seq.sampler.sample(scores, seq.history)]
        except Exception as exc:
            return [exc]
    if plan is None:
        plan = plan_rows(rows)
    pick = plan.pick
    if isinstance(logits, TopLogits):
        tokens, redo = sample_top(plan.samplers, logits.ids[pick], logits.vals[pick], logits.finite[pick],
                                  logits.vocab, greedy=plan.greedy, params=None if plan.greedy else plan.params)
        out: list[int | Exception] = tokens.tolist()
        if redo:
            for j, token in zip(redo, sample_sequences([rows[j] for j in redo], logits.full()), strict=True):
                out[j] = token
        return out
    constrained = [j for j, (_, seq) in enumerate(rows) if seq.constraint is not None]
    if isinstance(pick, slice) and not constrained:
        scores = logits[pick]  # a view: the sampler undoes what it writes
    else:  # a copy, which the grammars mask (a list of rows copies already)
        scores = logits[pick].copy() if isinstance(pick, slice) else logits[pick]
    failed: dict[int, Exception] = {}
    for j in constrained:
        try:
            scores[j] = rows[j][1].constraint.apply(scores[j])
        except Exception as exc:  # a grammar failure fails its sequence only
            failed[j] = exc
    tokens, errors = sample_rows(plan.samplers, scores, [seq.history for _, seq in rows])
    errors.update(failed)
    return [errors.get(j, token) for j, token in enumerate(tokens.tolist())]


class CompletionStream(Iterator[CompletionChunk]):
    """The chunks of one completion. ``close()``/``cancel()`` stop it and free its slot."""

    def __init__(self, seq: RunningSequence, wake: Callable[[], None], pump: Callable[[], None] | None = None):
        self._seq, self._wake, self._pump = seq, wake, pump  # pump: a runner without a loop thread
        self._out = seq.out  # (read for every chunk)
        self._over = False

    def __next__(self) -> CompletionChunk:
        if self._over:
            raise StopIteration
        if self._pump is not None:
            while self._out.empty():
                self._pump()
        return self._took(self._out.get())

    def poll(self) -> CompletionChunk | None:
        """The next chunk if one is there, else None (never blocks; raises the completion's error).
        For a consumer told of new chunks by ``set_notify`` rather than waiting in ``__next__``."""
        if self._over:
            raise StopIteration
        try:
            item = self._out.get_nowait()
        except queue.Empty:
            return None
        return self._took(item)

    def _took(self, item: CompletionChunk | BaseException) -> CompletionChunk:
        """A chunk just taken from the queue: resume a sequence paused on a full backlog, raise an error."""
        limit = self._seq.max_backlog
        if limit is not None and self._out.qsize() == limit - 1:  # it was paused: resume it
            self._wake()
        if isinstance(item, BaseException):
            self._over = True
            raise item
        self._over = item.done
        return item

    @property
    def backlog(self) -> int:
        """Chunks waiting unread (at ``max_backlog`` the sequence is paused)."""
        return self._out.qsize()

    def set_notify(self, notify: Callable[[], None] | None) -> None:
        """Have ``notify()`` called (on the runner's thread) after new chunks were queued: at most
        once per forward pass, just before the runner starts computing the next one (so the consumer
        works while the model computes, not while the runner builds the next batch), and when it
        runs out of work. It must be quick and must not call into the runner. Chunks already queued
        are not announced: call ``poll`` after setting it."""
        self._seq.notify = notify

    @property
    def finished(self) -> bool:
        """Whether the runner is done with this completion (its final chunk or error is queued)."""
        return self._seq.finished.is_set()

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

    def wait_admitted(self, timeout: float | None = None) -> bool:
        """Block until the completion has a sequence slot (or is over); False after ``timeout``
        seconds still waiting behind other requests."""
        return self._seq.admitted.wait(timeout)

    def set_max_backlog(self, chunks: int | None) -> None:
        """Back-pressure: pause generating while ``chunks`` chunks wait unread (None: never pause,
        the default). A paused completion keeps its slot but costs no compute."""
        if chunks is not None and (not isinstance(chunks, int) or chunks < 1):
            raise ValueError(f"max_backlog must be an int >= 1 or None, got {chunks!r}")
        self._seq.max_backlog = chunks
        self._wake()

    def __enter__(self) -> CompletionStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.cancel()
