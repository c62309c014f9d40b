"""Shared fixtures: one CPU backend per session and the path of the shared real-model files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("GGML_NO_BACKTRACE", "1")  # a ggml abort must not fork gdb

SHARED_MODELS = Path(__file__).resolve().parents[1].parent / "shared" / "models"


@pytest.fixture(scope="session")
def cpu():
    """A weight-less CPU backend (2 threads) for scratch computation, shared by the session."""
    from pyggml import Backend

    backend = Backend.cpu(n_threads=2)
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def shared_models() -> Path:
    """``/work/shared/models`` (real GGUF files); skips the test when it is absent."""
    if not SHARED_MODELS.is_dir():
        pytest.skip(f"shared models not found at {SHARED_MODELS}")
    return SHARED_MODELS
