"""pyggml vs llama.cpp (llama-cpp-python), side by side on the same GGUF files and settings.

    python bench/compare_llamacpp.py MODEL.gguf [MODEL2.gguf ...] [--threads 1,2] [-p 512] [-n 128]
    python bench/compare_llamacpp.py --synthetic tinyllama-1.1b --types q4_0,q8_0,f16 --threads 1,2
        [--llama-cpp-path DIR] [--rounds 3] [--json out.json]

Each measurement runs in its own subprocess, one engine at a time, alternating (pyggml, llama.cpp,
pyggml, ...) for ``--rounds`` rounds, so that drift of the machine hits both engines alike, the two
copies of ggml never share a process, and the peak RSS (``ru_maxrss``) is per engine. A run loads
the model, warms up (one pp, one decode step), then times pp<N> (``N`` prompt tokens on a fresh
sequence, in batches of ``--n-batch``) and tg<N> (N single-token decode steps on a fresh sequence).

Settings are identical on both sides: n_ctx = pp + tg, n_batch (= n_ubatch for llama.cpp), the
thread count for prompt and generation, an F16 KV cache, flash attention off unless
``--flash-attn``. llama.cpp goes through the high-level ``llama_cpp.Llama``: ``reset()`` then
``eval(tokens)`` for pp, ``eval([t])`` per token for tg.

On CPUs with AMX (Sapphire Rapids and later), a llama.cpp built with ``-march=native`` crashes
on quantized models (ggml's AMX kernels); build one without AMX into a directory and pass it with
``--llama-cpp-path`` (see docs/bench.md)::

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON \\
      -DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON" \\
      pip install --no-deps --target DIR llama-cpp-python==0.3.36

Exit status 1 when any run failed (its error is in the table and the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ENGINES = ("pyggml", "llama.cpp")


# ---- one measured run (in a child process) -----------------------------------------------------
def _max_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


def run_pyggml(args: argparse.Namespace) -> dict[str, Any]:
    from pyggml.bench import Session

    s = Session(args.model, n_threads=args.threads, flash_attn=args.flash_attn, cache_type="f16",
                n_ctx=args.n_prompt + args.n_gen, max_batch=args.n_batch)
    try:
        out: dict[str, Any] = {"load_s": s.load_s}
        if args.n_prompt:
            s.prompt(args.n_prompt, args.n_batch)  # warm-up
            pp = s.prompt(args.n_prompt, args.n_batch)
            out["pp_s"] = pp.wall_ns / 1e9
        if args.n_gen:
            s.generate(1)  # warm-up
            tg = s.generate(args.n_gen)
            out["tg_s"] = tg.wall_ns / 1e9
            out["tg_python_share"] = 1.0 - tg.parts.compute * 1e9 / tg.wall_ns
    finally:
        s.close()
    return out


def run_llamacpp(args: argparse.Namespace) -> dict[str, Any]:
    if args.llama_cpp_path:
        sys.path.insert(0, args.llama_cpp_path)
    import numpy as np
    from llama_cpp import Llama

    start = time.perf_counter()
    llm = Llama(model_path=str(args.model), n_ctx=args.n_prompt + args.n_gen, n_batch=args.n_batch,
                n_ubatch=args.n_batch, n_threads=args.threads, n_threads_batch=args.threads,
                flash_attn=args.flash_attn, verbose=False)  # KV cache: F16 (llama.cpp's default)
    out: dict[str, Any] = {"load_s": time.perf_counter() - start}
    rng = np.random.default_rng(0)

    def tokens(n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, llm.n_vocab(), n)]

    if args.n_prompt:
        llm.reset()
        llm.eval(tokens(args.n_prompt))  # warm-up
        prompt = tokens(args.n_prompt)
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        out["pp_s"] = time.perf_counter() - start
    if args.n_gen:
        llm.reset()
        llm.eval(tokens(1))  # warm-up
        gen = tokens(args.n_gen)
        llm.reset()
        start = time.perf_counter()
        for t in gen:
            llm.eval([t])
        out["tg_s"] = time.perf_counter() - start
    try:
        import llama_cpp

        out["version"] = llama_cpp.__version__
        out["module"] = llama_cpp.__file__
    except AttributeError:
        pass
    llm.close()
    return out


def worker(args: argparse.Namespace) -> int:
    run = run_pyggml if args.worker == "pyggml" else run_llamacpp
    args.threads = args.threads[0]  # the parent passes one count
    out = run(args)
    out["max_rss_bytes"] = _max_rss_bytes()
    print("RESULT " + json.dumps(out), flush=True)
    return 0


# ---- the comparison (parent process) ------------------------------------------------------------
def measure(engine: str, model: Path, threads: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run of ``engine`` in a fresh subprocess; {"error": ...} when it fails or crashes."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", engine, "--model", str(model),
           "--threads", str(threads), "-p", str(args.n_prompt), "-n", str(args.n_gen), "--n-batch", str(args.n_batch)]
    if args.flash_attn:
        cmd.append("--flash-attn")
    if args.llama_cpp_path:
        cmd += ["--llama-cpp-path", args.llama_cpp_path]
    return run_child(cmd, args.timeout)


def run_child(cmd: list[str], timeout: float) -> dict[str, Any]:
    """Run one measuring child: the JSON of its ``RESULT`` line, or {"error": ...} saying why not."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT ") and proc.returncode == 0:
            return json.loads(line[len("RESULT "):])
    if proc.returncode < 0:
        try:
            why = f"crashed ({signal.Signals(-proc.returncode).name})"
        except ValueError:
            why = f"killed by signal {-proc.returncode}"
    else:
        why = f"exit status {proc.returncode}"
    tail = (proc.stderr.strip().splitlines() or [""])[-1][:300]
    return {"error": f"{why}: {tail}" if tail else why}


def summarize(runs: list[dict[str, Any]], key: str, n_tokens: int) -> dict[str, Any] | None:
    ok = [r for r in runs if key in r]
    if not ok:
        return None
    ts = [n_tokens / r[key] for r in ok]
    return {"samples_ts": ts, "avg_ts": statistics.fmean(ts), "stddev_ts": statistics.stdev(ts) if len(ts) > 1 else 0.0}


def compare(models: list[tuple[Path, str]], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for model, label in models:
        for threads in args.threads:
            runs: dict[str, list[dict[str, Any]]] = {e: [] for e in ENGINES}
            for rnd in range(args.rounds):
                for engine in ENGINES:  # alternate: pyggml, llama.cpp, pyggml, ...
                    r = measure(engine, model, threads, args)
                    print(f"[{label} t={threads} round {rnd + 1}/{args.rounds}] {engine}: "
                          f"{r.get('error') or _brief(r, args)}", file=sys.stderr, flush=True)
                    runs[engine].append(r)
            for test, key, n in (("pp", "pp_s", args.n_prompt), ("tg", "tg_s", args.n_gen)):
                if not n:
                    continue
                row: dict[str, Any] = {"model": label, "path": str(model), "size": model.stat().st_size,
                                       "threads": threads, "test": f"{test}{n}"}
                for engine in ENGINES:
                    stats = summarize(runs[engine], key, n)
                    errors = sorted({r["error"] for r in runs[engine] if "error" in r})
                    row[engine] = {**(stats or {}), "errors": errors,
                                   "failed_runs": sum("error" in r for r in runs[engine]),
                                   "max_rss_bytes": max((r.get("max_rss_bytes", 0) for r in runs[engine]), default=0),
                                   "load_s": _mean([r["load_s"] for r in runs[engine] if "load_s" in r])}
                    modules = {r["module"] for r in runs[engine] if "module" in r}
                    if modules:  # which llama_cpp build ran (see --llama-cpp-path)
                        row[engine]["module"] = sorted(modules)[0]
                    if engine == "pyggml" and test == "tg":
                        row[engine]["python_share"] = _mean([r["tg_python_share"] for r in runs[engine]
                                                             if "tg_python_share" in r])
                a, b = row["pyggml"].get("avg_ts"), row["llama.cpp"].get("avg_ts")
                row["ratio"] = a / b if a and b else None
                rows.append(row)
    return rows


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _brief(r: dict[str, Any], args: argparse.Namespace) -> str:
    parts = []
    if "pp_s" in r:
        parts.append(f"pp {args.n_prompt / r['pp_s']:.1f} t/s")
    if "tg_s" in r:
        parts.append(f"tg {args.n_gen / r['tg_s']:.2f} t/s")
    return ", ".join(parts) + f", rss {r['max_rss_bytes'] / 2**20:.0f} MiB"


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ("model", "threads", "test", "pyggml t/s", "llama.cpp t/s", "pyggml/llama.cpp", "pyggml py %",
            "pyggml RSS MiB", "llama.cpp RSS MiB")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("-" * (len(h) + 2) for h in head) + "|"]

    def ts(side: dict[str, Any]) -> str:
        if "avg_ts" not in side:
            return "error: " + "; ".join(side["errors"])
        failed = f" ({side['failed_runs']} run(s) failed)" if side["failed_runs"] else ""
        return f"{side['avg_ts']:.2f} ± {side['stddev_ts']:.2f}{failed}"

    for r in rows:
        p, c = r["pyggml"], r["llama.cpp"]
        share = p.get("python_share")
        lines.append("| " + " | ".join([
            r["model"], str(r["threads"]), r["test"], ts(p), ts(c),
            f"{r['ratio']:.2f}" if r["ratio"] else "-", f"{100 * share:.1f}" if share is not None else "-",
            _mib(p["max_rss_bytes"]), _mib(c["max_rss_bytes"])]) + " |")
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f}" if n else "-"


def _list(kind: type) -> Any:
    return lambda text: [kind(v.strip()) for v in text.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="pyggml vs llama.cpp tokens/s on the same GGUF files.")
    parser.add_argument("models", nargs="*", type=Path, help="GGUF files")
    parser.add_argument("--synthetic", metavar="SHAPE", help="also random-weight models of this shape "
                        "(pyggml.synthetic.SHAPES), one per --types, cached in the pyggml cache directory")
    parser.add_argument("--types", type=_list(str), default=["q4_0", "q8_0", "f16"],
                        help="weight types of the --synthetic models (default: q4_0,q8_0,f16)")
    parser.add_argument("-t", "--threads", type=_list(int), default=[1, 2], help="thread counts (default: 1,2)")
    parser.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens for pp (0: skip)")
    parser.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens for tg (0: skip)")
    parser.add_argument("-b", "--n-batch", type=int, default=512, help="batch size (both engines)")
    parser.add_argument("--flash-attn", action="store_true", help="flash attention on both sides (default off)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per setting (default: 3)")
    parser.add_argument("--llama-cpp-path", help="directory prepended to sys.path before importing llama_cpp "
                        "(e.g. a build without AMX: see docs/bench.md)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run (default: 1800)")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.n_prompt < 0 or args.n_gen < 0 or args.n_prompt + args.n_gen == 0 or args.rounds < 1 \
            or args.n_batch < 1 or not args.threads or min(args.threads) < 1:
        parser.error("need -p/-n >= 0 (not both 0), --rounds >= 1, --n-batch >= 1 and positive --threads")
    models = []
    for path in args.models:
        if not path.is_file():
            parser.error(f"no such model file: {path}")
        models.append((path, path.name))
    if args.synthetic:
        from pyggml.bench import synthetic_model

        models += [(synthetic_model(args.synthetic, t), f"{args.synthetic} {t.upper()}") for t in args.types]
    if not models:
        parser.error("give GGUF files and/or --synthetic SHAPE")
    rows = compare(models, args)
    print(markdown(rows))
    if args.json:
        settings = {k: getattr(args, k) for k in ("n_prompt", "n_gen", "n_batch", "flash_attn", "rounds",
                                                  "llama_cpp_path")}
        doc = {"settings": {**settings, "n_ctx": args.n_prompt + args.n_gen, "cache_type": "f16"},
               "machine": _machine(), "results": rows}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    failed = any(r[e]["errors"] for r in rows for e in ENGINES)
    return 1 if failed else 0


def _machine() -> dict[str, Any]:
    from pyggml.bench import cpu_info

    return {"cpu": cpu_info(), "load_average": os.getloadavg()}


if __name__ == "__main__":
    sys.exit(main())
