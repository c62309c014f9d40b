"""Continuous batching: many sequences share one model, one KV cache and every forward pass.

``Runner`` composes the engine's parts; each turn of its loop thread:

1. admits waiting requests into free cache slots (reusing cached prompt prefixes, ``InputCache``);
2. lets the step plug-ins act before the batch is packed (plugins.py: speculation queues drafts,
   context shift makes room in full slots, images are encoded);
3. has the ``Scheduler`` (scheduler.py) pack one batch of at most ``batch_size`` inputs (first one
   decode token per generating sequence, then pending prompt tokens) and the rows that need logits;
4. has the ``Engine`` (engine.py) build or refill its graph and compute it;
5. samples each sequence's row with its own Sampler (after the plug-ins' ``after_logits``: grammar
   masks, draft verification) and streams the text (``RunningSequence.accept``, sequence.py).

Build-ahead: with ``build_ahead=True`` (the default when a GPU computes; on a CPU, whose cores
all compute, a builder thread only competes with them and costs a thread hand-off per step: 856 vs
1,762 tokens/s on stories260K) the loop builds batch N+1's graph while batch N computes
in a worker thread (cffi releases the GIL around ggml's compute). Nothing in the KV bookkeeping of N+1 depends on N's
results: a sequence whose next token is still being computed gets a placeholder input, and its
id is written into N+1's token array after N is sampled, just before N+1 is launched (the same
scheme as Ollama's runner): all of N's ids in one write where N's rows map onto N+1's placeholders
(``scheduler.feed_rows``, made while N computes), so that N+1 launches before N's sequences take their
tokens (``_hand_out``; a row whose sequence stopped meanwhile is left out); one by one, through the
placeholders, when a row failed or a grammar must take its token first. When N+1 is built before N has
computed (a device slower than the host), the loop offers it to the worker (``_chain``): the worker samples
N itself, writes the ids and computes N+1 at once, with no thread hand-off between the two computes, and the
loop takes N's tokens from it.
A launch returns once the worker's compute runs natively: until then
the worker needs the GIL, and the loop's Python would keep it (up to Python's 5 ms switch interval,
or until the loop blocked: nothing overlapped). N+1 refills N's graph, whose inputs are written by
then: one graph computed again keeps ggml's allocation plan (two graphs in turn were planned anew
each step). The computations outside batches (a context shift re-rotating keys, an
image's vision graph) first wait for the batch in flight, so the tensors always see the bookkeeping's
order; a batch whose sampled sequences draft next (speculation) completes before the next is built.

Bursts: clients whose requests ended together send their next ones together, a millisecond or two
apart. With slots free the loop waits for such a burst (``arriving``, ``ARRIVAL_QUIET_S``, at most
``ARRIVAL_WAIT_S``) so that its prompts start in one step; started as soon as the first request is
in, the others would wait through that request's whole prompt step before theirs began (the time to
first token at 8 parallel clients: 1.2-1.3x llama-server's before, 0.85-0.91x after, docs/bench.md).
Not while a step of generating sequences computes (build-ahead): the device would wait for the build
(``_generating_in_flight``).

``LLM`` is this runner with one sequence; ``pyggml bench`` times the same ``Engine``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager

import numpy as np

from pyggml.input import Input, text_input
from pyggml.models import Model, ModelError, Pooling
from pyggml.runner.checkpoints import Checkpoints
from pyggml.runner.embedding import Embedder, EmbeddingsNotSupportedError, GenerationNotSupportedError
from pyggml.runner.engine import AUTO_HEAD_MIN_ROWS, SAMPLE_HEAD_K, Engine, Graph, TopLogits, reads_in_place
from pyggml.runner.images import Images
from pyggml.runner.inputcache import InputCache
from pyggml.runner.plugins import Constraints, ContextShift, StepPlugin
from pyggml.runner.scheduler import CLOSED, UNSET, Scheduler, Step, StepBatch, feed_rows
from pyggml.runner.sequence import (
    MAX_DRAFT,
    CompletionRequest,
    CompletionStream,
    RowPlan,
    RunningSequence,
    check_int,
    plan_rows,
    prepare,
    sample_sequences,
)
from pyggml.runner.speculative import Speculation
from pyggml.tensor import DType

log = logging.getLogger(__name__)
# what ``Runner._sample`` gives: a step's live rows (row, sequence), their tokens (or exceptions), its logits
Sampled = tuple[list[tuple[int, RunningSequence]], list[int | Exception], np.ndarray | TopLogits]

__all__ = ["ARRIVAL_QUIET_S", "ARRIVAL_WAIT_S", "MAX_DRAFT", "Runner", "RunnerClosedError"]

# With slots free, the loop builds a batch only once no request has arrived (and no sequence ended)
# for ARRIVAL_QUIET_S and none is being prepared (``Runner.arriving``), waiting at most ARRIVAL_WAIT_S:
# requests of a burst come a millisecond or two apart, and a prompt step takes 100 ms to seconds.
ARRIVAL_QUIET_S = 0.005
ARRIVAL_WAIT_S = 0.05


class RunnerClosedError(RuntimeError):
    """The runner was closed (or stopped on an internal error)."""


class _HandOver:
    """What the start of a compute the worker launched itself signals (``Runner._go_on``, as ``started``):
    that compute's start event, and the step sampled before it, handed to the runner thread only now: woken
    earlier, the runner thread's Python would take the GIL whenever this thread released it (every cffi
    call on the way into the compute) and hold it for its own work."""

    def __init__(self, started: threading.Event, done: Step, logits: np.ndarray | TopLogits | None):
        self._started, self._done, self._logits = started, done, logits

    def set(self) -> None:
        done, self._done = self._done, None
        if done is not None:
            done.future.set_result(self._logits)
        self._started.set()


class Runner:
    """Serves completions of ``parallel`` sequences at once, each with a context of ``num_ctx``
    tokens (the model's cache holds ``parallel * num_ctx``). ``completion`` may be called from
    any thread; one loop thread does all model work. With ``background=False`` there is no loop
    thread: the thread reading a completion's chunks runs the loop until the next chunk is there
    (``LLM``: one caller, no thread hand-off per token). An embedding model (``model.pooling`` set)
    serves ``embedding``/``embeddings`` instead, one forward pass at a time, with no KV cache; a
    model that only embeds refuses completions. One runner per model; close it before the model.
    ``device_sampling``: graphs end in a sampling head, and steps whose sequences all sample plainly
    read each row's K largest logits instead of every logit (``Engine``; the same tokens). Default:
    on when a GPU computes the model, for steps of at least ``AUTO_HEAD_MIN_ROWS`` rows (a CPU computes
    the head slower than numpy samples; on a GPU it gains nothing measurable for a few rows)."""

    def __init__(self, model: Model, parallel: int = 4, num_ctx: int = 4096, batch_size: int = 512,
                 cache_type: DType | str = DType.F16, multi_user_cache: bool = True, build_ahead: bool | None = None,
                 background: bool = True, draft: Model | None = None, draft_max: int = 8,
                 device_sampling: bool | None = None):
        parallel = self._check(model, parallel, num_ctx, batch_size)
        self.model, self.tokenizer = model, model.tokenizer
        self.parallel, self.num_ctx = parallel, num_ctx
        self.batch_size = min(batch_size, num_ctx)
        self.embedder = Embedder(model, num_ctx, batch_size) if model.pooling is not None else None
        auto = device_sampling is None  # on a GPU, for steps with many rows (AUTO_HEAD_MIN_ROWS)
        if auto:
            device_sampling = model.backend.has_gpu
        self.engine = Engine(model, keep=2, sample_head=SAMPLE_HEAD_K if device_sampling else 0,
                             head_min_rows=AUTO_HEAD_MIN_ROWS if auto else 1)
        # an image's inputs go in one batch (same_batch): one longer than batch_size gets a batch that
        # grows to hold it (as Ollama's runner does), up to max_batch, reserved below
        self.images = Images(self, model.vision) if model.generates and model.vision is not None else None
        self.image_run = self.images.run if self.images is not None else 0
        self.max_batch = self.batch_size + (self.image_run - 1 if self.image_run > self.batch_size else 0)
        if model.generates:
            model.cache.init(model.backend, DType.parse(cache_type), max_sequences=parallel, capacity=num_ctx,
                             max_batch=self.max_batch)
            self.input_cache = InputCache(parallel * num_ctx, parallel, multi_user_cache, model.cache,
                                          self.batch_size)
            in_place = self._reserve()
        else:  # embeddings only: no cache and nothing for the loop to do
            self.num_ctx, self.input_cache, in_place = self.embedder.num_ctx, None, False
            self.embedder.reserve()
        if build_ahead is None:  # a CPU computes with every core: building beside it gains nothing
            build_ahead = model.backend.has_gpu
        self.build_ahead = build_ahead and in_place
        self.scheduler = Scheduler(self.batch_size, self.num_ctx)
        self._cond = threading.Condition()
        self._waiting: deque[RunningSequence] = deque()
        self._arriving = 0  # requests being prepared (``arriving``) that have not reached _waiting yet
        self._last_arrival = 0.0  # time.monotonic() a request last entered or left ``arriving``, or a sequence ended
        self.active: list[RunningSequence] = []  # admitted sequences, in admission order
        self.prompt_lookups = 0  # of which draft by prompt lookup (read every step: no pass over them)
        self._closing = False
        self._in_flight: Step | None = None  # the batch computing in the worker (build-ahead)
        self._due: list[RunningSequence] = []  # sequences whose consumer waits for a notify (``_notify``)
        self._last_plan: tuple[list, RowPlan] | None = None  # (rows, their plan): ``_plan``
        self.speculation = Speculation(self, self._drafter(draft, draft_max, cache_type, batch_size), draft_max)
        # in hook order: masks are ready before drafts are verified; drafts queue before full slots shift
        self.plugins: list[StepPlugin] = [Constraints(), self.speculation, ContextShift(self),
                                          *([self.images] if self.images is not None else [])]
        if model.generates and not model.cache.rewinds:  # a recurrent state: prefix reuse needs checkpoints
            self.plugins.insert(0, Checkpoints(self))
        self._error: BaseException | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pyggml-compute") if self.build_ahead else None
        self._chain_lock = threading.Lock()  # a step's ``chain``: offered by this thread, taken by the worker
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._loop, name="pyggml-runner", daemon=True)
            self._thread.start()

    # ---- start-up -------------------------------------------------------------------------------
    @staticmethod
    def _check(model: Model, parallel: int, num_ctx: int, batch_size: int) -> int:
        """Refuse a model or sizes the runner cannot serve; returns ``parallel`` within the model's limit."""
        if model.tokenizer is None:
            raise ModelError("the model file has no tokenizer (tokenizer.ggml.* keys)")
        if model.generates and model.cache is None:
            raise ModelError("the model has no KV cache; the runner needs one")
        for name, value, low in (("parallel", parallel, 1), ("num_ctx", num_ctx, 2), ("batch_size", batch_size, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"Runner: {name} must be an int >= {low}, got {value!r}")
        if model.max_parallel is not None and parallel > model.max_parallel:
            log.info("the %s model serves %d sequence(s) at once; parallel %d lowered", model.architecture,
                     model.max_parallel, parallel)
            return model.max_parallel
        return parallel

    def _drafter(self, draft: Model | None, draft_max: int, cache_type: DType | str, batch_size: int) -> Runner | None:
        """Speculative decoding with a draft model: its own runner (one pass drafts for every sequence)."""
        if draft is None:
            return None
        check_int("draft_max", draft_max, 1, MAX_DRAFT)
        if draft.tokenizer is None or draft.tokenizer.vocab.tokens != self.model.tokenizer.vocab.tokens:
            raise ModelError("the draft model must have the same vocabulary as the model")
        return Runner(draft, parallel=self.parallel, num_ctx=self.num_ctx, batch_size=batch_size,
                      cache_type=cache_type, build_ahead=False, background=False)

    def _reserve(self) -> bool:
        """Allocate the KV cache and the compute memory of the largest batch (and, for a vision model,
        of its largest image graph) now, so running out of memory fails here rather than mid-request.
        Returns whether the model's graph reads the batch's token array in place (what build-ahead needs)."""
        n = self.max_batch
        try:
            embeddings = self.images.reserve() if self.images is not None else []
            try:
                return self.engine.reserve(StepBatch.largest(n, min(n, self.parallel), embeddings))
            except MemoryError as exc:
                raise MemoryError(f"not enough memory for {self.parallel} sequences of {self.num_ctx} tokens and "
                                  f"batches of {n}: lower parallel, num_ctx or batch_size ({exc})") from exc
        except BaseException:
            self.engine.close()  # the image graph it kept
            raise

    # ---- API ------------------------------------------------------------------------------------
    def completion(self, request: CompletionRequest) -> CompletionStream:
        """Queue a completion; iterate the result for its chunks (the last has ``done=True``)."""
        with self.arriving():
            seq = self._prepare(request)
            with self._cond:
                if self._closing:
                    raise RunnerClosedError(f"the runner is closed{f': {self._error}' if self._error else ''}")
                self._waiting.append(seq)
                self._cond.notify()
        return CompletionStream(seq, self._wake, None if self._thread is not None else self._pump)

    @contextmanager
    def arriving(self) -> Iterator[None]:
        """Mark a request on its way to ``completion`` (a server wraps its template rendering in
        this; ``completion`` marks its own tokenizing). A batch that would start new prompts while
        slots are free waits for such requests, and for a short quiet spell after the last one
        arrived (at most ``ARRIVAL_WAIT_S`` in all): a burst of requests then shares one prompt
        step, rather than the first to arrive starting a long step that the others, a few
        milliseconds behind, must wait through before theirs start."""
        with self._cond:
            self._arriving += 1
            self._last_arrival = time.monotonic()
        try:
            yield
        finally:
            with self._cond:
                self._arriving -= 1
                self._last_arrival = time.monotonic()  # in _waiting now (or refused)
                self._cond.notify()

    @property
    def generates(self) -> bool:
        """Whether the model generates text (``completion``); else it only embeds."""
        return self.model.generates

    def embedding(self, text: str, *, normalize: bool = True, truncate: bool = False) -> np.ndarray:
        """The embedding (hidden,) of ``text``, pooled as the model says; L2-normalised unless
        ``normalize=False``. A text longer than the context is an error unless ``truncate``."""
        return self.embeddings([text], normalize=normalize, truncate=truncate)[0]

    def embeddings(self, texts: Sequence[str], *, normalize: bool = True, truncate: bool = False,
                   pooling: Pooling | str | None = None) -> np.ndarray:
        """Embeddings (len(texts), hidden) of several texts, computed in as few passes as fit."""
        if self.embedder is None:
            raise EmbeddingsNotSupportedError(
                f"the {self.model.architecture or 'loaded'} model generates text and has no embedding output; "
                "embeddings need an embedding model such as BERT")
        if self._closing:
            raise RunnerClosedError(f"the runner is closed{f': {self._error}' if self._error else ''}")
        return self.embedder.embed(texts, normalize=normalize, truncate=truncate, pooling=pooling)

    def rerank(self, query: str, documents: Sequence[str], *, truncate: bool = False) -> tuple[np.ndarray, int]:
        """A reranker's relevance scores of ``documents`` to ``query`` and the tokens read (``Embedder.rerank``)."""
        if self.embedder is None:
            raise EmbeddingsNotSupportedError(
                f"the {self.model.architecture or 'loaded'} model generates text; reranking needs a reranker "
                "(a cross-encoder such as bge-reranker, or Qwen3-Reranker)")
        if self._closing:
            raise RunnerClosedError(f"the runner is closed{f': {self._error}' if self._error else ''}")
        return self.embedder.rerank(query, documents, truncate=truncate)

    @property
    def active_sequences(self) -> int:
        return len(self.active)

    @property
    def drafter(self) -> Runner | None:
        """Speculative decoding: the draft model's own runner, if one was given."""
        return self.speculation.drafter

    @property
    def draft_max(self) -> int:
        return self.speculation.draft_max

    def close(self) -> None:
        """Cancel what is running or waiting and stop the loop thread (the model stays open)."""
        with self._cond:
            closed, self._closing = self._closing, True
            self._cond.notify()
        if self._thread is None:
            if not closed:
                self._shut_down()
        elif self._thread is not threading.current_thread():
            self._thread.join()
        if self._pool is not None:
            self._pool.shutdown()
        for plugin in self.plugins:
            plugin.close()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _prepare(self, request: CompletionRequest) -> RunningSequence:
        """Validate a request (ValueError saying what is wrong) and tokenize its prompt."""
        if not self.model.generates:
            raise GenerationNotSupportedError(
                f"the {self.model.architecture or 'loaded'} model is an embedding model: it cannot generate "
                "text (ask it for embeddings instead)")
        seq = prepare(request, self.tokenizer, self.num_ctx, self._image_inputs)
        seq.due = self._due
        return seq

    def _image_inputs(self, prompt: str | Sequence[int], images: Sequence[bytes]) -> list[Input]:
        if self.images is None:
            raise ValueError(f"the {self.model.architecture or 'loaded'} model takes no images (it has no vision "
                             "part; a vision model, or its mmproj file, is needed)")
        return self.images.prompt_inputs(prompt, images)

    # ---- the loop -------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while self._iterate(block=True):
                pass
        except BaseException as exc:  # a bug: fail everything rather than hang the callers
            log.exception("runner loop stopped")
            self._error = exc
        finally:
            self._shut_down()

    def _pump(self) -> None:
        """Without a loop thread (``background=False``): one iteration on the caller's thread, which
        waits for its completion's next chunk."""
        try:
            if not self._iterate(block=False):
                self._shut_down()
        except BaseException as exc:
            log.exception("runner stopped")
            self._error = exc
            self._shut_down()

    def _iterate(self, block: bool) -> bool:
        """One turn of the loop: admit, let the plug-ins act, pack and build a batch, complete the one
        in flight, launch the new one. Returns False once closing. With ``block`` it waits for work;
        without, it returns at once when there is none."""
        admitted = self._next_requests(block)
        if admitted is None:
            self._notify()
            return False
        if admitted:  # admitting may copy a cached prefix, a compute on the cache: not beside the step in flight
            self.wait_in_flight()
        for seq in admitted:
            self._admit(seq)
        for plugin in self.plugins:
            plugin.before_build()
        step = self._build()
        done, self._in_flight = self._in_flight, None
        chained = step is not None and done is not None and self._chain(done, step)
        sampled = self._sample(done) if done is not None else None
        if done is not None and sampled is None and step is not None:  # ``done`` failed (``_reset``): so did
            self._discard(step)  # ``step``'s sequences, and the graph it refilled is dropped
            step = None
        if chained and step.future is not None:  # the worker sampled ``done`` and launched ``step`` itself
            for plugin in self.plugins:  # (its compute has begun, or is about to)
                plugin.launched(step)
            self._launched(step)
            taken = self._hand_out(sampled)
        else:
            early = step is None or not self._feed(step, done, sampled)
            taken = self._hand_out(sampled) if early else []  # (the placeholders give the launch its ids)
            if step is not None:
                self._launch(step)  # before ``done``'s tokens are detokenized and streamed: they run beside it
            if not early:
                taken = self._hand_out(sampled)  # the ids are in the batch already: the rest runs beside it too
        if done is not None:
            self._accept(done, taken)
        if step is None or done is not None:
            self._notify()
        return True

    def _next_requests(self, block: bool) -> list[RunningSequence] | None:
        """Wait for work (with ``block``), then take the waiting requests that fit the free slots;
        None once closing. Cancelled waiting requests end here."""
        with self._cond:
            while not (self._closing or self._waiting or self._in_flight or any(not s.paused for s in self.active)):
                if not block:
                    raise RuntimeError("internal error: a completion waits but the runner has nothing to do")
                if self._due:  # nothing more to compute: tell the consumers now
                    self._notify()
                    continue
                self._cond.wait()
            if block and len(self.active) + len(self._waiting) < self.parallel and not self._generating_in_flight():
                self._await_arrivals()
            closing = self._closing
            dropped = [s for s in self._waiting if s.cancelled]
            for seq in dropped:
                self._waiting.remove(seq)
            admitted = []
            while self._waiting and len(self.active) + len(admitted) < self.parallel and not closing:
                admitted.append(self._waiting.popleft())
        for seq in dropped:
            seq.finish("cancelled")
        return None if closing else admitted

    def _generating_in_flight(self) -> bool:
        """Whether a step computing now (build-ahead) samples tokens of sequences still going: then the loop
        builds the next step without waiting for arrivals (``_await_arrivals``), since the device would wait
        for the build instead once the step in flight ends (a device's step at many sequences takes a few ms,
        the wait up to ARRIVAL_QUIET_S or more); requests arriving meanwhile go into the next step built."""
        step = self._in_flight
        return step is not None and any(not seq.done for _, seq in step.rows)

    def _await_arrivals(self) -> None:
        """Slots are free and requests are arriving (or were, or a sequence just ended: its
        client's next request is usually a millisecond behind): let them in before building,
        so that a burst shares one prompt step (see ``arriving``). Called holding _cond."""
        deadline = time.monotonic() + ARRIVAL_WAIT_S
        while not self._closing and len(self.active) + len(self._waiting) < self.parallel:  # (a full burst: go)
            # a request still being prepared ARRIVAL_WAIT_S after it came holds nothing up any more
            quiet = self._last_arrival + (ARRIVAL_WAIT_S if self._arriving else ARRIVAL_QUIET_S)
            left = min(deadline, quiet) - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(left)

    def _notify(self) -> None:
        """Tell the consumers waiting for a notify (``CompletionStream.set_notify``) that chunks
        were queued: one call per sequence per step, made just before a batch computes (the
        compute releases the GIL, so the consumers' Python runs beside it rather than competing
        with the runner for the GIL while it builds the batch) or when the runner runs out of work."""
        due = self._due
        for seq in due:
            seq._notify_due = False
            notify = seq.notify
            if notify is not None:
                try:
                    notify()
                except Exception:  # a consumer's bug must not stop the runner
                    log.exception("a completion's notify failed")
        due.clear()

    def _shut_down(self) -> None:
        """Stop: wait for the batch in flight, drop the kept graphs, end every sequence."""
        self.wait_in_flight()  # let it finish before the model is touched again
        if self._pool is not None:  # and any step the worker launched itself (a chain cut short by an error)
            try:
                self._pool.submit(int).result()
            except RuntimeError:  # (the pool is shut down already)
                pass
        self._in_flight = None
        self.engine.close()
        with self._cond:
            self._closing = True
            stranded = list(self._waiting) + [s for s in self.active if not s.done]
            self._waiting.clear()
        for seq in stranded:
            if self._error is None:
                self.release(seq, "cancelled")
            else:
                self.release(seq, error=RunnerClosedError(f"the runner stopped: {self._error!r}"))
        self._notify()

    def _admit(self, seq: RunningSequence) -> None:
        seq.t_start = time.perf_counter()
        # a prompt_logits request needs every prompt position computed: it reuses no cached prefix
        slot, remaining = self.input_cache.load_cache_slot(seq.prompt, seq.request.cache_prompt and
                                                           seq.scores is None)
        seq.slot, seq.pending = slot, deque(remaining)
        seq.cached_tokens = len(seq.prompt) - len(remaining)
        seq.admitted.set()
        self.active.append(seq)
        self.prompt_lookups += bool(seq.prompt_lookup)
        self.scheduler.maybe_full = True  # (its slot may start full: a cached prefix of num_ctx inputs)

    # ---- one step -------------------------------------------------------------------------------
    @property
    def in_flight(self) -> Step | None:
        """The step computing in the worker (build-ahead), if any."""
        return self._in_flight

    def wait_in_flight(self) -> None:
        """Wait until the step in flight has computed (before computing anything else on the cache)."""
        if self._in_flight is not None:
            wait([self._in_flight.future])

    def complete_in_flight(self) -> None:
        """Wait for the step in flight, sample it and take its tokens."""
        if self._in_flight is not None:
            step, self._in_flight = self._in_flight, None
            self._complete(step)

    def _build(self) -> Step | None:
        """The scheduler's next step with its graph (built, or a kept one refilled); None when there
        is nothing to compute."""
        step = self.scheduler.schedule(self.active, self.build_ahead)
        for seq in step.cancelled:
            self.release(seq, "cancelled")
        if step.batch is None:
            return None
        busy = self._in_flight.graph if self._in_flight is not None else None
        try:  # (a step in flight has started: _launch waits for that)
            step.graph = self.engine.build(step.batch, busy, busy_started=True)
            if step.late and not reads_in_place(step.graph.ctx, step.ids):  # the start-up check did not hold
                self.build_ahead = False
                raise RuntimeError("the model copied the batch's token ids; build-ahead is now off")
            if len(step.rows) > 1 or step.graph.top is not None:  # (one row without a head needs none)
                step.plan = self._plan(step.rows)  # decided here, beside the compute in flight, not before its own
            if step.late and self._in_flight is not None:
                step.feed = feed_rows(step.late, self._in_flight.rows)
            step.read = step.reads_logits
            if step.read and step.graph.top is not None and not step.scored and not step.spec and \
                    step.plan.from_top(self.engine.sample_head):
                step.read = "top"  # the sampling head's K logits per row are all the step needs
        except Exception as exc:
            self.engine.drop(busy)
            self._discard(step, busy)
            self._fail_step(step, exc)
            return None
        return step

    def _plan(self, rows: list[tuple[int, RunningSequence]]) -> RowPlan:
        """``plan_rows(rows)``; the last step's plan again when its rows were the same (the usual decode step:
        a plan reads only each sequence's fixed sampling settings, and making one visits every sequence)."""
        last = self._last_plan
        if last is not None and last[0] == rows:  # (each pair compared: row ints by value, sequences by identity)
            return last[1]
        plan = plan_rows(rows)
        self._last_plan = (rows, plan)
        return plan

    def _launch(self, step: Step) -> None:
        """Compute ``step``: in the worker (build-ahead; sampled in the next turn), or now."""
        self._fill(step)
        for plugin in self.plugins:
            plugin.launched(step)
        if self.build_ahead:
            step.future, step.started = Future(), threading.Event()
            self._pool.submit(self._work, step, step.started)
            self._launched(step)
        else:
            self._notify()  # the consumers' threads run while this batch computes
            self._complete(step)
            if any(seq.done or seq.generated == 1 for seq in self._due):
                self._notify()  # a first token (time to first token) or an end (a free slot): now

    @staticmethod
    def _discard(step: Step, busy: Graph | None = None) -> None:
        """Never launch ``step`` (its build failed, or the batch before it did): close its graph unless
        kept or ``busy`` (computing)."""
        if step.graph is not None and not step.graph.kept and step.graph is not busy:
            step.graph.ctx.close()

    def _launched(self, step: Step) -> None:
        """``step`` computes in the worker: it is the step in flight once its native compute runs."""
        self._in_flight = step
        # until the worker's compute runs native code (without the GIL), Python here would hold the GIL
        # the worker needs to get there: the device would wait for this thread's next turn to block
        while not step.started.wait(0.5) and not step.future.done():  # (set even when the compute fails)
            pass
        self._notify()

    def _chain(self, done: Step, step: Step) -> bool:
        """Offer ``step`` to the worker computing ``done``: once ``done`` computed, the worker samples it,
        writes the ids into ``step`` and computes ``step`` at once (``_work``), rather than hand ``done`` to
        this thread and wait for ``step`` to come back (two thread hand-offs between the computes). Only
        for a ``step`` whose ids all come from ``done``'s rows (``feed``) after a ``done`` whose sampling
        needs no plug-in (no grammar masks, drafts or prompt rows). False when the worker is past ``done``."""
        if step.feed is None or done.scored or done.spec or done.masks is not None:
            return False
        with self._chain_lock:
            if done.chain is not None:  # CLOSED: the worker took ``done``'s result already
                return False
            done.chain = step
            return True

    def _work(self, step: Step, started: threading.Event | _HandOver) -> None:
        """The worker's task: compute ``step`` (its ``future`` gets the logits); then, while a step is chained
        to the one just computed (``_chain``), sample that one, write the ids and compute the chained one."""
        while step is not None:
            try:
                logits = self._compute(step, started)
            except BaseException as exc:
                with self._chain_lock:
                    step.chain = CLOSED
                step.future.set_exception(exc)
                return
            step, started = self._go_on(step, logits)

    def _go_on(self, step: Step, logits: np.ndarray | TopLogits | None) -> tuple[Step | None, _HandOver | None]:
        """``step`` computed in the worker: sample it and launch the step chained to it, if any and if its
        ids can come from ``step``'s rows (else the runner thread decides, from the tokens sampled here).
        Returns the chained step and what its compute's start signals, or (None, None)."""
        with self._chain_lock:
            chained, step.chain = step.chain, CLOSED
        try:
            if chained is not None:
                step.sampled = self._draw(step, logits)
                if self._feed(chained, step, step.sampled):
                    chained.future, chained.started = Future(), threading.Event()
                    return chained, _HandOver(chained.started, step, logits)
            step.future.set_result(logits)
        except BaseException as exc:  # (a bug: the runner thread fails the batch)
            step.future.set_exception(exc)
        return None, None

    def _fill(self, step: Step) -> None:
        """Write the ids sampled since the batch was built (unless ``_feed`` did). A sequence that failed
        meanwhile left its placeholder unset (-1 in its slot never matches a prompt): any valid id will do."""
        if not step.late or step.fed:
            return
        tokens = [inp.token for _, inp, _ in step.late]
        if UNSET in tokens and any(inp.token == UNSET and not seq.done for _, inp, seq in step.late):
            raise RuntimeError("internal error: a batch input has no token id")
        step.ids[[index for index, _, _ in step.late]] = np.maximum(tokens, 0)

    def _compute(self, step: Step, started: threading.Event | _HandOver | None = None) -> np.ndarray | None:
        """Compute ``step`` and read what its sampling needs; ``started`` (build-ahead) is set once the
        native compute begins, or when it fails before."""
        try:
            return self.engine.compute(step.graph, read=step.read, on_start=None if started is None else started.set)
        finally:
            if started is not None:
                started.set()

    def _complete(self, step: Step) -> None:
        """Wait for a batch, sample it and take its tokens."""
        self._accept(step, self._hand_out(self._sample(step)))

    def _sample(self, step: Step) -> Sampled | None:
        """Wait for a batch, let the plug-ins and then the samplers take its logits rows: its live rows
        (row, sequence), their tokens (an exception for a row that cannot be sampled) and its logits; None
        when the batch failed."""
        try:
            logits = step.future.result() if step.future is not None else self._compute(step)
        except Exception as exc:
            self._reset(exc)
            return None
        for row, seq in step.scored:
            seq.scores.append(logits[row].copy())
        for plugin in self.plugins:
            plugin.after_logits(step, logits)
        return step.sampled if step.sampled is not None else self._draw(step, logits)

    @staticmethod
    def _draw(step: Step, logits: np.ndarray | TopLogits) -> Sampled:
        """Sample ``step``'s live rows (``_sample``; for a chained step, the worker's)."""
        live = [item for item in step.rows if not item[1].done]
        plan = step.plan if len(live) == len(step.rows) else None  # (made for all its rows)
        return live, sample_sequences(live, logits, plan), logits

    @staticmethod
    def _feed(step: Step, done: Step | None, sampled: Sampled | None) -> bool:
        """Write the tokens sampled in ``done`` into the ids of ``step``'s placeholders in one pass
        (``step.feed``), so that it launches before the sequences hear of them; False when it cannot (no
        map, or a row failed): ``_hand_out`` fills the placeholders first. A row whose sequence ended after
        ``done`` was built (a stop string in the step before) was not sampled: a placeholder of its sequence
        (if any) gets id 0, as ``_fill`` gives one (any valid id will do)."""
        if step.feed is None or sampled is None:
            return False
        try:
            tokens = np.array(sampled[1], np.int32)
        except (TypeError, ValueError, OverflowError):  # an exception in place of a token
            return False
        if tokens.size != len(done.rows):  # (``_draw`` left out the rows whose sequence was done: those it kept)
            kept = {id(item) for item in sampled[0]}
            live = np.array([id(item) in kept for item in done.rows])
            aligned = np.zeros(live.size, np.int32)
            aligned[live] = tokens
            tokens = aligned
        index, rows = step.feed
        step.ids[index] = tokens[rows]
        step.fed = True
        return True

    def _hand_out(self, sampled: Sampled | None) -> list[tuple[RunningSequence, int, np.ndarray | None, bool]]:
        """Give each sampled row's token to its sequence's placeholder in the batch built ahead (if it
        has one), or fail the sequence. Returns the items of ``_take`` (sequence, token, logits row
        for logprobs, whether a placeholder took it) still to ``_accept``: a constrained sequence takes
        its token here, since the next batch's grammar masks start when it launches, which may be before
        ``_accept``."""
        if sampled is None:
            return []
        live, tokens, logits = sampled
        taken = []
        for (row, seq), token in zip(live, tokens, strict=True):
            if isinstance(token, Exception):
                self.release(seq, error=token)
                continue
            placeholder = seq.placeholder
            if placeholder is not None:
                placeholder.token, seq.placeholder = token, None
            item = (seq, token, logits[row] if seq.n_logprobs else None, placeholder is not None)
            if seq.constraint is not None:
                self._take([item])
            else:
                taken.append(item)
        return taken

    def _accept(self, step: Step, taken: list) -> None:
        """Each sequence takes its sampled token (detokenize, stop strings, stream); then the
        sequences ``step`` finished by length end. (Its rows stop counting as in flight here, after
        the launch: nothing between reads the count.)"""
        for _, seq in step.rows:
            seq.outputs_in_flight -= 1
        self._take(taken)
        for seq in step.finishing:
            if not seq.done:
                self.release(seq, "cancelled" if seq.cancelled else "length")

    def _take(self, taken: list[tuple[RunningSequence, int, np.ndarray | None, bool]]) -> None:
        """Each (sequence, token, logits row, placed) took ``token`` (from logits ``row``; ``placed``: into the
        placeholder of the batch built ahead, else it queues as the next input): stream it, or end the sequence.
        (One loop for a step's sequences: a call per sequence costs as much as what most of them do.)"""
        for seq, token, row, placed in taken:
            try:
                reason = "cancelled" if seq.cancelled else seq.accept(token, row)
            except Exception as exc:  # the grammar refused the token: a bug, fail this sequence only
                self.release(seq, error=exc)
                continue
            if reason:
                self.release(seq, reason)
            elif not placed:
                seq.pending.append(text_input(token))

    def _reset(self, exc: BaseException) -> None:
        """A batch failed: its keys and values are missing, and later prompts may share them: every
        slot starts over and every running sequence fails."""
        log.error("batch failed: %r", exc)
        self.engine.drop()
        for slot in self.input_cache.slots:
            slot.inputs = []
            self.model.cache.remove(slot.id, 0)
        for seq in list(self.active):
            self.release(seq, error=exc)

    def fail_sequence(self, seq: RunningSequence, exc: BaseException) -> None:
        """One sequence cannot go on (e.g. its image does not decode): it fails, its slot starts over."""
        log.warning("sequence failed: %r", exc)
        seq.slot.inputs = []
        self.model.cache.remove(seq.slot.id, 0)
        self.release(seq, error=exc)

    def _fail_step(self, step: Step, exc: BaseException) -> None:
        """A batch could not be built: its sequences fail and their slots start over."""
        log.error("batch could not be built: %r", exc)
        for seq in step.seqs + [seq for _, seq in step.rows]:
            if not seq.done:
                seq.slot.inputs = []
                self.model.cache.remove(seq.slot.id, 0)
                self.release(seq, error=exc)

    def release(self, seq: RunningSequence, reason: str = "", error: BaseException | None = None) -> None:
        """Finish a sequence and free its slot (what it computed stays cached for later prompts)."""
        if seq.slot is not None:
            seq.slot.in_use = False
        if seq in self.active:
            self.active.remove(seq)
            self.prompt_lookups -= bool(seq.prompt_lookup)
            self._last_arrival = time.monotonic()  # its client's next request is often on its way
        if error is not None:
            seq.fail(error)
        else:
            seq.finish(reason)

