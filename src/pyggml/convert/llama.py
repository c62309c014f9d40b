"""Llama and Mistral (GGUF ``llama``): q/k rows reordered for ggml's interleaved rope, Llama 3.1 rope
factors as ``rope_freqs.weight``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import gguf
import numpy as np

from .base import Architecture, register
from .tensors import Source


@register("LlamaForCausalLM", "MistralForCausalLM", model_types=("llama", "mistral"))
class Llama(Architecture):
    gguf_arch = "llama"
    rope_types = ("default", "linear", "yarn", "llama3")
    interleave_qk: ClassVar[bool] = True  # HF's half-split rope rows -> ggml's adjacent pairs (False: already adjacent)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for flag in ("attention_bias", "mlp_bias"):
            if self.config.get(flag):
                raise ValueError(f"config.json sets {flag}=true; biases are not supported by this converter")
        self.rope.setdefault("rope_theta", 10000.0)

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        w.add_rope_dimension_count(self.head_dim)
        w.add_vocab_size(self.n_vocab)

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        for gguf_name, out in super().tensors(name, source):
            if self.interleave_qk and gguf_name.endswith((".attn_q.weight", ".attn_k.weight")):
                heads = self.n_heads if ".attn_q." in gguf_name else self.n_kv_heads
                out = out.map(lambda w, heads=heads: to_interleaved_rope(w, heads))
            yield gguf_name, out

    def extra_tensors(self) -> Iterable[tuple[str, Source]]:
        if self.rope["rope_type"] == "llama3":
            r = self.rope
            yield "rope_freqs.weight", Source.of(llama3_rope_factors(
                self.head_dim, float(r["rope_theta"]), float(r["factor"]), float(r.get("low_freq_factor", 1.0)),
                float(r.get("high_freq_factor", 4.0)), int(r.get("original_max_position_embeddings", 8192))))

    def expected(self) -> dict[str, tuple[int, ...]]:
        rope = {"rope_freqs.weight": (self.head_dim // 2,)} if self.rope["rope_type"] == "llama3" else {}
        return rope | self.decoder_shapes()


def to_interleaved_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder q/k projection rows from HF's half-split rope layout to ggml's interleaved one.

    HF Llama rotates dimension i of each head together with dimension i + d/2
    ("rotate_half"); GGUF ``llama`` files are run with ggml's normal rope, which
    rotates dimensions 2i and 2i+1. Both use frequency base^(-2i/d) for pair i,
    so moving row i of each head to 2i and row i + d/2 to 2i + 1 makes ggml
    compute the same rotation. Attention scores are unchanged because q and k are
    reordered alike; v and the output projection are left as they are.
    """
    head_dim = w.shape[0] // n_heads
    # rows of one head as (half, pair member), then read pair-member-fastest
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def from_interleaved_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of :func:`to_interleaved_rope` (GGUF rows back to HF order)."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(
    head_dim: int, base: float, factor: float, low_freq_factor: float,
    high_freq_factor: float, original_context: int,
) -> np.ndarray:
    """Per-frequency divisors for Llama 3.1 rope scaling (``rope_freqs.weight``).

    ggml divides rotation frequency i by factor i. Llama 3.1 leaves frequencies
    whose wavelength is shorter than ``original_context / high_freq_factor``
    alone, slows those longer than ``original_context / low_freq_factor`` by
    ``factor``, and interpolates smoothly in between.
    """
    inv_freq = base ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    with np.errstate(divide="ignore", invalid="ignore"):
        smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        between = 1.0 / ((1 - smooth) / factor + smooth)
    factors = np.where(wavelen < original_context / high_freq_factor, 1.0,
                       np.where(wavelen > original_context / low_freq_factor, factor, between))
    return factors.astype(np.float32)
