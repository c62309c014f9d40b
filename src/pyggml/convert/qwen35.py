"""Qwen 3.5 / 3.6 (GGUF ``qwen35``, and ``qwen35moe`` with experts): Gated DeltaNet and gated attention
layers, the text part of the released ``...ForConditionalGeneration`` checkpoints too (their vision tower
is not written).

As llama.cpp writes them: norms as ``1 + weight`` (Qwen's zero-centred RMS norms; not the DeltaNet's
output norm), ``ssm_a = -exp(A_log)``, ``dt_bias`` as ``ssm_dt.bias``, the convolution kernel 2-d, and
the DeltaNet's value heads reordered from grouped by key head (``k0: v0 v1, k1: v0 v1``) to tiled
(``v0 of k0, v0 of k1, v1 of k0, ...``), so that value head h reads key head ``h % key_heads``.
A multi-token-prediction block (``mtp.*``) becomes one more ``blk.N`` with ``nextn.*`` tensors.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import gguf
import numpy as np

from .base import _ARCHS, Architecture, StackedExperts, register
from .tensors import Source

KINDS = ("linear_attention", "full_attention")
# the MTP block's own tensors -> their GGUF names under blk.N (the rest of the block is named as a layer's)
_MTP = {"fc": "nextn.eh_proj", "pre_fc_norm_embedding": "nextn.enorm", "pre_fc_norm_hidden": "nextn.hnorm",
        "norm": "nextn.shared_head_norm"}


@register("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", model_types=("qwen3_5_text", "qwen3_5"))
class Qwen35(Architecture):
    gguf_arch = "qwen35"
    default_context = 262144
    always_head_dim = True
    keep_f32 = (*Architecture.keep_f32, "ssm_conv1d")  # ggml's convolution reads its kernel as F32
    skip = (*Architecture.skip, r"^model\.visual\.")
    mrope = True  # write rope.dimension_sections (Qwen 3.5's interleaved mRoPE; plain rope for text)

    def __init__(self, hf_dir, config, pooling=None) -> None:
        config = {**config, **(config.get("text_config") or {})}  # a vision-language checkpoint's text model
        super().__init__(hf_dir, config, pooling)
        self.n_main = self.n_layers
        self.layer_types = config.get("layer_types") or [
            "full_attention" if (i + 1) % config.get("full_attention_interval", 4) == 0 else "linear_attention"
            for i in range(self.n_main)]
        if len(self.layer_types) != self.n_main or any(t not in KINDS for t in self.layer_types):
            raise ValueError(f"config.json layer_types must name {self.n_main} layers, each one of "
                             f"{', '.join(KINDS)}; found {self.layer_types}")
        self.conv_taps: int = self.hparam("linear_conv_kernel_dim")
        self.head_k: int = self.hparam("linear_key_head_dim")
        self.head_v: int = self.hparam("linear_value_head_dim")
        self.n_k: int = self.hparam("linear_num_key_heads")
        self.n_v: int = self.hparam("linear_num_value_heads")
        if self.head_k != self.head_v or self.n_v % self.n_k:
            raise ValueError(f"config.json has linear_key_head_dim {self.head_k}, linear_value_head_dim {self.head_v}, "
                             f"{self.n_k} key and {self.n_v} value heads; GGUF {self.gguf_arch} needs equal head "
                             "sizes and value heads a multiple of the key heads")
        if config.get("attention_bias"):
            raise ValueError("config.json sets attention_bias=true; Qwen 3.5 files have no attention biases")
        self.rope_dims = int(self.head_dim * self.rope.get("partial_rotary_factor", 0.25))
        self.tied = bool(config.get("tie_word_embeddings", False))
        self.n_mtp = 0  # MTP blocks found in the checkpoint (a text-only save of the model has none)
        most = max(int(config.get("mtp_num_hidden_layers") or 0), 1)
        self.name_map = gguf.get_tensor_name_map(_ARCHS[self.gguf_arch], self.n_main + most)

    def metadata(self, w: gguf.GGUFWriter) -> None:
        n_mtp = self.n_mtp
        self.n_layers = self.n_main + n_mtp  # block_count counts the MTP blocks
        super().metadata(w)
        w.add_ssm_conv_kernel(self.conv_taps)
        w.add_ssm_state_size(self.head_k)
        w.add_ssm_group_count(self.n_k)
        w.add_ssm_time_step_rank(self.n_v)
        w.add_ssm_inner_size(self.head_v * self.n_v)
        w.add_full_attention_interval(int(self.config.get("full_attention_interval", 4)))
        w.add_array(f"{self.gguf_arch}.attention.recurrent_layers",  # (the gguf package may lack the helper)
                    [t == "linear_attention" for t in self.layer_types] + [False] * n_mtp)
        if n_mtp:
            w.add_nextn_predict_layers(n_mtp)
        w.add_rope_dimension_count(self.rope_dims)
        if self.mrope:
            sections = list(self.rope.get("mrope_section") or [11, 11, 10])
            w.add_rope_dimension_sections((sections + [0, 0, 0, 0])[:4])

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        name = re.sub(r"^model\.language_model\.", "model.", name)
        if m := re.match(r"^mtp\.(?:layers\.(\d+)\.(.*)|([a-z_]+)\.(weight))$", name):
            self.n_mtp = max(self.n_mtp, 1 + int(m[1] or 0))
            if m[1] is not None:  # a decoder layer: named as one, after the model's
                name = f"model.layers.{self.n_main + int(m[1])}.{m[2]}"
            elif m[3] in _MTP:
                yield f"blk.{self.n_main}.{_MTP[m[3]]}.{m[4]}", source if m[3] == "fc" else source.map(lambda w: w + 1)
                return
        if self.tied and name == "lm_head.weight":
            return
        if name.endswith(".A_log"):
            source = source.map(lambda a: -np.exp(a))
        elif name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif name.endswith(".conv1d.weight") and len(source.shape) == 3:  # (channels, 1, taps) -> (channels, taps)
            source = source.map(lambda w: w.reshape(w.shape[0], w.shape[2]), (source.shape[0], source.shape[2]))
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            source = source.map(lambda w: w + 1.0)
        if ".linear_attn." in name:
            source = self._tiled_value_heads(name, source)
        yield self.map_name(name), source

    def _tiled_value_heads(self, name: str, source: Source) -> Source:
        """The value-head axis of a DeltaNet tensor reordered from grouped by key head to tiled."""
        r, keys = self.n_v // self.n_k, 2 * self.n_k * self.head_k

        def tiled(a: np.ndarray, axis: int, start: int, head: int) -> np.ndarray:
            a = np.moveaxis(a, axis, 0)
            v = a[start:].reshape(self.n_k, r, head, *a.shape[1:]).swapaxes(0, 1).reshape(a[start:].shape)
            return np.moveaxis(np.concatenate([a[:start], v]), 0, axis)

        if r == 1:
            return source
        kind = name.rsplit(".", 2)[-2] if name.endswith((".weight", ".bias")) else name.rsplit(".", 1)[-1]
        axis, start, head = {"in_proj_qkv": (0, keys, self.head_v), "conv1d": (0, keys, self.head_v),
                             "in_proj_z": (0, 0, self.head_v), "in_proj_a": (0, 0, 1), "in_proj_b": (0, 0, 1),
                             "A_log": (0, 0, 1), "dt_proj": (0, 0, 1), "out_proj": (1, 0, self.head_v)}.get(kind,
                                                                                                    (None, 0, 0))
        return source if axis is None else source.map(lambda a: tiled(a, axis, start, head))

    def expected(self) -> dict[str, tuple[int, ...]]:
        embd, vocab, head = self.n_embd, self.n_vocab, self.head_dim
        key, value = self.n_k * self.head_k, self.n_v * self.head_v
        shapes = {"token_embd.weight": (vocab, embd)}
        for i in range(self.n_main + self.n_mtp):
            shapes |= {f"blk.{i}.attn_norm.weight": (embd,), f"blk.{i}.post_attention_norm.weight": (embd,)}
            if i < self.n_main and self.layer_types[i] == "linear_attention":
                shapes |= {f"blk.{i}.attn_qkv.weight": (2 * key + value, embd),
                           f"blk.{i}.attn_gate.weight": (value, embd),
                           f"blk.{i}.ssm_conv1d.weight": (2 * key + value, self.conv_taps),
                           f"blk.{i}.ssm_dt.bias": (self.n_v,), f"blk.{i}.ssm_a": (self.n_v,),
                           f"blk.{i}.ssm_norm.weight": (self.head_v,), f"blk.{i}.ssm_out.weight": (embd, value)}
                shapes |= self.gate_shapes(i)
            else:
                kv = self.n_kv_heads * head
                shapes |= {f"blk.{i}.attn_q.weight": (2 * self.n_heads * head, embd),
                           f"blk.{i}.attn_k.weight": (kv, embd), f"blk.{i}.attn_v.weight": (kv, embd),
                           f"blk.{i}.attn_q_norm.weight": (head,), f"blk.{i}.attn_k_norm.weight": (head,),
                           f"blk.{i}.attn_output.weight": (embd, self.n_heads * head)}
            shapes |= self.feed_forward_shapes(i)
            if i >= self.n_main:
                shapes |= {f"blk.{i}.nextn.eh_proj.weight": (embd, 2 * embd), f"blk.{i}.nextn.enorm.weight": (embd,),
                           f"blk.{i}.nextn.hnorm.weight": (embd,), f"blk.{i}.nextn.shared_head_norm.weight": (embd,)}
        shapes["output_norm.weight"] = (embd,)
        if not self.tied:
            shapes["output.weight"] = (vocab, embd)
        return shapes

    def gate_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        """A DeltaNet layer's projections of its learning strengths and decays."""
        return {f"blk.{layer}.ssm_beta.weight": (self.n_v, self.n_embd),
                f"blk.{layer}.ssm_alpha.weight": (self.n_v, self.n_embd)}

    def feed_forward_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        """The tensors of a layer's MLP."""
        ff, embd = self.hparam("intermediate_size"), self.n_embd
        return {f"blk.{layer}.ffn_gate.weight": (ff, embd), f"blk.{layer}.ffn_up.weight": (ff, embd),
                f"blk.{layer}.ffn_down.weight": (embd, ff)}


@register("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration",
          model_types=("qwen3_5_moe_text", "qwen3_5_moe"))
class Qwen35Moe(StackedExperts, Qwen35):
    """Qwen 3.5 / 3.6 MoE (GGUF ``qwen35moe``): every MLP a softmax router over stacked experts
    (``ffn_*_exps``) plus a shared expert (``ffn_*_shexp``) scaled by a sigmoid gate."""

    gguf_arch = "qwen35moe"
    keep_f32 = (*Qwen35.keep_f32, "ffn_gate_inp_shexp")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.n_experts: int = self.hparam("num_experts")
        self.n_experts_used: int = self.hparam("num_experts_per_tok")
        self.n_ff_exp: int = self.hparam("moe_intermediate_size")
        self.n_ff_shexp: int = self.hparam("shared_expert_intermediate_size")
        if self.config.get("norm_topk_prob", True) is False:
            raise ValueError("config.json has norm_topk_prob=false; GGUF qwen35moe always renormalises the chosen "
                             "experts' router weights")

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        w.add_expert_count(self.n_experts)
        w.add_expert_used_count(self.n_experts_used)
        w.add_expert_feed_forward_length(self.n_ff_exp)
        w.add_expert_shared_feed_forward_length(self.n_ff_shexp)

    def feed_forward_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        n, ff, sh, embd = self.n_experts, self.n_ff_exp, self.n_ff_shexp, self.n_embd
        return {f"blk.{layer}.ffn_gate_inp.weight": (n, embd), f"blk.{layer}.ffn_gate_exps.weight": (n, ff, embd),
                f"blk.{layer}.ffn_up_exps.weight": (n, ff, embd), f"blk.{layer}.ffn_down_exps.weight": (n, embd, ff),
                f"blk.{layer}.ffn_gate_inp_shexp.weight": (1, embd), f"blk.{layer}.ffn_gate_shexp.weight": (sh, embd),
                f"blk.{layer}.ffn_up_shexp.weight": (sh, embd), f"blk.{layer}.ffn_down_shexp.weight": (embd, sh)}


@register("Qwen3NextForCausalLM", model_types=("qwen3_next",))
class Qwen3Next(Qwen35Moe):
    """Qwen3-Next (GGUF ``qwen3next``): Qwen 3.5 MoE's layers with the DeltaNet's value heads left grouped by
    key head, its q, k, v, z projections fused per key head in the checkpoint (``in_proj_qkvz``: written as
    ``attn_qkv`` and ``attn_gate``), its beta and alpha projections fused (``in_proj_ba`` -> ``ssm_ba``)."""

    gguf_arch = "qwen3next"
    default_context = 262144
    mrope = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.config.get("mlp_only_layers") or self.config.get("decoder_sparse_step", 1) != 1:
            raise ValueError("config.json has dense layers (mlp_only_layers / decoder_sparse_step); GGUF qwen3next has "
                             "experts in every layer")

    def _tiled_value_heads(self, name: str, source: Source) -> Source:
        return source  # the file keeps the checkpoint's grouped order

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        if name.endswith(".linear_attn.in_proj_qkvz.weight"):  # per key head: q, k, v, z -> all q, all k, all v; z
            layer = re.search(r"layers\.(\d+)\.", name)[1]
            group = self.n_v // self.n_k * self.head_v  # a key head's value (and z) rows
            per_head = [self.head_k, self.head_k, group, group]
            embd, qkv = source.shape[1], 2 * self.n_k * self.head_k + self.n_v * self.head_v

            def part(w: np.ndarray, which: slice) -> np.ndarray:
                bounds = np.cumsum([0, *per_head])
                heads = w.reshape(self.n_k, int(bounds[-1]), embd)
                return np.concatenate([heads[:, bounds[i]:bounds[i + 1]].reshape(-1, embd)
                                       for i in range(4)[which]])

            yield f"blk.{layer}.attn_qkv.weight", source.map(lambda w: part(w, slice(0, 3)), (qkv, embd))
            yield f"blk.{layer}.attn_gate.weight", source.map(lambda w: part(w, slice(3, 4)),
                                                             (self.n_v * self.head_v, embd))
        else:
            yield from super().tensors(name, source)

    def gate_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        return {f"blk.{layer}.ssm_ba.weight": (2 * self.n_v, self.n_embd)}
