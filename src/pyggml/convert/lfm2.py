"""LFM2 / LFM2.5 (GGUF ``lfm2``): short-convolution and attention layers; ``head_count_kv`` per layer
(0 marks a convolution layer), the convolution's taps as ``shortconv.l_cache``, its kernel 2-d; and
LFM2-MoE (GGUF ``lfm2moe``), the same layers with experts."""

from __future__ import annotations

import re
from collections.abc import Iterable

import gguf

from .base import Architecture, register
from .tensors import Source

KINDS = ("conv", "full_attention")


@register("Lfm2ForCausalLM", "LFM2ForCausalLM", model_types=("lfm2",))
class Lfm2(Architecture):
    gguf_arch = "lfm2"
    default_context = 128000
    keep_f32 = (*Architecture.keep_f32, "conv")  # the short kernels, as llama.cpp keeps them (ssm_conv reads F32)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        config = self.config
        self.layer_types = config.get("layer_types") or [
            "full_attention" if i in (config.get("full_attn_idxs") or range(self.n_layers)) else "conv"
            for i in range(self.n_layers)]
        if len(self.layer_types) != self.n_layers or any(t not in KINDS for t in self.layer_types):
            raise ValueError(f"config.json layer_types must name {self.n_layers} layers, each one of "
                             f"{', '.join(KINDS)}; found {self.layer_types}")
        if config.get("conv_bias"):
            raise ValueError("config.json sets conv_bias=true; LFM2 files have no convolution biases (llama.cpp "
                             "runs them without)")
        self.conv_taps: int = self.hparam("conv_L_cache")
        if self.conv_taps < 2:
            raise ValueError(f"config.json conv_L_cache must be >= 2, found {self.conv_taps}")
        self.kv_heads = self.n_kv_heads
        self.n_kv_heads = [self.kv_heads if t == "full_attention" else 0 for t in self.layer_types]  # GGUF: per layer
        self.n_ff = self._feed_forward_length()
        self.tied = bool(config.get("tie_word_embeddings", config.get("tie_embedding", True)))
        self.rope.setdefault("rope_theta", 1000000.0)

    def _feed_forward_length(self) -> int:
        """The MLP's width as transformers' Lfm2MLP computes it from ``block_ff_dim``/``intermediate_size``."""
        ff = self.hparam("block_ff_dim", "intermediate_size")
        if self.config.get("block_auto_adjust_ff_dim", True):
            ff = int(2 * ff / 3)
            multiplier = self.config.get("block_ffn_dim_multiplier", 1.0)
            if multiplier is not None:
                multiple = self.config.get("block_multiple_of", 256)
                ff = multiple * -(-int(multiplier * ff) // multiple)
        return ff

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        w.add_vocab_size(self.n_vocab)
        w.add_shortconv_l_cache(self.conv_taps)
        if "rms_norm_eps" not in self.config:  # written by the base class
            w.add_layer_norm_rms_eps(float(self.config.get("norm_eps", 1e-5)))

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        for gguf_name, out in super().tensors(name, source):
            if gguf_name.endswith(".shortconv.conv.weight") and len(out.shape) == 3:  # (dim, 1, taps) -> (dim, taps)
                out = out.map(lambda w: w.reshape(w.shape[0], w.shape[2]), (out.shape[0], out.shape[2]))
            yield gguf_name, out

    def expected(self) -> dict[str, tuple[int, ...]]:
        embd, vocab, head = self.n_embd, self.n_vocab, self.head_dim
        shapes = {"token_embd.weight": (vocab, embd), "blk.{bid}.attn_norm.weight": (embd,),
                  "blk.{bid}.ffn_norm.weight": (embd,)}
        for i, kind in enumerate(self.layer_types):
            shapes |= self.feed_forward_shapes(i)
            if kind == "conv":
                shapes |= {f"blk.{i}.shortconv.conv.weight": (embd, self.conv_taps),
                           f"blk.{i}.shortconv.in_proj.weight": (3 * embd, embd),
                           f"blk.{i}.shortconv.out_proj.weight": (embd, embd)}
            else:
                kv = self.kv_heads * head
                shapes |= {f"blk.{i}.attn_q.weight": (self.n_heads * head, embd), f"blk.{i}.attn_k.weight": (kv, embd),
                           f"blk.{i}.attn_v.weight": (kv, embd), f"blk.{i}.attn_q_norm.weight": (head,),
                           f"blk.{i}.attn_k_norm.weight": (head,),
                           f"blk.{i}.attn_output.weight": (embd, self.n_heads * head)}
        shapes["token_embd_norm.weight"] = (embd,)
        if not self.tied:
            shapes["output.weight"] = (vocab, embd)
        return shapes

    def feed_forward_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        """The tensors of a layer's MLP."""
        ff, embd = self.n_ff, self.n_embd
        return {f"blk.{layer}.ffn_gate.weight": (ff, embd), f"blk.{layer}.ffn_up.weight": (ff, embd),
                f"blk.{layer}.ffn_down.weight": (embd, ff)}


# one expert's matrix, as LFM2-MoE checkpoints store them
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.feed_forward\.experts\.(\d+)\.(w[123])\.weight$")


@register("Lfm2MoeForCausalLM", model_types=("lfm2_moe",))
class Lfm2Moe(Lfm2):
    """LFM2-MoE (GGUF ``lfm2moe``): experts after ``num_dense_layers`` plain MLP layers, a sigmoid router
    whose per-expert bias (``exp_probs_b``) only chooses, the chosen weights renormalised."""

    gguf_arch = "lfm2moe"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.n_ff = self.hparam("intermediate_size")  # the dense layers' MLP, as stated
        self.n_experts: int = self.hparam("num_experts")
        self.n_experts_used: int = self.hparam("num_experts_per_tok")
        self.n_ff_exp: int = self.hparam("moe_intermediate_size")
        self.n_dense: int = self.config.get("num_dense_layers", 2)
        for key, value in (("norm_topk_prob", True), ("use_expert_bias", True), ("routed_scaling_factor", 1.0)):
            if self.config.get(key, value) != value:
                raise ValueError(f"config.json has {key}={self.config[key]}; GGUF lfm2moe supports only {value}")

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        w.add_expert_count(self.n_experts)
        w.add_expert_used_count(self.n_experts_used)
        w.add_expert_feed_forward_length(self.n_ff_exp)
        w.add_leading_dense_block_count(self.n_dense)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        if m := _EXPERT.match(name):  # stacked once the layer's last expert arrives
            experts = self.gather(f"layers.{m[1]}.feed_forward.experts.{m[3]}", int(m[2]), self.n_experts, source)
            if experts:
                yield from super().tensors(f"layers.{m[1]}.feed_forward.experts.{m[3]}.weight", Source.stack(experts))
        elif name.endswith(".feed_forward.expert_bias"):
            yield from super().tensors(name + ".bias", source)
        else:
            yield from super().tensors(name, source)

    def feed_forward_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        if layer < self.n_dense:
            return super().feed_forward_shapes(layer)
        n, ff, embd = self.n_experts, self.n_ff_exp, self.n_embd
        return {f"blk.{layer}.ffn_gate_inp.weight": (n, embd), f"blk.{layer}.exp_probs_b.bias": (n,),
                f"blk.{layer}.ffn_gate_exps.weight": (n, ff, embd), f"blk.{layer}.ffn_up_exps.weight": (n, ff, embd),
                f"blk.{layer}.ffn_down_exps.weight": (n, embd, ff)}
