"""Cost of constrained decoding on the critical path: tokens/s of the same-length generation with
and without a grammar (alternating runs, medians), the mask computation time (in the worker, beside
the graph), the time the loop waited for masks after the graph finished, and the time applying them.

    PYTHONPATH=src python bench/constrained_overhead.py ../shared/models/llama-2-tiny-random.gguf

``PYGGML_BENCH_LOOKUP=N`` decodes speculatively (prompt lookup, drafts of N) in both kinds of runs: the
masks of every verified row are then computed in the worker too (``Constraint.compute_draft_masks``).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from pyggml import BackendParams, models
from pyggml.constrain import Constraint, Grammar
from pyggml.runner import CompletionRequest, Runner, plugins


class _TimedFuture:
    def __init__(self, future, waits):
        self.future, self.waits = future, waits

    def result(self):
        t0 = time.perf_counter()
        out = self.future.result()
        self.waits.append(time.perf_counter() - t0)
        return out


def main(path: str, n_tokens: int = 200, rounds: int = 5, threads: int = 2) -> None:
    model = models.load(path, BackendParams(n_threads=threads))
    runner = Runner(model, parallel=1, num_ctx=512, batch_size=64)
    mask_s, wait_s, apply_s = [], [], []
    compute_masks, start_masks, apply = plugins.compute_masks, plugins.Constraints.launched, Constraint.apply

    def timed_compute(constraints):
        t0 = time.perf_counter()
        compute_masks(constraints)
        mask_s.append(time.perf_counter() - t0)

    def timed_start(self, step):
        start_masks(self, step)
        if step.masks is not None:
            step.masks = _TimedFuture(step.masks, wait_s)

    def timed_apply(self, logits, bias=None):
        t0 = time.perf_counter()
        out = apply(self, logits, bias)
        apply_s.append(time.perf_counter() - t0)
        return out

    plugins.compute_masks, plugins.Constraints.launched, Constraint.apply = timed_compute, timed_start, timed_apply
    eog = {t: float("-inf") for t in model.tokenizer.vocab.eog}
    grammar = Grammar.regex(f"[a-z ,.]{{{n_tokens * 8}}}")  # long enough never to end first
    speeds: dict[str, list[float]] = {"plain": [], "grammar": []}
    for r in range(rounds * 2 + 1):
        kind = "plain" if r % 2 else "grammar"
        options = {"grammar": grammar} if kind == "grammar" else {}
        options["prompt_lookup"] = int(os.environ.get("PYGGML_BENCH_LOOKUP", "0"))
        t0 = time.perf_counter()
        *_, last = runner.completion(CompletionRequest(prompt="Once upon a time", max_tokens=n_tokens,
                                                       temperature=0.8, seed=r, logit_bias=eog, cache_prompt=False,
                                                       **options))
        elapsed = last.timings.generate_seconds
        if r:  # the first round warms up
            speeds[kind].append((last.generated_tokens - 1) / elapsed)
        _ = t0
    runner.close()
    model.close()
    ms = lambda xs: f"{statistics.median(xs) * 1e3:.3f} ms"  # noqa: E731
    print(f"{path}: vocab {model.tokenizer.vocab_size}, {n_tokens} tokens, {rounds} alternating rounds each")
    for kind, values in speeds.items():
        print(f"  {kind:8s} median {statistics.median(values):8.1f} tok/s  ({', '.join(f'{v:.0f}' for v in values)})")
    print(f"  mask computed in the worker: median {ms(mask_s)}; the loop waited for it after the graph: "
          f"median {ms(wait_s)}, max {max(wait_s) * 1e3:.3f} ms; applying it: median {ms(apply_s)}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
