"""Continuous batching: many sequences share one model, one KV cache and every forward pass.

A loop thread owns the model. Each step it admits waiting requests into free cache slots
(reusing cached prompt prefixes, see ``InputCache``), packs one batch of at most ``batch_size``
inputs (first one decode token per generating sequence, then pending prompt tokens), asks for
logits only where a token will be sampled (a sequence's last pending input), computes, and
samples each sequence with its own Sampler.

Build-ahead: with ``build_ahead=True`` (the default when a GPU computes; on a CPU, whose cores
all compute, a builder thread only competes with them and costs a thread hand-off per step: 856 vs
1,762 tokens/s on stories260K) the loop builds batch N+1's graph while batch N computes
in a worker thread (cffi releases the GIL around ggml's compute). Nothing in the KV bookkeeping of N+1 depends on N's
results: a sequence whose next token is still being computed gets a placeholder input, and its
id is written into N+1's token array after N is sampled, just before N+1 is launched (the same
scheme as Ollama's runner). The one compute outside batches, a context shift (re-rotating keys),
first waits for the batch in flight, so the tensors always see the bookkeeping's order.

Bursts: clients whose requests ended together send their next ones together, a millisecond or two
apart. With slots free the loop waits for such a burst (``arriving``, ``ARRIVAL_QUIET_S``, at most
``ARRIVAL_WAIT_S``) so that its prompts start in one step; started as soon as the first request is
in, the others would wait through that request's whole prompt step before theirs began (the time to
first token at 8 parallel clients: 1.2-1.3x llama-server's before, 0.85-0.91x after, docs/bench.md).

Graph reuse (``Engine``): decode steps repeat the same batch shape, so the engine keeps the last
two graphs (one may be in flight while the next is built) and refills one when the cache allows.

Speculative decoding (``speculative.py``): a sequence with ``prompt_lookup`` (n-gram drafts), or
every sequence of a runner given a ``draft`` model (greedy drafts of up to ``draft_max`` tokens from
its own runner, batched over the sequences), puts its drafted tokens behind its decode input with a
logits row at each; ``_verify`` keeps the accepted prefix and the token after it and removes the
rest from the cache. Drafting needs the sampled token (and after a verified draft, the accepted
length fixes the next positions), so with build-ahead on the runner chooses per step: a batch with a
speculating sequence's row completes before the next batch is built; otherwise it builds ahead.

``LLM`` is this runner with one sequence; ``pyggml bench`` times the same ``Engine``.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from pyggml.constrain import Constraint, grammar_for
from pyggml.models import Batch, Input, Model, ModelError, Multimodal, MultimodalIndex, Pooling
from pyggml.runner.embedding import Embedder, EmbeddingsNotSupportedError, GenerationNotSupportedError
from pyggml.runner.engine import SAMPLE_HEAD_K, Engine, Graph
from pyggml.runner.inputcache import InputCache, ReprocessInputsError
from pyggml.runner.sequence import (
    MAX_LOGPROBS,
    CompletionRequest,
    CompletionStream,
    RunningSequence,
    check_stops,
    sample_sequences,
)
from pyggml.runner.speculative import lookup_draft, verify_token
from pyggml.tensor import DType

log = logging.getLogger(__name__)

_UNSET = -1  # token id of a placeholder input whose token is not sampled yet
_IMAGE_MARK = re.compile(r"\[img-(\d+)\]")  # where an image goes in a prompt (Ollama's marker)
MAX_DRAFT = 32  # most tokens drafted per step (speculative decoding)
# With slots free, the loop builds a batch only once no request has arrived (and no sequence ended)
# for ARRIVAL_QUIET_S and none is being prepared (``Runner.arriving``), waiting at most ARRIVAL_WAIT_S:
# requests of a burst come a millisecond or two apart, and a prompt step takes 100 ms to seconds.
ARRIVAL_QUIET_S = 0.005
ARRIVAL_WAIT_S = 0.05


class RunnerClosedError(RuntimeError):
    """The runner was closed (or stopped on an internal error)."""


def _packing_order(seq: RunningSequence) -> tuple[bool, int]:
    prompt = len(seq.pending) - len(seq.drafts) > 1
    return prompt, 0 if prompt else seq.slot.id


class _Batch(Batch):
    """A batch whose token ids are one int32 array that the graph reads when it computes, so ids
    sampled from the previous batch can still be written after the graph is built."""

    def __init__(self, ids: np.ndarray, **fields):
        super().__init__(inputs=ids, **fields)

    @property
    def tokens(self) -> np.ndarray:
        return self.inputs


@dataclass(eq=False)
class _Step:
    """One built batch: its graph, where each sequence's logits rows are, and the inputs whose
    token ids are filled in just before it computes."""

    graph: Graph | None = None
    ids: np.ndarray | None = None
    rows: list[tuple[int, RunningSequence]] = field(default_factory=list)  # (logits row, sequence) to sample
    scored: list[tuple[int, RunningSequence]] = field(default_factory=list)  # prompt rows a sequence keeps
    late: list[tuple[int, Input, RunningSequence]] = field(default_factory=list)  # placeholders by batch index
    seqs: list[RunningSequence] = field(default_factory=list)  # every sequence with inputs in the batch
    finishing: list[RunningSequence] = field(default_factory=list)  # done once the batch is computed
    future: Future | None = None
    masks: Future | None = None  # the grammar masks of its constrained rows, computed beside the graph
    spec: list[tuple[int, RunningSequence]] = field(default_factory=list)  # (first row, sequence) with drafts


class Runner:
    """Serves completions of ``parallel`` sequences at once, each with a context of ``num_ctx``
    tokens (the model's cache holds ``parallel * num_ctx``). ``completion`` may be called from
    any thread; one loop thread does all model work. With ``background=False`` there is no loop
    thread: the thread reading a completion's chunks runs the loop until the next chunk is there
    (``LLM``: one caller, no thread hand-off per token). An embedding model (``model.pooling`` set)
    serves ``embedding``/``embeddings`` instead, one forward pass at a time, with no KV cache; a
    model that only embeds refuses completions. One runner per model; close it before the model.
    ``device_sampling``: graphs end in a sampling head, and steps whose sequences all sample plainly
    read each row's K largest logits instead of every logit (``Engine``; the same tokens)."""

    def __init__(self, model: Model, parallel: int = 4, num_ctx: int = 4096, batch_size: int = 512,
                 cache_type: DType | str = DType.F16, multi_user_cache: bool = True, build_ahead: bool | None = None,
                 background: bool = True, draft: Model | None = None, draft_max: int = 8,
                 device_sampling: bool = False):
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
            parallel = model.max_parallel
        self.model, self.tokenizer = model, model.tokenizer
        self.parallel, self.num_ctx = parallel, num_ctx
        self.batch_size = min(batch_size, num_ctx)
        self.embedder = Embedder(model, num_ctx, batch_size) if model.pooling is not None else None
        # opt-in until measured on a GPU (then meant to default to model.backend.has_gpu; on a CPU the
        # head computes slower than numpy samples)
        self.engine = Engine(model, keep=2, sample_head=SAMPLE_HEAD_K if device_sampling else 0)
        # an image's inputs go in one batch (same_batch): one longer than batch_size gets a batch that
        # grows to hold it (as Ollama's runner does), up to max_batch, reserved below
        self.image_run = self._image_run() if model.generates else 0
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
        self._cond = threading.Condition()
        self._waiting: deque[RunningSequence] = deque()
        self._arriving = 0  # requests being prepared (``arriving``) that have not reached _waiting yet
        self._last_arrival = 0.0  # time.monotonic() a request last entered or left ``arriving``, or a sequence ended
        self._active: list[RunningSequence] = []
        self._closing = False
        self._in_flight: _Step | None = None  # the batch computing in the worker (build-ahead)
        self._due: list[RunningSequence] = []  # sequences whose consumer waits for a notify (``_notify``)
        self.drafter: Runner | None = None  # speculative decoding: the draft model's own runner
        self.draft_max = draft_max
        if draft is not None:
            _check_int("draft_max", draft_max, 1, MAX_DRAFT)
            if draft.tokenizer is None or draft.tokenizer.vocab.tokens != model.tokenizer.vocab.tokens:
                raise ModelError("the draft model must have the same vocabulary as the model")
            self.drafter = Runner(draft, parallel=parallel, num_ctx=num_ctx, batch_size=batch_size,
                                  cache_type=cache_type, build_ahead=False, background=False)
        self._error: BaseException | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pyggml-compute") if self.build_ahead else None
        self._mask_pool: ThreadPoolExecutor | None = None  # grammar masks, started with the first constraint
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._loop, name="pyggml-runner", daemon=True)
            self._thread.start()

    # ---- start-up -------------------------------------------------------------------------------
    def _reserve(self) -> bool:
        """Allocate the KV cache and the compute memory of the largest batch (and, for a vision model,
        of its largest image graph) now, so running out of memory fails here rather than mid-request.
        Returns whether the model's graph reads the batch's token array in place (what build-ahead needs)."""
        try:
            return self._reserve_memory()
        except BaseException:
            self.engine.close()  # the image graph it kept
            raise

    def _reserve_memory(self) -> bool:
        n = self.max_batch
        n_out = min(n, self.parallel)
        embeddings = self._reserve_images()
        multimodal = [MultimodalIndex(0, [Multimodal(tensor=e) for e in embeddings])] \
            if embeddings and sum(len(e.reshape(-1, e.shape[-1])) for e in embeddings) <= n else []
        batch = _Batch(np.zeros(n, np.int32), outputs=list(range(n - n_out, n)), positions=list(range(n)),
                       sequences=[0] * n, multimodal=multimodal)
        backend = self.model.backend
        try:
            with backend.new_context() as ctx:
                self.model.cache.start_forward(ctx, batch, reserve=True)
                logits = self.model.forward(ctx, batch)
                ctx.forward(logits)
                # the sampling head's outputs flagged as computes flag them (see Context.reserve)
                outputs = (logits, *self.engine.head(ctx, logits)) if self.engine.sample_head else ()
                in_place = _reads_in_place(ctx, batch.tokens)
                ctx.reserve(*outputs)
        except MemoryError as exc:
            raise MemoryError(f"not enough memory for {self.parallel} sequences of {self.num_ctx} tokens and "
                              f"batches of {n}: lower parallel, num_ctx or batch_size ({exc})") from exc
        return in_place

    def _reserve_images(self) -> list[np.ndarray]:
        """A vision model: build its largest image graph (the engine keeps it for the first image) and
        reserve its compute memory. Returns zero embeddings shaped like an image's, for the text batch."""
        if not self.model.takes_images:
            return []
        try:
            return self.engine.reserve_multimodal()
        except MemoryError as exc:
            raise MemoryError(f"not enough memory to encode an image (the vision graph of the "
                              f"{self.model.architecture or 'loaded'} model): free memory, or load it without its "
                              f"vision part ({exc})") from exc

    def _image_run(self) -> int:
        """The most inputs one image needs in one batch (``same_batch`` + 1), from letting the model's
        ``post_tokenize`` place an image; 0 for a text model or one whose vocabulary cannot place images."""
        if not self.model.takes_images:
            return 0
        try:
            inputs = self.model.post_tokenize([Input(multimodal=[Multimodal(data=b"")], multimodal_hash=1)])
        except Exception as exc:  # e.g. no image marker tokens: requests with images fail with this error
            log.warning("the model cannot place images in its input: %r", exc)
            return 0
        return max((inp.same_batch + 1 for inp in inputs if inp.same_batch), default=0)

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

    @property
    def active_sequences(self) -> int:
        return len(self._active)

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
        if self._mask_pool is not None:
            self._mask_pool.shutdown()
        if self.drafter is not None:
            self.drafter.close()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _prepare(self, request: CompletionRequest) -> RunningSequence:
        """Validate a request (ValueError saying what is wrong) and tokenize its prompt."""
        if not isinstance(request, CompletionRequest):
            raise TypeError(f"completion: expected a CompletionRequest, got {type(request).__name__}")
        if not self.model.generates:
            raise GenerationNotSupportedError(
                f"the {self.model.architecture or 'loaded'} model is an embedding model: it cannot generate "
                "text (ask it for embeddings instead)")
        prompt = request.prompt
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("empty prompt")
            ids = self.tokenizer.encode(prompt, add_special=True)
        elif isinstance(prompt, Sequence) and all(isinstance(t, (int, np.integer)) for t in prompt):
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.tokenizer.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids out of range 0..{self.tokenizer.vocab_size - 1}: {bad[:5]}")
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        if not ids:
            raise ValueError("empty prompt")
        inputs = self._with_images(prompt, request.images) if request.images else [Input(token=t) for t in ids]
        if len(inputs) > self.num_ctx:
            raise ValueError(f"prompt of {len(inputs)} tokens does not fit the context of {self.num_ctx} tokens "
                             "(raise num_ctx or shorten the prompt)")
        _check_int("max_tokens", request.max_tokens, -1)
        _check_int("num_keep", request.num_keep, -1)
        _check_int("logprobs", request.logprobs, 0, MAX_LOGPROBS)
        _check_int("prompt_lookup", request.prompt_lookup, 0, MAX_DRAFT)
        stops = check_stops(request.stop)
        bias = dict(request.logit_bias or {})
        if any(not isinstance(t, (int, np.integer)) or not 0 <= t < self.tokenizer.vocab_size for t in bias):
            raise ValueError(f"logit_bias keys must be token ids in 0..{self.tokenizer.vocab_size - 1}")
        if any(not isinstance(v, (int, float)) or math.isnan(v) for v in bias.values()):
            raise ValueError("logit_bias values must be numbers")
        if request.seed is not None:
            _check_int("seed", request.seed, 0)
        num_keep = len(inputs) if request.num_keep < 0 else request.num_keep
        grammar = grammar_for(request.format, request.grammar)  # ConstraintError is a ValueError
        constraint = Constraint(grammar, self.tokenizer) if grammar is not None else None
        try:  # the Sampler checks the sampling options
            seq = RunningSequence(request, inputs, self.tokenizer, [s for s in stops if s],
                                  min(num_keep, self.num_ctx - 1), constraint)
        except TypeError as exc:
            raise ValueError(f"bad sampling option: {exc}") from exc
        seq.due = self._due
        return seq

    def _with_images(self, prompt: str | Sequence[int], images: Sequence[bytes]) -> list[Input]:
        """The input stream of a prompt with images: text tokens around one Input per image (its
        bytes to encode and their hash), rewritten by the model's ``post_tokenize``."""
        if not self.model.takes_images:
            raise ValueError(f"the {self.model.architecture or 'loaded'} model takes no images (it has no vision "
                             "part; a vision model, or its mmproj file, is needed)")
        if not isinstance(prompt, str):
            raise ValueError("a prompt with images must be text (mark each image with [img-N])")
        if isinstance(images, (bytes, str)) or not all(isinstance(b, (bytes, bytearray)) and b for b in images):
            raise ValueError("images must be a list of non-empty byte strings (image files)")
        parts = _IMAGE_MARK.split(prompt)  # text, index, text, index, ...
        if len(parts) == 1:  # no markers: the images come first, as Ollama places them
            parts = ["", *[x for i in range(len(images)) for x in (str(i), "")]]
            parts[-1] = prompt
        inputs: list[Input] = []
        for k, part in enumerate(parts):
            if k % 2 == 0:
                if part or k == 0:  # the first piece carries the BOS token, even when empty
                    inputs += [Input(token=t) for t in self.tokenizer.encode(part, add_special=k == 0)]
                continue
            index = int(part)
            if index >= len(images):
                raise ValueError(f"the prompt names [img-{index}] but the request has {len(images)} image(s)")
            data = bytes(images[index])
            digest = hashlib.blake2b(data, digest_size=8).digest()  # the prompt cache compares images by it
            inputs.append(Input(multimodal=[Multimodal(data=data)], multimodal_hash=int.from_bytes(digest, "little")))
        inputs = self.model.post_tokenize(inputs)
        longest = max((inp.same_batch + 1 for inp in inputs if inp.same_batch), default=0)
        if longest > max(self.batch_size, self.image_run):
            raise ValueError(f"an image takes {longest} inputs in one batch but the runner's batches hold "
                             f"{max(self.batch_size, self.image_run)}; raise batch_size")
        return inputs

    def _encode(self, inp: Input) -> None:
        """Compute an image's vision graph (the engine's, built once per image shape; the result stays
        with its input, in host memory)."""
        if self._in_flight is not None:
            wait([self._in_flight.future])  # one graph computes at a time
        inp.multimodal = [m for item in inp.multimodal for m in self.engine.encode(item.data)]

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
        """One turn of the loop: admit, build a batch, compute, sample. Returns False once closing.
        With ``block`` it waits for work; without, it returns at once when there is none."""
        with self._cond:
            while not (self._closing or self._waiting or self._in_flight or any(not s.paused for s in self._active)):
                if not block:
                    raise RuntimeError("internal error: a completion waits but the runner has nothing to do")
                if self._due:  # nothing more to compute: tell the consumers now
                    self._notify()
                    continue
                self._cond.wait()
            if block and len(self._active) + len(self._waiting) < self.parallel:
                self._await_arrivals()
            closing = self._closing
            dropped = [s for s in self._waiting if s.cancelled]
            for seq in dropped:
                self._waiting.remove(seq)
            admitted = []
            while self._waiting and len(self._active) + len(admitted) < self.parallel and not closing:
                admitted.append(self._waiting.popleft())
        for seq in dropped:
            seq.finish("cancelled")
        if closing:
            self._notify()
            return False
        for seq in admitted:
            self._admit(seq)
        if self._in_flight is not None and self._drafts_after(self._in_flight):
            self._complete(self._in_flight)  # speculation: the next batch's drafts follow its sampled tokens
            self._in_flight = None
        step = self._build()
        if self._in_flight is not None:
            self._complete(self._in_flight)
            self._in_flight = None
        if step is None:
            self._notify()
            return True
        self._fill(step)
        self._start_masks(step)
        if self.build_ahead:
            step.future = self._pool.submit(self._compute, step)
            self._in_flight = step
            self._notify()
        else:
            self._notify()  # the consumers' threads run while this batch computes
            self._complete(step)
            if any(seq.done or seq.generated == 1 for seq in self._due):
                self._notify()  # a first token (time to first token) or an end (a free slot): now
        return True

    def _await_arrivals(self) -> None:
        """Slots are free and requests are arriving (or were, or a sequence just ended: its
        client's next request is usually a millisecond behind): let them in before building,
        so that a burst shares one prompt step (see ``arriving``). Called holding _cond."""
        deadline = time.monotonic() + ARRIVAL_WAIT_S
        while not self._closing:
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
        if self._in_flight is not None:
            wait([self._in_flight.future])  # let it finish before the model is touched again
        self._in_flight = None
        self.engine.close()
        with self._cond:
            self._closing = True
            stranded = list(self._waiting) + [s for s in self._active if not s.done]
            self._waiting.clear()
        for seq in stranded:
            if self._error is None:
                self._release(seq, "cancelled")
            else:
                self._release(seq, error=RunnerClosedError(f"the runner stopped: {self._error!r}"))
        self._notify()

    def _admit(self, seq: RunningSequence) -> None:
        seq.t_start = time.perf_counter()
        # a prompt_logits request needs every prompt position computed: it reuses no cached prefix
        slot, remaining = self.input_cache.load_cache_slot(seq.prompt, seq.request.cache_prompt and
                                                           seq.scores is None)
        seq.slot, seq.pending = slot, deque(remaining)
        seq.cached_tokens = len(seq.prompt) - len(remaining)
        self._active.append(seq)

    def _build(self) -> _Step | None:
        """Pack the next batch: decode tokens first, by slot (consecutive sequences attend as one
        group, see kvcache.Causal), then prompt tokens in arrival order."""
        ids, positions, sequences, outputs, multimodal = [], [], [], [], []
        step = _Step()
        self._draft_all()
        for seq in sorted(self._active, key=_packing_order):
            if seq.done:
                continue
            if seq.cancelled:
                if not seq.outputs_in_flight:
                    self._release(seq, "cancelled")
                continue
            if seq.paused:  # its consumer is not reading: generate nothing until it does
                continue
            if not seq.pending and seq.outputs_in_flight and self.build_ahead and seq.wants_logits \
                    and seq.placeholder is None:
                seq.placeholder = Input(token=_UNSET)
                seq.pending.append(seq.placeholder)
            room = self.batch_size - len(ids)
            if not seq.pending or room <= 0:  # (< 0 after an image that made the batch grow)
                continue
            slot, taken, first = seq.slot, 0, len(ids)
            while seq.pending and taken < room:
                if len(slot.inputs) >= self.num_ctx:
                    if taken:  # shift only when none of this sequence's inputs wait in a batch being built
                        break
                    self._shift(seq)
                    continue
                inp = seq.pending[0]
                if inp.same_batch:  # an image's inputs go in one batch: this one, the next one, or after a shift
                    if len(slot.inputs) + inp.same_batch >= self.num_ctx:
                        break
                    if inp.same_batch >= self.batch_size:  # longer than any batch: this one grows to hold it
                        room = taken + inp.same_batch + 1
                    elif inp.same_batch >= room - taken:
                        break
                seq.pending.popleft()
                if inp.multimodal:
                    if inp.multimodal[0].tensor is None:
                        try:
                            self._encode(inp)
                        except Exception as exc:
                            seq.pending.appendleft(inp)
                            self._fail_sequence(seq, exc)
                            break
                    multimodal.append(MultimodalIndex(len(ids), inp.multimodal))
                if inp.token == _UNSET:
                    step.late.append((len(ids), inp, seq))
                ids.append(inp.token)
                positions.append(len(slot.inputs))
                sequences.append(slot.id)
                slot.inputs.append(inp)
                taken += 1
            if taken:
                step.seqs.append(seq)
                if seq.scores is not None:  # every prompt position gets a logits row
                    step.scored.extend((len(outputs) + i, seq) for i in range(taken))
                    outputs.extend(range(first, len(ids)))
            if taken and not seq.pending and seq.drafts:  # a logits row at every drafted position too
                outputs.extend(range(len(ids) - len(seq.drafts) - 1, len(ids)))
                step.spec.append((len(outputs) - len(seq.drafts) - 1, seq))
                seq.outputs_in_flight += 1
            elif taken and not seq.pending:
                if seq.wants_logits:
                    if seq.scores is None:
                        outputs.append(len(ids) - 1)
                    step.rows.append((len(outputs) - 1, seq))
                    seq.outputs_in_flight += 1
                else:
                    step.finishing.append(seq)
        if not ids:
            return None
        step.ids = np.array(ids, np.int32)
        batch = _Batch(step.ids, outputs=outputs, positions=positions, sequences=sequences, multimodal=multimodal)
        busy = self._in_flight.graph if self._in_flight is not None else None
        try:
            step.graph = self.engine.build(batch, busy)
            if step.late and not _reads_in_place(step.graph.ctx, step.ids):  # the start-up check did not hold
                self.build_ahead = False
                raise RuntimeError("the model copied the batch's token ids; build-ahead is now off")
        except Exception as exc:
            self.engine.drop(busy)
            if step.graph is not None and not step.graph.kept:
                step.graph.ctx.close()
            self._fail_step(step, exc)
            return None
        return step

    def _draft_all(self) -> None:
        """Queue drafted tokens behind each speculating sequence's decode input: from prompt lookup,
        or from the draft model (all sequences' drafts in one batched run of it). Each draft gets
        as many tokens as the batch (shared), the slot, ``max_tokens`` and the grammar leave room for."""
        seqs = [s for s in self._active if self._speculates(s) and len(s.pending) == 1 and s.generated
                and not s.outputs_in_flight]
        if not seqs:
            return
        share = self.batch_size // len(seqs) - 1
        wanted = []
        for seq in seqs:
            k = min(seq.request.prompt_lookup or self.draft_max, share, self.num_ctx - len(seq.slot.inputs) - 1)
            if seq.request.max_tokens >= 0:
                k = min(k, seq.request.max_tokens - seq.generated - 1)
            if k > 0:
                wanted.append((seq, k))
        streams = []
        for seq, k in wanted:
            if seq.request.prompt_lookup:
                drafts = lookup_draft(seq.history, k)
                # a shorter match is padded (the padding is rejected like any wrong guess): steps of one
                # shape reuse one graph instead of building one per draft length
                self._queue_draft(seq, drafts + drafts[-1:] * (k - len(drafts)))
            elif len(seq.history) + k <= self.drafter.num_ctx and min(seq.history) >= 0:
                try:
                    streams.append((seq, self.drafter.completion(CompletionRequest(
                        prompt=seq.history, max_tokens=k, temperature=0.0, num_keep=0))))
                except Exception as exc:  # no draft this step; the target decodes on its own
                    log.warning("draft model refused a draft request: %r", exc)
        for seq, stream in streams:  # reading the first runs the draft model for all of them
            try:
                self._queue_draft(seq, [t for chunk in stream for t in chunk.tokens])
            except Exception as exc:
                log.warning("draft model failed: %r", exc)

    def _speculates(self, seq: RunningSequence) -> bool:
        """Whether ``seq`` drafts its next tokens (prompt lookup, or the runner's draft model)."""
        return not seq.done and not seq.cancelled and seq.scores is None and \
            bool(seq.request.prompt_lookup or self.drafter is not None)

    def _drafts_after(self, step: _Step) -> bool:
        """Whether a sequence sampled in ``step`` (in flight) drafts next. Its draft continues the
        token ``step`` samples, and after a verified draft even its positions depend on how much was
        accepted, so the next batch is built once ``step`` is done: the runner builds ahead only
        while no sampled sequence speculates (per step)."""
        return any(self._speculates(seq) for _, seq in (*step.rows, *step.spec))

    def _queue_draft(self, seq: RunningSequence, drafts: list[int]) -> None:
        if drafts and seq.constraint is not None:  # the matcher is past the decode input: check the draft
            drafts = drafts[:seq.constraint.validate(drafts)]
        seq.drafts = drafts
        seq.pending.extend(Input(token=t) for t in drafts)

    def _verify(self, logits: np.ndarray, first: int, seq: RunningSequence) -> None:
        """Check a sequence's drafts against the target's rows ``first..first+len(drafts)``: keep the
        longest accepted prefix plus the token that follows it, and remove the rest from the cache."""
        drafts, seq.drafts = seq.drafts, []
        seq.outputs_in_flight -= 1
        if seq.done:
            return
        slot = seq.slot
        base = len(slot.inputs) - len(drafts)  # position of the first drafted token
        seq.draft_tokens += len(drafts)
        accepted, reason, token = 0, None, None
        biases = []  # the rows' grammar masks, computed beside the graph (``_start_masks``)
        if seq.constraint is not None:
            biases, seq.constraint.draft_biases = seq.constraint.draft_biases, []
        try:
            for i in range(len(drafts) + 1):
                row = logits[first + i]
                if seq.constraint is None:
                    scores = row
                else:
                    scores = seq.constraint.apply(row, biases[i] if i < len(biases) else None)
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
        seq.accepted_tokens += accepted
        if accepted < len(drafts):  # the rejected positions leave the cache
            self.model.cache.remove(slot.id, base + accepted)
            del slot.inputs[base + accepted:]
        if isinstance(reason, Exception):
            self._release(seq, error=reason)
        elif reason:
            self._release(seq, reason)
        else:  # the correction at the first rejected position, or the bonus token after a whole draft
            seq.pending.append(Input(token=token))

    def _shift(self, seq: RunningSequence) -> None:
        """Make room in a full slot. Moving keys computes on the cache: the batch in flight, built
        before the move, must have written its keys and values first (and had its logits read)."""
        if self._in_flight is not None:
            wait([self._in_flight.future])
        try:
            self.input_cache.shift_cache_slot(seq.slot, seq.num_keep)
        except ReprocessInputsError as exc:
            seq.pending.extendleft(reversed(exc.inputs))

    def _fill(self, step: _Step) -> None:
        """Write the ids sampled since the batch was built. A sequence that failed meanwhile left
        its placeholder unset (-1 in its slot never matches a prompt): any valid id will do."""
        for index, inp, seq in step.late:
            if inp.token == _UNSET and not seq.done:
                raise RuntimeError("internal error: a batch input has no token id")
            step.ids[index] = max(inp.token, 0)

    def _start_masks(self, step: _Step) -> None:
        """Compute the grammar masks of the batch's constrained rows in a worker while the graph
        computes (llguidance releases the GIL); every token they follow is consumed by now."""
        jobs = [(seq.constraint, None) for _, seq in step.rows if seq.constraint is not None]
        jobs += [(seq.constraint, list(seq.drafts)) for _, seq in step.spec if seq.constraint is not None]
        if not jobs:
            return
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="pyggml-grammar")
        step.masks = self._mask_pool.submit(_compute_masks, jobs)

    def _compute(self, step: _Step) -> np.ndarray | None:
        read: bool | str = bool(step.rows or step.scored or step.spec)
        if read and step.graph.top is not None and not step.scored and not step.spec and \
                all(seq.samples_from_top(self.engine.sample_head) for _, seq in step.rows):
            read = "top"  # the sampling head's K logits per row are all the step needs
        return self.engine.compute(step.graph, read=read)

    def _complete(self, step: _Step) -> None:
        """Wait for a batch, then sample each sequence that has a row in it."""
        try:
            logits = step.future.result() if step.future is not None else self._compute(step)
        except Exception as exc:
            # its keys and values are missing, and later prompts may share them: start over
            log.error("batch failed: %r", exc)
            self.engine.drop()
            for slot in self.input_cache.slots:
                slot.inputs = []
                self.model.cache.remove(slot.id, 0)
            for seq in list(self._active):
                self._release(seq, error=exc)
            return
        for row, seq in step.scored:
            seq.scores.append(logits[row].copy())
        if step.masks is not None:
            try:
                step.masks.result()
            except Exception as exc:  # a grammar failure: sampling below recomputes and reports it
                log.error("grammar masks failed: %r", exc)
        for _, seq in step.rows:
            seq.outputs_in_flight -= 1
        live = [(row, seq) for row, seq in step.rows if not seq.done]
        for (row, seq), token in zip(live, sample_sequences(live, logits), strict=True):
            if isinstance(token, Exception):
                self._release(seq, error=token)
                continue
            placeholder, seq.placeholder = seq.placeholder, None
            if placeholder is not None:
                placeholder.token = token
            try:
                reason = "cancelled" if seq.cancelled else \
                    seq.accept(token, logits[row] if seq.request.logprobs else None)
            except Exception as exc:  # the grammar refused the token: a bug, fail this sequence only
                self._release(seq, error=exc)
                continue
            if reason:
                self._release(seq, reason)
            elif placeholder is None:
                seq.pending.append(Input(token=token))
        for first, seq in step.spec:
            self._verify(logits, first, seq)
        for seq in step.finishing:
            if not seq.done:
                self._release(seq, "cancelled" if seq.cancelled else "length")

    def _fail_sequence(self, seq: RunningSequence, exc: BaseException) -> None:
        """One sequence cannot go on (e.g. its image does not decode): it fails, its slot starts over."""
        log.warning("sequence failed: %r", exc)
        seq.slot.inputs = []
        self.model.cache.remove(seq.slot.id, 0)
        self._release(seq, error=exc)

    def _fail_step(self, step: _Step, exc: BaseException) -> None:
        """A batch could not be built: its sequences fail and their slots start over."""
        log.error("batch could not be built: %r", exc)
        for seq in step.seqs + [seq for _, seq in step.rows]:
            if not seq.done:
                seq.slot.inputs = []
                self.model.cache.remove(seq.slot.id, 0)
                self._release(seq, error=exc)

    def _release(self, seq: RunningSequence, reason: str = "", error: BaseException | None = None) -> None:
        """Finish a sequence and free its slot (what it computed stays cached for later prompts)."""
        if seq.slot is not None:
            seq.slot.in_use = False
        if seq in self._active:
            self._active.remove(seq)
            self._last_arrival = time.monotonic()  # its client's next request is often on its way
        if error is not None:
            seq.fail(error)
        else:
            seq.finish(reason)


def _compute_masks(jobs: list[tuple[Constraint, list[int] | None]]) -> None:
    """The next-token masks of a batch's constrained rows: one per sampled row, and for a
    speculating sequence one per verified row (its drafts stepped through and rolled back)."""
    for constraint, drafts in jobs:
        if drafts is None:
            constraint.compute_mask()
        else:
            constraint.compute_draft_masks(drafts)


def _reads_in_place(ctx, ids: np.ndarray) -> bool:
    """Whether the graph's token input is ``ids`` itself rather than a copy. The Context keeps
    its inputs' host arrays until it computes; there is no public accessor for them yet."""
    return any(np.may_share_memory(data, ids) for data in ctx._state.inputs.values())


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low or \
            (high is not None and value > high):
        limits = f">= {low}" if high is None else f"in {low}..{high}"
        raise ValueError(f"{name} must be an int {limits}, got {value!r}")
