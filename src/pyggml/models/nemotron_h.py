"""Nemotron-H (GGUF architecture "nemotron_h": NVIDIA Nemotron-H and Nemotron Nano 2, dense).

Each block is one pre-normed mixer and a residual: **Mamba-2** (the mixer of ``mamba2.py``:
``ssm_*`` tensors), **attention** (grouped-query, no positional encoding, optional biases) or a
**squared-ReLU MLP** (``ffn_up``, ReLU², ``ffn_down``). As llama.cpp reads the file, a layer whose
``attention.head_count_kv`` and ``feed_forward_length`` entries are both 0 is Mamba-2, one with
only a feed-forward length an MLP, one with only KV heads attention. Files with experts (``expert_count``:
Nemotron 3's MoE layers) are not supported here.

Memory: attention layers use a ``Causal`` cache, Mamba-2 layers a ``Recurrent`` one, in a ``Wrapper``
by kind (MLP layers use neither).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pyggml import nn
from pyggml.backend import Backend, Context
from pyggml.backend.metadata import MAX_CONTEXT, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH
from pyggml.kvcache import Causal, Recurrent, Wrapper
from pyggml.models import Batch, Model, ModelError, register
from pyggml.models.mamba2 import ATTENTION, SSM, Mamba2, Mamba2Options
from pyggml.tensor import Tensor

MLP = 2  # the third kind of layer (no cache)


@dataclass(frozen=True)
class Options(Mamba2Options):
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: tuple[int, ...]  # per layer; attention layers only
    head_dim: int
    ffn_sizes: tuple[int, ...]  # per layer; MLP layers only
    vocab_size: int | None
    context_length: int
    eps: float
    layer_kinds: tuple[int, ...]  # ATTENTION, SSM or MLP per layer

    @classmethod
    def from_config(cls, config) -> Options:
        arch = config.architecture
        hidden = config.uint("embedding_length", min=1, max=MAX_WIDTH)
        n_heads = config.uint("attention.head_count", min=1, max=MAX_WIDTH)
        n_layers = config.uint("block_count", min=1, max=MAX_LAYERS)
        if not hidden or not n_heads or not n_layers:
            raise ModelError(f"{arch}: {arch}.embedding_length, {arch}.block_count and {arch}.attention.head_count "
                             "must be set and non-zero")
        if config.uint("expert_count", 0):
            raise ModelError(f"{arch}: {arch}.expert_count is set; Nemotron-H files with experts are not supported")
        kv, ff = (nn.per_layer(config, key, n_layers, 0, limit) for key, limit in
                  (("attention.head_count_kv", n_heads), ("feed_forward_length", MAX_WIDTH)))
        if any(k and n_heads % k for k in kv) or any(k and f for k, f in zip(kv, ff, strict=True)):
            raise ModelError(f"{arch}: each layer needs {arch}.attention.head_count_kv (a divisor of the {n_heads} "
                             f"heads: attention) or {arch}.feed_forward_length (an MLP) or neither (Mamba-2), not "
                             f"both; found {kv} and {ff}")
        kinds = tuple(ATTENTION if k else MLP if f else SSM for k, f in zip(kv, ff, strict=True))
        head_dim = config.uint("attention.key_length", 0, max=MAX_WIDTH) or hidden // n_heads
        if (config.uint("attention.value_length", 0, max=MAX_WIDTH) or head_dim) != head_dim or not head_dim:
            raise ModelError(f"{arch}: {arch}.attention.value_length must equal {arch}.attention.key_length")
        eps = config.float("attention.layer_norm_rms_epsilon", None, min=0.0, max=1.0)
        eps = config.float("attention.layer_norm_epsilon", None, min=0.0, max=1.0) if eps is None else eps
        if eps is None:
            raise ModelError(f"{arch}: {arch}.attention.layer_norm_epsilon must be set")
        return cls(
            **Mamba2Options.read(config, recurrent=SSM in kinds),
            hidden_size=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=tuple(kv), head_dim=head_dim,
            ffn_sizes=tuple(ff),
            vocab_size=config.uint("vocab_size", 0, max=MAX_VOCAB) or len(config.get("tokenizer.ggml.tokens", ()))
            or None,
            context_length=config.uint("context_length", 8192, min=1, max=MAX_CONTEXT), eps=eps, layer_kinds=kinds,
        )


_IS_ATTENTION, _IS_MLP = f"layer_kinds[layer] == {ATTENTION}", f"layer_kinds[layer] == {MLP}"


class Mixer(nn.Module):
    """A block's one mixer: attention, Mamba-2 or the MLP, by the layer's kind."""

    attn_q: nn.Linear | None = nn.shape("hidden_size", "n_heads * head_dim", when=_IS_ATTENTION)
    attn_k: nn.Linear | None = nn.shape("hidden_size", "n_kv_heads[layer] * head_dim", when=_IS_ATTENTION)
    attn_v: nn.Linear | None = nn.shape("hidden_size", "n_kv_heads[layer] * head_dim", when=_IS_ATTENTION)
    attn_output: nn.Linear | None = nn.shape("n_heads * head_dim", "hidden_size", when=_IS_ATTENTION)
    mamba: Mamba2
    ffn_up: nn.Linear | None = nn.shape("hidden_size", "ffn_sizes[layer]", when=_IS_MLP)
    ffn_down: nn.Linear | None = nn.shape("ffn_sizes[layer]", "hidden_size", when=_IS_MLP)

    def __call__(self, ctx: Context, x: Tensor, cache: Wrapper, states: Recurrent, opts: Options,
                 layer: int) -> Tensor:
        kind = opts.layer_kinds[layer]
        if kind == SSM:
            return self.mamba(ctx, x, states, opts, opts.eps, layer)
        if kind == MLP:
            return nn.tap(f"blk.{layer}.ffn_down", self.ffn_down(self.ffn_up(x).relu().sqr()))
        n_tokens, n_kv, d = x.shape[1], opts.n_kv_heads[layer], opts.head_dim
        q = self.attn_q(x).reshape(d, opts.n_heads, n_tokens)
        k, v = self.attn_k(x).reshape(d, n_kv, n_tokens), self.attn_v(x).reshape(d, n_kv, n_tokens)
        out = nn.attention(ctx, q, k, v, cache, 1.0 / math.sqrt(d))
        return nn.tap(f"blk.{layer}.attn_output", self.attn_output(out))


class Layer(nn.Module):
    attn_norm: nn.RMSNorm = nn.shape("hidden_size")
    mixer: Mixer


class Weights(nn.Module):
    token_embd: nn.Embedding = nn.shape("hidden_size", "vocab_size")
    blk: list[Layer]
    output_norm: nn.RMSNorm = nn.shape("hidden_size")
    output: nn.Linear = nn.shape("hidden_size", "vocab_size", alt="token_embd")


@register("nemotron_h")
class NemotronH(Model):
    Options, Weights = Options, Weights

    def __init__(self, backend: Backend):
        self.backend = backend
        self.options = self.Options.from_config(backend.config)
        self.weights: Weights = nn.load(self.Weights, backend, self.options)
        self.states = Recurrent()
        self.cache = Wrapper(Causal(self.shift), self.states,
                             layer_types=[1 if k == SSM else 0 for k in self.options.layer_kinds])

    def forward(self, ctx: Context, batch: Batch) -> Tensor:
        w, o = self.weights, self.options
        inputs = nn.batch_inputs(ctx, batch)
        h = nn.tap("token_embd", w.token_embd(inputs.tokens))
        for i, layer, rows in nn.layers(w.blk, self.cache, inputs.outputs):
            x = layer.mixer(ctx, layer.attn_norm(h, o.eps), self.cache, self.states, o, i)
            x, h = nn.output_rows(rows, x, h)
            h = nn.tap(f"blk.{i}", h + x)
        return nn.tap("output", w.output(nn.tap("output_norm", w.output_norm(h, o.eps))))

    def shift(self, ctx: Context, layer: int, key: Tensor, shift: Tensor) -> Tensor:
        return key  # no positional encoding: a key does not depend on its position
