"""Qwen3-Next (GGUF architecture "qwen3next": Qwen3-Next-80B-A3B).

The forerunner of Qwen 3.5's MoE (``pyggml.models.qwen35moe``: Gated DeltaNet and gated attention
layers, a softmax-routed mixture of experts with a gated shared expert), with two differences in its
Gated DeltaNet layers: the learning strengths and decay inputs come from one projection (``ssm_ba``:
per key head, its value heads' betas then their alphas), and the value heads stay grouped by key head
(value head h reads key head ``h // (n_v_heads / n_k_heads)``), so query and key heads are repeated
to the value heads before the scan. Rope is plain NeoX rope on the first ``rope.dimension_count``
dims (no mRoPE sections).
"""

from __future__ import annotations

from pyggml import nn
from pyggml.models import qwen35, qwen35moe, register
from pyggml.tensor import Tensor

Options = qwen35moe.Options


class GatedDeltaNet(qwen35.GatedDeltaNet):
    ssm_beta: None = None  # not in these files (ssm_ba holds both)
    ssm_alpha: None = None
    ssm_ba: nn.Linear | None = nn.shape("hidden_size", "2 * n_v_heads", when=qwen35.IS_RECURRENT)

    def beta_alpha(self, x: Tensor, opts: Options) -> tuple[Tensor, Tensor]:
        """Per key head, r betas then r alphas (r = value heads per key head): each as (n_v_heads, n_tokens)."""
        ba, n, n_k = self.ssm_ba(x), x.shape[1], opts.n_k_heads
        r, e = opts.n_v_heads // n_k, ba.strides[0]
        return tuple(ba.view(i * r * e, (r, n_k, n), (2 * r * e, ba.strides[1])).contiguous().reshape(r * n_k, n)
                     for i in (0, 1))

    def key_heads(self, x: Tensor, opts: Options) -> Tensor:
        """Each query or key head repeated for its value heads (value head h reads key head h // r)."""
        s, n_k, steps, seqs = x.shape
        r = opts.n_v_heads // n_k
        if r == 1:
            return x
        return x.reshape(s, 1, n_k, steps * seqs).repeat(s, r, n_k, steps * seqs).reshape(s, r * n_k, steps, seqs)


class Layer(qwen35moe.Layer):
    delta_net: GatedDeltaNet


class Weights(qwen35moe.Weights):
    blk: list[Layer]


@register("qwen3next")
class Qwen3Next(qwen35moe.Qwen35Moe):
    Options, Weights = Options, Weights
