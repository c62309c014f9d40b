"""Cross-site protection, as Ollama does it: a web page the user visits must not be able to drive
the local server (CSRF) or reach it under its own name (DNS rebinding).

- ``Host``: a server bound to a loopback address answers only requests addressed to an IP
  literal, ``localhost``, this machine's name or a ``*.localhost``/``*.local``/``*.internal`` name,
  plus the names given in ``allowed_hosts`` (``"*"``: any; ``".example.com"`` or ``"*.example.com"``:
  that domain and its subdomains). Bound to any other address, it answers any name unless
  ``allowed_hosts`` is given. Otherwise 403.
- ``Origin`` (browsers send it with every cross-site request): allowed when it matches
  ``DEFAULT_ORIGINS`` or one of ``origins`` (``*`` matches a run of characters within a name or
  port, never ``/ @ ? # :``; ``"*"`` alone allows every origin), with the CORS headers a browser
  needs; otherwise 403. Requests without an Origin (curl, the Python clients) pass.
- Bodies must be JSON: ``Content-Type`` absent, ``application/json`` or ``*+json``. ``curl -d``'s
  ``application/x-www-form-urlencoded`` is accepted only without an ``Origin`` (a browser form
  always sends one), ``application/octet-stream`` only for an upload to ``/api/blobs/``; any other type
  is a 415.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_ORIGINS = tuple(
    f"{scheme}://{host}{port}" for host in ("localhost", "127.0.0.1", "0.0.0.0", "[::1]")
    for scheme in ("http", "https") for port in ("", ":*")
) + ("app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*")
LOCAL_SUFFIXES = (".localhost", ".local", ".internal")
ALLOW_HEADERS = "Authorization, Content-Type, User-Agent, Accept, X-Requested-With, OpenAI-Beta"
ALLOW_METHODS = "GET, POST, PUT, PATCH, DELETE, HEAD, OPTIONS"
# what a ``*`` in an origin pattern matches: an origin is ``scheme://host[:port]``, so a wildcard stays
# within one host label or port and never spans the characters that end or redirect an authority
# (``http://localhost:*`` must not match ``http://localhost:80@evil.example``)
_WILDCARD = r"[^/@?#:\\\s]*"


def split_list(value: str | Iterable[str] | None) -> list[str]:
    """A comma-separated setting (``--origins``, ``PYGGML_ORIGINS``, ...) as a list."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else value
    return [item.strip() for item in items if item and item.strip()]


def is_loopback(host: str) -> bool:
    """Whether a bind address reaches this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Guard:
    """ASGI middleware applying the Host, Origin and Content-Type rules above."""

    def __init__(self, app: ASGIApp, *, bind_host: str = "127.0.0.1", allowed_hosts: Iterable[str] | None = None,
                 origins: Iterable[str] = ()):
        self.app = app
        self.allowed_hosts = [h.lower() for h in split_list(allowed_hosts)] if allowed_hosts is not None else None
        self.any_host = (self.allowed_hosts is None and not is_loopback(bind_host)) or \
            "*" in (self.allowed_hosts or [])
        patterns = [*DEFAULT_ORIGINS, *split_list(origins)]
        self.any_origin = "*" in patterns
        self._origins = re.compile("|".join(_WILDCARD.join(map(re.escape, p.lower().split("*"))) for p in patterns))
        try:
            self.hostname = socket.gethostname().lower()
        except OSError:  # pragma: no cover
            self.hostname = ""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        refusal = self._refusal(scope, headers, origin)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        if origin is None:
            await self.app(scope, receive, send)
            return
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:  # a CORS preflight
            allow = {"Access-Control-Allow-Origin": origin, "Access-Control-Allow-Methods": ALLOW_METHODS,
                     "Access-Control-Allow-Headers": headers.get("access-control-request-headers") or ALLOW_HEADERS,
                     "Access-Control-Max-Age": "600", "Vary": "Origin"}
            await Response(status_code=204, headers=allow)(scope, receive, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                out = MutableHeaders(scope=message)
                out["Access-Control-Allow-Origin"] = origin
                out.add_vary_header("Origin")
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _refusal(self, scope: Scope, headers: Headers, origin: str | None) -> Response | None:
        path = scope.get("path", "")
        host = headers.get("host", "")
        if not self.host_allowed(host):
            return _error(path, 403, f"Host {host!r} is not allowed: this server answers requests to local names "
                          "only (start it with --allowed-hosts NAME, or PYGGML_ALLOWED_HOSTS, to allow others)")
        if origin is not None and not self.origin_allowed(origin):
            return _error(path, 403, f"Origin {origin!r} is not allowed (start the server with --origins "
                          f"{origin}, or PYGGML_ORIGINS, to allow it)")
        if scope["method"] in ("POST", "PUT", "PATCH"):
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            form = kind == "application/x-www-form-urlencoded" and origin is None  # `curl -d`
            upload = kind == "application/octet-stream" and path.startswith("/api/blobs/")  # a model file
            if kind and kind != "application/json" and not kind.endswith("+json") and not form and not upload:
                return _error(path, 415, f"request bodies must be JSON: send Content-Type: application/json "
                              f"(got {kind!r})")
        return None

    def host_allowed(self, host: str) -> bool:
        if self.any_host:
            return True
        name = _strip_port(host).lower().rstrip(".")
        if not name or name == "localhost" or name == self.hostname or name.endswith(LOCAL_SUFFIXES):
            return True
        try:
            ipaddress.ip_address(name.strip("[]"))
            return True  # an IP literal: DNS rebinding needs a name
        except ValueError:
            pass
        for allowed in self.allowed_hosts or ():
            domain = allowed[1:] if allowed.startswith("*.") else allowed if allowed.startswith(".") else None
            if name == allowed or (domain is not None and (name.endswith(domain) or name == domain[1:])):
                return True
        return False

    def origin_allowed(self, origin: str) -> bool:
        return self.any_origin or self._origins.fullmatch(origin.lower()) is not None


def _strip_port(host: str) -> str:
    if host.startswith("["):  # [v6]:port
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _error(path: str, status: int, message: str) -> Response:
    if path.startswith("/v1/"):
        kind = "invalid_request_error" if status < 500 else "server_error"
        return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                            status_code=status)
    return JSONResponse({"error": message}, status_code=status)
