"""Qwen 2.5-VL (HF ``Qwen2_5_VLForConditionalGeneration``) -> one GGUF ``qwen2vl`` file: the text model
as Qwen 2's with its mRoPE sections (``qwen2vl.rope.dimension_sections``), plus the vision tower
(``v.*``) and patch merger (``mm.*``) under llama.cpp's mmproj names and ``clip.*`` keys (projector
``qwen2.5vl_merger``): the fused q/k/v split, the 3-D patch convolution stored as its two frames
(``v.patch_embd.weight`` and ``.weight.1``), the processor's min/max pixels and normalisation kept."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import gguf

from .base import UnknownTensorError, register
from .qwen2 import Qwen2
from .qwen_vl import QwenVision, mrope_sections, read_processor, write_clip
from .tensors import Source

# transformers' Qwen2_5_VLVisionConfig and Qwen2VLImageProcessor defaults, for what config files leave out
VISION_DEFAULTS = dict(depth=32, hidden_size=3584, intermediate_size=3420, num_heads=16, in_channels=3,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                       out_hidden_size=3584, fullatt_block_indexes=[7, 15, 23, 31])
MEAN, STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]  # OpenAI CLIP's
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 1280
LAYER = {"norm1": "ln1", "norm2": "ln2", "attn.proj": "attn_out", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down"}
MERGER = {"merger.ln_q": "v.post_ln", "merger.mlp.0": "mm.0", "merger.mlp.2": "mm.2"}


@register("Qwen2_5_VLForConditionalGeneration", model_types=("qwen2_5_vl",))
class Qwen25VL(QwenVision, Qwen2):
    gguf_arch = "qwen2vl"
    rope_types = (*Qwen2.rope_types, "mrope")  # older configs name the sections' rope "mrope"
    keep_f32 = (*Qwen2.keep_f32, "patch_embd", "weight")  # "weight": v.patch_embd.weight.1 (14-wide rows)

    def __init__(self, hf_dir: Path, config: dict[str, Any], pooling: str | None = None) -> None:
        # transformers >= 5 nests the text model's keys under text_config; older files have them on top
        text = {**config, **(config.get("text_config") or {})}
        self.vision = {**VISION_DEFAULTS, **(config.get("vision_config") or {})}
        v = self.vision
        if v["in_channels"] != 3 or v["temporal_patch_size"] != 2:
            raise ValueError("config.json's vision_config must have in_channels 3 and temporal_patch_size 2")
        full = list(v["fullatt_block_indexes"])
        if not full or any(b - a != full[0] + 1 for a, b in zip(full, full[1:], strict=False)):
            raise ValueError(f"vision_config.fullatt_block_indexes {full} is not every n-th layer (llama.cpp's "
                             "n_wa_pattern)")
        self.wa_pattern = full[0] + 1
        self.processor = read_processor(hf_dir, v, MEAN, STD, MIN_PIXELS, MAX_PIXELS)
        super().__init__(hf_dir, text, pooling)
        self.sections = mrope_sections(self.rope, self.head_dim)

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        w.add_rope_dimension_sections(self.sections)
        write_clip(w, "qwen2.5vl_merger", self.vision, self.processor, use_silu=True)
        w.add_uint32("clip.vision.n_wa_pattern", self.wa_pattern)
        w.add_uint32("clip.vision.window_size", self.vision["window_size"])

    def vision_tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        base, _, kind = name.rpartition(".")
        if base in MERGER:
            yield f"{MERGER[base]}.{kind}", source
        elif m := re.fullmatch(r"blocks\.(\d+)\.(.+)", base):
            block, part = m.groups()
            if part == "attn.qkv":
                for piece, x in zip(("q", "k", "v"), source.split([source.shape[0] // 3] * 3), strict=True):
                    yield f"v.blk.{block}.attn_{piece}.{kind}", x
            elif part in LAYER:
                yield f"v.blk.{block}.{LAYER[part]}.{kind}", source
            else:
                raise UnknownTensorError("visual." + name)
        else:
            raise UnknownTensorError("visual." + name)

    def expected(self) -> dict[str, tuple[int, ...]]:
        v = self.vision
        hidden, ff, p, merged = v["hidden_size"], v["intermediate_size"], v["patch_size"], \
            v["hidden_size"] * v["spatial_merge_size"] ** 2
        shapes = {"v.patch_embd.weight": (hidden, 3, p, p), "v.patch_embd.weight.1": (hidden, 3, p, p),
                  "v.post_ln.weight": (hidden,), "mm.0.weight": (merged, merged), "mm.0.bias": (merged,),
                  "mm.2.weight": (v["out_hidden_size"], merged), "mm.2.bias": (v["out_hidden_size"],)}
        layer = {"ln1.weight": (hidden,), "ln2.weight": (hidden,), "attn_out.weight": (hidden, hidden),
                 "attn_out.bias": (hidden,), "ffn_gate.weight": (ff, hidden), "ffn_gate.bias": (ff,),
                 "ffn_up.weight": (ff, hidden), "ffn_up.bias": (ff,), "ffn_down.weight": (hidden, ff),
                 "ffn_down.bias": (hidden,)}
        layer |= {f"attn_{x}.{kind}": (hidden, hidden)[:1 if kind == "bias" else 2]
                  for x in "qkv" for kind in ("weight", "bias")}
        for i in range(v["depth"]):
            shapes |= {f"v.blk.{i}.{key}": shape for key, shape in layer.items()}
        return super().expected() | shapes


@register("Qwen2VLForConditionalGeneration", model_types=("qwen2_vl",))
class Qwen2VL(Qwen25VL):
    """Qwen2-VL: Qwen 2.5-VL's layout with LayerNorms (biased), a QuickGELU MLP (``fc1``/``fc2``), full
    attention in every layer, and its vision config's own names (embed_dim, mlp_ratio; its hidden_size
    is the text width). Projector ``qwen2vl_merger``."""

    def __init__(self, hf_dir: Path, config: dict[str, Any], pooling: str | None = None) -> None:
        v = dict(config.get("vision_config") or {})
        embed, ratio = v.get("embed_dim", 1280), v.get("mlp_ratio", 4)
        v.update(hidden_size=embed, intermediate_size=embed * ratio, out_hidden_size=v.get("hidden_size", 3584),
                 fullatt_block_indexes=[0], window_size=0)
        super().__init__(hf_dir, {**config, "vision_config": v}, pooling)

    def metadata(self, w: gguf.GGUFWriter) -> None:
        Qwen2.metadata(self, w)
        w.add_rope_dimension_sections(self.sections)
        write_clip(w, "qwen2vl_merger", self.vision, self.processor, use_gelu=False)  # QuickGELU

    def expected(self) -> dict[str, tuple[int, ...]]:
        shapes = super().expected()
        hidden = self.vision["hidden_size"]
        for key in [k for k in shapes if k.startswith("v.") and ".ffn_gate." in k]:
            del shapes[key]
        norms = [f"v.blk.{i}.{n}.bias" for i in range(self.vision["depth"]) for n in ("ln1", "ln2")]
        return shapes | {name: (hidden,) for name in (*norms, "v.post_ln.bias")}
