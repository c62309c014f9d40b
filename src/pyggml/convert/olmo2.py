"""OLMo 2 and OLMo 3 (GGUF ``olmo2``, as llama.cpp converts both): post-norms only, q/k RMSNorms over the
whole projection, NeoX rope (q/k rows in HF order), an output matrix always written. OLMo 3's
sliding-window layers are ``attention.sliding_window`` plus one bool per layer
(``attention.sliding_window_pattern``, true: sliding); YaRN (global layers only) as llama.cpp reads it."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import gguf

from .base import Architecture, register
from .tensors import Source


@register("Olmo2ForCausalLM", "Olmo3ForCausalLM", model_types=("olmo2", "olmo3"))
class Olmo2(Architecture):
    gguf_arch = "olmo2"
    rope_types = ("default", "yarn")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.head_dim * self.n_heads != self.n_embd:
            raise ValueError(f"config.json has head_dim={self.head_dim} with {self.n_heads} heads for hidden_size="
                             f"{self.n_embd}; GGUF olmo2 sizes heads as hidden_size / num_attention_heads")
        for flag in ("attention_bias", "clip_qkv"):
            if self.config.get(flag):
                raise ValueError(f"config.json sets {flag}; GGUF olmo2 has none")
        if self.rope["rope_type"] == "yarn" and (self.rope.get("truncate") is False or {"mscale", "mscale_all_dim"} &
                                                  set(self.rope)):
            raise ValueError("config.json's YaRN sets truncate=false or mscale; llama.cpp's olmo2 runs neither")
        self.window = self.config.get("sliding_window") if self.config.get("model_type") == "olmo3" else None
        self.sliding: list[bool] = []
        if self.window:
            types = self.config.get("layer_types") or [
                "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(self.n_layers)]
            if len(types) != self.n_layers or set(types) - {"sliding_attention", "full_attention"}:
                raise ValueError(f"config.json's layer_types {types} are not one of sliding_attention / "
                                 f"full_attention per layer ({self.n_layers} layers)")
            self.sliding = [t == "sliding_attention" for t in types]

    def metadata(self, w: gguf.GGUFWriter) -> None:
        # YaRN: ggml's rope scales by 1 + 0.1 ln(factor) itself (Hugging Face's default attention_factor), and
        # llama.cpp multiplies that by rope.scaling.attn_factor (its yarn_attn_factor key is not read for YaRN)
        scale = self.rope.pop("attention_factor", None) if self.rope["rope_type"] == "yarn" else None
        super().metadata(w)
        if scale is not None and not math.isclose(scale, 1 + 0.1 * math.log(self.rope["factor"]), rel_tol=1e-6):
            w.add_rope_scaling_attn_factors(scale / (1 + 0.1 * math.log(self.rope["factor"])))
        if self.window:
            w.add_sliding_window(int(self.window))
            w.add_sliding_window_pattern(self.sliding)

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        yield from super().tensors(name, source)
        if self.tied and name == "model.embed_tokens.weight":  # llama.cpp's olmo2 requires output.weight
            yield "output.weight", source

    def expected(self) -> dict[str, tuple[int, ...]]:
        shapes = self.decoder_shapes()
        del shapes["blk.{bid}.attn_norm.weight"], shapes["blk.{bid}.ffn_norm.weight"]
        embd, q, kv = self.n_embd, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return shapes | {"blk.{bid}.attn_q_norm.weight": (q,), "blk.{bid}.attn_k_norm.weight": (kv,),
                         "blk.{bid}.post_attention_norm.weight": (embd,), "blk.{bid}.post_ffw_norm.weight": (embd,),
                         "output.weight": (self.n_vocab, embd)}

    def _rope_parameters(self) -> dict[str, Any]:
        # transformers 5 writes OLMo 3's rope per layer kind; llama.cpp's olmo2 rotates both kinds with one base
        params = self.config.get("rope_parameters") or {}
        if "full_attention" in params:
            full, local = params["full_attention"], params.get("sliding_attention") or {}
            if local.get("rope_type", "default") != "default" or local.get("rope_theta", full.get("rope_theta")) != \
                    full.get("rope_theta"):
                raise ValueError("config.json's sliding-window layers rotate with their own rope parameters; GGUF "
                                 "olmo2 gives them the global layers' base, unscaled")
            self.config = {**self.config, "rope_parameters": full}
        return super()._rope_parameters()
