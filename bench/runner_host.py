"""Host work per decode step of the Runner, on a model whose compute is negligible (no GPU needed).

    python bench/runner_host.py                                  # synthetic: 1 tiny layer, 32k vocabulary
    python bench/runner_host.py --vocab 151936 --parallel 1,128  # a Qwen-sized vocabulary
    python bench/runner_host.py /work/shared/models/stories260K.gguf --steps 20
    python bench/runner_host.py --parallel 1,128 --device-sampling --build-ahead  # the device's wait too

On a GPU the Runner's Python is what the device waits for at high concurrency (issue 26: 49 % of a
step at 128 sequences). The same host work dominates a CPU run of a model with one tiny layer, so
this measures it anywhere: P sequences (``--parallel``) each generate ``--steps`` tokens after
``--warmup`` steps, every request with stop strings, EOG tokens banned (logit bias -inf: every
sequence runs every step), greedy (``--sampling greedy``) or seeded temperature/top-k/top-p
(``--sampling random``). One thread drives the runner (``background=False``) and reads every stream,
so all host work is on one thread and timed exclusively, per step, in these columns (ms, median of the
measured steps):

- ``compute``: ggml's compute and the read of the logits (or of a sampling head's K logits per row,
  ``--device-sampling``), ``Engine.compute``;
- ``cache``: cache bookkeeping and graph refill (or build), ``Engine.build``;
- ``sched``: packing the batch (inputs, positions, rows), admission, the loop;
- ``sample``: choosing each sequence's token from its logits row(s);
- ``detok``: accepting a token: detokenizing, stop strings and EOG, logprobs;
- ``stream``: handing chunks to their consumers (queue, notify) and the consumer reading them;
- ``host``: everything but ``compute`` (the figure the issue's target is about), and ``step``.

A timing wrapper costs about a microsecond per call, and several wrap each sequence's calls (at 128
sequences some 0.5 ms of a step), so every row is run twice: once with every phase timed (the phase
columns, ``host`` and ``step``), and once with only the compute timed (``lean host``: the step's time
less its compute, ``lean step``, and ``tok/s``): the host work without the measurement's own.

``--build-ahead`` adds a table of the runner as it serves on a GPU (``build_ahead=True``: the next step is
built, and the last one's tokens streamed, while a step computes in the runner's worker thread): per step
the compute (``Backend._run``: writing the inputs and computing), the ``idle`` time from one compute's end to
the next one's start (the host work the device waits for: reading and sampling the last step, launching
the next), the step from start to start, the idle share and the host share of the whole run (the prompt step
and the last steps too); wall clock, one compute thread (``--threads``) beside the runner's, as a GPU would
compute beside it. ``--device-ms MS`` makes it a simulated GPU: each compute is followed by MS ms of sleep (the
GIL free, as in a CUDA compute), the runner's loop runs in its own thread and this one reads every stream, as a
server's event loop does (``bench/runner_gpu.py --one-consumer`` on a real GPU):

    python bench/runner_host.py --vocab 512 --parallel 16,64,128 --sampling greedy --device-sampling \
        --build-ahead --device-ms 4.7   # P=128: ~4 ms of CPU compute + 4.7: the H200's 8.7 ms TinyLlama step

The phases are found by wrapping the runner's functions (whichever of the listed names exist), so the
script measures older and newer runners alike.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import numpy as np

PHASES = ("compute", "cache", "sched", "sample", "detok", "stream")
COLUMNS = ("P", *PHASES, "host", "step", "lean host", "lean step", "tok/s")
AHEAD_COLUMNS = ("P", "compute", "idle", "step", "idle share", "chained", "host share", "tok/s")  # --build-ahead
# phase -> (module, class or None, attribute) of the functions whose own time (not their timed callees') goes there
TIMED: dict[str, list[tuple[str, str | None, str]]] = {
    "compute": [("pyggml.runner.engine", "Engine", "compute")],
    "cache": [("pyggml.runner.engine", "Engine", "build")],
    "sched": [("pyggml.runner.runner", "Runner", name) for name in
              ("_iterate", "_build", "_admit", "_fill", "_start_masks", "_draft_all")],
    "sample": [("pyggml.runner.runner", "Runner", "_complete"), ("pyggml.runner.runner", "Runner", "_sample"),
               ("pyggml.sample", "Sampler", "sample"),
               ("pyggml.sample", None, "sample_rows"), ("pyggml.sample", None, "sample_top")],
    "detok": [("pyggml.runner.runner", "Runner", "_accept"), ("pyggml.runner.sequence", "RunningSequence", "accept")],
    "stream": [("pyggml.runner.sequence", "RunningSequence", name) for name in ("_put", "_send")] +
              [("pyggml.runner.runner", "Runner", "_notify"),
               ("pyggml.runner.sequence", "CompletionStream", "__next__")],
}


class Profiler:
    """Exclusive time per phase: a wrapped call's time minus that of the wrapped calls inside it."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.totals = dict.fromkeys(PHASES, 0.0)
        self._stack: list[float] = []  # time spent in timed callees, per open call
        self._undo: list[Callable[[], None]] = []

    def wrap_all(self, phases: tuple[str, ...] = PHASES) -> None:
        import importlib

        for phase in phases:
            places = TIMED[phase]
            for module_name, owner_name, attr in places:
                module = importlib.import_module(module_name)
                owner = getattr(module, owner_name, None) if owner_name else module
                if owner is not None and hasattr(owner, attr):
                    self._wrap(owner, attr, phase)

    def _wrap(self, owner, attr: str, phase: str) -> None:
        original = getattr(owner, attr)
        stack, totals, clock = self._stack, self.totals, self.clock

        def timed(*args, **kwargs):
            stack.append(0.0)
            t0 = clock()
            try:
                return original(*args, **kwargs)
            finally:
                spent = clock() - t0
                inner = stack.pop()
                totals[phase] += spent - inner
                if stack:
                    stack[-1] += spent

        setattr(owner, attr, timed)
        self._undo.append(lambda: setattr(owner, attr, original))

    def unwrap(self) -> None:
        while self._undo:
            self._undo.pop()()

    def snapshot(self) -> dict[str, float]:
        return dict(self.totals)


def synthetic_path(vocab: int) -> Path:
    """A cached random-weight llama of one tiny layer (hidden 64) and ``vocab`` tokens."""
    from pyggml.synthetic import Shape, write_synthetic
    from pyggml.tiny import cache_dir

    path = cache_dir() / f"synthetic-host-1x64-v{vocab}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_synthetic(path, Shape(1, 64, 128, 4, 4, vocab, 4096, 10000.0, False), "f32")
    return path


def run(model, parallel: int, steps: int, warmup: int, sampling: str, device_sampling: bool = False,
        clock: Callable[[], float] = time.perf_counter, lean: bool = False) -> dict[str, float]:
    """Median ms per step of each phase over ``steps`` decode steps with ``parallel`` sequences.
    ``lean``: only the compute is timed (the other phases read 0 and ``host`` is the step's time
    less its compute): no timing wrapper around each sequence's calls adds to the host figure."""

    profiler = Profiler(clock)
    per_step: list[dict[str, float]] = []
    spans: list[float] = []  # each step's time
    with runner_for(model, parallel, warmup + steps, device_sampling, build_ahead=False) as runner:
        profiler.wrap_all(("compute",) if lean else PHASES)
        original = runner._iterate  # the timed one (in "sched")

        def iterate(block):  # one step: note each phase's time so far, and the step's own
            t0 = clock()
            try:
                return original(block)
            finally:
                spans.append(clock() - t0)
                per_step.append(profiler.snapshot())

        runner._iterate = iterate
        try:
            tokens, wall = drain([runner.completion(r) for r in requests(model, parallel, warmup + steps + 2, sampling,
                                                                         device_sampling)])
        finally:
            profiler.unwrap()
    marks = [dict.fromkeys(PHASES, 0.0), *per_step]
    steps_ms = [{p: 1e3 * (b[p] - a[p]) for p in PHASES} for a, b in zip(marks, marks[1:], strict=False)]
    measured = steps_ms[warmup + 1:warmup + 1 + steps]  # +1: the prompt step
    span = [1e3 * t for t in spans[warmup + 1:warmup + 1 + steps]]
    row = {p: float(np.median([s[p] for s in measured])) for p in PHASES}
    row["host"] = float(np.median([t - s["compute"] for s, t in zip(measured, span, strict=True)]))
    row["step"] = float(np.median(span))
    row["tok/s"] = tokens / wall
    return row


def runner_for(model, parallel: int, steps: int, device_sampling: bool, build_ahead: bool, background: bool = False):
    """The benchmark's Runner: ``parallel`` slots with room for ``steps`` tokens each after the prompt, every
    prompt in one batch (a batch is at most num_ctx), driven by the caller's thread (no loop thread) unless
    ``background``."""
    from pyggml.runner import Runner

    extra = dict(device_sampling=True) if device_sampling else {}  # (runners before issue 26 lack it)
    return Runner(model, parallel=parallel, num_ctx=max(4 * parallel, steps + 16), batch_size=4 * parallel,
                  build_ahead=build_ahead, background=background, **extra)


def requests(model, parallel: int, max_tokens: int, sampling: str, device_sampling: bool) -> list:
    """The benchmark's ``parallel`` requests: three-token prompts, stop strings, one seed each."""
    from pyggml.runner import CompletionRequest

    tok = model.tokenizer
    # EOG banned so that every sequence runs every step; not with --device-sampling, where a bias would
    # send every row to the full logits (a random model then rarely ends a sequence early: a step of P-1)
    banned = {} if device_sampling else {t: -float("inf") for t in range(tok.vocab_size) if tok.is_eog(t)}
    options = dict(temperature=0.0) if sampling == "greedy" else dict(temperature=0.8, top_k=40, top_p=0.9)
    return [CompletionRequest(prompt=[1, 3 + i % (tok.vocab_size - 3), 3 + (7 * i) % (tok.vocab_size - 3)],
                              max_tokens=max_tokens, stop=["\n\nUser:", "<|im_end|>"], logit_bias=banned, seed=i,
                              **options)
            for i in range(parallel)]


def drain(streams: list) -> tuple[int, float]:
    """Read every stream to its end, round robin (one consumer); returns (tokens, seconds)."""
    t0 = time.perf_counter()
    live, tokens = list(streams), 0
    while live:
        for stream in list(live):
            chunk = next(stream)
            tokens += len(chunk.tokens)
            if chunk.done:
                live.remove(stream)
    return tokens, time.perf_counter() - t0


@contextmanager
def counting_chains():
    """Within it, a list that gets, per step the runner's worker computed, whether it launched the next step
    itself (``Runner._chain``); it stays empty with a runner that has no chain."""
    from pyggml.runner import Runner

    went_on: list[bool] = []
    go_on = getattr(Runner, "_go_on", None)
    if go_on is None:
        yield went_on
        return

    def counted(self, step, logits):
        out = go_on(self, step, logits)
        went_on.append(out[0] is not None)
        return out

    Runner._go_on = counted
    try:
        yield went_on
    finally:
        Runner._go_on = go_on


def run_ahead(model, parallel: int, steps: int, warmup: int, sampling: str,
              device_sampling: bool = False, device_ms: float = 0.0) -> dict[str, float]:
    """The runner as it serves (``build_ahead``: the next batch is built, and the last one's tokens
    streamed, while a batch computes in the runner's worker): median ms per step of ``compute`` (the
    backend writing the inputs and computing: ``Backend._run``), of ``idle`` (from one compute's end to the
    next one's start: the host work the device waits for, ggml's graph planning included), of ``step``
    (start to start), ``idle share`` (idle / step) and ``chained``, the share of the computed steps after which
    the worker sampled the step and launched the next itself (``Runner._chain``; 0 for a runner without it);
    ``host share``: 1 - the time in ``Backend._run`` over the whole run's (prompts and the last steps too), as
    ``runner_gpu.py`` counts it. Wall clock: the compute is another thread. ``device_ms``: a simulated GPU: each
    compute is followed by that many ms of sleep (the GIL free, as in a CUDA compute), and the runner's loop runs
    in its own thread while this one reads every stream (as a server's event loop; ``runner_gpu.py
    --one-consumer``)."""
    from pyggml.backend import Backend

    spans: list[tuple[float, float]] = []  # (start, end) of each compute
    original = Backend._run

    def compute(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            if device_ms:
                time.sleep(device_ms / 1e3)
            spans.append((t0, time.perf_counter()))

    Backend._run = compute
    try:
        with counting_chains() as went_on, runner_for(model, parallel, warmup + steps, device_sampling,
                                                      build_ahead=True, background=device_ms > 0) as runner:
            tokens, wall = drain([runner.completion(r) for r in requests(model, parallel, warmup + steps + 2,
                                                                         sampling, device_sampling)])
    finally:
        Backend._run = original
    measured = spans[warmup + 1:warmup + 2 + steps]  # +1: the prompt step; one more for the last gap
    idle = [1e3 * (b[0] - a[1]) for a, b in zip(measured, measured[1:], strict=False)]
    step = [1e3 * (b[0] - a[0]) for a, b in zip(measured, measured[1:], strict=False)]
    row = {"compute": float(np.median([1e3 * (e - s) for s, e in measured[:-1]])), "idle": float(np.median(idle)),
           "step": float(np.median(step))}
    row["idle share"] = row["idle"] / row["step"]
    row["chained"] = float(np.mean(went_on)) if went_on else 0.0
    row["host share"] = 1 - sum(e - s for s, e in spans) / wall
    row["tok/s"] = tokens / wall
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", type=Path, help="a GGUF file (default: the synthetic one-layer model)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary of the synthetic model (default 32000)")
    parser.add_argument("--parallel", default="1,16,64,128", help="comma-separated sequence counts")
    parser.add_argument("--steps", type=int, default=16, help="decode steps measured per run (default 16)")
    parser.add_argument("--warmup", type=int, default=3, help="decode steps before measuring (default 3)")
    parser.add_argument("--sampling", choices=("greedy", "random", "both"), default="both")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: the thread's CPU time (time.thread_time), steadier on a busy machine; it "
                             "costs ~1 us per timed call and leaves out waits (the compute of 2+ threads)")
    parser.add_argument("--device-sampling", action="store_true",
                        help="graphs end in a sampling head (Runner(device_sampling=True))")
    parser.add_argument("--build-ahead", action="store_true",
                        help="also the runner as it serves (build_ahead=True): how long the compute waits for the "
                             "host each step (columns " + ", ".join(AHEAD_COLUMNS[1:]) + "; wall clock)")
    parser.add_argument("--device-ms", type=float, default=0.0,
                        help="with --build-ahead: a simulated GPU, each compute followed by MS ms of sleep (the GIL "
                             "free); the loop in its own thread, this one reading the streams (default 0: off)")
    args = parser.parse_args(argv)
    if args.device_ms and not args.build_ahead:
        parser.error("--device-ms simulates a GPU for the --build-ahead table: add --build-ahead")
    if args.device_ms < 0:
        parser.error(f"--device-ms must be >= 0 (ms of sleep after each compute), got {args.device_ms:g}")
    from pyggml import models
    from pyggml.backend import BackendParams

    path = args.model or synthetic_path(args.vocab)
    parallels = [int(p) for p in args.parallel.split(",")]
    model = models.load(path, BackendParams(n_threads=args.threads))
    try:
        print(f"# {path.name}: vocab {model.tokenizer.vocab_size}, {args.steps} steps after {args.warmup}, "
              f"{args.threads} thread(s){', device sampling' if args.device_sampling else ''}; ms per step (median, "
              f"{'thread CPU time' if args.clock == 'cpu' else 'wall clock'})")
        for sampling in ("greedy", "random") if args.sampling == "both" else (args.sampling,):
            print(f"\n## sampling: {sampling}\n")
            print("| " + " | ".join(COLUMNS) + " |")
            print("|" + "---|" * len(COLUMNS))
            for parallel in parallels:
                clock = time.thread_time if args.clock == "cpu" else time.perf_counter
                row = run(model, parallel, args.steps, args.warmup, sampling, args.device_sampling, clock)
                lean = run(model, parallel, args.steps, args.warmup, sampling, args.device_sampling, clock, lean=True)
                row.update({"lean host": lean["host"], "lean step": lean["step"], "tok/s": lean["tok/s"]})
                cells = [str(parallel)] + [f"{row[c]:.3f}" for c in COLUMNS[1:-1]] + [f"{row['tok/s']:.0f}"]
                print("| " + " | ".join(cells) + " |", flush=True)
            if args.build_ahead:
                device = f", each compute + {args.device_ms:g} ms (a simulated GPU)" if args.device_ms else ""
                print(f"\n### build-ahead ({sampling}{device}): the compute's wait for the host, wall clock\n")
                print("| " + " | ".join(AHEAD_COLUMNS) + " |")
                print("|" + "---|" * len(AHEAD_COLUMNS))
                for parallel in parallels:
                    row = run_ahead(model, parallel, args.steps, args.warmup, sampling, args.device_sampling,
                                    args.device_ms)
                    cells = [str(parallel)] + [f"{row[c]:.3f}" for c in AHEAD_COLUMNS[1:-1]] + [f"{row['tok/s']:.0f}"]
                    print("| " + " | ".join(cells) + " |", flush=True)
    finally:
        model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
