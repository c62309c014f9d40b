"""Mistral 3 with vision (HF ``Mistral3ForConditionalGeneration``) -> one GGUF file: the text decoder as
``mistral3.py`` writes it (GGUF ``mistral3`` for Ministral 3, ``llama`` for Mistral Small 3.x), plus the
Pixtral tower (``v.*``), Mistral 3's projector (``mm.*``) and the ``[IMG_BREAK]`` embedding
(``v.token_embd.img_break``) with llama.cpp's ``pixtral`` mmproj names and ``clip.*`` keys (q/k rows
reordered per head into rope pairs, as llama.cpp's converter does). The vision part is written when the
vocabulary has ``[IMG]``, ``[IMG_BREAK]`` and ``[IMG_END]`` (without them images cannot be placed: only
the text decoder is)."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import gguf

from .base import UnknownTensorError, register
from .checkpoint import read_json
from .llama import to_interleaved_rope
from .mistral3 import Mistral3, Mistral3Text
from .tensors import Source
from .vocab import _added_tokens

log = logging.getLogger(__name__)

# transformers' defaults for what config.json may leave out (PixtralVisionConfig, Mistral3Config)
VISION_DEFAULTS = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                       num_channels=3, image_size=1024, patch_size=16, hidden_act="gelu")
IMAGE_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
EPS = 1e-5  # Pixtral's norms (fixed in transformers; llama.cpp norms the projector's input with it too)
LAYER = {"attention_norm": "ln1", "attention.q_proj": "attn_q", "attention.k_proj": "attn_k",
         "attention.v_proj": "attn_v", "attention.o_proj": "attn_out", "ffn_norm": "ln2",
         "feed_forward.gate_proj": "ffn_gate", "feed_forward.up_proj": "ffn_up", "feed_forward.down_proj": "ffn_down"}
OTHER = {"vision_tower.patch_conv.weight": "v.patch_embd.weight", "vision_tower.ln_pre.weight": "v.pre_ln.weight",
         "multi_modal_projector.norm.weight": "mm.input_norm.weight",
         "multi_modal_projector.patch_merger.merging_layer.weight": "mm.patch_merger.weight",
         "multi_modal_projector.linear_1.weight": "mm.1.weight", "multi_modal_projector.linear_1.bias": "mm.1.bias",
         "multi_modal_projector.linear_2.weight": "mm.2.weight", "multi_modal_projector.linear_2.bias": "mm.2.bias"}


@register("Mistral3ForConditionalGeneration")
class Mistral3Vision(Mistral3Text):
    keep_f32 = (*Mistral3Text.keep_f32, "patch_embd")

    def __init__(self, hf_dir: Path, config: dict[str, Any], pooling: str | None = None) -> None:
        super().__init__(hf_dir, config, pooling)
        self.image_tokens = self._image_token_ids(hf_dir)
        self.with_vision = self.image_tokens is not None
        if not self.with_vision:
            log.warning("%s: the vision part is not converted (the vocabulary lacks %s)", hf_dir,
                        ", ".join(IMAGE_TOKENS))
            return
        v = self.vision = {**VISION_DEFAULTS, **(config.get("vision_config") or {})}
        rope = {**(v.get("rope_scaling") or {}), **(v.get("rope_parameters") or {})}
        theta = rope.get("rope_theta", v.get("rope_theta", 10000.0))
        self.merge = int(config.get("spatial_merge_size", 2))
        self.projector_bias = bool(config.get("multimodal_projector_bias", False))
        checks = [
            (v["num_channels"] == 3, "vision_config.num_channels must be 3"),
            (v["hidden_act"] in ("silu", "gelu"), f"vision_config.hidden_act {v['hidden_act']!r}: silu or gelu"),
            (v.get("head_dim") in (None, v["hidden_size"] // v["num_attention_heads"]),
             "vision_config.head_dim must be hidden_size / num_attention_heads"),
            (float(theta) == 10000.0, f"vision_config rope_theta {theta}: llama.cpp's Pixtral assumes 10000"),
            (config.get("vision_feature_layer", -1) == -1, "vision_feature_layer must be -1 (the last layer)"),
            (config.get("projector_hidden_act", "gelu") == "gelu", "projector_hidden_act must be gelu"),
            (self.merge >= 1, "spatial_merge_size must be at least 1"),
            (float(self.config.get("rms_norm_eps", EPS)) == EPS,
             f"text_config.rms_norm_eps must be {EPS} (the projector's norm shares Pixtral's)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"config.json: {message}")
        pre = read_json(hf_dir / "preprocessor_config.json") or {}
        self.image_mean = pre.get("image_mean", [0.48145466, 0.4578275, 0.40821073])
        self.image_std = pre.get("image_std", [0.26862954, 0.26130258, 0.27577711])
        self.longest_edge = int((pre.get("size") or {}).get("longest_edge", v["image_size"]))

    @staticmethod
    def _image_token_ids(hf_dir: Path) -> dict[str, int] | None:
        tok_config = read_json(hf_dir / "tokenizer_config.json") or {}
        ids = {content: i for i, (content, _) in _added_tokens(hf_dir, tok_config,
                                                               read_json(hf_dir / "tokenizer.json")).items()}
        return {t: ids[t] for t in IMAGE_TOKENS} if all(t in ids for t in IMAGE_TOKENS) else None

    def skipped(self, name: str) -> bool:
        return any(re.search(p, name) for p in (Mistral3.skip if self.with_vision else self.skip))

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        if not self.with_vision:
            return
        v = self.vision
        w.add_string("clip.projector_type", "pixtral")
        w.add_bool("clip.has_vision_encoder", True)
        w.add_bool("clip.use_silu" if v["hidden_act"] == "silu" else "clip.use_gelu", True)
        for key, value in (("embedding_length", v["hidden_size"]), ("feed_forward_length", v["intermediate_size"]),
                           ("block_count", v["num_hidden_layers"]), ("attention.head_count", v["num_attention_heads"]),
                           ("image_size", self.longest_edge), ("patch_size", v["patch_size"]),
                           ("projection_dim", self.n_embd), ("spatial_merge_size", self.merge)):
            w.add_uint32(f"clip.vision.{key}", int(value))
        w.add_float32("clip.vision.attention.layer_norm_epsilon", EPS)
        w.add_array("clip.vision.image_mean", [float(x) for x in self.image_mean])
        w.add_array("clip.vision.image_std", [float(x) for x in self.image_std])

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        short = re.sub(r"^model\.", "", name)
        if not self.with_vision or not short.startswith(("vision_tower.", "multi_modal_projector.")):
            if self.with_vision and short.endswith("embed_tokens.weight"):  # the [IMG_BREAK] row, for the mmproj
                row = self.image_tokens["[IMG_BREAK]"]
                yield "v.token_embd.img_break", source.map(lambda x: x[row], shape=source.shape[1:])
            yield from super().tensors(name, source)
            return
        if short in OTHER:
            yield OTHER[short], source
            return
        m = re.fullmatch(r"vision_tower\.transformer\.layers\.(\d+)\.(.+)\.weight", short)
        if not m or m.group(2) not in LAYER:
            raise UnknownTensorError(name)
        kind = LAYER[m.group(2)]
        if kind in ("attn_q", "attn_k"):  # rope pairs in ggml's order: llama.cpp's 2-D rope turns 2i, 2i + 1
            source = source.map(lambda x: to_interleaved_rope(x, self.vision["num_attention_heads"]))
        yield f"v.blk.{m.group(1)}.{kind}.weight", source

    def expected(self) -> dict[str, tuple[int, ...]]:
        if not self.with_vision:
            return super().expected()
        v, text = self.vision, self.n_embd
        hidden, ff, p = v["hidden_size"], v["intermediate_size"], v["patch_size"]
        shapes = {"v.patch_embd.weight": (hidden, 3, p, p), "v.token_embd.img_break": (text,),
                  "v.pre_ln.weight": (hidden,)}
        layer = {"ln1": (hidden,), "attn_q": (hidden, hidden), "attn_k": (hidden, hidden), "attn_v": (hidden, hidden),
                 "attn_out": (hidden, hidden), "ln2": (hidden,), "ffn_gate": (ff, hidden), "ffn_up": (ff, hidden),
                 "ffn_down": (hidden, ff)}
        for i in range(v["num_hidden_layers"]):
            shapes |= {f"v.blk.{i}.{key}.weight": shape for key, shape in layer.items()}
        shapes |= {"mm.input_norm.weight": (hidden,), "mm.patch_merger.weight": (hidden, hidden * self.merge ** 2)}
        shapes |= {"mm.1.weight": (text, hidden), "mm.2.weight": (text, text)}
        if self.projector_bias:
            shapes |= {"mm.1.bias": (text,), "mm.2.bias": (text,)}
        return super().expected() | shapes
