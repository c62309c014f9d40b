"""A model all-local vs split over loopback `pyggml rpc-server`s: time, CPU and bytes per forward pass.

    python bench/rpc_split.py --synthetic tinyllama-1.1b --type q4_0 -p 512 -n 128 --servers 2 -r 2

Starts the servers itself (each with ``--threads``), runs pp and tg as ``pyggml bench`` does (its
``Session``) for each configuration in turn, and reports per forward pass: wall time, the CPU time of
every process involved (client and servers, from /proc: on a shared machine it says what the split
costs even when the wall clock mostly measures the neighbours) and the bytes through each relay.
Configurations: ``local`` (repacked Q4 weights, as usual), ``local-plain`` (``repack=False``: the
kernels an RPC server runs), ``rpc`` (split over local + servers, through pyggml's relays) and
``rpc-direct`` (ggml talking to the servers itself, ``PYGGML_RPC_DIRECT=1``: the relay's cost).
Linux only (CPU times from /proc). Results as JSON lines on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_servers(n: int, threads: int) -> list[tuple[subprocess.Popen, str]]:
    from pyggml.backend.hardware import rpc_version
    from pyggml.rpc import RPCError, hello

    servers = []
    for _ in range(n):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "pyggml.cli", "rpc-server", "--port", str(port), "--threads",
                                 str(threads)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"),
                                                                                 os.environ.get("PYTHONPATH", "")])))
        endpoint = f"127.0.0.1:{port}"
        for _ in range(300):
            try:
                hello(endpoint, rpc_version(), timeout=2.0)
                break
            except RPCError:
                time.sleep(0.2)
        else:
            proc.kill()
            raise RuntimeError("an rpc-server did not start")
        servers.append((proc, endpoint))
    return servers


def stop_servers(servers: list[tuple[subprocess.Popen, str]]) -> None:
    for proc, _ in servers:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
    for proc, _ in servers:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)


def measure(name: str, path: Path, args: argparse.Namespace, servers: list[tuple[subprocess.Popen, str]],
            rpc: list[str], repack: bool) -> None:
    from pyggml.bench import Session

    session = Session(path, n_threads=args.threads, rpc=rpc, repack=repack, n_ctx=args.n_prompt + args.n_gen,
                      max_batch=args.n_prompt)
    pids = [os.getpid()] + [proc.pid for proc, _ in servers if rpc]
    try:
        placement = {k: [v[0], v[-1]] for k, v in session.model.backend.placement().items()} if rpc else None
        for test, run in (("pp", lambda: session.prompt(args.n_prompt, args.n_prompt)),
                          ("tg", lambda: session.generate(args.n_gen))):
            run()  # warm-up
            for rep in range(args.repetitions):
                cpu0 = [cpu_seconds(pid) for pid in pids]
                traffic0 = session.model.backend.rpc_traffic()
                t0 = time.perf_counter()
                sample = run()
                wall = time.perf_counter() - t0
                cpu = [cpu_seconds(pid) - c for pid, c in zip(pids, cpu0, strict=True)]
                traffic = session.model.backend.rpc_traffic()
                steps = sample.parts.steps
                print(json.dumps({
                    "config": name, "test": f"{test}{args.n_prompt if test == 'pp' else args.n_gen}", "rep": rep,
                    "tokens_per_s": sample.tokens / wall, "ms_per_step": 1e3 * wall / steps,
                    "cpu_ms_per_step": {"client": 1e3 * cpu[0] / steps,
                                        "servers": [round(1e3 * c / steps, 2) for c in cpu[1:]]},
                    "kib_sent_per_step": (traffic[0] - traffic0[0]) / 1024 / steps,
                    "kib_received_per_step": (traffic[1] - traffic0[1]) / 1024 / steps,
                    "placement": placement, "load_s": session.load_s,
                    "loadavg": os.getloadavg()[0],
                }), flush=True)
    finally:
        session.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--synthetic", default="tinyllama-1.1b")
    parser.add_argument("--type", default="q4_0")
    parser.add_argument("-p", "--n-prompt", type=int, default=512)
    parser.add_argument("-n", "--n-gen", type=int, default=128)
    parser.add_argument("-r", "--repetitions", type=int, default=2)
    parser.add_argument("-t", "--threads", type=int, default=1, help="client threads (default 1)")
    parser.add_argument("--server-threads", type=int, default=1)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--configs", default="local,local-plain,rpc,rpc-direct")
    args = parser.parse_args()

    from pyggml.bench import synthetic_model

    path = synthetic_model(args.synthetic, args.type)
    for name in args.configs.split(","):
        servers = start_servers(args.servers, args.server_threads) if name.startswith("rpc") else []
        try:
            if name == "rpc-direct":
                os.environ["PYGGML_RPC_DIRECT"] = "1"
            measure(name, path, args, servers, [e for _, e in servers], repack=name == "local")
        finally:
            os.environ.pop("PYGGML_RPC_DIRECT", None)
            stop_servers(servers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
