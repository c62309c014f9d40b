"""Fail when a benchmark figure regressed against a baseline.

    python bench/compare_baseline.py BASELINE.json CURRENT.json [--threshold 0.10] [--stat mean]

Reads either kind of file (each side may be either):
- pytest-benchmark ``--benchmark-json`` output: one time per benchmark (``stats.<stat>``, lower is
  better), keyed by the benchmark's ``fullname``;
- ``pyggml bench -o json`` output: ``avg_ts`` tokens/s per test (higher is better), keyed by the
  test and its settings (``pp512 t=2 b=512 ngl=0 fa=0 kv=f16``).

A figure regresses when it is more than ``threshold`` slower: a time above ``baseline * (1 +
threshold)``, or a rate below ``baseline / (1 + threshold)``. Exit status: 1 listing every
regression, 0 when none; 2 for unreadable input. Figures present on one side only are listed
but do not fail the comparison.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

STATS = ("mean", "median", "min", "max")


class Figure:
    """One comparable number: its value and whether higher is better."""

    __slots__ = ("value", "higher_is_better", "unit")

    def __init__(self, value: float, higher_is_better: bool, unit: str):
        self.value, self.higher_is_better, self.unit = float(value), higher_is_better, unit


def figures(path: Path, stat: str = "mean") -> dict[str, Figure]:
    """The figures of a pytest-benchmark or pyggml bench JSON file, by name."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read JSON: {e}") from None
    if isinstance(doc, dict) and isinstance(doc.get("benchmarks"), list):
        return {b["fullname"]: Figure(b["stats"][stat], False, "s") for b in doc["benchmarks"]}
    if isinstance(doc, dict) and isinstance(doc.get("results"), list):
        return {_bench_key(r): Figure(r["avg_ts"], True, "tokens/s") for r in doc["results"]}
    raise ValueError(f"{path}: neither pytest-benchmark JSON ('benchmarks') nor pyggml bench JSON ('results')")


def _bench_key(r: dict[str, Any]) -> str:
    return (f"{r['test']} t={r['n_threads']} b={r['n_batch']} ngl={r['n_gpu_layers']} "
            f"fa={int(r['flash_attn'])} kv={r['cache_type']}")


def slowdown(base: Figure, cur: Figure) -> float:
    """How much slower ``cur`` is than ``base``, as a fraction (0.2 = takes 20% longer)."""
    if base.higher_is_better:
        return base.value / cur.value - 1.0 if cur.value > 0 else float("inf")
    return cur.value / base.value - 1.0 if base.value > 0 else 0.0


def compare(baseline: dict[str, Figure], current: dict[str, Figure], threshold: float) -> tuple[list[str], list[str]]:
    """(regressions, notes): one line per regressed figure, one per figure missing on a side."""
    regressions, notes = [], []
    for name in sorted(baseline):
        if name not in current:
            notes.append(f"missing in current: {name}")
            continue
        base, cur = baseline[name], current[name]
        change = slowdown(base, cur)
        if change > threshold:
            regressions.append(f"{name}: {base.value:.6g} -> {cur.value:.6g} {cur.unit} ({change:+.1%} slower)")
    notes += [f"new in current: {name}" for name in sorted(set(current) - set(baseline))]
    return regressions, notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("baseline", type=Path)
    parser.add_argument("current", type=Path)
    parser.add_argument("--threshold", type=float, default=0.10, help="allowed slowdown (default 0.10 = 10%%)")
    parser.add_argument("--stat", choices=STATS, default="mean", help="pytest-benchmark statistic (default mean)")
    args = parser.parse_args(argv)
    try:
        baseline, current = figures(args.baseline, args.stat), figures(args.current, args.stat)
    except (ValueError, KeyError, TypeError) as e:
        print(f"compare_baseline: error: {e}", file=sys.stderr)
        return 2
    regressions, notes = compare(baseline, current, args.threshold)
    for line in notes:
        print(f"note: {line}")
    if regressions:
        print(f"{len(regressions)} figure(s) regressed by more than {args.threshold:.0%}:")
        for line in regressions:
            print(f"  {line}")
        return 1
    print(f"ok: {len(set(baseline) & set(current))} figure(s) within {args.threshold:.0%} of the baseline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
