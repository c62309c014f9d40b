"""Qwen 3.5 / 3.6 mixture-of-experts decoders (GGUF architecture "qwen35moe": Qwen3.5-35B-A3B, 122B-A10B,
397B-A17B, Qwen3.6 MoE).

Qwen 3.5's layers (``pyggml.models.qwen35``: Gated DeltaNet and gated attention, the same caches) with
a mixture of experts in place of every MLP: a softmax router (``ffn_gate_inp``) sends each token to its
``expert_used_count`` best experts, weighted by their renormalised probabilities (``nn.moe``), and a
shared expert (``ffn_*_shexp``) that every token goes through is added, scaled by
``sigmoid(ffn_gate_inp_shexp x)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyggml import nn
from pyggml.backend import Backend
from pyggml.models import ModelError, qwen35, register
from pyggml.tensor import Tensor


@dataclass(frozen=True)
class Options(qwen35.Options):
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn_size: int = 0
    shared_ffn_size: int = 0
    fused_experts: bool = False  # gate and up experts in one ffn_gate_up_exps (nn.fused_gate_up)

    @classmethod
    def from_config(cls, config, **extra) -> Options:
        arch = config.architecture
        n_experts, n_used = nn.expert_counts(config)
        expert_ffn = config.uint("expert_feed_forward_length", 0)
        shared_ffn = config.uint("expert_shared_feed_forward_length", 0)
        if not expert_ffn or not shared_ffn:
            raise ModelError(f"{arch}: {arch}.expert_feed_forward_length and {arch}.expert_shared_feed_forward_length "
                             "must be set and non-zero")
        if config.uint("expert_gating_func", 1) != 1:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
            raise ModelError(f"{arch}: {arch}.expert_gating_func {config.uint('expert_gating_func')} is not "
                             "supported (only 1, softmax)")
        if config.float("expert_weights_scale", 1.0) not in (0.0, 1.0):
            raise ModelError(f"{arch}: {arch}.expert_weights_scale is not supported (the experts' weights are "
                             "renormalised only)")
        return super().from_config(config, n_experts=n_experts, n_experts_used=n_used, expert_ffn_size=expert_ffn,
                                   shared_ffn_size=shared_ffn, **extra)


class Experts(nn.Module):
    ffn_gate_inp: nn.Linear = nn.shape("hidden_size", "n_experts")  # the router
    ffn_gate_exps: nn.Experts | None = nn.shape("hidden_size", "expert_ffn_size", "n_experts", when="not fused_experts")
    ffn_up_exps: nn.Experts | None = nn.shape("hidden_size", "expert_ffn_size", "n_experts", when="not fused_experts")
    ffn_gate_up_exps: nn.Experts | None = nn.shape("hidden_size", "2 * expert_ffn_size", "n_experts",
                                                   when="fused_experts")
    ffn_down_exps: nn.Experts = nn.shape("expert_ffn_size", "hidden_size", "n_experts")
    ffn_gate_inp_shexp: nn.Linear = nn.shape("hidden_size", 1)  # the shared expert's gate
    ffn_gate_shexp: nn.Linear = nn.shape("hidden_size", "shared_ffn_size")
    ffn_up_shexp: nn.Linear = nn.shape("hidden_size", "shared_ffn_size")
    ffn_down_shexp: nn.Linear = nn.shape("shared_ffn_size", "hidden_size")

    def __call__(self, x: Tensor, opts: Options, layer: int) -> Tensor:
        gate = self.ffn_gate_exps if self.ffn_gate_up_exps is None else self.ffn_gate_up_exps
        routed = nn.moe(x, self.ffn_gate_inp(x), opts.n_experts_used, gate, self.ffn_up_exps,
                        self.ffn_down_exps, lambda gate, up: gate.silu(up))
        shared = self.ffn_down_shexp(self.ffn_gate_shexp(x).silu(self.ffn_up_shexp(x)))
        return routed + shared * self.ffn_gate_inp_shexp(x).sigmoid()


class Layer(qwen35.Layer):
    mlp: Experts  # in place of the SwiGLU MLP


class Weights(qwen35.Weights):
    blk: list[Layer]


@register("qwen35moe")
class Qwen35Moe(qwen35.Qwen35):
    Options, Weights = Options, Weights

    @staticmethod
    def layout(backend: Backend) -> dict:
        return {"fused_experts": nn.fused_gate_up(backend)}
