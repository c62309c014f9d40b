"""Llama 3.2 Vision (HF ``MllamaForConditionalGeneration``) -> one GGUF ``mllama`` file, as Ollama writes
them (llama.cpp has no mllama): the Llama text model with cross-attention layers (``blk.N.cross_attn_*``,
their tanh gates stored raw), the tiled vision encoder (``v.*``, its gates stored after tanh, the
position gate as ``1 - tanh``), the projector (``mm.0``) and ``mllama.vision.*`` keys."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from .base import UnknownTensorError, register
from .checkpoint import read_json
from .llama import Llama
from .tensors import Source
from .vocab import Vocab, read_vocab

# transformers' defaults for what a config.json may leave out (MllamaTextConfig, MllamaVisionConfig)
TEXT_DEFAULTS = dict(vocab_size=128_256, hidden_size=4096, intermediate_size=14_336, num_hidden_layers=40,
                     num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, max_position_embeddings=131_072,
                     cross_attention_layers=[3, 8, 13, 18, 23, 28, 33, 38], rope_theta=500_000.0)
VISION_DEFAULTS = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_global_layers=8,
                       attention_heads=16, image_size=448, patch_size=14, max_num_tiles=4, norm_eps=1e-5,
                       num_channels=3, intermediate_layers_indices=[3, 7, 15, 23, 30], hidden_act="gelu")
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
CROSS = {"q_proj": "cross_attn_q_proj", "k_proj": "cross_attn_k_proj", "v_proj": "cross_attn_v_proj",
         "o_proj": "cross_attn_o_proj", "q_norm": "cross_attn_q_norm", "k_norm": "cross_attn_k_norm"}
# Ollama's names; its files hold fc1 (hidden -> ffn) as ffn_down and fc2 as ffn_up (its forward applies them so)
LAYER = {"input_layernorm": "ln1", "post_attention_layernorm": "ln2", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_out",
         "mlp.fc1": "ffn_down", "mlp.fc2": "ffn_up"}
TOWER = {"patch_embedding.weight": "v.patch_embd.weight", "class_embedding": "v.class_embd",
         "gated_positional_embedding.embedding": "v.position_embd.weight",
         "gated_positional_embedding.tile_embedding.weight": "v.tile_position_embd.weight",
         "pre_tile_positional_embedding.embedding.weight": "v.pre_tile_position_embd.weight",
         "post_tile_positional_embedding.embedding.weight": "v.post_tile_position_embd.weight",
         "layernorm_pre.weight": "v.pre_ln.weight", "layernorm_pre.bias": "v.pre_ln.bias",
         "layernorm_post.weight": "v.post_ln.weight", "layernorm_post.bias": "v.post_ln.bias"}


def _tanh(x: np.ndarray) -> np.ndarray:
    return np.tanh(x.astype(np.float32))


@register("MllamaForConditionalGeneration", model_types=("mllama",))
class Mllama(Llama):
    gguf_arch = "mllama"
    tensor_names = "llama"
    keep_f32 = (*Llama.keep_f32, "patch_embd", "class_embd")

    def __init__(self, hf_dir: Path, config: dict[str, Any], pooling: str | None = None) -> None:
        self.vision = {**VISION_DEFAULTS, **(config.get("vision_config") or {})}
        text = {**TEXT_DEFAULTS, **(config.get("text_config") or {})}
        v = self.vision
        if v["num_channels"] != 3 or v["hidden_act"] != "gelu":
            raise ValueError("config.json's vision_config must have num_channels 3 and hidden_act gelu")
        if v["image_size"] % v["patch_size"] or v["hidden_size"] % v["attention_heads"]:
            raise ValueError("config.json's vision_config: image_size must be a multiple of patch_size and "
                             "hidden_size of attention_heads")
        ratios = [(a, b) for a in range(1, v["max_num_tiles"] + 1) for b in range(1, v["max_num_tiles"] + 1)
                  if a * b <= v["max_num_tiles"]]
        if [tuple(r) for r in v.get("supported_aspect_ratios") or ratios] != ratios:
            raise ValueError("config.json's vision_config.supported_aspect_ratios are not the default tile grids "
                             f"for max_num_tiles {v['max_num_tiles']}")
        self.cross_layers = sorted(int(i) for i in text["cross_attention_layers"])
        if not all(0 <= i < text["num_hidden_layers"] for i in self.cross_layers):
            raise ValueError("config.json's text_config.cross_attention_layers name layers the model lacks")
        indices = [int(i) for i in v["intermediate_layers_indices"]]
        if not all(0 <= i < v["num_hidden_layers"] for i in indices):
            raise ValueError("config.json's vision_config.intermediate_layers_indices name layers the encoder lacks")
        out_dim = v.get("vision_output_dim", v["hidden_size"] * (1 + len(indices)))
        if out_dim != v["hidden_size"] * (1 + len(indices)):
            raise ValueError(f"config.json's vision_output_dim {out_dim} is not hidden_size x (1 + "
                             "len(intermediate_layers_indices))")
        image_token = config.get("image_token_index", 128_256)
        if image_token < text["vocab_size"] or image_token >= text["vocab_size"] + 8:
            raise ValueError(f"config.json's image_token_index {image_token} is not one of the 8 embedding rows "
                             "after the vocabulary")
        preprocessor = read_json(hf_dir / "preprocessor_config.json") or {}
        self.image_mean = preprocessor.get("image_mean", CLIP_MEAN)
        self.image_std = preprocessor.get("image_std", CLIP_STD)
        if preprocessor.get("size", {}).get("height", v["image_size"]) != v["image_size"]:
            raise ValueError("preprocessor_config.json's tile size is not vision_config.image_size")
        super().__init__(hf_dir, text, pooling)

    def vocab(self) -> Vocab:
        return read_vocab(self.hf_dir, self.n_vocab + 8, pad=False)  # <|image|> follows the text vocabulary

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        v, arch = self.vision, self.gguf_arch
        w.add_array(f"{arch}.attention.cross_attention_layers", self.cross_layers)
        for key, value in (("block_count", v["num_hidden_layers"]), ("global.block_count", v["num_global_layers"]),
                           ("embedding_length", v["hidden_size"]), ("feed_forward_length", v["intermediate_size"]),
                           ("attention.head_count", v["attention_heads"]), ("image_size", v["image_size"]),
                           ("patch_size", v["patch_size"]), ("max_num_tiles", v["max_num_tiles"]),
                           ("num_channels", v["num_channels"])):
            w.add_uint32(f"{arch}.vision.{key}", int(value))
        w.add_array(f"{arch}.vision.intermediate_layers_indices", [int(i) for i in v["intermediate_layers_indices"]])
        w.add_float32(f"{arch}.vision.attention.layer_norm_epsilon", float(v["norm_eps"]))
        w.add_array(f"{arch}.vision.image_mean", [float(x) for x in self.image_mean])
        w.add_array(f"{arch}.vision.image_std", [float(x) for x in self.image_std])

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        # transformers >= 5: model.language_model.*, model.vision_model.*, model.multi_modal_projector.*,
        # lm_head; before: language_model.model.*, language_model.lm_head, vision_model.*, multi_modal_projector.*
        name = re.sub(r"^model\.", "", name)
        if name.startswith("language_model."):
            name = name.removeprefix("language_model.").removeprefix("model.")
            if name == "lm_head.weight":
                yield from super().tensors(name, source)
                return
            m = re.fullmatch(r"layers\.(\d+)\.(cross_attn\.(\w+)|cross_attn_(attn|mlp)_gate)(\.weight)?", name)
            if m and m[3] in CROSS:
                yield f"blk.{m[1]}.{CROSS[m[3]]}.weight", source
            elif m and m[4]:
                yield f"blk.{m[1]}.cross_attn_{m[4]}_gate", source
            elif m:
                raise UnknownTensorError(name)
            else:
                yield from super().tensors("model." + name, source)
        elif name.startswith("vision_model."):
            yield from self._vision(name.removeprefix("vision_model."), source)
        elif name in ("multi_modal_projector.weight", "multi_modal_projector.bias"):
            yield "mm.0." + name.rpartition(".")[2], source
        else:
            yield from super().tensors(name, source)

    def _vision(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        if name in TOWER:
            yield TOWER[name], source
            return
        if name == "gated_positional_embedding.gate":  # one gate, stored in both forms the model uses
            yield "v.position_embd.gate", source.map(lambda g: 1 - _tanh(g))
            yield "v.tile_position_embd.gate", source.map(_tanh)
            return
        m = re.fullmatch(r"(pre|post)_tile_positional_embedding\.gate", name)
        if m:
            yield f"v.{m[1]}_tile_position_embd.gate", source.map(_tanh)
            return
        m = re.fullmatch(r"(transformer|global_transformer)\.layers\.(\d+)\.(.+)", name)
        if m:
            prefix = f"v.{'global.' if m[1] == 'global_transformer' else ''}blk.{m[2]}"
            if m[3] in ("gate_attn", "gate_ffn"):
                yield f"{prefix}.{'attn' if m[3] == 'gate_attn' else 'ffn'}_gate", source.map(_tanh)
                return
            base, _, kind = m[3].rpartition(".")
            if base in LAYER:
                yield f"{prefix}.{LAYER[base]}.{kind}", source
                return
        raise UnknownTensorError("vision_model." + name)

    def expected(self) -> dict[str, tuple[int, ...]]:
        v = self.vision
        hidden, ff, p, tiles = v["hidden_size"], v["intermediate_size"], v["patch_size"], v["max_num_tiles"]
        positions = (v["image_size"] // p) ** 2 + 1
        ratios = sum(1 for a in range(1, tiles + 1) for b in range(1, tiles + 1) if a * b <= tiles) + 1
        embd, q, kv, tff = self.n_embd, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.n_ff
        text = {n: s for n, s in super().expected().items() if not n.startswith("blk.")}
        shapes = {n: s for n, s in text.items() if n == "token_embd.weight"}
        shapes["token_embd.weight"] = (self.n_vocab + 8, embd)
        for i in range(self.n_layers):
            b = f"blk.{i}."
            shapes[b + "attn_norm.weight"] = (embd,)
            if i in self.cross_layers:
                shapes |= {b + "cross_attn_q_proj.weight": (q, embd), b + "cross_attn_k_proj.weight": (kv, embd),
                           b + "cross_attn_v_proj.weight": (kv, embd), b + "cross_attn_o_proj.weight": (embd, q),
                           b + "cross_attn_q_norm.weight": (self.head_dim,),
                           b + "cross_attn_k_norm.weight": (self.head_dim,),
                           b + "cross_attn_attn_gate": (1,), b + "cross_attn_mlp_gate": (1,)}
            else:
                shapes |= {b + "attn_q.weight": (q, embd), b + "attn_k.weight": (kv, embd),
                           b + "attn_v.weight": (kv, embd), b + "attn_output.weight": (embd, q)}
            shapes |= {b + "ffn_norm.weight": (embd,), b + "ffn_gate.weight": (tff, embd),
                       b + "ffn_up.weight": (tff, embd), b + "ffn_down.weight": (embd, tff)}
        shapes |= {n: s for n, s in text.items() if n != "token_embd.weight"}
        shapes |= {"v.patch_embd.weight": (hidden, 3, p, p), "v.class_embd": (hidden,),
                   "v.position_embd.weight": (positions, hidden), "v.position_embd.gate": (1,),
                   "v.tile_position_embd.weight": (ratios, tiles * positions * hidden),
                   "v.tile_position_embd.gate": (1,),
                   "v.pre_tile_position_embd.weight": (ratios, tiles * hidden), "v.pre_tile_position_embd.gate": (1,),
                   "v.post_tile_position_embd.weight": (ratios, tiles * hidden),
                   "v.post_tile_position_embd.gate": (1,),
                   "v.pre_ln.weight": (hidden,), "v.pre_ln.bias": (hidden,),
                   "v.post_ln.weight": (hidden,), "v.post_ln.bias": (hidden,)}
        layer = {"ln1.weight": (hidden,), "ln1.bias": (hidden,), "attn_q.weight": (hidden, hidden),
                 "attn_k.weight": (hidden, hidden), "attn_v.weight": (hidden, hidden),
                 "attn_out.weight": (hidden, hidden), "ln2.weight": (hidden,), "ln2.bias": (hidden,),
                 "ffn_down.weight": (ff, hidden), "ffn_down.bias": (ff,), "ffn_up.weight": (hidden, ff),
                 "ffn_up.bias": (hidden,)}
        for prefix, count, gated in (("v.blk", v["num_hidden_layers"], False),
                                     ("v.global.blk", v["num_global_layers"], True)):
            for i in range(count):
                shapes |= {f"{prefix}.{i}.{k}": s for k, s in layer.items()}
                if gated:
                    shapes |= {f"{prefix}.{i}.attn_gate": (1,), f"{prefix}.{i}.ffn_gate": (1,)}
        out_dim = hidden * (1 + len(v["intermediate_layers_indices"]))
        return shapes | {"mm.0.weight": (embd, out_dim), "mm.0.bias": (embd,)}
