"""DeepSeek V2 / V3 / R1 and their relatives (GGUF architecture "deepseek2", as llama.cpp runs it).

Multi-head latent attention (MLA): a token's keys and values for every head come from one compressed
vector, the RMS-normed ``latent`` (``kv_lora_rank`` wide) of ``attn_kv_a_mqa``, plus one rotated key
(``rope.dimension_count`` wide) that all heads share. The cache keeps just those two per token
(``Causal(value_from_key=kv_lora_rank)``: the latent is the value, and with the rope key after it the key),
so a token costs ``(kv_lora_rank + rope_dim) x layers`` cache elements, not ``2 x heads x head_dim x layers``.
Attention runs in the absorbed form (``nn.latent_attention``): ``attn_k_b`` is folded into the queries and
``attn_v_b`` applied after attention. Queries come from ``attn_q`` or, with ``attention.q_lora_rank``, from a
low-rank pair ``attn_q_a`` -> RMSNorm -> ``attn_q_b``; rope is the interleaved-pair (normal) kind, with YaRN's
magnitude folded into the score scale as llama.cpp does (``mscale`` = ``rope.scaling.yarn_log_multiplier``/0.1).

After ``leading_dense_block_count`` plain SwiGLU layers every MLP is a mixture of experts plus always-on shared
experts (``ffn_*_shexp``): a softmax router (V2) or a sigmoid one with a choosing-only bias ``exp_probs_b`` and
grouped top-k (V3), the chosen weights renormalised if ``expert_weights_norm`` and scaled by
``expert_weights_scale`` (``routed_scaling_factor``) (``nn.route``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pyggml import nn
from pyggml.backend import Backend, Context
from pyggml.backend.metadata import MAX_CONTEXT, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH
from pyggml.kvcache import Cache, Causal
from pyggml.models import Batch, Model, ModelError, register
from pyggml.tensor import RopeType, Tensor

SOFTMAX, SIGMOID = 1, 2  # llama.cpp's expert_gating_func values
_DENSE, _MOE, _SHARED = "layer < n_dense", "layer >= n_dense", "layer >= n_dense and n_shared"
_SEPARATE, _FUSED = f"{_MOE} and not fused_experts", f"{_MOE} and fused_experts"


@dataclass(frozen=True)
class Options:
    hidden_size: int
    n_layers: int
    n_heads: int
    vocab_size: int | None
    context_length: int
    eps: float
    q_lora_rank: int  # 0: queries from one matrix (attn_q)
    kv_lora_rank: int
    rope_dim: int
    nope_dim: int  # the part of a head's key without rope
    v_dim: int
    ffn_size: int  # the leading dense layers' MLP
    n_dense: int
    n_experts: int
    n_experts_used: int
    expert_ffn_size: int
    n_shared: int  # shared experts, one MLP of n_shared * expert_ffn_size
    sigmoid: bool  # router gating: sigmoid (with the choosing bias exp_probs_b) or softmax
    groups: int
    groups_used: int
    normalize: bool
    expert_scale: float
    rope: nn.Rope
    scale: float  # of the attention scores (YaRN's magnitude folded in)
    fused_experts: bool = False  # gate and up experts in one ffn_gate_up_exps (nn.fused_gate_up)

    @property
    def head_dim(self) -> int:
        return self.nope_dim + self.rope_dim

    @classmethod
    def from_config(cls, config) -> Options:
        arch = config.architecture
        hidden = config.uint("embedding_length", min=1, max=MAX_WIDTH)
        n_layers = config.uint("block_count", min=1, max=MAX_LAYERS)
        n_heads = config.uint("attention.head_count", min=1, max=MAX_WIDTH)
        kv_lora = config.uint("attention.kv_lora_rank", 0, max=MAX_WIDTH)
        rope_dim = config.uint("rope.dimension_count", 0, max=MAX_WIDTH)
        k_mla = config.uint("attention.key_length_mla", 0, max=MAX_WIDTH)
        v_mla = config.uint("attention.value_length_mla", 0, max=MAX_WIDTH)
        if not (kv_lora and rope_dim and k_mla and v_mla):
            raise ModelError(f"{arch}: attention.kv_lora_rank, rope.dimension_count, attention.key_length_mla and "
                             "attention.value_length_mla must be set (a file from before llama.cpp split attn_kv_b "
                             "into attn_k_b and attn_v_b: convert it again)")
        if k_mla <= rope_dim or rope_dim % 2:
            raise ModelError(f"{arch}: attention.key_length_mla ({k_mla}) must exceed the even "
                             f"rope.dimension_count ({rope_dim})")
        if (config.uint("attention.key_length", kv_lora + rope_dim) != kv_lora + rope_dim
                or config.uint("attention.value_length", kv_lora) != kv_lora
                or config.uint("attention.head_count_kv", 1) != 1):
            raise ModelError(f"{arch}: attention.key_length / value_length / head_count_kv must be the latent "
                             f"cache's {kv_lora + rope_dim} / {kv_lora} / 1")
        moe = moe_options(config, n_layers, SOFTMAX)
        if moe["n_experts"] and not moe["n_shared"]:
            raise ModelError(f"{arch}: expert_shared_count must be set (deepseek2 always has shared experts)")
        rope = nn.Rope.from_config(config, rope_dim, RopeType.NORMAL)
        rope, scale = _yarn(config, rope, k_mla)
        return cls(
            hidden_size=hidden, n_layers=n_layers, n_heads=n_heads,
            vocab_size=config.uint("vocab_size", 0, max=MAX_VOCAB) or len(config.get("tokenizer.ggml.tokens", ()))
            or None,
            context_length=config.uint("context_length", 4096, min=1, max=MAX_CONTEXT),
            eps=config.float("attention.layer_norm_rms_epsilon", 1e-6, min=0.0, max=1.0),
            q_lora_rank=config.uint("attention.q_lora_rank", 0, max=MAX_WIDTH), kv_lora_rank=kv_lora,
            rope_dim=rope_dim, nope_dim=k_mla - rope_dim, v_dim=v_mla, rope=rope, scale=scale, **moe)


def moe_options(config, n_layers: int, default_gating: int) -> dict:
    """The feed-forward hyper-parameters of a DeepSeek-style model (``FeedForward``'s ``Options`` fields):
    ``leading_dense_block_count`` dense layers, then routed experts plus ``expert_shared_count`` shared ones;
    ``default_gating`` when the file names no ``expert_gating_func`` (llama.cpp's default per architecture)."""
    arch = config.architecture
    n_dense = min(config.uint("leading_dense_block_count", 0, max=MAX_LAYERS), n_layers)
    n_experts, n_used = config.uint("expert_count", 0), config.uint("expert_used_count", 0)
    groups, groups_used = config.uint("expert_group_count", 0) or 1, config.uint("expert_group_used_count", 0)
    gating = config.uint("expert_gating_func", 0) or default_gating
    moe = n_dense < n_layers
    if moe:
        if not n_experts or not 0 < n_used <= n_experts:
            raise ModelError(f"{arch}: expert_count ({n_experts}) and expert_used_count ({n_used}) must be "
                             "set, with 0 < expert_used_count <= expert_count")
        if gating not in (SOFTMAX, SIGMOID):
            raise ModelError(f"{arch}: expert_gating_func {gating} is not supported (1 softmax, 2 sigmoid)")
        if groups > 1 and (n_experts % groups or not 0 < groups_used < groups
                           or n_used > groups_used * (n_experts // groups) or n_experts // groups < 2):
            raise ModelError(f"{arch}: expert_group_count {groups} / expert_group_used_count {groups_used} do "
                             f"not fit {n_experts} experts of which {n_used} are used")
        if not config.uint("expert_feed_forward_length", 0):
            raise ModelError(f"{arch}: expert_feed_forward_length must be set")
    return dict(
        ffn_size=config.uint("feed_forward_length", 0, max=MAX_WIDTH) if n_dense else 0, n_dense=n_dense,
        n_experts=n_experts if moe else 0, n_experts_used=n_used if moe else 0,
        expert_ffn_size=config.uint("expert_feed_forward_length", 0, max=MAX_WIDTH) if moe else 0,
        n_shared=config.uint("expert_shared_count", 0, max=MAX_WIDTH) if moe else 0, sigmoid=gating == SIGMOID,
        groups=groups, groups_used=groups_used, normalize=config.bool("expert_weights_norm", False),
        expert_scale=config.float("expert_weights_scale", 0.0, min=0.0, max=1e6) or 1.0)


def _yarn(config, rope: nn.Rope, head_dim: int) -> tuple[nn.Rope, float]:
    """The rope's attention factor and the score scale as llama.cpp sets them for deepseek2: YaRN's rope
    magnitude is 1 (Hugging Face's mscale / mscale_all_dim, which DeepSeek sets equal) and the scores are
    scaled by (1 + 0.1 mscale_all_dim ln(factor))^2 / sqrt(head_dim), mscale_all_dim being
    ``rope.scaling.yarn_log_multiplier`` / 0.1 (times ``rope.scaling.attn_factor``, normally 1)."""
    factor = 1.0 / rope.freq_scale
    log_mul = config.float("rope.scaling.yarn_log_multiplier", 0.0, min=0.0, max=1e3) / 0.1
    magnitude = 1.0
    if rope.ext_factor:  # cancel ggml's own 1 + 0.1 ln(factor); without the key, HF's default mscale(factor)
        magnitude = (1.0 if log_mul or factor <= 1.0 else 1.0 + 0.1 * math.log(factor)) / (1 + 0.1 * math.log(factor))
    attn_factor = magnitude * config.float("rope.scaling.attn_factor", 1.0, min=1e-6, max=1e6)
    mscale = attn_factor * (1 + 0.1 * math.log(factor)) * (1 + 0.1 * log_mul * math.log(factor))
    return dataclasses.replace(rope, attn_factor=attn_factor), mscale * mscale / math.sqrt(head_dim)


class SelfAttention(nn.Module):
    attn_q: nn.Linear | None = nn.shape("hidden_size", "n_heads * head_dim", when="not q_lora_rank")
    attn_q_a: nn.Linear | None = nn.shape("hidden_size", "q_lora_rank", when="q_lora_rank")
    attn_q_a_norm: nn.RMSNorm | None = nn.shape("q_lora_rank", when="q_lora_rank")
    attn_q_b: nn.Linear | None = nn.shape("q_lora_rank", "n_heads * head_dim", when="q_lora_rank")
    attn_kv_a_mqa: nn.Linear = nn.shape("hidden_size", "kv_lora_rank + rope_dim")
    attn_kv_a_norm: nn.RMSNorm = nn.shape("kv_lora_rank")
    attn_k_b: nn.Weight = nn.shape("nope_dim", "kv_lora_rank", "n_heads")  # W_UK per head
    attn_v_b: nn.Weight = nn.shape("kv_lora_rank", "v_dim", "n_heads")  # W_UV per head
    attn_output: nn.Linear = nn.shape("n_heads * v_dim", "hidden_size")

    def __call__(self, ctx: Context, x: Tensor, positions: Tensor, cache: Cache, o: Options, absorb: bool) -> Tensor:
        n = x.shape[1]
        q = self.attn_q(x) if self.attn_q is not None else self.attn_q_b(self.attn_q_a_norm(self.attn_q_a(x), o.eps))
        q = q.reshape(o.head_dim, o.n_heads, n)
        row, width = q.strides[1:3], q.dtype.row_bytes(o.nope_dim)
        q_nope = q.view(0, (o.nope_dim, o.n_heads, n), row)
        q_rope = o.rope(q.view(width, (o.rope_dim, o.n_heads, n), row), positions)
        kv = self.attn_kv_a_mqa(x)  # (latent, rope key) per token
        latent = self.attn_kv_a_norm(kv.view(0, (o.kv_lora_rank, n), kv.strides[1:2]), o.eps)
        k_rope = kv.view(kv.dtype.row_bytes(o.kv_lora_rank), (o.rope_dim, 1, n), (kv.strides[1], kv.strides[1]))
        out = nn.latent_attention(ctx, q_nope, q_rope, latent, o.rope(k_rope, positions), cache, o.scale,
                                  self.attn_k_b.weight, self.attn_v_b.weight, absorb=absorb)
        return self.attn_output(out)


class Bias(nn.Weight):
    suffix = ".bias"  # a tensor with no weight beside it (``blk.N.exp_probs_b.bias``)


class FeedForward(nn.Module):
    """The SwiGLU MLP of the leading layers, or the routed and shared experts of the others."""

    ffn_gate: nn.Linear | None = nn.shape("hidden_size", "ffn_size", when=_DENSE)
    ffn_up: nn.Linear | None = nn.shape("hidden_size", "ffn_size", when=_DENSE)
    ffn_down: nn.Linear | None = nn.shape("ffn_size", "hidden_size", when=_DENSE)
    ffn_gate_inp: nn.Linear | None = nn.shape("hidden_size", "n_experts", when=_MOE)  # the router
    exp_probs_b: Bias | None = nn.shape("n_experts", when=f"{_MOE} and sigmoid")
    ffn_gate_exps: nn.Experts | None = nn.shape("hidden_size", "expert_ffn_size", "n_experts", when=_SEPARATE)
    ffn_up_exps: nn.Experts | None = nn.shape("hidden_size", "expert_ffn_size", "n_experts", when=_SEPARATE)
    ffn_gate_up_exps: nn.Experts | None = nn.shape("hidden_size", "2 * expert_ffn_size", "n_experts", when=_FUSED)
    ffn_down_exps: nn.Experts | None = nn.shape("expert_ffn_size", "hidden_size", "n_experts", when=_MOE)
    ffn_gate_shexp: nn.Linear | None = nn.shape("hidden_size", "expert_ffn_size * n_shared", when=_SHARED)
    ffn_up_shexp: nn.Linear | None = nn.shape("hidden_size", "expert_ffn_size * n_shared", when=_SHARED)
    ffn_down_shexp: nn.Linear | None = nn.shape("expert_ffn_size * n_shared", "hidden_size", when=_SHARED)

    def __call__(self, x: Tensor, o: Options, layer: int) -> Tensor:
        if layer < o.n_dense:
            return self.ffn_down(self.ffn_gate(x).silu(self.ffn_up(x)))
        chosen, weights = nn.route(self.ffn_gate_inp(x), o.n_experts_used, sigmoid=o.sigmoid,
                                   bias=None if self.exp_probs_b is None else self.exp_probs_b.weight,
                                   groups=o.groups, groups_used=o.groups_used, normalize=o.normalize,
                                   scale=o.expert_scale)
        gate = self.ffn_gate_exps if self.ffn_gate_up_exps is None else self.ffn_gate_up_exps
        routed = nn.mix_experts(x, chosen, weights, gate, self.ffn_up_exps, self.ffn_down_exps,
                                lambda gate, up: gate.silu(up))
        if self.ffn_gate_shexp is None:
            return routed
        return routed + self.ffn_down_shexp(self.ffn_gate_shexp(x).silu(self.ffn_up_shexp(x)))


class Layer(nn.Module):
    attn_norm: nn.RMSNorm = nn.shape("hidden_size")
    attention: SelfAttention
    ffn_norm: nn.RMSNorm = nn.shape("hidden_size")
    mlp: FeedForward

    def __call__(self, ctx: Context, h: Tensor, positions: Tensor, outputs: Tensor | None, cache: Cache, o: Options,
                 layer: int, absorb: bool) -> Tensor:
        x = self.attention(ctx, self.attn_norm(h, o.eps), positions, cache, o, absorb)
        x, h = nn.output_rows(outputs, x, h)
        h = h + x
        return h + self.mlp(self.ffn_norm(h, o.eps), o, layer)


class Weights(nn.Module):
    token_embd: nn.Embedding = nn.shape("hidden_size", "vocab_size")
    blk: list[Layer]
    output_norm: nn.RMSNorm = nn.shape("hidden_size")
    output: nn.Linear = nn.shape("hidden_size", "vocab_size", alt="token_embd")


@register("deepseek2")
class DeepSeek2(Model):
    Options, Weights = Options, Weights
    # False: attention decompresses the cached latents into per-head keys and values (the reference form)
    absorb: bool = True

    def __init__(self, backend: Backend):
        self.backend = backend
        self.options = dataclasses.replace(Options.from_config(backend.config), fused_experts=nn.fused_gate_up(backend))
        self.weights: Weights = nn.load(Weights, backend, self.options)
        self.cache = Causal(self.shift, value_from_key=self.options.kv_lora_rank)

    def forward(self, ctx: Context, batch: Batch) -> Tensor:
        w, o = self.weights, self.options
        inputs = nn.batch_inputs(ctx, batch)
        h = nn.tap("token_embd", w.token_embd(inputs.tokens))
        for i, layer, rows in nn.layers(w.blk, self.cache, inputs.outputs):
            h = nn.tap(f"blk.{i}", layer(ctx, h, inputs.positions, rows, self.cache, o, i, self.absorb))
        return nn.tap("output", w.output(nn.tap("output_norm", w.output_norm(h, o.eps))))

    def shift(self, ctx: Context, layer: int, key: Tensor, shift: Tensor) -> Tensor:
        """Re-rotate the rope part of cached rows (latent, rope key) (kv_lora_rank + rope_dim, 1, n); a rotation
        by a difference of positions keeps the key's magnitude (YaRN's was applied when it was stored)."""
        o, n = self.options, key.shape[2]
        strides = key.strides[1:3]
        latent = key.view(0, (o.kv_lora_rank, 1, n), strides)
        rotated = key.view(key.dtype.row_bytes(o.kv_lora_rank), (o.rope_dim, 1, n), strides)
        rope = o.rope
        if rope.ext_factor:  # ggml's YaRN multiplies by 1 + 0.1 ln(factor): divide it out
            rope = dataclasses.replace(rope, attn_factor=1.0 / (1.0 + 0.1 * math.log(1.0 / rope.freq_scale)))
        return latent.concat(rope(rotated, shift), 0)
