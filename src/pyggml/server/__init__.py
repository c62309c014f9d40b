"""``pyggml serve``: one model over HTTP, speaking Ollama's API (``/api/...``) and OpenAI's
(``/v1/...``), on top of ``pyggml.runner.Runner`` (continuous batching of ``parallel`` sequences).

``create_app(ServedModel(runner, path))`` gives the Starlette app (for tests and embedding);
``serve(path, ...)`` loads the model and runs uvicorn in this process.
"""

from pyggml.server.app import create_app, serve
from pyggml.server.service import ServedModel

__all__ = ["ServedModel", "create_app", "serve"]
