"""bench/compare_runner_llamacpp.py: a smoke run of the two in-process engines on the tiny synthetic
model (F16, which every llama.cpp build runs, AMX or not), and its agreement check. Timings are not
checked. Skipped when llama_cpp is not installed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "compare_runner_llamacpp.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("compare_runner_llamacpp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_agreement_check(script):
    a = {"prompt_ids": [[1, 5, 6], [1, 7]], "tokens": [[3, 4, 5], [8, 9, 10]]}
    assert script.check_agreement(a, json.loads(json.dumps(a)), 3) == []
    b = {"prompt_ids": [[1, 5, 6], [1, 7, 7]], "tokens": [[3, 4, 6], [8, 9, 10]]}
    problems = script.check_agreement(a, b, 2)
    assert len(problems) == 1 and "sequence 1" in problems[0] and "tokenized" in problems[0]
    assert len(script.check_agreement(a, b, 3)) == 2


def test_smoke_in_process_engines(tmp_path):
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (pip install -e '.[bench]')")
    out = tmp_path / "out.json"
    env = {**os.environ, "PYGGML_CACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, str(SCRIPT), "--synthetic", "tiny", "--type", "f16", "--engines", "pyggml,llama.cpp",
           "-P", "2", "-n", "4", "--prompt-tokens", "12", "--ttft-tokens", "24", "--rounds", "1", "-t", "1",
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    result = doc["result"]
    (row,) = result["throughput"]
    assert row["parallel"] == 2
    for engine in ("pyggml", "llama.cpp"):
        assert row[engine]["generated"] == 8 and row[engine]["tok_s"]["avg"] > 0, row[engine]
        ttft = result["ttft"][engine]
        assert ttft["uncached_s"]["avg"] > 0 and ttft["prompt_tokens"][1] > ttft["prompt_tokens"][0] >= 24
        assert ttft["cached_tokens"] >= 24
    assert result["agreement"]["2"][0].startswith("ok"), result["agreement"]
    assert "pyggml/llama.cpp" in row["ratios"]
    assert "| 2 |" in proc.stdout
