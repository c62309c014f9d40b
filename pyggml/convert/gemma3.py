"""Gemma 3 text (GGUF ``gemma3``): Gemma 2 without soft-capping, with per-head q/k RMSNorm, and two
rope bases: one for the sliding-window layers, one (possibly scaled) for the global layers."""

from __future__ import annotations

from typing import Any

import gguf

from .base import register
from .gemma2 import Gemma2


@register("Gemma3ForCausalLM", model_types=("gemma3_text",))
class Gemma3(Gemma2):
    gguf_arch = "gemma3"
    default_context = 131072
    large_model_layers = 62

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        local = self._local_rope()
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope scaling {local['rope_type']!r} on sliding-window layers")
        w.add_rope_freq_base_swa(float(local.get("rope_theta", 10000.0)))

    def expected(self) -> dict[str, tuple[int, ...]]:
        head = (self.head_dim,)
        return super().expected() | {"blk.{bid}.attn_q_norm.weight": head, "blk.{bid}.attn_k_norm.weight": head}

    def _local_rope(self) -> dict[str, Any]:
        params = self.config.get("rope_parameters") or {}
        if "sliding_attention" in params:
            return params["sliding_attention"]
        return {"rope_theta": self.config.get("rope_local_base_freq", 10000.0)}

    def _rope_parameters(self) -> dict[str, Any]:
        # transformers 5 keeps one rope per layer type; the global layers' goes in the usual keys
        params = self.config.get("rope_parameters") or {}
        if "full_attention" in params:
            rope = dict(params["full_attention"])
            rope["rope_type"] = rope.get("rope_type", rope.get("type")) or "default"
            if rope["rope_type"] not in self.rope_types:
                raise ValueError(f"unsupported rope scaling type {rope['rope_type']!r} for gemma3")
            return rope
        return super()._rope_parameters()
