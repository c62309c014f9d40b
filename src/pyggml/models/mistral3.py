"""Mistral 3 text decoders: Ministral 3 (GGUF architecture "mistral3", as llama.cpp runs it).

Llama with YaRN rope (its magnitude as Hugging Face's ``mscale`` / ``mscale_all_dim``: 1 for the released
models, through ``rope.scaling.yarn_log_multiplier``), and Llama 4's attention temperature tuning: each
query is multiplied by 1 + ``attention.temperature_scale`` * ln(1 + floor(position / n)), n the
``rope.scaling.original_context_length``, so queries past the original context attend more sharply.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pyggml import nn
from pyggml.backend import Context
from pyggml.backend.metadata import MAX_CONTEXT
from pyggml.kvcache import Causal
from pyggml.models import Batch, ModelError, llama, mistral3_vision, register
from pyggml.tensor import Tensor


@dataclass(frozen=True)
class Options(llama.Options):
    temperature_scale: float = 0.0  # 0: no temperature tuning
    temperature_floor: int = 0  # positions per temperature step (the original context)

    @classmethod
    def from_config(cls, config, **extra) -> Options:
        arch = config.architecture
        scale = config.float("attention.temperature_scale", 0.0, min=0.0, max=1e3)
        floor = config.uint("rope.scaling.original_context_length", 0, max=MAX_CONTEXT)
        if scale and not floor:
            raise ModelError(f"{arch}: attention.temperature_scale needs rope.scaling.original_context_length")
        options = super().from_config(config, temperature_scale=scale, temperature_floor=floor, **extra)
        if options.rope.n_dims != options.head_dim:
            raise ModelError(f"{arch}: rope.dimension_count must equal the head size ({options.head_dim})")
        return dataclasses.replace(options, rope=dataclasses.replace(options.rope, attn_factor=yarn_magnitude(
            config, options.rope)))


def yarn_magnitude(config, rope: nn.Rope) -> float:
    """The rope's attention factor as llama.cpp sets it: under YaRN, Hugging Face's attention factor
    mscale(factor, 1) / mscale(factor, rope.scaling.yarn_log_multiplier) (DeepSeek's form; mscale(factor, 1)
    without the key) divided by the 1 + 0.1 ln(factor) that ggml's YaRN applies itself; times
    rope.scaling.attn_factor."""
    factor = 1.0 / rope.freq_scale

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1.0 else 0.1 * m * math.log(factor) + 1.0

    magnitude = 1.0
    if rope.ext_factor:
        log_mul = config.float("rope.scaling.yarn_log_multiplier", 0.0, min=0.0, max=1e3)
        magnitude = (mscale(1.0) / mscale(log_mul) if log_mul else mscale(1.0)) / mscale(1.0)
    return magnitude * config.float("rope.scaling.attn_factor", 1.0, min=1e-6, max=1e6)


class SelfAttention(llama.SelfAttention):
    def __call__(self, ctx: Context, x: Tensor, positions: Tensor, cache: Causal, opts: Options,
                 temperature: Tensor | None) -> Tensor:
        q, k, v = self.project(x, opts)
        q, k = opts.rope(q, positions), opts.rope(k, positions)
        if temperature is not None:  # (1, 1, n_tokens): ln(1 + floor(position / floor)) * scale, per token
            q = q + q * temperature
        return self.attn_output(nn.attention(ctx, q, k, v, cache, 1.0 / math.sqrt(opts.head_dim)))


class Layer(llama.Layer):
    attention: SelfAttention


class Weights(llama.Weights):
    blk: list[Layer]  # (a rope_freqs tensor is not used: llama.cpp's mistral3 files carry none)


@register("mistral3")
class Mistral3(llama.Llama):
    Options, Weights = Options, Weights
    vision: mistral3_vision.Vision | None = None  # (Llama's __init__ loads it; attach_mmproj too)

    def forward(self, ctx: Context, batch: Batch) -> Tensor:
        w, o = self.weights, self.options
        inputs = nn.batch_inputs(ctx, batch)
        temperature = self._temperature(ctx, inputs.positions) if o.temperature_scale else None
        h = nn.tap("token_embd", w.token_embd(inputs.tokens))
        if batch.multimodal:  # image embeddings over their placeholders (Pixtral's: attended causally)
            h = nn.multimodal_embeddings(ctx, h, batch)
        for i, layer, rows in nn.layers(w.blk, self.cache, inputs.outputs):
            # the Llama layer hands its last argument to the attention: here the queries' temperature
            h = nn.tap(f"blk.{i}", layer(ctx, h, inputs.positions, rows, self.cache, o, temperature))
        return nn.tap("output", w.output(nn.tap("output_norm", w.output_norm(h, o.eps))))

    def shift(self, ctx: Context, layer: int, key: Tensor, shift: Tensor) -> Tensor:
        return self.options.rope(key, shift)

    def _temperature(self, ctx: Context, positions: Tensor) -> Tensor:
        o = self.options
        return nn.attention_temperature(ctx, positions, o.temperature_scale, o.temperature_floor, self.cache.capacity)
