"""bench/compare_servers.py end to end on a tiny random model: `pyggml serve` against a stand-in for
llama.cpp's llama-server (a script that takes llama-server's arguments and serves with pyggml), so
the race, the streamed client and the table run without a llama.cpp build. Checks counts, not
timings."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAKE = """#!{python}
import sys
args = sys.argv[1:]
if "--help" in args:
    print("usage: llama-server ... -np N -c N -t N -fa [on|off|auto] --no-kv-unified --no-webui")
    sys.exit(0)
opt = {{args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("-")}}
assert "--no-kv-unified" in args and opt["-fa"] in ("on", "off", "auto")
sys.path.insert(0, {src!r})
from pyggml.server.app import serve
parallel = int(opt["-np"])
sys.exit(serve(opt["-m"], host=opt["--host"], port=int(opt["--port"]), parallel=parallel,
               num_ctx=int(opt["-c"]) // parallel, n_threads=int(opt["-t"]), log_level="warning"))
"""


def _load_bench():
    spec = importlib.util.spec_from_file_location("compare_servers", ROOT / "bench" / "compare_servers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from pyggml.synthetic import write_synthetic

    return write_synthetic(tmp_path_factory.mktemp("servers") / "tiny.gguf", "tiny", "f32")


def test_race_against_a_stand_in(tiny, tmp_path, capsys):
    pytest.importorskip("uvicorn")
    fake = tmp_path / "llama-server"
    fake.write_text(FAKE.format(python=sys.executable, src=str(ROOT / "src")))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "race.json"
    bench = _load_bench()
    status = bench.main([str(tiny), "--llama-server", str(fake), "-P", "1,2", "-n", "5", "--requests", "2",
                         "--rounds", "1", "--threads", "1", "--ctx", "256", "--json", str(out), "--quiet",
                         "--logs", str(tmp_path / "logs")])
    printed = capsys.readouterr().out
    assert status == 0, printed
    report = json.loads(out.read_text())
    assert [r["parallel"] for r in report["results"]] == [1, 2]
    for res in report["results"]:
        assert not res["errors"]
        assert set(res["ratio"]) == set(bench.METRICS)
        for name in ("pyggml", "llama-server"):
            (one,) = res["rounds"][name]
            # ignore_eos: every request generates exactly n tokens on both
            assert one["requests"] == 2 * res["parallel"] and one["short_requests"] == 0
            assert one["tokens"] == 5 * one["requests"]
            assert one["events"] >= one["requests"]
    assert "| 2 | pyggml/llama-server |" in printed


def test_ignore_eos_is_refused_when_not_a_boolean(tiny):
    pytest.importorskip("uvicorn")
    import httpx

    from ._server import running_server

    with running_server(tiny) as (base, served):
        body = {"model": served.name, "prompt": "a", "ignore_eos": "yes"}
        bad = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert bad.status_code == 400 and "ignore_eos" in bad.text
        ok = httpx.post(base + "/v1/completions", json={"model": served.name, "prompt": "a", "max_tokens": 6,
                                                        "temperature": 0, "ignore_eos": True}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 6


if os.name == "nt":  # the stand-in is a shebang script
    pytestmark = pytest.mark.skip("POSIX only")
