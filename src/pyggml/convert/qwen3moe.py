"""Qwen 3 MoE (GGUF ``qwen3moe``): Qwen 3 attention; each layer's MLP is a softmax router choosing
top-k of many experts, whose matrices GGUF stores stacked (``ffn_{gate,up,down}_exps``)."""

from __future__ import annotations

import re
from collections.abc import Iterable

import gguf

from .base import register
from .qwen3 import Qwen3
from .tensors import Source

# one expert's matrix, as Hugging Face checkpoints store them
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


@register("Qwen3MoeForCausalLM", model_types=("qwen3_moe",))
class Qwen3Moe(Qwen3):
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

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        if m := _EXPERT.match(name):  # stacked once the layer's last expert arrives
            experts = self.gather(f"{m[1]}.{m[3]}_proj", int(m[2]), self.n_experts, source)
            if experts:
                yield from super().tensors(f"{m[1]}.{m[3]}_proj.weight", Source.stack(experts))
        elif name.endswith(".mlp.experts.gate_up_proj"):  # transformers 5: all experts' gate and up in one
            gate, up = source.split([self.n_ff_exp, self.n_ff_exp], axis=1)
            yield from super().tensors(name.replace("gate_up_proj", "gate_proj.weight"), gate)
            yield from super().tensors(name.replace("gate_up_proj", "up_proj.weight"), up)
        elif name.endswith(".mlp.experts.down_proj"):
            yield from super().tensors(name + ".weight", source)
        else:
            yield from super().tensors(name, source)

    def expected(self) -> dict[str, tuple[int, ...]]:
        shapes = {k: v for k, v in super().expected().items() if not re.search(r"ffn_(gate|up|down)\.", k)}
        n, ff, embd = self.n_experts, self.n_ff_exp, self.n_embd
        return shapes | {"blk.{bid}.ffn_gate_inp.weight": (n, embd), "blk.{bid}.ffn_gate_exps.weight": (n, ff, embd),
                         "blk.{bid}.ffn_up_exps.weight": (n, ff, embd), "blk.{bid}.ffn_down_exps.weight": (n, embd, ff)}
