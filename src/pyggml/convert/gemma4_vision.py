"""Gemma 4 with vision (HF ``Gemma4ForConditionalGeneration``) -> one GGUF ``gemma4`` file: the text
model as ``gemma4.py`` writes it, plus the vision tower (``v.*``) and the projection (``mm.*``) under
llama.cpp's mmproj names and ``clip.vision.*`` keys (projector ``gemma4v``); ``gemma3_vision.split_mmproj``
writes llama.cpp's two-file layout from it. The audio tower is left out. A checkpoint without
``vision_config`` converts as text only."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import gguf

from .base import UnknownTensorError, register
from .checkpoint import read_json
from .gemma4 import Gemma4Text
from .tensors import Source

log = logging.getLogger(__name__)
LAYER = {"input_layernorm": "ln1", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "self_attn.o_proj": "attn_out", "post_attention_layernorm": "attn_post_norm",
         "pre_feedforward_layernorm": "ln2", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "post_feedforward_layernorm": "ffn_post_norm"}
CLAMPS = ("input_min", "input_max", "output_min", "output_max")
# transformers' Gemma4VisionConfig defaults and the image processor's
VISION_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
                       num_key_value_heads=12, head_dim=64, rms_norm_eps=1e-6, pooling_kernel_size=3, patch_size=16,
                       hidden_activation="gelu_pytorch_tanh", standardize=False)
PROCESSOR_DEFAULTS = dict(max_soft_tokens=280, patch_size=16, pooling_kernel_size=3)
CAUSAL_WIDTHS = (1536, 2560)  # llama.cpp: E2B and E4B see images causally, the other widths both ways on SWA layers


@register("Gemma4ForConditionalGeneration", model_types=("gemma4",))
class Gemma4Vision(Gemma4Text):
    keep_f32 = (*Gemma4Text.keep_f32, "patch_embd", "input_projection")
    skip = (r"^model\.(audio_tower|embed_audio)\.", r"^lm_head\.weight$", r"rotary_emb\.")

    def __init__(self, hf_dir: Path, config: dict[str, Any], pooling: str | None = None) -> None:
        text = dict(config.get("text_config") or {})
        bidirectional = text.pop("use_bidirectional_attention", None)
        super().__init__(hf_dir, {**config, "text_config": text}, pooling)
        if bidirectional not in (None, "vision"):
            raise ValueError(f"config.json's text_config has use_bidirectional_attention={bidirectional!r}; GGUF "
                             "gemma4 has none")
        vision = config.get("vision_config")
        self.vision = None if vision is None else {**VISION_DEFAULTS, **vision}
        # llama.cpp chooses the image tokens' attention by the text width, not by a key: a checkpoint it would run
        # otherwise than transformers converts as text only
        if self.vision is not None and (bidirectional == "vision") != (self.n_embd not in CAUSAL_WIDTHS):
            log.warning("%s: use_bidirectional_attention=%r, but llama.cpp attends the images of a %d-wide Gemma 4 "
                        "%s: the vision part is left out", hf_dir, bidirectional, self.n_embd,
                        "causally" if self.n_embd in CAUSAL_WIDTHS else "both ways on sliding layers")
            self.vision = None
        if self.vision is None:
            self.skip = (*self.skip, r"^model\.(vision_tower|embed_vision)\.")
            return
        v = self.vision
        if v["hidden_activation"] != "gelu_pytorch_tanh":
            raise ValueError(f"config.json's vision_config has hidden_activation={v['hidden_activation']!r}; GGUF "
                             "gemma4v runs gelu_pytorch_tanh")
        rope = v.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial" or float(rope.get("rope_theta", 100.0)) != 100.0:
            raise ValueError("config.json's vision rope must be axial with rope_theta 100 (llama.cpp fixes it)")
        processor = {**PROCESSOR_DEFAULTS, **(read_json(hf_dir / "preprocessor_config.json") or {})}
        processor = {**processor, **(processor.get("image_processor") or {})}
        if processor["patch_size"] != v["patch_size"] or processor["pooling_kernel_size"] != v["pooling_kernel_size"]:
            raise ValueError("preprocessor_config.json's patch_size/pooling_kernel_size differ from vision_config's")
        if processor.get("do_normalize") or processor.get("image_mean", [0.0] * 3) != [0.0] * 3:
            raise ValueError("preprocessor_config.json normalises pixels; Gemma 4 takes them in [0, 1]")
        self.max_soft_tokens = int(processor["max_soft_tokens"])
        if v["num_attention_heads"] * v["head_dim"] != v["hidden_size"]:
            raise ValueError("vision_config's heads x head_dim must equal hidden_size (llama.cpp's vision graph)")

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        v = self.vision
        if v is None:
            return
        w.add_string("clip.projector_type", "gemma4v")
        w.add_bool("clip.has_vision_encoder", True)
        w.add_bool("clip.use_gelu", True)
        side = v["patch_size"] * v["pooling_kernel_size"]
        for key, value in (("embedding_length", v["hidden_size"]), ("feed_forward_length", v["intermediate_size"]),
                           ("block_count", v["num_hidden_layers"]), ("attention.head_count", v["num_attention_heads"]),
                           ("attention.head_count_kv", v["num_key_value_heads"]), ("image_size", 224),
                           ("patch_size", v["patch_size"]), ("projection_dim", self.n_embd),
                           ("projector.scale_factor", v["pooling_kernel_size"]),
                           ("image_max_pixels", self.max_soft_tokens * side * side)):
            w.add_uint32(f"clip.vision.{key}", int(value))
        w.add_float32("clip.vision.attention.layer_norm_epsilon", float(v["rms_norm_eps"]))
        w.add_array("clip.vision.image_mean", [0.0, 0.0, 0.0])
        w.add_array("clip.vision.image_std", [1.0, 1.0, 1.0])

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        if name.startswith("model.embed_vision."):
            if name != "model.embed_vision.embedding_projection.weight":
                raise UnknownTensorError(name)
            yield "mm.input_projection.weight", source
        elif name.startswith("model.vision_tower."):
            yield self._tower(name.removeprefix("model.vision_tower."), source)
        else:
            yield from super().tensors(name, source)

    def _tower(self, name: str, source: Source) -> tuple[str, Source]:
        if name == "patch_embedder.input_proj.weight":  # (hidden, py*px*c) -> llama.cpp's kernel (hidden, c, py, px)
            hidden, pixels = source.shape
            p = int(round((pixels // 3) ** 0.5))
            return "v.patch_embd.weight", source.map(
                lambda w: w.reshape(hidden, p, p, 3).transpose(0, 3, 1, 2).copy(), (hidden, 3, p, p))
        if name == "patch_embedder.position_embedding_table":
            return "v.position_embd.weight", source
        if name in ("std_bias", "std_scale"):
            return f"v.{name}", source
        m = re.fullmatch(r"encoder\.layers\.(\d+)\.(.+?)(?:\.linear)?\.(weight|input_min|input_max|output_min|"
                         r"output_max)", name)
        if m is None or m[2] not in LAYER:
            raise UnknownTensorError("model.vision_tower." + name)
        if m[3] in CLAMPS:
            source = source.map(lambda x: x.reshape(1), (1,))
        return f"v.blk.{m[1]}.{LAYER[m[2]]}.{m[3]}", source

    def expected(self) -> dict[str, tuple[int, ...]]:
        shapes = super().expected()
        v = self.vision
        if v is None:
            return shapes
        hidden, ff, p, d = v["hidden_size"], v["intermediate_size"], v["patch_size"], v["head_dim"]
        q, kv = v["num_attention_heads"] * d, v["num_key_value_heads"] * d
        shapes |= {"v.patch_embd.weight": (hidden, 3, p, p), "mm.input_projection.weight": (self.n_embd, hidden),
                   "v.position_embd.weight": (2, int(v.get("position_embedding_size", 10240)), hidden)}
        if v["standardize"]:
            shapes |= {"v.std_bias": (hidden,), "v.std_scale": (hidden,)}
        layer = {"ln1": (hidden,), "attn_q": (q, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden),
                 "attn_q_norm": (d,), "attn_k_norm": (d,), "attn_out": (hidden, q), "attn_post_norm": (hidden,),
                 "ln2": (hidden,), "ffn_gate": (ff, hidden), "ffn_up": (ff, hidden), "ffn_down": (hidden, ff),
                 "ffn_post_norm": (hidden,)}
        for i in range(v["num_hidden_layers"]):
            for key, shape in layer.items():
                shapes[f"v.blk.{i}.{key}.weight"] = shape
                if v.get("use_clipped_linears") and len(shape) == 2:
                    shapes |= {f"v.blk.{i}.{key}.{c}": (1,) for c in CLAMPS}
        return shapes
