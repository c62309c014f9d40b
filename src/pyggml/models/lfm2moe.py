"""LFM2-MoE (GGUF architecture "lfm2moe": LFM2-8B-A1B, LFM2-24B-A2B).

LFM2's layers (``pyggml.models.lfm2``: short convolutions and attention, the same caches) with a
mixture of experts in place of the MLP after the first ``leading_dense_block_count`` layers. The
router scores each expert with a sigmoid; a learned per-expert bias (``exp_probs_b``) shifts the
scores only for choosing the ``expert_used_count`` experts, whose unbiased scores, renormalised to
sum to 1, weight their SwiGLU outputs (stacked ``ffn_*_exps`` matrices, ``mulmat_id``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pyggml import nn
from pyggml.models import ModelError, lfm2, register
from pyggml.tensor import Tensor

_DENSE, _MOE = "layer < n_dense", "layer >= n_dense"
SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


@dataclass(frozen=True)
class Options(lfm2.Options):
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn_size: int = 0
    n_dense: int = 0  # the leading layers with a plain MLP

    @classmethod
    def from_config(cls, config, **extra) -> Options:
        arch = config.architecture
        n_experts, n_used = nn.expert_counts(config)
        expert_ffn = config.uint("expert_feed_forward_length", 0)
        if not expert_ffn:
            raise ModelError(f"{arch}: {arch}.expert_feed_forward_length must be set and non-zero")
        if config.uint("expert_gating_func", SIGMOID) != SIGMOID:
            raise ModelError(f"{arch}: {arch}.expert_gating_func {config.uint('expert_gating_func')} is not "
                             f"supported (only {SIGMOID}, sigmoid)")
        if config.float("expert_weights_scale", 1.0) not in (0.0, 1.0):
            raise ModelError(f"{arch}: {arch}.expert_weights_scale is not supported (the experts' weights are "
                             "renormalised only)")
        return super().from_config(config, n_experts=n_experts, n_experts_used=n_used, expert_ffn_size=expert_ffn,
                                   n_dense=config.uint("leading_dense_block_count", 0, max=10**6), **extra)


class Bias(nn.Weight):
    suffix = ".bias"  # a tensor with no weight beside it (``blk.N.exp_probs_b.bias``)


class FeedForward(nn.Module):
    """The dense MLP of the leading layers, or the experts of the others."""

    ffn_gate: nn.Linear | None = nn.shape("hidden_size", "ffn_size", when=_DENSE)
    ffn_up: nn.Linear | None = nn.shape("hidden_size", "ffn_size", when=_DENSE)
    ffn_down: nn.Linear | None = nn.shape("ffn_size", "hidden_size", when=_DENSE)
    ffn_gate_inp: nn.Linear | None = nn.shape("hidden_size", "n_experts", when=_MOE)  # the router
    exp_probs_b: Bias | None = nn.shape("n_experts", when=_MOE)
    ffn_gate_exps: nn.Weight | None = nn.shape("hidden_size", "expert_ffn_size", "n_experts", when=_MOE)
    ffn_up_exps: nn.Weight | None = nn.shape("hidden_size", "expert_ffn_size", "n_experts", when=_MOE)
    ffn_down_exps: nn.Weight | None = nn.shape("expert_ffn_size", "hidden_size", "n_experts", when=_MOE)

    def __call__(self, x: Tensor, opts: Options, layer: int) -> Tensor:
        if layer < opts.n_dense:
            return self.ffn_down(self.ffn_gate(x).silu(self.ffn_up(x)))
        n_tokens, k = x.shape[1], opts.n_experts_used
        scores = self.ffn_gate_inp(x).sigmoid()  # (n_experts, n_tokens)
        chosen = (scores + self.exp_probs_b.weight).top_k(k)  # (k, n_tokens): the bias only chooses
        weights = scores.reshape(1, opts.n_experts, n_tokens).rows(chosen).reshape(k, n_tokens)
        experts = (nn.Experts(w.weight) for w in (self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps))
        return nn.mix_experts(x, chosen, weights / weights.sum_rows(), *experts, glu=lambda g, u: g.silu(u))


class Layer(lfm2.Layer):
    mlp: FeedForward


class Weights(lfm2.Weights):
    blk: list[Layer]


@register("lfm2moe")
class Lfm2Moe(lfm2.Lfm2):
    Options, Weights = Options, Weights
