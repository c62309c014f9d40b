"""Qwen 3.5 / 3.6 dense decoders (GGUF architecture "qwen35": Qwen3.5-0.8B .. 27B, Qwen3.6 dense).

Pre-norm blocks of two kinds, each followed by a SwiGLU MLP (``post_attention_norm`` before it):
mostly **Gated DeltaNet** layers (linear attention with a recurrent state), every
``full_attention_interval``-th one (or as ``attention.recurrent_layers`` says) **gated attention**.

- Gated DeltaNet: ``attn_qkv`` projects q, k (``ssm.group_count`` heads of ``ssm.state_size``) and v
  (``ssm.time_step_rank`` heads); they run through a causal depthwise convolution of
  ``ssm.conv_kernel`` taps and SiLU; q and k are L2-normalised. Per value head, a state S (state_size
  squared) decays by ``exp(g)``, ``g = ssm_a * softplus(ssm_alpha x + ssm_dt)``, and learns
  ``sigmoid(ssm_beta x) * (v - S k)`` along k; the output ``S q / sqrt(state_size)`` is RMS-normed
  (``ssm_norm``), gated by ``silu(attn_gate x)`` and projected by ``ssm_out``. Value head h reads key
  head ``h % group_count`` (GGUF stores the value heads in that tiled order).
- Gated attention: ``attn_q`` gives each head's query and an output gate side by side; q and k heads
  are RMS-normed, rotated (NeoX rope on the first ``rope.dimension_count`` dims: text positions make
  Qwen's interleaved mRoPE plain rope), and the attention output is multiplied by ``sigmoid(gate)``.

The file's norms already hold Qwen's ``1 + weight``. Memory: a ``Causal`` cache for attention layers
and a ``Recurrent`` one (convolution inputs and delta-rule states) for the others, in a ``Wrapper``.
Files with a multi-token-prediction block (``nextn_predict_layers``: one more ``blk.N``) load; the
block's weights are checked and stay unused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pyggml import nn
from pyggml.backend import Backend, Context
from pyggml.backend.metadata import MAX_CONTEXT, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH
from pyggml.kvcache import Causal, Recurrent, Wrapper
from pyggml.models import Batch, Model, ModelError, register
from pyggml.tensor import RopeType, Tensor

ATTENTION, RECURRENT, MTP = 0, 1, 2  # a layer's kind (the first two: the Wrapper's cache for it)


@dataclass(frozen=True)
class Options:
    hidden_size: int
    n_layers: int  # blocks in the file, the multi-token-prediction ones included
    n_main: int  # the decoder's blocks
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_size: int
    vocab_size: int | None
    context_length: int
    eps: float
    conv_kernel: int  # the convolution's taps
    state_size: int  # a key head's (and a value head's) size: the delta-rule state is its square
    n_k_heads: int
    n_v_heads: int
    conv_dim: int  # q, k and v together: what the convolution runs over
    layer_kinds: tuple[int, ...]
    rope: nn.Rope

    @classmethod
    def from_config(cls, config, **extra) -> Options:
        arch = config.architecture
        hidden, n_layers, n_heads, n_kv_heads, head_dim = nn.attention_sizes(config)
        n_mtp = config.uint("nextn_predict_layers", 0, max=n_layers - 1)
        n_main = n_layers - n_mtp
        sizes = {key: config.uint(f"ssm.{key}", 0, max=MAX_WIDTH) for key in
                 ("conv_kernel", "state_size", "group_count", "time_step_rank", "inner_size")}
        missing = [f"{arch}.ssm.{key}" for key, size in sizes.items() if not size]
        if missing:
            raise ModelError(f"{arch}: {', '.join(missing)} must be set and non-zero (the Gated DeltaNet layers)")
        state, n_k, n_v = sizes["state_size"], sizes["group_count"], sizes["time_step_rank"]
        if sizes["inner_size"] != n_v * state or n_v % n_k or sizes["conv_kernel"] < 2:
            raise ModelError(f"{arch}: {arch}.ssm.inner_size ({sizes['inner_size']}) must be ssm.time_step_rank "
                             f"({n_v}) value heads of ssm.state_size ({state}), a multiple of ssm.group_count "
                             f"({n_k}) key heads, with ssm.conv_kernel >= 2 (found {sizes['conv_kernel']})")
        recurrent = config.get(f"{arch}.attention.recurrent_layers")
        if recurrent is None:
            interval = config.uint("full_attention_interval", 4, min=1, max=MAX_LAYERS)
            recurrent = [(i + 1) % interval != 0 for i in range(n_main)] + [False] * n_mtp
        if not isinstance(recurrent, list) or len(recurrent) != n_layers or any(recurrent[n_main:]):
            raise ModelError(f"{arch}: {arch}.attention.recurrent_layers must give each of the {n_layers} blocks a "
                             f"bool (the {n_mtp} multi-token-prediction ones false)")
        kinds = tuple(RECURRENT if r else ATTENTION for r in recurrent[:n_main]) + (MTP,) * n_mtp
        return cls(
            hidden_size=hidden, n_layers=n_layers, n_main=n_main, n_heads=n_heads, n_kv_heads=n_kv_heads,
            head_dim=head_dim, ffn_size=config.uint("feed_forward_length", min=1, max=MAX_WIDTH),
            vocab_size=config.uint("vocab_size", 0, max=MAX_VOCAB) or len(config.get("tokenizer.ggml.tokens", ()))
            or None,
            context_length=config.uint("context_length", 262144, min=1, max=MAX_CONTEXT),
            eps=config.float("attention.layer_norm_rms_epsilon", 1e-6, min=0.0, max=1.0),
            conv_kernel=sizes["conv_kernel"], state_size=state, n_k_heads=n_k, n_v_heads=n_v,
            conv_dim=(2 * n_k + n_v) * state, layer_kinds=kinds,
            rope=nn.Rope.from_config(config, config.uint("rope.dimension_count", head_dim, max=head_dim),
                                     RopeType.NEOX), **extra,
        )


# conditions on a layer's kind, for the declarations of the tensors only some layers have
IS_ATTENTION, IS_RECURRENT, IS_MTP = (f"layer_kinds[layer] {op}" for op in (f"!= {RECURRENT}", f"== {RECURRENT}",
                                                                             f"== {MTP}"))


class Bias(nn.Weight):
    suffix = ".bias"  # a tensor with no weight beside it (``blk.N.ssm_dt.bias``)


class GatedAttention(nn.Module):
    attn_q: nn.Linear | None = nn.shape("hidden_size", "2 * n_heads * head_dim", when=IS_ATTENTION)  # query, gate
    attn_k: nn.Linear | None = nn.shape("hidden_size", "n_kv_heads * head_dim", when=IS_ATTENTION)
    attn_v: nn.Linear | None = nn.shape("hidden_size", "n_kv_heads * head_dim", when=IS_ATTENTION)
    attn_q_norm: nn.RMSNorm | None = nn.shape("head_dim", when=IS_ATTENTION)
    attn_k_norm: nn.RMSNorm | None = nn.shape("head_dim", when=IS_ATTENTION)
    attn_output: nn.Linear | None = nn.shape("n_heads * head_dim", "hidden_size", when=IS_ATTENTION)

    def __call__(self, ctx: Context, x: Tensor, positions: Tensor, cache: Wrapper, opts: Options,
                 layer: int) -> Tensor:
        n, d, heads = x.shape[1], opts.head_dim, opts.n_heads
        qg = self.attn_q(x)  # per head: d query values, then d gate values
        q, gate = (qg.view(i * d * qg.strides[0], (d, heads, n), (2 * d * qg.strides[0], qg.strides[1]))
                   for i in (0, 1))
        q = opts.rope(self.attn_q_norm(q, opts.eps), positions)
        k = opts.rope(self.attn_k_norm(self.attn_k(x).reshape(d, opts.n_kv_heads, n), opts.eps), positions)
        v = self.attn_v(x).reshape(d, opts.n_kv_heads, n)
        out = nn.attention(ctx, q, k, v, cache, 1.0 / math.sqrt(d)) * gate.sigmoid().reshape(d * heads, n)
        return nn.tap(f"blk.{layer}.attn_output", self.attn_output(out))


class GatedDeltaNet(nn.Module):
    attn_qkv: nn.Linear | None = nn.shape("hidden_size", "conv_dim", when=IS_RECURRENT)
    attn_gate: nn.Linear | None = nn.shape("hidden_size", "n_v_heads * state_size", when=IS_RECURRENT)  # z
    ssm_conv1d: nn.Weight | None = nn.shape("conv_kernel", "conv_dim", when=IS_RECURRENT)
    ssm_dt: Bias | None = nn.shape("n_v_heads", when=IS_RECURRENT)
    ssm_a: nn.Parameter | None = nn.shape("n_v_heads", when=IS_RECURRENT)  # -exp(A_log)
    ssm_beta: nn.Linear | None = nn.shape("hidden_size", "n_v_heads", when=IS_RECURRENT)
    ssm_alpha: nn.Linear | None = nn.shape("hidden_size", "n_v_heads", when=IS_RECURRENT)
    ssm_norm: nn.RMSNorm | None = nn.shape("state_size", when=IS_RECURRENT)
    ssm_out: nn.Linear | None = nn.shape("n_v_heads * state_size", "hidden_size", when=IS_RECURRENT)

    def __call__(self, ctx: Context, x: Tensor, states: Recurrent, opts: Options, layer: int) -> Tensor:
        n, s, n_k, n_v = x.shape[1], opts.state_size, opts.n_k_heads, opts.n_v_heads
        qkv = states.conv(ctx, self.attn_qkv(x), self.ssm_conv1d.weight).silu()
        beta, alpha = self.beta_alpha(x, opts)  # (n_v, n) each
        beta = beta.sigmoid()  # how strongly each token is learnt
        decay = (alpha + self.ssm_dt.weight).softplus() * self.ssm_a.weight  # (n_v, n), log space
        # the scan runs over each sequence's tokens: the batch laid out as (T, N), padding steps that change nothing
        qkv, steps, seqs = states.by_sequence(ctx, qkv)
        beta, decay = (states.by_sequence(ctx, t, zero_padding=True)[0] for t in (beta, decay))
        grid, head, row = (steps, seqs), s * qkv.strides[0], qkv.strides[1]

        def heads(first: int, count: int) -> Tensor:  # (s, count, T, N): heads first.. of each row of qkv
            return qkv.view(first * head, (s, count, *grid), (head, row, steps * row))

        q, k = (self.key_heads(self._l2_norm(heads(i * n_k, n_k), opts), opts) for i in (0, 1))
        v = heads(2 * n_k, n_v)
        state = states.get_state(ctx, s * s * n_v).reshape(s, s, n_v, seqs)
        out, state = q.gated_delta_net(k, v, decay.reshape(1, n_v, *grid), beta.reshape(1, n_v, *grid), state)
        states.put_state(ctx, state.reshape(s * s * n_v, seqs))
        out = states.by_batch(ctx, out.reshape(s * n_v, steps * seqs)).reshape(s, n_v, n)
        out = self.ssm_norm(out, opts.eps) * self.attn_gate(x).reshape(s, n_v, n).silu()
        return nn.tap(f"blk.{layer}.ssm_out", self.ssm_out(out.reshape(s * n_v, n)))

    def beta_alpha(self, x: Tensor, opts: Options) -> tuple[Tensor, Tensor]:
        """The projections of the learning strength and of the decay, (n_v_heads, n_tokens) each."""
        return self.ssm_beta(x), self.ssm_alpha(x)

    def key_heads(self, x: Tensor, opts: Options) -> Tensor:
        """Query or key heads as the scan reads them: value head h reads key head ``h % n_k_heads``."""
        return x

    @staticmethod
    def _l2_norm(x: Tensor, opts: Options) -> Tensor:
        """x / sqrt(sum(x^2) + eps) per head (as llama.cpp computes it, through an RMS norm)."""
        return x.rms_norm(opts.eps / x.shape[0]).scale(1.0 / math.sqrt(x.shape[0]))


class MLP(nn.Module):
    ffn_gate: nn.Linear = nn.shape("hidden_size", "ffn_size")
    ffn_up: nn.Linear = nn.shape("hidden_size", "ffn_size")
    ffn_down: nn.Linear = nn.shape("ffn_size", "hidden_size")

    def __call__(self, x: Tensor, opts: Options, layer: int) -> Tensor:
        return self.ffn_down(self.ffn_gate(x).silu(self.ffn_up(x)))


class NextN(nn.Module):
    """The multi-token-prediction block's own weights (``blk.N.nextn.*``, checked and unused)."""

    nested = True
    eh_proj: nn.Linear | None = nn.shape("2 * hidden_size", "hidden_size", when=IS_MTP)
    enorm: nn.RMSNorm | None = nn.shape("hidden_size", when=IS_MTP)
    hnorm: nn.RMSNorm | None = nn.shape("hidden_size", when=IS_MTP)
    embed_tokens: nn.Embedding | None = nn.shape("hidden_size", "vocab_size")
    shared_head_head: nn.Linear | None = nn.shape("hidden_size", "vocab_size")
    shared_head_norm: nn.RMSNorm | None = nn.shape("hidden_size")


class Layer(nn.Module):
    attn_norm: nn.RMSNorm = nn.shape("hidden_size")
    attention: GatedAttention
    delta_net: GatedDeltaNet
    post_attention_norm: nn.RMSNorm = nn.shape("hidden_size")
    mlp: MLP
    nextn: NextN

    def __call__(self, ctx: Context, h: Tensor, positions: Tensor, outputs: Tensor | None, cache: Wrapper,
                 states: Recurrent, opts: Options, layer: int) -> Tensor:
        x = self.attn_norm(h, opts.eps)
        if opts.layer_kinds[layer] == RECURRENT:
            x = self.delta_net(ctx, x, states, opts, layer)
        else:
            x = self.attention(ctx, x, positions, cache, opts, layer)
        x, h = nn.output_rows(outputs, x, h)
        h = h + x
        return h + self.mlp(self.post_attention_norm(h, opts.eps), opts, layer)


class Weights(nn.Module):
    token_embd: nn.Embedding = nn.shape("hidden_size", "vocab_size")
    blk: list[Layer]
    output_norm: nn.RMSNorm = nn.shape("hidden_size")
    output: nn.Linear = nn.shape("hidden_size", "vocab_size", alt="token_embd")


@register("qwen35")
class Qwen35(Model):
    Options, Weights = Options, Weights

    def __init__(self, backend: Backend):
        self.backend = backend
        self.options = o = self.Options.from_config(backend.config, **self.layout(backend))
        self.weights: Weights = nn.load(self.Weights, backend, o)
        self.states = Recurrent()
        self.cache = Wrapper(Causal(self.shift), self.states, layer_types=o.layer_kinds[:o.n_main])

    @staticmethod
    def layout(backend: Backend) -> dict:
        """Options that the file's tensors decide rather than its keys."""
        return {}

    def forward(self, ctx: Context, batch: Batch) -> Tensor:
        w, o = self.weights, self.options
        inputs = nn.batch_inputs(ctx, batch)
        h = nn.tap("token_embd", w.token_embd(inputs.tokens))
        for i, layer, rows in nn.layers(w.blk[:o.n_main], self.cache, inputs.outputs):  # not the MTP layers
            h = nn.tap(f"blk.{i}", layer(ctx, h, inputs.positions, rows, self.cache, self.states, o, i))
        return nn.tap("output", w.output(nn.tap("output_norm", w.output_norm(h, o.eps))))

    def shift(self, ctx: Context, layer: int, key: Tensor, shift: Tensor) -> Tensor:
        return self.options.rope(key, shift)
