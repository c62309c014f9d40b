"""What pyggml computes on: ggml's log and errors, this machine's cores and how many threads are worth
using now (``FreeCores``), its devices (``devices()``), and remote devices registered through ggml RPC.

The lowest module that speaks to ggml besides ``tensor.py``: importing it installs pyggml's ggml log
handler (``PYGGML_LOG``: none, debug, info, warn, error).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("GGML_NO_BACKTRACE", "1")  # an abort must not fork gdb first

from pyggml import rpc as _rpc  # noqa: E402
from pyggml.rpc import RPCError  # noqa: E402
from pyggml.tensor import ffi, lib  # noqa: E402  (the compiled binding, loaded in one place)

NULL = ffi.NULL
_LOG_LEVELS = {"none": 0, "debug": 1, "info": 2, "warn": 3, "error": 4}
lib.pyggml_log_install(_LOG_LEVELS.get(os.environ.get("PYGGML_LOG", "none").lower(), 0))


class GGMLError(RuntimeError):
    """ggml reported a failure (allocation, compute); the message includes ggml's own log."""


def ggml_log() -> str:
    buf = ffi.new("char[]", 8192)
    n = lib.pyggml_log_take(buf, 8192)
    return ffi.unpack(buf, n).decode("utf-8", "replace").strip()


def with_ggml_log(message: str) -> str:
    log = ggml_log()
    return f"{message}\nggml: {log}" if log else message


def ggml_version() -> str:
    """Version of the ggml sources pyggml was built from."""
    return ffi.string(lib.ggml_version()).decode()


def physical_cores() -> int:
    """Physical cores available to this process (hyper-threads counted once)."""
    available = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in available:
        try:
            base = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
            cores.add(((base / "physical_package_id").read_text(), (base / "core_id").read_text()))
        except OSError:
            return max(1, len(available))
    return max(1, len(cores))


def max_threads() -> int:
    """The most compute threads a backend may have: 4 per logical CPU (more only adds scheduling cost; ggml's
    own ceiling is 512)."""
    return max(1, min(512, 4 * (os.cpu_count() or 1)))


class FreeCores:
    """How many compute threads are worth using now: ``n_threads``, or fewer while other processes
    keep cores busy. A graph has a barrier per node and every one waits for a descheduled thread,
    so with a core taken a thread fewer is many times faster (docs/server.md, "Threads under
    contention"). Measured on Linux from the CPU time this process's CPUs spent on other processes
    (/proc/stat less ``time.process_time()``) over windows of at least SAMPLE_S: a core busy half a
    window or more counts as taken, judged by the median of the last SAMPLES windows. Elsewhere
    always ``n_threads``."""

    SAMPLE_S = 0.2
    FIRST_S = 0.05  # the first window may be shorter (/proc/stat counts 10 ms ticks: ~0.2 cores' error)
    SAMPLES = 3

    def __init__(self, n_threads: int):
        self.n_threads = self.threads = n_threads
        self.cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.busy: deque[float] = deque(maxlen=self.SAMPLES)  # cores' worth of other processes' work
        self._last: tuple[float, float, float] | None = None  # (monotonic, busy s, own s)
        self._on = n_threads > 1 and bool(self.cpus)
        if self._on:  # the first window starts now: by the first compute (after loading) it can tell
            busy = cpu_busy_seconds(self.cpus)
            self._on = busy is not None
            self._last = (time.monotonic(), busy, time.process_time()) if self._on else None

    def __call__(self) -> int:
        if not self._on:
            return self.n_threads
        now = time.monotonic()
        if now < self._last[0] + (self.SAMPLE_S if self.busy else self.FIRST_S):
            return self.threads
        busy = cpu_busy_seconds(self.cpus)
        if busy is None:  # /proc/stat went away: keep every thread
            self._on, self.threads = False, self.n_threads
            return self.threads
        own = time.process_time()
        then, busy_then, own_then = self._last
        self.busy.append(max(0.0, (busy - busy_then) - (own - own_then)) / (now - then))
        taken = int(sorted(self.busy)[(len(self.busy) - 1) // 2] + 0.5)
        self.threads = max(1, min(self.n_threads, len(self.cpus) - taken))
        self._last = (now, busy, own)
        return self.threads


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_busy_seconds(cpus: Sequence[int]) -> float | None:
    """Seconds the given CPUs have spent not idle since boot (Linux /proc/stat), or None."""
    wanted = {f"cpu{c}" for c in cpus}
    total = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu"):
                    break
                fields = line.split()
                if fields[0] in wanted:  # user nice system idle iowait irq softirq steal (guest: in user)
                    ticks = [int(x) for x in fields[1:9]]
                    total += sum(ticks) - ticks[3] - ticks[4]
    except (OSError, ValueError, IndexError):
        return None
    return total / _TICK


# ---- devices ------------------------------------------------------------------------------------
_KINDS = {lib.GGML_BACKEND_DEVICE_TYPE_CPU: "cpu", lib.GGML_BACKEND_DEVICE_TYPE_GPU: "gpu",
          lib.GGML_BACKEND_DEVICE_TYPE_IGPU: "igpu", lib.GGML_BACKEND_DEVICE_TYPE_ACCEL: "accel"}


@dataclass(frozen=True)
class Device:
    name: str
    description: str
    kind: str  # "cpu" | "gpu" | "igpu" | "accel" | "rpc" (a device of a remote `pyggml rpc-server`)
    memory_free: int
    memory_total: int


def device_info(dev: Any) -> Device:
    name = ffi.string(lib.ggml_backend_dev_name(dev)).decode()
    remote = _RPC_DEVICES.get(_address(dev))
    if remote is not None:
        endpoint, relay = remote
        # ask only over a live connection: a fresh one would wait while the server serves another client
        if relay.connected and relay.error is None:
            _RPC_MEMORY[endpoint] = device_memory(dev)
        free, total = _RPC_MEMORY.get(endpoint, (0, 0))
        return Device(name, f"RPC server {endpoint}", "rpc", free, total)
    free, total = device_memory(dev)
    return Device(name, ffi.string(lib.ggml_backend_dev_description(dev)).decode(),
                  _KINDS.get(lib.ggml_backend_dev_type(dev), "other"), free, total)


def device_memory(dev: Any) -> tuple[int, int]:
    free, total = ffi.new("size_t *"), ffi.new("size_t *")
    lib.ggml_backend_dev_memory(dev, free, total)
    return int(free[0]), int(total[0])


def _address(p: Any) -> int:
    return int(ffi.cast("uintptr_t", p))


def devices() -> list[Device]:
    """The compute devices ggml can use, GPUs first if any; remote (RPC) devices once a model or
    ``add_rpc_server`` has used their server in this process. A build without a GPU backend lists
    only the CPU (``gpu_layers`` then runs on the CPU: ``Backend.cpu_fallback`` says so)."""
    return [device_info(lib.ggml_backend_dev_get(i)) for i in range(lib.ggml_backend_dev_count())]


# ---- remote devices (ggml RPC through pyggml.rpc's relays) -------------------------------------------
_RPC_LOCK = threading.Lock()
_RPC_SERVERS: dict[str, list[Any]] = {}  # endpoint -> its ggml devices (registered once per process)
_RPC_DEVICES: dict[int, tuple[str, _rpc.Relay]] = {}  # device address -> (endpoint, relay)
_RPC_MEMORY: dict[str, tuple[int, int]] = {}  # endpoint -> last known (free, total)


def rpc_version() -> tuple[int, int, int]:
    """The ggml RPC protocol version of this build ((0, 0, 0) when built without RPC)."""
    return (lib.RPC_PROTO_MAJOR_VERSION, lib.RPC_PROTO_MINOR_VERSION, lib.RPC_PROTO_PATCH_VERSION)


def add_rpc_server(endpoint: str) -> list[Any]:
    """Register the devices of the RPC server at ``endpoint`` ("host:port") with ggml; returns them.

    Checked from Python first (reachable, same protocol), so that ggml, which aborts on such errors,
    only ever talks to the server's relay in this process."""
    (endpoint,) = _rpc.normalize_endpoints([endpoint])
    if not lib.PYGGML_HAS_RPC:
        raise RPCError("this pyggml was built without ggml's RPC backend (CMake option PYGGML_RPC=OFF)")
    with _RPC_LOCK:
        relay = _rpc.relay_for(endpoint, rpc_version())
        if os.environ.get("PYGGML_RPC_DIRECT") == "1":  # measuring the relay's cost only (see pyggml/rpc.py)
            relay = _rpc.Direct(endpoint)
        if relay.connected:
            if relay.error is not None:
                raise RPCError(f"rpc server {endpoint} was lost earlier in this process ({relay.error}); close the "
                               "models that use it, then load again")
        else:
            _rpc.hello(endpoint, rpc_version())
        devs = _RPC_SERVERS.get(endpoint)
        if devs is None:
            relay.last_failure = None
            reg = lib.ggml_backend_rpc_add_server(relay.address.encode())
            if (relay.error or relay.last_failure) is not None:  # ggml may have closed the failed connection
                raise RPCError(f"rpc server {endpoint}: {relay.error or relay.last_failure}")
            if reg == NULL or lib.ggml_backend_reg_dev_count(reg) == 0:
                raise RPCError(f"rpc server {endpoint} offers no devices")
            devs = [lib.ggml_backend_reg_dev_get(reg, i) for i in range(lib.ggml_backend_reg_dev_count(reg))]
            lib.ggml_backend_register(reg)  # now listed by devices()
            _RPC_SERVERS[endpoint] = devs
            for dev in devs:
                _RPC_DEVICES[_address(dev)] = (endpoint, relay)
        return list(devs)


def rpc_traffic() -> dict[str, _rpc.Traffic]:
    """Bytes this process sent to / received from each RPC server so far."""
    return _rpc.traffic()


def serve_rpc(endpoint: str, cache_dir: str | None, n_threads: int) -> None:
    """Run ggml's RPC server on this machine's devices (CPU, and GPUs when built with them); blocks.
    ``endpoint`` must be an IPv4 address and port (checked by the caller, ``pyggml rpc-server``)."""
    if not lib.PYGGML_HAS_RPC:
        raise RPCError("this pyggml was built without ggml's RPC backend (CMake option PYGGML_RPC=OFF)")
    rpc_reg = lib.ggml_backend_rpc_reg()
    local = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        if lib.ggml_backend_dev_backend_reg(dev) != rpc_reg:  # never re-export remote devices
            local.append(dev)
    # GPUs first, the CPU last, as ggml lists them
    devs = ffi.new("ggml_backend_dev_t[]", local)
    cache = ffi.new("char[]", cache_dir.encode()) if cache_dir else NULL
    lib.ggml_backend_rpc_start_server(endpoint.encode(), cache, n_threads, len(local), devs)


def rpc_relay(dev: Any) -> tuple[str, _rpc.Relay] | None:
    """(endpoint, relay) of a device registered by ``add_rpc_server``; None for a local device."""
    return _RPC_DEVICES.get(_address(dev))
