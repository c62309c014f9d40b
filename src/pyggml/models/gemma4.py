"""Gemma 4 text (GGUF architecture "gemma4": E2B, E4B, 31B, and the 26B-A4B mixture of experts).

Gemma 3's pre- and post-normed blocks (norm weights stored as they apply) and sliding-window layers
among global ones, with:

- **two head sizes**: global layers have wider heads (``attention.key_length``) than sliding ones
  (``attention.key_length_swa``), maybe fewer KV heads (a ``head_count_kv`` per layer), and rotate
  only a part of each head ("proportional" rope: ``rope_freqs`` leaves the rest unrotated); queries are
  not scaled (the q/k RMS norms do it), values are RMS-normed without weight, and a global layer
  without ``attn_v`` uses its key projection as values;
- **shared KV**: the last ``attention.shared_kv_layers`` layers store nothing and attend over the
  cache of the last storing layer of their kind (``nn.shared_kv_layers``);
- **per-layer embeddings** (``embedding_length_per_layer_input``): a second token embedding,
  plus a projection of the input embedding, gives each layer a small vector that gates a bottleneck
  (``inp_gate`` -> GELU x vector -> ``proj`` -> norm) added after the MLP;
- **experts** (``expert_count``): besides the dense MLP, a router on the RMS-normed stream picks
  ``expert_used_count`` experts (softmax, renormalised, times a per-expert scale) whose GeGLU output,
  normed, is added to the MLP's;
- ``layer_output_scale`` multiplies each block's output; final logits are soft-capped.

A file with a vision part (gemma4_vision.py, or an mmproj file) takes images: their embeddings go over
the placeholders unscaled, their per-layer token embedding is the padding token's (as Hugging Face and
llama.cpp), and, as llama.cpp decides by the width (all but E2B's and E4B's), an image's tokens see each
other both ways on the sliding layers (Hugging Face's ``use_bidirectional_attention="vision"``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pyggml import nn
from pyggml.backend import Backend, Context
from pyggml.backend.metadata import MAX_LAYERS, MAX_WIDTH
from pyggml.kvcache import Causal, Wrapper
from pyggml.models import Batch, Model, ModelError, gemma4_vision, register
from pyggml.tensor import RopeType, Tensor


def _sizes(config, key: str, n_layers: int, default: int) -> tuple[int, ...]:
    """A per-layer size (``nn.per_layer``), none of them 0."""
    values = nn.per_layer(config, key, n_layers, default, MAX_WIDTH)
    if not all(values):
        raise ModelError(f"{config.architecture}: {config.architecture}.{key} must give each of the {n_layers} "
                         f"layers a non-zero size; found {list(values)}")
    return values


@dataclass(frozen=True)
class Options:
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: tuple[int, ...]  # per layer
    head_dims: tuple[int, ...]  # per layer: sliding layers' or global layers' head size
    head_dim: int  # the global layers' (rope_freqs has one factor per rotated pair of it)
    ffn_size: tuple[int, ...]  # per layer (wider in the KV-sharing layers of some models)
    vocab_size: int | None
    context_length: int
    eps: float
    sliding_window: int
    layer_kinds: tuple[int, ...]  # nn.SLIDING or nn.GLOBAL per layer
    kv_layers: tuple[int, ...]  # the layer whose cache each layer attends over (itself when it stores)
    rope: nn.Rope  # global layers (with rope_freqs)
    rope_local: nn.Rope
    final_softcap: float
    ple_size: int  # per-layer embedding width; 0: none
    n_experts: int
    n_experts_used: int
    expert_ffn_size: int

    @classmethod
    def from_config(cls, config) -> Options:
        arch = config.architecture
        hidden = config.uint("embedding_length", min=1, max=MAX_WIDTH)
        n_heads = config.uint("attention.head_count", min=1, max=MAX_WIDTH)
        n_layers = config.uint("block_count", min=1, max=MAX_LAYERS)
        head_dim = config.uint("attention.key_length", min=1, max=MAX_WIDTH)  # the global layers'
        if config.uint("attention.value_length", head_dim) != head_dim:
            raise ModelError(f"{arch}: {arch}.attention.value_length must equal attention.key_length")
        head_dim_swa = config.uint("attention.key_length_swa", head_dim, max=MAX_WIDTH)
        if config.uint("attention.value_length_swa", head_dim_swa) != head_dim_swa:
            raise ModelError(f"{arch}: {arch}.attention.value_length_swa must equal attention.key_length_swa")
        kinds = nn.layer_kinds(config, n_layers, 0)
        n_kv = _sizes(config, "attention.head_count_kv", n_layers, n_heads)
        if any(n_heads % k for k in n_kv):
            raise ModelError(f"{arch}: {arch}.attention.head_count_kv {n_kv} must divide the {n_heads} heads")
        first = n_layers - config.uint("attention.shared_kv_layers", 0, max=n_layers)
        kv_layers = nn.shared_kv_layers(kinds, n_layers - first)
        if any(kv_layers[i] != first - (2 if kinds[i] == nn.SLIDING else 1) for i in range(first, n_layers)):
            raise ModelError(f"{arch}: the layers sharing KV must follow a sliding layer and a global one, as "
                             "llama.cpp reads them")
        window = config.uint("attention.sliding_window", 512)
        if window < 1:
            raise ModelError(f"{arch}: attention.sliding_window must be >= 1")
        rope = nn.Rope.from_config(config, config.uint("rope.dimension_count", head_dim, max=head_dim), RopeType.NEOX)
        # as llama.cpp: the sliding layers rotate as many dimensions as the global ones unless the file says
        rope_local = nn.Rope(config.uint("rope.dimension_count_swa", rope.n_dims, max=head_dim_swa),
                             config.float("rope.freq_base_swa", 10000.0, min=1.0, max=1e12), mode=RopeType.NEOX,
                             n_ctx_orig=rope.n_ctx_orig)
        n_experts = config.uint("expert_count", 0)
        n_used = config.uint("expert_used_count", 0)
        expert_ffn = config.uint("expert_feed_forward_length", 0, max=MAX_WIDTH) if n_experts else 0
        if n_experts and not (0 < n_used <= n_experts and expert_ffn):
            raise ModelError(f"{arch}: with {arch}.expert_count ({n_experts}), expert_used_count ({n_used}) must be in "
                             "1..expert_count and expert_feed_forward_length set")
        return cls(
            hidden_size=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
            head_dims=tuple(head_dim_swa if k == nn.SLIDING else head_dim for k in kinds), head_dim=head_dim,
            ffn_size=_sizes(config, "feed_forward_length", n_layers, 0),
            vocab_size=config.uint("vocab_size", 0) or len(config.get("tokenizer.ggml.tokens", ())) or None,
            context_length=config.uint("context_length", 131072),
            eps=config.float("attention.layer_norm_rms_epsilon", 1e-6),
            sliding_window=window, layer_kinds=kinds, kv_layers=kv_layers, rope=rope, rope_local=rope_local,
            final_softcap=config.float("final_logit_softcapping", 0.0, min=0.0, max=1e6) or 0.0,
            ple_size=config.uint("embedding_length_per_layer_input", 0, max=MAX_WIDTH),
            n_experts=n_experts, n_experts_used=n_used, expert_ffn_size=expert_ffn,
        )


_STORES = "kv_layers[layer] == layer"
CAUSAL_IMAGE_WIDTHS = (1536, 2560)  # E2B, E4B: llama.cpp attends their image tokens causally


class SelfAttention(nn.Module):
    attn_q: nn.Linear = nn.shape("hidden_size", "n_heads * head_dims[layer]")
    attn_q_norm: nn.RMSNorm = nn.shape("head_dims[layer]")
    attn_k: nn.Linear | None = nn.shape("hidden_size", "n_kv_heads[layer] * head_dims[layer]", when=_STORES)
    attn_k_norm: nn.RMSNorm | None = nn.shape("head_dims[layer]", when=_STORES)
    attn_v: nn.Linear | None = nn.shape("hidden_size", "n_kv_heads[layer] * head_dims[layer]")  # absent: keys' proj.
    attn_output: nn.Linear = nn.shape("n_heads * head_dims[layer]", "hidden_size")

    def __call__(self, ctx: Context, x: Tensor, positions: Tensor, cache: Wrapper, opts: Options, layer: int,
                 rope_freqs: Tensor) -> Tensor:
        d, n_tokens = opts.head_dims[layer], x.shape[1]
        rope, factors = (opts.rope_local, None) if opts.layer_kinds[layer] == nn.SLIDING else (opts.rope, rope_freqs)
        q = self.attn_q_norm(self.attn_q(x).reshape(d, opts.n_heads, n_tokens), opts.eps)
        q, k, v = rope(q, positions, factors), None, None
        if opts.kv_layers[layer] == layer:  # else the cache holds an earlier layer's keys and values
            shape = (d, opts.n_kv_heads[layer], n_tokens)
            k = self.attn_k(x)
            v = (k if self.attn_v is None else self.attn_v(x)).reshape(*shape).rms_norm(opts.eps)
            k = rope(self.attn_k_norm(k.reshape(*shape), opts.eps), positions, factors)
        return self.attn_output(nn.attention(ctx, q, k, v, cache, 1.0))


class MLP(nn.Module):
    ffn_gate: nn.Linear = nn.shape("hidden_size", "ffn_size[layer]")
    ffn_up: nn.Linear = nn.shape("hidden_size", "ffn_size[layer]")
    ffn_down: nn.Linear = nn.shape("ffn_size[layer]", "hidden_size")

    def __call__(self, x: Tensor) -> Tensor:
        return self.ffn_down(self.ffn_gate(x).gelu(self.ffn_up(x)))


class Router(nn.Module):
    nested = True  # blk.N.ffn_gate_inp.weight and .scale
    weight: nn.Parameter | None = nn.shape("hidden_size", "n_experts", when="n_experts")
    scale: nn.Parameter | None = nn.shape("hidden_size", when="n_experts")


class DownExperts(nn.Module):
    nested = True  # blk.N.ffn_down_exps.weight and .scale (per expert)
    weight: nn.Parameter | None = nn.shape("expert_ffn_size", "hidden_size", "n_experts", when="n_experts")
    scale: nn.Parameter | None = nn.shape("n_experts", when="n_experts")


class Layer(nn.Module):
    attn_norm: nn.RMSNorm = nn.shape("hidden_size")
    attention: SelfAttention
    post_attention_norm: nn.RMSNorm = nn.shape("hidden_size")
    ffn_norm: nn.RMSNorm = nn.shape("hidden_size")
    mlp: MLP
    post_ffw_norm: nn.RMSNorm = nn.shape("hidden_size")
    # experts
    ffn_gate_inp: Router
    ffn_gate_up_exps: nn.Experts | None = nn.shape("hidden_size", "2 * expert_ffn_size", "n_experts",
                                                   when="n_experts")
    ffn_down_exps: DownExperts
    pre_ffw_norm_2: nn.RMSNorm | None = nn.shape("hidden_size", when="n_experts")
    post_ffw_norm_1: nn.RMSNorm | None = nn.shape("hidden_size", when="n_experts")
    post_ffw_norm_2: nn.RMSNorm | None = nn.shape("hidden_size", when="n_experts")
    # per-layer embedding
    inp_gate: nn.Linear | None = nn.shape("hidden_size", "ple_size", when="ple_size")
    proj: nn.Linear | None = nn.shape("ple_size", "hidden_size", when="ple_size")
    post_norm: nn.RMSNorm | None = nn.shape("hidden_size", when="ple_size")
    layer_output_scale: nn.Weight | None = nn.shape(1)

    def __call__(self, ctx: Context, h: Tensor, per_layer: Tensor | None, positions: Tensor, outputs: Tensor | None,
                 cache: Wrapper, opts: Options, layer: int, rope_freqs: Tensor) -> Tensor:
        x = self.attention(ctx, self.attn_norm(h, opts.eps), positions, cache, opts, layer, rope_freqs)
        x, h = nn.output_rows(outputs, x, h)
        h = h + self.post_attention_norm(x, opts.eps)
        x = self.mlp(self.ffn_norm(h, opts.eps))
        if opts.n_experts:
            x = self.post_ffw_norm_1(x, opts.eps) + self.post_ffw_norm_2(self.experts(h, opts), opts.eps)
        h = h + self.post_ffw_norm(x, opts.eps)
        if per_layer is not None:
            (per_layer,) = nn.output_rows(outputs, per_layer)
            h = h + self.post_norm(self.proj(self.inp_gate(h).gelu() * per_layer), opts.eps)
        return h if self.layer_output_scale is None else h * self.layer_output_scale.weight

    def experts(self, h: Tensor, opts: Options) -> Tensor:
        """The routed experts on the stream ``h`` after attention (hidden, n_tokens)."""
        k, n_tokens = opts.n_experts_used, h.shape[1]
        routed = h.rms_norm(opts.eps).scale(1.0 / math.sqrt(opts.hidden_size)) * self.ffn_gate_inp.scale.weight
        logits = self.ffn_gate_inp.weight.weight.mulmat(routed)  # (n_experts, n_tokens)
        chosen = logits.top_k(k)
        weights = logits.reshape(1, opts.n_experts, n_tokens).rows(chosen).reshape(k, n_tokens).softmax()
        per_expert = self.ffn_down_exps.scale.weight.reshape(1, opts.n_experts, ctx=h.ctx)
        weights = weights * per_expert.rows(chosen.reshape(k * n_tokens)).reshape(k, n_tokens)
        down = nn.Experts(self.ffn_down_exps.weight.weight)
        return nn.mix_experts(self.pre_ffw_norm_2(h, opts.eps), chosen, weights, self.ffn_gate_up_exps, None, down,
                              lambda gate, up: gate.gelu(up))  # the experts' gate and up stored as one


class Weights(nn.Module):
    token_embd: nn.Embedding = nn.shape("hidden_size", "vocab_size")
    per_layer_token_embd: nn.Embedding | None = nn.shape("ple_size * n_layers", "vocab_size", when="ple_size")
    per_layer_model_proj: nn.Linear | None = nn.shape("hidden_size", "ple_size * n_layers", when="ple_size")
    per_layer_proj_norm: nn.RMSNorm | None = nn.shape("ple_size", when="ple_size")
    rope_freqs: nn.Weight = nn.shape("head_dim // 2")
    blk: list[Layer]
    output_norm: nn.RMSNorm = nn.shape("hidden_size")
    output: nn.Linear | None = nn.shape("hidden_size", "vocab_size", alt="token_embd")


@register("gemma4")
class Gemma4(Model):
    Options, Weights = Options, Weights

    def __init__(self, backend: Backend):
        self.backend = backend
        self.options = o = Options.from_config(backend.config)
        self.weights = nn.load(Weights, backend, o)
        self.cache = Wrapper(Causal(self.shift, swa_window=o.sliding_window), Causal(self.shift),
                             layer_types=o.layer_kinds)
        self.vision = gemma4_vision.load(backend, o.hidden_size)
        self._pad = backend.config.get("tokenizer.ggml.padding_token_id", 0)

    def attach_mmproj(self, projector: Backend) -> None:
        if self.vision is not None:
            raise ModelError(f"{self.backend.path} has a vision part already; it takes no mmproj file")
        vision = gemma4_vision.load(projector, self.options.hidden_size)
        if vision is None:
            raise ModelError(f"{projector.path}: no vision tensors (v.patch_embd.weight)")
        self.vision, self._projector = vision, projector

    def close(self) -> None:
        super().close()
        if getattr(self, "_projector", None) is not None:
            self._projector.close()
            self._projector = None

    def forward(self, ctx: Context, batch: Batch) -> Tensor:
        w, o = self.weights, self.options
        inputs = nn.batch_inputs(ctx, batch)
        h = nn.tap("token_embd", w.token_embd(inputs.tokens).scale(math.sqrt(o.hidden_size)))
        tokens = inputs.tokens
        if batch.multimodal:
            h, tokens = self._images(ctx, h, batch)
        per_layer = self._per_layer_inputs(h, tokens) if o.ple_size else None
        for i, layer, rows in nn.layers(w.blk, self.cache, inputs.outputs, o.kv_layers):
            this = None if per_layer is None else per_layer.view(i * per_layer.strides[2], per_layer.shape[:2],
                                                                  per_layer.strides[1:2])
            h = nn.tap(f"blk.{i}", layer(ctx, h, this, inputs.positions, rows, self.cache, o, i, w.rope_freqs.weight))
        logits = w.output(nn.tap("output_norm", w.output_norm(h, o.eps)))
        if o.final_softcap:
            logits = logits.scale(1.0 / o.final_softcap).tanh().scale(o.final_softcap)
        return logits

    def _images(self, ctx: Context, h: Tensor, batch: Batch) -> tuple[Tensor, Tensor]:
        """Image embeddings over their placeholders, and the tokens the per-layer table reads (the
        padding token on image rows)."""
        tokens = np.array(batch.tokens, dtype=np.int32)
        for m in batch.multimodal:
            end = m.index + sum(np.asarray(item.tensor).reshape(-1, h.shape[0]).shape[0] for item in m.multimodal)
            tokens[m.index:end] = self._pad
            if self.options.hidden_size not in CAUSAL_IMAGE_WIDTHS:
                self.cache.caches[nn.SLIDING].set_noncausal(m.index, end)
        return nn.multimodal_embeddings(ctx, h, batch), nn.int32_input(ctx.input(), tokens)

    def _per_layer_inputs(self, h: Tensor, tokens: Tensor) -> Tensor:
        """Each layer's per-layer embedding input, (ple_size, n_tokens, n_layers): the token's row of the
        per-layer table and the projected input embedding, normed, averaged (times sqrt 2, as Gemma 4)."""
        w, o = self.weights, self.options
        shape = (o.ple_size, o.n_layers, h.shape[1])
        table = w.per_layer_token_embd(tokens).reshape(*shape).scale(math.sqrt(o.ple_size))
        projected = w.per_layer_model_proj(h).scale(1.0 / math.sqrt(o.hidden_size)).reshape(*shape)
        mixed = (w.per_layer_proj_norm(projected, o.eps) + table).scale(1.0 / math.sqrt(2.0))
        return mixed.permute(0, 2, 1, 3).contiguous()

    def shift(self, ctx: Context, layer: int, key: Tensor, shift: Tensor) -> Tensor:
        o = self.options
        if o.layer_kinds[layer] == nn.SLIDING:
            return o.rope_local(key, shift)
        return o.rope(key, shift, self.weights.rope_freqs.weight)
