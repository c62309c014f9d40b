"""What the Qwen-VL converters (``qwen2vl.py``, ``qwen3vl.py``) share; not an architecture itself.

- :class:`QwenVision`: a Qwen text architecture plus the vision part of Qwen-VL checkpoints: the text and
  vision tensors told apart by their prefixes, the 3-D patch convolution written as its two frames;
- :func:`read_processor`: the image processor's pixel bounds and normalisation;
- :func:`mrope_sections`: the text rope's mRoPE sections, as GGUF stores them;
- :func:`write_clip`: the ``clip.*`` keys, named as llama.cpp's mmproj files name them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import gguf

from .base import Architecture
from .checkpoint import read_json
from .tensors import Source


class QwenVision(Architecture):
    """Listed before the Qwen text architecture it extends (``class Qwen3VL(QwenVision, Qwen3)``): text tensors go
    on to that class as ``model.*``, the vision tower's (``visual.*``) to :meth:`vision_tensors`, except the patch
    convolution (hidden, 3, 2, p, p), written as the two frames of a still image (``v.patch_embd.weight`` and
    ``v.patch_embd.weight.1``)."""

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        # transformers >= 5: model.language_model.* / model.visual.*; before: model.* / visual.*
        name = re.sub(r"^model\.language_model\.", "model.", name)
        name = re.sub(r"^(model\.)?visual\.", "visual.", name)
        if not name.startswith("visual."):
            yield from super().tensors(name, source)
        elif name == "visual.patch_embed.proj.weight":
            hidden, channels, _, p, _ = source.shape
            for frame, suffix in ((0, ""), (1, ".1")):
                yield f"v.patch_embd.weight{suffix}", source.map(lambda x, f=frame: x[:, :, f],
                                                                  (hidden, channels, p, p))
        else:
            yield from self.vision_tensors(name.removeprefix("visual."), source)

    def vision_tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        """Vision tensor ``visual.<name>`` -> zero or more ``(gguf_name, source)`` pairs."""
        raise NotImplementedError


def read_processor(hf_dir: Path, vision: dict[str, Any], mean: list[float], std: list[float], min_pixels: int,
                   max_pixels: int) -> dict[str, Any]:
    """The image processor's min/max pixels and normalisation (preprocessor_config.json, with the model's
    defaults), refused when its patch or merge size is not the vision tower's."""
    pre = read_json(hf_dir / "preprocessor_config.json") or {}
    size = pre.get("size") or {}
    if pre.get("patch_size", vision["patch_size"]) != vision["patch_size"] or \
            pre.get("merge_size", vision["spatial_merge_size"]) != vision["spatial_merge_size"]:
        raise ValueError("preprocessor_config.json's patch_size/merge_size differ from config.json's vision_config")
    return dict(min_pixels=int(pre.get("min_pixels") or size.get("shortest_edge") or min_pixels),
                max_pixels=int(pre.get("max_pixels") or size.get("longest_edge") or max_pixels),
                mean=pre.get("image_mean", mean), std=pre.get("image_std", std))


def mrope_sections(rope: dict[str, Any], head_dim: int) -> list[int]:
    """The rope's mrope_section (pairs of each head on the temporal, height, width axes), padded to four."""
    sections = list(rope.get("mrope_section") or [])
    if len(sections) != 3 or 2 * sum(sections) != head_dim:
        raise ValueError(f"rope mrope_section {sections} must be 3 numbers summing to head_dim / 2 ({head_dim // 2})")
    return [*sections, 0]


def write_clip(w: gguf.GGUFWriter, projector: str, v: dict[str, Any], processor: dict[str, Any],
               **flags: bool) -> None:
    """The ``clip.*`` keys a Qwen-VL vision part shares, named as llama.cpp's mmproj files name them."""
    w.add_string("clip.projector_type", projector)
    w.add_bool("clip.has_vision_encoder", True)
    for flag, on in flags.items():
        w.add_bool(f"clip.{flag}", on)
    for key, value in (("embedding_length", v["hidden_size"]), ("feed_forward_length", v["intermediate_size"]),
                       ("block_count", v["depth"]), ("attention.head_count", v["num_heads"]),
                       ("patch_size", v["patch_size"]), ("spatial_merge_size", v["spatial_merge_size"]),
                       ("projection_dim", v["out_hidden_size"]), ("image_size", v.get("image_size", 560)),
                       ("image_min_pixels", processor["min_pixels"]), ("image_max_pixels", processor["max_pixels"])):
        w.add_uint32(f"clip.vision.{key}", int(value))
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)  # HF's vision norms
    w.add_float32("clip.vision.rope.freq_base", float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
    w.add_array("clip.vision.image_mean", [float(x) for x in processor["mean"]])
    w.add_array("clip.vision.image_std", [float(x) for x in processor["std"]])
