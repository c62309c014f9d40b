"""pyggml: build LLM compute graphs in Python, run them in ggml's native kernels.

Shapes are in ggml order everywhere: ``t.shape[0]`` is the innermost
(contiguous) dimension, so ``t.numpy().shape == tuple(reversed(t.shape))``.

The native core is imported on first use of one of its names, so pure-Python
parts (tokenizers, samplers, the converter) load without the compiled module.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Backend": "pyggml.backend",
    "BackendParams": "pyggml.backend",
    "Context": "pyggml.backend",
    "Device": "pyggml.backend.hardware",
    "devices": "pyggml.backend.hardware",
    "ggml_version": "pyggml.backend.hardware",
    "GGUFError": "pyggml.backend.metadata",
    "Tensor": "pyggml.tensor",
    "DType": "pyggml.tensor",
    "load": "pyggml.llm",
    "LLM": "pyggml.llm",
}

__all__ = ["__version__", *_LAZY]


_SUBMODULES = {"backend", "bench", "chat", "compat", "convert", "kvcache", "llm", "models", "nn", "quantize", "rpc",
               "runner", "sample", "server", "synthetic", "tensor", "tiny", "tokenizer"}


def __dir__() -> list[str]:
    """The public API (``__all__``) and the submodules, though most are imported on first use."""
    return sorted({*globals(), *__all__, *_SUBMODULES})


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:  # `import pyggml; pyggml.models.load(...)` without importing the submodule
        return importlib.import_module(f"pyggml.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pyggml' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
