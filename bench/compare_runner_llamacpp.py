"""Aggregate generation throughput with several concurrent sequences, and time to first token for
a long prompt cached and uncached: pyggml against llama.cpp (llama-cpp-python) on the same GGUF.

    python bench/compare_runner_llamacpp.py --synthetic llama-3.2-1b --type q4_0 --threads 2 \\
        --parallel 1,4,8 -n 128 --rounds 3 --llama-cpp-path /tmp/llcpp_noamx --json runner.json
    python bench/compare_runner_llamacpp.py MODEL.gguf --engines pyggml,llama.cpp --parallel 1,2 -n 16

Engines (``--engines``, default all four), each measured in its own subprocess:

- ``pyggml``: ``pyggml.runner.Runner(model, parallel=P, num_ctx=C, batch_size=B)``, one client
  thread per sequence calling ``runner.completion``.
- ``llama.cpp``: llama.cpp's low-level batched API through llama-cpp-python's ctypes bindings:
  one context with ``n_seq_max=P``, ``n_ctx=P*C`` (llama.cpp's default split KV cache gives each
  sequence C cells), the P prompts decoded together, then one ``llama_decode`` per step holding
  the next token of every sequence; logits by ``llama_get_logits_ith``, greedy argmax in numpy.
  This is what a llama.cpp server with P slots does, without the HTTP.
- ``pyggml-serve``: ``pyggml serve --parallel P --ctx C`` and P concurrent HTTP clients on
  ``/v1/completions`` (non-streaming).
- ``llama-cpp-server``: ``python -m llama_cpp.server`` (llama-cpp-python's OpenAI server), same
  clients. It has no parallel slots: one ``Llama`` object behind a lock, so concurrent requests
  are served one after another (``--interrupt_requests False`` so that a waiting request does
  not cut the running one short; ``--logits_all False`` so that prompts do not compute logits for
  every token).

Every engine gets the same P prompt texts (``--prompt-tokens`` tokens each by pyggml's tokenizer,
distinct from their first word), the same thread count for prompt and generation, batch size B
(llama.cpp's n_batch and n_ubatch), an F16 KV cache, no flash attention (``--flash-attn``: on in
all), greedy sampling (temperature 0, no repeat penalty) and exactly ``-n`` generated tokens per sequence: the
end-of-generation tokens are banned (logit bias -inf in-process, -100 over HTTP; the low-level
API masks them before its argmax). Throughput = all generated tokens / wall time from the first
request to the last token (prompt processing of the P short prompts included, model load and a
warm-up request excluded). For the servers the generated count is the ``usage`` they report.

Time to first token (``--ttft-tokens``, default 1000; 0 skips): one sequence, a prompt of that
many tokens (uncached: a fresh context), then the same prompt with a few more words (cached: the
engine can reuse the first request's keys and values), each asking for one token. The servers'
figure is the latency of a ``max_tokens=1`` request.

Runs alternate engines (pyggml, llama.cpp, pyggml-serve, llama-cpp-server, pyggml, ...) for
``--rounds`` rounds, so drift of the machine hits them alike. The first round also checks that
pyggml and the low-level API tokenized the prompts alike and generated the same first
``--check-tokens`` greedy tokens (both run ggml; a warning, not an error, if they differ), and
that the two servers returned the same completion texts.

On CPUs with AMX a native llama-cpp-python build crashes on quantized models: pass a build
without AMX with ``--llama-cpp-path`` (see compare_llamacpp.py and docs/bench.md); it is put first
on the llama.cpp children's ``PYTHONPATH`` (the server too). The server engines need
``pip install -e ".[bench]"`` (uvicorn, fastapi, sse-starlette, starlette-context, ...) and httpx.

Exit status 1 when any run failed (its error is in the table and the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_llamacpp import run_child  # noqa: E402  (a script beside this one, not a package)

ENGINES = ("pyggml", "llama.cpp", "pyggml-serve", "llama-cpp-server")
LLAMA_ENGINES = ("llama.cpp", "llama-cpp-server")
SERVERS = ("pyggml-serve", "llama-cpp-server")
RATIOS = ("pyggml/llama.cpp", "pyggml-serve/llama-cpp-server")
WORDS = ("apple river stone cloud music paper garden window silver orange forest candle bridge winter "
         "planet engine yellow castle dragon letter market pencil rocket summer thunder valley violin "
         "wizard anchor basket circle desert feather harbor island jacket kettle ladder meadow needle "
         "ocean pepper quartz ribbon saddle tiger umbrella velvet wagon zebra").split()
F16 = 1  # GGML_TYPE_F16


# ---- prompts (parent) ----------------------------------------------------------------------------
def make_prompts(model: Path, count: int, n_tokens: int, seed: int = 0) -> tuple[list[str], list[int]]:
    """``count`` texts of at least ``n_tokens`` tokens (pyggml's tokenizer, BOS included), each
    starting with a different word so that no two share a cached prefix beyond BOS."""
    from pyggml.backend import Backend, BackendParams
    from pyggml.tokenizer import from_metadata

    backend = Backend.load(model, BackendParams(n_threads=1, repack=False))
    try:
        tok = from_metadata(backend.config)
    finally:
        backend.close()
    rng = random.Random(seed)
    texts, lengths = [], []
    for i in range(count):
        words = [WORDS[(seed * 7 + i) % len(WORDS)] + str(i)]
        while len(tok.encode(" ".join(words), add_special=True)) < n_tokens:
            words.append(rng.choice(WORDS))
        texts.append(" ".join(words))
        lengths.append(len(tok.encode(texts[-1], add_special=True)))
    return texts, lengths


# ---- one measured run (in a child process) -----------------------------------------------------
def _max_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


class PyggmlEngine:
    def __init__(self, args: argparse.Namespace, parallel: int, n_ctx: int):
        from pyggml import models
        from pyggml.backend import BackendParams
        from pyggml.runner import Runner

        start = time.perf_counter()
        self.model = models.load(args.model, BackendParams(n_threads=args.threads, flash_attention=args.flash_attn))
        self.runner = Runner(self.model, parallel=parallel, num_ctx=n_ctx, batch_size=args.n_batch)
        self.load_s = time.perf_counter() - start
        self.bias = {t: float("-inf") for t in self.model.tokenizer.vocab.eog}

    def generate(self, prompts: list[str], n_gen: int) -> dict[str, Any]:
        from pyggml.runner import CompletionRequest

        results: list[dict[str, Any] | None] = [None] * len(prompts)
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                request = CompletionRequest(prompt=prompts[i], max_tokens=n_gen, temperature=0, repeat_penalty=1.0,
                                            logit_bias=self.bias)
                tokens: list[int] = []
                for chunk in self.runner.completion(request):
                    tokens += chunk.tokens
                    if chunk.done:
                        results[i] = {"tokens": tokens, "generated": chunk.generated_tokens,
                                      "cached": chunk.cached_tokens, "reason": chunk.finish_reason}
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        if errors:
            raise errors[0]
        encode = self.model.tokenizer.encode
        return {"wall_s": wall, "generated": sum(r["generated"] for r in results),
                "tokens": [r["tokens"] for r in results], "prompt_ids": [encode(p, add_special=True) for p in prompts],
                "cached": [r["cached"] for r in results]}

    def close(self) -> None:
        self.runner.close()
        self.model.close()


class LlamaCppEngine:
    """P sequences in one llama.cpp context, decoded together through the low-level C API."""

    def __init__(self, args: argparse.Namespace, parallel: int, n_ctx: int):
        import llama_cpp as L
        import numpy as np

        self.L, self.np = L, np
        self.parallel, self.n_batch = parallel, args.n_batch
        start = time.perf_counter()
        L.llama_backend_init()
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self.model = L.llama_model_load_from_file(str(args.model).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {args.model}")
        cparams = L.llama_context_default_params()
        cparams.n_ctx = n_ctx * parallel
        cparams.n_seq_max = parallel
        cparams.n_batch = cparams.n_ubatch = args.n_batch
        cparams.n_threads = cparams.n_threads_batch = args.threads
        fa = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if args.flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.flash_attn_type = fa
        cparams.type_k = cparams.type_v = F16
        cparams.kv_unified = args.kv_unified
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create the context")
        self.load_s = time.perf_counter() - start
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.eog = np.array([t for t in range(self.n_vocab) if L.llama_vocab_is_eog(self.vocab, t)], np.int64)
        self.batch = L.llama_batch_init(max(args.n_batch, parallel), 0, parallel)
        self.settings = {"n_ctx": L.llama_n_ctx(self.ctx), "n_seq_max": L.llama_n_seq_max(self.ctx),
                         "kv_unified": bool(args.kv_unified)}

    def tokenize(self, text: str) -> list[int]:
        L = self.L
        raw = text.encode()
        size = len(raw) + 8
        while True:
            buf = (L.llama_token * size)()
            n = L.llama_tokenize(self.vocab, raw, len(raw), buf, size, True, False)
            if n >= 0:
                return list(buf[:n])
            if -n <= size:
                raise RuntimeError(f"llama_tokenize failed ({n})")
            size = -n

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> dict[int, int]:
        """Decode (token, position, sequence, wants_logits) items, n_batch at a time; the greedy
        next token of each sequence that asked for logits (read before the next chunk overwrites them)."""
        L, b = self.L, self.batch
        sampled: dict[int, int] = {}
        for lo in range(0, len(items), self.n_batch):
            chunk = items[lo:lo + self.n_batch]
            for i, (token, pos, seq, logits) in enumerate(chunk):
                b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
                b.seq_id[i][0] = seq
                b.logits[i] = logits
            b.n_tokens = len(chunk)
            status = L.llama_decode(self.ctx, b)
            if status != 0:
                raise RuntimeError(f"llama_decode returned {status}")
            for i, (_, _, seq, logits) in enumerate(chunk):
                if logits:
                    sampled[seq] = self._argmax(i)
        return sampled

    def _argmax(self, index: int) -> int:
        np = self.np
        row = np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, index), shape=(self.n_vocab,)).copy()
        row[self.eog] = -np.inf
        return int(np.argmax(row))

    def clear(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def generate(self, prompts: list[str], n_gen: int) -> dict[str, Any]:
        start = time.perf_counter()
        ids = [self.tokenize(p) for p in prompts]
        # the prompts one after another (logits for each one's last token), then one token per sequence a step
        first = self._decode([(t, pos, s, pos == len(p) - 1) for s, p in enumerate(ids) for pos, t in enumerate(p)])
        tokens = [[first[s]] for s in range(len(ids))]
        for step in range(1, n_gen):
            nxt = self._decode([(tokens[s][-1], len(ids[s]) + step - 1, s, True) for s in range(len(ids))])
            for s in range(len(ids)):
                tokens[s].append(nxt[s])
        wall = time.perf_counter() - start
        return {"wall_s": wall, "generated": sum(len(t) for t in tokens), "tokens": tokens, "prompt_ids": ids}

    def ttft(self, prompt: str, longer: str) -> dict[str, Any]:
        """Seconds to the first token of ``prompt`` on an empty cache, then of ``longer`` (which
        extends it) reusing the first prompt's cells; and the two prompts' token counts."""
        a, b = self.tokenize(prompt), self.tokenize(longer)
        common = 0
        while common < min(len(a), len(b)) - 1 and a[common] == b[common]:
            common += 1
        self.clear()
        times = []
        for ids, keep in ((a, 0), (b, common)):
            start = time.perf_counter()
            self.L.llama_memory_seq_rm(self.L.llama_get_memory(self.ctx), 0, keep, -1)
            self._decode([(t, pos, 0, pos == len(ids) - 1) for pos, t in enumerate(ids) if pos >= keep])
            times.append(time.perf_counter() - start)
        return _ttft(times, [len(a), len(b)], common)

    def close(self) -> None:
        L = self.L
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)


class ServerEngine:
    """A server in a subprocess, driven by concurrent HTTP clients."""

    def __init__(self, args: argparse.Namespace, engine: str, parallel: int, n_ctx: int):
        import asyncio

        import httpx

        self.httpx = httpx
        self.loop = asyncio.new_event_loop()
        self.client: Any = None
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = dict(os.environ)
        if engine == "pyggml-serve":
            cmd = [sys.executable, "-m", "pyggml.cli", "serve", str(args.model), "--port", str(port),
                   "--parallel", str(parallel), "--ctx", str(n_ctx), "--threads", str(args.threads),
                   "--batch-size", str(args.n_batch), "--flash-attn", "on" if args.flash_attn else "off"]
        else:  # one sequence at a time: its context needs no room for the others
            cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(args.model), "--host", "127.0.0.1",
                   "--port", str(port), "--n_ctx", str(n_ctx), "--n_batch", str(args.n_batch),
                   "--n_ubatch", str(args.n_batch), "--n_threads", str(args.threads),
                   "--n_threads_batch", str(args.threads), "--n_gpu_layers", "0",
                   "--flash_attn", str(bool(args.flash_attn)),
                   "--logits_all", "False", "--interrupt_requests", "False", "--verbose", "False"]
            if args.llama_cpp_path:
                env["PYTHONPATH"] = os.pathsep.join([args.llama_cpp_path] + [p for p in [env.get("PYTHONPATH")] if p])
        self.log = tempfile.TemporaryFile()
        start = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode}: {self._log_tail()}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - start > args.timeout:
                raise RuntimeError(f"the server did not start: {self._log_tail()}")
            time.sleep(0.2)
        self.load_s = time.perf_counter() - start
        self.name = httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        self.bias = {str(t): -100.0 for t in _eog_ids(args.model)}

    def _log_tail(self) -> str:
        self.log.seek(0)
        lines = self.log.read().decode(errors="replace").strip().splitlines()
        return lines[-1][:300] if lines else ""

    def _body(self, prompt: str, n_gen: int) -> dict[str, Any]:
        return {"model": self.name, "prompt": prompt, "max_tokens": n_gen, "temperature": 0, "repeat_penalty": 1.0,
                "logit_bias": self.bias, "stream": False}

    async def _requests(self, prompts: list[str], n_gen: int) -> list[dict[str, Any]]:
        import asyncio

        if self.client is None:  # one client (and its pooled connections) for every request
            self.client = self.httpx.AsyncClient(base_url=self.url, timeout=None,
                                                 limits=self.httpx.Limits(max_connections=None))

        start = time.perf_counter()

        async def one(prompt: str) -> dict[str, Any]:
            r = await self.client.post("/v1/completions", json=self._body(prompt, n_gen))
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
            return {**r.json(), "latency_s": time.perf_counter() - start}

        return await asyncio.gather(*(one(p) for p in prompts))

    def generate(self, prompts: list[str], n_gen: int) -> dict[str, Any]:
        start = time.perf_counter()
        answers = self.loop.run_until_complete(self._requests(prompts, n_gen))
        wall = time.perf_counter() - start
        return {"wall_s": wall, "generated": sum(a["usage"]["completion_tokens"] for a in answers),
                "texts": [a["choices"][0]["text"] for a in answers],
                "prompt_tokens": [a["usage"]["prompt_tokens"] for a in answers],
                "latency_s": sorted(a["latency_s"] for a in answers),  # one after another, or together?
                "cached_tokens": [(a["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                                  for a in answers]}

    def ttft(self, prompt: str, longer: str) -> dict[str, Any]:
        times, counts, cached = [], [], None
        for text in (prompt, longer):
            start = time.perf_counter()
            answer = self.generate([text], 1)
            times.append(time.perf_counter() - start)
            counts.append(answer["prompt_tokens"][0])
            cached = answer["cached_tokens"][0]
        return _ttft(times, counts, cached)

    def server_rss(self) -> int:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def close(self) -> None:
        if self.client is not None:
            self.loop.run_until_complete(self.client.aclose())
        self.loop.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _eog_ids(model: Path) -> list[int]:
    from pyggml.backend import Backend, BackendParams
    from pyggml.tokenizer import from_metadata

    backend = Backend.load(model, BackendParams(n_threads=1, repack=False))
    try:
        return sorted(from_metadata(backend.config).vocab.eog)
    finally:
        backend.close()


def _pyggml_ttft(engine: PyggmlEngine, prompt: str, longer: str) -> dict[str, Any]:
    from pyggml.runner import CompletionRequest

    times, counts = [], []
    for text in (prompt, longer):
        start = time.perf_counter()
        stream = iter(engine.runner.completion(CompletionRequest(prompt=text, max_tokens=1, temperature=0,
                                                                 logit_bias=engine.bias)))
        last = next(stream)
        times.append(time.perf_counter() - start)
        for last in stream:  # noqa: B007 (the final chunk has the counts)
            pass
        counts.append(last.prompt_tokens)
    return _ttft(times, counts, last.cached_tokens)


def _ttft(times: list[float], counts: list[int], cached: int | None = None) -> dict[str, Any]:
    return {"uncached_s": times[0], "cached_s": times[1], "prompt_tokens": counts, "cached_tokens": cached}


def worker(args: argparse.Namespace) -> int:
    if args.worker in LLAMA_ENGINES and args.llama_cpp_path:
        sys.path.insert(0, args.llama_cpp_path)
    job = json.loads(Path(args.job).read_text())
    test, parallel, n_ctx = job["test"], job["parallel"], job["n_ctx"]
    if args.worker == "pyggml":
        engine: Any = PyggmlEngine(args, parallel, n_ctx)
    elif args.worker == "llama.cpp":
        engine = LlamaCppEngine(args, parallel, n_ctx)
    else:
        engine = ServerEngine(args, args.worker, parallel, n_ctx)
    out: dict[str, Any] = {"load_s": engine.load_s}
    try:
        engine.generate([job["warmup"]], 2)  # warm-up: a prompt and a decode step
        if isinstance(engine, LlamaCppEngine):
            engine.clear()
            out["llama_cpp"] = engine.settings
        if test == "throughput":
            out.update(engine.generate(job["prompts"], job["n_gen"]))
        elif isinstance(engine, PyggmlEngine):
            out["ttft"] = _pyggml_ttft(engine, job["prompts"][0], job["prompts"][1])
        else:
            out["ttft"] = engine.ttft(job["prompts"][0], job["prompts"][1])
        if isinstance(engine, ServerEngine):
            out["max_rss_bytes"] = engine.server_rss()
    finally:
        engine.close()
    if args.worker in LLAMA_ENGINES:
        import llama_cpp

        out["version"], out["module"] = llama_cpp.__version__, llama_cpp.__file__
    out.setdefault("max_rss_bytes", _max_rss_bytes())
    print("RESULT " + json.dumps(out), flush=True)
    return 0


# ---- the comparison (parent process) ------------------------------------------------------------
def measure(engine: str, model: Path, job: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """One run of ``engine`` in a fresh subprocess; {"error": ...} when it fails or crashes."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", engine, "--job", f.name, "--model", str(model),
           "--threads", str(args.threads), "--n-batch", str(args.n_batch), "--timeout", str(args.timeout)]
    if args.llama_cpp_path:
        cmd += ["--llama-cpp-path", args.llama_cpp_path]
    if args.kv_unified:
        cmd.append("--kv-unified")
    if args.flash_attn:
        cmd.append("--flash-attn")
    try:
        return run_child(cmd, args.timeout)
    finally:
        os.unlink(f.name)


def _stats(values: list[float]) -> dict[str, Any]:
    return {"samples": values, "avg": statistics.fmean(values), "median": statistics.median(values),
            "stddev": statistics.stdev(values) if len(values) > 1 else 0.0}


def _side(runs: list[dict[str, Any]]) -> dict[str, Any]:
    side: dict[str, Any] = {"errors": sorted({r["error"] for r in runs if "error" in r}),
                            "failed_runs": sum("error" in r for r in runs),
                            "max_rss_bytes": max((r.get("max_rss_bytes", 0) for r in runs), default=0)}
    loads = [r["load_s"] for r in runs if "load_s" in r]
    side["load_s"] = statistics.fmean(loads) if loads else None
    modules = sorted({r["module"] for r in runs if "module" in r})
    if modules:
        side["module"] = modules[0]
    return side


def check_agreement(a: dict[str, Any], b: dict[str, Any], n_check: int) -> list[str]:
    """Where pyggml's and the low-level API's prompt ids and first greedy tokens differ."""
    problems = []
    for s, (pa, pb) in enumerate(zip(a.get("prompt_ids", []), b.get("prompt_ids", []), strict=False)):
        if pa != pb:
            problems.append(f"sequence {s}: prompt tokenized differently ({len(pa)} vs {len(pb)} tokens)")
    for s, (ta, tb) in enumerate(zip(a.get("tokens", []), b.get("tokens", []), strict=False)):
        if ta[:n_check] != tb[:n_check]:
            problems.append(f"sequence {s}: first tokens differ: pyggml {ta[:n_check]} vs llama.cpp {tb[:n_check]}")
    return problems


def compare(model: Path, label: str, args: argparse.Namespace) -> dict[str, Any]:
    n_prompts = max(args.parallel)
    prompts, prompt_lengths = make_prompts(model, n_prompts + 1, args.prompt_tokens)
    warmup, prompts = prompts[-1], prompts[:-1]
    n_ctx = args.ctx or _round_up(args.prompt_tokens + args.n_gen + 16, 256)
    rows: list[dict[str, Any]] = []
    warnings: list[str] = []
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {p: {e: [] for e in args.engines} for p in args.parallel}
    ttft_runs: dict[str, list[dict[str, Any]]] = {e: [] for e in args.engines}
    agreement: dict[int, list[str]] = {}
    ttft_job = None
    if args.ttft_tokens:
        long_text, long_len = make_prompts(model, 1, args.ttft_tokens, seed=1)
        extra = " " + WORDS[0]  # a few more tokens: the first request's are reusable
        ttft_job = {"test": "ttft", "parallel": 1, "n_ctx": _round_up(long_len[0] + 64, 256), "warmup": warmup,
                    "prompts": [long_text[0], long_text[0] + extra], "n_gen": 1}
    for rnd in range(args.rounds):
        for parallel in args.parallel:
            job = {"test": "throughput", "parallel": parallel, "n_ctx": n_ctx, "warmup": warmup,
                   "prompts": prompts[:parallel], "n_gen": args.n_gen}
            for engine in args.engines:
                r = measure(engine, model, job, args)
                runs[parallel][engine].append(r)
                brief = r.get("error") or (f"{r['generated']} tokens in {r['wall_s']:.2f} s = "
                                           f"{r['generated'] / r['wall_s']:.2f} t/s (load {r['load_s']:.1f} s)")
                if "latency_s" in r and parallel > 1:
                    brief += ", requests done at " + " ".join(f"{t:.1f}" for t in r["latency_s"]) + " s"
                print(f"[{label} P={parallel} round {rnd + 1}/{args.rounds}] {engine}: {brief}", file=sys.stderr,
                      flush=True)
            if rnd == 0 and {"pyggml", "llama.cpp"} <= set(args.engines):
                a, b = runs[parallel]["pyggml"][0], runs[parallel]["llama.cpp"][0]
                if "error" not in a and "error" not in b:
                    problems = check_agreement(a, b, args.check_tokens)
                    agreement[parallel] = problems or [f"ok: same prompt ids and first {args.check_tokens} tokens "
                                                       f"in all {parallel} sequences"]
                    for problem in problems:
                        warnings.append(f"P={parallel}: {problem}")
                        print(f"WARNING: pyggml and llama.cpp disagree at P={parallel}: {problem}",
                              file=sys.stderr, flush=True)
            if rnd == 0 and set(SERVERS) <= set(args.engines):
                a, b = runs[parallel][SERVERS[0]][0], runs[parallel][SERVERS[1]][0]
                if "texts" in a and "texts" in b:
                    same = sum(x == y for x, y in zip(a["texts"], b["texts"], strict=False))
                    if same < parallel:
                        warnings.append(f"P={parallel}: the two servers' completions differ in {parallel - same} "
                                        f"of {parallel} sequences")
                        print(f"WARNING: {warnings[-1]}", file=sys.stderr, flush=True)
        if ttft_job is not None:
            for engine in args.engines:
                r = measure(engine, model, ttft_job, args)
                ttft_runs[engine].append(r)
                t = r.get("ttft", {})
                brief = r.get("error") or (f"{t['uncached_s']:.3f} s uncached ({t['prompt_tokens'][0]} tokens), "
                                           f"{t['cached_s']:.3f} s cached ({t['prompt_tokens'][1]} tokens, "
                                           f"{t['cached_tokens']} reused)")
                print(f"[{label} TTFT round {rnd + 1}/{args.rounds}] {engine}: {brief}", file=sys.stderr, flush=True)
    for parallel in args.parallel:
        row: dict[str, Any] = {"parallel": parallel, "n_gen": args.n_gen}
        for engine in args.engines:
            ok = [r for r in runs[parallel][engine] if "wall_s" in r]
            side = _side(runs[parallel][engine])
            if ok:
                side["tok_s"] = _stats([r["generated"] / r["wall_s"] for r in ok])
                side["generated"] = ok[0]["generated"]
                if any(r["generated"] != parallel * args.n_gen for r in ok):
                    warnings.append(f"P={parallel} {engine}: generated {ok[0]['generated']} tokens, "
                                    f"not {parallel * args.n_gen}")
            if ok and "llama_cpp" in ok[0]:
                side["settings"] = ok[0]["llama_cpp"]
            if ok and "latency_s" in ok[0]:  # when each request finished, per run
                side["request_latency_s"] = [r["latency_s"] for r in ok]
            row[engine] = side
        rows.append(row)
    base = {e: next((r[e]["tok_s"]["avg"] for r in rows if r["parallel"] == min(args.parallel) and "tok_s" in r[e]),
                    None) for e in args.engines}
    for row in rows:
        for engine in args.engines:
            side = row[engine]
            if "tok_s" in side and base[engine]:
                side["scaling"] = side["tok_s"]["avg"] / base[engine]
        row["ratios"] = {}
        for name in RATIOS:
            ours, theirs = name.split("/")
            a, b = row.get(ours, {}).get("tok_s"), row.get(theirs, {}).get("tok_s")
            if a and b:
                row["ratios"][name] = a["avg"] / b["avg"]
    ttft: dict[str, Any] = {}
    if ttft_job is not None:
        for engine in args.engines:
            ok = [r for r in ttft_runs[engine] if "ttft" in r]
            side = _side(ttft_runs[engine])
            if ok:
                side["uncached_s"] = _stats([r["ttft"]["uncached_s"] for r in ok])
                side["cached_s"] = _stats([r["ttft"]["cached_s"] for r in ok])
                side["prompt_tokens"] = ok[0]["ttft"]["prompt_tokens"]
                side["cached_tokens"] = ok[0]["ttft"]["cached_tokens"]
            ttft[engine] = side
    return {"model": label, "path": str(model), "size": model.stat().st_size, "threads": args.threads,
            "n_ctx_per_sequence": n_ctx, "prompt_tokens": prompt_lengths[:n_prompts], "throughput": rows,
            "ttft": ttft, "agreement": agreement, "warnings": warnings}


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def markdown(result: dict[str, Any], engines: list[str]) -> str:
    head = ["sequences"] + [f"{e} t/s" for e in engines] + [f"{e} xP1" for e in engines]
    ratio_names = [k for k in RATIOS if any(k in r["ratios"] for r in result["throughput"])]
    head += ratio_names
    lines = [f"{result['model']}, {result['threads']} threads, {result['throughput'][0]['n_gen']} tokens per "
             f"sequence, context {result['n_ctx_per_sequence']} per sequence", "",
             "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]

    def ts(side: dict[str, Any]) -> str:
        if "tok_s" not in side:
            return "error: " + "; ".join(side["errors"])
        failed = f" ({side['failed_runs']} failed)" if side["failed_runs"] else ""
        return f"{side['tok_s']['avg']:.2f} ± {side['tok_s']['stddev']:.2f}{failed}"

    for r in result["throughput"]:
        cells = [str(r["parallel"])] + [ts(r[e]) for e in engines]
        cells += [f"{r[e]['scaling']:.2f}" if "scaling" in r[e] else "-" for e in engines]
        cells += [f"{r['ratios'][k]:.2f}" if k in r["ratios"] else "-" for k in ratio_names]
        lines.append("| " + " | ".join(cells) + " |")
    if result["ttft"]:
        lines += ["", "| time to first token | prompt tokens | uncached s | cached s | RSS MiB |",
                  "|---|---|---|---|---|"]
        for engine, side in result["ttft"].items():
            if "uncached_s" not in side:
                lines.append(f"| {engine} | - | error: {'; '.join(side['errors'])} | - | - |")
                continue
            n_first, n_second = side["prompt_tokens"]
            lines.append(f"| {engine} | {n_first} + {n_second - n_first} | "
                         f"{side['uncached_s']['avg']:.3f} ± {side['uncached_s']['stddev']:.3f} | "
                         f"{side['cached_s']['avg']:.3f} ± {side['cached_s']['stddev']:.3f} | "
                         f"{side['max_rss_bytes'] / 2**20:.0f} |")
    rss = [f"{e} {max(r[e]['max_rss_bytes'] for r in result['throughput']) / 2**20:.0f}" for e in engines]
    lines += ["", "peak RSS MiB: " + ", ".join(rss)]
    for w in result["warnings"]:
        lines.append(f"WARNING: {w}")
    return "\n".join(lines)


def _list(kind: type) -> Any:
    return lambda text: [kind(v.strip()) for v in text.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="pyggml vs llama.cpp: aggregate tokens/s with concurrent sequences "
                                     "and time to first token.")
    parser.add_argument("model", nargs="?", type=Path, help="a GGUF file (or --synthetic)")
    parser.add_argument("--synthetic", metavar="SHAPE", help="a random-weight model of this shape "
                        "(pyggml.synthetic.SHAPES), cached in the pyggml cache directory")
    parser.add_argument("--type", default="q4_0", help="weight type of the --synthetic model (default: q4_0)")
    parser.add_argument("--engines", type=_list(str), default=list(ENGINES),
                        help=f"comma-separated, of {','.join(ENGINES)} (default: all)")
    parser.add_argument("-P", "--parallel", type=_list(int), default=[1, 4, 8],
                        help="concurrent sequences (default: 1,4,8)")
    parser.add_argument("-t", "--threads", type=int, default=2, help="threads, prompt and generation (default: 2)")
    parser.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens per sequence (default: 128)")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="tokens per prompt (default: 32)")
    parser.add_argument("--ctx", type=int, default=0, help="context per sequence (default: prompt + n + 16, "
                        "rounded up to 256)")
    parser.add_argument("-b", "--n-batch", type=int, default=512, help="batch size (all engines; default: 512)")
    parser.add_argument("--ttft-tokens", type=int, default=1000, help="prompt tokens for the time-to-first-token "
                        "test (default: 1000; 0 skips it)")
    parser.add_argument("--kv-unified", action="store_true", help="llama.cpp low-level API: one KV buffer shared "
                        "by all sequences (default: llama.cpp's default, one per sequence)")
    parser.add_argument("--flash-attn", action="store_true", help="ggml's fused flash attention in every engine "
                        "(default: off in all)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: 3)")
    parser.add_argument("--check-tokens", type=int, default=8, help="greedy tokens compared between pyggml and the "
                        "low-level API (default: 8)")
    parser.add_argument("--llama-cpp-path", help="directory put first on sys.path / PYTHONPATH for llama_cpp "
                        "(e.g. a build without AMX: see docs/bench.md)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run (default: 1800)")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--model", dest="worker_model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.model = args.worker_model
        return worker(args)
    unknown = [e for e in args.engines if e not in ENGINES]
    if unknown or not args.engines:
        parser.error(f"unknown engine(s) {unknown}; choose from {', '.join(ENGINES)}")
    if not args.parallel or min(args.parallel) < 1 or args.n_gen < 1 or args.rounds < 1 or args.threads < 1 \
            or args.prompt_tokens < 2 or args.ttft_tokens < 0 or args.n_batch < 1:
        parser.error("need positive --parallel, -n, --rounds, --threads, --n-batch, --prompt-tokens >= 2")
    if args.model is not None:
        if not args.model.is_file():
            parser.error(f"no such model file: {args.model}")
        model, label = args.model, args.model.name
    elif args.synthetic:
        from pyggml.bench import synthetic_model

        model, label = synthetic_model(args.synthetic, args.type), f"{args.synthetic} {args.type.upper()}"
    else:
        parser.error("give a MODEL or --synthetic SHAPE")
    result = compare(model, label, args)
    print(markdown(result, args.engines))
    if args.json:
        settings = {k: getattr(args, k) for k in ("engines", "parallel", "threads", "n_gen", "prompt_tokens", "n_batch",
                                                  "ttft_tokens", "kv_unified", "rounds", "llama_cpp_path")}
        from pyggml.bench import cpu_info

        doc = {"settings": {**settings, "cache_type": "f16", "flash_attn": bool(args.flash_attn)},
               "machine": {"cpu": cpu_info(), "load_average": os.getloadavg()}, "result": result}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    sides = [r[e] for r in result["throughput"] for e in args.engines] + list(result["ttft"].values())
    return 1 if any(s["errors"] for s in sides) else 0


if __name__ == "__main__":
    sys.exit(main())
