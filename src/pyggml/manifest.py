"""Writing Ollama's store (``$OLLAMA_MODELS``, else ``~/.ollama/models``) in Ollama's own layout, so
Ollama runs what pyggml creates and pyggml what Ollama pulled: ``blobs/sha256-<hex>`` (content-addressed
files) and ``manifests/registry.ollama.ai/NAMESPACE/MODEL/TAG`` (a Docker v2 manifest naming a config
blob and one layer per part: ``application/vnd.ollama.image.model`` for the GGUF, ``.params``,
``.system``, ``.template``, ``.license``, ``.messages``, ``.projector``).

``create`` writes a model from a Modelfile's parts, ``copy`` gives a model a second name, ``delete``
removes a name and the blobs no other manifest uses. Reading the store is ``pyggml.store``'s.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from pyggml.modelfile import Modelfile, check_parameters
from pyggml.store import (
    _OLLAMA_MEDIA,
    ModelNotFoundError,
    ModelRef,
    _ollama_parts,
    _ollama_ref,
    list_models,
    ollama_dir,
    resolve,
)

MANIFEST_MEDIA = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_MEDIA = "application/vnd.docker.container.image.v1+json"
_CHUNK = 1 << 20
NO_NETWORK = ("pyggml has no network access: it never downloads or uploads models. Put a GGUF file on this "
              "machine and name it, or make a stored model of it with `pyggml create NAME -f Modelfile` "
              "(FROM ./model.gguf); models `ollama pull` fetched are usable by name")

Status = Callable[[str], None]


def check_digest(digest: Any) -> str:
    """``digest`` if it is ``sha256:<64 hex digits>`` (Ollama also writes ``sha256-``); ``ValueError`` otherwise."""
    text = str(digest).replace("sha256-", "sha256:", 1)
    hexdigest = text.removeprefix("sha256:")
    if not text.startswith("sha256:") or len(hexdigest) != 64 or any(c not in "0123456789abcdef" for c in hexdigest):
        raise ValueError(f"invalid digest {str(digest)!r:.80}: expected sha256:<64 lowercase hex digits>")
    return text


def blob_path(digest: str) -> Path:
    return ollama_dir() / "blobs" / check_digest(digest).replace(":", "-")


def has_blob(digest: str) -> bool:
    return blob_path(digest).is_file()


class BlobWriter:
    """A blob written piece by piece into a temporary file in the store; ``finish`` checks its digest and
    renames it into place (a writer left unfinished removes its file)."""

    def __init__(self) -> None:
        blobs = ollama_dir() / "blobs"
        blobs.mkdir(parents=True, exist_ok=True)
        self._sha = hashlib.sha256()
        fd, self._tmp = tempfile.mkstemp(dir=blobs, prefix=".partial-")
        self._file = os.fdopen(fd, "wb")

    def write(self, chunk: bytes) -> None:
        self._sha.update(chunk)
        self._file.write(chunk)

    def finish(self, digest: str | None = None) -> str:
        """The blob's digest; ``ValueError`` (nothing kept) when it is not ``digest``."""
        self._file.close()
        found = f"sha256:{self._sha.hexdigest()}"
        if digest is not None and found != check_digest(digest):
            raise ValueError(f"digest mismatch: the content hashes to {found}, not {digest}")
        os.replace(self._tmp, blob_path(found))
        return found

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._file.close()
        if os.path.exists(self._tmp):
            os.unlink(self._tmp)


def write_blob(chunks: Iterable[bytes], digest: str | None = None) -> str:
    """Store ``chunks`` as a blob; its digest (``ValueError`` when it is not ``digest``)."""
    with BlobWriter() as writer:
        for chunk in chunks:
            writer.write(chunk)
        return writer.finish(digest)


def import_file(path: Path) -> str:
    """The digest of ``path`` stored as a blob (copied in unless a blob of that content is there)."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
    digest = f"sha256:{sha.hexdigest()}"
    if not has_blob(digest):
        with open(path, "rb") as f:
            write_blob(iter(lambda: f.read(_CHUNK), b""), digest)
    return digest


def _text_layer(kind: str, text: str) -> dict[str, Any]:
    data = text.encode("utf-8")
    return {"mediaType": _OLLAMA_MEDIA + kind, "digest": write_blob([data]), "size": len(data)}


def _json_layer(kind: str, value: Any) -> dict[str, Any]:
    return _text_layer(kind, json.dumps(value))


def manifest_path(name: str) -> Path:
    """Where the manifest of ``name`` ("model", "model:tag", "ns/model:tag") lives; ``ValueError`` for a bad name."""
    parts = _ollama_parts(name)
    if parts is None or not all(_name_ok(p) for p in parts[1:]):
        raise ValueError(f"invalid model name {name!r}: use NAME or NAME:TAG (letters, digits, '.', '-', '_'), "
                         "optionally NAMESPACE/NAME")
    return ollama_dir() / "manifests" / Path(*parts)


def _name_ok(part: str) -> bool:
    return bool(part) and part[0].isalnum() and all(c.isalnum() or c in "._-" for c in part)


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the manifest {path}: {exc}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("layers"), list):
        raise ValueError(f"{path} is not an Ollama manifest (no layers)")
    return manifest


def stored_manifest(name: str) -> Path:
    """The manifest file of a model in Ollama's store; ``ModelNotFoundError`` when there is none."""
    path = manifest_path(name)
    if not path.is_file():
        raise ModelNotFoundError(f"model {name!r} not found in Ollama's store ({ollama_dir()})")
    return path


def find_stored(name: str) -> ModelRef:
    """A model by name only (never a file path): what a server request may name as a base."""
    for ref in list_models():
        if name == ref.name or name in ref.aliases:
            return ref
    raise ModelNotFoundError(f"model {name!r} not found (`pyggml list` shows what there is)")


def create(name: str, spec: Modelfile, *, model_digest: str | None = None, projector_digest: str | None = None,
           by_name_only: bool = False, status: Status = lambda _: None) -> ModelRef:
    """Write model ``name`` from ``spec``: its GGUF is ``model_digest`` (a blob already stored), else
    ``spec.base`` (a GGUF file, copied in, or a stored model, whose layers it starts from; only a name
    when ``by_name_only``); its vision projector ``projector_digest`` or the file ``spec.projector``. The
    Modelfile's parts replace the base's (its parameters are merged over the base's). Returns the new
    model as ``pyggml.store`` finds it."""
    target = manifest_path(name)
    base_params: dict[str, Any] = {}
    if model_digest is not None:
        digest = check_digest(model_digest)
        if not has_blob(digest):
            raise ModelNotFoundError(f"blob {digest} is not in the store: upload it first (POST /api/blobs/{digest})")
        layers = [_file_layer(digest)]
    elif spec.base is not None:
        base = find_stored(spec.base) if by_name_only and spec.base != "demo" else resolve(spec.base)
        if base.source == "ollama":
            base_params = dict(base.params)
            layers = [layer for layer in _read_manifest(stored_manifest(base.name))["layers"] if _kind(layer)]
            status(f"using existing layers of {base.name}")
        else:
            status(f"copying {base.path} into the store")
            layers = [_file_layer(import_file(base.path))]
    else:
        raise ValueError("neither a base model (from) nor a GGUF (files) was given")
    _check_gguf(blob_path(next(layer for layer in layers if _kind(layer) == "model")["digest"]))
    if spec.projector is not None and not by_name_only:
        status(f"copying {spec.projector} into the store")
        projector_digest = import_file(Path(spec.projector).expanduser())
    if projector_digest is not None:
        check_projector(blob_path(check_digest(projector_digest)))
        layers = [layer for layer in layers if _kind(layer) != "projector"] + \
            [{**_file_layer(projector_digest), "mediaType": _OLLAMA_MEDIA + "projector"}]
    status("writing layers")
    params = {**base_params, **check_parameters(spec.parameters)}
    new = {"template": [_text_layer("template", spec.template)] if spec.template is not None else None,
           "system": [_text_layer("system", spec.system)] if spec.system is not None else None,
           "params": [_json_layer("params", params)] if spec.parameters else None,
           "messages": [_json_layer("messages", spec.messages)] if spec.messages else None,
           "license": [_text_layer("license", text) for text in spec.license] or None}
    for kind, replacement in new.items():
        if replacement is not None:  # the Modelfile's part replaces the base's
            layers = [layer for layer in layers if _kind(layer) != kind] + replacement
    status("writing manifest")
    _write_manifest(target, layers)
    created = _ollama_ref(target)
    assert created is not None  # its model layer and blob were written just now
    return created


def _file_layer(digest: str) -> dict[str, Any]:
    return {"mediaType": _OLLAMA_MEDIA + "model", "digest": digest, "size": blob_path(digest).stat().st_size}


def _kind(layer: Any) -> str | None:
    kind = str(layer.get("mediaType", "")) if isinstance(layer, dict) else ""
    return kind[len(_OLLAMA_MEDIA):] if kind.startswith(_OLLAMA_MEDIA) else None


def check_projector(path: Path) -> None:
    """``ValueError`` unless ``path`` is a vision projector GGUF (llama.cpp's mmproj: architecture "clip")."""
    from pyggml.backend.metadata import GGUFError, read_gguf_summary

    try:
        arch = read_gguf_summary(path).config.architecture
    except (GGUFError, OSError) as exc:
        raise ValueError(f"the projector is not a GGUF pyggml can read: {exc}") from None
    if arch != "clip":
        raise ValueError(f"a second model file must be a vision projector (an mmproj GGUF, architecture 'clip'); "
                         f"this one is {arch!r}")


def _check_gguf(path: Path) -> None:
    from pyggml.backend.metadata import GGUFError, read_gguf_summary
    from pyggml.store import check_has_weights

    try:
        read_gguf_summary(path)
    except (GGUFError, OSError) as exc:
        raise ValueError(f"the model file is not a GGUF pyggml can read: {exc}") from None
    check_has_weights(path)


def _config(model_blob: Path, layers: list[dict[str, Any]]) -> dict[str, Any]:
    """The config blob Ollama reads beside the layers: format, family, size and type of the model."""
    from pyggml.backend.metadata import read_gguf_summary
    from pyggml.store import human_count

    summary = read_gguf_summary(model_blob)
    arch = summary.config.architecture or ""
    by_type = summary.elements_by_type
    return {"model_format": "gguf", "model_family": arch, "model_families": [arch],
            "model_type": human_count(summary.n_parameters),
            "file_type": max(by_type, key=by_type.get) if by_type else "",
            "architecture": "amd64", "os": "linux",
            "rootfs": {"type": "layers", "diff_ids": [layer["digest"] for layer in layers]}}


def _write_manifest(target: Path, layers: list[dict[str, Any]]) -> None:
    model = next(layer for layer in layers if _kind(layer) == "model")
    config = json.dumps(_config(blob_path(model["digest"]), layers)).encode()
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST_MEDIA,
                "config": {"mediaType": CONFIG_MEDIA, "digest": write_blob([config]), "size": len(config)},
                "layers": layers}
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".partial-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(manifest, f)
    os.replace(tmp, target)


def copy(source: str, destination: str) -> None:
    """Give the stored model ``source`` a second name (the blobs are shared)."""
    manifest = stored_manifest(source)
    target = manifest_path(destination)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(manifest, target)


def delete(name: str) -> None:
    """Remove the stored model ``name``, and the blobs no other manifest names."""
    manifest = stored_manifest(name)
    data = _read_manifest(manifest)
    digests = {layer.get("digest") for layer in data["layers"] if isinstance(layer, dict)}
    digests.add((data.get("config") or {}).get("digest"))
    manifest.unlink()
    root = ollama_dir() / "manifests"
    parent = manifest.parent
    while parent != root and parent.is_dir() and not any(parent.iterdir()):
        parent.rmdir()
        parent = parent.parent
    for digest in digests - _digests_in_use():
        try:
            blob_path(str(digest)).unlink(missing_ok=True)
        except ValueError:  # a digest Ollama would not write: not ours to remove
            continue


def _digests_in_use() -> set[str]:
    used: set[str] = set()
    for path in (ollama_dir() / "manifests").glob("*/*/*/*"):
        try:
            data = _read_manifest(path)
        except ValueError:
            continue
        used.update(str(layer.get("digest")) for layer in data["layers"] if isinstance(layer, dict))
        used.add(str((data.get("config") or {}).get("digest")))
    return used
