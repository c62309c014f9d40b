"""Granite 4.0 hybrids (GGUF ``granitehybrid``): Mamba-2 and attention layers (``head_count_kv`` per
layer, 0 marking Mamba-2), ``ssm.*`` sizes, Granite's multipliers, and a shared MLP that is the
dense MLP (``ffn_*``) or, beside experts, the shared expert (``ffn_*_shexp``). Mamba-2 tensors as
llama.cpp stores them: A = -exp(A_log) and D as (n_heads, 1), the kernel 2-d, the gated norm per group."""

from __future__ import annotations

import re
from collections.abc import Iterable

import gguf
import numpy as np

from .base import Architecture, register
from .llama import to_interleaved_rope
from .tensors import Source

MAMBA, ATTENTION = ("mamba", "linear_attention"), ("attention", "full_attention")
# names gguf's map lacks
_RENAMES = {"mamba.dt_bias": "ssm_dt.bias", "block_sparse_moe.router.weight": "ffn_gate_inp.weight",
            "block_sparse_moe.experts.down_proj": "ffn_down_exps.weight"}


class Mamba2Tensors:
    """The Mamba-2 mixer's tensors in llama.cpp's layout (shared with ``nemotron_h.py``); needs
    ``n_layers``, ``ssm_heads``, ``ssm_groups``, ``ssm_inner``, ``ssm_state``, ``conv_kernel``."""

    def mamba2(self, gguf_name: str, out: Source) -> Source:
        kind = (gguf_name.split(".") + ["", ""])[2]  # blk.N.<kind>
        if kind == "ssm_a":  # stored as log(-A)
            return out.map(lambda w: -np.exp(w.reshape(-1, 1)), (self.ssm_heads, 1))
        if kind == "ssm_d":
            return out.map(lambda w: w.reshape(-1, 1), (self.ssm_heads, 1))
        if kind == "ssm_conv1d" and gguf_name.endswith(".weight"):  # (dim, 1, taps) -> (dim, taps)
            return out.map(lambda w: w.reshape(w.shape[0], -1), (out.shape[0], out.shape[-1]))
        if kind == "ssm_norm":  # one RMS norm per group
            groups = self.ssm_groups
            return out.map(lambda w: w.reshape(groups, -1), (groups, self.ssm_inner // groups))
        return out

    def mamba2_shapes(self, i: int, embd: int) -> dict[str, tuple[int, ...]]:
        heads, groups, inner, state = self.ssm_heads, self.ssm_groups, self.ssm_inner, self.ssm_state
        conv_dim = inner + 2 * groups * state
        shapes = {f"blk.{i}.ssm_in.weight": (2 * inner + 2 * groups * state + heads, embd),
                  f"blk.{i}.ssm_conv1d.weight": (conv_dim, self.conv_kernel), f"blk.{i}.ssm_dt.bias": (heads,),
                  f"blk.{i}.ssm_a": (heads, 1), f"blk.{i}.ssm_d": (heads, 1),
                  f"blk.{i}.ssm_norm.weight": (groups, inner // groups), f"blk.{i}.ssm_out.weight": (embd, inner),
                  f"blk.{i}.ssm_conv1d.bias": (conv_dim,)}
        return shapes


@register("GraniteMoeHybridForCausalLM", model_types=("granitemoehybrid",))
class GraniteHybrid(Mamba2Tensors, Architecture):
    gguf_arch = "granitehybrid"
    default_context = 131072
    keep_f32 = (*Architecture.keep_f32, "ssm_conv1d", "ssm_a", "ssm_d")  # as llama.cpp's converter keeps them

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        config = self.config
        types = config.get("layer_types") or config.get("layers_block_type") or ["mamba"] * self.n_layers
        if len(types) != self.n_layers or any(t not in MAMBA + ATTENTION for t in types):
            raise ValueError(f"config.json layer_types must name {self.n_layers} layers, each mamba or attention "
                             f"(linear_attention or full_attention); found {types}")
        self.is_mamba = [t in MAMBA for t in types]
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json hidden_act={config['hidden_act']!r}; GGUF granitehybrid runs SiLU only")
        for flag in ("attention_bias", "mamba_proj_bias"):
            if config.get(flag):
                raise ValueError(f"config.json sets {flag}=true; granitehybrid files here have no such biases")
        low, high = config.get("time_step_limit") or (0.0, None)  # transformers writes inf as {"__float__": ...}
        if low != 0 or not (high is None or high == float("inf") or high == {"__float__": "Infinity"}):
            raise ValueError("config.json sets time_step_limit; llama.cpp's Mamba-2 does not clamp time steps")
        self.conv_kernel: int = self.hparam("mamba_d_conv")
        self.ssm_state: int = self.hparam("mamba_d_state")
        self.ssm_heads: int = self.hparam("mamba_n_heads")
        self.ssm_groups: int = self.hparam("mamba_n_groups")
        self.ssm_inner: int = int(config.get("mamba_expand", 2)) * self.n_embd
        head = config.get("mamba_d_head", "auto")
        if self.ssm_inner % self.ssm_heads or (head != "auto" and head * self.ssm_heads != self.ssm_inner) or \
                self.ssm_heads % self.ssm_groups:
            raise ValueError(f"config.json: mamba_n_heads ({self.ssm_heads}) x mamba_d_head ({head}) must be "
                             f"mamba_expand x hidden_size ({self.ssm_inner}), and a multiple of mamba_n_groups")
        if not config.get("mamba_conv_bias", True):
            raise ValueError("config.json sets mamba_conv_bias=false; llama.cpp's Mamba-2 needs the convolution's bias")
        self.n_experts: int = config.get("num_local_experts") or 0
        self.n_experts_used: int = config.get("num_experts_per_tok") or 0
        self.n_ff_shared: int = self.hparam("shared_intermediate_size")
        self.n_ff = self.hparam("intermediate_size") if self.n_experts else self.n_ff_shared
        self.use_rope = config.get("position_embedding_type") == "rope"
        self.rope.setdefault("rope_theta", 10000.0)
        self.head_dim = self.n_embd // self.n_heads  # llama.cpp's granite reads no key_length
        self.kv_heads = self.n_kv_heads
        self.n_kv_heads = [0 if m else self.kv_heads for m in self.is_mamba]  # GGUF: per layer (base writes it)

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        w.add_vocab_size(self.n_vocab)
        w.add_rope_scaling_finetuned(self.use_rope)  # llama.cpp granite: rotary positions or none
        w.add_rope_dimension_count(self.head_dim)
        w.add_ssm_conv_kernel(self.conv_kernel)
        w.add_ssm_inner_size(self.ssm_inner)
        w.add_ssm_state_size(self.ssm_state)
        w.add_ssm_time_step_rank(self.ssm_heads)
        w.add_ssm_group_count(self.ssm_groups)
        multipliers = {"embedding_multiplier": w.add_embedding_scale, "residual_multiplier": w.add_residual_scale,
                       "attention_multiplier": w.add_attention_scale, "logits_scaling": w.add_logit_scale}
        for key, add in multipliers.items():
            if self.config.get(key) is not None:
                add(float(self.config[key]))
        if self.n_experts:
            w.add_expert_count(self.n_experts)
            w.add_expert_used_count(self.n_experts_used)
            w.add_expert_shared_feed_forward_length(self.n_ff_shared)

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        m = re.match(r"^model\.layers\.(\d+)\.(.*)$", name)
        if m is None:
            yield from super().tensors(name, source)
            return
        bid, rest = m[1], m[2]
        if rest in _RENAMES:
            yield f"blk.{bid}.{_RENAMES[rest]}", source
        elif rest in ("block_sparse_moe.input_linear.weight", "block_sparse_moe.experts.gate_up_proj"):
            gate, up = source.split([self.n_ff, self.n_ff], axis=1)
            yield f"blk.{bid}.ffn_gate_exps.weight", gate
            yield f"blk.{bid}.ffn_up_exps.weight", up
        elif rest == "shared_mlp.input_linear.weight":
            gate, up = source.split([self.n_ff_shared, self.n_ff_shared], axis=0)
            suffix = "_shexp" if self.n_experts else ""
            yield f"blk.{bid}.ffn_gate{suffix}.weight", gate
            yield f"blk.{bid}.ffn_up{suffix}.weight", up
        elif rest == "shared_mlp.output_linear.weight":
            yield f"blk.{bid}.ffn_down{'_shexp' if self.n_experts else ''}.weight", source
        else:
            for gguf_name, out in super().tensors(name, source):
                if gguf_name.endswith((".attn_q.weight", ".attn_k.weight")):  # llama.cpp's normal rope
                    heads = self.n_heads if ".attn_q." in gguf_name else self.kv_heads
                    out = out.map(lambda w, heads=heads: to_interleaved_rope(w, heads))
                yield gguf_name, self.mamba2(gguf_name, out)

    def expected(self) -> dict[str, tuple[int, ...]]:
        embd, vocab, head = self.n_embd, self.n_vocab, self.head_dim
        shapes = {"token_embd.weight": (vocab, embd)}
        for i, mamba in enumerate(self.is_mamba):
            shapes[f"blk.{i}.attn_norm.weight"] = (embd,)
            if mamba:
                shapes |= self.mamba2_shapes(i, embd)
            else:
                q, kv = self.n_heads * head, self.kv_heads * head
                shapes |= {f"blk.{i}.attn_q.weight": (q, embd), f"blk.{i}.attn_k.weight": (kv, embd),
                           f"blk.{i}.attn_v.weight": (kv, embd), f"blk.{i}.attn_output.weight": (embd, q)}
            shapes[f"blk.{i}.ffn_norm.weight"] = (embd,)
            if self.n_experts:
                n, ff, sh = self.n_experts, self.n_ff, self.n_ff_shared
                shapes |= {f"blk.{i}.ffn_gate_inp.weight": (n, embd), f"blk.{i}.ffn_gate_exps.weight": (n, ff, embd),
                           f"blk.{i}.ffn_up_exps.weight": (n, ff, embd), f"blk.{i}.ffn_down_exps.weight": (n, embd, ff),
                           f"blk.{i}.ffn_gate_shexp.weight": (sh, embd), f"blk.{i}.ffn_up_shexp.weight": (sh, embd),
                           f"blk.{i}.ffn_down_shexp.weight": (embd, sh)}
            else:
                ff = self.n_ff
                shapes |= {f"blk.{i}.ffn_gate.weight": (ff, embd), f"blk.{i}.ffn_up.weight": (ff, embd),
                           f"blk.{i}.ffn_down.weight": (embd, ff)}
        shapes["output_norm.weight"] = (embd,)
        if not self.tied:
            shapes["output.weight"] = (vocab, embd)
        return shapes
