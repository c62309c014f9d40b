"""`pyggml serve` against llama.cpp's C++ `llama-server`: the same concurrent streamed OpenAI load.

    python bench/compare_servers.py --synthetic tinyllama-1.1b --type q4_0 --threads 2 \\
        --parallel 1,4,8 --rounds 3 --json servers.json
    python bench/compare_servers.py MODEL.gguf --llama-server /path/to/llama-server -P 4
    python bench/compare_servers.py MODEL.gguf --servers pyggml -P 1,2 -n 8 --rounds 1   # no llama-server

For each parallel count P both servers are started on loopback (``pyggml serve --parallel P --ctx
C`` and ``llama-server -np P -c C*P --no-kv-unified``, both with ``--threads``, the same flash
attention setting and a batch of ``--batch-size``), and then driven in turn, alternating which goes
first, for ``--rounds`` rounds: P client tasks, each sending ``--requests`` requests one after
another (4*P in all by default) to ``/v1/completions`` with ``stream: true``, ``temperature: 0``,
``max_tokens: -n``, ``ignore_eos: true`` (both servers ban the end-of-generation tokens, so every
request generates exactly n tokens) and a distinct short prompt (no two share a cached prefix;
new prompts every round). Only one server works at a time; the other idles.

Per round and server: throughput (completion tokens, from each stream's final ``usage``, over the
wall time from the first request to the last stream's end), time to first token (request sent to
the first event with text) and inter-token latency (the gaps between a stream's successive text
events; an event may carry more than one token when a server holds back an incomplete UTF-8
character: ``events`` counts them). The table gives the median over rounds of each figure and
the ratio pyggml/llama-server (tok/s: higher is better; latencies: lower is better).

The HTTP client is a few lines of asyncio over raw sockets (one connection per request, chunked
transfer decoding, SSE lines), so the client itself costs little CPU beside the servers: on a
2-core machine every cycle it takes is taken from the compute threads of whichever server runs.

``--llama-server`` (default ``$LLAMA_SERVER`` or build/llama-server/bin/llama-server): the
binary built from the pinned llama-cpp-python sdist (docs/bench.md). A dev/bench tool only.
Exit status 1 when any run failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

SERVERS = ("pyggml", "llama-server")
WORDS = ("apple river stone cloud music paper garden window silver orange forest candle bridge winter "
         "planet engine yellow castle dragon letter market pencil rocket summer thunder valley violin "
         "wizard anchor basket circle desert feather harbor island jacket kettle ladder meadow needle "
         "ocean pepper quartz ribbon saddle tiger umbrella velvet wagon zebra").split()
SRC = Path(__file__).resolve().parent.parent / "src"
# where docs/bench.md builds it (build/ is ignored by git)
DEFAULT_LLAMA_SERVER = str(SRC.parent / "build" / "llama-server" / "bin" / "llama-server")
BASELINE_SRC: list[str] = []  # --pyggml-baseline


# ---- servers -------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def eog_bias(model: Path) -> dict[str, float]:
    """A logit bias banning the model's end-of-generation tokens: for a pyggml tree from before
    ``ignore_eos`` (``--pyggml-baseline``)."""
    sys.path.insert(0, str(SRC))
    from pyggml.backend import Backend, BackendParams
    from pyggml.tokenizer import from_metadata

    backend = Backend.load(model, BackendParams(n_threads=1, repack=False))
    try:
        return {str(t): -100 for t in from_metadata(backend.config).vocab.eog}
    finally:
        backend.close()


def pyggml_command(args: argparse.Namespace, parallel: int, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "pyggml.cli", "serve", str(args.model), "--host", "127.0.0.1", "--port", str(port),
           "--parallel", str(parallel), "--ctx", str(args.ctx), "--threads", str(args.threads),
           "--batch-size", str(args.batch_size), "--flash-attn", args.flash_attn]
    return cmd


def llama_server_help(binary: str) -> str:
    try:
        return subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def llama_server_command(args: argparse.Namespace, parallel: int, port: int, help_text: str) -> list[str]:
    cmd = [args.llama_server, "-m", str(args.model), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(parallel), "-c", str(args.ctx * parallel), "-t", str(args.threads), "-tb", str(args.threads),
           "-b", str(args.batch_size), "-ub", str(args.batch_size), "-fa", args.flash_attn]
    if "--no-kv-unified" in help_text:  # one KV stream per slot (the default with an explicit -np, said here)
        cmd.append("--no-kv-unified")
    if "--no-webui" in help_text:
        cmd.append("--no-webui")
    return cmd


class Server:
    """A server subprocess on loopback; ``ready()`` waits for its /health to answer 200."""

    def __init__(self, name: str, cmd: list[str], port: int, log_path: Path):
        self.name, self.cmd, self.port = name, cmd, port
        self.log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        env = dict(os.environ)
        if name.startswith("pyggml"):
            src = str(SRC) if name == "pyggml" else BASELINE_SRC[0]
            env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.proc.returncode} (log: {self.log.name})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} did not become ready in {timeout:g} s (log: {self.log.name})")

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the server process has used so far (Linux; 0 elsewhere)."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# ---- the client ------------------------------------------------------------------------------------
async def stream_completion(port: int, body: dict[str, Any]) -> dict[str, Any]:
    """POST ``body`` to /v1/completions and read the SSE stream: times of the text events, the
    completion token count (final ``usage``, else llama.cpp's ``timings.predicted_n``)."""
    payload = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + payload)
        await writer.drain()
        status = (await reader.readline()).split()
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            key, _, value = line.decode("latin-1").partition(":")
            headers[key.strip().lower()] = value.strip().lower()
        if len(status) < 2 or status[1] != b"200":
            raise RuntimeError(f"HTTP {status[1:2]}: {(await reader.read(2000)).decode('utf-8', 'replace')}")
        chunked = headers.get("transfer-encoding") == "chunked"
        times: list[float] = []
        tokens, text, buf, done = None, [], b"", False
        while not done:
            if chunked:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    break
                data = await reader.readexactly(size + 2)
                data = data[:-2]
            else:
                data = await reader.read(65536)
                if not data:
                    break
            now = time.perf_counter()
            buf += data
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    line = line[5:].strip()
                    if line == b"[DONE]":
                        done = True
                        break
                    obj = json.loads(line)
                    if "error" in obj:
                        raise RuntimeError(f"stream error: {obj['error']}")
                    choices = obj.get("choices") or []
                    if choices and choices[0].get("text"):
                        times.append(now)
                        text.append(choices[0]["text"])
                    usage = obj.get("usage")
                    if usage:
                        tokens = usage.get("completion_tokens", tokens)
                    elif tokens is None and "timings" in obj:
                        tokens = obj["timings"].get("predicted_n")
        return {"start": start, "end": time.perf_counter(), "times": times, "tokens": tokens, "text": "".join(text)}
    finally:
        writer.close()


def make_prompts(count: int, salt: int) -> list[str]:
    """``count`` distinct short prompts (about 12 words), each starting with its own word."""
    rng = random.Random(salt)
    return [" ".join([f"{WORDS[(salt + i) % len(WORDS)]}{salt}x{i}", *rng.choices(WORDS, k=11)]) for i in range(count)]


async def drive(port: int, parallel: int, requests: int, n_gen: int, prompts: list[str], model: str,
                no_eos: dict[str, Any] | None = None) -> dict[str, Any]:
    """P clients, each sending ``requests`` streamed completions one after another. ``no_eos``: the
    body fields that keep a completion from ending early (default ``ignore_eos: true``)."""
    no_eos = {"ignore_eos": True} if no_eos is None else no_eos
    results: list[dict[str, Any]] = []

    async def client(c: int) -> None:
        for r in range(requests):
            body = {"model": model, "prompt": prompts[c * requests + r], "max_tokens": n_gen, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}, **no_eos}
            results.append(await stream_completion(port, body))

    t0 = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(parallel)))
    wall = time.perf_counter() - t0
    return summarize(results, wall, n_gen)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(results: list[dict[str, Any]], wall: float, n_gen: int) -> dict[str, Any]:
    tokens = [r["tokens"] if r["tokens"] is not None else len(r["times"]) for r in results]
    ttft = [r["times"][0] - r["start"] for r in results if r["times"]]
    itl = [b - a for r in results for a, b in zip(r["times"], r["times"][1:], strict=False)]
    short = sum(1 for t in tokens if t != n_gen)
    return {"tok_s": sum(tokens) / wall, "wall_s": wall, "requests": len(results), "tokens": sum(tokens),
            "short_requests": short, "events": sum(len(r["times"]) for r in results),
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p95_ms": 1e3 * percentile(ttft, 95),
            "itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p95_ms": 1e3 * percentile(itl, 95)}


# ---- the race ------------------------------------------------------------------------------------------
METRICS = ("tok_s", "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "itl_p95_ms", "cpu_ms_per_token")


def run_parallel(args: argparse.Namespace, parallel: int, help_text: str, logs: Path) -> dict[str, Any]:
    servers: dict[str, Server] = {}
    out: dict[str, Any] = {"parallel": parallel, "rounds": {name: [] for name in args.servers}, "errors": {}}
    try:
        for name in args.servers:
            port = free_port()
            cmd = (pyggml_command(args, parallel, port) if name.startswith("pyggml")
                   else llama_server_command(args, parallel, port, help_text))
            servers[name] = Server(name, cmd, port, logs / f"{name}-P{parallel}.log")
            out.setdefault("commands", {})[name] = cmd
        for name, server in servers.items():
            try:
                server.ready(args.start_timeout)
                no_eos = {"logit_bias": args.eog_bias} if name == "pyggml-baseline" else None
                asyncio.run(drive(server.port, 1, 1, 4, make_prompts(1, 10_000 + parallel), args.model_name,
                                  no_eos))  # warm-up
            except Exception as exc:
                out["errors"][name] = repr(exc)
        for r in range(args.rounds):
            order = list(servers) if r % 2 == 0 else list(reversed(servers))
            for name in order:
                if name in out["errors"]:
                    continue
                prompts = make_prompts(parallel * args.requests, 1 + 97 * r + parallel)
                no_eos = {"logit_bias": args.eog_bias} if name == "pyggml-baseline" else None
                cpu = servers[name].cpu_seconds()
                try:
                    result = asyncio.run(drive(servers[name].port, parallel, args.requests, args.n_gen, prompts,
                                               args.model_name, no_eos))
                except Exception as exc:
                    out["errors"][name] = repr(exc)
                    continue
                # CPU the server spent per token: what another process's load changes least (with -t 1;
                # at more threads ggml's workers also spin while waiting for each other)
                result["cpu_ms_per_token"] = 1e3 * (servers[name].cpu_seconds() - cpu) / max(result["tokens"], 1)
                out["rounds"][name].append(result)
                if not args.quiet:
                    print(f"  P={parallel} round {r + 1} {name}: {result['tok_s']:.2f} tok/s, TTFT p50 "
                          f"{result['ttft_p50_ms']:.0f} ms, ITL p95 {result['itl_p95_ms']:.1f} ms"
                          + (f", {result['short_requests']} short" if result["short_requests"] else ""),
                          file=sys.stderr, flush=True)
    finally:
        for server in servers.values():
            server.stop()
    out["median"] = {name: {m: statistics.median(x[m] for x in rounds) for m in METRICS}
                     for name, rounds in out["rounds"].items() if rounds}
    med = out["median"]
    if "pyggml" in med and "llama-server" in med:
        out["ratio"] = {m: _ratio(med["pyggml"][m], med["llama-server"][m]) for m in METRICS}
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| P | server | tok/s | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p95 ms | server CPU ms/token |",
             "|---|---|---|---|---|---|---|---|"]
    for res in results:
        for name, med in res["median"].items():
            lines.append(f"| {res['parallel']} | {name} | {med['tok_s']:.2f} | {med['ttft_p50_ms']:.0f} | "
                         f"{med['ttft_p95_ms']:.0f} | {med['itl_p50_ms']:.1f} | {med['itl_p95_ms']:.1f} | "
                         f"{med['cpu_ms_per_token']:.2f} |")
        if "pyggml-baseline" in res["median"] and "pyggml" in res["median"]:
            new, old = res["median"]["pyggml"], res["median"]["pyggml-baseline"]
            lines.append(f"| {res['parallel']} | pyggml/pyggml-baseline | "
                         + " | ".join(f"{_ratio(new[m], old[m]):.2f}x" for m in METRICS) + " |")
        if "ratio" in res:
            ratio = res["ratio"]
            lines.append(f"| {res['parallel']} | pyggml/llama-server | "
                         + " | ".join(f"{ratio[m]:.2f}x" for m in METRICS) + " |")
        for name, err in res["errors"].items():
            lines.append(f"| {res['parallel']} | {name} | failed: {err[:150]} | | | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(SRC))
    from pyggml.bench import add_model_arguments, model_argument

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER") or DEFAULT_LLAMA_SERVER,
                        help="llama.cpp's llama-server binary (default: $LLAMA_SERVER or %(default)s)")
    parser.add_argument("--servers", default=",".join(SERVERS), help="which to run (default: both)")
    parser.add_argument("--pyggml-baseline", metavar="SRC", default=None,
                        help="also race `pyggml serve` from another checkout's src/ folder (server "
                             "'pyggml-baseline'; EOG banned by logit_bias, for trees without ignore_eos)")
    parser.add_argument("-P", "--parallel", default="1,4,8", help="parallel clients/slots (default: 1,4,8)")
    parser.add_argument("-n", "--n-gen", type=int, default=64, help="tokens per request (default: 64)")
    parser.add_argument("--requests", type=int, default=4, help="requests per client (default: 4: 4*P in all)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: 3)")
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=1024, help="context per sequence (default: 1024)")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--flash-attn", choices=["on", "off", "auto"], default="off")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--logs", type=Path, default=None, help="folder for the servers' logs (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="write all rounds and medians here")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    args.model = model_argument(parser, args).resolve()
    args.model_name = args.model.stem
    args.servers = [s for s in args.servers.split(",") if s]
    if args.pyggml_baseline:
        BASELINE_SRC[:] = [str(Path(args.pyggml_baseline).resolve())]
        args.servers.append("pyggml-baseline")
        args.eog_bias = eog_bias(args.model)
    if unknown := set(args.servers) - set(SERVERS) - {"pyggml-baseline"}:
        parser.error(f"unknown servers {sorted(unknown)}; choose from {SERVERS}")
    help_text = ""
    if "llama-server" in args.servers:
        help_text = llama_server_help(args.llama_server)
        if not help_text:
            parser.error(f"llama-server not runnable: {args.llama_server} (build it: docs/bench.md)")
    if args.logs is None:
        import tempfile

        args.logs = Path(tempfile.mkdtemp(prefix="compare_servers-"))
    args.logs.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    results = [run_parallel(args, int(p), help_text, args.logs) for p in args.parallel.split(",")]
    import importlib.util

    fast = [m for m in ("httptools", "uvloop") if importlib.util.find_spec(m) is not None]  # uvicorn's choice
    print(f"\n{args.model.name}, {args.threads} threads, {args.n_gen} tokens x {args.requests} requests per client, "
          f"medians of {args.rounds} rounds; started {started}, load average {load}; pyggml serve with "
          f"{' + '.join(fast) or 'h11 + asyncio (no httptools/uvloop installed)'}")
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "threads": args.threads, "n_gen": args.n_gen,
                                         "requests": args.requests, "rounds": args.rounds, "started": started,
                                         "pyggml_http": fast,
                                         "loadavg": load, "results": results}, indent=1))
    return 1 if any(res["errors"] for res in results) else 0


if __name__ == "__main__":
    sys.exit(main())
