"""Decode speed at several CPU threadpool poll levels, alternated in one process (issue 13, item 12).

    python bench/poll_levels.py --synthetic tinyllama-1.1b --type q4_0 --levels 0,1,50 --rounds 7

One backend per level (``BackendParams.poll``; with ``--adapt`` also one per level that adapts its
thread count to the machine's load, ``BackendParams.adapt_threads``, the default), the same model
file, all threads always unless adapting; each round prefills
``--prompt`` tokens and then times ``--tokens`` single-token decode steps through the engine, level
after level, so that all levels see the same machine. Prints each level's median and every round.
Run it on a quiet machine: it measures what spinning between graphs buys when nothing competes
(``bench/contention.py`` measures what it costs when something does).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from pyggml import BackendParams, models  # noqa: E402
from pyggml.bench import add_model_arguments, model_argument  # noqa: E402
from pyggml.input import Batch  # noqa: E402
from pyggml.runner.engine import Engine  # noqa: E402


def decode_speed(model, n_prompt: int, n_tokens: int) -> float:
    model.cache.cells.clear()
    engine = Engine(model, keep=2)
    try:
        engine.forward(Batch(inputs=[5] * n_prompt, outputs=[n_prompt - 1], positions=list(range(n_prompt)),
                             sequences=[0] * n_prompt))
        start = time.perf_counter()
        for i in range(n_tokens):
            engine.forward(Batch(inputs=[7], outputs=[0], positions=[n_prompt + i], sequences=[0]))
        return n_tokens / (time.perf_counter() - start)
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--levels", default="0,1,50", help="poll levels, comma-separated (default: 0,1,50)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=256, help="tokens prefilled before timing (default: 256)")
    parser.add_argument("--tokens", type=int, default=48, help="decode steps timed per round (default: 48)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--adapt", action="store_true",
                        help="also time each level with adapt_threads (pyggml's default): its cost on a quiet machine")
    args = parser.parse_args()
    args.model = model_argument(parser, args)
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    loaded = {}
    for level in levels:
        for adapt in (False, True) if args.adapt else (False,):
            model = models.load(args.model, BackendParams(n_threads=args.threads, poll=level, adapt_threads=adapt))
            model.cache.init(model.backend, "f16", max_sequences=1, capacity=args.prompt + args.tokens,
                             max_batch=args.prompt)
            loaded[f"poll {level:3d}{' adapt' if adapt else ''}"] = model
    speeds: dict[str, list[float]] = {name: [] for name in loaded}
    try:
        for _ in range(args.rounds):
            for name, model in loaded.items():
                speeds[name].append(decode_speed(model, args.prompt, args.tokens))
    finally:
        for model in loaded.values():
            model.close()
    print(f"{args.model.name}, {args.threads} threads, {args.tokens} decode steps after {args.prompt} tokens, "
          f"{args.rounds} rounds")
    for name, values in speeds.items():
        print(f"{name:15s}: median {statistics.median(values):7.2f} t/s   rounds "
              + " ".join(f"{v:.2f}" for v in values))


if __name__ == "__main__":
    main()
