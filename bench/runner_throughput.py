"""Aggregate generation throughput of the Runner at 1, 4 and 8 parallel sequences, and time to first
token for a 1,000-token prompt, uncached then cached.

    python bench/runner_throughput.py MODEL.gguf [--threads 2] [--tokens 32]
    python bench/runner_throughput.py --synthetic tinyllama-1.1b --type q4_0
"""

from __future__ import annotations

import argparse
import threading
import time

from pyggml import models
from pyggml.backend import BackendParams
from pyggml.runner import CompletionRequest, Runner


def throughput(model, parallel: int, n_tokens: int) -> float:
    with Runner(model, parallel=parallel, num_ctx=256, batch_size=512) as runner:
        def one(i: int, out: list[int]) -> None:
            request = CompletionRequest(prompt=[1, 300 + i, 400 + i], max_tokens=n_tokens, temperature=0)
            out.append(sum(len(chunk.tokens) for chunk in runner.completion(request)))

        one(0, [])  # warm-up
        out: list[int] = []
        threads = [threading.Thread(target=one, args=(i, out)) for i in range(parallel)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(out) / (time.perf_counter() - start)


def time_to_first_token(model, n_prompt: int = 1000) -> tuple[float, float]:
    vocab = model.tokenizer.vocab_size
    prompt = [1] + [3 + (300 + i) % (vocab - 3) for i in range(n_prompt - 1)]
    times = []
    with Runner(model, parallel=2, num_ctx=2 * n_prompt, batch_size=512) as runner:
        for _ in range(2):  # the second request finds the prefix in a slot
            start = time.perf_counter()
            stream = iter(runner.completion(CompletionRequest(prompt=prompt + [42], max_tokens=1, temperature=0)))
            next(stream)
            times.append(time.perf_counter() - start)
            for _ in stream:
                pass
    return times[0], times[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?")
    parser.add_argument("--synthetic", help="a pyggml.synthetic shape, e.g. tinyllama-1.1b")
    parser.add_argument("--type", default="q4_0")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    path = args.model
    if path is None:
        from pyggml.synthetic import write_synthetic
        from pyggml.tiny import cache_dir

        if not args.synthetic:
            parser.error("give a MODEL or --synthetic SHAPE")
        path = cache_dir() / f"synthetic-{args.synthetic}-{args.type}.gguf"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            write_synthetic(path, args.synthetic, args.type)
    model = models.load(path, BackendParams(n_threads=args.threads))
    try:
        for parallel in (1, 4, 8):
            print(f"parallel={parallel}: {throughput(model, parallel, args.tokens):.1f} tokens/s aggregate", flush=True)
        cold, warm = time_to_first_token(model)
        print(f"time to first token, 1,000-token prompt: {cold:.2f} s uncached, {warm:.2f} s cached")
    finally:
        model.close()


if __name__ == "__main__":
    main()
