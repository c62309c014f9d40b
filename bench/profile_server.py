"""Where a `pyggml serve` decode step spends its time: the server in this process, the streamed
OpenAI load of bench/compare_servers.py from a child process, and counters per thread.

    python bench/profile_server.py --synthetic tinyllama-1.1b --type q4_0 --threads 2 -P 1,4 -n 64
    python bench/profile_server.py MODEL.gguf -P 4 --yappi 25     # + the 25 costliest functions

Reported per parallel count P, per generated token (counts and CPU fractions: on a shared machine
wall times mean little, but CPU seconds spent per token by each thread, and how many wake-ups a
token costs, do not move much with load):

- CPU time per token of each kind of thread (``/proc/self/task/*/stat``): the runner loop thread
  (Python + its share of ggml's compute), ggml's worker threads, the event loop (HTTP, SSE
  encoding), the job threads bridging the runner to the event loop;
- context switches per token (voluntary: a thread slept and was woken; involuntary: preempted);
- inside the runner thread (wall seconds split by ``Engine``'s own ``times`` counters plus timers
  around sampling/accepting): compute, output read, graph refill/build, sampling, accept (detokenize,
  stop matching, chunk hand-off), the rest of the loop;
- with ``--yappi N``: the N functions with the most CPU time (all threads, yappi's CPU clock).

A dev tool for the profile table in docs/bench.md; not a benchmark of throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import socket
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

SRC = Path(os.environ.get("PYGGML_SRC") or Path(__file__).resolve().parent.parent / "src")  # another tree's src/
sys.path.insert(0, str(SRC))

CLK = os.sysconf("SC_CLK_TCK")


def _bench():
    spec = importlib.util.spec_from_file_location("compare_servers", Path(__file__).with_name("compare_servers.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def thread_stats() -> dict[int, dict[str, Any]]:
    """Per native thread of this process: name, CPU seconds, voluntary/involuntary switches; key 0:
    the whole process, threads that have exited included (getrusage)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    out = {0: {"name": "process", "cpu": ru.ru_utime + ru.ru_stime, "vol": ru.ru_nvcsw, "invol": ru.ru_nivcsw}}
    for tid in os.listdir("/proc/self/task"):
        try:
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            status = Path(f"/proc/self/task/{tid}/status").read_text().splitlines()
        except OSError:
            continue
        sw = {line.split(":")[0]: int(line.split()[1]) for line in status if "ctxt_switches" in line}
        out[int(tid)] = {"name": comm, "cpu": (int(fields[11]) + int(fields[12])) / CLK,
                         "vol": sw.get("voluntary_ctxt_switches", 0), "invol": sw.get("nonvoluntary_ctxt_switches", 0)}
    return out


def kind_of(name: str, main_tid: int, tid: int, loop_tid: int) -> str:
    """``name``: the Python thread's name, or the kernel's for a thread Python did not start."""
    if tid == loop_tid:
        return "event loop (HTTP, SSE)"
    if name.startswith("pyggml-runner"):
        return "runner loop (+ its compute share)"
    if name.startswith("pyggml-server"):
        return "job threads (runner -> loop)"
    if tid == main_tid:
        return "main"
    if name.startswith("pyggml-compute"):
        return "build-ahead compute thread"
    return "ggml workers (compute)" if name.startswith("kernel:") else f"other ({name})"


class RunnerTimers:
    """Wraps the runner's per-step work with CPU-time timers (``time.thread_time``: what the runner
    thread itself spends, unaffected by other processes taking the cores) and counts the calls."""

    def __init__(self, runner):
        from pyggml.runner.sequence import RunningSequence
        from pyggml.sample import Sampler

        self.times: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self._undo: list[tuple[Any, str, Any]] = []
        self._wrap(runner.engine, "build", "engine.build (graph refill or build)")
        self._wrap(runner.engine, "compute", "engine.compute (ggml + logits read)")
        for name in ("_iterate", "_build", "_complete", "_notify"):
            if hasattr(runner, name):
                self._wrap(runner, name, name)
        self._wrap(Sampler, "sample", "Sampler.sample")
        self._wrap(RunningSequence, "accept", "RunningSequence.accept (detokenize, stops, chunk)")

    def _wrap(self, owner: Any, attr: str, label: str) -> None:
        inner = getattr(owner, attr)
        clock = time.thread_time

        def timed(*a, **k):
            t0 = clock()
            try:
                return inner(*a, **k)
            finally:
                self.times[label] += clock() - t0
                self.counts[label] += 1

        self._undo.append((owner, attr, owner.__dict__.get(attr)))
        setattr(owner, attr, timed)

    def restore(self) -> None:
        for owner, attr, old in reversed(self._undo):
            if old is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, old)


def profile(args: argparse.Namespace, parallel: int, bench) -> dict[str, Any]:
    import uvicorn

    from pyggml import BackendParams, models
    from pyggml.runner import Runner
    from pyggml.server import ServedModel, create_app

    model = models.load(args.model, BackendParams(n_threads=args.threads,
                                                  flash_attention={"on": True, "off": False}.get(args.flash_attn)))
    runner = Runner(model, parallel=parallel, num_ctx=args.ctx, batch_size=args.batch_size)
    served = ServedModel(runner, args.model)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(served), log_level="warning"))
    loop_tid: list[int] = []

    def serve() -> None:
        loop_tid.append(threading.get_native_id())
        server.run(sockets=[sock])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        model_name = Path(args.model).stem
        # a logit bias rather than ignore_eos: a tree from before ignore_eos (PYGGML_SRC) takes it too
        no_eos = {"logit_bias": {str(t): -100 for t in model.tokenizer.vocab.eog}}

        def load(p: int, requests: int, n: int, salt: int) -> dict[str, Any]:
            # the client runs in its own process: its CPU is not counted here
            import multiprocessing as mp

            ctx = mp.get_context("spawn")
            with ctx.Pool(1) as pool:
                return pool.apply(_drive, (port, p, requests, n, bench.make_prompts(p * requests, salt), model_name,
                                           no_eos))

        timers = RunnerTimers(runner)  # before the warm-up: the loop then waits inside a timed turn
        load(1, 1, 4, 5000 + parallel)  # warm-up
        timers.times.clear()
        timers.counts.clear()
        built, reused = runner.engine.built, runner.engine.reused
        if args.yappi:
            import yappi

            yappi.set_clock_type("cpu")
            yappi.start(builtins=False, profile_threads=True)
        before = thread_stats()
        result = load(parallel, args.requests, args.n_gen, 77 + parallel)
        after = thread_stats()
        if args.yappi:
            yappi.stop()
        tokens = result["tokens"]
        kinds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        main_tid = threading.main_thread().native_id
        names = {t.native_id: t.name for t in threading.enumerate()}
        gone = {key: after[0][key] - before[0][key] for key in ("cpu", "vol", "invol")}
        for tid, a in after.items():
            if tid == 0:
                continue
            b = before.get(tid, {"cpu": 0.0, "vol": 0, "invol": 0})
            for key in ("cpu", "vol", "invol"):
                gone[key] -= a[key] - b[key]
        kinds["exited threads (job threads)"] = gone
        for tid, a in after.items():
            if tid == 0:
                continue
            b = before.get(tid, {"cpu": 0.0, "vol": 0, "invol": 0})
            k = kinds[kind_of(names.get(tid, f"kernel:{a['name']}"), main_tid, tid, loop_tid[0])]
            for key in ("cpu", "vol", "invol"):
                k[key] += a[key] - b[key]
        report = {"parallel": parallel, "result": result, "tokens": tokens,
                  "threads": {k: {key: v / tokens for key, v in d.items()} for k, d in kinds.items()},
                  "runner": {k: v / tokens for k, v in timers.times.items()},
                  "counts": {k: v / tokens for k, v in timers.counts.items()},
                  "graphs": {"built": runner.engine.built - built, "reused": runner.engine.reused - reused}}
        timers.restore()
        if args.yappi:
            stats = yappi.get_func_stats()
            stats.sort("tsub")
            report["yappi"] = [(f"{Path(s.module).name}:{s.lineno} {s.name}", s.ncall / tokens, s.tsub / tokens,
                                s.ttot / tokens) for s in list(stats)[:args.yappi]]
            yappi.clear_stats()
        return report
    finally:
        server.should_exit = True
        runner.close()
        thread.join(15)
        model.close()
        sock.close()


def _drive(port, p, requests, n, prompts, model_name, no_eos):
    return asyncio.run(_bench().drive(port, p, requests, n, prompts, model_name, no_eos))


def show(report: dict[str, Any]) -> None:
    p, res = report["parallel"], report["result"]
    print(f"\n## P={p}: {report['tokens']} tokens, {res['tok_s']:.1f} tok/s, {res['events']} SSE events "
          f"(load average {os.getloadavg()[0]:.1f})")
    total = sum(d["cpu"] for d in report["threads"].values())
    print("| thread | CPU ms/token | CPU share | voluntary switches/token | involuntary/token |")
    print("|---|---|---|---|---|")
    for kind, d in sorted(report["threads"].items(), key=lambda kv: -kv[1]["cpu"]):
        print(f"| {kind} | {1e3 * d['cpu']:.2f} | {d['cpu'] / total:.1%} | {d['vol']:.2f} | {d['invol']:.2f} |")
    run = report["runner"]
    loop = run.get("_iterate", 0.0)
    print("\n| runner thread, per token | CPU us/token | share of the runner loop's CPU |")
    print("|---|---|---|")
    parts = {
        "ggml compute + logits read": run.get("engine.compute (ggml + logits read)", 0.0),
        "graph refill/build (engine.build)": run.get("engine.build (graph refill or build)", 0.0),
        "batch packing (_build minus engine.build)": run.get("_build", 0.0)
        - run.get("engine.build (graph refill or build)", 0.0),
        "sampling (Sampler.sample)": run.get("Sampler.sample", 0.0),
        "accept: detokenize, stop match, chunk": run.get("RunningSequence.accept (detokenize, stops, chunk)", 0.0),
        "notify consumers (_notify)": run.get("_notify", 0.0),
    }
    parts["rest of _complete (row loop, placeholders)"] = run.get("_complete", 0.0) - parts[
        "ggml compute + logits read"] - parts["sampling (Sampler.sample)"] - parts[
        "accept: detokenize, stop match, chunk"]
    parts["rest of the loop (lock, admission, fill)"] = loop - run.get("_build", 0.0) - run.get(
        "_complete", 0.0) - parts["notify consumers (_notify)"]
    for name, v in parts.items():
        print(f"| {name} | {1e6 * v:.0f} | {v / loop:.1%} |")
    counts = report["counts"]
    print(f"\nper token: loop turns {counts.get('_iterate', 0):.2f}, graphs built or refilled "
          f"{counts.get('engine.build (graph refill or build)', 0):.2f}, notify rounds {counts.get('_notify', 0):.2f}; "
          f"graphs built {report['graphs']['built']}, refilled {report['graphs']['reused']} in all")
    if "yappi" in report:
        print("\n| function (yappi CPU) | calls/token | own CPU us/token | total CPU us/token |")
        print("|---|---|---|---|")
        for name, calls, own, tot in report["yappi"]:
            print(f"| {name} | {calls:.2f} | {1e6 * own:.0f} | {1e6 * tot:.0f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", type=Path)
    parser.add_argument("--synthetic", metavar="SHAPE")
    parser.add_argument("--type", default="q4_0")
    parser.add_argument("-P", "--parallel", default="1,4")
    parser.add_argument("-n", "--n-gen", type=int, default=64)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--flash-attn", choices=["on", "off", "auto"], default="off")
    parser.add_argument("--yappi", type=int, default=0, metavar="N", help="also list the N costliest functions")
    args = parser.parse_args(argv)
    if args.model is None and args.synthetic:
        from pyggml.bench import synthetic_model

        args.model = synthetic_model(args.synthetic, args.type)
    if args.model is None:
        parser.error("give a MODEL or --synthetic SHAPE")
    bench = _bench()
    for p in args.parallel.split(","):
        with contextlib.redirect_stdout(sys.stdout):
            show(profile(args, int(p), bench))
    return 0


if __name__ == "__main__":
    sys.exit(main())
