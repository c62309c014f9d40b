"""Layers on remote devices through ggml RPC (`pyggml rpc-server`, `rpc=`), on loopback only.

Two rpc-server processes on free ports serve the module; a model split over the local CPU and both
remotes must give the same logits and greedy tokens as the all-local run (the remote CPU backends run
the same kernels, and repacking is off on both sides so the local layers do too). Failures must be
clean: an unreachable server, a server of another protocol version, and a server killed while
generating each raise RPCError, within a bounded time, without taking the test process down.
Every process is started and stopped by PID; every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from pyggml._ggml import lib

import pyggml
from pyggml import BackendParams, models
from pyggml import rpc as wire
from pyggml.rpc import RPCError
from pyggml.runner import CompletionRequest, Runner
from pyggml.synthetic import write_synthetic

from . import rpc_wire as rw
from .conftest import SHARED_MODELS
from .rpc_wire import VERSION, Server, cli, free_port

pytestmark = pytest.mark.skipif(not lib.PYGGML_HAS_RPC, reason="pyggml built without ggml RPC (PYGGML_RPC=OFF)")

STORIES = SHARED_MODELS / "stories260K.gguf"


@pytest.fixture(scope="module")
def servers():
    started = []
    try:
        for _ in range(2):
            started.append(Server())
        yield [s.endpoint for s in started]
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="module")
def stories_path():
    if not STORIES.exists():
        pytest.skip(f"{STORIES} is absent")
    return STORIES


@pytest.fixture(scope="module", params=["f32", "q8_0"])
def synthetic_path(request, tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("rpc") / f"tiny-{request.param}.gguf", "tiny", request.param)


def load(path, **options):
    options.setdefault("n_threads", 1)
    return pyggml.load(path, repack=False, num_ctx=128, **options)


def run_twice(path, prompt, servers, tensor_split=None):
    """(placement, tokens, logits) all-local, then split over the servers."""
    runs = []
    for rpc in ((), servers):
        llm = load(path, rpc=rpc, tensor_split=tensor_split if rpc else None)
        try:
            ids = llm.tokenize(prompt)
            logits = llm.logits(ids)
            llm.generate(prompt, max_tokens=12, temperature=0)
            runs.append((llm.model.backend.placement(), llm.stats.tokens, logits))
        finally:
            llm.close()
    return runs


def test_stories_split_over_two_servers_matches_local(stories_path, servers):
    (_, local_tokens, local_logits), (placement, tokens, logits) = run_twice(stories_path, "Once upon a time", servers)
    devices = list(placement)
    assert devices[0] == "CPU" and devices[1].endswith(f"({servers[0]})") and devices[2].endswith(f"({servers[1]})")
    assert all(placement.values())  # every device computes some layers
    assert tokens == local_tokens and len(tokens) == 12
    np.testing.assert_array_equal(logits, local_logits)


def test_synthetic_split_matches_local(synthetic_path, servers):
    # the tiny shape has two layers: one on each remote; embeddings and the output layer stay local
    (_, local_tokens, local_logits), (placement, tokens, logits) = run_twice(
        synthetic_path, "hello world", servers, tensor_split=[0, 1, 1])
    assert list(placement.values()) == [[0], [1]]
    assert tokens == local_tokens
    np.testing.assert_array_equal(logits, local_logits)


def test_devices_lists_remote_devices(stories_path, servers):
    llm = load(stories_path, rpc=servers)
    try:
        remote = [d for d in pyggml.devices() if d.kind == "rpc"]
        assert {d.description for d in remote} >= {f"RPC server {e}" for e in servers}
        assert all(d.memory_total > 0 for d in remote if d.description.split()[-1] in servers)
        memory = llm.model.backend.memory()
        assert sum(1 for name, m in memory.items() if name.startswith("RPC") and m["weights"] > 0) == 2
    finally:
        llm.close()


def test_runner_four_sequences_over_rpc(stories_path, servers):
    requests = [("Once upon a time", 20), ("Lily went to the", 12), ("The cat", 16), ("Tom had a big red", 10)]

    def complete_all(model):
        results: list = [None] * len(requests)

        def work(i):
            prompt, n = requests[i]
            chunks = list(runner.completion(CompletionRequest(prompt, max_tokens=n, temperature=0.0)))
            results[i] = [t for c in chunks for t in c.tokens]

        with Runner(model, parallel=4, num_ctx=128, batch_size=16) as runner:
            threads = [threading.Thread(target=work, args=(i,)) for i in range(len(requests))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
        return results

    local = models.load(stories_path, BackendParams(n_threads=1, repack=False))
    try:
        expected = complete_all(local)
    finally:
        local.close()
    remote = models.load(stories_path, BackendParams(n_threads=1, repack=False, rpc=servers))
    try:
        got = complete_all(remote)
    finally:
        remote.close()
    assert all(expected) and got == expected


def test_prefix_copy_over_rpc_matches_local(stories_path, servers):
    """A request forking another slot's cached prefix copies cache cells on every device in one step: each
    device's copy is a graph of its own (one graph over all of them put a view of a layer's transposed V into
    the split of the device before it, and both servers refused a graph naming a tensor they do not hold)."""
    prompts = ["Once upon a time", "Once upon a time there", "Lily went", "Once upon"]

    def complete_in_turn(model):
        with Runner(model, parallel=4, num_ctx=128, batch_size=16) as runner:
            chunks = [list(runner.completion(CompletionRequest(p, max_tokens=3, temperature=0.0))) for p in prompts]
        return [([t for c in cs for t in c.tokens], cs[-1].cached_tokens) for cs in chunks]

    local = models.load(stories_path, BackendParams(n_threads=1, repack=False))
    try:
        expected = complete_in_turn(local)
    finally:
        local.close()
    remote = models.load(stories_path, BackendParams(n_threads=1, repack=False, rpc=servers))
    try:
        assert len(remote.backend.placement()) == 3  # layers on the CPU and both servers
        got = complete_in_turn(remote)
        assert remote.cache.config.permuted_v  # V transposed: its copy goes through a view of the store
    finally:
        remote.close()
    assert got == expected and expected[-1][1] > 0  # the last one forked a cached prefix


def test_context_shift_over_rpc_matches_local(stories_path, servers):
    """Past num_ctx the runner shifts the cache: the keys of the remote layers are re-rotated there."""

    def generate(model):
        with Runner(model, parallel=1, num_ctx=32, batch_size=16) as runner:
            chunks = list(runner.completion(CompletionRequest("Once upon a time", max_tokens=60, temperature=0.0,
                                                              cache_prompt=False)))
        return [t for c in chunks for t in c.tokens], chunks[-1].generated_tokens

    results = []
    for rpc in ((), servers):
        model = models.load(stories_path, BackendParams(n_threads=1, repack=False, rpc=rpc))
        try:
            results.append(generate(model))
        finally:
            model.close()
    assert results[0][1] == 60 and results[1] == results[0]


def test_a_split_graph_computes_again_after_other_graphs(servers):
    """ggml's scheduler cannot split one graph twice: a graph over several devices keeps its own."""
    from pyggml.backend import Backend

    backend = Backend(BackendParams(n_threads=1, rpc=servers[:1], tensor_split=[1, 1]))
    try:
        backend.config = type(backend.config)({"general.architecture": "t", "t.block_count": 2})
        remote = backend.alloc_persistent("f32", (4, 8), layer=1)  # on the server
        local = backend.alloc_persistent("f32", (4, 8), layer=0)
        devices = list(backend.placement())
        assert devices[0] == "CPU" and devices[1].endswith(f"({servers[0]})")
        remote_name = devices[1].split()[0]  # RPC<n>: numbered in the order servers joined this process
        rows = np.arange(32, dtype=np.float32).reshape(8, 4)
        with backend.new_context() as ctx:
            index = ctx.from_numpy(np.arange(8, dtype=np.int32))
            ctx.compute(remote.set_rows(ctx.from_numpy(rows), index), local.set_rows(ctx.from_numpy(-rows), index))
        graph = backend.new_context()
        i = graph.from_numpy(np.array([7, 0], np.int32), name="i")
        out = local.rows(i) + remote.rows(i) * 3.0
        graph.reserve()
        graph.compute(out)
        np.testing.assert_array_equal(out.numpy(), 2 * rows[[7, 0]])
        for picks in ([6, 1], [2, 2], [5, 3]):
            with backend.new_context() as other:  # another graph in between
                x = remote.rows(other.from_numpy(np.array([picks[0]], np.int32))) + 1.0
                other.compute(x)
                np.testing.assert_array_equal(x.numpy(), rows[[picks[0]]] + 1)
            graph.set_input("i", np.array(picks, np.int32))
            graph.compute(out)
            np.testing.assert_array_equal(out.numpy(), 2 * rows[picks])
        graph.close()
        assert len(backend._sched_pool) >= 1  # its scheduler (and compute buffers) serve the next graphs
        grown = backend.new_context()
        y = remote.rows(grown.from_numpy(np.array([1], np.int32)))
        grown.compute(y)
        with pytest.raises(ValueError, match="cannot grow"):
            grown.compute(y + 1.0)
        assert backend.memory()[remote_name]["graph"] > 0
    finally:
        backend.close()


def test_killed_server_raises_a_clear_error_and_nothing_hangs(stories_path, servers):
    victim = Server()
    outcome: dict = {}

    def generate():
        llm = load(stories_path, rpc=[servers[0], victim.endpoint])
        try:
            for i, _ in enumerate(llm.generate("Once upon a time", max_tokens=100, temperature=0, stream=True)):
                if i == 2:
                    os.kill(victim.proc.pid, signal.SIGKILL)
            outcome["result"] = "finished"
        except Exception as exc:
            outcome["result"] = exc
            try:
                llm.generate("Once", max_tokens=2)
            except Exception as again:
                outcome["again"] = again
        finally:
            llm.close()
            outcome["closed"] = True

    worker = threading.Thread(target=generate, daemon=True)
    worker.start()
    worker.join(120)  # a guard against a hang, not a timing check
    victim.stop(signal.SIGKILL)
    assert not worker.is_alive(), "generation hung after the server died"
    error = outcome["result"]
    assert isinstance(error, RPCError), error
    assert victim.endpoint in str(error) and "load again" in str(error)
    assert isinstance(outcome["again"], RPCError) and outcome["closed"]
    # the surviving server serves the next client
    llm = load(stories_path, rpc=[servers[0]])
    try:
        assert llm.generate("Once upon a time", max_tokens=4, temperature=0)
    finally:
        llm.close()
    with pytest.raises(RPCError, match="cannot reach"):
        load(stories_path, rpc=[victim.endpoint])


def test_unreachable_server_is_a_clear_error(stories_path):
    port = free_port()  # nothing listens there
    with pytest.raises(RPCError, match=f"cannot reach rpc server 127.0.0.1:{port}"):
        load(stories_path, rpc=[f"127.0.0.1:{port}"])


def fake_server(answer: bytes) -> tuple[str, threading.Thread, socket.socket]:
    """A one-connection server that answers HELLO with ``answer`` (framed) and closes."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(30)

    def serve():
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(30)
            try:
                conn.recv(1 + 8 + 24)
                conn.sendall(struct.pack("<Q", len(answer)) + answer)
            except OSError:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"127.0.0.1:{listener.getsockname()[1]}", thread, listener


@pytest.mark.parametrize("answer, message", [
    (bytes([VERSION[0] - 1, 0, 0, 0]) + bytes(24), "speaks RPC protocol"),
    (bytes([VERSION[0], VERSION[1] + 1, 0, 0]) + bytes(24), "speaks RPC protocol"),
    (b"HTTP/1.1 400", "not a ggml RPC server"),
])
def test_protocol_mismatch_is_a_clear_error(stories_path, answer, message):
    endpoint, thread, listener = fake_server(answer)
    try:
        with pytest.raises(RPCError, match=message):
            load(stories_path, rpc=[endpoint])
    finally:
        listener.close()
        thread.join(30)


class FakeUpstream:
    """A scripted stand-in for an RPC server behind a relay: ``script(conn)`` runs on its one connection."""

    def __init__(self, script):
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(1)
        self.listener.settimeout(30)
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, args=(script,), daemon=True)
        self.thread.start()

    def _serve(self, script):
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(30)
            try:
                script(conn)
            except OSError:
                pass

    def close(self):
        self.listener.close()
        self.thread.join(30)


def recv_exact(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "connection closed"
        data += chunk
    return data


def command(cmd: int, payload: bytes) -> bytes:
    return bytes([cmd]) + struct.pack("<Q", len(payload)) + payload


def test_relay_forwards_and_counts_then_answers_for_a_silent_server():
    from pyggml import rpc

    big = bytes(range(256)) * 1024  # 256 KiB: streamed, not buffered
    got = {}

    def script(conn):
        got["set"] = recv_exact(conn, 9 + len(big))
        got["align"] = recv_exact(conn, 9 + 4)
        conn.sendall(struct.pack("<Q", 8) + struct.pack("<Q", 32))  # GET_ALIGNMENT answered
        recv_exact(conn, 9 + 4)  # the next GET_ALIGNMENT is never answered
        time.sleep(3)

    upstream = FakeUpstream(script)
    relay = rpc.Relay(upstream.endpoint, VERSION, timeout=0.5)
    try:
        with socket.create_connection(("127.0.0.1", int(relay.address.rsplit(":", 1)[1])), timeout=30) as ggml:
            ggml.sendall(command(rpc.CMD_SET_TENSOR, big))
            ggml.sendall(command(rpc.CMD_GET_ALIGNMENT, bytes(4)))
            assert recv_exact(ggml, 16) == struct.pack("<QQ", 8, 32)
            ggml.sendall(command(rpc.CMD_GET_ALIGNMENT, bytes(4)))
            # the server stays silent past the timeout: a well-formed stand-in answer, and the relay says why
            assert recv_exact(ggml, 16) == struct.pack("<QQ", 8, 64)
            assert "did not answer within 0.5 s" in relay.error
            ggml.sendall(command(rpc.CMD_GET_TENSOR, bytes(rpc.RPC_TENSOR_SIZE + 8) + struct.pack("<Q", 12)))
            assert recv_exact(ggml, 8 + 12) == struct.pack("<Q", 12) + bytes(12)  # zeros from now on
    finally:
        upstream.close()
    assert got["set"] == command(rpc.CMD_SET_TENSOR, big) and got["align"] == command(rpc.CMD_GET_ALIGNMENT, bytes(4))
    traffic = relay.traffic()
    assert traffic.commands["SET_TENSOR"] == (1, 9 + len(big)) and traffic.messages == 4


def test_relay_pads_a_tensor_cut_off_by_a_dying_server():
    from pyggml import rpc

    size = 200_000
    data = bytes(range(256)) * (size // 256 + 1)

    def script(conn):
        recv_exact(conn, 9 + rpc.RPC_TENSOR_SIZE + 16)
        conn.sendall(struct.pack("<Q", size) + data[:70_000])  # then the server dies

    upstream = FakeUpstream(script)
    relay = rpc.Relay(upstream.endpoint, VERSION, timeout=30)
    try:
        with socket.create_connection(("127.0.0.1", int(relay.address.rsplit(":", 1)[1])), timeout=30) as ggml:
            ggml.sendall(command(rpc.CMD_GET_TENSOR, bytes(rpc.RPC_TENSOR_SIZE + 8) + struct.pack("<Q", size)))
            answer = recv_exact(ggml, 8 + size)
            assert "connection lost" in relay.error  # while ggml's connection is open
    finally:
        upstream.close()
    assert answer[:8] == struct.pack("<Q", size) and answer[8:8 + 70_000] == data[:70_000]
    assert answer[8 + 70_000:] == bytes(size - 70_000)


def test_options_are_checked(stories_path, servers):
    for bad in (["localhost"], ["127.0.0.1:0"], ["127.0.0.1:x"], ["::1:50052"], [servers[0], servers[0]]):
        with pytest.raises(ValueError, match="rpc"):
            load(stories_path, rpc=bad)
    with pytest.raises(ValueError, match="one value per device"):
        load(stories_path, rpc=servers, tensor_split=[1, 1])
    for bad_split in ([1, -1, 1], [0, 0, 0], ["a", 1, 1]):
        with pytest.raises(ValueError, match="tensor_split"):
            load(stories_path, rpc=servers, tensor_split=bad_split)


def test_tensor_split_places_layers_in_order(stories_path, servers):
    llm = load(stories_path, rpc=",".join(servers), tensor_split="3,1,1")  # the CLI's comma-separated forms
    try:
        placement = llm.model.backend.placement()
    finally:
        llm.close()
    assert list(placement.values()) == [[0, 1, 2], [3], [4]]
    assert list(placement)[0] == "CPU" and servers[0] in list(placement)[1] and servers[1] in list(placement)[2]


def test_show_reports_the_placement(stories_path, servers):
    proc = cli("show", str(stories_path), "--rpc", ",".join(servers))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "layers 0-1  CPU" in out and f"({servers[0]})" in out and f"({servers[1]})" in out


def test_run_over_rpc_matches_run_alone(stories_path, servers):
    outputs = []
    for extra in ((), ("--rpc", ",".join(servers), "--tensor-split", "1,1,2")):
        proc = cli("run", str(stories_path), "Once upon a time", "--max-tokens", "8", "--temperature", "0",
                   "--threads", "1", *extra)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outputs.append((out, err))
    assert outputs[1][0] == outputs[0][0] and len(outputs[0][0]) > 10
    lines = [line for line in outputs[1][1].splitlines() if line.startswith("pyggml: layers")]
    assert lines[0] == "pyggml: layers 0-1 on CPU"
    assert lines[1].startswith("pyggml: layers 2 on RPC") and lines[1].endswith(f"({servers[0]})")
    assert lines[2].startswith("pyggml: layers 3-4 on RPC") and lines[2].endswith(f"({servers[1]})")


def test_a_non_loopback_address_needs_allow_remote():
    proc = cli("rpc-server", "--host", "0.0.0.0", "--port", str(free_port()))
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "--allow-remote" in err and "no authentication" in err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_the_server_stops_cleanly_on_a_signal(sig):
    server = Server()
    code, err = server.stop(sig)
    assert code == 0, err
    assert "pyggml rpc-server: stopped" in err and "Traceback" not in err


# ---- a hostile client: each message that crashed ggml's server, sent to a live `pyggml rpc-server` ----------
def _alloc_size(ne0: int) -> bytes:
    return struct.pack("<I", 0) + rw.tensor(ne=(ne0,) * 4) + bytes(wire.RPC_TENSOR_SIZE * 10)


def _chain(depth: int, ptr: int, base: int) -> bytes:
    """A graph whose one node sits at the end of a chain of ``depth`` views (ggml recurses along it)."""
    tensors = [rw.tensor(1, buffer=ptr, data=base, ne=(4,))]
    tensors += [rw.tensor(i, buffer=ptr, data=base, ne=(4,), op=1, src=(i - 1,)) for i in range(2, depth + 1)]
    return rw.graph([depth], tensors)


def _vec(i: int, ptr: int, base: int, **kw) -> bytes:
    return rw.tensor(i, buffer=ptr, data=base + 256 * (i - 1), ne=(64,), **kw)


# name -> (what to send, given the connection and a fresh 4 KiB buffer at ptr/base): each is refused and
# closes its connection. The first ten aborted or crashed ggml's server (issue 25, item 4).
HOSTILE = {
    "SET_TENSOR data past its buffer": lambda c, p, b: c.set(rw.tensor(buffer=p, data=b + 8192, ne=(16,)), bytes(64)),
    "GET_TENSOR data before its buffer": lambda c, p, b: c.send(
        wire.CMD_GET_TENSOR, rw.tensor(buffer=p, data=b - 4096, ne=(16,)) + struct.pack("<QQ", 0, 64)),
    "SET_TENSOR ne=2^32-1": lambda c, p, b: c.set(rw.tensor(buffer=p, data=b, ne=(2**32 - 1,)), bytes(64)),
    "GET_TENSOR ne=2^32-1 in every dimension": lambda c, p, b: c.send(
        wire.CMD_GET_TENSOR, rw.tensor(buffer=p, data=b, ne=(2**32 - 1,) * 4) + struct.pack("<QQ", 0, 4)),
    "COPY_TENSOR overrunning its destination": lambda c, p, b: c.send(
        wire.CMD_COPY_TENSOR, rw.tensor(1, buffer=p, data=b, ne=(1024,)) + rw.tensor(2, buffer=p, data=b + 2048)),
    "GET_ALLOC_SIZE overflowing": lambda c, p, b: c.send(wire.CMD_GET_ALLOC_SIZE, _alloc_size(2**32 - 1)),
    "graph node with op >= GGML_OP_COUNT": lambda c, p, b: c.send(
        wire.CMD_GRAPH_COMPUTE, rw.graph([1], [_vec(1, p, b, op=rw.OP_COUNT + 99)])),
    "graph node list [0]": lambda c, p, b: c.send(wire.CMD_GRAPH_COMPUTE, rw.graph([0], [_vec(1, p, b)])),
    "200,000-deep source chain": lambda c, p, b: c.send(wire.CMD_GRAPH_COMPUTE, _chain(200_000, p, b)),
    "GET_TENSOR data at 2^64-8": lambda c, p, b: c.send(
        wire.CMD_GET_TENSOR, rw.tensor(buffer=p, data=2**64 - 8) + struct.pack("<QQ", 0, 4)),
    "SET_TENSOR offset wrapping past 2^64": lambda c, p, b: c.set(rw.tensor(buffer=p, data=b, ne=(16,)), bytes(4),
                                                                  offset=2**64 - 2),
    "GET_TENSOR size past its tensor": lambda c, p, b: c.send(
        wire.CMD_GET_TENSOR, rw.tensor(buffer=p, data=b, ne=(16,)) + struct.pack("<QQ", 0, 2**63)),
    "MEMSET_TENSOR past its tensor": lambda c, p, b: c.send(
        wire.CMD_MEMSET_TENSOR, rw.tensor(buffer=p, data=b, ne=(16,)) + struct.pack("<QQB", 32, 64, 7)),
    "COPY_TENSOR with data at 2^64-8": lambda c, p, b: c.send(
        wire.CMD_COPY_TENSOR, rw.tensor(1, buffer=p, data=b) + rw.tensor(2, buffer=p, data=2**64 - 8)),
    "graph with a cycle": lambda c, p, b: c.send(
        wire.CMD_GRAPH_COMPUTE, rw.graph([1], [_vec(1, p, b, op=rw.OP_ADD, src=(2, 2)),
                                               _vec(2, p, b, op=rw.OP_ADD, src=(1, 1))])),
    "graph source not in the message": lambda c, p, b: c.send(
        wire.CMD_GRAPH_COMPUTE, rw.graph([1], [_vec(1, p, b, op=rw.OP_ADD, src=(7, 8))])),
    "graph node listed twice": lambda c, p, b: c.send(wire.CMD_GRAPH_COMPUTE, rw.graph([1, 1], [_vec(1, p, b)])),
    "graph tensor without a buffer": lambda c, p, b: c.send(
        wire.CMD_GRAPH_COMPUTE, rw.graph([1], [rw.tensor(1, data=b, ne=(64,))])),
    "graph counts larger than the message": lambda c, p, b: c.send(
        wire.CMD_GRAPH_COMPUTE, struct.pack("<II", 0, 2**32 - 1) + bytes(8)),
    "GRAPH_RECOMPUTE before any graph": lambda c, p, b: c.send(wire.CMD_GRAPH_RECOMPUTE, struct.pack("<I", 0)),
    "tensor type 200": lambda c, p, b: c.set(rw.tensor(buffer=p, data=b, type=200), bytes(4)),
    "a removed tensor type (4)": lambda c, p, b: c.set(rw.tensor(buffer=p, data=b, type=4, nb=(18, 18, 18, 18)),
                                                        bytes(4)),
    "Q4_0 row not a whole block": lambda c, p, b: c.set(rw.tensor(buffer=p, data=b, type=2, ne=(17,),
                                                                  nb=(18, 18, 18, 18)), bytes(4)),
    "a buffer of another connection": lambda c, p, b: c.send(wire.CMD_FREE_BUFFER, struct.pack("<Q", p + 64)),
    "device 9": lambda c, p, b: c.send(wire.CMD_ALLOC_BUFFER, struct.pack("<IQ", 9, 64)),
    "unknown command 200": lambda c, p, b: c.send(200, b""),
    "a second HELLO": lambda c, p, b: c.send(wire.CMD_HELLO, bytes(wire.CONN_CAPS_SIZE)),
    "SET_TENSOR shorter than its head": lambda c, p, b: c.send(wire.CMD_SET_TENSOR, bytes(10)),
    "BUFFER_CLEAR of the wrong size": lambda c, p, b: c.send(wire.CMD_BUFFER_CLEAR, struct.pack("<Q", p)),
    "GRAPH_COMPUTE header announcing 1 GiB": lambda c, p, b: c.sock.sendall(
        bytes([wire.CMD_GRAPH_COMPUTE]) + struct.pack("<Q", 1 << 30)),
    "SET_TENSOR of 1 GiB into 4 KiB": lambda c, p, b: c.sock.sendall(
        bytes([wire.CMD_SET_TENSOR]) + struct.pack("<Q", 1 << 30) + rw.tensor(buffer=p, data=b, ne=(1024,))
        + bytes(9)),
    "MUL_MAT of mismatched shapes": lambda c, p, b: _mul_mat_of_mismatched_shapes(c, p, b),
}


def _mul_mat_of_mismatched_shapes(c: rw.RawClient, p: int, b: int) -> None:
    """No check foresees every kernel's shape assertion: the session's worker dies (noticed at the next
    command), the server lives on."""
    a, x = _vec(1, p, b), rw.tensor(2, buffer=p, data=b + 256, ne=(3,))
    c.send(wire.CMD_GRAPH_COMPUTE, rw.graph([3], [a, x, _vec(3, p, b, op=rw.OP_MUL_MAT, src=(1, 2))]))
    c.send(wire.CMD_GET_ALIGNMENT, bytes(4))


@pytest.fixture(scope="module")
def guarded():
    server = Server("--max-memory", "64M")
    yield server
    server.stop()


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _alive_and_serving(server: Server) -> None:
    assert server.proc.poll() is None, "the rpc-server died"
    failed = []

    def client():
        try:
            rw.round_trip(server.endpoint)
        except BaseException as exc:
            failed.append(exc)

    done = threading.Thread(target=client, daemon=True)
    done.start()
    done.join(60)  # a bound against a hang, not a timing check
    assert not done.is_alive(), "a real client got no service"
    assert not failed, failed


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_message_is_refused_and_the_server_serves_on(guarded, case):
    with rw.RawClient(guarded.endpoint, timeout=60) as c:
        ptr, _, base = c.alloc(4096)
        HOSTILE[case](c, ptr, base)
        assert c.closed_by_server(), "the connection should close"
    _alive_and_serving(guarded)


def test_allocations_stop_at_max_memory_and_free_with_the_connection(guarded):
    def alloc(c, size):
        return struct.unpack("<QQ", c.call(wire.CMD_ALLOC_BUFFER, struct.pack("<IQ", 0, size), 16))

    with rw.RawClient(guarded.endpoint) as c:
        assert alloc(c, 48 << 20)[0] != 0
        assert alloc(c, 32 << 20) == (0, 0)  # over --max-memory 64M: a failed allocation, the connection lives
        with rw.RawClient(guarded.endpoint) as other:
            assert alloc(other, 32 << 20) == (0, 0)  # the limit holds for all clients together
        assert alloc(c, 1 << 20)[0] != 0
    with rw.RawClient(guarded.endpoint) as c:  # the first connection's buffers went with it
        for _ in range(100):  # its session ends just after the close (bounded wait, not a timing check)
            if alloc(c, 48 << 20)[0] != 0:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the buffers of a closed connection were not freed")


def test_idle_and_stalled_connections_do_not_block_other_clients(guarded):
    silent = socket.create_connection(("127.0.0.1", guarded.port), timeout=30)  # no HELLO
    idle = rw.RawClient(guarded.endpoint)  # greeted, then nothing
    idle.alloc(4096)
    stalled = rw.RawClient(guarded.endpoint)  # a message begun and never finished
    stalled.sock.sendall(bytes([wire.CMD_SET_TENSOR]) + struct.pack("<Q", 4096) + bytes(100))
    try:
        _alive_and_serving(guarded)
    finally:
        for s in (silent, idle.sock, stalled.sock):
            s.close()


def test_header_sizes_are_bounded_before_allocating(guarded):
    if not Path(f"/proc/{guarded.proc.pid}/status").exists():
        pytest.skip("needs /proc to read the server's memory")
    before = _rss(guarded.proc.pid)
    clients = []
    try:
        for cmd in (wire.CMD_SET_TENSOR, wire.CMD_GRAPH_COMPUTE, wire.CMD_GET_ALLOC_SIZE, wire.CMD_SET_TENSOR):
            c = rw.RawClient(guarded.endpoint)
            c.sock.sendall(bytes([cmd]) + struct.pack("<Q", 1 << 30))  # 9 bytes announcing 1 GiB
            clients.append(c)
        rw.round_trip(guarded.endpoint)
        assert _rss(guarded.proc.pid) - before < 64 << 20
    finally:
        for c in clients:
            c.sock.close()
    _alive_and_serving(guarded)


# ---- a hostile server: answers that made ggml's client abort -------------------------------------------------
CLIENT_SCRIPT = """
import sys
from pyggml import BackendParams
from pyggml.backend import Backend
from pyggml.rpc import RPCError
try:
    backend = Backend(BackendParams(n_threads=1, rpc=[sys.argv[1]], tensor_split=[1, 1]))
    backend.config = type(backend.config)({"general.architecture": "t", "t.block_count": 2})
    backend.alloc_persistent("q8_0", (32, 8), layer=1)  # its size is asked of the server (GET_ALLOC_SIZE)
    with backend.new_context() as ctx:
        x = ctx.from_numpy(__import__("numpy").ones(8, "float32"))
        ctx.compute(x * 2.0)
    print("NO ERROR")
except RPCError as exc:
    print("RPCError:", exc)
"""


@pytest.mark.parametrize("cmd, answer, message", [
    (wire.CMD_DEVICE_COUNT, struct.pack("<I", 16), "16 devices"),
    (wire.CMD_DEVICE_COUNT, struct.pack("<I", 2**32 - 1), "devices"),
    (wire.CMD_ALLOC_BUFFER, None, "buffer of"),  # half the size asked for
    (wire.CMD_BUFFER_GET_BASE, struct.pack("<Q", 0), "buffer base of 0x0"),
    (wire.CMD_BUFFER_GET_BASE, struct.pack("<Q", 2**64 - 8), "buffer base of 0xfffffffffffffff8"),
    (wire.CMD_GET_ALIGNMENT, struct.pack("<Q", 0), "alignment of 0"),
    (wire.CMD_GET_ALIGNMENT, struct.pack("<Q", 48), "alignment of 48"),
    (wire.CMD_GET_MAX_SIZE, struct.pack("<Q", 0), "maximum buffer size of 0"),
    (wire.CMD_GET_ALLOC_SIZE, struct.pack("<Q", 2**64 - 1), "allocation size of 18446744073709551615"),
])
def test_a_hostile_server_answer_is_a_clean_error(cmd, answer, message):
    if answer is None:
        def reply(request):
            return struct.pack("<QQ", 0x1000, struct.unpack_from("<Q", request, 4)[0] // 2)
    else:
        def reply(request):
            return answer
    fake = rw.FakeServer({cmd: reply})
    try:
        proc = subprocess.run([sys.executable, "-c", CLIENT_SCRIPT, fake.endpoint], capture_output=True, text=True,
                              timeout=120, env=dict(os.environ, GGML_NO_BACKTRACE="1"))
    finally:
        fake.close()
    assert proc.returncode == 0, f"the client died ({proc.returncode}): {proc.stderr[-2000:]}"
    assert proc.stdout.startswith("RPCError:") and message in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_a_graph_as_deep_as_the_limit_computes_and_one_deeper_is_refused(guarded):
    from pyggml.rpc_server import Limits

    depth = Limits(max_memory=0).max_graph_depth  # what ggml's recursion must survive in the worker
    with rw.RawClient(guarded.endpoint, timeout=120) as c:
        ptr, _, base = c.alloc(4096)
        c.send(wire.CMD_GRAPH_COMPUTE, _chain(depth, ptr, base))
        assert c.call(wire.CMD_GET_ALIGNMENT, bytes(4), 8)  # the worker lived through it
        c.send(wire.CMD_GRAPH_COMPUTE, _chain(depth + 1, ptr, base))
        assert c.closed_by_server()
    _alive_and_serving(guarded)


def test_rpc_server_limits_are_checked():
    from pyggml.cli import _memory_size

    assert _memory_size("8G") == 8 << 30 and _memory_size("512MiB") == 512 << 20 and _memory_size("1000") == 1000
    for bad in (["--max-memory", "lots"], ["--max-memory", "0"], ["--max-clients", "0"], ["--idle-timeout", "-1"]):
        proc = cli("rpc-server", "--port", str(free_port()), *bad)
        try:
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.communicate(timeout=30)
        assert proc.returncode != 0 and bad[0] in err, err


def _fnv(data: bytes) -> int:
    h = 0xcbf29ce484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001b3) % 2**64
    return h


def test_the_tensor_cache_is_used_and_its_files_are_checked_against_the_tensor(tmp_path):
    server = Server("--cache", str(tmp_path))
    data = bytes(range(256))
    try:
        with rw.RawClient(server.endpoint) as c:
            ptr, _, base = c.alloc(1024)
            small, whole = rw.tensor(1, buffer=ptr, data=base, ne=(16,)), rw.tensor(2, buffer=ptr, data=base, ne=(64,))
            hash_of = struct.pack("<QQ", 0, _fnv(data))
            assert c.call(wire.CMD_SET_TENSOR_HASH, whole + hash_of, 1) == b"\x00"  # not cached yet
            c.sock.sendall(rw.message(wire.CMD_SET_TENSOR, whole + b"\x01" + struct.pack("<Q", 0) + data))
            assert c.get(whole, 256) == data and (tmp_path / f"{_fnv(data):016x}").stat().st_size == 256
            c.send(wire.CMD_BUFFER_CLEAR, struct.pack("<QB", ptr, 0))
            assert c.get(whole, 256) == bytes(256)
            assert c.call(wire.CMD_SET_TENSOR_HASH, whole + hash_of, 1) == b"\x01"  # from the cache
            assert c.get(whole, 256) == data
            c.send(wire.CMD_SET_TENSOR_HASH, small + hash_of)  # 256 cached bytes into a 64-byte tensor
            assert c.closed_by_server()
        _alive_and_serving(server)
    finally:
        server.stop()


def test_more_devices_than_the_scheduler_takes_is_a_clean_error():
    script = ("import sys\nfrom pyggml import BackendParams\nfrom pyggml.backend import Backend\n"
              "try:\n    Backend(BackendParams(n_threads=1, rpc=sys.argv[1:]))\n    print('NO ERROR')\n"
              "except ValueError as exc:\n    print('ValueError:', exc)\n")
    fakes = [rw.FakeServer({wire.CMD_DEVICE_COUNT: lambda request: struct.pack("<I", 8)}) for _ in range(2)]
    try:
        proc = subprocess.run([sys.executable, "-c", script, *(f.endpoint for f in fakes)], capture_output=True,
                              text=True, timeout=120, env=dict(os.environ, GGML_NO_BACKTRACE="1"))
    finally:
        for f in fakes:
            f.close()
    assert proc.returncode == 0, f"the client died ({proc.returncode}): {proc.stderr[-2000:]}"
    assert proc.stdout.startswith("ValueError: 17 devices"), proc.stdout + proc.stderr[-2000:]


def test_idle_timeout_closes_a_silent_client_and_frees_its_memory():
    server = Server("--idle-timeout", "1", "--max-memory", "16M")
    try:
        with rw.RawClient(server.endpoint, timeout=60) as idle:
            idle.alloc(12 << 20)
            assert idle.closed_by_server()  # after --idle-timeout (the 60 s here only bounds the wait)
        with rw.RawClient(server.endpoint) as c:
            c.alloc(12 << 20)  # the idle client's buffer went with it
        _alive_and_serving(server)
    finally:
        server.stop()
