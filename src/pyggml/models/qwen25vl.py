"""Qwen 2.5-VL as Ollama writes it (GGUF architecture "qwen25vl", one file): qwen2vl.py's model under
Ollama's names: the text model's keys under ``qwen25vl.`` with ``rope.mrope_section``, the vision part's
under ``qwen25vl.vision.`` (its full-attention layers as ``fullatt_block_indexes``; the normalisation
is OpenAI CLIP's, which Ollama's files do not store) and its tensors ``v.patch_embd_0``/``_1`` and
``v.merger.*``."""

from __future__ import annotations

from pyggml import nn
from pyggml.backend import Backend
from pyggml.models import ModelError, qwen2, qwen2vl, qwen2vl_vision, register
from pyggml.tensor import Tensor

KEY = "qwen25vl.vision."
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
RENAMED = {"v.patch_embd.weight": "v.patch_embd_0.weight", "v.patch_embd.weight.1": "v.patch_embd_1.weight",
           "v.post_ln.weight": "v.merger.ln_q.weight",
           **{f"mm.{i}.{kind}": f"v.merger.mlp.{i}.{kind}" for i in (0, 2) for kind in ("weight", "bias")}}


@register("qwen25vl")
class Qwen25VL(qwen2vl.Qwen2VL):
    def __init__(self, backend: Backend):
        qwen2.Qwen2.__init__(self, backend)
        if backend.get("v.patch_embd_0.weight") is not None:
            names = _OllamaNames(backend, "")
            self.vision = qwen2vl_vision.load(names, self.options.hidden_size, vision_options(names))

    def attach_mmproj(self, projector: Backend) -> None:
        raise ModelError("qwen25vl (Ollama's layout) holds its vision part in the model file; it takes no mmproj")


def vision_options(backend) -> qwen2vl_vision.VisionOptions:
    c = backend.config

    def uint(key: str, default: int | None = None) -> int:
        value = c.uint(KEY + key, default)
        if not value:
            raise ModelError(f"qwen25vl: the vision part needs a non-zero {KEY + key}")
        return value

    hidden, heads, patch, merge = uint("embedding_length"), uint("attention.head_count"), uint("patch_size", 14), \
        uint("spatial_merge_size", 2)
    layers, gate = uint("block_count"), backend.get("v.blk.0.ffn_gate.weight")
    full = c.get(KEY + "fullatt_block_indexes", [7, 15, 23, 31])
    if not full or any(b - a != full[0] + 1 for a, b in zip(full, full[1:], strict=False)):
        raise ModelError(f"qwen25vl: {KEY}fullatt_block_indexes {full} is not every n-th layer")
    if gate is None or hidden % heads or (hidden // heads) % 4:
        raise ModelError(f"qwen25vl: no v.blk.0.ffn_gate.weight, or a vision width {hidden} / {heads} heads that "
                         "is not a multiple of 4 per head")
    factor = patch * merge
    return qwen2vl_vision.VisionOptions(
        hidden_size=hidden, ffn_size=gate.shape[1], n_layers=layers, n_heads=heads,
        eps=c.float(KEY + "attention.layer_norm_epsilon", 1e-6), patch_size=patch, merge=merge,
        full_every=full[0] + 1, window=max(uint("window_size", 112) // factor, 1),
        text_hidden=c.uint("embedding_length"), rope_base=c.float(KEY + "rope.freq_base", 10000.0, min=1.0),
        min_pixels=56 * 56, max_pixels=factor * factor * qwen2vl_vision.MAX_TOKENS, image_mean=CLIP_MEAN,
        image_std=CLIP_STD)


class _OllamaNames(nn.Prefixed):
    """Ollama's tensor names where they differ from llama.cpp's."""

    def get(self, name: str) -> Tensor | None:
        return super().get(RENAMED.get(name, name))
