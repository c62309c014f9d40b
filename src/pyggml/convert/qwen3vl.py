"""Qwen3-VL (HF ``Qwen3VLForConditionalGeneration``) -> one GGUF ``qwen3vl`` file: the text model as
Qwen 3's with its mRoPE sections and ``qwen3vl.n_deepstack_layers``, plus the vision part under
llama.cpp's mmproj names (projector ``qwen3vl_merger``): the patch convolution's two frames and bias,
the learned position table, layers with a fused q/k/v, the merger (``v.post_ln``, ``mm.0``, ``mm.2``) and
the DeepStack mergers as ``v.deepstack.<vision layer>.*`` with ``clip.vision.is_deepstack_layers``."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import gguf

from .base import UnknownTensorError, register
from .qwen3 import Qwen3
from .qwen3moe import Qwen3Moe
from .qwen_vl import QwenVision, mrope_sections, read_processor, write_clip
from .tensors import Source

# transformers' Qwen3VLVisionConfig defaults, for what config.json leaves out
VISION_DEFAULTS = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16,
                       spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=3584, num_position_embeddings=2304,
                       deepstack_visual_indexes=[8, 16, 24])
LAYER = {"norm1": "ln1", "norm2": "ln2", "attn.qkv": "attn_qkv", "attn.proj": "attn_out", "mlp.linear_fc1": "ffn_up",
         "mlp.linear_fc2": "ffn_down"}
MERGER = {"merger.norm": "v.post_ln", "merger.linear_fc1": "mm.0", "merger.linear_fc2": "mm.2",
          "patch_embed.proj": "v.patch_embd", "pos_embed": "v.position_embd"}
DEEPSTACK = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}


@register("Qwen3VLForConditionalGeneration", model_types=("qwen3_vl",))
class Qwen3VL(QwenVision, Qwen3):
    gguf_arch = "qwen3vl"
    keep_f32 = (*Qwen3.keep_f32, "patch_embd", "weight")  # "weight": v.patch_embd.weight.1

    def __init__(self, hf_dir: Path, config: dict[str, Any], pooling: str | None = None) -> None:
        text = {**config, **(config.get("text_config") or {})}
        self.vision = v = {**VISION_DEFAULTS, **(config.get("vision_config") or {})}
        if v["in_channels"] != 3 or v["temporal_patch_size"] != 2:
            raise ValueError("config.json's vision_config must have in_channels 3 and temporal_patch_size 2")
        self.deepstack = list(v["deepstack_visual_indexes"])
        if any(not 0 <= i < v["depth"] for i in self.deepstack) or len(set(self.deepstack)) != len(self.deepstack):
            raise ValueError(f"vision_config.deepstack_visual_indexes {self.deepstack} must be distinct layers")
        # Qwen3-VL's preprocessor_config.json: mean and std 0.5, 256 x 256 to 4096 x 4096 pixels
        self.processor = read_processor(hf_dir, v, [0.5] * 3, [0.5] * 3, 256 * 256, 4096 * 4096)
        super().__init__(hf_dir, text, pooling)
        self.sections = mrope_sections(self.rope, self.head_dim)
        if len(self.deepstack) >= self.n_layers:
            raise ValueError(f"{len(self.deepstack)} DeepStack layers need a text model of more layers")

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        w.add_rope_dimension_sections(self.sections)
        w.add_uint32(f"{self.gguf_arch}.n_deepstack_layers", len(self.deepstack))
        write_clip(w, "qwen3vl_merger", self.vision, self.processor, use_gelu=True)
        w.add_array("clip.vision.is_deepstack_layers", [i in self.deepstack for i in range(self.vision["depth"])])

    def vision_tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        base, _, kind = name.rpartition(".")
        if base in MERGER:
            yield f"{MERGER[base]}.{kind}", source
        elif (m := re.fullmatch(r"blocks\.(\d+)\.(.+)", base)) and m.group(2) in LAYER:
            yield f"v.blk.{m.group(1)}.{LAYER[m.group(2)]}.{kind}", source
        elif (m := re.fullmatch(r"deepstack_merger_list\.(\d+)\.(.+)", base)) and m.group(2) in DEEPSTACK \
                and int(m.group(1)) < len(self.deepstack):
            yield f"v.deepstack.{self.deepstack[int(m.group(1))]}.{DEEPSTACK[m.group(2)]}.{kind}", source
        else:
            raise UnknownTensorError("visual." + name)

    def expected(self) -> dict[str, tuple[int, ...]]:
        v = self.vision
        hidden, ff, p, out = v["hidden_size"], v["intermediate_size"], v["patch_size"], v["out_hidden_size"]
        merged = hidden * v["spatial_merge_size"] ** 2
        shapes = {"v.patch_embd.weight": (hidden, 3, p, p), "v.patch_embd.weight.1": (hidden, 3, p, p),
                  "v.patch_embd.bias": (hidden,), "v.position_embd.weight": (v["num_position_embeddings"], hidden),
                  "v.post_ln.weight": (hidden,), "v.post_ln.bias": (hidden,), "mm.0.weight": (merged, merged),
                  "mm.0.bias": (merged,), "mm.2.weight": (out, merged), "mm.2.bias": (out,)}
        layer = {"ln1": (hidden,), "ln2": (hidden,), "attn_qkv": (3 * hidden, hidden), "attn_out": (hidden, hidden),
                 "ffn_up": (ff, hidden), "ffn_down": (hidden, ff)}
        for i in range(v["depth"]):
            for key, shape in layer.items():
                shapes[f"v.blk.{i}.{key}.weight"], shapes[f"v.blk.{i}.{key}.bias"] = shape, shape[:1]
        for i in self.deepstack:
            for key, shape in (("norm", (merged,)), ("fc1", (merged, merged)), ("fc2", (out, merged))):
                shapes[f"v.deepstack.{i}.{key}.weight"], shapes[f"v.deepstack.{i}.{key}.bias"] = shape, shape[:1]
        return super().expected() | shapes


@register("Qwen3VLMoeForConditionalGeneration", model_types=("qwen3_vl_moe",))
class Qwen3VLMoe(Qwen3VL, Qwen3Moe):
    """Qwen3-VL with Qwen 3 MoE's experts (GGUF ``qwen3vlmoe``); its router always renormalises the chosen."""

    gguf_arch = "qwen3vlmoe"
    embedding = False

    def __init__(self, hf_dir: Path, config: dict[str, Any], pooling: str | None = None) -> None:
        text = {"norm_topk_prob": True, **(config.get("text_config") or {})}
        super().__init__(hf_dir, {**config, "text_config": text}, pooling)
