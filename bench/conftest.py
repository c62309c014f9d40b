"""The benchmark suite (pytest-benchmark): ``python -m pytest bench/ --benchmark-only``.

Not part of the default ``python -m pytest`` run (pyproject's testpaths is ``tests``). Files here
are named ``bench_*.py``; this hook collects them when the directory is given.
"""

from __future__ import annotations

import pytest


def pytest_collect_file(file_path, parent):
    # files named on the command line are collected by pytest itself; this adds the rest of bench/
    if file_path.suffix == ".py" and file_path.name.startswith("bench_") and \
            not parent.session.isinitpath(file_path):
        return pytest.Module.from_parent(parent, path=file_path)
    return None
