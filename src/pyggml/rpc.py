"""ggml RPC without the process aborts: endpoints, the version check, and a relay per remote server.

ggml's RPC client (``ggml-rpc.cpp``) calls ``GGML_ABORT`` when a server cannot be reached, speaks another
protocol version, or drops the connection in the middle of a command: a lost remote would take the whole
Python process with it. So pyggml never gives ggml a remote address. For each remote server it starts a
*relay* in this process, a loopback listener that ggml connects to instead, and that forwards each command
to the real server. ggml's dispatcher sends one command at a time and waits for its answer, so the relay
keeps the protocol's framing and knows which commands are answered and how long the answer is. When the
server is gone (reset, closed, silent past the timeout) the relay marks its connection failed and from
then on answers every command itself with a well-formed dummy reply: ggml finishes what it was doing
without aborting, and ``Backend`` raises :class:`RPCError` after the compute instead of using the
garbage results. The same happens when the server answers something that would make ggml's client abort
or place tensors wrongly (:func:`check_answer`: a device count past the scheduler's limit, a buffer smaller
than asked, a base address of 0 or one that wraps). The relay also counts the bytes each way
(``traffic()``), which is how the transfer per decode step is measured.

Before ggml first connects to a server, :func:`hello` checks it from Python with a bounded timeout:
unreachable, not an RPC server, or another protocol version raise :class:`RPCError` with the reason.

This module speaks only sockets; the ggml side (registering devices, the server loop) is in
``pyggml.backend.hardware``, and ``pyggml rpc-server``'s guard, which checks clients' messages, in
``pyggml.rpc_server``. The protocol facts below are those of the pinned ggml (protocol 7.0.0); check them
against ``ggml/src/ggml-rpc/ggml-rpc.cpp`` when the pin moves.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import os
import socket
import struct
import threading
from dataclasses import dataclass, field

log = logging.getLogger("pyggml.rpc")

DEFAULT_PORT = 50052
CONNECT_TIMEOUT = 5.0  # seconds to connect and exchange HELLO with a server


def reply_timeout() -> float:
    """Seconds a server may take to answer one command (a long prompt on a slow host computes meanwhile);
    ``PYGGML_RPC_TIMEOUT`` overrides the default of 300."""
    try:
        value = float(os.environ.get("PYGGML_RPC_TIMEOUT", "300"))
    except ValueError:
        value = 300.0
    return value if value > 0 else 300.0


class RPCError(ConnectionError):
    """A remote ggml RPC server cannot be used: unreachable, another protocol version, or gone."""


# ---- endpoints ---------------------------------------------------------------------------------
def parse_endpoint(text: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port). ggml splits at the first colon: IPv6 literals are refused."""
    if not isinstance(text, str):
        raise TypeError(f"rpc endpoint must be a string 'host:port', got {type(text).__name__}")
    host, sep, port_text = text.strip().partition(":")
    if not sep or not host or ":" in port_text:
        raise ValueError(f"rpc endpoint must be 'host:port' (IPv4 address or host name), got {text!r}")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"rpc endpoint {text!r}: port {port_text!r} is not a number") from None
    if not 1 <= port <= 65535:
        raise ValueError(f"rpc endpoint {text!r}: port must be 1..65535")
    return host, port


def normalize_endpoints(endpoints: object) -> list[str]:
    """A list of ``host:port`` strings from a list or a comma-separated string; duplicates refused."""
    if endpoints is None:
        return []
    if isinstance(endpoints, str):
        endpoints = [e for e in endpoints.split(",") if e.strip()]
    if not isinstance(endpoints, (list, tuple)):
        raise TypeError(f"rpc must be a list of 'host:port' strings, got {type(endpoints).__name__}")
    out = []
    for e in endpoints:
        host, port = parse_endpoint(e)
        out.append(f"{host}:{port}")
    if len(set(out)) != len(out):
        raise ValueError(f"rpc: the same server is listed twice: {out}")
    return out


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ---- protocol (ggml-rpc.cpp, protocol 7) --------------------------------------------------------
CMD_ALLOC_BUFFER, CMD_GET_ALIGNMENT, CMD_GET_MAX_SIZE, CMD_BUFFER_GET_BASE = 0, 1, 2, 3
CMD_FREE_BUFFER, CMD_BUFFER_CLEAR, CMD_SET_TENSOR, CMD_SET_TENSOR_HASH = 4, 5, 6, 7
CMD_GET_TENSOR, CMD_COPY_TENSOR, CMD_GRAPH_COMPUTE, CMD_GET_DEVICE_MEMORY = 8, 9, 10, 11
CMD_INIT_TENSOR, CMD_GET_ALLOC_SIZE, CMD_HELLO, CMD_DEVICE_COUNT = 12, 13, 14, 15
CMD_GRAPH_RECOMPUTE, CMD_MEMSET_TENSOR = 16, 17
CMD_COUNT = 19
COMMAND_NAMES = ("ALLOC_BUFFER", "GET_ALIGNMENT", "GET_MAX_SIZE", "BUFFER_GET_BASE", "FREE_BUFFER", "BUFFER_CLEAR",
                 "SET_TENSOR", "SET_TENSOR_HASH", "GET_TENSOR", "COPY_TENSOR", "GRAPH_COMPUTE", "GET_DEVICE_MEMORY",
                 "INIT_TENSOR", "GET_ALLOC_SIZE", "HELLO", "DEVICE_COUNT", "GRAPH_RECOMPUTE", "MEMSET_TENSOR")

RPC_TENSOR_SIZE = 296  # sizeof(rpc_tensor), packed: 8+4+8+4*4+4*4+4+64+4+10*8+8+8+8+64+4
CONN_CAPS_SIZE = 24
HELLO_RESPONSE_SIZE = 4 + CONN_CAPS_SIZE
# commands the server answers, with the size of the answer (GET_TENSOR: the size the request asks for)
_ANSWER_SIZE: dict[int, int | None] = {
    CMD_ALLOC_BUFFER: 16, CMD_GET_ALIGNMENT: 8, CMD_GET_MAX_SIZE: 8, CMD_BUFFER_GET_BASE: 8,
    CMD_SET_TENSOR_HASH: 1, CMD_GET_TENSOR: None, CMD_COPY_TENSOR: 1, CMD_GET_DEVICE_MEMORY: 16,
    CMD_GET_ALLOC_SIZE: 8, CMD_HELLO: HELLO_RESPONSE_SIZE, CMD_DEVICE_COUNT: 4,
}
_UNANSWERED = {CMD_FREE_BUFFER, CMD_BUFFER_CLEAR, CMD_SET_TENSOR, CMD_GRAPH_COMPUTE, CMD_INIT_TENSOR,
               CMD_GRAPH_RECOMPUTE, CMD_MEMSET_TENSOR}
_GET_TENSOR_SIZE_AT = RPC_TENSOR_SIZE + 8  # rpc_msg_get_tensor_req: tensor, offset, size
MAX_DEVICES = 15  # per server: ggml's scheduler takes at most 16 backends, and the local CPU is one
MAX_ALIGNMENT = 1 << 20
_U64 = struct.Struct("<Q")
TENSOR = struct.Struct("<QIQ4I4II16ii10QQQQ64si")  # rpc_tensor, packed
assert TENSOR.size == RPC_TENSOR_SIZE


@dataclass
class Tensor:
    """The fields of a serialised ggml tensor that decide where its bytes are and what computes it."""
    id: int
    type: int
    buffer: int
    ne: tuple[int, ...]
    nb: tuple[int, ...]
    op: int
    src: tuple[int, ...]
    view_src: int
    data: int


def parse_tensor(data: bytes | memoryview, offset: int = 0) -> Tensor:
    f = TENSOR.unpack_from(data, offset)
    return Tensor(f[0], f[1], f[2], f[3:7], f[7:11], f[11], f[29:39], f[39], f[41])


@functools.cache
def type_table() -> dict[int, tuple[int, int]]:
    """ggml type -> (block size, bytes per block), for the types ggml still has (``DType``; removed
    types keep their number in ggml but are absent here)."""
    from pyggml.tensor import DType

    return {int(d): (d.block_size, d.type_size) for d in DType}


def nbytes(t: Tensor) -> int:
    """ggml_nbytes in Python integers (no wrap-around); the type must be in :func:`type_table`."""
    blck, size = type_table()[t.type]
    if any(n == 0 for n in t.ne):
        return 0
    if blck == 1:
        return size + sum((n - 1) * s for n, s in zip(t.ne, t.nb, strict=True))
    return t.ne[0] * t.nb[0] // blck + sum((n - 1) * s for n, s in zip(t.ne[1:], t.nb[1:], strict=True))


def check_answer(cmd: int, request: bytes, answer: bytes, buffers: dict[int, int]) -> str | None:
    """Why a server's answer to ``request`` would make ggml abort or compute wrongly, or None. ``buffers``
    (remote pointer -> size) is updated from allocations."""
    if cmd == CMD_DEVICE_COUNT:
        (n,) = struct.unpack("<I", answer)
        return f"reports {n} devices (at most {MAX_DEVICES} are usable)" if n > MAX_DEVICES else None
    if cmd == CMD_ALLOC_BUFFER:
        ptr, size = struct.unpack("<QQ", answer)
        (asked,) = _U64.unpack_from(request, 4)
        if ptr != 0 and not asked <= size < 1 << 62:
            return f"answered an allocation of {asked} bytes with a buffer of {size}"
        if ptr != 0:
            buffers[ptr] = size
        return None
    if cmd == CMD_BUFFER_GET_BASE:
        (base,) = _U64.unpack(answer)
        size = buffers.get(_U64.unpack(request)[0], 0)
        if base == 0 or base + size >= 1 << 63:
            return f"answered a buffer base of {base:#x} for a buffer of {size} bytes"
        return None
    if cmd == CMD_GET_ALIGNMENT:
        (align,) = _U64.unpack(answer)
        if not 0 < align <= MAX_ALIGNMENT or align & (align - 1):
            return f"answered an alignment of {align} (a power of two up to {MAX_ALIGNMENT} is expected)"
        return None
    if cmd == CMD_GET_MAX_SIZE:
        return "answered a maximum buffer size of 0" if _U64.unpack(answer)[0] == 0 else None
    if cmd == CMD_GET_ALLOC_SIZE:
        (size,) = _U64.unpack(answer)  # ggml's client raises a smaller one to the tensor's size itself
        if size >= 1 << 62:
            return f"answered an allocation size of {size}"
    return None


def _dummy_answer(cmd: int, size: int, version: tuple[int, int, int]) -> bytes:
    """What the relay answers once its server is gone: well-formed values that keep ggml from aborting
    (non-zero alignment and base address, 'already cached' for hashes, zeros for data)."""
    if cmd == CMD_HELLO:
        return bytes(version) + bytes(1 + CONN_CAPS_SIZE)
    if cmd == CMD_GET_ALIGNMENT:
        return struct.pack("<Q", 64)
    if cmd == CMD_GET_MAX_SIZE:
        return struct.pack("<Q", 1 << 62)
    if cmd == CMD_BUFFER_GET_BASE:
        return struct.pack("<Q", 1 << 20)
    if cmd in (CMD_SET_TENSOR_HASH, CMD_COPY_TENSOR):
        return b"\x01"
    return bytes(size)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionResetError("connection closed")
        got += k
    return bytes(buf)


def hello(endpoint: str, version: tuple[int, int, int], timeout: float = CONNECT_TIMEOUT) -> tuple[int, int, int]:
    """Connect to an RPC server, exchange HELLO and disconnect; returns the server's protocol version.

    Raises RPCError when it cannot be reached or answered, or speaks an incompatible version (same
    rule as ggml: equal major, server minor not newer than ours)."""
    host, port = parse_endpoint(endpoint)
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(bytes([CMD_HELLO]) + struct.pack("<Q", CONN_CAPS_SIZE) + bytes(CONN_CAPS_SIZE))
            (size,) = struct.unpack("<Q", _recv_exact(sock, 8))
            if size != HELLO_RESPONSE_SIZE:
                raise RPCError(f"rpc server {endpoint} answered HELLO with {size} bytes, not "
                               f"{HELLO_RESPONSE_SIZE}: not a ggml RPC server of protocol {version[0]}.x")
            answer = _recv_exact(sock, size)
    except TimeoutError:
        raise RPCError(f"rpc server {endpoint} did not answer within {timeout:g} s (a ggml RPC server serves one "
                       "client at a time: is another client using it?)") from None
    except OSError as exc:
        if isinstance(exc, RPCError):
            raise
        raise RPCError(f"cannot reach rpc server {endpoint}: {exc.strerror or exc}") from None
    theirs = (answer[0], answer[1], answer[2])
    if theirs[0] != version[0] or theirs[1] > version[1]:
        raise RPCError(f"rpc server {endpoint} speaks RPC protocol {'.'.join(map(str, theirs))}, this pyggml speaks "
                       f"{'.'.join(map(str, version))}: run the same ggml version on both sides")
    return theirs


# ---- the relay ------------------------------------------------------------------------------------
_CHUNK = 1 << 20
_SMALL = 1 << 16


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class _Connection:
    """One ggml dispatcher <-> one upstream connection; runs in its own thread."""

    def __init__(self, relay: Relay, client: socket.socket):
        self.relay = relay
        self.client = client
        self.upstream: socket.socket | None = None
        self.failure: str | None = None
        self.buffer = bytearray(_CHUNK)
        self.buffers: dict[int, int] = {}  # remote pointer -> size, from the server's allocations

    def fail(self, what: str) -> None:
        if self.failure is None:
            self.failure = self.relay.last_failure = what
            log.error("rpc server %s: %s", self.relay.endpoint, what)
            if self.upstream is not None:
                try:
                    self.upstream.close()
                except OSError:
                    pass
                self.upstream = None

    # upstream I/O: every error turns into fail(); the client side never sees a broken stream
    def _up_send(self, data: bytes | memoryview) -> None:
        if self.upstream is None:
            return
        try:
            self.upstream.sendall(data)
            self.relay.sent += len(data)
        except TimeoutError:
            self.fail(f"did not accept data within {self.relay.timeout:g} s")
        except OSError as exc:
            self.fail(f"connection lost while sending ({exc.strerror or exc})")

    def _up_recv(self, n: int) -> bytes | None:
        if self.upstream is None:
            return None
        try:
            data = _recv_exact(self.upstream, n)
            self.relay.received += n
            return data
        except TimeoutError:
            self.fail(f"did not answer within {self.relay.timeout:g} s (PYGGML_RPC_TIMEOUT)")
        except OSError as exc:
            self.fail(f"connection lost while waiting for an answer ({exc.strerror or exc})")
        return None

    def run(self) -> None:
        try:
            try:
                host, port = parse_endpoint(self.relay.endpoint)
                self.upstream = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT)
                self.upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                _keepalive(self.upstream)
                self.upstream.settimeout(self.relay.timeout)
            except OSError as exc:
                self.upstream = None
                self.fail(f"cannot connect ({exc.strerror or exc})")
            while self._one_command():
                pass
        except OSError:  # the client side (ggml, in this process) closed: the dispatcher is gone
            pass
        except Exception:  # a bug here: closing makes ggml abort, which beats ggml waiting forever
            log.exception("rpc relay for %s failed", self.relay.endpoint)
        finally:
            self.relay._forget(self)
            for s in (self.client, self.upstream):
                if s is not None:
                    try:
                        s.close()
                    except OSError:
                        pass

    def _one_command(self) -> bool:
        client = self.client
        try:
            header = _recv_exact(client, 9)
        except ConnectionResetError:
            return False
        cmd = header[0]
        (size,) = struct.unpack_from("<Q", header, 1)
        self.relay.messages += 1
        if cmd < len(COMMAND_NAMES):
            counts = self.relay.commands.setdefault(COMMAND_NAMES[cmd], [0, 0])
            counts[0] += 1
            counts[1] += 9 + size
        if cmd not in _ANSWER_SIZE and cmd not in _UNANSWERED:
            # cannot happen with the pinned ggml; the framing of the rest is unknown, so stop here
            self.fail(f"unknown RPC command {cmd} from ggml (is the relay's table out of date?)")
            return False
        payload = b""
        if size <= _SMALL:
            payload = _recv_exact(client, size)
            self._up_send(header + payload)
        else:
            self._up_send(header)
            view = memoryview(self.buffer)
            left = size
            while left:
                k = client.recv_into(view, min(left, _CHUNK))
                if k == 0:
                    raise ConnectionResetError("client closed")
                left -= k
                self._up_send(view[:k])
        answer_size = _ANSWER_SIZE.get(cmd, -1)
        if answer_size == -1:
            return True
        if answer_size is None:  # GET_TENSOR
            answer_size = struct.unpack_from("<Q", payload, _GET_TENSOR_SIZE_AT)[0] if len(payload) >= \
                _GET_TENSOR_SIZE_AT + 8 else 0
        self._answer(cmd, answer_size, payload)
        return True

    def _answer(self, cmd: int, size: int, request: bytes) -> None:
        client = self.client
        head = self._up_recv(8)
        if head is not None and struct.unpack("<Q", head)[0] != size:
            self.fail(f"answered command {cmd} with {struct.unpack('<Q', head)[0]} bytes, expected {size}")
            head = None
        if head is None or size <= _SMALL:
            body = self._up_recv(size) if head is not None else None
            wrong = check_answer(cmd, request, body, self.buffers) if body is not None else None
            if wrong is not None:  # ggml would abort on it, or place tensors wrongly: the server is unusable
                self.fail(f"{COMMAND_NAMES[cmd]}: {wrong}")
                body = None
            if body is None:
                body = _dummy_answer(cmd, size, self.relay.version)
            client.sendall(struct.pack("<Q", size) + body)
            return
        client.sendall(head)  # a large tensor: stream it, and pad with zeros if the server dies midway
        view = memoryview(self.buffer)
        left = size
        while left:
            n = min(left, _CHUNK)
            got = 0
            if self.upstream is not None:
                try:
                    got = self.upstream.recv_into(view, n)
                    if got == 0:
                        raise ConnectionResetError("connection closed")
                    self.relay.received += got
                except TimeoutError:
                    self.fail(f"did not answer within {self.relay.timeout:g} s (PYGGML_RPC_TIMEOUT)")
                    got = 0
                except OSError as exc:
                    self.fail(f"connection lost while sending a tensor ({exc.strerror or exc})")
                    got = 0
            if got == 0:
                got = n
                view[:n] = bytes(n)
            client.sendall(view[:got])
            left -= got


@dataclass
class Traffic:
    sent: int  # bytes to the server (framing included)
    received: int  # bytes from it
    messages: int  # commands sent
    commands: dict[str, tuple[int, int]] = field(default_factory=dict)  # command -> (count, bytes sent)


class Relay:
    """A loopback listener standing in for one remote server (one per server per process)."""

    def __init__(self, endpoint: str, version: tuple[int, int, int], timeout: float | None = None):
        self.endpoint = endpoint
        self.version = version
        self.timeout = timeout or reply_timeout()
        self.sent = 0
        self.received = 0
        self.messages = 0
        self.commands: dict[str, list[int]] = {}
        self.last_failure: str | None = None  # also after ggml closed the connection that failed
        self._lock = threading.Lock()
        self._connections: list[_Connection] = []
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(8)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, name=f"pyggml-rpc-relay {endpoint}", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(self, client)
            with self._lock:
                self._connections.append(conn)
            threading.Thread(target=conn.run, name=f"pyggml-rpc {self.endpoint}", daemon=True).start()

    def _forget(self, conn: _Connection) -> None:
        with self._lock:
            if conn in self._connections:
                self._connections.remove(conn)

    @property
    def connected(self) -> bool:
        """Whether ggml holds a connection to this server (its dispatcher is alive)."""
        with self._lock:
            return bool(self._connections)

    @property
    def error(self) -> str | None:
        """Why a live connection to this server failed, or None."""
        with self._lock:
            for conn in self._connections:
                if conn.failure is not None:
                    return conn.failure
        return None

    def traffic(self) -> Traffic:
        return Traffic(self.sent, self.received, self.messages, {k: (v[0], v[1]) for k, v in self.commands.items()})


class Direct:
    """Stands in for a relay when ``PYGGML_RPC_DIRECT=1``: ggml connects to the server itself. For measuring
    what the relay costs, never for use: a lost server then aborts the process, and no bytes are counted."""

    def __init__(self, endpoint: str):
        self.endpoint = self.address = endpoint
        self.sent = self.received = self.messages = 0
        self.connected = False
        self.error: str | None = None
        self.last_failure: str | None = None

    def traffic(self) -> Traffic:
        return Traffic(0, 0, 0)


_relays: dict[str, Relay] = {}
_relays_lock = threading.Lock()


def relay_for(endpoint: str, version: tuple[int, int, int]) -> Relay:
    """The relay of ``endpoint`` (made on first use; it lives as long as the process, as ggml keeps the
    devices it registered for it)."""
    with _relays_lock:
        relay = _relays.get(endpoint)
        if relay is None:
            relay = _relays[endpoint] = Relay(endpoint, version)
        return relay


def traffic() -> dict[str, Traffic]:
    """Bytes sent to and received from each remote server by this process so far (payload and framing)."""
    with _relays_lock:
        return {endpoint: relay.traffic() for endpoint, relay in _relays.items()}
