"""Facts about models for people: architecture, parameter count, quantization."""

from __future__ import annotations

from typing import Any


def human_count(n: int) -> str:
    """A parameter count as people write it: 260K, 1.1B, 8B, 950 (never "0.00 B")."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}" if n < 10 * size else f"{n / size:.0f}{unit}"
    return str(n)


def tensor_summary(tensors: Any) -> tuple[int, str, dict[str, int]]:
    """(parameter count, main type, elements per type) of a ``Backend.tensors()`` mapping."""
    by_type: dict[str, int] = {}
    for t in tensors.values():
        by_type[t.dtype.name] = by_type.get(t.dtype.name, 0) + t.nelements
    total = sum(by_type.values())
    return total, max(by_type, key=by_type.get) if by_type else "-", by_type


def describe(model: Any) -> dict[str, Any]:
    """What ``/show info`` prints about a loaded model."""
    config = model.config
    n_params, quant, _ = tensor_summary(model.backend.tensors())
    return {
        "architecture": config.architecture or "-",
        "name": config.get("general.name") or "-",
        "parameters": human_count(n_params),
        "quantization": quant,
        "context length": model.context_length or "-",
        "embedding length": config.uint("embedding_length", 0) or "-",
    }
