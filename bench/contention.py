"""Latency of single requests while other processes keep every core busy: pyggml against
llama.cpp (llama-cpp-python), same model, same prompt, same number of tokens (issue 13, item 12).

    python bench/contention.py ../shared/models/stories260K.gguf --tokens 64 --requests 5 --rounds 3

Each configuration runs in its own process (one at a time, interleaved round by round, so that all
of them see the same background), loads the model, generates once to warm up, then times
``--requests`` greedy completions of ``--tokens`` tokens with the end-of-generation tokens banned.
``--busy N`` starts N processes that spin (default: one per logical CPU) for the whole run;
``--busy 0`` measures the machine as it is. Prints one JSON line per configuration and round, and
a table of the median and worst request time per configuration at the end.

pyggml configurations: ``t=N`` threads, always all of them; ``poll=P`` the CPU threadpool's poll
level (``BackendParams.poll``: how long idle workers spin for the next graph before sleeping; 0
sleeps at once, 1 is pyggml's default, 50 ggml's); ``(default)``: pyggml's defaults, poll 1 and
``BackendParams.adapt_threads`` (fewer threads while other processes keep cores busy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PYGGML = [("pyggml t=2 (default)", ["--engine", "pyggml", "--threads", "2", "--poll", "1", "--adapt"]),
          ("pyggml t=2 poll=50", ["--engine", "pyggml", "--threads", "2", "--poll", "50"]),
          ("pyggml t=2 poll=1", ["--engine", "pyggml", "--threads", "2", "--poll", "1"]),
          ("pyggml t=2 poll=0", ["--engine", "pyggml", "--threads", "2", "--poll", "0"]),
          ("pyggml t=1", ["--engine", "pyggml", "--threads", "1", "--poll", "1"])]
LLAMA = [("llama.cpp t=2", ["--engine", "llama.cpp", "--threads", "2"]),
         ("llama.cpp t=1", ["--engine", "llama.cpp", "--threads", "1"])]


def child(args: argparse.Namespace) -> None:
    prompt = "Once upon a time"
    times = []
    if args.engine == "pyggml":
        from pyggml import BackendParams, models
        from pyggml.runner import CompletionRequest, Runner

        model = models.load(args.model, BackendParams(n_threads=args.threads, poll=args.poll,
                                                      adapt_threads=args.adapt))
        ban = {t: -100.0 for t in model.tokenizer.vocab.eog}
        with Runner(model, parallel=1, num_ctx=256) as runner:
            for i in range(args.requests + 1):
                start = time.perf_counter()
                chunks = list(runner.completion(CompletionRequest(prompt, max_tokens=args.tokens, temperature=0,
                                                                  logit_bias=ban, cache_prompt=False)))
                assert chunks[-1].generated_tokens == args.tokens
                if i:
                    times.append(time.perf_counter() - start)
        model.close()
    else:
        from llama_cpp import Llama

        llm = Llama(args.model, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=256, verbose=False)
        ban = {llm.token_eos(): -100.0}
        for i in range(args.requests + 1):
            llm.reset()
            start = time.perf_counter()
            out = llm.create_completion(prompt, max_tokens=args.tokens, temperature=0, logit_bias=ban)
            assert out["usage"]["completion_tokens"] == args.tokens
            if i:
                times.append(time.perf_counter() - start)
    print(json.dumps({"times": times}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--timeout", type=float, default=600, help="seconds one configuration may take")
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--poll", type=int, default=50, help=argparse.SUPPRESS)
    parser.add_argument("--adapt", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        child(args)
        return
    try:
        import llama_cpp  # noqa: F401
        configs = PYGGML + LLAMA
    except ImportError:
        print("llama-cpp-python is absent: measuring pyggml only", file=sys.stderr)
        configs = PYGGML
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    results: dict[str, list[float]] = {name: [] for name, _ in configs}
    try:
        for r in range(args.rounds):
            for name, extra in configs:
                cmd = [sys.executable, __file__, args.model, "--tokens", str(args.tokens), "--requests",
                       str(args.requests), *extra]
                try:
                    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=True)
                    times = json.loads(out.stdout.strip().splitlines()[-1])["times"]
                except subprocess.TimeoutExpired:
                    times = [float("inf")]
                results[name] += times
                print(json.dumps({"config": name, "round": r, "busy": args.busy, "times": times}), flush=True)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    print(f"\n{args.tokens} tokens per request, {args.busy} busy processes, {os.cpu_count()} logical CPUs")
    print(f"{'configuration':24s} {'median s':>9s} {'worst s':>9s} {'tokens/s (median)':>18s}")
    for name, times in results.items():
        med = statistics.median(times)
        print(f"{name:24s} {med:9.3f} {max(times):9.3f} {args.tokens / med:18.1f}")


if __name__ == "__main__":
    main()
