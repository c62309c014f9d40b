"""The code base stays `ruff` clean (the rules are in pyproject.toml), and model files stay leaves."""

import ast
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


def test_model_files_use_no_other_model_files_private_names():
    """A model file is a leaf (docs/porting.md): what it shares with another architecture lives in ``nn`` or
    is a public name of its family, never another model file's ``_private`` helper."""
    found = []
    for path in sorted((ROOT / "src" / "pyggml" / "models").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pyggml.models."):
                if node.module.rsplit(".", 1)[1] != path.stem:
                    found += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and isinstance(node.value, ast.Name) and (ROOT / "src" / "pyggml" / "models" /
                                                              f"{node.value.id}.py").is_file() \
                    and node.value.id != path.stem:
                found.append(f"{path.name}: {node.value.id}.{node.attr}")
    assert not found, "private names of other model files (move the shared piece into nn): " + ", ".join(found)
