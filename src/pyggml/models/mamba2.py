"""The Mamba-2 mixer of the Mamba-2 hybrids (``granitehybrid``: Granite 4.0; ``nemotron_h``: Nemotron-H):
a shared building block, not an architecture (as ``pooling.py`` is for the embedding models).

``ssm_in`` makes the gate z, the scan's input x with its B and C (one pair per group of heads), and a
time step per head; x, B, C go through a causal depthwise convolution of ``ssm.conv_kernel`` taps
(+ bias, SiLU); the selective scan (``Tensor.ssm_scan``: per head, a (head_dim, d_state) state decaying
by exp(softplus(dt) * A)) gives y; y + D x, gated by SiLU(z), RMS-normed per group (``ssm_norm``), then
``ssm_out``. The state lives in a ``Recurrent`` cache (per sequence, the last ``conv_kernel - 1`` inputs
of the convolution and the scan state); the scan runs over the batch laid out per sequence
(``Recurrent.by_sequence``), so sequences may have any number of rows in a batch; padded steps have a
time step of -inf (softplus 0: no change).
"""

from __future__ import annotations

from dataclasses import dataclass

from pyggml import nn
from pyggml.backend import Context
from pyggml.backend.metadata import MAX_WIDTH
from pyggml.kvcache import Recurrent
from pyggml.models import ModelError
from pyggml.tensor import Tensor

ATTENTION, SSM = 0, 1  # a layer's kind: the Wrapper's cache for it
_PADDING_DT = -1e30  # a padded scan step's time step: softplus gives 0, so the state stays as it is


@dataclass(frozen=True)
class Mamba2Options:
    """The Mamba-2 mixer's sizes (GGUF ``ssm.*``)."""

    ssm_conv_kernel: int  # the convolution's taps
    ssm_inner: int  # d_inner: ssm_heads * ssm_head_dim
    ssm_state: int  # d_state
    ssm_heads: int  # ``ssm.time_step_rank``: one time step (and A, D) per head
    ssm_groups: int  # B and C per group of heads

    @property
    def ssm_head_dim(self) -> int:
        return self.ssm_inner // self.ssm_heads

    @property
    def ssm_conv_dim(self) -> int:  # x, B and C: what the convolution sees
        return self.ssm_inner + 2 * self.ssm_groups * self.ssm_state

    @property
    def ssm_in_size(self) -> int:  # z, x, B, C, dt
        return 2 * self.ssm_inner + 2 * self.ssm_groups * self.ssm_state + self.ssm_heads

    @property
    def ssm_group_size(self) -> int:
        return self.ssm_inner // self.ssm_groups

    @staticmethod
    def read(config, recurrent: bool) -> dict:
        """The ``ssm.*`` keys, checked; zeros when no layer is recurrent."""
        arch = config.architecture
        keys = {"ssm_conv_kernel": "ssm.conv_kernel", "ssm_inner": "ssm.inner_size", "ssm_state": "ssm.state_size",
                "ssm_heads": "ssm.time_step_rank", "ssm_groups": "ssm.group_count"}
        values = {field: config.uint(key, 0, max=MAX_WIDTH) for field, key in keys.items()}
        if not recurrent:
            return values
        missing = [f"{arch}.{keys[f]}" for f, v in values.items() if not v]
        if missing:
            raise ModelError(f"{arch}: {', '.join(missing)} must be set and non-zero for the Mamba-2 layers")
        if values["ssm_conv_kernel"] < 2:
            raise ModelError(f"{arch}: {arch}.ssm.conv_kernel must be >= 2 (the convolution's taps)")
        inner, heads, groups = values["ssm_inner"], values["ssm_heads"], values["ssm_groups"]
        if inner % heads or heads % groups:
            raise ModelError(f"{arch}: {arch}.ssm.inner_size ({inner}) must be a multiple of {arch}.ssm.time_step_rank "
                             f"({heads} heads), and that of {arch}.ssm.group_count ({groups})")
        return values


_IS_SSM = f"layer_kinds[layer] == {SSM}"


class Bias(nn.Weight):
    suffix = ".bias"  # a tensor with no weight beside it (``blk.N.ssm_dt.bias``)


class Conv(nn.Module):
    """A depthwise convolution kernel (taps, dim) and its bias (dim,)."""

    leaf = True

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        self.weight, self.bias = weight, bias


class Mamba2(nn.Module):
    """The Mamba-2 mixer (tensors ``blk.N.ssm_*``)."""

    ssm_in: nn.Linear | None = nn.shape("hidden_size", "ssm_in_size", when=_IS_SSM)
    # the bias is required: llama.cpp adds it unchecked (a file without one crashes there)
    ssm_conv1d: Conv | None = nn.shape("ssm_conv_kernel", "ssm_conv_dim", bias=True, when=_IS_SSM)
    ssm_dt: Bias | None = nn.shape("ssm_heads", when=_IS_SSM)
    ssm_a: nn.Parameter | None = nn.shape(1, "ssm_heads", when=_IS_SSM)
    ssm_d: nn.Parameter | None = nn.shape(1, "ssm_heads", when=_IS_SSM)
    ssm_norm: nn.RMSNorm | None = nn.shape("ssm_group_size", "ssm_groups", when=_IS_SSM)
    ssm_out: nn.Linear | None = nn.shape("ssm_inner", "hidden_size", when=_IS_SSM)

    def __call__(self, ctx: Context, x: Tensor, states: Recurrent, o: Mamba2Options, eps: float,
                 layer: int) -> Tensor:
        n, inner, conv_dim, heads, head_dim = x.shape[1], o.ssm_inner, o.ssm_conv_dim, o.ssm_heads, o.ssm_head_dim
        zxbcdt = nn.tap(f"blk.{layer}.ssm_in", self.ssm_in(x))  # (z, x B C, dt) per token
        row, width = zxbcdt.strides[1], zxbcdt.dtype.row_bytes(1)

        def rows(start: int, size: int) -> Tensor:
            return zxbcdt.view(start * width, (size, n), (row,))

        xbc = (states.conv(ctx, rows(inner, conv_dim), self.ssm_conv1d.weight) + self.ssm_conv1d.bias).silu()
        dt = rows(inner + conv_dim, heads) + self.ssm_dt.weight
        # per sequence: x B C, dt, and a 1 marking the real steps (padding rows are all zero)
        ones = dt.view(0, (1, n), (dt.strides[1],)).contiguous().scale_bias(0.0, 1.0)
        table = xbc.concat(dt, 0).concat(ones, 0)
        grid, steps, seqs = states.by_sequence(ctx, table, zero_padding=True)
        g_row, f = grid.strides[1], grid.dtype.row_bytes(1)
        xs = grid.view(0, (head_dim, heads, steps, seqs), (head_dim * f, g_row, g_row * steps))
        b, c = (grid.view((inner + i * o.ssm_groups * o.ssm_state) * f, (o.ssm_state, o.ssm_groups, steps, seqs),
                          (o.ssm_state * f, g_row, g_row * steps)) for i in (0, 1))
        real = grid.view((conv_dim + heads) * f, (1, steps * seqs), (g_row,))
        dt = grid.view(conv_dim * f, (heads, steps * seqs), (g_row,)) + \
            real.contiguous().scale_bias(-_PADDING_DT, _PADDING_DT)
        size = o.ssm_state * head_dim * heads
        store, units = states.state_store(ctx, size)
        y, last = xs.ssm_scan(dt.reshape(heads, steps, seqs), self.ssm_a.weight, b, c,
                              store.reshape(o.ssm_state, head_dim, heads, store.shape[1], ctx=ctx), units)
        states.put_state(ctx, last.reshape(size, seqs))
        y = states.by_batch(ctx, y.reshape(inner, steps * seqs))  # (inner, n) in batch order
        skip = xbc.view(0, (head_dim, heads, n), (head_dim * f, xbc.strides[1])) * self.ssm_d.weight
        y = rows(0, inner).contiguous().silu(y + skip.reshape(inner, n))  # gated by SiLU(z)
        y = self.ssm_norm(y.reshape(o.ssm_group_size, o.ssm_groups, n), eps).reshape(inner, n)
        return nn.tap(f"blk.{layer}.ssm_out", self.ssm_out(y))
