"""SmolLM3 (GGUF ``smollm3``, as llama.cpp converts it): Llama's layout and q/k row order; llama.cpp leaves rope
out of every fourth layer by a fixed rule, so a checkpoint whose ``no_rope_layers`` say otherwise, or that slides
a window, cannot be expressed."""

from __future__ import annotations

from .base import register
from .llama import Llama

NO_ROPE_STEP = 4  # llama.cpp's fixed n_no_rope_layer_step for smollm3


@register("SmolLM3ForCausalLM", model_types=("smollm3",))
class SmolLM3(Llama):
    gguf_arch = "smollm3"
    rope_types = ("default", "linear", "yarn")  # llama.cpp's smollm3 reads no rope frequency factors

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        fixed = [int((i + 1) % NO_ROPE_STEP != 0) for i in range(self.n_layers)]
        if list(self.config.get("no_rope_layers") or fixed) != fixed:
            raise ValueError(f"config.json's no_rope_layers are not GGUF smollm3's (rope left out of every "
                             f"{NO_ROPE_STEP}th layer): {self.config['no_rope_layers']}")
        if self.config.get("use_sliding_window"):
            raise ValueError("config.json sets use_sliding_window=true; GGUF smollm3 has no sliding window")
