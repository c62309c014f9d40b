"""Models by name, and facts about models for people (architecture, parameter count, quantization).

``resolve(ref)`` finds the GGUF file a reference names; ``list_models()`` lists every model on
this machine (``pyggml list``). No network access: nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def human_count(n: int) -> str:
    """A parameter count as people write it: 260K, 1.1B, 8B, 950 (never "0.00 B")."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}" if n < 10 * size else f"{n / size:.0f}{unit}"
    return str(n)


def tensor_summary(tensors: Any) -> tuple[int, str, dict[str, int]]:
    """(parameter count, main type, elements per type) of a ``Backend.tensors()`` mapping."""
    by_type: dict[str, int] = {}
    for t in tensors.values():
        by_type[t.dtype.name] = by_type.get(t.dtype.name, 0) + t.nelements
    total = sum(by_type.values())
    return total, max(by_type, key=by_type.get) if by_type else "-", by_type


def describe(model: Any) -> dict[str, Any]:
    """What ``/show info`` prints about a loaded model."""
    config = model.config
    n_params, quant, _ = tensor_summary(model.backend.tensors())
    return {
        "architecture": config.architecture or "-",
        "name": config.get("general.name") or "-",
        "parameters": human_count(n_params),
        "quantization": quant,
        "context length": model.context_length or "-",
        "embedding length": config.uint("embedding_length", 0) or "-",
    }


# ---- models by name ---------------------------------------------------------------------------------
#
# A reference resolves, in order, to: an existing file; the built-in demo model ("demo"); a name in
# pyggml's model directory; a model in Ollama's local store; a GGUF in the Hugging Face hub cache.
# Nothing is ever downloaded.

OLLAMA_REGISTRY = "registry.ollama.ai"
_OLLAMA_MEDIA = "application/vnd.ollama.image."


class ModelNotFoundError(FileNotFoundError):
    """No file and no stored model answers to a reference (the message says where it looked)."""


@dataclass
class ModelRef:
    """A model found on this machine: the name to call it by, its GGUF file, where it came from
    ("file", "demo", "pyggml", "ollama", "huggingface"), and what an Ollama manifest adds."""

    name: str
    path: Path
    source: str
    template: str | None = None  # Ollama's template layer (a Go template: shown, not rendered)
    system: str | None = None  # Ollama's system layer: the default system message
    params: dict[str, Any] = field(default_factory=dict)  # Ollama's params layer (stop, temperature, ...)
    projector: Path | None = None  # Ollama's projector layer (a vision model's mmproj GGUF)
    license: list[str] = field(default_factory=list)  # Ollama's license layers
    messages: list[dict[str, Any]] = field(default_factory=list)  # Ollama's messages layer: a conversation's start
    aliases: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0


def models_dir() -> Path:
    """pyggml's model directory: ``$PYGGML_MODELS``, else ``~/.cache/pyggml/models``."""
    if os.environ.get("PYGGML_MODELS"):
        return Path(os.environ["PYGGML_MODELS"]).expanduser()
    return Path.home() / ".cache" / "pyggml" / "models"


def ollama_dir() -> Path:
    """Ollama's local store: ``$OLLAMA_MODELS``, else ``~/.ollama/models``."""
    if os.environ.get("OLLAMA_MODELS"):
        return Path(os.environ["OLLAMA_MODELS"]).expanduser()
    return Path.home() / ".ollama" / "models"


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def resolve(ref: str | os.PathLike) -> ModelRef:
    """The model ``ref`` names (see the module notes for the order); ``ModelNotFoundError`` otherwise."""
    text = os.fspath(ref)
    path = Path(text).expanduser()
    if path.is_file():
        return ModelRef(path.stem, path, "file", aliases=(text, path.name))
    if text == "demo":
        from pyggml.tiny import default_model_path

        return ModelRef("demo", default_model_path(), "demo", aliases=("demo:latest",))
    if path.exists():
        raise ModelNotFoundError(f"{text} is a directory, not a GGUF file")
    for find in (_find_pyggml, _find_ollama, _find_hf):
        found = find(text)
        if found is not None:
            return found
    raise ModelNotFoundError(
        f"no such model file or stored model: {text!r} is not a file, not 'demo', and not a model in "
        f"{models_dir()}, in Ollama's store ({ollama_dir()}) or in the Hugging Face cache ({hf_cache_dir()}); "
        "`pyggml list` shows what is there")


def list_models() -> list[ModelRef]:
    """Every model in pyggml's directory, Ollama's store and the Hugging Face cache (and the demo
    model once it has been built), sorted by name; a name found twice keeps its first source."""
    from pyggml.tiny import TINY_VERSION, cache_dir

    found: dict[str, ModelRef] = {}
    demo = cache_dir() / f"pyggml-tiny-random-v{TINY_VERSION}.gguf"
    candidates = [ModelRef("demo", demo, "demo", aliases=("demo:latest",))] if demo.is_file() else []
    candidates += _list_pyggml() + _list_ollama() + _list_hf()
    for model in candidates:
        found.setdefault(model.name, model)
    return sorted(found.values(), key=lambda m: m.name)


# ---- pyggml's directory -----------------------------------------------------------------------------

def _find_pyggml(name: str) -> ModelRef | None:
    root = models_dir()
    base = name[:-len(":latest")] if name.endswith(":latest") else name
    for candidate in (root / base, root / f"{base}.gguf"):
        if _inside(candidate, root) and candidate.is_file():
            return _pyggml_ref(root, candidate)
    return None


def _list_pyggml() -> list[ModelRef]:
    root = models_dir()
    return [_pyggml_ref(root, p) for p in sorted(root.rglob("*.gguf")) if p.is_file()] if root.is_dir() else []


def _pyggml_ref(root: Path, path: Path) -> ModelRef:
    name = path.relative_to(root).with_suffix("").as_posix()
    return ModelRef(name, path, "pyggml", aliases=(f"{name}:latest", f"{name}.gguf"))


# ---- Ollama's store -----------------------------------------------------------------------------------

def _ollama_parts(name: str) -> tuple[str, str, str, str] | None:
    """(host, namespace, model, tag) of an Ollama model name: "llama3.2", "llama3.2:1b", "me/m:q4",
    "host/ns/m:tag"; None for what cannot be one."""
    body, _, tag = name.partition(":") if name.count(":") <= 1 else (name, "", "")
    parts = body.split("/")
    if not body or not all(parts) or len(parts) > 3 or any(p in (".", "..") for p in parts) or "\\" in body:
        return None
    tag = tag or "latest"
    if "/" in tag or tag in (".", ".."):
        return None
    host, namespace = OLLAMA_REGISTRY, "library"
    if len(parts) == 3:
        host, namespace, model = parts
    elif len(parts) == 2:
        namespace, model = parts
    else:
        model = parts[0]
    return host, namespace, model, tag


def _find_ollama(name: str) -> ModelRef | None:
    parts = _ollama_parts(name)
    if parts is None:
        return None
    manifest = ollama_dir() / "manifests" / Path(*parts)
    return _ollama_ref(manifest) if manifest.is_file() else None


def _list_ollama() -> list[ModelRef]:
    root = ollama_dir() / "manifests"
    if not root.is_dir():
        return []
    out = []
    for manifest in sorted(root.glob("*/*/*/*")):
        if manifest.is_file():
            found = _ollama_ref(manifest)
            if found is not None:
                out.append(found)
    return out


def _ollama_ref(manifest: Path) -> ModelRef | None:
    """The model a manifest names (None when it has no model layer or its blob is missing)."""
    host, namespace, model, tag = manifest.parts[-4:]
    short = model if namespace == "library" else f"{namespace}/{model}"
    if host != OLLAMA_REGISTRY:
        short = f"{host}/{namespace}/{model}"
    try:
        layers = json.loads(manifest.read_text(encoding="utf-8")).get("layers") or []
    except (OSError, ValueError, AttributeError):
        return None
    found: dict[str, Path] = {}
    licenses: list[str] = []
    for layer in layers:
        if not isinstance(layer, dict):
            continue
        kind, digest = str(layer.get("mediaType", "")), str(layer.get("digest", ""))
        blob = _blob(digest)
        if kind.startswith(_OLLAMA_MEDIA) and blob is not None:
            found.setdefault(kind[len(_OLLAMA_MEDIA):], blob)
            if kind == _OLLAMA_MEDIA + "license":
                licenses.append(_read_text(blob) or "")
    if "model" not in found:
        return None
    params, messages = _read_json(found.get("params"), dict), _read_json(found.get("messages"), list)
    name = f"{short}:{tag}"
    aliases = (short,) if tag == "latest" else ()
    return ModelRef(name, found["model"], "ollama", template=_read_text(found.get("template")),
                    system=_read_text(found.get("system")), params=params or {}, projector=found.get("projector"),
                    license=licenses, messages=[m for m in messages or [] if isinstance(m, dict)], aliases=aliases)


def _read_json(path: Path | None, kind: type) -> Any:
    """A JSON layer's value when it is of ``kind``, else None."""
    text = _read_text(path)
    try:
        value = json.loads(text) if text is not None else None
    except ValueError:
        return None
    return value if isinstance(value, kind) else None


def _blob(digest: str) -> Path | None:
    algorithm, _, hexdigest = digest.partition(":")
    if algorithm != "sha256" or not hexdigest or not all(c in "0123456789abcdef" for c in hexdigest):
        return None
    for candidate in (f"sha256-{hexdigest}", f"sha256:{hexdigest}"):
        path = ollama_dir() / "blobs" / candidate
        if path.is_file():
            return path
    return None


def _read_text(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


# ---- the Hugging Face hub cache -------------------------------------------------------------------------

def _find_hf(name: str) -> ModelRef | None:
    text = name.removeprefix("hf.co/").removeprefix("huggingface.co/")
    repo, _, want = text.partition(":")
    parts = repo.split("/")
    if len(parts) != 2 or not all(parts) or any(p in (".", "..") for p in parts):
        return None
    files = _hf_ggufs(repo)
    if not files:
        return None
    if want:
        exact = [f for f in files if f.name == want or f.name == f"{want}.gguf"]
        tagged = [f for f in files if want.lower() in f.name.lower()]
        files = exact or tagged
        if not files:
            return None
    elif len(files) > 1:
        raise ModelNotFoundError(f"{repo} holds {len(files)} GGUF files in the Hugging Face cache; name one as "
                                 f"{repo}:FILE, one of: {', '.join(f.name for f in files)}")
    if len(files) > 1:
        raise ModelNotFoundError(f"{name!r} matches several files: {', '.join(f.name for f in files)}")
    return _hf_ref(repo, files[0])


def hf_cached_file(repo_id: str, filename: str | None = None) -> Path:
    """A GGUF of ``repo_id`` ("org/name") in the local Hugging Face cache, as llama-cpp-python's
    ``Llama.from_pretrained`` picks it: ``filename`` is a file name, a path in the repository or a glob
    ("*q4_k_m.gguf"); None when the repository holds one GGUF. Never downloads: ModelNotFoundError says
    what is cached, or how to fetch the file."""
    import fnmatch

    parts = repo_id.split("/") if isinstance(repo_id, str) else []
    if len(parts) != 2 or not all(parts) or any(p in (".", "..") for p in parts):
        raise ModelNotFoundError(f"repo_id must look like 'org/name', got {repo_id!r}")
    fetch = f"huggingface-cli download {repo_id}{f' {filename!r}' if filename else ''}"
    snapshot = _hf_snapshot(hf_cache_dir() / f"models--{parts[0]}--{parts[1]}")
    files = sorted(p for p in snapshot.rglob("*.gguf") if p.is_file()) if snapshot else []
    if not files:
        raise ModelNotFoundError(f"{repo_id} has no GGUF file in the Hugging Face cache ({hf_cache_dir()}); pyggml "
                                 f"never downloads: fetch it first (`{fetch}`)")
    relative = {f: f.relative_to(snapshot).as_posix() for f in files}
    if filename is None:
        found = [f for f in files if "mmproj" not in f.name.lower()]
    else:
        found = [f for f in files if fnmatch.fnmatch(relative[f], filename) or fnmatch.fnmatch(f.name, filename)]
    names = ", ".join(relative.values())
    if not found:
        raise ModelNotFoundError(f"no file of {repo_id} in the Hugging Face cache matches {filename!r}; cached: "
                                 f"{names} (pyggml never downloads: `{fetch}`)")
    if len(found) > 1:
        raise ModelNotFoundError(f"{filename or repo_id!r} matches several cached files of {repo_id}: "
                                 f"{', '.join(relative[f] for f in found)}; name one")
    return found[0]


def _hf_snapshot(repo_dir: Path) -> Path | None:
    snapshots = repo_dir / "snapshots"
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
        if commit and (snapshots / commit).is_dir():
            return snapshots / commit
    dirs = [d for d in snapshots.iterdir() if d.is_dir()] if snapshots.is_dir() else []
    return max(dirs, key=lambda d: d.stat().st_mtime) if dirs else None


def _hf_ggufs(repo: str) -> list[Path]:
    org, name = repo.split("/")
    snapshot = _hf_snapshot(hf_cache_dir() / f"models--{org}--{name}")
    if snapshot is None:
        return []
    return sorted(p for p in snapshot.rglob("*.gguf") if p.is_file() and "mmproj" not in p.name.lower())


def _list_hf() -> list[ModelRef]:
    root = hf_cache_dir()
    if not root.is_dir():
        return []
    out = []
    for repo_dir in sorted(root.glob("models--*--*")):
        org, _, name = repo_dir.name[len("models--"):].partition("--")
        out += [_hf_ref(f"{org}/{name}", p) for p in _hf_ggufs(f"{org}/{name}")]
    return out


def _hf_ref(repo: str, path: Path) -> ModelRef:
    return ModelRef(f"{repo}:{path.name}", path, "huggingface", aliases=(f"hf.co/{repo}:{path.name}",))


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


# ---- what `pyggml list` prints ----------------------------------------------------------------------------

def file_facts(path: Path) -> tuple[str, str]:
    """(architecture, main weight type) read from a GGUF header without loading it; ("?", "?")
    for a file that cannot be read."""
    from pyggml.backend.metadata import GGUFError, read_gguf_summary

    try:
        summary = read_gguf_summary(path)
    except (GGUFError, OSError):  # a broken file is listed, not fatal
        return "?", "?"
    by_type = summary.elements_by_type
    return summary.config.architecture or "-", max(by_type, key=by_type.get) if by_type else "-"


def check_has_weights(path: Path) -> None:
    """``ValueError`` for a GGUF with a vocabulary and no tensors (llama.cpp's ggml-vocab-*.gguf
    files), which would otherwise fail listing every weight the architecture needs. Reads the header
    natively, skipping the arrays: it runs before every load."""
    from pyggml.backend.metadata import GGUFError, read_gguf_summary

    try:
        summary = read_gguf_summary(path)
    except (GGUFError, OSError):  # not readable here: the loader reports it properly
        return
    if not summary.elements_by_type:
        n_tokens = summary.array_lengths.get("tokenizer.ggml.tokens")
        what = f"a vocabulary of {n_tokens} tokens" if n_tokens is not None else "metadata"
        raise ValueError(f"{path} holds only {what} and no weights: it is a tokenizer file (such as llama.cpp's "
                         "ggml-vocab-*.gguf), not a model that can run")


def human_bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
