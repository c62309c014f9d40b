"""gpt-oss (GGUF ``gpt-oss``): attention with q/k/v/o biases and per-head sinks, sliding-window layers
alternating with full ones, YaRN rope, and a mixture of experts in every layer (router with a bias,
clamped SwiGLU experts with biases).

Hugging Face stores all experts of a layer in three tensors: ``gate_up_proj`` (experts, hidden, 2 *
ff) with gate and up *interleaved* along the last axis, ``down_proj`` (experts, ff, hidden), and
their biases. GGUF, as llama.cpp writes it, has them split and transposed into
``ffn_{gate,up,down}_exps`` (+ ``.bias``). The published checkpoints store the expert matrices as
MXFP4 (``*_blocks``: 32 4-bit values per 16 bytes, ``*_scales``: a power-of-two exponent per 32),
already in GGUF's (out, in) order; they are dequantized here and written at ``--type``.
"""

from __future__ import annotations

from collections.abc import Iterable

import gguf
import numpy as np

from .base import Architecture, register
from .tensors import Source

_FP4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)  # e2m1 codes
ALPHA, LIMIT = 1.702, 7.0  # the clamped SwiGLU's constants; GGUF has no key for them (llama.cpp fixes them)


@register("GptOssForCausalLM", model_types=("gpt_oss",))
class GptOss(Architecture):
    gguf_arch = "gpt-oss"
    rope_types = ("default", "yarn")
    always_head_dim = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.n_experts: int = self.hparam("num_local_experts", "num_experts")
        self.n_experts_used: int = self.hparam("num_experts_per_tok")
        self.n_ff_exp: int = self.hparam("intermediate_size")
        for key, fixed in (("swiglu_alpha", ALPHA), ("swiglu_limit", LIMIT)):
            if not np.isclose(self.config.get(key, fixed), fixed):
                raise ValueError(f"config.json's {key} is {self.config[key]}; GGUF gpt-oss fixes it at {fixed}")
        default = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.n_layers)]
        if self.config.get("layer_types", default) != default:
            raise ValueError("config.json's layer_types must alternate sliding_attention, full_attention (the only "
                             "pattern GGUF gpt-oss has)")
        if not self.config.get("sliding_window"):
            raise ValueError("config.json has no sliding_window; GGUF gpt-oss needs one")
        method = (self.config.get("quantization_config") or {}).get("quant_method", "mxfp4")
        if method != "mxfp4":
            raise ValueError(f"config.json's quantization_config.quant_method is {method!r}; gpt-oss converts "
                             "from bf16/f32 or MXFP4 experts")

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        w.add_expert_count(self.n_experts)
        w.add_expert_used_count(self.n_experts_used)
        w.add_expert_feed_forward_length(self.n_ff_exp)
        w.add_sliding_window(int(self.config["sliding_window"]))

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        e, ff, embd = self.n_experts, self.n_ff_exp, self.n_embd
        if name.endswith(".self_attn.sinks"):
            yield self.map_name(name + ".weight"), source
        elif name.endswith(".mlp.experts.gate_up_proj"):  # (E, hidden, 2 ff) -> gate, up (E, ff, hidden)
            for part, start in (("gate_proj", 0), ("up_proj", 1)):
                gguf_name = self.map_name(name.replace("gate_up_proj", f"{part}.weight"))
                yield gguf_name, source.map(lambda a, s=start: a[:, :, s::2].transpose(0, 2, 1), (e, ff, embd))
        elif name.endswith(".mlp.experts.gate_up_proj_bias"):  # (E, 2 ff) -> (E, ff) each
            for part, start in (("gate_proj", 0), ("up_proj", 1)):
                gguf_name = self.map_name(name.replace("gate_up_proj_bias", f"{part}.bias"))
                yield gguf_name, source.map(lambda a, s=start: a[:, s::2], (e, ff))
        elif name.endswith(".mlp.experts.down_proj"):  # (E, ff, hidden) -> (E, hidden, ff)
            yield self.map_name(name + ".weight"), source.map(lambda a: a.transpose(0, 2, 1), (e, embd, ff))
        elif name.endswith(("_proj_blocks", "_proj_scales")):  # MXFP4: once both halves have arrived
            key, part = name.rsplit("_", 1)
            pair = self.gather(key, ("blocks", "scales").index(part), 2, source)
            if pair:  # (E, out, in): GGUF's order already
                weight = self._dequantized(*pair)
                if key.endswith("gate_up_proj"):  # gate and up rows interleaved
                    for part, start in (("gate_proj", 0), ("up_proj", 1)):
                        gguf_name = self.map_name(key.replace("gate_up_proj", f"{part}.weight"))
                        yield gguf_name, weight.map(lambda a, s=start: a[:, s::2], (e, ff, embd))
                else:
                    yield self.map_name(key + ".weight"), weight
        elif name.endswith(".mlp.experts.down_proj_bias"):
            yield self.map_name(name.replace("down_proj_bias", "down_proj.bias")), source
        else:
            yield from super().tensors(name, source)

    @staticmethod
    def _dequantized(blocks: Source, scales: Source) -> Source:
        """MXFP4 ``blocks`` (..., groups, 16 bytes: the low nibble first) and ``scales`` (..., groups:
        exponents biased by 127) as float32 (..., groups * 32)."""
        *lead, groups, n_bytes = blocks.shape
        if tuple(scales.shape) != (*lead, groups) or n_bytes != 16:
            raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not match")

        def load():
            codes = blocks.load().astype(np.uint8)
            values = np.empty((*codes.shape[:-1], 32), np.float32)
            values[..., 0::2], values[..., 1::2] = _FP4[codes & 15], _FP4[codes >> 4]
            values *= np.exp2(scales.load().astype(np.float32) - 127)[..., None]
            return values.reshape(*lead, groups * 32)

        return Source((*lead, groups * 32), load)

    def expected(self) -> dict[str, tuple[int, ...]]:
        embd, vocab, e, ff = self.n_embd, self.n_vocab, self.n_experts, self.n_ff_exp
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        shapes = {
            "token_embd.weight": (vocab, embd),
            "blk.{bid}.attn_norm.weight": (embd,),
            "blk.{bid}.attn_q.weight": (q, embd), "blk.{bid}.attn_q.bias": (q,),
            "blk.{bid}.attn_k.weight": (kv, embd), "blk.{bid}.attn_k.bias": (kv,),
            "blk.{bid}.attn_v.weight": (kv, embd), "blk.{bid}.attn_v.bias": (kv,),
            "blk.{bid}.attn_output.weight": (embd, q), "blk.{bid}.attn_output.bias": (embd,),
            "blk.{bid}.attn_sinks.weight": (self.n_heads,),
            "blk.{bid}.post_attention_norm.weight": (embd,),
            "blk.{bid}.ffn_gate_inp.weight": (e, embd), "blk.{bid}.ffn_gate_inp.bias": (e,),
            "blk.{bid}.ffn_gate_exps.weight": (e, ff, embd), "blk.{bid}.ffn_gate_exps.bias": (e, ff),
            "blk.{bid}.ffn_up_exps.weight": (e, ff, embd), "blk.{bid}.ffn_up_exps.bias": (e, ff),
            "blk.{bid}.ffn_down_exps.weight": (e, embd, ff), "blk.{bid}.ffn_down_exps.bias": (e, embd),
            "output_norm.weight": (embd,),
        }
        if not self.tied:
            shapes["output.weight"] = (vocab, embd)
        return shapes
