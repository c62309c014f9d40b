"""Ministral 3 text decoders (GGUF ``mistral3``, as llama.cpp converts ``Ministral3ForCausalLM``): Llama's
layout and q/k row order, YaRN with ``mscale_all_dim`` as ``rope.scaling.yarn_log_multiplier``, and Llama 4's
attention temperature (``llama_4_scaling_beta``) as ``attention.temperature_scale``; the text decoder of a
``Mistral3ForConditionalGeneration`` (Ministral 3, and Mistral Small 3.x as GGUF ``llama``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf

from .base import TextOfMultimodal, register
from .llama import Llama


@register("Ministral3ForCausalLM", model_types=("ministral3",))
class Mistral3(Llama):
    gguf_arch = "mistral3"
    rope_types = ("default", "yarn")  # llama.cpp's mistral3 reads no rope frequency factors

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.config.get("sliding_window"):
            raise ValueError("config.json sets sliding_window; GGUF mistral3 has no sliding window")
        rope = self.rope
        if rope["rope_type"] == "yarn" and rope.get("mscale_all_dim") and rope.get("mscale", 1.0) != 1.0:
            raise ValueError(f"config.json's YaRN has mscale={rope['mscale']}; llama.cpp's mistral3 assumes 1")
        if rope.get("llama_4_scaling_beta") and not rope.get("original_max_position_embeddings"):
            raise ValueError("config.json's llama_4_scaling_beta needs original_max_position_embeddings")

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        if self.rope["rope_type"] == "yarn" and self.rope.get("mscale_all_dim"):
            w.add_rope_scaling_yarn_log_mul(float(self.rope["mscale_all_dim"]))
        if self.rope.get("llama_4_scaling_beta"):
            w.add_attn_temperature_scale(float(self.rope["llama_4_scaling_beta"]))
            if self.rope["rope_type"] != "yarn":  # the temperature's step: written with YaRN's keys otherwise
                w.add_rope_scaling_orig_ctx_len(int(self.rope["original_max_position_embeddings"]))


class Mistral3Text(TextOfMultimodal, Mistral3):
    """The text decoder of a checkpoint saved with its vision part (as published): Ministral 3 as GGUF
    ``mistral3``, Mistral Small 3.1 / 3.2 (a ``mistral`` text decoder) as GGUF ``llama``, as llama.cpp converts
    them; the vision tower and projector are left out here (``mistral3_vision.py`` adds them, and registers
    the checkpoint's name)."""

    skip = (*Mistral3.skip, r"^(model\.)?(vision_tower|multi_modal_projector)\.")

    def __init__(self, hf_dir: Path, config: dict[str, Any], pooling: str | None = None) -> None:
        text_type = (config.get("text_config") or {}).get("model_type")
        if text_type not in ("ministral3", "mistral"):
            raise ValueError(f"config.json's text_config is {text_type!r}; supported: ministral3 (GGUF mistral3), "
                             "mistral (GGUF llama)")
        if text_type == "mistral":
            self.gguf_arch = "llama"  # Mistral Small 3.x: Llama's graph (no temperature tuning)
        super().__init__(hf_dir, config, pooling)
