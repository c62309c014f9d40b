"""Backend (weights on devices) and Context (one graph).

A ``Backend`` owns ggml backends (CPU, plus GPUs when built with them), a ``ggml_backend_sched``
that splits graphs across them, and the model weights read from a GGUF file. A ``Context`` builds
one graph: tensors made in it are nodes, data given with ``from_numpy`` is uploaded at
``compute``, and results stay readable until the backend computes another graph. The GGUF metadata
(``Config``) is ``pyggml.backend.metadata``; devices, threads and RPC devices are ``pyggml.backend.hardware``.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import re
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pyggml import rpc as _rpc
from pyggml.backend.hardware import (
    NULL,
    FreeCores,
    GGMLError,
    add_rpc_server,
    device_info,
    device_memory,
    max_threads,
    physical_cores,
    rpc_relay,
    with_ggml_log,
)
from pyggml.backend.metadata import Config, GGUFError, read_metadata, refused_gguf
from pyggml.rpc import RPCError
from pyggml.tensor import (  # the compiled binding, loaded in one place
    _INTERMEDIATE,
    DType,
    Tensor,
    _check_size,
    _prepare_host_array,
    dtype_of_numpy,
    ffi,
    index_source,
    lib,
)


# ---- parameters ----------------------------------------------------------------------------------
@dataclass
class BackendParams:
    """How to place and run a model. ``gpu_layers``: a count (the last N layers), "all", or a list
    of layer indices. ``flash_attention=None`` lets the backend decide. ``repack`` lets the CPU
    backend rearrange quantized weights for its fastest kernels (costs RAM outside the mmap)."""

    n_threads: int | None = None
    gpu_layers: int | str | Sequence[int] = 0
    main_gpu: int = 0
    flash_attention: bool | None = None
    use_mmap: bool = True
    repack: bool = True
    # remote devices: "host:port" of `pyggml rpc-server`s (a list, or one comma-separated string); the
    # layers are split over [local CPU, remote devices...] in proportion to their free memory, or to
    # ``tensor_split`` (one non-negative number per device, in that order)
    rpc: Sequence[str] | str = ()
    tensor_split: Sequence[float] | None = None
    # how long the CPU threadpool's idle workers spin waiting for the next graph before they sleep:
    # 0 (sleep at once) to 100 (ggml's own default is 50, ~100 ms of spinning). 1 (~2 ms) bridges the
    # gap between two decode steps, as fast as 50 on a quiet machine, and gives a core back soon
    # enough that a machine with other busy processes degrades no worse than llama.cpp (docs/server.md,
    # "Threads under contention")
    poll: int = 1
    # compute with fewer than n_threads threads while other processes keep cores busy (``FreeCores``);
    # False: always n_threads (a benchmark pins its configuration)
    adapt_threads: bool = True

    def validate(self) -> None:
        self.rpc = _rpc.normalize_endpoints(self.rpc)
        if self.tensor_split is not None:
            split = self.tensor_split
            if isinstance(split, str):
                split = [s for s in split.split(",") if s.strip()]
            try:
                split = [float(x) for x in split]
            except (TypeError, ValueError):
                raise ValueError(f"tensor_split must be numbers, got {self.tensor_split!r}") from None
            if not split or any(not x >= 0 or x == float("inf") for x in split) or sum(split) <= 0:
                raise ValueError(f"tensor_split must be non-negative numbers with a positive sum, got {split}")
            self.tensor_split = split
        if not isinstance(self.poll, int) or isinstance(self.poll, bool) or not 0 <= self.poll <= 100:
            raise ValueError(f"poll must be an integer from 0 to 100, got {self.poll!r}")
        if not isinstance(self.adapt_threads, bool):
            raise ValueError(f"adapt_threads must be True or False, got {self.adapt_threads!r}")
        if self.n_threads is not None and (not isinstance(self.n_threads, int) or self.n_threads < 1):
            raise ValueError(f"n_threads must be a positive integer, got {self.n_threads!r}")
        if self.n_threads is not None and self.n_threads > max_threads():
            raise ValueError(f"n_threads={self.n_threads} is more than {max_threads()} (4 per logical CPU, of "
                             f"which this machine has {os.cpu_count()}); more threads than cores only wait on each "
                             "other")
        g = self.gpu_layers
        if isinstance(g, str):
            if g != "all":
                raise ValueError(f'gpu_layers must be a count, "all" or a list of layers, got {g!r}')
        elif isinstance(g, int):
            if g < 0:
                raise ValueError(f"gpu_layers must be >= 0, got {g}")
        elif not all(isinstance(x, int) and x >= 0 for x in g):
            raise ValueError(f"gpu_layers list must hold layer indices, got {g!r}")


ProgressFn = Callable[[int, int], None]

_READ_BY_ROWS = re.compile(r"(?:^|\.)(?:\w*_embd|token_types)\.weight$")
# stacked experts (GGUF ffn_*_exps), read only by mulmat_id; other 3-d weights (MLA's attn_k_b) go
# through batched mulmat, which the repacked layout has no kernel for
_EXPERTS = re.compile(r"_exps\.weight$")
_LAYER_RE = re.compile(r"^(?:blk|layers|enc\.blk|dec\.blk|v\.blk)\.(\d+)\.")
_MAX_GPUS = 16
# a graph's tensors: a large model's decode graph has ~10**4; ggml's scheduler mallocs ~20 KB per graph slot
MAX_GRAPH_NODES = 1 << 18


def _pad(n: int, align: int) -> int:
    return (n + align - 1) // align * align


@dataclass
class _Memory:
    weights: int = 0
    cache: int = 0


@dataclass
class _Storage:
    """A persistent allocation (weights or cache): its ggml context and buffers."""

    ctx: Any = None
    buffers: list[Any] = field(default_factory=list)


class Backend:
    """Devices, the scheduler, and (for a loaded model) the weights of a GGUF file."""

    def __init__(self, params: BackendParams | None = None):
        params = params or BackendParams()
        params.validate()
        self.params = params
        self.n_threads = params.n_threads or physical_cores()
        self.config = Config({})
        self.path: Path | None = None
        self._lock = threading.RLock()
        self._epoch = 0
        self._closed = False
        self._weights: dict[str, Tensor] = {}
        self._weight_ptrs: set[Any] = set()  # their tensor pointers (graph ops must not write into them)
        self._repacked: set[str] = set()
        self._repacked_ptrs: set[Any] = set()  # the same weights by tensor pointer (a cheap check per op)
        self._storages: list[_Storage] = []
        # where this backend's tensor headers live, for the checked C ops (csrc/pyggml_ops.h)
        self._pools = ffi.new("struct pyg_pools *")
        self._pool_arrays: list[Any] = []  # every array the C side was given: a graph builder may still read one
        self._memory: dict[str, _Memory] = {}
        self._gguf = NULL
        self._meta_ctx = NULL
        self._mmap: mmap.mmap | None = None
        self._mmap_view: Any = None
        self._threadpool = NULL
        self._free_cores: FreeCores | None = None
        self._sched = NULL
        self._sched_size = 0
        self._allocated: tuple[int, int] | None = None  # (graph serial, node count) the scheduler holds
        self._split_graphs: weakref.WeakSet[_GraphState] = weakref.WeakSet()  # graphs with a scheduler of their own
        self._sched_pool: list[tuple[int, Any]] = []  # (graph size, scheduler) given back by closed graphs
        self._pool_lock = threading.RLock()  # guards the two above (reentrant: a graph's __del__ may run inside)
        self._backends: list[Any] = []
        self._gpus: list[Any] = []
        self._remotes: list[Any] = []  # RPC backends, one per remote device
        self._remote_devs: list[Any] = []
        self._relays: list[_rpc.Relay] = []
        self._rpc_failure: str | None = None
        self._layer_map: list[int] | None = None
        try:
            self._init_devices()
        except BaseException:
            self.close()  # e.g. the second RPC server is unreachable: let the first one go
            raise

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def cpu(cls, n_threads: int | None = None) -> Backend:
        """A CPU backend with no weights, for scratch computation."""
        return cls(BackendParams(n_threads=n_threads))

    @classmethod
    def load(cls, path: str | os.PathLike, params: BackendParams | None = None,
             progress: ProgressFn | None = None) -> Backend:
        """Read a GGUF file's metadata and put its weights on the devices ``params`` asks for.

        On CPU the file is memory-mapped and wrapped without copying (quantized weights that the
        CPU kernels repack are copied). ``progress(done_bytes, total_bytes)`` is called as weights load.
        """
        backend = cls(params)
        try:
            backend._load(Path(path), progress)
        except BaseException:
            backend.close()
            raise
        return backend

    def _init_devices(self) -> None:
        gpus, cpu_dev = [], NULL
        rpc_reg = lib.ggml_backend_rpc_reg()
        for i in range(lib.ggml_backend_dev_count()):
            dev = lib.ggml_backend_dev_get(i)
            kind = lib.ggml_backend_dev_type(dev)
            if rpc_reg != NULL and lib.ggml_backend_dev_backend_reg(dev) == rpc_reg:
                continue  # a remote device: used only when params.rpc names its server
            if kind == lib.GGML_BACKEND_DEVICE_TYPE_CPU:
                cpu_dev = dev
            elif kind in (lib.GGML_BACKEND_DEVICE_TYPE_GPU, lib.GGML_BACKEND_DEVICE_TYPE_IGPU):
                gpus.append(dev)
        if cpu_dev == NULL:
            raise GGMLError("ggml has no CPU device")
        self._cpu_dev = cpu_dev
        self._gpu_devs = gpus
        self._cpu = lib.ggml_backend_dev_init(cpu_dev, NULL)
        if self._cpu == NULL:
            raise GGMLError(with_ggml_log("could not start the CPU backend"))
        self._backends = [self._cpu]
        tp_params = lib.ggml_threadpool_params_default(self.n_threads)
        tp_params.poll = self.params.poll
        self._threadpool = lib.ggml_threadpool_new(ffi.new("struct ggml_threadpool_params *", tp_params))
        lib.ggml_backend_cpu_set_n_threads(self._cpu, self.n_threads)
        self._threads_now = self.n_threads
        self._free_cores = FreeCores(self.n_threads) if self.params.adapt_threads and self.n_threads > 1 else None
        if self._threadpool != NULL:
            lib.ggml_backend_cpu_set_threadpool(self._cpu, self._threadpool)
        wanted = self.params.gpu_layers
        # gpu_layers on a build without a GPU backend: say so (it would otherwise silently run on the CPU)
        self.cpu_fallback = None if self._gpu_devs or wanted in (0, [], ()) else (
            f"gpu_layers={wanted!r} asked for, but this pyggml build has no GPU backend (build it with "
            'CMAKE_ARGS="-DGGML_CUDA=on", docs/gpu.md): every layer runs on the CPU')
        if self.cpu_fallback:
            logging.getLogger(__name__).warning(self.cpu_fallback)
        if self._gpu_devs and wanted not in (0, [], ()):
            for dev in self._gpu_devs:
                be = lib.ggml_backend_dev_init(dev, NULL)
                if be == NULL:
                    raise GGMLError(with_ggml_log(f"could not start {device_info(dev).name}"))
                self._gpus.append(be)
                self._backends = [*self._gpus, self._cpu]
        if self.params.rpc:
            if self._gpus:
                raise ValueError("gpu_layers together with rpc is not supported yet: use one or the other")
            for endpoint in self.params.rpc:
                for dev in add_rpc_server(endpoint):
                    be = lib.ggml_backend_dev_init(dev, NULL)
                    if be == NULL:
                        raise RPCError(with_ggml_log(f"could not start a backend on rpc server {endpoint}"))
                    self._remotes.append(be)
                    self._remote_devs.append(dev)
                    self._backends = [*self._gpus, *self._remotes, self._cpu]  # close() frees what exists
                self._relays.append(rpc_relay(self._remote_devs[-1])[1])
            self._check_remotes()
        # the scheduler wants the CPU last
        self._backends = [*self._gpus, *self._remotes, self._cpu]
        if len(self._backends) > 16:  # GGML_SCHED_MAX_BACKENDS: ggml aborts past it
            raise ValueError(f"{len(self._backends)} devices (with the RPC servers' devices): ggml's scheduler "
                             "takes at most 16; name fewer servers")
        # Only CPU_REPACK: weights in the AMX buffer type crashed in compute on these (virtualised)
        # Xeons, and repacking gives the AVX-512 kernels most of the speed-up anyway.
        extra = ffi.new("ggml_backend_buffer_type_t[]", 8)
        n_extra = lib.pyggml_dev_extra_bufts(cpu_dev, extra, 8)
        self._repack_bufts = [extra[i] for i in range(n_extra)
                              if ffi.string(lib.ggml_backend_buft_name(extra[i])) == b"CPU_REPACK"]
        self._new_sched(self._graph_size(8192))

    def _new_sched(self, size: int) -> None:
        if self._sched != NULL:
            lib.ggml_backend_sched_free(self._sched)
        backends = ffi.new("ggml_backend_t[]", self._backends)
        bufts = ffi.new("ggml_backend_buffer_type_t[]",
                        [lib.ggml_backend_get_default_buffer_type(b) for b in self._backends])
        _check_sched_memory(size)
        self._sched = lib.ggml_backend_sched_new(backends, bufts, len(self._backends), size, False,
                                                 bool(self._gpus))
        if self._sched == NULL:
            raise GGMLError(with_ggml_log("could not create the backend scheduler"))
        self._sched_size = size
        self._allocated = None

    # ---- loading --------------------------------------------------------------------------
    def _load(self, path: Path, progress: ProgressFn | None) -> None:
        self.path = path
        if not path.exists():
            raise FileNotFoundError(f"no such model file: {path}")
        if not path.is_file():
            raise GGUFError(f"{path} is not a file")
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            header = f.read(8)
        if header[:4] != b"GGUF":
            raise GGUFError(f"{path} is not a GGUF file (it starts with {header[:4]!r}, not b'GGUF')")
        if len(header) < 8:
            raise GGUFError(f"{path} is truncated: {len(header)} bytes, too short for a GGUF header")
        version = int.from_bytes(header[4:8], "little")
        if version == 1:
            raise GGUFError(f"{path} is GGUF version 1, which is no longer supported: convert it again")
        if version not in (2, 3):
            raise GGUFError(f"{path} has unsupported GGUF version {version}")

        meta_ctx = ffi.new("struct ggml_context **")
        gguf = lib.gguf_init_from_file(str(path).encode(), {"no_alloc": True, "ctx": meta_ctx})
        if gguf == NULL:
            raise refused_gguf(path)
        self._gguf, self._meta_ctx = gguf, meta_ctx[0]
        self.config = Config(read_metadata(gguf))
        self._check_tensors(path, file_size)
        self._check_layer_count(path)
        self._place_weights(path, file_size, progress)

    def _check_tensors(self, path: Path, file_size: int) -> None:
        """gguf.h does not check the data section against the file: do it before touching data. (A row
        length that is not a multiple of the type's block size and a misaligned offset are refused by
        gguf_init_from_file itself, so they are not checked again here.)"""
        gguf = self._gguf
        data_offset = lib.gguf_get_data_offset(gguf)
        known = {int(d) for d in DType}
        for i in range(lib.gguf_get_n_tensors(gguf)):
            name = ffi.string(lib.gguf_get_tensor_name(gguf, i)).decode("utf-8", "replace")
            kind = lib.gguf_get_tensor_type(gguf, i)
            if kind not in known or DType(kind).type_size == 0:
                raise GGUFError(f"{path}: tensor {name!r} has unsupported type {kind}")
            if kind in _INTERMEDIATE:
                raise GGUFError(f"{path}: tensor {name!r} is stored as {DType(kind).name}, an intermediate type of "
                                "ggml's matrix kernels that no op can read; quantize the model to another type")
            offset = lib.gguf_get_tensor_offset(gguf, i)
            size = lib.gguf_get_tensor_size(gguf, i)
            t = lib.ggml_get_tensor(self._meta_ctx, name.encode())
            if t == NULL:
                raise GGUFError(f"{path}: tensor {name!r} is listed but has no metadata")
            if data_offset + offset + size > file_size:
                raise GGUFError(f"{path} is truncated: tensor {name!r} needs bytes up to "
                                f"{data_offset + offset + size}, the file has {file_size}")

    def _check_layer_count(self, path: Path) -> None:
        """A layer count of any part (``block_count``, ``clip.vision.block_count``, ...) larger than the file's
        tensor count (every layer has weights) is refused before anything builds per-layer structures for it
        (10**6 text layers took minutes to fail, 2**31 vision layers forever)."""
        n = lib.gguf_get_n_tensors(self._gguf)
        for key, count in self.config.items():
            if key.endswith("block_count") and isinstance(count, int) and n and count > n:
                raise GGUFError(f"{path}: metadata {key!r} = {count}, but the file has only {n} tensors "
                                "(every layer has weights)")

    def _layer_backend(self, name: str) -> int:
        """Index into self._backends for a weight, by its layer and params.gpu_layers (or rpc)."""
        if self._remotes:
            match = _LAYER_RE.match(name)
            layers = self._split_layers()
            if match and int(match.group(1)) < len(layers):
                return layers[int(match.group(1))]
            return len(self._backends) - 1  # embeddings, output and anything else stay local
        if not self._gpus:
            return len(self._backends) - 1
        n_layers = self.config.uint("block_count", 0) or 0
        wanted = self.params.gpu_layers
        match = _LAYER_RE.match(name)
        if wanted == "all":
            on_gpu = True
        elif isinstance(wanted, int):
            first = n_layers - wanted
            on_gpu = (int(match.group(1)) >= first) if match else (wanted > n_layers and not
                                                                   name.startswith("token_embd"))
        else:
            on_gpu = bool(match) and int(match.group(1)) in set(wanted)
        if not on_gpu:
            return len(self._backends) - 1
        return min(self.params.main_gpu, len(self._gpus) - 1)

    def _split_layers(self) -> list[int]:
        """Backend index of each layer when split over [local CPU, remote devices...]: contiguous ranges
        in that order, sized in proportion to tensor_split or to each device's free memory (the rule of
        llama.cpp's --tensor-split). The output layer stays on the CPU: logits are needed here, and the
        hidden state that crosses instead is far smaller than the vocabulary."""
        if self._layer_map is not None:
            return self._layer_map
        n_layers = self.config.uint("block_count", 0) or 0
        cpu_index = len(self._backends) - 1
        indices = [cpu_index, *range(len(self._gpus), len(self._gpus) + len(self._remotes))]
        split = self.params.tensor_split
        if split is None:
            split = [device_memory(self._cpu_dev)[0]] + [device_memory(d)[0] for d in self._remote_devs]
            self._check_remotes()
            if sum(split) <= 0:
                split = [1.0] * len(indices)
        elif len(split) != len(indices):
            raise ValueError(f"tensor_split has {len(split)} values; this model runs on {len(indices)} devices "
                             f"(the local CPU and {len(indices) - 1} remote): give one value per device")
        total = float(sum(split))
        bounds, acc = [], 0.0
        for x in split:
            acc += x / total
            bounds.append(acc)
        layers = []
        for i in range(n_layers):
            position = i / n_layers
            j = sum(1 for b in bounds if b <= position)  # upper_bound, as llama.cpp
            layers.append(indices[min(j, len(indices) - 1)])
        if n_layers:
            self._layer_map = layers
        return layers

    def placement(self) -> dict[str, list[int]]:
        """Which layers compute on which device: device label -> layer indices (embeddings and the
        output layer are on the CPU)."""
        n_layers = self.config.uint("block_count", 0) or 0
        out: dict[str, list[int]] = {}
        for i in range(n_layers):
            be = self._backends[self._layer_backend(f"blk.{i}.")]
            dev = lib.ggml_backend_get_device(be)
            label = ffi.string(lib.ggml_backend_dev_name(dev)).decode()
            remote = rpc_relay(dev)
            if remote is not None:
                label = f"{label} ({remote[0]})"
            out.setdefault(label, []).append(i)
        return out

    def rpc_traffic(self) -> tuple[int, int]:
        """(bytes sent, bytes received) to and from this backend's RPC servers so far, all processes'
        models on them included (0, 0 without RPC)."""
        sent = sum(r.sent for r in self._relays)
        return sent, sum(r.received for r in self._relays)

    def _check_remotes(self) -> None:
        """Raise RPCError if a remote server of this backend was lost (the backend is then unusable)."""
        if self._rpc_failure is None:
            for relay in self._relays:
                if relay.error is not None:
                    self._rpc_failure = f"rpc server {relay.endpoint}: {relay.error}"
                    break
        if self._rpc_failure is not None:
            raise RPCError(f"{self._rpc_failure}; the model's layers there are lost: close it and load again")

    def _repack_buft(self, t: Any, any_name: bool = False) -> Any:
        """The CPU extra buffer type whose kernels can use this weight, or NULL."""
        # embedding tables (token_embd, position_embd, token_types, ...) are read with get_rows (no kernel for
        # repacked data); a tied output gets a copy through matmul_weight instead
        name = ffi.string(t.name).decode()
        if not self.params.repack or (_READ_BY_ROWS.search(name) and not any_name) \
                or (t.ne[2] != 1 and not _EXPERTS.search(name)) or t.ne[3] != 1 or not lib.ggml_is_quantized(t.type):
            return NULL
        for buft in self._repack_bufts:
            if self._probe_mulmat(t, buft):
                return buft
        return NULL

    def _probe_mulmat(self, weight: Any, buft: Any) -> bool:
        """Whether the CPU computes ``weight``'s product (mulmat, or mulmat_id for a 3-D stack of
        experts) with the weight in ``buft``."""
        probe_ctx = lib.ggml_init({"mem_size": 5 * lib.ggml_tensor_overhead(), "mem_buffer": NULL,
                                   "no_alloc": True})
        buf = lib.ggml_backend_buft_alloc_buffer(buft, 0)
        try:
            w = lib.ggml_dup_tensor(probe_ctx, weight)
            w.buffer = buf
            if weight.ne[2] == 1:
                x = lib.ggml_new_tensor_2d(probe_ctx, lib.GGML_TYPE_F32, weight.ne[0], 8)
                op = lib.ggml_mul_mat(probe_ctx, w, x)
            else:
                x = lib.ggml_new_tensor_3d(probe_ctx, lib.GGML_TYPE_F32, weight.ne[0], 1, 8)
                ids = lib.ggml_new_tensor_2d(probe_ctx, lib.GGML_TYPE_I32, 1, 8)
                op = lib.ggml_mul_mat_id(probe_ctx, w, x, ids)
            return bool(lib.ggml_backend_dev_supports_op(self._cpu_dev, op))
        finally:
            if buf != NULL:
                lib.ggml_backend_buffer_free(buf)
            lib.ggml_free(probe_ctx)

    def _place_weights(self, path: Path, file_size: int, progress: ProgressFn | None) -> None:
        gguf = self._gguf
        data_offset = lib.gguf_get_data_offset(gguf)
        cpu_index = len(self._backends) - 1
        groups: dict[Any, list[tuple[Any, int, int]]] = {}  # buffer type -> [(tensor, file offset, size)]
        zero_copy: list[tuple[Any, int, int]] = []
        total = 0
        for i in range(lib.gguf_get_n_tensors(gguf)):
            name = lib.gguf_get_tensor_name(gguf, i)
            t = lib.ggml_get_tensor(self._meta_ctx, name)
            entry = (t, data_offset + lib.gguf_get_tensor_offset(gguf, i), lib.gguf_get_tensor_size(gguf, i))
            total += entry[2]
            index = self._layer_backend(ffi.string(name).decode())
            repack = self._repack_buft(t) if index == cpu_index else NULL
            if repack != NULL:
                groups.setdefault(repack, []).append(entry)
                self._repacked.add(ffi.string(name).decode())
                self._repacked_ptrs.add(t)
            elif index == cpu_index and self.params.use_mmap:
                zero_copy.append(entry)
            else:
                buft = lib.ggml_backend_get_default_buffer_type(self._backends[index])
                groups.setdefault(buft, []).append(entry)

        storage = self._add_storage(self._meta_ctx, writable=False)
        done = 0
        if zero_copy or groups:
            self._mmap_file(path, file_size)
        if zero_copy:
            base = ffi.cast("char *", self._mmap_view)
            buf = lib.ggml_backend_dev_buffer_from_host_ptr(self._cpu_dev, base, file_size,
                                                            max(size for _, _, size in zero_copy))
            if buf == NULL:
                raise GGMLError(with_ggml_log("could not wrap the mapped model file in a CPU buffer"))
            lib.ggml_backend_buffer_set_usage(buf, lib.GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
            storage.buffers.append(buf)
            for t, offset, size in zero_copy:
                self._check_status(lib.ggml_backend_tensor_alloc(buf, t, base + offset), "map a weight")
                done += size
            self._account(self._cpu_dev, weights=sum(size for _, _, size in zero_copy))
            if progress:
                progress(done, total)
        for buft, entries in groups.items():
            buf = self._alloc_tensors(buft, [t for t, _, _ in entries], "weights")
            storage.buffers.append(buf)
            lib.ggml_backend_buffer_set_usage(buf, lib.GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
            base = ffi.cast("char *", self._mmap_view)
            for t, offset, size in entries:
                lib.ggml_backend_tensor_set(t, base + offset, 0, size)  # repacks on the way for CPU_REPACK
                # the copied range of the mapping is not needed in RAM any more: drop it right away so
                # the peak stays near one copy of the weights
                self._release_pages(offset, size)
                done += size
                if progress:
                    progress(done, total)
        for i in range(lib.gguf_get_n_tensors(gguf)):
            name = ffi.string(lib.gguf_get_tensor_name(gguf, i)).decode("utf-8", "replace")
            t = lib.ggml_get_tensor(self._meta_ctx, name.encode())
            self._weights[name] = Tensor(t, None, max(1, lib.ggml_n_dims(t)), self)
            self._weight_ptrs.add(t)
        self._check_remotes()  # an upload to a server that went away was answered by its relay
        self._new_sched(self._graph_size(self.max_graph_nodes))
        if not zero_copy and self._mmap is not None:
            self._unmap()
        if progress and total == 0:
            progress(0, 0)

    def _mmap_file(self, path: Path, file_size: int) -> None:
        if file_size == 0:
            raise GGUFError(f"{path} is empty")
        with open(path, "rb") as f:
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if hasattr(self._mmap, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
            self._mmap.madvise(mmap.MADV_WILLNEED)
        self._mmap_view = ffi.from_buffer(self._mmap)

    def _release_pages(self, offset: int, size: int) -> None:
        if self._mmap is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = mmap.PAGESIZE
        start = _pad(offset, page)
        end = (offset + size) // page * page
        if end > start:
            self._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)

    def _unmap(self) -> None:
        if self._mmap_view is not None:
            ffi.release(self._mmap_view)
            self._mmap_view = None
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None

    def _alloc_tensors(self, buft: Any, tensors: list[Any], purpose: str) -> Any:
        align = lib.ggml_backend_buft_get_alignment(buft)
        offsets, size = [], 0
        for t in tensors:
            size = _pad(size, align)
            offsets.append(size)
            size += lib.ggml_backend_buft_get_alloc_size(buft, t)
        buf = lib.ggml_backend_buft_alloc_buffer(buft, max(size, 1))
        if buf == NULL:
            self._check_remotes()  # a remote server that answered wrongly is an RPCError, not lack of memory
            name = ffi.string(lib.ggml_backend_buft_name(buft)).decode()
            raise MemoryError(with_ggml_log(f"could not allocate {size / 2**20:.1f} MiB of {purpose} on {name}"))
        base = ffi.cast("char *", lib.ggml_backend_buffer_get_base(buf))
        for t, off in zip(tensors, offsets, strict=True):
            self._check_status(lib.ggml_backend_tensor_alloc(buf, t, base + off), f"place {purpose}")
        dev = self._cpu_dev
        for b in self._backends:
            if lib.ggml_backend_get_default_buffer_type(b) == buft:
                dev = lib.ggml_backend_get_device(b)
        self._account(dev, **{purpose: size})
        return buf

    def _account(self, dev: Any, weights: int = 0, cache: int = 0) -> None:
        entry = self._memory.setdefault(ffi.string(lib.ggml_backend_dev_name(dev)).decode(), _Memory())
        entry.weights += weights
        entry.cache += cache

    @staticmethod
    def _check_status(status: int, what: str) -> None:
        if status != lib.GGML_STATUS_SUCCESS:
            reason = ffi.string(lib.ggml_status_to_string(status)).decode()
            raise GGMLError(with_ggml_log(f"could not {what}: {reason}"))

    # ---- public API -------------------------------------------------------------------------
    @property
    def has_gpu(self) -> bool:
        """Whether a GPU (or other accelerator) device computes some of the layers."""
        return bool(self._gpus)

    @property
    def flash_attention(self) -> bool:
        """Whether models should use ggml's fused flash attention."""
        fa = self.params.flash_attention
        return bool(self._gpus) if fa is None else fa

    @property
    def max_graph_nodes(self) -> int:
        return min(MAX_GRAPH_NODES, max(8192, 5 * len(self._weights)))

    def _graph_size(self, max_nodes: int) -> int:
        """Graph slots for ``max_nodes`` of our tensors plus the weights and caches read as leafs."""
        return max_nodes + len(self._weights) + 512

    def tensors(self) -> dict[str, Tensor]:
        """All weights by GGUF name."""
        return dict(self._weights)

    def get(self, name: str) -> Tensor | None:
        """A weight by GGUF tensor name, or None."""
        return self._weights.get(name)

    def memory(self) -> dict[str, dict[str, int]]:
        """Bytes per device: weights, cache, and graph (the scheduler's compute buffers)."""
        out = {name: {"weights": m.weights, "cache": m.cache, "graph": 0} for name, m in self._memory.items()}
        with self._pool_lock:
            scheds = [self._sched, *(state.sched for state in list(self._split_graphs) if state.sched is not None),
                      *(sched for _, sched in self._sched_pool)]
            for be in self._backends:
                name = ffi.string(lib.ggml_backend_dev_name(lib.ggml_backend_get_device(be))).decode()
                entry = out.setdefault(name, {"weights": 0, "cache": 0, "graph": 0})
                entry["graph"] += sum(int(lib.ggml_backend_sched_get_buffer_size(sched, be)) for sched in scheds)
        return out

    def new_context(self, max_nodes: int | None = None) -> Context:
        """A context for building and computing one graph of at most ``max_nodes`` tensors
        (1..MAX_GRAPH_NODES; None or 0: ``max_graph_nodes``)."""
        self._check_open()
        return Context(self, max_nodes or self.max_graph_nodes)

    def alloc_persistent(self, dtype: DType | str, shape: Sequence[int], *, layer: int | None = None,
                         name: str = "", purpose: str = "cache") -> Tensor:
        """A tensor that outlives graphs (e.g. a KV cache), on the device of ``layer``."""
        self._check_open()
        dtype = DType.parse(dtype)
        shape = tuple(int(s) for s in shape)
        if not 1 <= len(shape) <= 4 or any(s <= 0 for s in shape) or shape[0] % dtype.block_size:
            raise ValueError(f"alloc_persistent: bad shape {shape} for {dtype.name}")
        _check_size("alloc_persistent", dtype, shape)
        ctx = lib.ggml_init({"mem_size": 2 * lib.ggml_tensor_overhead(), "mem_buffer": NULL, "no_alloc": True})
        ne = ffi.new("int64_t[4]", shape + (1,) * (4 - len(shape)))
        t = lib.ggml_new_tensor(ctx, dtype, len(shape), ne)
        if name:
            lib.ggml_set_name(t, name.encode()[:63])
        index = len(self._backends) - 1
        if layer is not None:
            index = self._layer_backend(f"blk.{layer}.")
        buft = lib.ggml_backend_get_default_buffer_type(self._backends[index])
        storage = self._add_storage(ctx, writable=True)
        storage.buffers.append(self._alloc_tensors(buft, [t], purpose))
        lib.ggml_backend_buffer_clear(storage.buffers[-1], 0)
        if self._relays:
            self._check_remotes()
        return Tensor(t, None, len(shape), self)

    def matmul_weight(self, weight: Tensor) -> Tensor:
        """``weight`` for use only as the left operand of ``mulmat``: a copy in the CPU's repacked
        layout when that is faster and the original must stay plain (tied output embeddings share
        token_embd, which get_rows reads), else ``weight`` itself. Costs the copy's RAM."""
        self._check_open()
        p = weight._p
        if weight.ctx is not None or weight._keep is not self or p.buffer == NULL \
                or not lib.ggml_backend_buffer_is_host(p.buffer) or p.data == NULL:
            return weight
        name = ffi.string(p.name).decode()
        if name in self._repacked:
            return weight
        buft = self._repack_buft(p, any_name=True)
        if buft == NULL:
            return weight
        ctx = lib.ggml_init({"mem_size": 2 * lib.ggml_tensor_overhead(), "mem_buffer": NULL, "no_alloc": True})
        copy = lib.ggml_dup_tensor(ctx, p)
        copy_name = f"{name[:40]}.mulmat"
        lib.ggml_set_name(copy, copy_name.encode())
        storage = self._add_storage(ctx, writable=False)
        storage.buffers.append(self._alloc_tensors(buft, [copy], "weights"))
        lib.ggml_backend_tensor_set(copy, p.data, 0, lib.ggml_nbytes(p))  # repacks on the way
        self._repacked.add(copy_name)
        self._repacked_ptrs.add(copy)
        return Tensor(copy, None, weight.ndim, self)

    def supports_op(self, tensor: Tensor) -> bool:
        """Whether some device of this backend can compute ``tensor``'s op."""
        return any(lib.ggml_backend_supports_op(b, tensor._p) for b in self._backends)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("backend is closed")

    def _add_storage(self, ctx: Any, *, writable: bool) -> _Storage:
        """Keep a ggml context of weights (read-only) or caches (``writable``) and tell the checked C
        ops that its tensors belong to this backend."""
        storage = _Storage(ctx=ctx)
        self._storages.append(storage)
        pools, n = self._pools, self._pools.n
        if not self._pool_arrays or n == len(self._pool_arrays[-1]):
            grown = ffi.new("struct pyg_pool[]", max(16, 2 * n))
            if n:
                ffi.memmove(grown, pools.pool, n * ffi.sizeof("struct pyg_pool"))
            self._pool_arrays.append(grown)
            pools.pool = grown
        lib.pyg_pool_init(pools.pool + n, ctx, writable)
        pools.n = n + 1  # after the entry is written: a graph being built on another thread may be reading
        return storage

    def close(self) -> None:
        """Free the weights, caches, scheduler and threads. Tensors of this backend become invalid."""
        if self._closed:
            return
        self._closed = True
        self._pools.closed = 1  # the checked C ops refuse this backend's tensors from now on
        self._weights.clear()
        with self._lock, self._pool_lock:
            for state in list(self._split_graphs):
                if state.sched is not None:
                    lib.ggml_backend_sched_free(state.sched)
                    state.sched = None
            self._split_graphs.clear()
            for _, sched in self._sched_pool:
                lib.ggml_backend_sched_free(sched)
            self._sched_pool.clear()
        if self._sched != NULL:
            lib.ggml_backend_sched_free(self._sched)
            self._sched = NULL
        for storage in self._storages:
            for buf in storage.buffers:
                lib.ggml_backend_buffer_free(buf)
            storage.buffers.clear()
        # the tensor headers (storage.ctx) stay until this object goes: weights keep it alive, and a
        # stale weight's shape or repr reads them; its ops and reads refuse the closed backend
        if self._gguf != NULL:
            lib.gguf_free(self._gguf)
            self._gguf = NULL
        self._unmap()
        for be in self._backends:
            lib.ggml_backend_free(be)
        self._backends = []
        if self._threadpool != NULL:
            lib.ggml_threadpool_free(self._threadpool)
            self._threadpool = NULL

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
            ctxs = [storage.ctx for storage in self._storages if storage.ctx not in (None, NULL)]
            if self._meta_ctx != NULL and self._meta_ctx not in ctxs:
                ctxs.append(self._meta_ctx)  # a load that failed before placing the weights
            for c in ctxs:
                lib.ggml_free(c)
            self._storages.clear()
            self._meta_ctx = NULL
        except Exception:
            pass

    # ---- computing (used by Context) ----------------------------------------------------------
    def _compute(self, state: _GraphState, reserve_only: bool = False,
                 on_start: Callable[[], None] | None = None) -> None:
        with self._lock:
            self._check_open()
            if self._relays:
                self._check_remotes()
            if len(self._backends) > 1:
                return self._compute_split(state, reserve_only, on_start)
            if state.graph_size > self._sched_size:
                self._new_sched(state.graph_size)
            sched = self._sched
            # the same graph as the last compute, unchanged: the scheduler still holds its split and
            # its buffers, so only the inputs need writing (as llama.cpp does when it reuses a graph)
            allocated = (state.serial, lib.ggml_graph_n_nodes(state.graph))
            reuse = not reserve_only and not state.leaf_outputs and self._allocated == allocated
            self._allocated = None
            if not reuse:
                lib.pyggml_forget_compute_placement(state.ptr)  # its old places may have moved since
                lib.ggml_backend_sched_reset(sched)
                for ptr, index in state.placements:
                    lib.ggml_backend_sched_set_tensor_backend(sched, ptr, self._backends[index])
            if reserve_only:
                if not lib.ggml_backend_sched_reserve(sched, state.graph):
                    raise MemoryError(with_ggml_log("could not reserve memory for the graph"))
                return
            self._check_indices(state)
            if not reuse:
                # a fresh plan for this graph: ggml's allocator would otherwise keep the last graph's plan
                # whenever node and leaf counts match and sizes fit, with that graph's in-place and
                # liveness choices (an argsort written over its own input, say); it also sizes leaves
                # read back as outputs, which reusing a plan does not check
                if not lib.ggml_backend_sched_reserve(sched, state.graph):
                    raise MemoryError(with_ggml_log("could not reserve memory for the graph"))
                if not lib.ggml_backend_sched_alloc_graph(sched, state.graph):
                    raise MemoryError(with_ggml_log("could not allocate the graph's compute buffers"))
            self._run(state, sched, on_start)
            self._allocated = allocated

    def _compute_split(self, state: _GraphState, reserve_only: bool, on_start: Callable[[], None] | None) -> None:
        """Compute a graph over several devices (GPUs, RPC servers and the CPU) with a scheduler of its own.

        ggml's scheduler splits a graph by rewiring it (a source on another device is replaced by a copy
        that lives in the scheduler) and leaves the allocator's places in its tensors: it cannot split the
        same graph a second time, after another graph used the scheduler. So each graph keeps its own
        scheduler, splits once, and every later compute only rewrites the inputs (the reuse of one graph
        that llama.cpp also relies on). A reservation uses a throwaway scheduler and undoes its rewiring."""
        n_nodes = lib.ggml_graph_n_nodes(state.graph)
        if state.split_nodes and state.split_nodes != n_nodes:
            raise ValueError("this graph is split over several devices and cannot grow after its first compute: "
                             "build the new tensors in a new context")
        if reserve_only:
            if state.split_nodes:
                return  # its scheduler already holds the memory
            sched = self._make_sched(state.graph_size)
            try:
                _unsplit_graph(state)  # remember the graph as built
                self._place(state, sched)
                reserved = lib.ggml_backend_sched_reserve(sched, state.graph)
            finally:
                lib.ggml_backend_sched_free(sched)
                _unsplit_graph(state)  # the copies were the scheduler's
            if self._relays:
                self._check_remotes()
            if not reserved:
                raise MemoryError(with_ggml_log("could not reserve memory for the graph"))
            return
        self._check_indices(state)
        if not state.split_nodes:
            if state.sched is None:
                state.sched = self._take_sched(state.graph_size)
                state.owner = self
                with self._pool_lock:
                    self._split_graphs.add(state)
            # a scheduler from the pool still holds its last graph's allocation plan, which ggml reuses
            # for any graph with the same counts (see _compute): plan this one first
            self._place_pinned(state)
            reserved = lib.ggml_backend_sched_reserve(state.sched, state.graph)
            self._place_pinned(state)  # undo the reservation's rewiring: alloc_graph splits again
            if not reserved or not lib.ggml_backend_sched_alloc_graph(state.sched, state.graph):
                if self._relays:
                    self._check_remotes()
                raise MemoryError(with_ggml_log("could not allocate the graph's compute buffers"))
            state.split_nodes = n_nodes
        self._run(state, state.sched, on_start)

    def _place_pinned(self, state: _GraphState) -> None:
        """The graph as built, placed on ``state.sched`` (requested places, layer outputs pinned)."""
        _unsplit_graph(state)  # a reservation may have rewired it
        self._place(state, state.sched)
        backends = ffi.new("ggml_backend_t[]", self._backends)
        lib.pyggml_pin_layer_outputs(state.sched, state.graph, backends, len(self._backends))

    def _take_sched(self, size: int) -> Any:
        """A scheduler for a new graph: one that a closed graph gave back (its compute buffers are kept), or
        a new one."""
        with self._pool_lock:
            fits = [entry for entry in self._sched_pool if entry[0] >= size]
            if fits:
                entry = min(fits, key=lambda e: e[0])
                self._sched_pool.remove(entry)
                return entry[1]
        return self._make_sched(size)

    def _give_back_sched(self, state: _GraphState) -> None:
        """``state``'s graph is closed or gone and will not compute again: its scheduler can serve another.
        (Not under the compute lock: a graph may be closed while another computes.)"""
        with self._pool_lock:
            sched, state.sched = state.sched, None
            self._split_graphs.discard(state)
            if sched is None:
                return
            if self._closed:
                lib.ggml_backend_sched_free(sched)
                return
            self._sched_pool.append((state.graph_size, sched))
            while len(self._sched_pool) > 4:
                lib.ggml_backend_sched_free(self._sched_pool.pop(0)[1])

    def _make_sched(self, size: int) -> Any:
        backends = ffi.new("ggml_backend_t[]", self._backends)
        bufts = ffi.new("ggml_backend_buffer_type_t[]",
                        [lib.ggml_backend_get_default_buffer_type(b) for b in self._backends])
        _check_sched_memory(size)
        sched = lib.ggml_backend_sched_new(backends, bufts, len(self._backends), size, False, bool(self._gpus))
        if sched == NULL:
            raise GGMLError(with_ggml_log("could not create a backend scheduler"))
        return sched

    def _place(self, state: _GraphState, sched: Any) -> None:
        lib.ggml_backend_sched_reset(sched)
        for ptr, index in state.placements:
            lib.ggml_backend_sched_set_tensor_backend(sched, ptr, self._backends[index])

    @staticmethod
    def _check_indices(state: _GraphState) -> None:
        for indices, (bound, op) in state.index_checks.items():
            data = state.inputs.get(indices)
            if data is None and indices.flags & 1:  # GGML_TENSOR_FLAG_INPUT: made by ctx.empty, never set
                raise ValueError(f"{op}: the indices were never given data (call .set() before compute)")
            if data is None or not data.size:
                continue
            # one pass: a negative index seen as unsigned lies past every bound (ggml's indices are signed ints)
            unsigned = data.view(f"u{data.itemsize}") if data.dtype.kind == "i" else data
            if unsigned.max() >= bound:
                raise ValueError(f"{op}: index {int(data.max()) if data.max() >= bound else int(data.min())} "
                                 f"out of range 0..{bound - 1}")

    def _run(self, state: _GraphState, sched: Any, on_start: Callable[[], None] | None = None) -> None:
        """Write the inputs and compute the allocated graph (``on_start``: see ``Context.compute``)."""
        for ptr, data in state.inputs.items():
            if ptr.buffer != NULL and data.nbytes:
                lib.ggml_backend_tensor_set(ptr, ffi.from_buffer(data), 0, data.nbytes)
        if self._free_cores is not None and (threads := self._free_cores()) != self._threads_now:
            lib.ggml_backend_cpu_set_n_threads(self._cpu, threads)  # the threadpool's extra workers idle
            self._threads_now = threads
        if on_start is not None:
            on_start()
        status = lib.ggml_backend_sched_graph_compute(sched, state.graph)
        if self._relays:
            self._check_remotes()  # a lost server's relay answered with zeros: the results are garbage
        if status != lib.GGML_STATUS_SUCCESS:
            raise GGMLError(with_ggml_log(f"compute failed: {ffi.string(lib.ggml_status_to_string(status)).decode()}"))
        self._epoch += 1
        state.epoch = self._epoch


def _unsplit_graph(state: _GraphState) -> None:
    """Undo what splitting the graph over several backends did to it (see pyggml_graph_srcs), so that
    the scheduler can split it again; remembers the sources of nodes added since."""
    n = lib.ggml_graph_n_nodes(state.graph)
    if state.srcs is None or state.srcs_cap < n:
        cap = max(64, 2 * n)
        grown = ffi.new("struct ggml_tensor *[]", cap * (lib.GGML_MAX_SRC + 1))
        if state.srcs is not None and state.srcs_n:
            ffi.memmove(grown, state.srcs, state.srcs_n * (lib.GGML_MAX_SRC + 1) * ffi.sizeof("void *"))
        state.srcs, state.srcs_cap = grown, cap
    state.srcs_n = lib.pyggml_graph_srcs(state.graph, state.srcs, state.srcs_n, state.srcs_cap)


_uncleared = ffi.new_allocator(should_clear_after_alloc=False)
_SCHED_MAX_SPLIT_INPUTS = 30  # GGML_SCHED_MAX_SPLIT_INPUTS in ggml-backend.cpp


def _check_sched_memory(graph_size: int) -> None:
    """ggml_backend_sched_new mallocs a context buffer of ~20 KB per graph slot unchecked and aborts when its
    split fails to get it: try that allocation here first, so running out of memory is a MemoryError."""
    need = graph_size * 2 * _SCHED_MAX_SPLIT_INPUTS * lib.ggml_tensor_overhead() + \
        lib.ggml_graph_overhead_custom(graph_size, False)
    try:
        _uncleared(f"char[{need}]")  # malloc'ed, untouched, freed at once
    except MemoryError:
        raise MemoryError(f"could not allocate the {need:,} bytes ggml's scheduler needs for a graph of "
                          f"{graph_size:,} slots") from None


class _GraphState:
    """What all handles of one Context share: the ggml context, the graph and pending inputs."""

    __slots__ = ("ptr", "mem", "g", "pools", "graph", "graph_size", "inputs", "index_checks", "epoch",
                 "leaf_outputs", "named", "anonymous_inputs", "placements", "serial", "srcs", "srcs_n",
                 "srcs_cap", "sched", "owner", "split_nodes", "__weakref__")
    _serials = itertools.count(1)

    def __init__(self, max_nodes: int, graph_size: int, pools: Any = NULL):
        self.serial = next(self._serials)  # tells graphs apart for the scheduler (ids of dead ones are reused)
        self.graph_size = graph_size
        self.ptr, self.sched, self.owner = NULL, None, None  # what __del__ reads, should this fail
        mem = lib.ggml_tensor_overhead() * (max_nodes + 16) + lib.ggml_graph_overhead_custom(self.graph_size, False)
        # allocated here, not by ggml_init: a failed malloc there aborts the process, here it is a MemoryError
        try:
            self.mem = _uncleared(f"char[{mem + 64}]")
        except MemoryError:
            raise MemoryError(f"could not allocate {mem:,} bytes for a graph of up to {max_nodes:,} nodes") from None
        aligned = ffi.cast("char *", self.mem) + (-int(ffi.cast("uintptr_t", self.mem)) % 64)  # ggml asserts it
        self.ptr = lib.ggml_init({"mem_size": mem, "mem_buffer": aligned, "no_alloc": True})
        if self.ptr == NULL:
            raise MemoryError("could not create a ggml context")
        self.graph = lib.ggml_new_graph_custom(self.ptr, self.graph_size, False)
        # what the checked C ops read and update: the context, its tensor count and whether it is closed
        self.g = ffi.new("struct pyg_graph *")
        lib.pyg_graph_init(self.g, self.ptr, max_nodes)
        self.pools = pools  # the backend's weight and cache contexts (kept alive with the graph)
        self.g.pools = pools
        self.n_tensors = 1  # the graph object
        self.inputs: dict[Any, np.ndarray] = {}
        self.index_checks: dict[Any, tuple[int, str]] = {}  # index tensor -> (exclusive bound, op)
        # name -> (tensor pointer, dtype, shape): not the Tensor, whose ctx refers back to this state (a
        # reference cycle would keep the graph's ggml memory until the next garbage collection)
        self.named: dict[str, tuple[Any, DType, tuple[int, ...]]] = {}
        self.anonymous_inputs = 0
        self.placements: list[tuple[Any, int]] = []  # (tensor, backend index) from ctx.input()/layer()
        self.epoch = 0
        # an input read back as it is (a leaf no node uses): ggml's allocator does not size-check such
        # leaves when it reuses the previous graph's buffers, so these graphs are re-measured first
        self.leaf_outputs = False
        # several devices (Backend._compute_split): the graph's own scheduler, the node count it was split
        # at, and every node's sources as built (before a split rewired them)
        self.sched: Any = None
        self.owner: Backend | None = None
        self.split_nodes = 0
        self.srcs: Any = None
        self.srcs_n = 0
        self.srcs_cap = 0

    def __del__(self) -> None:
        if self.sched is not None and self.owner is not None:
            self.owner._give_back_sched(self)
        # freed when the last handle (and so the last tensor) of the graph is gone, even after close():
        # a stale tensor's shape, dtype and repr read this memory
        if self.ptr != NULL:
            lib.ggml_free(self.ptr)
            self.ptr = NULL
            self.closed = True

    @property
    def max_tensors(self) -> int:
        return self.g.max_tensors

    @property
    def n_tensors(self) -> int:
        return self.g.n_tensors

    @n_tensors.setter
    def n_tensors(self, n: int) -> None:
        self.g.n_tensors = n

    @property
    def closed(self) -> bool:
        return bool(self.g.closed)

    @closed.setter
    def closed(self, closed: bool) -> None:
        self.g.closed = closed


class Context:
    """Builds and computes one graph. Use as a context manager, or call ``close()``."""

    __slots__ = ("backend", "max_nodes", "_state", "_placement", "_g")

    def __init__(self, backend: Backend, max_nodes: int, _state: _GraphState | None = None,
                 _placement: int | None = None):
        if not isinstance(max_nodes, int) or isinstance(max_nodes, bool) or not 0 < max_nodes <= MAX_GRAPH_NODES:
            raise ValueError(f"max_nodes must be an integer in 1..{MAX_GRAPH_NODES}, got {max_nodes!r}")
        self.backend = backend
        self.max_nodes = max_nodes
        self._state = _state or _GraphState(max_nodes, backend._graph_size(max_nodes), backend._pools)
        self._placement = _placement
        self._g = self._state.g  # the checked C ops' view of the graph (tensor.py's fast paths)

    @property
    def max_graph_nodes(self) -> int:
        return self.max_nodes

    @property
    def n_nodes(self) -> int:
        """Nodes in the graph so far (after ``forward``)."""
        return lib.ggml_graph_n_nodes(self._state.graph)

    def _c(self) -> Any:
        """The ggml context pointer for one more tensor; refuses past capacity or after close."""
        state = self._state
        if state.closed:
            raise ValueError("context is closed")
        state.n_tensors += 1
        if state.n_tensors > state.max_tensors:
            raise ValueError(f"graph is full: more than {state.max_tensors} tensors; "
                             "create the context with a larger max_nodes")
        return state.ptr

    def _index_bound(self, indices: Tensor, bound: int, op: str) -> None:
        """Make sure every value of ``indices`` lies in 0..bound-1 before ggml reads at it: a graph input is
        checked at each compute, indices computed in the graph must come from an op with a known range."""
        kind, source = index_source(indices._p)
        if kind == "input":
            # one entry per input, with the tightest bound: checked once per compute
            checks = self._state.index_checks
            if source not in checks or bound < checks[source][0]:
                checks[source] = (bound, op)
        elif kind == "range":
            if source > bound:
                raise ValueError(f"{op}: the indices come from argmax/argsort/top_k over {source} entries (values up "
                                 f"to {source - 1}), but the indexed dimension has {bound}; take them over at most "
                                 f"{bound} entries (e.g. a view of the first {bound})")
        else:
            raise ValueError(f"{op}: the indices come from {source}, whose values pyggml cannot bound (an index "
                             f"outside 0..{bound - 1} would crash ggml); pass them as a graph input "
                             "(ctx.from_numpy: checked at compute), or compute them with argmax, argsort or top_k "
                             f"over at most {bound} entries")

    # ---- making tensors ------------------------------------------------------------------
    def _new(self, dtype: DType, shape: tuple[int, ...]) -> Tensor:
        if not 1 <= len(shape) <= 4:
            raise ValueError(f"tensors have 1 to 4 dims, got shape {shape}")
        if any(s <= 0 for s in shape):
            raise ValueError(f"tensor dims must be positive, got {shape}")
        if shape[0] % dtype.block_size:
            raise ValueError(f"dim 0 ({shape[0]}) must be a multiple of the {dtype.name} block size "
                             f"{dtype.block_size}")
        _check_size("tensor", dtype, shape)
        c = self._c()
        ne = ffi.new("int64_t[4]", shape + (1,) * (4 - len(shape)))
        p = lib.ggml_new_tensor(c, dtype, len(shape), ne)
        lib.ggml_set_input(p)
        if self._placement is not None:
            # applied at compute, after the scheduler's reset (which forgets earlier assignments)
            self._state.placements.append((p, self._placement))
        return Tensor(p, self, len(shape))

    def from_numpy(self, array: Any, dtype: DType | str | None = None, *, name: str | None = None) -> Tensor:
        """A graph input holding ``array``: shape ``tuple(reversed(array.shape))``; data is
        converted to ``dtype`` (F32, F16, I32, ...; default: the array's own type).

        A ``name`` lets the data be replaced later with ``set_input(name, array)``, so the graph
        can be computed again for new inputs of the same shape without being rebuilt."""
        array = np.asarray(array)
        if array.ndim == 0:
            array = array.reshape(1)
        if array.ndim > 4:
            raise ValueError(f"from_numpy: at most 4 dims, got an array of shape {array.shape}")
        if dtype is None:
            dtype = dtype_of_numpy(array.dtype) if array.dtype != np.float64 else DType.F32
        dtype = DType.parse(dtype)
        shape = tuple(reversed(array.shape)) if array.size else None
        if shape is None:
            raise ValueError("from_numpy: empty arrays have no ggml equivalent")
        t = self._new(dtype, shape)
        if dtype.numpy_dtype is None:
            raise TypeError(f"from_numpy: cannot convert numpy data to {dtype.name}; use F32/F16/I32 inputs")
        self._set_input(t, _prepare_host_array(array, dtype, shape, "from_numpy"))
        state = self._state
        if name is None:
            state.anonymous_inputs += 1
        elif name in state.named:
            raise ValueError(f"from_numpy: this graph already has an input named {name!r}")
        else:
            state.named[name] = (t._p, dtype, t.shape)
        return t

    def set_input(self, name: str, array: Any) -> None:
        """Replace the data of the input created with ``from_numpy(..., name=name)``."""
        entry = self._state.named.get(name)
        if entry is None:
            raise KeyError(f"set_input: this graph has no input named {name!r}")
        ptr, dtype, shape = entry
        self._state.inputs[ptr] = _prepare_host_array(array, dtype, shape, "set_input")

    def input_shape(self, name: str) -> tuple[int, ...] | None:
        """Shape (ggml order) of the named input, or None if the graph has none."""
        entry = self._state.named.get(name)
        return None if entry is None else entry[2]

    @property
    def graph_id(self) -> int:
        """A number that tells this graph apart from every other of the process (its handles from
        ``input()``/``layer()`` share it)."""
        return self._state.serial

    @property
    def reusable(self) -> bool:
        """Whether every input with data is named, so ``set_input`` can refill all of them."""
        return self._state.anonymous_inputs == 0

    def empty(self, dtype: DType | str, *shape: int) -> Tensor:
        """A graph input with uninitialised data (fill it with ``tensor.set`` before computing)."""
        return self._new(DType.parse(dtype), tuple(int(s) for s in shape))

    def zeros(self, dtype: DType | str, *shape: int) -> Tensor:
        dtype = DType.parse(dtype)
        if dtype.numpy_dtype is None:
            raise TypeError(f"zeros: {dtype.name} is not supported; use F32/F16/I32")
        t = self._new(dtype, tuple(int(s) for s in shape))
        self._set_input(t, np.zeros(tuple(reversed(t.shape)), dtype=dtype.numpy_dtype))
        return t

    def arange(self, start: float, stop: float, step: float = 1.0, dtype: DType | str = DType.F32) -> Tensor:
        """Evenly spaced values in [start, stop)."""
        if step == 0 or (stop - start) / step <= 0:
            raise ValueError(f"arange: empty or infinite range ({start}, {stop}, {step})")
        dtype = DType.parse(dtype)
        values = np.arange(start, stop, step)
        return self.from_numpy(values.astype(dtype.numpy_dtype or np.float32), dtype)

    def _set_input(self, tensor: Tensor, array: np.ndarray) -> None:
        self._state.inputs[tensor._p] = array

    def input(self) -> Context:
        """A handle on this graph whose new tensors live on the device of the model's inputs."""
        return Context(self.backend, self.max_nodes, self._state, len(self.backend._backends) - 1)

    def layer(self, i: int) -> Context:
        """A handle on this graph whose new tensors live on layer ``i``'s device."""
        return Context(self.backend, self.max_nodes, self._state, self.backend._layer_backend(f"blk.{i}."))

    # ---- running -------------------------------------------------------------------------
    def forward(self, *tensors: Tensor) -> Context:
        """Add tensors (and everything they depend on) to the graph."""
        state = self._state
        if state.closed:
            raise ValueError("context is closed")
        for t in tensors:
            if not isinstance(t, Tensor):
                raise TypeError(f"forward: expected Tensor, got {type(t).__name__}")
            if t.ctx is not None and t.ctx._state is not state:
                raise ValueError("forward: tensor belongs to another context")
            if t.ctx is not None and t._p.op == 0:  # GGML_OP_NONE: a graph input
                state.leaf_outputs = True
            lib.ggml_build_forward_expand(state.graph, t._p)
        return self

    def compute(self, *tensors: Tensor, on_start: Callable[[], None] | None = None) -> Context:
        """Compute the graph (plus ``tensors``); their ``numpy()`` then holds the results until
        the backend computes another graph. ``on_start`` is called once the inputs are written, just
        before the native compute (which runs without the GIL): a thread that handed this compute to
        another one waits for it before running Python of its own, or the compute's thread waits for
        the GIL to start (up to Python's switch interval, 5 ms)."""
        for t in tensors:
            if isinstance(t, Tensor):
                lib.ggml_set_output(t._p)
        self.forward(*tensors)
        self.backend._compute(self._state, on_start=on_start)
        return self

    def reserve(self, *outputs: Tensor) -> Context:
        """Allocate the worst-case compute memory for the graph built so far; compute nothing.
        ``outputs``: the tensors the real computes will read, flagged as ``compute`` flags them. ggml
        keeps the buffer plan it makes here for any later graph with as many nodes whose tensors fit,
        and a plan made without those flags lets later nodes overwrite them."""
        for t in outputs:
            lib.ggml_set_output(t._p)
        self.forward(*outputs)
        self.backend._compute(self._state, reserve_only=True)
        return self

    def _check_results(self, tensor: Tensor) -> None:
        state = self._state
        if state.closed:
            raise ValueError("numpy: the tensor's context is closed")
        if tensor._p in state.inputs and state.epoch == 0:
            return self._raise_pending()
        if state.epoch == 0:
            raise ValueError("numpy: the graph has not been computed yet (call ctx.compute(tensor))")
        if state.epoch != self.backend._epoch:
            raise ValueError("numpy: the backend computed another graph since, which may have overwritten this "
                             "result; read results before the next compute (threads sharing a Backend must "
                             "compute and read under one lock, or use a Backend each)")
        if tensor._p.buffer == NULL:
            raise ValueError("numpy: tensor was not part of the computed graph (pass it to compute)")

    @staticmethod
    def _raise_pending() -> None:
        raise ValueError("numpy: the graph has not been computed yet (call ctx.compute(tensor))")

    def close(self) -> None:
        """Close the graph: its tensors refuse further ops, computes and reads. The ggml memory
        goes when the last tensor of the graph does (freeing it here would let a stale tensor's
        ``shape`` or ``repr`` read freed memory)."""
        state = self._state
        if not state.closed:
            state.closed = True
            state.inputs.clear()
            state.index_checks.clear()
            if state.sched is not None and state.owner is not None:
                state.owner._give_back_sched(state)  # it will not compute again

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


