"""Qwen 3 mixture-of-experts decoders (GGUF architecture "qwen3moe": Qwen3-30B-A3B, Qwen3-235B-A22B).

Qwen 3's attention (``pyggml.models.qwen3``); every layer's MLP is a set of experts instead: a
router (``ffn_gate_inp``) scores the experts per token, softmax turns the scores into
probabilities, each token goes to its ``expert_used_count`` most probable experts, whose chosen
probabilities are renormalised to sum to 1 and weight the experts' SwiGLU outputs. The experts'
matrices are stacked in one tensor per kind (``ffn_gate_exps``, ``ffn_up_exps``,
``ffn_down_exps``: (in, out, expert)) and ``mulmat_id`` multiplies each token by its chosen
experts only, so a decode step reads the weights of ``expert_used_count`` experts, not all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyggml import nn
from pyggml.models import ModelError, llama, qwen2, qwen3, register
from pyggml.tensor import Tensor


@dataclass(frozen=True)
class Options(qwen2.Options):
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn_size: int = 0

    @classmethod
    def from_config(cls, config, **extra) -> Options:
        arch = config.architecture
        n_experts, n_used = config.uint("expert_count", 0), config.uint("expert_used_count", 0)
        if not n_experts or not 0 < n_used <= n_experts:
            raise ModelError(f"{arch}: {arch}.expert_count ({n_experts}) and {arch}.expert_used_count ({n_used}) "
                             "must be set, with 0 < expert_used_count <= expert_count")
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
    ffn_gate_exps: nn.Weight = nn.shape("hidden_size", "expert_ffn_size", "n_experts")
    ffn_up_exps: nn.Weight = nn.shape("hidden_size", "expert_ffn_size", "n_experts")
    ffn_down_exps: nn.Weight = nn.shape("expert_ffn_size", "hidden_size", "n_experts")

    def __call__(self, x: Tensor, opts: Options) -> Tensor:
        n_tokens, k = x.shape[1], opts.n_experts_used
        probs = self.ffn_gate_inp(x).softmax()  # (n_experts, n_tokens)
        chosen = probs.top_k(k)  # (k, n_tokens): expert ids
        weights = probs.reshape(1, opts.n_experts, n_tokens).rows(chosen).reshape(k, n_tokens)
        weights = (weights / weights.sum_rows()).reshape(1, k, n_tokens)  # renormalised over the chosen
        x = x.reshape(opts.hidden_size, 1, n_tokens)
        gate = self.ffn_gate_exps.weight.mulmat_id(x, chosen)  # (expert_ffn_size, k, n_tokens)
        up = self.ffn_up_exps.weight.mulmat_id(x, chosen)
        out = self.ffn_down_exps.weight.mulmat_id(gate.silu(up), chosen) * weights  # (hidden, k, n_tokens)
        # the weighted sum over the k experts: k strided views of (hidden, n_tokens) added up
        rows = (opts.hidden_size, n_tokens)
        total = out.view(0, rows, (out.strides[2],))
        for i in range(1, k):
            total = total + out.view(i * out.strides[1], rows, (out.strides[2],))
        return total


class Layer(llama.Layer):
    attention: qwen3.SelfAttention
    mlp: Experts


class Weights(llama.Weights):
    blk: list[Layer]


@register("qwen3moe")
class Qwen3Moe(llama.Llama):
    Options, Weights = Options, Weights
