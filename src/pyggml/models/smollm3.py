"""SmolLM3 (GGUF architecture "smollm3"): Llama whose every fourth layer (3, 7, 11, ...) attends without
positions (no rope: "NoPE"), as llama.cpp runs it (a fixed step of 4, no GGUF key). Those layers' cached
keys carry no rotation, so a context shift leaves them alone."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pyggml import nn
from pyggml.backend import Context
from pyggml.kvcache import Causal
from pyggml.models import Batch, ModelError, llama, register
from pyggml.tensor import Tensor

NO_ROPE_STEP = 4  # llama.cpp's n_no_rope_layer_step for smollm3


@dataclass(frozen=True)
class Options(llama.Options):
    @classmethod
    def from_config(cls, config, **extra) -> Options:
        options = super().from_config(config, **extra)
        if options.rope.n_dims != options.head_dim:
            raise ModelError(f"{config.architecture}: rope.dimension_count must equal the head size "
                             f"({options.head_dim}), as llama.cpp requires")
        return options

    def uses_rope(self, layer: int) -> bool:
        return (layer + 1) % NO_ROPE_STEP != 0


class SelfAttention(llama.SelfAttention):
    def __call__(self, ctx: Context, x: Tensor, positions: Tensor, cache: Causal, opts: Options,
                 uses_rope: bool) -> Tensor:
        q, k, v = self.project(x, opts)
        if uses_rope:
            q, k = opts.rope(q, positions), opts.rope(k, positions)
        return self.attn_output(nn.attention(ctx, q, k, v, cache, 1.0 / math.sqrt(opts.head_dim)))


class Layer(llama.Layer):
    attention: SelfAttention


class Weights(llama.Weights):
    blk: list[Layer]  # (a rope_freqs tensor, which llama.cpp's smollm3 never reads, is not used either)


@register("smollm3")
class SmolLM3(llama.Llama):
    Options, Weights = Options, Weights

    def forward(self, ctx: Context, batch: Batch) -> Tensor:
        w, o = self.weights, self.options
        inputs = nn.batch_inputs(ctx, batch)
        h = nn.tap("token_embd", w.token_embd(inputs.tokens))
        for i, layer, rows in nn.layers(w.blk, self.cache, inputs.outputs):
            # the Llama layer hands its last argument to the attention: here whether the layer rotates
            h = nn.tap(f"blk.{i}", layer(ctx, h, inputs.positions, rows, self.cache, o, o.uses_rope(i)))
        return nn.tap("output", w.output(nn.tap("output_norm", w.output_norm(h, o.eps))))

    def shift(self, ctx: Context, layer: int, key: Tensor, shift: Tensor) -> Tensor:
        return self.options.rope(key, shift) if self.options.uses_rope(layer) else key
