"""Which models a server serves and which of them are loaded: the routes ask ``served_for(request,
name, keep_alive)`` for the ``ServedModel`` a request names.

``SingleModel`` serves one model loaded before the server started (``pyggml serve FILE``).
``ModelManager`` serves every model ``pyggml list`` finds (``pyggml serve`` with no model), as
Ollama's server does: a model loads on its first request (requests for a model that is loading wait
for it), at most ``max_loaded`` stay loaded (an idle one is unloaded to make room; when all are
busy the request gets 503 with ``Retry-After``), memory is checked before loading (507 with the
reason), and a model is unloaded once it has been idle for its ``keep_alive`` (the request's
field, else the server's; Ollama's semantics: a duration such as "5m" or seconds, 0 unloads as
soon as the request is done, a negative value keeps it loaded). Only models in the catalog can be
loaded: a client cannot make the server open an arbitrary file.

Everything that changes which models are loaded runs on the event loop (loading and closing run
in threads, awaited): a route that got a model admits its request before its next ``await``, so the
reaper never unloads a model between the two.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from pyggml.repl import parse_duration
from pyggml.server.params import APIError
from pyggml.server.service import RETRY_AFTER_SECONDS, ServedModel
from pyggml.store import ModelRef, list_models

log = logging.getLogger(__name__)

DEFAULT_KEEP_ALIVE = 300.0  # Ollama's 5 minutes
FOREVER = "2999-01-01T00:00:00Z"


async def served_for(request: Any, name: Any, keep_alive: Any = None) -> ServedModel:
    """The model a request names (400 without a name, 404 for one not served; loads it on demand)."""
    return await request.app.state.models.get(name, keep_alive)


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat().replace("+00:00", "Z")


def _keep_alive(value: Any) -> float | None:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise APIError(400, str(exc), param="keep_alive") from None


class SingleModel:
    """One model, loaded for the life of the server."""

    def __init__(self, served: ServedModel):
        self.served = served

    async def get(self, name: Any, keep_alive: Any = None) -> ServedModel:
        if keep_alive is not None:
            _keep_alive(keep_alive)  # checked, then ignored: this model stays loaded
        self.served.check_model(name)
        return self.served

    async def unload(self, name: str) -> bool:
        return False

    async def tags(self) -> list[dict[str, Any]]:
        return [await _entry(self.served)]

    async def ps(self) -> list[dict[str, Any]]:
        entry = await _entry(self.served)
        entry.update(expires_at=FOREVER, size_vram=0, context_length=self.served.runner.num_ctx)
        return [entry]

    def openai_models(self) -> list[dict[str, Any]]:
        return [{"id": self.served.name, "object": "model", "created": int(self.served.modified),
                 "owned_by": "pyggml"}]

    def health(self) -> dict[str, Any]:
        return self.served.health()

    async def close(self) -> None:  # the caller that loaded the model closes it
        pass


async def _entry(served: ServedModel) -> dict[str, Any]:
    return {"name": served.name, "model": served.name, "modified_at": served.modified_at, "size": served.size,
            "digest": await served.digest(), "details": served.details}


@dataclass(eq=False)
class _Loaded:
    ref: ModelRef
    served: ServedModel
    keep_alive: float | None
    last_used: float  # time.monotonic() of the last request or of the last moment it was busy

    def busy(self) -> bool:
        return self.served.health()["requests"] > 0

    def expires(self) -> float | None:
        return None if self.keep_alive is None else self.last_used + self.keep_alive


class ModelManager:
    """Every model of ``catalog()`` (default: ``pyggml.store.list_models``) by name, loaded by
    ``load(ref) -> ServedModel`` (run in a thread) on demand. ``memory_needed(ref)`` and
    ``memory_available()`` (bytes) decide whether one more fits; ``tick`` is how often (seconds)
    idle models are looked at."""

    def __init__(self, load: Callable[[ModelRef], ServedModel], *, catalog: Callable[[], list[ModelRef]] = list_models,
                 max_loaded: int = 1, keep_alive: float | None = DEFAULT_KEEP_ALIVE,
                 memory_needed: Callable[[ModelRef], int] | None = None,
                 memory_available: Callable[[], int | None] | None = None, tick: float = 0.25):
        if not isinstance(max_loaded, int) or max_loaded < 1:
            raise ValueError(f"max_loaded must be an int >= 1, got {max_loaded!r}")
        self._load, self._catalog = load, catalog
        self.max_loaded, self.keep_alive, self.tick = max_loaded, keep_alive, tick
        self._memory_needed = memory_needed or estimate_memory
        self._memory_available = memory_available or available_memory
        self._loaded: dict[str, _Loaded] = {}
        self._loading: dict[str, asyncio.Future] = {}
        self._closing: set[asyncio.Task] = set()
        self._reaper: asyncio.Task | None = None

    # ---- the catalog ----------------------------------------------------------------------------
    def catalog(self) -> list[ModelRef]:
        return self._catalog()

    def find(self, name: Any) -> ModelRef:
        if name is None or name == "":
            raise APIError(400, "model is required", param="model")
        if not isinstance(name, str):
            raise APIError(400, "model must be a string", param="model")
        refs = self.catalog()
        for ref in refs:
            if name == ref.name or name in ref.aliases:
                return ref
        names = ", ".join(r.name for r in refs[:20]) or "none (see `pyggml list`)"
        raise APIError(404, f"model {name!r} not found; this server serves: {names}", code="model_not_found",
                       param="model")

    def loaded_model(self, name: str) -> ServedModel | None:
        """The loaded model ``name`` names, or None (never loads)."""
        loaded = self._loaded.get(self.find(name).name)
        return loaded.served if loaded is not None else None

    # ---- loading --------------------------------------------------------------------------------
    def adopt(self, ref: ModelRef, served: ServedModel) -> None:
        """Count ``served``, loaded before the server started, as ``ref`` loaded (unloaded as any other)."""
        self._loaded[ref.name] = _Loaded(ref, served, self.keep_alive, time.monotonic())

    async def get(self, name: Any, keep_alive: Any = None) -> ServedModel:
        seconds = self.keep_alive if keep_alive is None else _keep_alive(keep_alive)
        ref = self.find(name)
        self._start_reaper()
        while True:
            loaded = self._loaded.get(ref.name)
            if loaded is not None:
                loaded.keep_alive, loaded.last_used = seconds, time.monotonic()
                return loaded.served
            pending = self._loading.get(ref.name)
            if pending is None:
                break
            with contextlib.suppress(Exception):  # its own request reports a failure; this one retries
                await asyncio.shield(pending)
        return await self._load_model(ref, seconds)

    async def _load_model(self, ref: ModelRef, keep_alive: float | None) -> ServedModel:
        future = asyncio.get_running_loop().create_future()
        self._loading[ref.name] = future
        try:
            await self._make_room(ref)
            try:
                served = await asyncio.to_thread(self._load, ref)
            except Exception as exc:  # noqa: BLE001 - a bad file (ValueError), memory, ggml: this model fails alone
                log.warning("could not load %s from %s: %s", ref.name, ref.path, exc)
                raise APIError(500, f"could not load model {ref.name!r}: {exc}", code="model_load_failed") from None
            self._loaded[ref.name] = _Loaded(ref, served, keep_alive, time.monotonic())
            log.info("loaded %s from %s", ref.name, ref.path)
            future.set_result(None)
            return served
        except BaseException as exc:
            future.set_exception(exc if isinstance(exc, Exception) else APIError(503, "loading was cancelled"))
            future.exception()  # retrieved: no "never retrieved" warning when nobody else waits
            raise
        finally:
            del self._loading[ref.name]

    async def _make_room(self, ref: ModelRef) -> None:
        """Unload idle models (least recently used first) until one more is allowed and fits."""
        needed = self._memory_needed(ref)
        while True:
            await self._wait_closing()
            count = len(self._loaded) + len(self._loading) - 1  # this one is in _loading already
            available = self._memory_available()
            fits = available is None or needed <= available
            if count < self.max_loaded and fits:
                return
            idle = sorted((m for m in self._loaded.values() if not m.busy()), key=lambda m: m.last_used)
            if not idle:
                if count >= self.max_loaded:
                    raise APIError(503, f"cannot load {ref.name!r} now: {len(self._loaded)} model(s) loaded "
                                   f"(--max-loaded {self.max_loaded}) and all are busy; retry later",
                                   code="server_busy", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
                raise APIError(507, f"not enough memory to load {ref.name!r}: it needs about {_gib(needed)}, "
                               f"{_gib(available)} is available", code="insufficient_memory")
            self._unload(idle[0])

    # ---- unloading ------------------------------------------------------------------------------
    def _unload(self, loaded: _Loaded) -> None:
        """Forget ``loaded`` now and close it in a thread (awaited by the next load)."""
        self._loaded.pop(loaded.ref.name, None)
        log.info("unloading %s", loaded.ref.name)
        task = asyncio.ensure_future(asyncio.to_thread(_close, loaded.served))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _wait_closing(self) -> None:
        if self._closing:
            await asyncio.gather(*list(self._closing), return_exceptions=True)

    async def unload(self, name: str) -> bool:
        """Unload ``name`` once idle (Ollama's ``keep_alive: 0`` with no prompt); whether it was loaded."""
        loaded = self._loaded.get(self.find(name).name)
        if loaded is None:
            return False
        loaded.keep_alive = 0.0
        if not loaded.busy():
            self._unload(loaded)
            await self._wait_closing()
        return True

    def _start_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.ensure_future(self._reap())

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(self.tick)
            self.reap()

    def reap(self, now: float | None = None) -> None:
        """Unload every idle model whose keep-alive has run out."""
        now = time.monotonic() if now is None else now
        for loaded in list(self._loaded.values()):
            if loaded.busy():
                loaded.last_used = now  # keep-alive counts from the end of the last request
                continue
            expires = loaded.expires()
            if expires is not None and now >= expires:
                self._unload(loaded)

    # ---- what the routes report -------------------------------------------------------------------
    async def tags(self) -> list[dict[str, Any]]:
        out = []
        for ref in self.catalog():
            loaded = self._loaded.get(ref.name)
            if loaded is not None:
                entry = await _entry(loaded.served)
                entry["name"] = entry["model"] = ref.name
            else:
                entry = _ref_entry(ref)
            out.append(entry)
        return out

    async def ps(self) -> list[dict[str, Any]]:
        out = []
        wall, mono = time.time(), time.monotonic()
        for loaded in self._loaded.values():
            entry = await _entry(loaded.served)
            expires = loaded.expires()
            if loaded.busy() and expires is not None:
                expires = max(expires, mono + (loaded.keep_alive or 0.0))
            entry.update(name=loaded.ref.name, model=loaded.ref.name, size_vram=0,
                         context_length=loaded.served.runner.num_ctx,
                         expires_at=FOREVER if expires is None else _iso(wall + expires - mono))
            out.append(entry)
        return out

    def openai_models(self) -> list[dict[str, Any]]:
        return [{"id": ref.name, "object": "model", "created": int(_mtime(ref)), "owned_by": "pyggml"}
                for ref in self.catalog()]

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "models_loaded": sorted(self._loaded), "models_loading": sorted(self._loading),
                "max_loaded": self.max_loaded,
                "requests": sum(m.served.health()["requests"] for m in self._loaded.values())}

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for loaded in list(self._loaded.values()):
            self._unload(loaded)
        await self._wait_closing()


def _close(served: ServedModel) -> None:
    served.close()


def _mtime(ref: ModelRef) -> float:
    try:
        return ref.path.stat().st_mtime
    except OSError:
        return 0.0


def _ref_entry(ref: ModelRef) -> dict[str, Any]:
    """/api/tags for a model that is not loaded: facts from the file's header. The digest is the
    blob's for Ollama's store; for other files a digest of path, size and time (hashing every
    file of a store on each listing would take minutes)."""
    from pyggml.store import file_facts, human_count

    arch, quant = file_facts(ref.path)
    if ref.source == "ollama" and ref.path.name.startswith("sha256"):
        digest = "sha256:" + ref.path.name[len("sha256") + 1:]
    else:
        digest = "sha256:" + hashlib.sha256(f"{ref.path}:{ref.size}:{_mtime(ref)}".encode()).hexdigest()
    n_params = _parameter_count(ref)
    return {"name": ref.name, "model": ref.name, "modified_at": _iso(_mtime(ref)), "size": ref.size, "digest": digest,
            "details": {"parent_model": "", "format": "gguf", "family": arch, "families": [arch],
                        "parameter_size": human_count(n_params) if n_params else "", "quantization_level": quant}}


def _parameter_count(ref: ModelRef) -> int:
    from pyggml.backend.metadata import GGUFError, read_gguf_summary

    try:
        return read_gguf_summary(ref.path).n_parameters
    except (GGUFError, OSError):  # a broken file is listed, not fatal
        return 0


# ---- memory -----------------------------------------------------------------------------------------

def available_memory() -> int | None:
    """Bytes the system can still give (``MemAvailable``), None where that is unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if hasattr(os, "sysconf"):
        with contextlib.suppress(ValueError, OSError):
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return None


def estimate_memory(ref: ModelRef, num_ctx_total: int = 4096 * 4) -> int:
    """Bytes a model needs loaded: its weights (the file) and an F16 KV cache of ``num_ctx_total``
    tokens, from the header's dimensions (weights only when they are unknown)."""
    from pyggml.backend.metadata import GGUFError, read_gguf_summary

    try:
        config = read_gguf_summary(ref.path).config
    except (GGUFError, OSError):  # unknown dimensions: the weights alone
        return ref.size

    def value(key: str) -> int:  # 0 where absent or not one integer (a per-layer list is left out)
        found = config.get(f"{config.architecture}.{key}")
        return found if isinstance(found, int) and not isinstance(found, bool) and found > 0 else 0

    layers, embd = value("block_count"), value("embedding_length")
    heads = value("attention.head_count") or 1
    kv_heads = value("attention.head_count_kv") or heads
    kv = 2 * layers * num_ctx_total * embd * kv_heads // heads * 2
    size = ref.size
    return size + kv


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB"
