"""Server memory under two abuses (issue 13, items 7 and 8), measured on a ``pyggml serve``
subprocess of the source tree given (compare a tree before and after a change):

    python bench/server_memory.py prompt MODEL.gguf --mb 10        # one oversized prompt
    python bench/server_memory.py unread MODEL.gguf --streams 2 --seconds 100 -- --max-predict 10000000

``prompt`` sends one ``/api/generate`` of ``--mb`` MB and prints the status, the time it took and
the server's RSS before, at peak and after. ``unread`` opens ``--streams`` streaming completions
whose clients never read (4 KiB receive windows) and samples the RSS and the slots in use. Words
after ``--`` go to ``pyggml serve``. The server runs with ``--ctx 128 --parallel N --threads 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def start(args: argparse.Namespace, parallel: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(Path(args.tree) / "src"))
    cmd = [sys.executable, "-m", "pyggml.cli", "serve", args.model, "--port", str(args.port), "--ctx", "128",
           "--parallel", str(parallel), "--threads", "1", *args.serve]
    server = subprocess.Popen(cmd, cwd=args.tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=5)
            return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise SystemExit("the server did not start")


def memory(pid: int) -> tuple[int, int]:
    """(peak, current) RSS in MB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmHWM"].split()[0]) // 1024, int(fields["VmRSS"].split()[0]) // 1024


def prompt(args: argparse.Namespace) -> dict:
    server = start(args, 1)
    try:
        before = memory(server.pid)[1]
        body = json.dumps({"model": Path(args.model).stem, "prompt": "word " * int(args.mb * 1e6 / 5),
                           "stream": False}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{args.port}/api/generate", body,
                                         {"Content-Type": "application/json"})
        start_time = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=1200) as response:
                status, text = response.status, response.read()[:120]
        except urllib.error.HTTPError as exc:
            status, text = exc.code, exc.read()[:120]
        seconds = time.perf_counter() - start_time
        time.sleep(1)
        peak, after = memory(server.pid)
        return {"status": status, "answer": text.decode(errors="replace"), "seconds": round(seconds, 2),
                "rss_mb_before": before, "rss_mb_peak": peak, "rss_mb_after": after}
    finally:
        server.terminate()
        server.wait()


def unread(args: argparse.Namespace) -> dict:
    server = start(args, args.streams)
    clients = []
    try:
        body = json.dumps({"model": Path(args.model).stem, "prompt": "hello", "max_tokens": 10**6, "temperature": 0,
                           "stream": True, "logit_bias": {"2": -100}}).encode()
        for _ in range(args.streams):
            client = socket.socket()
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.connect(("127.0.0.1", args.port))
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            clients.append(client)
        start_time, samples = time.monotonic(), []
        while time.monotonic() - start_time < args.seconds:
            time.sleep(args.seconds / 6)
            with urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=60) as response:
                slots = json.load(response)["slots_in_use"]
            samples.append({"s": round(time.monotonic() - start_time), "rss_mb": memory(server.pid)[1],
                            "slots_in_use": slots})
        return {"streams": args.streams, "samples": samples}
    finally:
        for client in clients:
            client.close()
        server.terminate()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["prompt", "unread"])
    parser.add_argument("model")
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]), help="source tree to serve from")
    parser.add_argument("--port", type=int, default=18431)
    parser.add_argument("--mb", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=100.0)
    parser.add_argument("serve", nargs="*", help="arguments for pyggml serve (after --)")
    args = parser.parse_args()
    print(json.dumps({"tree": args.tree, **(prompt(args) if args.what == "prompt" else unread(args))}))


if __name__ == "__main__":
    main()
