"""Speculative decoding, side by side with plain decoding: acceptance rate and generation tokens/s
(alternating runs, medians; greedy, EOG banned so every run generates the same number of tokens).

    PYTHONPATH=src python bench/speculative.py draft            # Q4_0 drafting for Q8_0 of a synthetic shape
    PYTHONPATH=src python bench/speculative.py lookup MODEL.gguf   # prompt lookup on an input-grounded prompt
    PYTHONPATH=src python bench/speculative.py lookup synthetic    # the same on a larger synthetic llama (Q8_0)
    PYTHONPATH=src python bench/speculative.py llamacpp MODEL.gguf # llama-cpp-python's LlamaPromptLookupDecoding

Besides tokens/s it counts the target's forward passes per generated token (graph computes: a
figure timing noise does not touch) and the draft model's. ``PYGGML_BENCH_BUILD_AHEAD=1`` forces
build-ahead on (a GPU's default; the runner then completes a batch before building the next only
while a speculating sequence was sampled in it), ``PYGGML_BENCH_ROUNDS`` sets the rounds (5).
On a shared machine timings are noisy: read the medians, and compare only within one invocation.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pyggml import BackendParams, models
from pyggml.runner import CompletionRequest, Runner
from pyggml.synthetic import Shape, write_synthetic

TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
        "friend Ben. One day, Lily and Ben found a big red ball under a tree. They played with the ball all day. "
        "When the sun went down, Lily said, \"Thank you, Ben, for playing with me.\" Ben smiled and said, "
        "\"You are my best friend, Lily.\"")
PROMPT = f"{TEXT}\nThe story again, word for word:\n{TEXT[:60]}"
SHAPE = Shape(4, 512, 1408, 8, 4, 32000, 2048, 10000.0, False)  # a synthetic llama big enough to be costly
N, THREADS = 128, 1
ROUNDS = int(os.environ.get("PYGGML_BENCH_ROUNDS", "5"))
BUILD_AHEAD = os.environ.get("PYGGML_BENCH_BUILD_AHEAD") == "1" or None  # None: the backend's default


def _passes(runner: Runner | None) -> int:
    return 0 if runner is None else runner.engine.built + runner.engine.reused


def _run(runner: Runner, prompt: str, **options) -> tuple[float, int, int, int, int, int]:
    """tokens/s, drafted, accepted, generated, the target's and the draft model's forward passes."""
    eog = {t: float("-inf") for t in runner.tokenizer.vocab.eog}
    before = _passes(runner), _passes(runner.drafter)
    *_, last = runner.completion(CompletionRequest(prompt=prompt, max_tokens=N, temperature=0, logit_bias=eog,
                                                   cache_prompt=False, **options))
    return ((last.generated_tokens - 1) / last.timings.generate_seconds, last.draft_tokens, last.accepted_tokens,
            last.generated_tokens, _passes(runner) - before[0], _passes(runner.drafter) - before[1])


def _compare(name: str, plain: Runner, spec: Runner, prompt: str, **spec_options) -> None:
    _run(plain, prompt), _run(spec, prompt, **spec_options)  # warm up
    speeds: dict[str, list[float]] = {"plain": [], "speculative": []}
    passes: dict[str, list[tuple[int, int, int]]] = {"plain": [], "speculative": []}
    drafted = accepted = 0
    for _ in range(ROUNDS):
        tps, _, _, n, target, small = _run(plain, prompt)
        speeds["plain"].append(tps)
        passes["plain"].append((n, target, small))
        tps, d, a, n, target, small = _run(spec, prompt, **spec_options)
        speeds["speculative"].append(tps)
        passes["speculative"].append((n, target, small))
        drafted, accepted = drafted + d, accepted + a
    print(f"{name}: {N} tokens x {ROUNDS} alternating rounds, {THREADS} thread(s), build-ahead {spec.build_ahead}")
    for kind, values in speeds.items():
        n, target, small = (sum(x[i] for x in passes[kind]) for i in range(3))
        print(f"  {kind:12s} median {statistics.median(values):7.1f} tok/s  ({', '.join(f'{v:.1f}' for v in values)})"
              f"; target passes per token {target / n:.2f}, draft-model passes per token {small / n:.2f}")
    print(f"  acceptance {accepted}/{drafted} = {accepted / max(drafted, 1):.0%} of drafted tokens, "
          f"{accepted / ROUNDS / N:.2f} accepted per generated token")


def draft() -> None:
    folder = Path(tempfile.mkdtemp())
    t0 = time.perf_counter()
    target = models.load(write_synthetic(folder / "q8.gguf", SHAPE, "q8_0", seed=1), BackendParams(n_threads=THREADS))
    small = models.load(write_synthetic(folder / "q4.gguf", SHAPE, "q4_0", seed=1), BackendParams(n_threads=THREADS))
    print(f"wrote and loaded the Q8_0 target and Q4_0 draft in {time.perf_counter() - t0:.1f} s")
    with Runner(target, parallel=1, num_ctx=1024, batch_size=64, build_ahead=BUILD_AHEAD) as plain:
        with Runner(target, parallel=1, num_ctx=1024, batch_size=64, draft=small, draft_max=4,
                    build_ahead=BUILD_AHEAD) as spec:
            _compare("Q4_0 draft for Q8_0 (random weights, same seed)", plain, spec, PROMPT)


def lookup(path: str) -> None:
    if path == "synthetic":  # a larger model than stories260K: the synthetic shape above, Q8_0
        path = str(write_synthetic(Path(tempfile.mkdtemp()) / "q8.gguf", SHAPE, "q8_0", seed=1))
    model = models.load(path, BackendParams(n_threads=THREADS))
    with Runner(model, parallel=1, num_ctx=1024, batch_size=64, build_ahead=BUILD_AHEAD) as runner:
        _compare(f"prompt lookup (8) on {Path(path).name}", runner, runner, PROMPT, prompt_lookup=8)


def llamacpp(path: str) -> None:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    def run(llm) -> float:
        t0 = time.perf_counter()
        out = llm(PROMPT, max_tokens=N, temperature=0, logit_bias={llm.token_eos(): -1e9})
        return out["usage"]["completion_tokens"] / (time.perf_counter() - t0)

    plain = Llama(path, n_ctx=1024, n_threads=THREADS, verbose=False)
    spec = Llama(path, n_ctx=1024, n_threads=THREADS, verbose=False,
                 draft_model=LlamaPromptLookupDecoding(num_pred_tokens=8))
    run(plain), run(spec)
    speeds = {"plain": [], "lookup": []}
    for _ in range(ROUNDS):
        plain.reset()
        speeds["plain"].append(run(plain))
        spec.reset()
        speeds["lookup"].append(run(spec))
    print(f"llama-cpp-python on {Path(path).name} (wall time incl. prompt; no acceptance counter exposed)")
    for kind, values in speeds.items():
        print(f"  {kind:8s} median {statistics.median(values):7.1f} tok/s  ({', '.join(f'{v:.1f}' for v in values)})")


if __name__ == "__main__":
    {"draft": draft, "lookup": lookup, "llamacpp": llamacpp}[sys.argv[1]](*sys.argv[2:])
