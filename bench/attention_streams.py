"""One decode graph of P sequences against the same tokens of one sequence (issue 17).

    python bench/attention_streams.py --synthetic tinyllama-1.1b --type q4_0 --history 40,100,200,400

Both graphs carry P tokens through the same weights; only attention differs: P tokens of P
sequences each with ``history`` positions (each attends over its own cells: the KV streams) against
P consecutive tokens of one sequence. Prints the median compute time of each over ``--repeats``
computes of the same graph and their ratio, per history length (1.0: attention over P histories
costs no more than over one). ``--unified`` pools the cells as before the streams.
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


def compute_ms(model, history: int, seqs: list[int], batch: Batch, repeats: int, parallel: int) -> float:
    model.cache.init(model.backend, "f16", max_sequences=parallel, capacity=history + parallel + 1,
                     max_batch=max(history, parallel))
    engine = Engine(model, keep=0)
    for s in seqs:  # the histories
        engine.forward(Batch(inputs=[5] * history, outputs=[history - 1], positions=list(range(history)),
                             sequences=[s] * history))
    graph = engine.build(batch)
    times = []
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            graph.ctx.compute(graph.logits)
            times.append(time.perf_counter() - start)
    finally:
        graph.ctx.close()
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--history", default="40,100,200", help="positions per sequence, comma-separated")
    parser.add_argument("-P", "--parallel", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--flash-attn", action="store_true")
    parser.add_argument("--unified", action="store_true", help="one pool of cells for all sequences")
    args = parser.parse_args()
    args.model = model_argument(parser, args)
    model = models.load(args.model, BackendParams(n_threads=args.threads, flash_attention=args.flash_attn))
    if args.unified:
        model.cache.unified = True
    p = args.parallel
    try:
        print(f"{args.model.name}, {args.threads} threads, P={p}, flash attention {'on' if args.flash_attn else 'off'}"
              f"{', unified cells' if args.unified else ''}")
        for history in (int(x) for x in args.history.split(",") if x.strip()):
            many = compute_ms(model, history, list(range(p)),
                              Batch(inputs=[7] * p, outputs=list(range(p)), positions=[history] * p,
                                    sequences=list(range(p))), args.repeats, p)
            one = compute_ms(model, history, [0],
                             Batch(inputs=[7] * p, outputs=list(range(p)), positions=list(range(history, history + p)),
                                   sequences=[0] * p), args.repeats, p)
            print(f"history {history:5d}: {p} sequences x 1 token {many:8.1f} ms; 1 sequence x {p} tokens "
                  f"{one:8.1f} ms; ratio {many / one:.3f}")
    finally:
        model.close()


if __name__ == "__main__":
    main()
