"""Llama 3.2 Vision (GGUF architecture "mllama", the layout Ollama writes): a Llama decoder in which the
layers ``attention.cross_attention_layers`` attend from the text to an image instead of to the text.

A cross-attention layer: RMSNorm -> queries (per-head RMSNorm) over the image's keys (per-head RMSNorm)
and values -> output scaled by tanh(attn gate) -> residual; RMSNorm -> SwiGLU MLP scaled by tanh(mlp
gate) -> residual. The image's keys and values are computed once, in the batch that carries the
``<|image|>`` token, and kept by the ``Encoder`` cache (``Wrapper(Encoder(), Causal)``) for the later
batches of the sequence; sequences that see no image skip these layers, as Hugging Face does without
pixels. As in Hugging Face's processor, tokens from the image token on attend to the image's tiles
(not the padding tiles), and text before it in the image's batch attends to every tile with its
cross-attention MLP masked out (text before it in an earlier batch skips these layers, as in Ollama).
One image per prompt; a later image (a later turn) replaces the earlier one."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from pyggml import nn
from pyggml.backend import Backend, Context
from pyggml.backend.metadata import MAX_LAYERS
from pyggml.kvcache import Causal, Encoder, Wrapper
from pyggml.models import Batch, ModelError, llama, mllama_vision, register
from pyggml.tensor import DType, Tensor

SELF, CROSS = "not is_cross[layer]", "is_cross[layer]"


@dataclass(frozen=True)
class Options(llama.Options):
    is_cross: tuple[bool, ...] = ()
    embd_rows: int | None = None  # token_embd rows: the vocabulary and 8 more (<|image|> among them)

    @classmethod
    def from_config(cls, config) -> Options:
        arch, n_layers = config.architecture, config.uint("block_count", 0, max=MAX_LAYERS)
        cross = config.uints("attention.cross_attention_layers", [])
        if not all(0 <= i < n_layers for i in cross):
            raise ModelError(f"{arch}: {arch}.attention.cross_attention_layers {cross} name layers outside "
                             f"0..{n_layers - 1}")
        vocab = config.uint("vocab_size", 0) or None  # not the tokenizer's size: it has <|image|> beyond
        opts = super().from_config(config, is_cross=tuple(i in cross for i in range(n_layers)),
                                   embd_rows=vocab + 8 if vocab else None)
        return dataclasses.replace(opts, vocab_size=vocab)


class SelfAttention(llama.SelfAttention):
    attn_q: nn.Linear | None = nn.shape("hidden_size", "n_heads * head_dim", when=SELF)
    attn_k: nn.Linear | None = nn.shape("hidden_size", "n_kv_heads * head_dim", when=SELF)
    attn_v: nn.Linear | None = nn.shape("hidden_size", "n_kv_heads * head_dim_v", when=SELF)
    attn_output: nn.Linear | None = nn.shape("n_heads * head_dim_v", "hidden_size", when=SELF)


class CrossAttention(nn.Module):
    cross_attn_q_proj: nn.Linear | None = nn.shape("hidden_size", "n_heads * head_dim", when=CROSS)
    cross_attn_k_proj: nn.Linear | None = nn.shape("hidden_size", "n_kv_heads * head_dim", when=CROSS)
    cross_attn_v_proj: nn.Linear | None = nn.shape("hidden_size", "n_kv_heads * head_dim", when=CROSS)
    cross_attn_o_proj: nn.Linear | None = nn.shape("n_heads * head_dim", "hidden_size", when=CROSS)
    cross_attn_q_norm: nn.RMSNorm | None = nn.shape("head_dim", when=CROSS)
    cross_attn_k_norm: nn.RMSNorm | None = nn.shape("head_dim", when=CROSS)
    cross_attn_attn_gate: nn.Parameter | None = nn.shape(1, when=CROSS)  # stored before tanh
    cross_attn_mlp_gate: nn.Parameter | None = nn.shape(1, when=CROSS)

    def put(self, ctx: Context, cache: Wrapper, states: Tensor, o: Options) -> None:
        """Keys and values of the image embeddings ``states`` (hidden, n_enc) into the encoder cache."""
        n = states.shape[1]
        key = self.cross_attn_k_proj(states).reshape(o.head_dim, o.n_kv_heads, n)
        cache.put(ctx, self.cross_attn_k_norm(key, o.eps),
                  self.cross_attn_v_proj(states).reshape(o.head_dim, o.n_kv_heads, n))

    def __call__(self, ctx: Context, x: Tensor, cache: Wrapper, mask: Tensor, o: Options) -> Tensor:
        n = x.shape[1]
        q = self.cross_attn_q_norm(self.cross_attn_q_proj(x).reshape(o.head_dim, o.n_heads, n), o.eps)
        key, value, _ = cache.get(ctx)
        out = q.permute(0, 2, 1, 3).scaled_dot_product_attention(key, value, mask, 1.0 / math.sqrt(o.head_dim))
        return self.cross_attn_o_proj(out.reshape(o.head_dim * o.n_heads, n))


def _tanh(ctx: Context, gate: nn.Parameter) -> Tensor:
    return gate.weight.reshape(1, ctx=ctx).tanh()


class Layer(llama.Layer):
    attention: SelfAttention
    cross: CrossAttention

    def cross_attend(self, ctx: Context, h: Tensor, cache: Wrapper, image: _Image, outputs: Tensor | None,
                     o: Options) -> Tensor:
        c = self.cross
        if image.states is not None:
            c.put(ctx, cache, image.states, o)
        h = h + c(ctx, self.attn_norm(h, o.eps), cache, image.mask, o) * _tanh(ctx, c.cross_attn_attn_gate)
        rows = image.rows
        if outputs is not None:  # last layer: only the rows whose logits are wanted go on
            h, rows = h.rows(outputs), None if rows is None else rows.rows(outputs)
        x = self.mlp(self.ffn_norm(h, o.eps), o)
        return h + (x if rows is None else x * rows) * _tanh(ctx, c.cross_attn_mlp_gate)


class Weights(llama.Weights):
    token_embd: nn.Embedding = nn.shape("hidden_size", "embd_rows")
    blk: list[Layer]
    output: nn.Linear = nn.shape("hidden_size", "vocab_size")


@dataclass(frozen=True)
class _Image:
    """What the cross-attention layers of one batch read: the image embeddings to store (in the batch
    that carries the image), the mask (n_enc, n_tokens) and the rows (1, n_tokens) whose MLP counts."""

    states: Tensor | None
    mask: Tensor
    rows: Tensor | None


@register("mllama")
class Mllama(llama.Llama):
    Options, Weights = Options, Weights
    vision: mllama_vision.Vision | None = None
    max_parallel = 1  # the encoder cache holds one image for all sequences (as in Ollama, which runs mllama alone)

    def __init__(self, backend: Backend):
        self.backend = backend
        self.options = self.Options.from_config(backend.config)
        self.weights: Weights = nn.load(self.Weights, backend, self.options)
        self.vision = mllama_vision.load(backend, self.options.hidden_size)
        self.cache = Wrapper(Encoder(), Causal(self.shift), layer_types=[0 if c else 1 for c in self.options.is_cross])
        self._key_bias = None  # the stored image's tile mask (n_enc,): 0 for its tiles, -inf for padding tiles
        if self.vision is not None:
            self._key_bias = backend.alloc_persistent(DType.F32, (self.vision.options.n_enc,), name="mllama.tiles",
                                                      purpose="cache")

    def forward(self, ctx: Context, batch: Batch) -> Tensor:
        w, o = self.weights, self.options
        inputs = nn.batch_inputs(ctx, batch)
        freq_factors = w.rope_freqs.weight if w.rope_freqs is not None else None
        image = self._image(ctx, batch)
        h = nn.tap("token_embd", w.token_embd(inputs.tokens))
        for i, layer, last in nn.layers(w.blk, self.cache, inputs.outputs):
            if not o.is_cross[i]:
                h = layer(ctx, h, inputs.positions, last, self.cache, o, freq_factors)
            elif image is not None:
                h = layer.cross_attend(ctx, h, self.cache, image, last, o)
            elif last is not None:  # a skipped last layer still picks the output rows
                h = h.rows(last)
            h = nn.tap(f"blk.{i}", h)
        return nn.tap("output", w.output(nn.tap("output_norm", w.output_norm(h, o.eps))))

    def _image(self, ctx: Context, batch: Batch) -> _Image | None:
        """The image the batch's cross-attention layers read, or None when its sequences see none."""
        encoder: Encoder = self.cache.caches[0]
        n_tokens = len(batch.inputs)
        if not batch.multimodal:
            if self._key_bias is None or not (encoder.encoder_cached or encoder.reserving):
                return None
            n_enc = self._key_bias.shape[0]
            states = ctx.zeros(DType.F32, self.options.hidden_size, n_enc) if encoder.reserving else None
            return _Image(states, self._key_bias.reshape(n_enc, 1, ctx=ctx).repeat(n_enc, n_tokens), None)
        if self.vision is None:
            raise ValueError("mllama: this model has no vision part; the batch carries an image")
        if len(batch.multimodal) > 1:
            raise ValueError("mllama: one image per batch (the encoder cache holds one image)")
        index, items = batch.multimodal[0].index, batch.multimodal[0].multimodal
        n_enc, hidden = self.vision.options.n_enc, self.options.hidden_size
        states, bias = (np.asarray(m.tensor, np.float32) for m in items) if len(items) == 2 else (None, None)
        if states is None or states.shape != (n_enc, hidden) or bias.shape != (n_enc,):
            raise ValueError(f"mllama: an image must be its embeddings ({n_enc}, {hidden}) and tile mask ({n_enc},) "
                             "as its vision part makes them")
        seen = np.arange(n_tokens) >= index  # rows from the image token on see its tiles
        mask = np.where(seen[:, None], bias[None, :], 0.0).astype(np.float32)  # numpy (n_tokens, n_enc)
        ctx.forward(ctx.from_numpy(bias).copy(self._key_bias))
        return _Image(ctx.from_numpy(states), ctx.from_numpy(mask), ctx.from_numpy(seen.astype(np.float32)[:, None]))
