"""Ollama's model-management routes on the store (``pyggml.manifest``): ``/api/create`` (Ollama's JSON form:
``from`` a stored model, or ``files`` naming a GGUF uploaded first to ``/api/blobs/:digest``; status lines
streamed as NDJSON), ``/api/copy``, ``/api/delete`` and ``/api/blobs/:digest`` (HEAD: whether it is there;
POST: an upload, kept only when its content hashes to the digest). ``/api/pull`` and ``/api/push`` say
that there is no network access. A request can name stored models and uploaded blobs only, never a file
on the server's machine."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pyggml import manifest
from pyggml.modelfile import MESSAGE_ROLES, Modelfile
from pyggml.server.params import APIError, Fields, read_json
from pyggml.store import ModelNotFoundError

CREATE_FIELDS = {"model", "name", "from", "files", "adapters", "template", "license", "system", "parameters",
                 "messages", "quantize", "stream"}


def _api_error(exc: Exception) -> APIError:
    if isinstance(exc, ModelNotFoundError):
        return APIError(404, str(exc))
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    return APIError(500, f"{type(exc).__name__}: {exc}")


async def _in_thread(work: Callable[[], Any]) -> Any:
    try:
        return await asyncio.to_thread(work)
    except (ValueError, OSError) as exc:
        raise _api_error(exc) from None


def _create_request(body: dict[str, Any]) -> tuple[str, Modelfile, str | None, str | None]:
    """(name, what the Modelfile would say, the uploaded GGUF's and projector's digests) of a create request;
    400s name the field. Of two files, the projector is the one whose architecture is "clip"."""
    f = Fields(body, "the request", CREATE_FIELDS)
    name = f.string("model") or f.string("name")
    if not name:
        raise APIError(400, "model is required (the new model's name)", param="model")
    f.unsupported("quantize", what="is not supported by /api/create: quantize with `pyggml quantize` first")
    f.unsupported("adapters", (None, {}), "is not supported: pyggml does not apply LoRA adapters")
    digest = projector = None
    files = f.mapping("files") or {}
    if files:
        if len(files) > 2 or not all(str(k).lower().endswith(".gguf") for k in files):
            raise APIError(400, f"files must name one .gguf file (and at most a vision projector .gguf), got "
                           f"{', '.join(map(str, files))} (safetensors are not converted here: use "
                           "`pyggml convert`)", param="files")
        try:
            digests = [manifest.check_digest(v) for v in files.values()]
        except ValueError as exc:
            raise APIError(400, f"files: {exc}", param="files") from None
        digest, projector = digests[0], digests[1] if len(digests) > 1 else None
    base = f.string("from")
    if (base is None) == (digest is None):
        raise APIError(400, "give either from (a stored model's name) or files (an uploaded GGUF)", param="from")
    license = body.get("license")
    licenses = [license] if isinstance(license, str) else license or []
    if not isinstance(licenses, list) or not all(isinstance(t, str) for t in licenses):
        raise APIError(400, "license must be a string or an array of strings", param="license")
    parameters = f.mapping("parameters") or {}
    messages = f.array("messages") or []
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in MESSAGE_ROLES and isinstance(m.get("content"), str)):
            raise APIError(400, f"messages[{i}] must be an object with a role ({', '.join(MESSAGE_ROLES)}) and a "
                           "string content", param="messages")
    spec = Modelfile(base=base, parameters=dict(parameters), system=f.string("system"),
                     template=f.string("template"), license=list(licenses),
                     messages=[{"role": m["role"], "content": m["content"]} for m in messages])
    if projector is not None and _is_projector(digest):
        digest, projector = projector, digest
    return name, spec, digest, projector


def _is_projector(digest: str) -> bool:
    try:
        manifest.check_projector(manifest.blob_path(digest))
        return True
    except ValueError:
        return False


async def create(request: Request) -> Response:
    body = await read_json(request)
    name, spec, digest, projector = _create_request(body)
    stream = Fields(body, "the request", CREATE_FIELDS).boolean("stream", True)

    def run(status: Callable[[str], None] = lambda _: None) -> Any:
        return manifest.create(name, spec, model_digest=digest, projector_digest=projector, by_name_only=True,
                               status=status)

    if not stream:
        await _in_thread(run)
        return JSONResponse({"status": "success"})
    loop, lines = asyncio.get_running_loop(), asyncio.Queue()
    task = asyncio.ensure_future(asyncio.to_thread(
        run, lambda line: loop.call_soon_threadsafe(lines.put_nowait, {"status": line})))
    task.add_done_callback(lambda _: lines.put_nowait(None))

    async def statuses() -> AsyncIterator[str]:
        while (line := await lines.get()) is not None:
            yield json.dumps(line) + "\n"
        error = task.exception()
        yield json.dumps({"error": _api_error(error).message} if error else {"status": "success"}) + "\n"

    return StreamingResponse(statuses(), media_type="application/x-ndjson")


async def copy(request: Request) -> Response:
    body = await read_json(request)
    f = Fields(body, "the request", {"source", "destination"})
    source, destination = f.string("source"), f.string("destination")
    if not source or not destination:
        raise APIError(400, "source and destination are required", param="source" if not source else "destination")
    await _in_thread(lambda: manifest.copy(source, destination))
    return Response(status_code=200)


async def delete(request: Request) -> Response:
    body = await read_json(request)
    f = Fields(body, "the request", {"model", "name"})
    name = f.string("model") or f.string("name")
    if not name:
        raise APIError(400, "model is required", param="model")
    await _in_thread(lambda: manifest.delete(name))
    return Response(status_code=200)


async def blob(request: Request) -> Response:
    try:
        digest = manifest.check_digest(request.path_params["digest"])
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    if request.method == "HEAD":
        return Response(status_code=200 if manifest.has_blob(digest) else 404)
    if manifest.has_blob(digest):  # Ollama answers an upload of a blob it has at once
        return Response(status_code=200)
    with manifest.BlobWriter() as writer:
        async for chunk in request.stream():
            writer.write(chunk)
        try:
            writer.finish(digest)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
    return Response(status_code=201)


async def no_network(request: Request) -> Response:
    raise APIError(501, f"{request.url.path}: {manifest.NO_NETWORK}")


routes = [
    Route("/api/create", create, methods=["POST"]),
    Route("/api/copy", copy, methods=["POST"]),
    Route("/api/delete", delete, methods=["DELETE"]),
    Route("/api/blobs/{digest}", blob, methods=["HEAD", "POST"]),
    Route("/api/pull", no_network, methods=["POST"]),
    Route("/api/push", no_network, methods=["POST"]),
]
