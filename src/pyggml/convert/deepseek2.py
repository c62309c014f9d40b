"""DeepSeek V2 / V3 and GLM-4.7-Flash (GGUF ``deepseek2``, as llama.cpp converts them, with the split
``attn_k_b``/``attn_v_b`` of its MLA files): ``kv_b_proj`` becomes W_UK per head, stored transposed for absorbing
it into the queries, and W_UV per head; GGUF's key/value lengths are the latent cache's (kv_lora_rank + rope,
kv_lora_rank) and the heads' own sizes go under ``attention.key_length_mla``/``value_length_mla``; one KV head.
The router is softmax (V2) or sigmoid with ``e_score_correction_bias`` as ``exp_probs_b`` and grouped top-k (V3,
GLM-4.7-Flash); experts are stacked; YaRN's ``mscale_all_dim`` is written as 0.1 x itself in
``rope.scaling.yarn_log_multiplier`` (llama.cpp's convention for deepseek2). Configs llama.cpp's graph would run
differently from transformers are refused."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import ClassVar

import gguf

from .base import StackedExperts, register
from .tensors import Source

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class DeepSeekMoE(StackedExperts):
    """DeepSeek's feed-forward as GGUF stores it (also GLM-4.5's, ``glm4moe.py``): ``first_k_dense_replace`` dense
    layers, then a router (with ``exp_probs_b``, V3's correction bias, where ``router_bias``), stacked experts and
    shared experts; multi-token prediction layers past ``num_hidden_layers`` are left out."""

    router_bias: ClassVar[bool] = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        c = self.config
        self.n_experts: int = c.get("n_routed_experts") or 0
        self.n_dense: int = (c.get("first_k_dense_replace") or 0) if self.n_experts else self.n_layers
        if kinds := c.get("mlp_layer_types"):  # GLM-4.7-Flash: "dense" or "sparse" per layer
            self.n_dense = next((i for i, kind in enumerate(kinds) if kind != "dense"), len(kinds))
            if len(kinds) != self.n_layers or any(kind != "sparse" for kind in kinds[self.n_dense:]):
                raise ValueError(f"config.json's mlp_layer_types {kinds}: GGUF {self.gguf_arch} has dense layers "
                                 f"only before the sparse ones, one kind per layer ({self.n_layers})")
        if self.n_experts:
            self.n_used: int = self.hparam("num_experts_per_tok")
            self.n_ff_exp: int = self.hparam("moe_intermediate_size")
            self.n_shared: int = c.get("n_shared_experts") or 0
        if c.get("mlp_bias"):
            raise ValueError(f"config.json sets mlp_bias; GGUF {self.gguf_arch} has no MLP biases")
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json's hidden_act {c['hidden_act']!r}; GGUF {self.gguf_arch} runs silu")

    def moe_metadata(self, w: gguf.GGUFWriter, *, sigmoid: bool, grouped: bool) -> None:
        """The experts' keys; ``grouped``: with the config's renormalisation and expert groups."""
        c = self.config
        w.add_leading_dense_block_count(self.n_dense)
        if not self.n_experts:
            return
        w.add_expert_count(self.n_experts)
        w.add_expert_used_count(self.n_used)
        w.add_expert_feed_forward_length(self.n_ff_exp)
        w.add_expert_shared_count(self.n_shared)
        w.add_expert_weights_scale(float(c.get("routed_scaling_factor") or 1.0))
        if grouped:
            w.add_expert_weights_norm(bool(c.get("norm_topk_prob")))
            w.add_expert_group_count(c.get("n_group") or 1)
            w.add_expert_group_used_count(c.get("topk_group") or 1)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        if (m := _LAYER.match(name)) and int(m[1]) >= self.n_layers:  # multi-token prediction layers
            return
        if name.endswith(".mlp.gate.e_score_correction_bias"):
            yield re.sub(r"^model\.layers\.(\d+)\..*", r"blk.\1.exp_probs_b.bias", name), source
        else:
            yield from super().tensors(name, source)  # experts stacked (StackedExperts), the rest by name

    def feed_forward_shapes(self, i: int) -> dict[str, tuple[int, ...]]:
        """Layer i's feed-forward tensors."""
        p, embd = f"blk.{i}.", self.n_embd
        if i < self.n_dense:
            ff = self.hparam("intermediate_size")
            return {p + "ffn_gate.weight": (ff, embd), p + "ffn_up.weight": (ff, embd),
                    p + "ffn_down.weight": (embd, ff)}
        n, ff, shared = self.n_experts, self.n_ff_exp, self.n_ff_exp * self.n_shared
        shapes = {p + "ffn_gate_inp.weight": (n, embd)}
        if self.router_bias:
            shapes[p + "exp_probs_b.bias"] = (n,)
        shapes |= {p + "ffn_gate_exps.weight": (n, ff, embd), p + "ffn_up_exps.weight": (n, ff, embd),
                   p + "ffn_down_exps.weight": (n, embd, ff)}
        if shared:
            shapes |= {p + "ffn_gate_shexp.weight": (shared, embd), p + "ffn_up_shexp.weight": (shared, embd),
                       p + "ffn_down_shexp.weight": (embd, shared)}
        return shapes


@register("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM",
          model_types=("deepseek_v2", "deepseek_v3", "glm4_moe_lite"))
class DeepSeek2(DeepSeekMoE):
    gguf_arch = "deepseek2"
    rope_types = ("default", "yarn")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        c = self.config
        # V3's router (sigmoid, correction bias, groups): DeepSeek V3 and GLM-4.7-Flash
        v2 = c.get("model_type") == "deepseek_v2" or (c.get("architectures") or [""])[0] == "DeepseekV2ForCausalLM"
        self.v3 = not v2
        self.router_bias = self.v3
        self.q_lora: int = c.get("q_lora_rank") or 0
        self.kv_lora: int = self.hparam("kv_lora_rank")
        self.rope_dim: int = self.hparam("qk_rope_head_dim")
        self.nope_dim: int = self.hparam("qk_nope_head_dim")
        self.v_dim: int = self.hparam("v_head_dim")
        # GGUF's key/value lengths are the latent cache's (written below), one KV head
        self.head_dim, self.n_kv_heads = self.n_embd // self.n_heads, 1
        self._refuse()

    def _refuse(self) -> None:
        """What the GGUF graph cannot express, or llama.cpp runs otherwise than transformers."""
        c, rope = self.config, self.rope
        if c.get("attention_bias"):
            raise ValueError("config.json sets attention_bias; GGUF deepseek2 has no attention biases")
        if self.v3 and c.get("rope_interleave") is False:
            raise ValueError("config.json sets rope_interleave=false; llama.cpp's deepseek2 rotates interleaved pairs")
        if self.n_experts and not self.n_shared:
            raise ValueError("config.json has no n_shared_experts; GGUF deepseek2 always has shared experts")
        if not self.v3 and c.get("topk_method", "greedy") == "group_limited_greedy" and (c.get("n_group") or 1) > 1:
            raise ValueError("config.json's topk_method group_limited_greedy scores a group by its best expert; "
                             "llama.cpp's deepseek2 scores it by its best two (DeepSeek V3's rule)")
        if self.v3 and c.get("scoring_func", "sigmoid") != "sigmoid":
            raise ValueError(f"config.json's scoring_func {c['scoring_func']!r}; DeepSeek V3 routes by sigmoid")
        if rope["rope_type"] == "yarn":
            # llama.cpp gives YaRN's rope a magnitude of 1 and scales the scores by mscale(mscale_all_dim)^2:
            # transformers' result when mscale == mscale_all_dim (as DeepSeek's configs have them)
            if not rope.get("mscale_all_dim") or rope.get("mscale", rope["mscale_all_dim"]) != rope["mscale_all_dim"] \
                    or rope.get("attention_factor") is not None:
                raise ValueError("config.json's YaRN needs mscale_all_dim, equal to mscale, and no attention_factor "
                                 "(llama.cpp's deepseek2 assumes DeepSeek's mscale == mscale_all_dim)")
            if rope.get("truncate") is False:
                raise ValueError("config.json's YaRN sets truncate=false; ggml's YaRN truncates")

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        c = self.config
        if "rms_norm_eps" not in c:  # llama.cpp requires the key
            w.add_layer_norm_rms_eps(1e-6)
        if "num_key_value_heads" not in c:  # else written by the base class (as 1)
            w.add_head_count_kv(1)
        w.add_vocab_size(self.n_vocab)
        w.add_q_lora_rank(self.q_lora)  # 0 too: llama.cpp requires the key unless the layer count says V2-Lite
        w.add_kv_lora_rank(self.kv_lora)
        w.add_key_length(self.kv_lora + self.rope_dim)
        w.add_value_length(self.kv_lora)
        w.add_key_length_mla(self.nope_dim + self.rope_dim)
        w.add_value_length_mla(self.v_dim)
        w.add_rope_dimension_count(self.rope_dim)
        if self.rope["rope_type"] == "yarn":
            w.add_rope_scaling_yarn_log_mul(0.1 * float(self.rope["mscale_all_dim"]))
        # transformers' V2 router never renormalises, nor groups when greedy
        self.moe_metadata(w, sigmoid=self.v3, grouped=self.v3)

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        if not name.endswith(".kv_b_proj.weight"):
            yield from super().tensors(name, source)
            return
        # (heads * (nope + v), rank): W_UK per head transposed to (rank, nope) for absorbing, W_UV per head
        h, nope, v, rank = self.n_heads, self.nope_dim, self.v_dim, self.kv_lora
        kv = source.map(lambda a: a.reshape(h, nope + v, rank), (h, nope + v, rank))
        k_b, v_b = kv.split([nope, v], axis=1)
        yield from super().tensors(name.replace("kv_b_proj", "k_b_proj"),
                                   k_b.map(lambda a: a.transpose(0, 2, 1), (h, rank, nope)))
        yield from super().tensors(name.replace("kv_b_proj", "v_b_proj"), v_b)

    def expected(self) -> dict[str, tuple[int, ...]]:
        embd, heads, rank = self.n_embd, self.n_heads, self.kv_lora
        q = heads * (self.nope_dim + self.rope_dim)
        shapes = {"token_embd.weight": (self.n_vocab, embd)}
        for i in range(self.n_layers):
            p = f"blk.{i}."
            shapes[p + "attn_norm.weight"] = (embd,)
            if self.q_lora:
                shapes |= {p + "attn_q_a.weight": (self.q_lora, embd), p + "attn_q_a_norm.weight": (self.q_lora,),
                           p + "attn_q_b.weight": (q, self.q_lora)}
            else:
                shapes[p + "attn_q.weight"] = (q, embd)
            shapes |= {p + "attn_kv_a_mqa.weight": (rank + self.rope_dim, embd), p + "attn_kv_a_norm.weight": (rank,),
                       p + "attn_k_b.weight": (heads, rank, self.nope_dim),  # W_UK transposed
                       p + "attn_v_b.weight": (heads, self.v_dim, rank),
                       p + "attn_output.weight": (embd, heads * self.v_dim), p + "ffn_norm.weight": (embd,)}
            shapes |= self.feed_forward_shapes(i)
        shapes["output_norm.weight"] = (embd,)
        if not self.tied:
            shapes["output.weight"] = (self.n_vocab, embd)
        return shapes
