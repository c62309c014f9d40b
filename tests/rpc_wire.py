"""Hand-made ggml RPC messages (protocol 7) for the tests: a raw client that can say anything, well-formed
or hostile, and a scripted fake server. Wire format: ``cmd (u8) | size (u64) | payload``; answers
``size (u64) | payload``; a tensor is the packed ``rpc_tensor`` of ``pyggml.rpc.TENSOR``."""

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

from pyggml._ggml import lib

from pyggml import rpc
from pyggml.rpc import RPCError, hello

ROOT = Path(__file__).resolve().parents[1]
VERSION = (lib.RPC_PROTO_MAJOR_VERSION, lib.RPC_PROTO_MINOR_VERSION, lib.RPC_PROTO_PATCH_VERSION)
F32 = 0
OP_ADD, OP_MUL_MAT, OP_COUNT = 2, 29, 101  # ggml.h's enum ggml_op (pinned by protocol 7.0.0)


FLAG_COMPUTE = 16  # ggml computes only the nodes marked so


def tensor(id: int = 1, *, buffer: int = 0, data: int = 0, ne=(1, 1, 1, 1), nb=None, type: int = F32,
           op: int = 0, src=(), view_src: int = 0) -> bytes:
    """A packed rpc_tensor; ``nb`` defaults to a contiguous f32 layout; an op marks it to be computed."""
    ne = tuple(ne) + (1,) * (4 - len(ne))
    if nb is None:
        nb = [4]
        for n in ne[:3]:
            nb.append(min(nb[-1] * n, 2**32 - 1))
    srcs = tuple(src) + (0,) * (10 - len(src))
    flags = FLAG_COMPUTE if op else 0
    return rpc.TENSOR.pack(id, type, buffer, *ne, *nb, op, *([0] * 16), flags, *srcs, view_src, 0, data, b"t%d" % id, 0)


def message(cmd: int, payload: bytes) -> bytes:
    return bytes([cmd]) + struct.pack("<Q", len(payload)) + payload


def graph(nodes, tensors, device: int = 0) -> bytes:
    return (struct.pack("<II", device, len(nodes)) + struct.pack(f"<{len(nodes)}Q", *nodes)
            + struct.pack("<I", len(tensors)) + b"".join(tensors))


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(min(n - len(data), 1 << 20))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return bytes(data)


class RawClient:
    """One connection to an RPC server, greeted (HELLO) unless ``hello=False``."""

    def __init__(self, endpoint: str, timeout: float = 30.0, hello: bool = True):
        host, port = endpoint.split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        if hello:
            assert self.call(rpc.CMD_HELLO, bytes(rpc.CONN_CAPS_SIZE), 4 + rpc.CONN_CAPS_SIZE)[:3] == bytes(VERSION)

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()

    def send(self, cmd: int, payload: bytes) -> None:
        self.sock.sendall(message(cmd, payload))

    def call(self, cmd: int, payload: bytes, size: int) -> bytes:
        self.send(cmd, payload)
        assert struct.unpack("<Q", recv_exact(self.sock, 8))[0] == size
        return recv_exact(self.sock, size)

    def alloc(self, size: int, device: int = 0) -> tuple[int, int, int]:
        """(remote pointer, size, base) of a new buffer."""
        ptr, got = struct.unpack("<QQ", self.call(rpc.CMD_ALLOC_BUFFER, struct.pack("<IQ", device, size), 16))
        assert ptr != 0 and got >= size
        (base,) = struct.unpack("<Q", self.call(rpc.CMD_BUFFER_GET_BASE, struct.pack("<Q", ptr), 8))
        return ptr, got, base

    def set(self, t: bytes, data: bytes, offset: int = 0) -> None:
        self.send(rpc.CMD_SET_TENSOR, t + b"\x00" + struct.pack("<Q", offset) + data)

    def get(self, t: bytes, size: int, offset: int = 0) -> bytes:
        return self.call(rpc.CMD_GET_TENSOR, t + struct.pack("<QQ", offset, size), size)

    def closed_by_server(self) -> bool:
        """Whether the server closed this connection (waits up to the socket's timeout for it)."""
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False


def round_trip(endpoint: str) -> None:
    """What a real client does, checked: allocate, write two vectors, add them on the server, read back."""
    import numpy as np

    a, b = np.arange(64, dtype=np.float32), np.full(64, 0.5, np.float32)
    with RawClient(endpoint) as c:
        assert struct.unpack("<I", c.call(rpc.CMD_DEVICE_COUNT, b"", 4))[0] >= 1
        ptr, _, base = c.alloc(3 * 256)
        ta, tb = (tensor(i + 1, buffer=ptr, data=base + 256 * i, ne=(64,)) for i in range(2))
        tc = tensor(3, buffer=ptr, data=base + 512, ne=(64,), op=OP_ADD, src=(1, 2))
        c.set(ta, a.tobytes())
        c.set(tb, b.tobytes())
        c.send(rpc.CMD_GRAPH_COMPUTE, graph([3], [ta, tb, tc]))
        got = np.frombuffer(c.get(tc, 256), np.float32)
        np.testing.assert_array_equal(got, a + b)
        c.send(rpc.CMD_FREE_BUFFER, struct.pack("<Q", ptr))


_DEFAULT_ANSWERS = {  # what a plain one-CPU server answers, by command
    rpc.CMD_DEVICE_COUNT: struct.pack("<I", 1), rpc.CMD_GET_ALIGNMENT: struct.pack("<Q", 32),
    rpc.CMD_GET_MAX_SIZE: struct.pack("<Q", 1 << 40), rpc.CMD_GET_DEVICE_MEMORY: struct.pack("<QQ", 1 << 30, 1 << 30),
    rpc.CMD_BUFFER_GET_BASE: struct.pack("<Q", 1 << 32), rpc.CMD_SET_TENSOR_HASH: b"\x00",
    rpc.CMD_COPY_TENSOR: b"\x01",
}


class FakeServer:
    """A server that speaks the protocol well except where ``answers`` (command -> function(request) ->
    answer bytes) says otherwise; serves connections one after another until closed."""

    def __init__(self, answers: dict):
        self.answers = answers
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4)
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._session, args=(conn,), daemon=True).start()

    def _session(self, conn: socket.socket) -> None:
        with conn:
            try:
                while True:
                    head = recv_exact(conn, 9)
                    cmd, size = head[0], struct.unpack_from("<Q", head, 1)[0]
                    request = recv_exact(conn, size)
                    answer = self._answer(cmd, request)
                    if answer is not None:
                        conn.sendall(struct.pack("<Q", len(answer)) + answer)
            except (ConnectionError, OSError):
                return

    def _answer(self, cmd: int, request: bytes) -> bytes | None:
        if cmd in self.answers:
            return self.answers[cmd](request)
        return normal_answer(cmd, request)

    def close(self) -> None:
        self.listener.close()


def normal_answer(cmd: int, request: bytes) -> bytes | None:
    """What a plain one-CPU server answers (None: the command has no answer)."""
    if cmd == rpc.CMD_HELLO:
        return bytes(VERSION) + bytes(1 + rpc.CONN_CAPS_SIZE)
    if cmd == rpc.CMD_ALLOC_BUFFER:
        return struct.pack("<QQ", 0x1000, struct.unpack_from("<Q", request, 4)[0])
    if cmd == rpc.CMD_GET_ALLOC_SIZE:
        return struct.pack("<Q", rpc.nbytes(rpc.parse_tensor(request, 4)))
    if cmd == rpc.CMD_GET_TENSOR:
        return bytes(struct.unpack_from("<Q", request, rpc.RPC_TENSOR_SIZE + 8)[0])
    return _DEFAULT_ANSWERS.get(cmd)


# ---- a live `pyggml rpc-server` -----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child: be killed if the test process dies first (Linux), so no server outlives a crash."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def cli(*args: str, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               GGML_NO_BACKTRACE="1")
    preexec = _die_with_parent if sys.platform.startswith("linux") else None
    return subprocess.Popen([sys.executable, "-m", "pyggml.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=preexec, **kwargs)


class Server:
    """A `pyggml rpc-server` subprocess on a free loopback port."""

    def __init__(self, *options: str):
        for _ in range(3):  # another process may take the free port first
            self.port = free_port()
            self.endpoint = f"127.0.0.1:{self.port}"
            self.proc = cli("rpc-server", "--port", str(self.port), "--threads", "1", *options)
            for _ in range(300):  # up to ~60 s on a loaded machine
                if self.proc.poll() is not None:
                    break
                try:
                    hello(self.endpoint, VERSION, timeout=2.0)
                    return
                except RPCError:
                    time.sleep(0.2)
            self.stop()
        raise RuntimeError("could not start a pyggml rpc-server")

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, str]:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
        try:
            _, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            _, err = self.proc.communicate(timeout=30)
        return self.proc.returncode, err
