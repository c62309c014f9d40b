"""The code base stays `ruff` clean (the rules are in pyproject.toml)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None,
                    reason="ruff is not installed for this Python (the `test` extra has it)")
def test_ruff_clean():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "src", "tests", "bench"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
