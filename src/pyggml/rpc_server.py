"""`pyggml rpc-server`: ggml's RPC server behind a guard that checks every message first.

ggml's server (``ggml-rpc.cpp``) trusts its client: a tensor whose data lies outside its buffer, a shape
whose byte size overflows, a graph node with an unknown op, a node list naming tensor 0, or a source chain
deeper than the thread's stack aborts or crashes the whole process; it serves one connection at a time, so
one idle client blocks all others; and it allocates whatever size a message header announces. So the port
users connect to is this guard's, not ggml's:

* every client gets its own ggml server in a *worker* process, started on a private loopback port (a spare
  one waits ready). Clients never wait for each other, and a crash that no check foresaw (a kernel's shape
  assertion) ends only the session that caused it; the guard and every other client carry on.
* every command is parsed and bounded here before the worker sees it: exact sizes, device numbers, buffers
  owned by this session, each tensor's type, shape and byte range inside its buffer, graphs (ids, sources,
  ops, depth). A command that cannot be shown safe closes the connection; it is never forwarded.
* header sizes are bounded before anything is read or allocated, buffers of all clients together stay within
  ``max_memory`` (a larger request is answered as a failed allocation), and a started message must keep
  arriving (``message_timeout``), as must the first (HELLO, ``handshake_timeout``).

The wire format is that of the pinned ggml (protocol 7.0.0; ``ggml/src/ggml-rpc/ggml-rpc.cpp``): every
message is ``cmd (1 byte) | size (u64) | payload``; answers are ``size (u64) | payload``.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pyggml import rpc
from pyggml.rpc import (
    CMD_ALLOC_BUFFER,
    CMD_BUFFER_CLEAR,
    CMD_BUFFER_GET_BASE,
    CMD_COPY_TENSOR,
    CMD_DEVICE_COUNT,
    CMD_FREE_BUFFER,
    CMD_GET_ALIGNMENT,
    CMD_GET_ALLOC_SIZE,
    CMD_GET_DEVICE_MEMORY,
    CMD_GET_MAX_SIZE,
    CMD_GET_TENSOR,
    CMD_GRAPH_COMPUTE,
    CMD_GRAPH_RECOMPUTE,
    CMD_HELLO,
    CMD_INIT_TENSOR,
    CMD_MEMSET_TENSOR,
    CMD_SET_TENSOR,
    CMD_SET_TENSOR_HASH,
    COMMAND_NAMES,
    CONN_CAPS_SIZE,
    RPC_TENSOR_SIZE,
    Tensor,
    nbytes,
    parse_tensor,
    type_table,
)

log = logging.getLogger("pyggml.rpc_server")

GGML_OP_COUNT = 101  # ggml-rpc.h pins it for protocol 7.0.0 (a static_assert there)
MAX_SRC = 10
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_CHUNK = 1 << 20
_MAX_BYTES = 1 << 62  # no tensor or region may come near where ggml's size_t arithmetic wraps

# the payload size of each fixed-size command
_FIXED = {
    CMD_ALLOC_BUFFER: 12, CMD_GET_ALIGNMENT: 4, CMD_GET_MAX_SIZE: 4, CMD_BUFFER_GET_BASE: 8, CMD_FREE_BUFFER: 8,
    CMD_BUFFER_CLEAR: 9, CMD_SET_TENSOR_HASH: RPC_TENSOR_SIZE + 16, CMD_GET_TENSOR: RPC_TENSOR_SIZE + 16,
    CMD_COPY_TENSOR: 2 * RPC_TENSOR_SIZE, CMD_GET_DEVICE_MEMORY: 4, CMD_INIT_TENSOR: RPC_TENSOR_SIZE,
    CMD_GET_ALLOC_SIZE: 4 + RPC_TENSOR_SIZE * (1 + MAX_SRC), CMD_HELLO: CONN_CAPS_SIZE, CMD_DEVICE_COUNT: 0,
    CMD_GRAPH_RECOMPUTE: 4, CMD_MEMSET_TENSOR: RPC_TENSOR_SIZE + 17,
}
_SET_TENSOR_HEAD = RPC_TENSOR_SIZE + 9  # rpc_tensor | cache flag (u8) | offset (u64) | data
_GRAPH_KEPT_BYTES, _TENSORS_KEPT = 4 << 20, 1 << 15  # per session: what is remembered as already checked


class Refused(Exception):
    """A message the guard cannot show safe: the connection closes, nothing reaches ggml."""


@dataclass(frozen=True)
class Limits:
    max_memory: int  # bytes of device buffers all clients together may hold
    max_clients: int = 8  # sessions (and worker processes) at once
    handshake_timeout: float = 10.0  # for a new connection's HELLO
    message_timeout: float = 60.0  # between the pieces of one started message
    idle_timeout: float | None = None  # between commands (None: a loaded model may idle for hours)
    reply_timeout: float = 600.0  # for a worker's answer (a long graph computes meanwhile)
    max_graph_bytes: int = 64 << 20  # about 220,000 tensors; a large model's decode graph has a few thousand
    max_graph_depth: int = 20_000  # ggml builds a graph recursively; the worker's thread has a large stack


@dataclass
class Buffer:
    device: int
    base: int
    size: int


# ---- one client ----------------------------------------------------------------------------------
class Session:
    """One client connection, its worker, and the buffers it allocated there."""

    def __init__(self, guard: Guard, client: socket.socket, peer: str):
        self.guard = guard
        self.client = client
        self.peer = peer
        self.worker: Worker | None = None
        self.buffers: dict[int, Buffer] = {}
        self.graph_ready: set[int] = set()  # devices whose last graph the worker keeps (GRAPH_RECOMPUTE)
        # what passed the checks while the buffers stay the same (a new graph mostly repeats the last ones)
        self.checked_tensors: dict[bytes, Tensor] = {}
        self.checked_graphs: dict[bytes, None] = {}  # the last few whole GRAPH_COMPUTE payloads

    def buffers_changed(self) -> None:
        self.graph_ready.clear()  # ggml drops every kept graph when a buffer goes
        self.checked_tensors.clear()
        self.checked_graphs.clear()

    # -- client I/O
    def _recv(self, n: int, timeout: float | None) -> bytes:
        self.client.settimeout(timeout)
        return rpc._recv_exact(self.client, n)

    def _answer(self, payload: bytes) -> None:
        self.client.sendall(_U64.pack(len(payload)) + payload)

    # -- the loop
    def run(self) -> None:
        reason = "closed by the client"
        try:
            self._hello()
            while self._command():
                pass
        except Refused as exc:
            reason = f"refused: {exc}"
            log.warning("rpc-server: %s: %s; closing the connection", self.peer, exc)
        except TimeoutError:
            reason = "timed out"
            log.warning("rpc-server: %s: no data within the timeout; closing the connection", self.peer)
        except (ConnectionError, OSError) as exc:
            reason = f"connection ended ({exc})"
        except Exception:  # a bug in the guard: lose this session, never the server
            reason = "internal error"
            log.exception("rpc-server: %s: internal error", self.peer)
        finally:
            self.close()
            (log.info if reason == "closed by the client" else log.warning)(
                "rpc-server: %s: session ended (%s)", self.peer, reason)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.stop()  # first, so nobody else can reach the worker's port after us
            self.worker = None
        self.guard.release(sum(b.size for b in self.buffers.values()))
        self.buffers.clear()
        try:
            self.client.close()
        except OSError:
            pass

    def _hello(self) -> None:
        header = self._recv(9, self.guard.limits.handshake_timeout)
        if header[0] != CMD_HELLO or _U64.unpack_from(header, 1)[0] != CONN_CAPS_SIZE:
            raise Refused("the first message must be HELLO with 24 bytes of capabilities")
        self._recv(CONN_CAPS_SIZE, self.guard.limits.handshake_timeout)
        # plain TCP only: no transport upgrade is offered, whatever the client asks for
        self._answer(bytes(self.guard.version) + bytes(1 + CONN_CAPS_SIZE))

    def _command(self) -> bool:
        limits = self.guard.limits
        try:
            first = self._recv(1, limits.idle_timeout)
        except ConnectionResetError:
            return False
        cmd = first[0]
        (size,) = _U64.unpack(self._recv(8, limits.message_timeout))
        if cmd == CMD_HELLO:
            raise Refused("a second HELLO")
        handler = _HANDLERS.get(cmd)
        if handler is None:
            raise Refused(f"unknown command {cmd}")
        fixed = _FIXED.get(cmd)
        if fixed is not None and size != fixed:
            raise Refused(f"{COMMAND_NAMES[cmd]} with {size} bytes (it has {fixed})")
        if cmd == CMD_GRAPH_COMPUTE and not 12 <= size <= limits.max_graph_bytes:
            raise Refused(f"GRAPH_COMPUTE of {size} bytes (1 node takes 12, the limit is {limits.max_graph_bytes})")
        if cmd == CMD_SET_TENSOR:  # its data is streamed once the head is checked
            if size < _SET_TENSOR_HEAD:
                raise Refused(f"SET_TENSOR of {size} bytes (its head alone takes {_SET_TENSOR_HEAD})")
            handler(self, self._recv(_SET_TENSOR_HEAD, limits.message_timeout), size)
            return True
        handler(self, self._recv(size, limits.message_timeout) if size else b"")
        return True

    # -- the worker
    def up(self) -> Worker:
        if self.worker is None:
            self.worker = self.guard.take_worker()
        return self.worker

    def forward(self, cmd: int, payload: bytes, answer: int | None = None) -> bytes | None:
        """Send a checked command to the worker; return its answer of ``answer`` bytes (None: no answer)."""
        worker = self.up()
        worker.send(bytes([cmd]) + _U64.pack(len(payload)) + payload)
        return None if answer is None else worker.answer(answer)

    # -- checks
    def device(self, payload: bytes, at: int = 0) -> int:
        (dev,) = _U32.unpack_from(payload, at)
        if dev >= self.up().n_devices:
            raise Refused(f"device {dev} (this server has {self.up().n_devices})")
        return dev

    def owned(self, ptr: int) -> Buffer:
        buf = self.buffers.get(ptr)
        if buf is None:
            raise Refused(f"buffer {ptr:#x} is not one this connection allocated")
        return buf

    def tensor(self, t: Tensor, need_buffer: bool) -> int:
        """Check one tensor as ggml's server will use it; returns its byte size."""
        types = type_table()
        if t.type not in types:
            raise Refused(f"tensor type {t.type}")
        blck = types[t.type][0]
        if t.ne[0] % blck:
            raise Refused(f"tensor ne[0]={t.ne[0]} is not a multiple of the type's block of {blck}")
        elements = t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3]
        size = nbytes(t)
        if elements >= _MAX_BYTES or size >= _MAX_BYTES:
            raise Refused(f"tensor of shape {list(t.ne)} and strides {list(t.nb)} is too large")
        if t.op >= GGML_OP_COUNT:
            raise Refused(f"tensor op {t.op} (ggml has {GGML_OP_COUNT})")
        if t.buffer == 0:
            if need_buffer or t.data != 0:
                raise Refused("a tensor without a buffer" + (" has a data pointer" if t.data else ""))
            return size
        buf = self.owned(t.buffer)
        if not buf.base <= t.data or t.data + size > buf.base + buf.size:
            raise Refused(f"tensor data {t.data:#x}+{size} lies outside its buffer "
                          f"[{buf.base:#x}, {buf.base + buf.size:#x})")
        return size

    def region(self, t: Tensor, offset: int, size: int, starts_inside: bool = True) -> None:
        """``size`` bytes at ``offset`` into tensor ``t`` (checked by :meth:`tensor`) are inside it; with
        ``starts_inside`` the first byte must also lie inside the buffer, as ggml checks for reads and writes."""
        if offset + size > nbytes(t):
            raise Refused(f"{size} bytes at offset {offset} of a tensor of {nbytes(t)} bytes")
        buf = self.buffers[t.buffer]
        if starts_inside and t.data + offset >= buf.base + buf.size:
            raise Refused(f"offset {offset} of tensor data {t.data:#x} is past the end of its buffer")


# ---- command handlers: each checks its message completely, then forwards it ----------------------
def _alloc_buffer(s: Session, payload: bytes) -> None:
    dev = s.device(payload)
    (size,) = _U64.unpack_from(payload, 4)
    if size == 0 or not s.guard.reserve(size):
        log.warning("rpc-server: %s: allocation of %d bytes refused (%d of %d in use, --max-memory)",
                    s.peer, size, s.guard.allocated, s.guard.limits.max_memory)
        s._answer(bytes(16))  # a failed allocation: the client reports it
        return
    try:
        ptr, got = struct.unpack("<QQ", s.forward(CMD_ALLOC_BUFFER, payload, 16))
    except BaseException:
        s.guard.release(size)
        raise
    if ptr == 0:
        s.guard.release(size)
        s._answer(bytes(16))
        return
    buf = s.buffers[ptr] = Buffer(dev, 0, size)  # from here on released with the session
    (buf.base,) = _U64.unpack(s.forward(CMD_BUFFER_GET_BASE, _U64.pack(ptr), 8))
    if got < size or buf.base == 0 or buf.base + got >= 1 << 64:
        raise ConnectionError(f"the worker answered an allocation of {size} with {got} bytes at {buf.base:#x}")
    s.guard.reserve(got - size, force=True)
    buf.size = got
    s._answer(struct.pack("<QQ", ptr, got))


def _device_query(cmd: int, answer: int):
    def handle(s: Session, payload: bytes) -> None:
        s.device(payload)
        s._answer(s.forward(cmd, payload, answer))
    return handle


def _device_count(s: Session, payload: bytes) -> None:
    s._answer(_U32.pack(s.up().n_devices))


def _buffer_get_base(s: Session, payload: bytes) -> None:
    s._answer(_U64.pack(s.owned(_U64.unpack(payload)[0]).base))


def _free_buffer(s: Session, payload: bytes) -> None:
    (ptr,) = _U64.unpack(payload)
    buf = s.owned(ptr)
    s.forward(CMD_FREE_BUFFER, payload)
    del s.buffers[ptr]
    s.guard.release(buf.size)
    s.buffers_changed()


def _buffer_clear(s: Session, payload: bytes) -> None:
    s.owned(_U64.unpack_from(payload)[0])
    s.forward(CMD_BUFFER_CLEAR, payload)


def _set_tensor(s: Session, head: bytes, size: int) -> None:
    t = parse_tensor(head)
    s.tensor(t, need_buffer=True)
    (offset,) = _U64.unpack_from(head, RPC_TENSOR_SIZE + 1)
    data = size - _SET_TENSOR_HEAD
    s.region(t, offset, data)
    worker = s.up()
    worker.send(bytes([CMD_SET_TENSOR]) + _U64.pack(size) + head)
    left = data
    while left:  # the size is known good: stream, never hold a whole tensor here
        chunk = s._recv(min(left, _CHUNK), s.guard.limits.message_timeout)
        worker.send(chunk)
        left -= len(chunk)


def _set_tensor_hash(s: Session, payload: bytes) -> None:
    t = parse_tensor(payload)
    s.tensor(t, need_buffer=True)
    offset, digest = struct.unpack_from("<QQ", payload, RPC_TENSOR_SIZE)
    cached = s.guard.cached_size(digest)
    if cached is None:
        s._answer(b"\x00")  # not cached: the client sends the data (checked as SET_TENSOR)
        return
    s.region(t, offset, cached)
    answer = s.forward(CMD_SET_TENSOR_HASH, payload, 1)
    s._answer(answer)


def _get_tensor(s: Session, payload: bytes) -> None:
    t = parse_tensor(payload)
    s.tensor(t, need_buffer=True)
    offset, size = struct.unpack_from("<QQ", payload, RPC_TENSOR_SIZE)
    s.region(t, offset, size)
    worker = s.up()
    worker.send(bytes([CMD_GET_TENSOR]) + _U64.pack(len(payload)) + payload)
    head = worker.recv(8)
    if _U64.unpack(head)[0] != size:
        raise ConnectionError(f"the worker answered GET_TENSOR with {_U64.unpack(head)[0]} bytes, not {size}")
    s.client.sendall(head)
    left = size
    while left:
        chunk = worker.recv(min(left, _CHUNK))
        s.client.sendall(chunk)
        left -= len(chunk)


def _copy_tensor(s: Session, payload: bytes) -> None:
    src, dst = parse_tensor(payload), parse_tensor(payload, RPC_TENSOR_SIZE)
    size = s.tensor(src, need_buffer=True)
    s.tensor(dst, need_buffer=True)
    buf = s.buffers[dst.buffer]
    if dst.data + size > buf.base + buf.size:  # ggml copies the source's bytes into the destination
        raise Refused(f"COPY_TENSOR of {size} bytes overruns the destination buffer")
    s._answer(s.forward(CMD_COPY_TENSOR, payload, 1))


def _init_tensor(s: Session, payload: bytes) -> None:
    s.tensor(parse_tensor(payload), need_buffer=False)
    s.forward(CMD_INIT_TENSOR, payload)


def _get_alloc_size(s: Session, payload: bytes) -> None:
    s.device(payload)
    s.tensor(parse_tensor(payload, 4), need_buffer=False)
    for i in range(MAX_SRC):
        src = parse_tensor(payload, 4 + RPC_TENSOR_SIZE * (1 + i))
        if src.id != 0:
            s.tensor(src, need_buffer=False)
    s._answer(s.forward(CMD_GET_ALLOC_SIZE, payload, 8))


def _memset_tensor(s: Session, payload: bytes) -> None:
    t = parse_tensor(payload)
    s.tensor(t, need_buffer=True)
    offset, size = struct.unpack_from("<QQ", payload, RPC_TENSOR_SIZE)
    s.region(t, offset, size, starts_inside=False)
    s.forward(CMD_MEMSET_TENSOR, payload)


def _graph_compute(s: Session, payload: bytes) -> None:
    # device (u32) | n_nodes (u32) | node ids (u64 each) | n_tensors (u32) | rpc_tensor each
    dev = s.device(payload)
    if payload not in s.checked_graphs:
        _check_graph(s, payload)
        if len(payload) <= _GRAPH_KEPT_BYTES:  # kept whole: the comparison is exact
            if len(s.checked_graphs) >= 4:
                del s.checked_graphs[next(iter(s.checked_graphs))]
            s.checked_graphs[payload] = None
    s.forward(CMD_GRAPH_COMPUTE, payload)
    s.graph_ready.add(dev)


def _check_graph(s: Session, payload: bytes) -> None:
    (n_nodes,) = _U32.unpack_from(payload, 4)
    at = 8 + 8 * n_nodes
    if n_nodes == 0 or at + 4 > len(payload):
        raise Refused(f"GRAPH_COMPUTE with {n_nodes} nodes in {len(payload)} bytes")
    (n_tensors,) = _U32.unpack_from(payload, at)
    if n_nodes > n_tensors or at + 4 + n_tensors * RPC_TENSOR_SIZE != len(payload):
        raise Refused(f"GRAPH_COMPUTE of {len(payload)} bytes does not hold {n_nodes} nodes and {n_tensors} tensors")
    if len(s.checked_tensors) > _TENSORS_KEPT:
        s.checked_tensors.clear()
    tensors: dict[int, Tensor] = {}
    for start in range(at + 4, len(payload), RPC_TENSOR_SIZE):
        record = payload[start:start + RPC_TENSOR_SIZE]
        t = s.checked_tensors.get(record)
        if t is None:
            t = parse_tensor(record)
            s.tensor(t, need_buffer=True)
            s.checked_tensors[record] = t
        if t.id == 0 or t.id in tensors:
            raise Refused(f"graph tensor id {t.id:#x} is 0 or repeated")
        tensors[t.id] = t
    nodes = struct.unpack_from(f"<{n_nodes}Q", payload, 8)
    if len(set(nodes)) != n_nodes or not all(n in tensors for n in nodes):
        raise Refused("graph nodes must be distinct tensors of the message (no 0, no unknown id)")
    _check_graph_depth(tensors, nodes, s.guard.limits.max_graph_depth)


def _check_graph_depth(tensors: dict[int, Tensor], nodes: tuple[int, ...], limit: int) -> None:
    """Walk the sources as ggml's server will (depth first, from each node in order): every source exists,
    there is no cycle, and the walk never goes deeper than ``limit`` (ggml recurses once per step)."""
    done: set[int] = set()

    def sources(tid: int):
        t = tensors[tid]
        return iter([i for i in (*t.src, t.view_src) if i != 0 and i not in done])

    for root in nodes:
        if root in done:
            continue
        path, stack = {root}, [(root, sources(root))]
        while stack:
            tid, pending = stack[-1]
            for i in pending:
                if i in done:
                    continue
                if i not in tensors:
                    raise Refused(f"graph tensor {tid:#x} names an unknown source {i:#x}")
                if i in path:
                    raise Refused("the graph has a cycle")
                if len(stack) >= limit:
                    raise Refused(f"a graph chain deeper than {limit} tensors")
                path.add(i)
                stack.append((i, sources(i)))
                break
            else:
                stack.pop()
                path.discard(tid)
                done.add(tid)


def _graph_recompute(s: Session, payload: bytes) -> None:
    dev = s.device(payload)
    if dev not in s.graph_ready:
        raise Refused("GRAPH_RECOMPUTE without a graph computed since the last FREE_BUFFER")
    s.forward(CMD_GRAPH_RECOMPUTE, payload)


_HANDLERS = {
    CMD_ALLOC_BUFFER: _alloc_buffer, CMD_GET_ALIGNMENT: _device_query(CMD_GET_ALIGNMENT, 8),
    CMD_GET_MAX_SIZE: _device_query(CMD_GET_MAX_SIZE, 8), CMD_BUFFER_GET_BASE: _buffer_get_base,
    CMD_FREE_BUFFER: _free_buffer, CMD_BUFFER_CLEAR: _buffer_clear, CMD_SET_TENSOR: _set_tensor,
    CMD_SET_TENSOR_HASH: _set_tensor_hash, CMD_GET_TENSOR: _get_tensor, CMD_COPY_TENSOR: _copy_tensor,
    CMD_GRAPH_COMPUTE: _graph_compute, CMD_GET_DEVICE_MEMORY: _device_query(CMD_GET_DEVICE_MEMORY, 16),
    CMD_INIT_TENSOR: _init_tensor, CMD_GET_ALLOC_SIZE: _get_alloc_size, CMD_DEVICE_COUNT: _device_count,
    CMD_GRAPH_RECOMPUTE: _graph_recompute, CMD_MEMSET_TENSOR: _memset_tensor,
}


# ---- workers -------------------------------------------------------------------------------------
class Worker:
    """ggml's RPC server in a child process on a private loopback port, connected and greeted."""

    def __init__(self, threads: int, cache: str | None, version: tuple[int, int, int], reply_timeout: float):
        # the port stays bound here (not listening) until the worker listens on it too (both SO_REUSEADDR):
        # no other process is handed it meanwhile, and our own connect cannot land on itself
        with socket.socket() as reserved:
            reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            reserved.bind(("127.0.0.1", 0))
            self.port = reserved.getsockname()[1]
            args = [sys.executable, "-m", "pyggml.rpc_server", f"127.0.0.1:{self.port}", str(threads), cache or ""]
            # stdin: a pipe the worker watches, so it exits when the guard does, however it ends; stdout:
            # ggml prints its banner there for every worker, kept out of the server's output
            self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
            self.sock = self._connect(version)
        self.sock.settimeout(reply_timeout)
        self.send(bytes([CMD_DEVICE_COUNT]) + _U64.pack(0))
        (self.n_devices,) = _U32.unpack(self.answer(4))

    def _connect(self, version: tuple[int, int, int]) -> socket.socket:
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise ConnectionError(f"the ggml worker exited with {self.proc.returncode} while starting")
            try:
                sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise ConnectionError("the ggml worker did not start listening within 60 s") from None
                time.sleep(0.05)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.sendall(bytes([CMD_HELLO]) + _U64.pack(CONN_CAPS_SIZE) + bytes(CONN_CAPS_SIZE))
            if _U64.unpack(rpc._recv_exact(sock, 8))[0] != 4 + CONN_CAPS_SIZE:
                raise ConnectionError("the ggml worker answered HELLO wrongly")
            if tuple(rpc._recv_exact(sock, 4 + CONN_CAPS_SIZE)[:3]) != version:
                raise ConnectionError("the ggml worker speaks another protocol version")
        except OSError:
            sock.close()
            self.stop()
            raise
        return sock

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self, n: int) -> bytes:
        data = self.sock.recv(n)
        if not data:
            raise ConnectionError("the ggml worker closed the connection (it crashed: see the messages above)")
        return data

    def answer(self, size: int) -> bytes:
        head = rpc._recv_exact(self.sock, 8)
        if _U64.unpack(head)[0] != size:
            raise ConnectionError(f"the ggml worker answered with {_U64.unpack(head)[0]} bytes, not {size}")
        return rpc._recv_exact(self.sock, size)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended (and was reaped by another thread's wait) since the poll
                pass
        self.proc.wait()
        self.proc.stdin.close()
        sock = getattr(self, "sock", None)
        if sock is not None:
            sock.close()


# ---- the guard -----------------------------------------------------------------------------------
@dataclass
class Guard:
    """Accepts clients on ``address:port`` and runs a :class:`Session` for each."""

    address: str
    port: int
    limits: Limits
    threads: int
    cache: str | None
    version: tuple[int, int, int]
    allocated: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _sessions: set = field(default_factory=set)
    _spare: Worker | None = None
    _spare_ready: threading.Event = field(default_factory=threading.Event)

    def listen(self) -> None:
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((self.address, self.port))
        self._listener.listen(16)
        self._prepare_spare()

    def serve_forever(self) -> None:
        while True:
            try:
                client, peer = self._listener.accept()
                client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError as exc:  # out of file descriptors, a client gone at once: keep accepting
                log.error("rpc-server: accepting a connection failed: %s", exc)
                time.sleep(0.1)
                continue
            name = f"{peer[0]}:{peer[1]}"
            with self._lock:
                full = len(self._sessions) >= self.limits.max_clients
            if full:
                log.warning("rpc-server: %s: refused, %d clients already (--max-clients)", name,
                            self.limits.max_clients)
                client.close()
                continue
            session = Session(self, client, name)
            with self._lock:
                self._sessions.add(session)
            threading.Thread(target=self._run, args=(session,), name=f"rpc-session {name}", daemon=True).start()

    def _run(self, session: Session) -> None:
        try:
            session.run()
        finally:
            with self._lock:
                self._sessions.discard(session)

    # -- workers: one spare is kept started, so a new client does not wait for a process to start
    def _prepare_spare(self) -> None:
        self._spare_ready.clear()
        threading.Thread(target=self._start_spare, name="rpc-spare-worker", daemon=True).start()

    def _start_spare(self) -> None:
        try:
            worker = Worker(self.threads, self.cache, self.version, self.limits.reply_timeout)
        except Exception as exc:  # whatever it was, take_worker tries again and reports
            log.error("rpc-server: could not start a ggml worker: %s", exc)
            worker = None
        with self._lock:
            self._spare = worker
        self._spare_ready.set()

    def take_worker(self) -> Worker:
        if not self._spare_ready.wait(120):
            raise ConnectionError("no ggml worker started within 120 s")
        with self._lock:
            worker, self._spare = self._spare, None
        self._prepare_spare()
        if worker is None or worker.proc.poll() is not None:
            worker = Worker(self.threads, self.cache, self.version, self.limits.reply_timeout)
        return worker

    def stop(self) -> None:
        """Kill every worker (the spare and the sessions')."""
        with self._lock:
            sessions, spare, self._spare = list(self._sessions), self._spare, None
        for session in sessions:
            if session.worker is not None:
                session.worker.stop()
        if spare is not None:
            spare.stop()

    # -- memory
    def reserve(self, size: int, force: bool = False) -> bool:
        with self._lock:
            if not force and self.allocated + size > self.limits.max_memory:
                return False
            self.allocated += size
            return True

    def release(self, size: int) -> None:
        with self._lock:
            self.allocated -= size

    def cached_size(self, digest: int) -> int | None:
        if not self.cache:
            return None
        try:
            return (Path(self.cache) / f"{digest:016x}").stat().st_size
        except OSError:
            return None


def _worker_main(endpoint: str, threads: str, cache: str) -> None:
    """The worker process: ggml's server on a thread with a stack deep enough for the graphs the guard admits."""
    from pyggml.backend.hardware import serve_rpc

    def watch_guard() -> None:
        sys.stdin.buffer.read()  # returns when the guard's end of the pipe closes: it stopped or died
        os._exit(0)

    threading.Thread(target=watch_guard, daemon=True).start()
    threading.stack_size(512 << 20)  # address space only; ggml recurses once per link of a source chain
    server = threading.Thread(target=serve_rpc, args=(endpoint, cache or None, int(threads)), daemon=True)
    server.start()
    server.join()  # ggml's loop returns only when it could not start (a message says why)
    os._exit(1)


if __name__ == "__main__":
    _worker_main(*sys.argv[1:4])
