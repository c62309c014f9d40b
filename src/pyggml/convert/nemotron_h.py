"""Nemotron-H (GGUF ``nemotron_h``, dense): blocks of one mixer each, Mamba-2, attention or a
squared-ReLU MLP, named by ``layers_block_type`` (or the released checkpoints' ``hybrid_override_pattern``:
M, *, -); in the file a layer's kind is its ``head_count_kv`` and ``feed_forward_length`` entries (both 0:
Mamba-2). The Mamba-2 tensors as ``granitehybrid.py`` writes them."""

from __future__ import annotations

import re
from collections.abc import Iterable

import gguf

from .base import Architecture, register
from .granitehybrid import Mamba2Tensors
from .tensors import Source

KINDS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}


@register("NemotronHForCausalLM", model_types=("nemotron_h",))
class NemotronH(Mamba2Tensors, Architecture):
    gguf_arch = "nemotron_h"
    default_context = 8192
    always_head_dim = True
    keep_f32 = (*Architecture.keep_f32, "ssm_conv1d", "ssm_a", "ssm_d")

    def __init__(self, hf_dir, config, *args, **kwargs) -> None:
        pattern = config.get("layers_block_type") or config.get("hybrid_override_pattern")
        types = [KINDS.get(c, c) for c in pattern] if isinstance(pattern, str) else \
            [_LEGACY.get(t, t) for t in pattern or ()]
        super().__init__(hf_dir, {"num_hidden_layers": len(types), **config}, *args, **kwargs)
        if len(types) != self.n_layers or any(t not in ("linear_attention", "full_attention", "mlp") for t in types):
            raise ValueError(f"config.json layers_block_type (or hybrid_override_pattern) must name {self.n_layers} "
                             f"layers, each linear_attention (M), full_attention (*) or mlp (-); found {pattern} "
                             "(moe layers: GGUF nemotron_h_moe, not supported)")
        self.types = types
        self.tied = False  # transformers' NemotronH never ties lm_head to the embeddings, whatever the config says
        for key, value in (("mamba_hidden_act", "silu"), ("mlp_hidden_act", "relu2")):
            if config.get(key, value) != value:
                raise ValueError(f"config.json has {key}={config[key]!r}; GGUF nemotron_h runs {value} only")
        for flag in ("use_bias", "attention_bias"):
            if config.get(flag):
                raise ValueError(f"config.json sets {flag}=true; nemotron_h files here have no such biases")
        if not config.get("use_conv_bias", True):
            raise ValueError("config.json sets use_conv_bias=false; llama.cpp's Mamba-2 needs the convolution's bias")
        self.conv_kernel: int = self.hparam("conv_kernel", "mamba_d_conv")
        self.ssm_state: int = self.hparam("ssm_state_size")
        self.ssm_heads: int = self.hparam("mamba_num_heads")
        self.ssm_groups: int = self.hparam("n_groups", "mamba_n_groups")
        self.ssm_inner: int = self.ssm_heads * self.hparam("mamba_head_dim")
        if self.ssm_heads % self.ssm_groups:
            raise ValueError(f"config.json mamba_num_heads ({self.ssm_heads}) must be a multiple of n_groups "
                             f"({self.ssm_groups})")
        self.eps = float(self.hparam("layer_norm_epsilon"))
        self.kv_heads, self.ffn = self.n_kv_heads, self.hparam("intermediate_size")
        # GGUF: per layer (the base class writes them)
        self.n_kv_heads = [self.kv_heads if t == "full_attention" else 0 for t in types]
        self.n_ff = [self.ffn if t == "mlp" else 0 for t in types]

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        if "num_key_value_heads" not in self.config:
            w.add_head_count_kv(self.n_kv_heads)
        w.add_vocab_size(self.n_vocab)
        w.add_layer_norm_eps(self.eps)  # llama.cpp requires it; the RMS norms read the rms key
        w.add_layer_norm_rms_eps(self.eps)
        w.add_ssm_conv_kernel(self.conv_kernel)
        w.add_ssm_inner_size(self.ssm_inner)
        w.add_ssm_state_size(self.ssm_state)
        w.add_ssm_time_step_rank(self.ssm_heads)
        w.add_ssm_group_count(self.ssm_groups)

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        name = re.sub(r"^model\.", "backbone.", name)  # transformers' own name for the trunk
        if m := re.match(r"^backbone\.layers\.(\d+)\.mixer\.dt_bias$", name):
            yield f"blk.{m[1]}.ssm_dt.bias", source
            return
        for gguf_name, out in super().tensors(name, source):
            yield gguf_name, self.mamba2(gguf_name, out)

    def expected(self) -> dict[str, tuple[int, ...]]:
        embd, vocab, head = self.n_embd, self.n_vocab, self.head_dim
        shapes = {"token_embd.weight": (vocab, embd)}
        for i, kind in enumerate(self.types):
            shapes[f"blk.{i}.attn_norm.weight"] = (embd,)
            if kind == "linear_attention":
                shapes |= self.mamba2_shapes(i, embd)
            elif kind == "mlp":
                shapes |= {f"blk.{i}.ffn_up.weight": (self.ffn, embd), f"blk.{i}.ffn_down.weight": (embd, self.ffn)}
                if self.config.get("mlp_bias"):
                    shapes |= {f"blk.{i}.ffn_up.bias": (self.ffn,), f"blk.{i}.ffn_down.bias": (embd,)}
            else:
                q, kv = self.n_heads * head, self.kv_heads * head
                shapes |= {f"blk.{i}.attn_q.weight": (q, embd), f"blk.{i}.attn_k.weight": (kv, embd),
                           f"blk.{i}.attn_v.weight": (kv, embd), f"blk.{i}.attn_output.weight": (embd, q)}
        shapes["output_norm.weight"] = (embd,)
        if not self.tied:
            shapes["output.weight"] = (vocab, embd)
        return shapes
