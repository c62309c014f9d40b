"""Llama 4 text decoders (GGUF architecture "llama4": the text part of Llama 4 Scout and Maverick).

Llama's pre-norm decoder (``pyggml.models.llama``) with interleaved positions and experts:

- three of every four layers (``attention.sliding_window_pattern``, default 4) rotate their queries and
  keys (ggml's normal rope, the rotated pairs adjacent as Meta's complex form) and attend only within
  their chunk of ``attention.chunk_size`` positions (0..8191, 8192..16383, ...); those rope layers then
  normalise each query and key head to unit RMS (no weight; not in the 128-expert Maverick, as llama.cpp);
- every fourth layer has no positions (NoPE) and attends to the whole context, its queries scaled by
  1 + ``attention.temperature_scale`` * ln(1 + floor((p + 1) / ``attention.temperature_length``)) (attention
  temperature tuning: sharper attention far into long contexts);
- every ``interleave_moe_layer_step``-th layer has a mixture of experts in place of the MLP: a sigmoid of
  the router's logit for each of the ``expert_used_count`` best experts scales that expert's *input*,
  and a shared expert (``ffn_*_shexp``) sees every token.

llama.cpp fixes the chunk at 8192 positions and the temperature at 0.1 per 8192 positions, reading no
keys for them; the three keys above (written by ``pyggml.convert``) default to those values, so files
of other values (tiny test models) run differently in llama.cpp.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pyggml import nn
from pyggml.backend import Backend, Context
from pyggml.backend.metadata import MAX_CONTEXT
from pyggml.kvcache import Cache, Causal, Wrapper
from pyggml.models import Batch, ModelError, llama, register
from pyggml.tensor import Tensor

NO_ROPE_STEP = 4  # llama.cpp's n_no_rope_layer_step: layers 3, 7, 11, ... have no rope (no GGUF key)
CHUNK, TEMPERATURE_LENGTH, TEMPERATURE_SCALE = 8192, 8192, 0.1  # llama.cpp's fixed values
MAVERICK_EXPERTS = 128  # llama.cpp leaves out the q/k norm for the model with this many experts


@dataclass(frozen=True)
class Options(llama.Options):
    layer_kinds: tuple[int, ...] = ()  # nn.SLIDING (chunked) or nn.GLOBAL per layer
    chunk_size: int = CHUNK
    rope_chunked: nn.Rope | None = None  # the chunked layers' rope (rope.freq_base_swa)
    qk_norm: bool = True
    temperature_scale: float = TEMPERATURE_SCALE  # 0: no temperature tuning
    temperature_length: int = TEMPERATURE_LENGTH
    moe: tuple[bool, ...] = ()  # per layer: experts (else a dense MLP)
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn_size: int = 0

    @classmethod
    def from_config(cls, config, **extra) -> Options:
        arch = config.architecture
        n_layers = config.uint("block_count", 1)
        n_experts, n_used = nn.expert_counts(config)
        step = config.uint("interleave_moe_layer_step", None, max=n_layers)
        if step is None:
            raise ModelError(f"{arch}: {arch}.interleave_moe_layer_step must be set (0: no expert layers)")
        expert_ffn = config.uint("expert_feed_forward_length", 0)
        if not expert_ffn:
            raise ModelError(f"{arch}: {arch}.expert_feed_forward_length must be set and non-zero")
        if config.float("expert_weights_scale", 1.0) not in (0.0, 1.0):
            raise ModelError(f"{arch}: {arch}.expert_weights_scale is not supported")
        if config.uint("attention.sliding_window", CHUNK) == 0:
            raise ModelError(f"{arch}: attention.sliding_window is 0 (no chunked attention, as MobileLLM); "
                             "only Llama 4's chunked layers are supported")
        options = super().from_config(
            config, layer_kinds=nn.layer_kinds(config, n_layers, NO_ROPE_STEP),
            chunk_size=config.uint("attention.chunk_size", CHUNK, min=1, max=MAX_CONTEXT),
            qk_norm=n_experts != MAVERICK_EXPERTS,
            temperature_scale=config.float("attention.temperature_scale", TEMPERATURE_SCALE, min=0.0, max=1e3),
            temperature_length=config.uint("attention.temperature_length", TEMPERATURE_LENGTH, min=1,
                                           max=MAX_CONTEXT),
            moe=tuple(step > 0 and (i + 1) % step == 0 for i in range(n_layers)),
            n_experts=n_experts, n_experts_used=n_used, expert_ffn_size=expert_ffn, **extra)
        if options.rope.n_dims != options.head_dim or options.head_dim_v != options.head_dim:
            raise ModelError(f"{arch}: rope.dimension_count and attention.value_length must equal the head size "
                             f"({options.head_dim}), as llama.cpp requires")
        base = config.float("rope.freq_base_swa", 0.0, min=0.0, max=1e12) or options.rope.base
        return dataclasses.replace(options, rope_chunked=dataclasses.replace(options.rope, base=base))

    def uses_rope(self, layer: int) -> bool:
        return (layer + 1) % NO_ROPE_STEP != 0

    def layer_rope(self, layer: int) -> nn.Rope | None:
        if not self.uses_rope(layer):
            return None
        return self.rope_chunked if self.layer_kinds[layer] == nn.SLIDING else self.rope


class SelfAttention(llama.SelfAttention):
    def __call__(self, ctx: Context, x: Tensor, positions: Tensor, cache: Cache, opts: Options,
                 rope: nn.Rope | None, freq_factors: Tensor | None, temperature: Tensor | None) -> Tensor:
        q, k, v = self.project(x, opts)
        if rope is not None:
            q, k = rope(q, positions, freq_factors), rope(k, positions, freq_factors)
            if opts.qk_norm:  # L2 norm of each head (RMS, no weight)
                q, k = q.rms_norm(opts.eps), k.rms_norm(opts.eps)
        elif temperature is not None:  # (1, 1, n_tokens)
            q = q + q * temperature
        return self.attn_output(nn.attention(ctx, q, k, v, cache, 1.0 / math.sqrt(opts.head_dim)))


_DENSE, _MOE = "not moe[layer]", "moe[layer]"


class FeedForward(nn.Module):
    """A dense SwiGLU MLP, or routed experts beside a shared one."""

    ffn_gate: nn.Linear | None = nn.shape("hidden_size", "ffn_size", when=_DENSE)
    ffn_up: nn.Linear | None = nn.shape("hidden_size", "ffn_size", when=_DENSE)
    ffn_down: nn.Linear | None = nn.shape("ffn_size", "hidden_size", when=_DENSE)
    ffn_gate_inp: nn.Linear | None = nn.shape("hidden_size", "n_experts", when=_MOE)  # the router
    ffn_gate_exps: nn.Experts | None = nn.shape("hidden_size", "expert_ffn_size", "n_experts", when=_MOE)
    ffn_up_exps: nn.Experts | None = nn.shape("hidden_size", "expert_ffn_size", "n_experts", when=_MOE)
    ffn_down_exps: nn.Experts | None = nn.shape("expert_ffn_size", "hidden_size", "n_experts", when=_MOE)
    ffn_gate_shexp: nn.Linear | None = nn.shape("hidden_size", "expert_ffn_size", when=_MOE)
    ffn_up_shexp: nn.Linear | None = nn.shape("hidden_size", "expert_ffn_size", when=_MOE)
    ffn_down_shexp: nn.Linear | None = nn.shape("expert_ffn_size", "hidden_size", when=_MOE)

    def __call__(self, x: Tensor, opts: Options) -> Tensor:
        if self.ffn_gate_inp is None:
            return self.ffn_down(self.ffn_gate(x).silu(self.ffn_up(x)))
        n_tokens, k = x.shape[1], opts.n_experts_used
        logits = self.ffn_gate_inp(x)  # (n_experts, n_tokens)
        chosen = logits.top_k(k)
        weights = logits.sigmoid().reshape(1, opts.n_experts, n_tokens).rows(chosen).reshape(k, n_tokens)
        routed = nn.mix_experts(x, chosen, weights, self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps,
                                lambda gate, up: gate.silu(up), weigh_inputs=True)
        return routed + self.ffn_down_shexp(self.ffn_gate_shexp(x).silu(self.ffn_up_shexp(x)))


class Layer(nn.Module):
    attn_norm: nn.RMSNorm = nn.shape("hidden_size")
    attention: SelfAttention
    ffn_norm: nn.RMSNorm = nn.shape("hidden_size")
    mlp: FeedForward

    def __call__(self, ctx: Context, h: Tensor, positions: Tensor, outputs: Tensor | None, cache: Cache,
                 opts: Options, rope: nn.Rope | None, freq_factors: Tensor | None,
                 temperature: Tensor | None) -> Tensor:
        x = self.attention(ctx, self.attn_norm(h, opts.eps), positions, cache, opts, rope, freq_factors, temperature)
        x, h = nn.output_rows(outputs, x, h)
        h = h + x
        return h + self.mlp(self.ffn_norm(h, opts.eps), opts)


class Weights(llama.Weights):
    blk: list[Layer]


@register("llama4")
class Llama4(llama.Llama):
    Options, Weights = Options, Weights

    def __init__(self, backend: Backend):
        self.backend = backend
        self.options = Options.from_config(backend.config)
        self.weights: Weights = nn.load(Weights, backend, self.options)
        o = self.options
        self.cache = Wrapper(Causal(self.shift, chunk_size=o.chunk_size), Causal(self.shift),
                             layer_types=o.layer_kinds)

    def forward(self, ctx: Context, batch: Batch) -> Tensor:
        w, o = self.weights, self.options
        inputs = nn.batch_inputs(ctx, batch)
        freq_factors = w.rope_freqs.weight if w.rope_freqs is not None else None
        temperature = None
        if o.temperature_scale and not all(o.uses_rope(i) for i in range(o.n_layers)):
            temperature = nn.attention_temperature(ctx, inputs.positions, o.temperature_scale, o.temperature_length,
                                                   self.cache.caches[nn.GLOBAL].capacity, offset=1)
        h = nn.tap("token_embd", w.token_embd(inputs.tokens))
        for i, layer, rows in nn.layers(w.blk, self.cache, inputs.outputs):
            h = nn.tap(f"blk.{i}", layer(ctx, h, inputs.positions, rows, self.cache, o, o.layer_rope(i), freq_factors,
                                         temperature))
        return nn.tap("output", w.output(nn.tap("output_norm", w.output_norm(h, o.eps))))

    def shift(self, ctx: Context, layer: int, key: Tensor, shift: Tensor) -> Tensor:
        rope = self.options.layer_rope(layer)
        if rope is None:
            return key  # no positions in this layer's keys
        return rope(key, shift, self.weights.rope_freqs.weight if self.weights.rope_freqs is not None else None)
