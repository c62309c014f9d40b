"""``pyggml create``, ``cp``, ``rm`` (Ollama's store, written in Ollama's layout: ``pyggml.manifest``),
``ps`` and ``stop`` (ask the running server, as ``ollama ps``/``ollama stop`` do), and ``pull``/``push``,
which say that pyggml has no network access."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_parsers(sub: Any) -> None:
    """Register the model-management commands on the ``pyggml`` command's subparsers."""
    create = sub.add_parser("create", help="make a stored model from a Modelfile (written to Ollama's store)")
    create.add_argument("name", help="the new model's name (NAME or NAME:TAG)")
    create.add_argument("-f", "--file", default="Modelfile", metavar="MODELFILE",
                        help="the Modelfile (default: ./Modelfile); FROM names a GGUF file or a stored model")
    create.set_defaults(func=cmd_create)

    cp = sub.add_parser("cp", help="copy a stored model to a new name")
    cp.add_argument("source")
    cp.add_argument("destination")
    cp.set_defaults(func=cmd_cp)

    rm = sub.add_parser("rm", help="remove stored models (and the files no other model uses)")
    rm.add_argument("names", nargs="+", metavar="name")
    rm.set_defaults(func=cmd_rm)

    for name, what in (("ps", "models the running server has loaded"),
                       ("stop", "unload a model from the running server")):
        command = sub.add_parser(name, help=what)
        if name == "stop":
            command.add_argument("model")
        command.add_argument("--host", default=None,
                             help="the server, HOST[:PORT] (default: $PYGGML_HOST, else $OLLAMA_HOST, else "
                                  "127.0.0.1:11434)")
        command.set_defaults(func=cmd_ps if name == "ps" else cmd_stop)

    for name in ("pull", "push"):
        command = sub.add_parser(name, help="not available: pyggml has no network access")
        command.add_argument("model")
        command.set_defaults(func=cmd_no_network)


def cmd_create(args: argparse.Namespace) -> int:
    from pyggml import manifest, modelfile

    path = Path(args.file).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SystemExit(f"pyggml create: cannot read the Modelfile {path}: {exc.strerror or exc}") from None
    try:
        spec = modelfile.parse(text)
    except ValueError as exc:
        raise SystemExit(f"pyggml create: {path}: {exc}") from None
    for part in ("base", "projector"):  # a relative FROM path counts from the Modelfile, as in Ollama
        value = getattr(spec, part)
        if value is not None and not Path(value).expanduser().is_file() and (path.parent / value).is_file():
            setattr(spec, part, str(path.parent / value))
    if spec.template is not None:
        print("pyggml: note: the TEMPLATE is stored for Ollama (a Go template); pyggml itself renders the GGUF's "
              "own chat template", file=sys.stderr)
    ref = manifest.create(args.name, spec, status=lambda line: print(line, file=sys.stderr))
    print(f"success: created {ref.name}", file=sys.stderr)
    return 0


def cmd_cp(args: argparse.Namespace) -> int:
    from pyggml import manifest

    manifest.copy(args.source, args.destination)
    print(f"copied '{args.source}' to '{args.destination}'", file=sys.stderr)
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from pyggml import manifest
    from pyggml.store import ModelNotFoundError, resolve

    for name in args.names:
        try:
            manifest.delete(name)
        except (ModelNotFoundError, ValueError):  # not a stored name: say what it is
            try:
                ref = resolve(name)
            except ModelNotFoundError:
                raise ValueError(f"model {name!r} not found") from None
            if ref.source == "ollama":
                raise
            raise ValueError(f"{name!r} is the file {ref.path} ({ref.source}), not a model in Ollama's store: "
                             "delete the file itself") from None
        print(f"deleted '{name}'", file=sys.stderr)
    return 0


def cmd_ps(args: argparse.Namespace) -> int:
    from pyggml.store import human_bytes

    models = _ask(args.host, "GET", "/api/ps")["models"]
    rows = [("NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL")]
    for m in models:
        until = "Forever" if str(m.get("expires_at", "")).startswith("2999") else str(m.get("expires_at", ""))
        vram = m.get("size_vram") or 0
        processor = "100% GPU" if vram and vram >= m.get("size", 0) else "100% CPU"
        rows.append((m["name"], str(m.get("digest", "")).removeprefix("sha256:")[:12], human_bytes(m.get("size", 0)),
                     processor, str(m.get("context_length", "")), until))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("    ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    loaded = {m["name"] for m in _ask(args.host, "GET", "/api/ps")["models"]}
    if args.model not in loaded and f"{args.model}:latest" not in loaded:
        raise ValueError(f"model {args.model!r} is not loaded (`pyggml ps` lists the loaded models)")
    _ask(args.host, "POST", "/api/generate", {"model": args.model, "keep_alive": 0})
    return 0


def show_parts(ref: Any, name: str, parts: list[str]) -> int:
    """``pyggml show NAME --modelfile`` (``--parameters``, ``--system``, ``--template``, ``--license``): a
    model's parts as Ollama prints them; the template is the GGUF's chat template, the one pyggml renders."""
    from pyggml.backend.metadata import read_gguf_summary
    from pyggml.modelfile import parameters_text, render

    config = read_gguf_summary(ref.path).config
    texts = {
        "modelfile": render(name, str(ref.path), template=ref.template, system=ref.system, parameters=ref.params,
                            license=ref.license, messages=ref.messages).rstrip("\n"),
        "parameters": parameters_text(ref.params),
        "system": ref.system or "",
        "template": config.get("tokenizer.chat_template") or "",
        "license": "\n\n".join(ref.license) or config.get("general.license") or "",
    }
    for part in parts:
        print(texts[part])
    return 0


def cmd_no_network(args: argparse.Namespace) -> int:
    from pyggml.manifest import NO_NETWORK

    print(f"pyggml {args.command}: {NO_NETWORK}", file=sys.stderr)
    return 1


def _ask(host: str | None, method: str, route: str, body: dict | None = None) -> dict[str, Any]:
    """The JSON answer of the server at ``host`` (``ValueError`` with its error, ``OSError`` when none runs)."""
    import urllib.error
    import urllib.request

    from pyggml.cli import _listen_address

    address, port = _listen_address(host or "127.0.0.1", None)
    address = "127.0.0.1" if address in ("0.0.0.0", "") else "[::1]" if address == "::" else address
    url = f"http://{f'[{address}]' if ':' in address and not address.startswith('[') else address}:{port}{route}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read()).get("error", exc.reason)
        except ValueError:
            message = exc.reason
        raise ValueError(f"the server answered {exc.code}: {message}") from None
    except urllib.error.URLError as exc:
        raise OSError(f"no pyggml server is running at {url.removesuffix(route)} ({exc.reason}); start one with "
                      "`pyggml serve`, or name it with --host / OLLAMA_HOST") from None
