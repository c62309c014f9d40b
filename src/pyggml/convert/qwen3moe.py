"""Qwen 3 MoE (GGUF ``qwen3moe``): Qwen 3 attention; each layer's MLP is a softmax router choosing
top-k of many experts, whose matrices GGUF stores stacked (``ffn_{gate,up,down}_exps``)."""

from __future__ import annotations

import re

import gguf

from .base import StackedExperts, register
from .qwen3 import Qwen3


@register("Qwen3MoeForCausalLM", model_types=("qwen3_moe",))
class Qwen3Moe(StackedExperts, Qwen3):
    gguf_arch = "qwen3moe"
    embedding = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.n_experts: int = self.hparam("num_experts", "num_local_experts")
        self.n_experts_used: int = self.hparam("num_experts_per_tok")
        self.n_ff_exp: int = self.hparam("moe_intermediate_size")
        if not self.config.get("norm_topk_prob", False):
            raise ValueError("config.json has norm_topk_prob=false; GGUF qwen3moe always renormalises the "
                             "chosen experts' router weights")
        if self.config.get("mlp_only_layers") or self.config.get("decoder_sparse_step", 1) != 1:
            raise ValueError("config.json has dense layers (mlp_only_layers / decoder_sparse_step); GGUF qwen3moe "
                             "has experts in every layer")

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        w.add_expert_count(self.n_experts)
        w.add_expert_used_count(self.n_experts_used)
        w.add_expert_feed_forward_length(self.n_ff_exp)

    def expected(self) -> dict[str, tuple[int, ...]]:
        shapes = {k: v for k, v in super().expected().items() if not re.search(r"ffn_(gate|up|down)\.", k)}
        n, ff, embd = self.n_experts, self.n_ff_exp, self.n_embd
        return shapes | {"blk.{bid}.ffn_gate_inp.weight": (n, embd), "blk.{bid}.ffn_gate_exps.weight": (n, ff, embd),
                         "blk.{bid}.ffn_up_exps.weight": (n, ff, embd), "blk.{bid}.ffn_down_exps.weight": (n, embd, ff)}
