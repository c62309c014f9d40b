"""gpt-oss (GGUF ``gpt-oss``): MoE with biased router and experts, attention sinks, alternating
sliding-window layers, YaRN rope. Expert matrices come either as floats (gate and up interleaved,
stored input-major) or as OpenAI's MXFP4 blocks, which are repacked into ggml's MXFP4 unchanged."""

from __future__ import annotations

import re
from collections.abc import Iterable

import gguf
import numpy as np

from .base import Architecture, register
from .tensors import Q, Source

_PACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up|down)_proj_(blocks|scales)$")


@register("GptOssForCausalLM", model_types=("gpt_oss",))
class GptOss(Architecture):
    gguf_arch = "gpt-oss"
    always_head_dim = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.n_experts: int = self.hparam("num_local_experts", "num_experts")
        self.n_ff_exp: int = self.hparam("intermediate_size")
        pattern = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.n_layers)]
        if self.config.get("layer_types", pattern) != pattern:
            raise ValueError("config.json's layer_types do not alternate sliding-window and full attention, "
                             "starting with sliding, as GGUF gpt-oss does")
        for key, value in (("swiglu_limit", 7.0), ("swiglu_alpha", 1.702)):
            if self.config.get(key, value) != value:
                raise ValueError(f"config.json has {key}={self.config[key]}; GGUF gpt-oss runs {value}")

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        w.add_expert_count(self.n_experts)
        w.add_expert_used_count(self.hparam("num_experts_per_tok"))
        w.add_expert_feed_forward_length(self.n_ff_exp)
        w.add_sliding_window(int(self.hparam("sliding_window")))

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        experts = name.rpartition(".experts.")[0] + ".experts"
        if name.endswith(".self_attn.sinks"):
            yield from super().tensors(name + ".weight", source)
        elif m := _PACKED.match(name):  # OpenAI MXFP4: blocks and scales arrive separately
            parts = self.gather(f"{m[1]}.{m[2]}_proj (MXFP4 blocks and scales)", m[3] == "scales", 2, source)
            if parts and m[2] == "down":
                yield from super().tensors(f"{experts}.down_proj.weight", _mxfp4(*parts))
            elif parts:  # gate and up rows interleave
                for kind, rows in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
                    yield from super().tensors(f"{experts}.{kind}_proj.weight", _mxfp4(*parts, rows))
        elif name.endswith(".mlp.experts.gate_up_proj"):  # (expert, hidden, gate/up interleaved)
            for kind, start in (("gate", 0), ("up", 1)):
                shape = (self.n_experts, self.n_ff_exp, self.n_embd)
                yield from super().tensors(f"{experts}.{kind}_proj.weight",
                                           source.map(lambda w, s=start: w[:, :, s::2].transpose(0, 2, 1), shape))
        elif name.endswith(".mlp.experts.gate_up_proj_bias"):
            for kind, start in (("gate", 0), ("up", 1)):
                yield from super().tensors(f"{experts}.{kind}_proj.bias",
                                           source.map(lambda b, s=start: b[:, s::2], (self.n_experts, self.n_ff_exp)))
        elif name.endswith(".mlp.experts.down_proj"):  # (expert, ff, hidden)
            shape = (self.n_experts, self.n_embd, self.n_ff_exp)
            yield from super().tensors(name + ".weight", source.map(lambda w: w.transpose(0, 2, 1), shape))
        elif name.endswith(".mlp.experts.down_proj_bias"):
            yield from super().tensors(name.replace("_bias", ".bias"), source)
        else:
            yield from super().tensors(name, source)

    def expected(self) -> dict[str, tuple[int, ...]]:
        embd, n, ff, vocab = self.n_embd, self.n_experts, self.n_ff_exp, self.n_vocab
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        shapes = {"token_embd.weight": (vocab, embd), "blk.{bid}.attn_norm.weight": (embd,)}
        for kind, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            shapes |= {f"blk.{{bid}}.{kind}.weight": (rows, embd), f"blk.{{bid}}.{kind}.bias": (rows,)}
        shapes |= {
            "blk.{bid}.attn_output.weight": (embd, q), "blk.{bid}.attn_output.bias": (embd,),
            "blk.{bid}.attn_sinks.weight": (self.n_heads,),
            "blk.{bid}.post_attention_norm.weight": (embd,),
            "blk.{bid}.ffn_gate_inp.weight": (n, embd), "blk.{bid}.ffn_gate_inp.bias": (n,),
            "blk.{bid}.ffn_gate_exps.weight": (n, ff, embd), "blk.{bid}.ffn_gate_exps.bias": (n, ff),
            "blk.{bid}.ffn_up_exps.weight": (n, ff, embd), "blk.{bid}.ffn_up_exps.bias": (n, ff),
            "blk.{bid}.ffn_down_exps.weight": (n, embd, ff), "blk.{bid}.ffn_down_exps.bias": (n, embd),
            "output_norm.weight": (embd,),
        }
        if not self.tied:
            shapes["output.weight"] = (vocab, embd)
        return shapes


def _mxfp4(blocks: Source, scales: Source, rows: slice = slice(None)) -> Source:
    """OpenAI MXFP4 (``blocks``: (expert, row, block, 16 bytes), value 2i in the low nibble of byte i;
    ``scales``: one E8M0 exponent per block) as ggml MXFP4 blocks (exponent byte, then 16 bytes with
    value j in the low nibble of byte j and value j + 16 in the high one). Same values, same scales."""
    n, n_rows, n_blocks, _ = blocks.shape
    n_rows = len(range(n_rows)[rows])

    def load() -> np.ndarray:
        packed, exponents = blocks.load()[:, rows], scales.load()[:, rows]
        values = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], 32)
        qs = values[..., :16] | (values[..., 16:] << 4)
        return np.concatenate([exponents[..., None], qs], axis=-1).reshape(n, n_rows, n_blocks * 17)

    return Source((n, n_rows, n_blocks * 32), load, qtype=Q.MXFP4)
