"""``pyggml serve``: models over HTTP, speaking Ollama's API (``/api/...``) and OpenAI's (``/v1/...``).

The server serves one model named when it starts (``SingleModel``), or every model ``pyggml list``
finds, loaded on demand by name and unloaded when idle or when memory runs short (``ModelManager``).
Each loaded model is a ``ServedModel``: the engine ``pyggml.runner.config.open_engine`` opened from the
server's ``EngineConfig`` (a ``Runner`` batching ``parallel`` sequences), with its request queue, name
and aliases. ``params`` checks requests, ``ollama``/``openai`` translate them, ``guard`` checks
Host/Origin/Content-Type.

``create_app(ServedModel(runner, path))`` gives the Starlette app (for tests and embedding);
``serve(EngineConfig | path, ServerConfig)`` loads and runs uvicorn in this process.
"""

from pyggml.server.app import ServerConfig, create_app, serve
from pyggml.server.service import ServedModel

__all__ = ["ServedModel", "ServerConfig", "create_app", "serve"]
