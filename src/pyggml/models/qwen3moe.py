"""Qwen 3 mixture-of-experts decoders (GGUF architecture "qwen3moe": Qwen3-30B-A3B, Qwen3-235B-A22B).

Qwen 3 (``pyggml.models.qwen3``: Llama's pre-norm decoder, NeoX rope, per-head q/k RMS norms) with a
mixture of experts for every layer's MLP: a router (``ffn_gate_inp``) scores the experts per token,
each token goes to its ``expert_used_count`` best experts, and their SwiGLU outputs are summed with
weights softmax(the chosen scores) (``nn.moe``: Qwen's softmax over all experts, renormalised over
the chosen, gives the same weights). The experts' matrices are stacked in one tensor per kind
(``ffn_gate_exps``, ``ffn_up_exps``, ``ffn_down_exps``: (in, out, expert)), so a decode step reads
the weights of ``expert_used_count`` experts, not all of them. Everything else (embedding with
``pooling_type``, context shift) is Qwen 3's.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyggml import nn
from pyggml.models import ModelError, qwen3, register
from pyggml.tensor import Tensor


@dataclass(frozen=True)
class Options(qwen3.Options):
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn_size: int = 0

    @classmethod
    def from_config(cls, config, **extra) -> Options:
        arch = config.architecture
        n_experts, n_used = nn.expert_counts(config)
        if config.uint("expert_shared_count", 0):
            raise ModelError(f"{arch}: {arch}.expert_shared_count is set; shared experts are not supported")
        if config.uint("expert_gating_func", 1) != 1:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
            raise ModelError(f"{arch}: {arch}.expert_gating_func {config.uint('expert_gating_func')} is not "
                             "supported (only 1, softmax)")
        if not config.bool("expert_weights_norm", True):
            raise ModelError(f"{arch}: {arch}.expert_weights_norm is false; qwen3moe renormalises the chosen "
                             "experts' weights")
        ffn = config.uint("expert_feed_forward_length", 0)
        if not ffn:
            raise ModelError(f"{arch}: {arch}.expert_feed_forward_length must be set and non-zero")
        return super().from_config(config, n_experts=n_experts, n_experts_used=n_used, expert_ffn_size=ffn,
                                   **extra)


class Experts(nn.Module):
    ffn_gate_inp: nn.Linear = nn.shape("hidden_size", "n_experts")  # the router
    ffn_gate_exps: nn.Experts = nn.shape("hidden_size", "expert_ffn_size", "n_experts")
    ffn_up_exps: nn.Experts = nn.shape("hidden_size", "expert_ffn_size", "n_experts")
    ffn_down_exps: nn.Experts = nn.shape("expert_ffn_size", "hidden_size", "n_experts")

    def __call__(self, x: Tensor, opts: Options) -> Tensor:
        return nn.moe(x, self.ffn_gate_inp(x), opts.n_experts_used, self.ffn_gate_exps, self.ffn_up_exps,
                      self.ffn_down_exps, lambda gate, up: gate.silu(up))


class Layer(qwen3.Layer):
    mlp: Experts  # in place of the SwiGLU MLP


class Weights(qwen3.Weights):
    blk: list[Layer]


@register("qwen3moe")
class Qwen3Moe(qwen3.Qwen3):
    Options, Weights = Options, Weights
