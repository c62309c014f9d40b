"""Gemma 3 with vision (HF ``Gemma3ForConditionalGeneration``) -> one GGUF ``gemma3`` file: the text
model as ``gemma3.py`` writes it, plus the SigLIP tower (``v.*``) and the projector (``mm.*``) with
llama.cpp's mmproj names and ``clip.vision.*`` keys (the soft-embedding norm stored as ``1 + weight``)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import gguf

from .base import register
from .checkpoint import read_json
from .gemma3 import Gemma3
from .tensors import Source

# (Gemma 3 reads the last states; a SigLIP pooling head in the checkpoint is skipped)
# transformers' defaults for what a Gemma 3 config.json may leave out (Gemma3TextConfig, SiglipVisionConfig
# as Gemma3Config sets it)
TEXT_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                     max_position_embeddings=131_072, sliding_window=4096, query_pre_attn_scalar=256)
VISION_DEFAULTS = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                       patch_size=14, image_size=896, layer_norm_eps=1e-6, num_channels=3)
LAYER = {"layer_norm1": "ln1", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.out_proj": "attn_out", "layer_norm2": "ln2", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down"}
TOWER = {"embeddings.patch_embedding": "v.patch_embd", "embeddings.position_embedding": "v.position_embd",
         "post_layernorm": "v.post_ln"}


@register("Gemma3ForConditionalGeneration", model_types=("gemma3",))
class Gemma3Vision(Gemma3):
    keep_f32 = (*Gemma3.keep_f32, "patch_embd", "input_projection")
    skip = (*Gemma3.skip, r"vision_tower\.(vision_model\.)?head\.", r"^(language_model\.)?lm_head\.weight$")

    def __init__(self, hf_dir: Path, config: dict[str, Any], pooling: str | None = None) -> None:
        self.vision = {**VISION_DEFAULTS, **(config.get("vision_config") or {})}
        if self.vision["num_channels"] != 3:
            raise ValueError("config.json's vision_config must have num_channels 3")
        text = {**TEXT_DEFAULTS, **(config.get("text_config") or {})}
        self.tokens_per_image = int(config.get("mm_tokens_per_image", 256))
        preprocessor = read_json(hf_dir / "preprocessor_config.json") or {}
        self.image_mean = preprocessor.get("image_mean", [0.5, 0.5, 0.5])
        self.image_std = preprocessor.get("image_std", [0.5, 0.5, 0.5])
        side = self.vision["image_size"] // self.vision["patch_size"]
        per_side = int(round(self.tokens_per_image ** 0.5))
        if per_side ** 2 != self.tokens_per_image or side % per_side:
            raise ValueError(f"config.json's mm_tokens_per_image {self.tokens_per_image} is not a square dividing "
                             f"the {side}x{side} patch grid")
        self.merge = side // per_side
        super().__init__(hf_dir, text, pooling)

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        v = self.vision
        w.add_string("clip.projector_type", "gemma3")
        w.add_bool("clip.has_vision_encoder", True)
        w.add_bool("clip.use_gelu", True)
        for key, value in (("embedding_length", v["hidden_size"]), ("feed_forward_length", v["intermediate_size"]),
                           ("block_count", v["num_hidden_layers"]), ("attention.head_count", v["num_attention_heads"]),
                           ("image_size", v["image_size"]), ("patch_size", v["patch_size"]),
                           ("projection_dim", self.n_embd), ("projector.scale_factor", self.merge)):
            w.add_uint32(f"clip.vision.{key}", int(value))
        w.add_float32("clip.vision.attention.layer_norm_epsilon", float(v["layer_norm_eps"]))
        w.add_array("clip.vision.image_mean", [float(x) for x in self.image_mean])
        w.add_array("clip.vision.image_std", [float(x) for x in self.image_std])

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        # transformers >= 4.52 saves model.language_model.* / model.vision_tower.*; before, language_model.model.*
        name = re.sub(r"^(model\.)?", "", name)
        if name.startswith("language_model."):
            yield from super().tensors("model." + name.removeprefix("language_model.").removeprefix("model."), source)
        elif name.startswith("vision_tower."):  # transformers >= 5 drops the inner vision_model.
            yield self._tower_name(name.removeprefix("vision_tower.").removeprefix("vision_model.")), source
        elif name == "multi_modal_projector.mm_input_projection_weight":
            yield "mm.input_projection.weight", source
        elif name == "multi_modal_projector.mm_soft_emb_norm.weight":
            yield "mm.soft_emb_norm.weight", source.map(lambda x: x + 1)  # Gemma's RMSNorm: 1 + weight
        else:
            yield from super().tensors(name, source)

    def _tower_name(self, name: str) -> str:
        base, _, kind = name.rpartition(".")
        if base in TOWER:
            return f"{TOWER[base]}.{kind}"
        m = re.fullmatch(r"encoder\.layers\.(\d+)\.(.+)", base)
        if m and m.group(2) in LAYER:
            return f"v.blk.{m.group(1)}.{LAYER[m.group(2)]}.{kind}"
        from .base import UnknownTensorError

        raise UnknownTensorError("vision_tower." + name)

    def expected(self) -> dict[str, tuple[int, ...]]:
        v = self.vision
        hidden, ff, p = v["hidden_size"], v["intermediate_size"], v["patch_size"]
        shapes = {"v.patch_embd.weight": (hidden, 3, p, p), "v.patch_embd.bias": (hidden,),
                  "v.position_embd.weight": ((v["image_size"] // p) ** 2, hidden)}
        layer = {"ln1": (hidden,), "attn_q": (hidden, hidden), "attn_k": (hidden, hidden), "attn_v": (hidden, hidden),
                 "attn_out": (hidden, hidden), "ln2": (hidden,), "ffn_up": (ff, hidden), "ffn_down": (hidden, ff)}
        for i in range(v["num_hidden_layers"]):
            for key, shape in layer.items():
                shapes[f"v.blk.{i}.{key}.weight"] = shape
                shapes[f"v.blk.{i}.{key}.bias"] = shape[:1]
        shapes |= {"v.post_ln.weight": (hidden,), "v.post_ln.bias": (hidden,),
                   "mm.input_projection.weight": (hidden, self.n_embd), "mm.soft_emb_norm.weight": (hidden,)}
        return super().expected() | shapes


def split_mmproj(src: str | Path, text_out: str | Path, mmproj_out: str | Path) -> tuple[Path, Path]:
    """llama.cpp's layout from a single file: the text model (without ``v.*``, ``mm.*`` and ``clip.*``)
    and an mmproj file (``general.architecture = clip``: the vision tensors and ``clip.*`` keys)."""
    reader = gguf.GGUFReader(Path(src))
    if not any(key.startswith("clip.") for key in reader.fields):
        raise ValueError(f"{src}: its vision part has no llama.cpp mmproj layout (clip.* keys); keep it in one file")
    outputs = []
    for path, vision in ((Path(text_out), False), (Path(mmproj_out), True)):
        arch = "clip" if vision else str(reader.fields["general.architecture"].contents())
        writer = gguf.GGUFWriter(path, arch)
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            if vision and not (key.startswith("clip.") or key in ("general.name", "general.file_type")):
                continue
            if not vision and key.startswith("clip."):
                continue
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), kind, sub_type=sub)
        if vision:
            writer.add_string("general.type", "mmproj")
        for t in reader.tensors:
            if t.name.startswith(("v.", "mm.")) == vision:
                writer.add_tensor(t.name, t.data, raw_shape=list(reversed(t.shape.tolist())), raw_dtype=t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        outputs.append(path)
    return outputs[0], outputs[1]
