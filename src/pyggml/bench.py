"""``pyggml bench``: prompt-processing and generation speed, measured the way llama-bench does.

``pp<N>``: one forward pass of N random prompt tokens on a fresh sequence, in batches of
``n_batch`` tokens, logits only for the last token of each batch. ``tg<N>``: N single-token
decode steps on a fresh sequence. Every test runs once untimed (warm-up: pp at full length, tg
for one token), then ``repetitions`` times under the clock. The clock runs around the whole step,
Python graph building and cache bookkeeping included: that is what a user of pyggml waits for.

Each step is also split into its parts (cache bookkeeping, graph building, ``ctx.compute``, the
read-back of logits) so that the **Python share** of a step is a reported field. Every field is
described in ``docs/bench.md``; the JSON document follows ``docs/bench.schema.json``.

This module imports only the standard library at the top, so that registering its subcommands
costs the other ``pyggml`` commands nothing.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import itertools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
CACHE_TYPES = ("f16", "f32", "q8_0", "q4_0")
CPU_FEATURES = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
                "avx512_vnni", "avx512_vbmi", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16",
                "amx_fp16", "asimd", "asimddp", "i8mm", "sve", "sve2")
# one row per test; every column is documented in docs/bench.md
CSV_COLUMNS = ("pyggml_version", "ggml_version", "cpu_model", "model_filename", "model_type", "model_size",
               "model_n_params", "test", "n_prompt", "n_gen", "n_threads", "n_batch", "n_gpu_layers",
               "flash_attn", "cache_type", "repetitions", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts",
               "step_ms", "cache_ms", "graph_ms", "compute_ms", "ggml_compute_ms", "output_ms", "python_share",
               "host_share", "graph_nodes", "graph_us_per_node", "load_s", "samples_ns", "samples_ts")
MD_COLUMNS = ("model", "size", "params", "backend", "threads", "n_batch", "type_kv", "fa", "test", "t/s", "py %")


# ---- timing one test ------------------------------------------------------------------------------
@dataclass
class Parts:
    """Seconds spent in each part of the forward passes of one timed run."""

    steps: int = 0
    cache: float = 0.0  # Batch + cache.start_forward: cell placement, mask, index inputs
    graph: float = 0.0  # model.forward + ctx.forward: building the graph in Python
    compute: float = 0.0  # ctx.compute: allocation, input upload, ggml's graph compute
    ggml_compute: float = 0.0  # of which inside ggml_backend_sched_graph_compute
    output: float = 0.0  # logits.numpy() and closing the context
    nodes: int = 0  # graph nodes of the last step


@dataclass
class Sample:
    wall_ns: int
    tokens: int
    parts: Parts
    rpc_bytes: tuple[int, int] = (0, 0)  # (sent, received) to/from RPC servers during the run


class _KernelClock:
    """Stands in for ``pyggml.backend``'s cffi ``lib`` while a benchmark runs and times
    ``ggml_backend_sched_graph_compute``, the native part of ``ctx.compute``. Every other name passes
    straight through and is cached on first use, so the stand-in costs nothing per call."""

    def __init__(self, lib: Any):
        self._lib = lib
        self.seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._lib, name)
        if name == "ggml_backend_sched_graph_compute":
            native = value

            def value(*args: Any) -> Any:
                start = time.perf_counter()
                try:
                    return native(*args)
                finally:
                    self.seconds += time.perf_counter() - start

        setattr(self, name, value)
        return value


class Session:
    """A model loaded at fixed settings with a one-sequence KV cache, timing pp and tg runs."""

    def __init__(self, path: str | os.PathLike, *, n_threads: int | None = None, flash_attn: bool = False,
                 cache_type: str = "f16", gpu_layers: int | str = 0, n_ctx: int = 512, max_batch: int = 512,
                 seed: int = 0, rpc: Sequence[str] | str = (), tensor_split: Sequence[float] | str | None = None,
                 repack: bool = True):
        import numpy as np

        from pyggml import models
        from pyggml.backend import BackendParams
        from pyggml.models import Batch
        from pyggml.runner.engine import Engine
        from pyggml.tensor import DType

        start = time.perf_counter()
        params = BackendParams(n_threads=n_threads, gpu_layers=gpu_layers, flash_attention=flash_attn, rpc=rpc or (),
                               tensor_split=tensor_split, repack=repack,
                               adapt_threads=False)  # -t means that many threads, busy machine or not
        self.model = models.load(path, params)
        try:
            if self.model.cache is None:
                raise ValueError(f"{path}: the model has no KV cache; pyggml bench measures decoders")
            self.model.cache.init(self.model.backend, DType.parse(cache_type), max_sequences=1,
                                  capacity=max(n_ctx, 1), max_batch=max_batch)
        except BaseException:
            self.model.close()
            raise
        self.load_s = time.perf_counter() - start
        self.n_threads = self.model.backend.n_threads
        embd = self.model.backend.get("token_embd.weight")
        self.n_vocab = embd.shape[1] if embd is not None else len(self.model.config.get("tokenizer.ggml.tokens", ()))
        self._rng = np.random.default_rng(seed)
        self._batch = Batch
        self._clock: _KernelClock | None = None
        self._engine = Engine(self.model)

    def tokens(self, n: int) -> list[int]:
        return [int(t) for t in self._rng.integers(0, max(self.n_vocab, 1), n)]

    def prompt(self, n_prompt: int, n_batch: int) -> Sample:
        """One pp run: ``n_prompt`` tokens on a fresh sequence, ``n_batch`` at a time."""
        tokens = self.tokens(n_prompt)
        self.model.cache.remove(0, 0)
        parts = Parts()
        before = self.model.backend.rpc_traffic()
        with self._kernel_clock() as clock:
            start = time.perf_counter_ns()
            for first in range(0, n_prompt, n_batch):
                self.step(tokens[first:first + n_batch], first, parts)
            wall = time.perf_counter_ns() - start
        parts.ggml_compute = clock.seconds if clock else float("nan")
        return Sample(wall, n_prompt, parts, self._rpc_delta(before))

    def _rpc_delta(self, before: tuple[int, int]) -> tuple[int, int]:
        after = self.model.backend.rpc_traffic()
        return after[0] - before[0], after[1] - before[1]

    def generate(self, n_gen: int) -> Sample:
        """One tg run: ``n_gen`` single-token forward passes on a fresh sequence."""
        tokens = self.tokens(n_gen)
        self.model.cache.remove(0, 0)
        parts = Parts()
        before = self.model.backend.rpc_traffic()
        with self._kernel_clock() as clock:
            start = time.perf_counter_ns()
            for pos, token in enumerate(tokens):
                self.step([token], pos, parts)
            wall = time.perf_counter_ns() - start
        parts.ggml_compute = clock.seconds if clock else float("nan")
        return Sample(wall, n_gen, parts, self._rpc_delta(before))

    def step(self, tokens: list[int], first_pos: int, parts: Parts) -> None:
        """One forward pass through the engine the Runner uses (decode steps reuse a kept graph), timed by part."""
        batch = self._batch(inputs=tokens, outputs=[len(tokens) - 1],
                            positions=range(first_pos, first_pos + len(tokens)), sequences=[0] * len(tokens))
        times: dict[str, float] = {}
        self._engine.forward(batch, times)
        parts.nodes = self._engine.n_nodes
        parts.steps += 1
        parts.cache += times["cache"]
        parts.graph += times["graph"]
        parts.compute += times["compute"]
        parts.output += times["output"]

    @contextmanager
    def _kernel_clock(self) -> Iterator[_KernelClock | None]:
        """Time ggml's graph compute during one run (the stand-in is kept, so its cache stays warm)."""
        import pyggml.backend as backend_module

        lib = getattr(backend_module, "lib", None)
        if lib is None or not hasattr(lib, "ggml_backend_sched_graph_compute"):
            yield None  # the backend changed shape: ggml_compute_ms is reported as null
            return
        if self._clock is None or self._clock._lib is not lib:
            self._clock = _KernelClock(lib)
        self._clock.seconds = 0.0
        backend_module.lib = self._clock
        try:
            yield self._clock
        finally:
            backend_module.lib = lib

    def close(self) -> None:
        self._engine.close()
        self.model.close()


# ---- a whole run ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Instance:
    """One combination of the list-valued options (as llama-bench's test instances)."""

    n_threads: int
    n_batch: int
    n_gpu_layers: int | str
    flash_attn: bool
    cache_type: str


def result(test: str, inst: Instance, session: Session, n_prompt: int, n_gen: int,
           samples: Sequence[Sample]) -> dict[str, Any]:
    """The documented result record of one test from its timed samples."""
    ns = [s.wall_ns for s in samples]
    ts = [s.tokens * 1e9 / s.wall_ns for s in samples]
    steps = sum(s.parts.steps for s in samples)
    wall = sum(ns) / 1e9

    def ms(field: str) -> float | None:
        total = sum(getattr(s.parts, field) for s in samples)
        return None if total != total else 1e3 * total / steps  # NaN: not measured

    step_ms = 1e3 * wall / steps
    compute_ms, ggml_ms, graph_ms = ms("compute"), ms("ggml_compute"), ms("graph")
    nodes = samples[-1].parts.nodes
    remote = {}
    if session.model.backend.params.rpc:
        remote = {"placement": session.model.backend.placement(),
                  "rpc_sent_per_step": sum(s.rpc_bytes[0] for s in samples) / steps,
                  "rpc_received_per_step": sum(s.rpc_bytes[1] for s in samples) / steps}
    return {
        "test": test, "n_prompt": n_prompt, "n_gen": n_gen,
        "n_threads": session.n_threads, "n_batch": inst.n_batch, "n_gpu_layers": inst.n_gpu_layers,
        "flash_attn": inst.flash_attn, "cache_type": inst.cache_type,
        "repetitions": len(samples), "samples_ns": ns, "avg_ns": statistics.fmean(ns), "stddev_ns": _stdev(ns),
        "samples_ts": ts, "avg_ts": statistics.fmean(ts), "stddev_ts": _stdev(ts),
        "step_ms": step_ms, "cache_ms": ms("cache"), "graph_ms": graph_ms, "compute_ms": compute_ms,
        "ggml_compute_ms": ggml_ms, "output_ms": ms("output"),
        "python_share": max(0.0, 1.0 - compute_ms / step_ms),
        "host_share": None if ggml_ms is None else max(0.0, 1.0 - ggml_ms / step_ms),
        "graph_nodes": nodes, "graph_us_per_node": 1e3 * graph_ms / nodes if nodes else None,
        "load_s": session.load_s,
        **remote,
    }


def _stdev(values: Sequence[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def run_tests(session: Session, inst: Instance, n_prompts: Sequence[int], n_gens: Sequence[int],
              repetitions: int, warmup: bool = True) -> Iterator[dict[str, Any]]:
    for n in n_prompts:
        if warmup:
            session.prompt(n, inst.n_batch)
        yield result(f"pp{n}", inst, session, n, 0, [session.prompt(n, inst.n_batch) for _ in range(repetitions)])
    for n in n_gens:
        if warmup:
            session.generate(1)
        yield result(f"tg{n}", inst, session, 0, n, [session.generate(n) for _ in range(repetitions)])


# ---- build, machine and model information ---------------------------------------------------------
def cpu_info() -> dict[str, Any]:
    """CPU model and the SIMD/matrix features ggml's kernels care about, from /proc/cpuinfo."""
    from pyggml.backend.hardware import physical_cores

    model, flags = "", set()
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return {"model": model or platform.processor() or platform.machine(), "logical_cpus": os.cpu_count() or 1,
            "physical_cores": physical_cores(), "features": [f for f in CPU_FEATURES if f in flags]}


def build_info() -> dict[str, Any]:
    import pyggml
    from pyggml.backend.hardware import devices, ggml_version

    return {
        "pyggml_version": pyggml.__version__,
        "ggml_version": ggml_version(),
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "devices": [{"name": d.name, "description": d.description, "kind": d.kind, "memory_total": d.memory_total}
                    for d in devices()],
        "cpu": cpu_info(),
    }


def model_info(path: Path, session: Session, synthetic: dict[str, str] | None = None) -> dict[str, Any]:
    """File, size, main weight type and parameter count of the loaded model."""
    tensors = session.model.backend.tensors().values()
    by_type: dict[str, int] = {}
    for t in tensors:
        by_type[t.dtype.name] = by_type.get(t.dtype.name, 0) + t.nelements
    config = session.model.config
    return {
        "path": str(path.resolve()), "filename": path.name, "size": path.stat().st_size,
        "type": max(by_type, key=by_type.get) if by_type else "", "n_params": sum(by_type.values()),
        "architecture": config.architecture, "name": config.string("general.name", "") or "",
        "synthetic": synthetic,
    }


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``MODEL`` or ``--synthetic SHAPE [--type TYPE]``: the model argument of the bench/ scripts
    (resolve it with ``model_argument``)."""
    parser.add_argument("model", nargs="?", type=Path, help="a GGUF file (or --synthetic)")
    parser.add_argument("--synthetic", metavar="SHAPE", help="a random-weight model of this shape, cached")
    parser.add_argument("--type", default="q4_0", help="weight type of the --synthetic model (default: q4_0)")


def model_argument(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Path:
    """The file ``add_model_arguments`` named: MODEL, else the cached --synthetic model."""
    if args.model is not None:
        return Path(args.model)
    if not args.synthetic:
        parser.error("give a MODEL or --synthetic SHAPE")
    return synthetic_model(args.synthetic, args.type)


def synthetic_model(shape: str, dtype: str) -> Path:
    """The cached random-weight model of this shape and type, written on first use."""
    from pyggml.synthetic import write_synthetic
    from pyggml.tiny import cache_dir

    path = cache_dir() / f"synthetic-{shape}-{dtype.lower()}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"pyggml bench: writing synthetic model {path} (once)", file=sys.stderr)
        write_synthetic(path, shape, dtype, progress=progress_printer("pyggml bench"))
    return path


# ---- output ---------------------------------------------------------------------------------------
def _human(n: float, units: Sequence[str], base: float) -> str:
    for unit in units[:-1]:
        if abs(n) < base:
            return f"{n:.2f} {unit}"
        n /= base
    return f"{n:.2f} {units[-1]}"


def md_row(model: dict[str, Any], backend: str, r: dict[str, Any]) -> list[str]:
    desc = f"{model['architecture']} {model['type']}".strip()
    return [desc, _human(model["size"], ("B", "KiB", "MiB", "GiB"), 1024),
            _human(model["n_params"], ("", "K", "M", "B"), 1000).strip(), backend, str(r["n_threads"]),
            str(r["n_batch"]), r["cache_type"], str(int(r["flash_attn"])), r["test"],
            f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}", f"{100 * r['python_share']:.1f}"]


def csv_row(build: dict[str, Any], model: dict[str, Any], r: dict[str, Any]) -> dict[str, Any]:
    row = {"pyggml_version": build["pyggml_version"], "ggml_version": build["ggml_version"],
           "cpu_model": build["cpu"]["model"], "model_filename": model["filename"], "model_type": model["type"],
           "model_size": model["size"], "model_n_params": model["n_params"]}
    row.update({k: v for k, v in r.items() if k in CSV_COLUMNS})
    row["flash_attn"] = int(r["flash_attn"])
    row["samples_ns"] = ";".join(str(v) for v in r["samples_ns"])
    row["samples_ts"] = ";".join(f"{v:.4f}" for v in r["samples_ts"])
    return {k: ("" if row[k] is None else row[k]) for k in CSV_COLUMNS}


class Printer:
    """Writes results as they come (md, csv) or as one document at the end (json)."""

    def __init__(self, fmt: str, out: Any = None):
        self.fmt, self.out = fmt, out or sys.stdout
        self.header_done = False
        self.notes: dict[str, None] = {}  # md: lines printed under the table, in order

    def row(self, build: dict[str, Any], model: dict[str, Any], r: dict[str, Any]) -> None:
        if self.fmt == "md":
            cells = md_row(model, _backend_names(build, r), r)
            if not self.header_done:
                self._line("| " + " | ".join(MD_COLUMNS) + " |")
                self._line("|" + "|".join("-" * (len(c) + 2) for c in MD_COLUMNS) + "|")
            self._line("| " + " | ".join(cells) + " |")
            if "placement" in r:
                layers = "; ".join(f"{layer_ranges(ls)} on {name}" for name, ls in r["placement"].items())
                self.notes.setdefault(f"{r['test']}: {r['rpc_sent_per_step'] / 1024:,.1f} KiB sent, "
                                      f"{r['rpc_received_per_step'] / 1024:,.1f} KiB received per forward pass; "
                                      f"layers {layers}")
        elif self.fmt == "csv":
            buf = io.StringIO()
            writer = csv.DictWriter(buf, CSV_COLUMNS, lineterminator="\n")
            if not self.header_done:
                writer.writeheader()
            writer.writerow(csv_row(build, model, r))
            self.out.write(buf.getvalue())
            self.out.flush()
        self.header_done = True

    def finish(self, document: dict[str, Any]) -> None:
        if self.fmt == "json":
            json.dump(document, self.out, indent=2)
            self.out.write("\n")
        elif self.fmt == "md" and self.header_done:
            b = document["build"]
            features = " ".join(b["cpu"]["features"]) or "-"
            self._line(f"\npyggml {b['pyggml_version']}, ggml {b['ggml_version']}, {b['cpu']['model']} "
                       f"({features})")
            for note in self.notes:
                self._line(note)
        self.out.flush()

    def _line(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()


def _backend_names(build: dict[str, Any], r: dict[str, Any]) -> str:
    if "placement" in r:  # --rpc: the devices that compute layers
        return ",".join(name.split(" ")[0] for name in r["placement"])
    names = [d["name"] for d in build["devices"] if d["kind"] not in ("cpu", "rpc")] \
        if r["n_gpu_layers"] not in (0, "0") else []
    return ",".join(names + ["CPU"])


# ---- command line ---------------------------------------------------------------------------------
def layer_ranges(values: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def _positive_list(text: str) -> list[int]:
    values = _int_list(text)
    if 0 in values:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _layers_list(text: str) -> list[int | str]:
    out: list[int | str] = []
    for v in text.split(","):
        v = v.strip()
        if v == "all":
            out.append(v)
        elif v.isdigit():
            out.append(int(v))
        else:
            raise argparse.ArgumentTypeError(f"--gpu-layers takes counts or 'all', got {v!r}")
    return out


def _choice_list(choices: Sequence[str]) -> Any:
    def parse(text: str) -> list[str]:
        values = [v.strip().lower() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}; got {text!r}")
        return values

    return parse


def _flag_list(text: str) -> list[bool]:
    return [v == "1" for v in _choice_list(("0", "1"))(text)]


def add_parsers(sub: Any) -> None:
    """Register ``bench`` and ``make-model`` on the ``pyggml`` command's subparsers."""
    bench = sub.add_parser("bench", help="prompt processing and generation speed (like llama-bench)",
                           description="Measure pp (prompt processing) and tg (generation) tokens/s. List-valued "
                                       "options (comma-separated) run every combination. Fields: docs/bench.md.")
    bench.add_argument("model", nargs="?", help="GGUF file (or use --synthetic)")
    bench.add_argument("--synthetic", metavar="SHAPE",
                       help="a random-weight model of this shape (tiny, tinyllama-1.1b, llama-3.2-1b, llama-3.1-8b, "
                            "qwen2.5-0.5b, qwen3-0.6b, qwen3moe-small, qwen3-small-dense, gemma3-1b, phi3-mini, "
                            "phi3-mini-8l, gpt-oss-small, lfm2-1.2b, qwen3.5-9b, qwen3.5-35b-a3b, qwen3-next-80b-a3b; "
                            "pyggml.synthetic.SHAPES), written once into the pyggml "
                            "cache directory")
    bench.add_argument("--type", default="q4_0", help="weight type of the --synthetic model (default: q4_0; "
                       "mxfp4: MXFP4 experts, Q8_0 elsewhere)")
    bench.add_argument("-p", "--n-prompt", type=_int_list, default=[512], help="prompt lengths (default: 512)")
    bench.add_argument("-n", "--n-gen", type=_int_list, default=[128], help="generation lengths (default: 128)")
    bench.add_argument("-r", "--repetitions", type=int, default=5, help="timed runs per test (default: 5)")
    bench.add_argument("-t", "--threads", type=_positive_list, default=None,
                       help="thread counts (default: physical cores)")
    bench.add_argument("-b", "--batch-size", type=_positive_list, default=[512], help="batch sizes (default: 512)")
    bench.add_argument("-ngl", "--gpu-layers", type=_layers_list, default=[0],
                       help="layers on the GPU: counts or 'all' (default: 0)")
    bench.add_argument("-ctk", "--cache-type", type=_choice_list(CACHE_TYPES), default=["f16"],
                       help="KV cache types: f16, f32, q8_0, q4_0 (quantized needs --flash-attn 1; default: f16)")
    bench.add_argument("-fa", "--flash-attn", type=_flag_list, default=[False], help="0 and/or 1 (default: 0)")
    bench.add_argument("-o", "--output", choices=("md", "json", "csv"), default="md", help="output format")
    bench.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run of each test")
    bench.add_argument("--progress", action="store_true", help="report each test on stderr as it starts")
    bench.add_argument("--rpc", metavar="HOST:PORT,...", default=None,
                       help="also compute layers on these `pyggml rpc-server`s; reports the placement and the bytes "
                            "sent and received per forward pass")
    bench.add_argument("--tensor-split", metavar="W,W,...", default=None,
                       help="with --rpc: share of the layers for the local CPU and each remote device")
    bench.add_argument("--no-repack", action="store_true",
                       help="keep quantized weights in their file layout on the CPU (RPC servers never repack)")
    bench.set_defaults(func=cmd_bench)

    make = sub.add_parser("make-model", help="write a random-weight GGUF of any architecture or a real model's shape",
                          description="Write a GGUF with random weights: a named shape at a real model's dimensions "
                                      "(for benchmarks) or any registered architecture at a small default shape "
                                      "(for tests and porting). --set changes single hyper-parameters.")
    make.add_argument("shape", help="a named shape (tiny, tinyllama-1.1b, llama-3.2-1b, qwen3-0.6b, ...) or an "
                                    "architecture (llama, bert, qwen3moe, ...)")
    make.add_argument("out", help="output .gguf path")
    make.add_argument("--type", default="q4_0", help="weight type: f32, f16, q8_0, q4_0, q4_k, ... (default: q4_0)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", type=_hparam,
                      help="a GGUF metadata key without the architecture prefix, e.g. block_count=4 or "
                           "tokenizer.ggml.model=bert (repeatable)")
    make.set_defaults(func=cmd_make_model)


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        return bench(args)
    except (KeyboardInterrupt, BrokenPipeError):  # the pyggml command handles a closed pipe
        raise
    except Exception as e:  # any failure must reach CI as a non-zero exit
        print(f"pyggml bench: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def bench(args: argparse.Namespace, out: Any = None) -> int:
    if (args.model is None) == (args.synthetic is None):
        raise ValueError("give a MODEL file or --synthetic SHAPE (not both)")
    if args.repetitions < 1:
        raise ValueError(f"--repetitions must be >= 1, got {args.repetitions}")
    n_prompts = [n for n in args.n_prompt if n > 0]
    n_gens = [n for n in args.n_gen if n > 0]
    if not n_prompts and not n_gens:
        raise ValueError("nothing to measure: -p and -n are both 0")
    synthetic = None
    if args.synthetic:
        path = synthetic_model(args.synthetic, args.type)
        synthetic = {"shape": args.synthetic, "type": args.type.lower()}
    else:
        path = Path(args.model)
        if not path.is_file():
            raise FileNotFoundError(f"no such model file: {args.model}")
    from pyggml.backend.hardware import physical_cores

    threads = args.threads or [physical_cores()]
    n_ctx = max(n_prompts + n_gens)
    printer = Printer(args.output, out)
    build = build_info()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    model: dict[str, Any] | None = None
    results: list[dict[str, Any]] = []
    combos = list(itertools.product(threads, args.gpu_layers, args.flash_attn, args.cache_type))
    # a quantized KV cache needs flash attention: drop such pairs from a cross product, not a lone request
    valid = [c for c in combos if c[2] or c[3] in ("f16", "f32")]
    if valid and len(valid) < len(combos):
        print(f"pyggml bench: skipping {len(combos) - len(valid)} combination(s) of a quantized cache "
              "without flash attention", file=sys.stderr)
        combos = valid
    for t, ngl, fa, ctk in combos:
        session = Session(path, n_threads=t, flash_attn=fa, cache_type=ctk, gpu_layers=ngl, n_ctx=n_ctx,
                          max_batch=max(args.batch_size), rpc=getattr(args, "rpc", None) or (),
                          tensor_split=getattr(args, "tensor_split", None),
                          repack=not getattr(args, "no_repack", False))
        try:
            if model is None:
                model = model_info(path, session, synthetic)
            for nb in args.batch_size:
                inst = Instance(t, nb, ngl, fa, ctk)
                if args.progress:
                    print(f"pyggml bench: {inst}", file=sys.stderr)
                for r in run_tests(session, inst, n_prompts, n_gens, args.repetitions, not args.no_warmup):
                    results.append(r)
                    printer.row(build, model, r)
        finally:
            session.close()
    printer.finish({"schema_version": SCHEMA_VERSION, "started": started, "build": build, "model": model,
                    "results": results})
    return 0


def _hparam(text: str) -> tuple[str, Any]:
    """KEY=VALUE with VALUE an int, a float, true/false or a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    if value.lower() in ("true", "false"):
        return key, value.lower() == "true"
    for kind in (int, float):
        try:
            return key, kind(value)
        except ValueError:
            pass
    return key, value


def progress_printer(prefix: str) -> Callable[[int, int], None]:
    """A ``progress(done, total)`` for writing synthetic models: a line on stderr per 10% of a file
    of over 100M weights (a few seconds each), nothing for small ones."""
    step = [0]

    def progress(done: int, total: int) -> None:
        if total > 100_000_000 and done * 10 // total > step[0]:
            step[0] = done * 10 // total
            print(f"{prefix}: {100 * done // total}% of {total / 1e6:,.0f}M weights", file=sys.stderr)

    return progress


def cmd_make_model(args: argparse.Namespace) -> int:
    try:
        from pyggml.synthetic import write_synthetic

        out = write_synthetic(args.out, args.shape, args.type, seed=args.seed,
                              progress=progress_printer("pyggml make-model"), hparams=dict(args.set))
    except KeyboardInterrupt:
        raise
    except Exception as e:
        print(f"pyggml make-model: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({out.stat().st_size / 2**20:,.1f} MiB)")
    return 0
