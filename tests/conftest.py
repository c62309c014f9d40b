"""Shared fixtures: one CPU backend per session and the path of the shared real-model files.

Strictness under ``CI=true`` (set by CI services, and by ``.ci/run``): a test that would skip because
something is missing (``../shared/models``, ``ruff``, a reference package such as torch,
transformers or llama-cpp-python) fails instead, so a green CI run means every check ran. A test
that may legitimately skip in CI says so with ``@pytest.mark.ci_may_skip``. Hypothesis runs
derandomized in CI (the same examples every run); elsewhere it draws a fresh seed per session and
the report header prints it (rerun with ``--hypothesis-seed=N``).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

os.environ.setdefault("GGML_NO_BACKTRACE", "1")  # a ggml abort must not fork gdb

SHARED_MODELS = Path(__file__).resolve().parents[1].parent / "shared" / "models"
CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
# PYGGML_TEST_DEVICE=gpu: the registry and parity tests place every layer on the GPU
# (test_architectures.py); without a GPU they skip (marked ci_may_skip there)
TEST_DEVICE = os.environ.get("PYGGML_TEST_DEVICE", "cpu").strip().lower() or "cpu"
if TEST_DEVICE not in ("cpu", "gpu"):
    raise pytest.UsageError(f"PYGGML_TEST_DEVICE must be cpu or gpu, got {TEST_DEVICE!r}")


def gpu_present() -> bool:
    import pyggml

    return any(d.kind in ("gpu", "igpu") for d in pyggml.devices())

try:
    from hypothesis import settings as _hypothesis_settings
except ImportError:  # the `test` extra has it; the tests that use it fail to import
    _hypothesis_settings = None
else:
    _hypothesis_settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
    _hypothesis_settings.register_profile("dev", print_blob=True)
    # loaded at import, before the test modules build their settings objects from the default
    _hypothesis_settings.load_profile("ci" if CI else "dev")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    config.addinivalue_line("markers", "ci_may_skip: the test may skip under CI=true (e.g. it needs a GPU)")
    # a seed for this session unless one is given (before Hypothesis' plugin reads the option)
    if not CI and _hypothesis_settings is not None and getattr(config.option, "hypothesis_seed", "") is None:
        config.option.hypothesis_seed = str(random.randrange(1 << 32))


def pytest_report_header(config):
    if _hypothesis_settings is None:
        return "hypothesis: not installed"
    if CI:
        return "CI=true: missing models or packages fail; hypothesis derandomized (profile 'ci')"
    seed = getattr(config.option, "hypothesis_seed", None)
    return f"hypothesis seed: {seed} (rerun the same examples with --hypothesis-seed={seed})"


def _fail_skip(report, what: str) -> None:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (f"{what} skipped under CI=true: {reason}\n(CI must have ../shared/models and every "
                       "extra installed: pip install -e '.[test,reference,bench]')")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if CI and report.skipped and not hasattr(report, "wasxfail") and not item.get_closest_marker("ci_may_skip"):
        _fail_skip(report, item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if CI and report.skipped:  # a module-level importorskip / skip
        _fail_skip(report, collector.nodeid)


@pytest.fixture(scope="session")
def cpu():
    """A weight-less CPU backend (2 threads) for scratch computation, shared by the session."""
    from pyggml import Backend

    backend = Backend.cpu(n_threads=2)
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def stories_tokenizer():
    """stories260K's tokenizer (no weights), for the grammar tests (which need llguidance)."""
    pytest.importorskip("llguidance", reason="constrained output needs llguidance")
    import gguf

    from pyggml.tokenizer import from_metadata

    path = SHARED_MODELS / "stories260K.gguf"
    if not path.exists():
        pytest.skip(f"{path} is not there")
    reader = gguf.GGUFReader(path)
    return from_metadata({f.name: f.contents() for f in reader.fields.values()})


@pytest.fixture(scope="session")
def shared_models() -> Path:
    """``/work/shared/models`` (real GGUF files); skips the test when it is absent (fails under CI)."""
    if not SHARED_MODELS.is_dir():
        pytest.skip(f"shared models not found at {SHARED_MODELS}")
    return SHARED_MODELS


def record_calls(monkeypatch, owner, name: str, note=lambda result: result) -> list:
    """Wrap ``owner.<name>`` (a method or a staticmethod) for the test: each call's ``note(result)`` is appended
    to the list returned."""
    import inspect

    original = inspect.getattr_static(owner, name)
    static = isinstance(original, staticmethod)
    function = original.__func__ if static else original
    notes: list = []

    def recorded(*args, **kwargs):
        result = function(*args, **kwargs)
        notes.append(note(result))
        return result

    monkeypatch.setattr(owner, name, staticmethod(recorded) if static else recorded)
    return notes


def chained_steps(monkeypatch) -> list[bool]:
    """Per step the runner's worker computed, whether it launched the next itself (``Runner._chain``)."""
    from pyggml.runner import Runner

    return record_calls(monkeypatch, Runner, "_go_on", lambda out: out[0] is not None)


def hold_computes(monkeypatch, seconds: float) -> None:
    """Make every ``Engine.compute`` last ``seconds`` longer after its native compute: a device slower than the
    host, so that with build-ahead the runner thread waits for each step (and offers the worker the next)."""
    import time

    from pyggml.runner.engine import Engine

    compute = Engine.compute

    def held(self, *args, **kwargs):
        out = compute(self, *args, **kwargs)
        time.sleep(seconds)
        return out

    monkeypatch.setattr(Engine, "compute", held)
