"""Llama 4 (GGUF ``llama4``, as llama.cpp converts it): Llama's layout without the q/k row reordering (Meta's
rope already rotates adjacent pairs), dense layers of ``intermediate_size_mlp`` between expert layers (every
``interleave_moe_layer_step``-th) whose fused ``gate_up_proj`` / ``down_proj`` are split and transposed into
``ffn_{gate,up,down}_exps``, and a shared expert. llama.cpp leaves rope out of every fourth layer and chunks
the others' attention by fixed rules, so checkpoints whose ``no_rope_layers``, ``layer_types`` or
``moe_layers`` say otherwise are refused. The chunk size and the attention temperature are written
(``attention.chunk_size``, ``attention.temperature_scale``, ``attention.temperature_length``) for pyggml;
llama.cpp runs every file at its fixed 8192, 0.1 and 8192. A ``Llama4ForConditionalGeneration`` checkpoint
gives its text decoder (the vision part is left out)."""

from __future__ import annotations

import re
from collections.abc import Iterable

import gguf

from .base import TextOfMultimodal, register
from .llama import Llama
from .tensors import Source

NO_ROPE_STEP = 4  # llama.cpp's n_no_rope_layer_step, also its chunked-layer pattern
MAVERICK_EXPERTS = 128  # llama.cpp's llama4 normalises q/k unless the model has this many experts


@register("Llama4ForCausalLM", model_types=("llama4_text",))
class Llama4(Llama):
    gguf_arch = "llama4"
    rope_types = ("default", "llama3")
    interleave_qk = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        c, n = self.config, self.n_layers
        self.n_experts: int = self.hparam("num_local_experts")
        self.n_experts_used: int = self.hparam("num_experts_per_tok")
        self.n_ff_exp: int = self.hparam("intermediate_size")  # Hugging Face's name for the experts' width
        self.n_ff = self.hparam("intermediate_size_mlp")  # the dense layers'
        self.moe_step: int = self.hparam("interleave_moe_layer_step")
        self.moe = [self.moe_step > 0 and (i + 1) % self.moe_step == 0 for i in range(n)]
        if c.get("moe_layers") is not None and list(c["moe_layers"]) != [i for i in range(n) if self.moe[i]]:
            raise ValueError(f"config.json's moe_layers {c['moe_layers']} are not every {self.moe_step}th layer, "
                             "as GGUF llama4 places them")
        rope_layers = [int((i + 1) % NO_ROPE_STEP != 0) for i in range(n)]
        if list(c.get("no_rope_layers") or rope_layers) != rope_layers:
            raise ValueError(f"config.json's no_rope_layers are not GGUF llama4's (rope left out of every "
                             f"{NO_ROPE_STEP}th layer): {c['no_rope_layers']}")
        self.chunk: int | None = c.get("attention_chunk_size")
        kinds = ["chunked_attention" if r else "full_attention" for r in rope_layers]
        if not self.chunk or list(c.get("layer_types") or kinds) != kinds:
            raise ValueError(f"config.json's attention_chunk_size / layer_types ({c.get('layer_types')}) are not "
                             "GGUF llama4's: chunked attention on exactly the rope layers")
        if bool(c.get("use_qk_norm", True)) != (self.n_experts != MAVERICK_EXPERTS):
            raise ValueError(f"config.json's use_qk_norm={c.get('use_qk_norm')} with {self.n_experts} experts; "
                             f"llama.cpp normalises q/k exactly when there are not {MAVERICK_EXPERTS} experts")

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        c = self.config
        w.add_expert_count(self.n_experts)
        w.add_expert_used_count(self.n_experts_used)
        w.add_expert_feed_forward_length(self.n_ff_exp)
        w.add_interleave_moe_layer_step(self.moe_step)
        w.add_uint32(f"{self.gguf_arch}.attention.chunk_size", int(self.chunk))
        tuning = c.get("attn_temperature_tuning", True)
        w.add_attn_temperature_scale(float(c.get("attn_scale", 0.1)) if tuning else 0.0)
        w.add_attn_temperature_length(int(c.get("floor_scale", 8192)))

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        if name.endswith(".feed_forward.experts.gate_up_proj"):  # (experts, hidden, 2 * ff): x @ W
            gate, up = source.split([self.n_ff_exp, self.n_ff_exp], axis=2)
            for part, kind in ((gate, "gate"), (up, "up")):
                yield from super().tensors(name.replace("gate_up_proj", f"{kind}_proj.weight"), _transposed(part))
        elif name.endswith(".feed_forward.experts.down_proj"):  # (experts, ff, hidden)
            yield from super().tensors(name + ".weight", _transposed(source))
        else:
            yield from super().tensors(name, source)

    def expected(self) -> dict[str, tuple[int, ...]]:
        embd, ff, ff_exp, n = self.n_embd, self.n_ff, self.n_ff_exp, self.n_experts
        shapes = super().expected()
        dense = {k: shapes.pop(k) for k in list(shapes) if re.search(r"\.ffn_(gate|up|down)\.", k)}
        dense = {k: (ff, embd) if "down" not in k else (embd, ff) for k in dense}
        moe = {"ffn_gate_inp": (n, embd), "ffn_gate_exps": (n, ff_exp, embd), "ffn_up_exps": (n, ff_exp, embd),
               "ffn_down_exps": (n, embd, ff_exp), "ffn_gate_shexp": (ff_exp, embd), "ffn_up_shexp": (ff_exp, embd),
               "ffn_down_shexp": (embd, ff_exp)}
        for i in range(self.n_layers):
            if self.moe[i]:
                shapes |= {f"blk.{i}.{k}.weight": v for k, v in moe.items()}
            else:
                shapes |= {k.format(bid=i): v for k, v in dense.items()}
        return shapes


def _transposed(source: Source) -> Source:
    """Stacked (experts, in, out) matrices as GGUF stores experts: (experts, out, in)."""
    e, a, b = source.shape
    return source.map(lambda w: w.transpose(0, 2, 1), (e, b, a))


@register("Llama4ForConditionalGeneration")
class Llama4Text(TextOfMultimodal, Llama4):
    """The text decoder of a checkpoint saved with its vision part (as Meta publishes Llama 4)."""

    skip = (*Llama4.skip, r"^(model\.)?(vision_model|multi_modal_projector)\.")

