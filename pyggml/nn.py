"""Building blocks for model files: weight-holding modules, the weight loader, rope and attention.

Model files declare weights as annotated fields named exactly like the GGUF tensors::

    class Layer(nn.Module):
        attn_norm: nn.RMSNorm            # loads blk.N.attn_norm.weight
        attn: SelfAttention              # a non-leaf module: its fields share the layer's prefix
        ffn_up: nn.Linear                # blk.N.ffn_up.weight (+ .bias when present)
        attn_q_norm: nn.RMSNorm | None   # optional: None when the file has no such tensor

    class Model(nn.Module):
        token_embd: nn.Embedding
        blk: list[Layer]                 # blk.0., blk.1., ... up to config block_count
        output: nn.Linear = nn.alt("token_embd")   # tied embeddings when output.weight is absent

``nn.load(Model, backend)`` fills them in and reports every missing tensor at once.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Union

import numpy as np

from pyggml.backend import MAX_CONTEXT
from pyggml.tensor import _NO_TO_FLOAT, _NOT_MATMUL, DType, RopeType, Tensor

if typing.TYPE_CHECKING:
    from pyggml.backend import Backend, Context
    from pyggml.kvcache import Cache


class MissingWeightsError(ValueError):
    """Required tensors are absent from the GGUF file."""


class Module:
    """Base of everything that holds weights. Leaf modules read ``<prefix>.weight`` / ``.bias``."""

    leaf: ClassVar[bool] = False


class Weight(Module):
    """A bare tensor (e.g. ``rope_freqs.weight``)."""

    leaf = True

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        self.weight = weight


def _check_type(weight: Tensor | None, ok: bool, use: str) -> None:
    """Refuse at load a weight stored in a type ggml has no kernel for in this use (it would fail, or for
    some types crash, on the first request)."""
    if weight is not None and not ok:
        from pyggml.models import ModelError

        raise ModelError(f"weight {weight.name!r} is stored as {weight.dtype.name}, which ggml cannot use as {use}")


class Linear(Module):
    leaf = True

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        _check_type(weight, weight.dtype not in _NOT_MATMUL, "a matrix-product weight")
        _check_type(bias, bias is None or bias.dtype == DType.F32, "a bias (F32 only)")
        self.weight = weight
        self.bias = bias

    def __call__(self, x: Tensor) -> Tensor:
        y = self.weight.mulmat(x)
        return y if self.bias is None else y + self.bias


class Embedding(Module):
    leaf = True

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        _check_type(weight, weight.dtype in (DType.F32, DType.F16, DType.BF16) or (
            weight.dtype.is_quantized and weight.dtype not in _NO_TO_FLOAT), "an embedding table")
        self.weight = weight

    def __call__(self, ids: Tensor) -> Tensor:
        return self.weight.rows(ids)


class RMSNorm(Module):
    leaf = True

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        _check_type(weight, weight.dtype == DType.F32, "a norm weight (F32 only)")
        self.weight = weight

    def __call__(self, x: Tensor, eps: float) -> Tensor:
        return x.rms_norm(eps, self.weight)


class LayerNorm(Module):
    leaf = True

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        _check_type(weight, weight.dtype == DType.F32, "a norm weight (F32 only)")
        _check_type(bias, bias is None or bias.dtype == DType.F32, "a norm bias (F32 only)")
        self.weight = weight
        self.bias = bias

    def __call__(self, x: Tensor, eps: float) -> Tensor:
        return x.norm(eps, self.weight, self.bias)


@dataclass(frozen=True)
class _Alt:
    name: str


def alt(name: str) -> Any:
    """Field default: load this other tensor when the field's own is absent (tied weights)."""
    return _Alt(name)


# ---- the loader ---------------------------------------------------------------------------------
def load(cls: type, backend: Backend, n_layers: int | None = None) -> Any:
    """Build ``cls`` with its declared weights taken from ``backend`` by GGUF name."""
    missing: list[str] = []
    layers = n_layers if n_layers is not None else backend.config.uint("block_count", 0)
    module = _build(cls, "", backend, layers, missing)
    if missing:
        raise MissingWeightsError(f"{backend.path}: missing tensors: {', '.join(missing)}")
    return module


def _unwrap(hint: Any) -> tuple[Any, bool]:
    """(type, optional) of an annotation such as ``nn.Linear | None``."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(hint))
    return hint, False


def _build(cls: type, prefix: str, backend: Backend, n_layers: int, missing: list[str]) -> Any:
    obj = cls.__new__(cls)
    for field, hint in typing.get_type_hints(cls).items():
        if typing.get_origin(hint) is ClassVar:
            continue
        kind, optional = _unwrap(hint)
        default = cls.__dict__.get(field)
        if typing.get_origin(kind) is list:
            (item,) = typing.get_args(kind)
            value = [_build(item, f"{prefix}{field}.{i}.", backend, n_layers, missing) for i in range(n_layers)]
        elif isinstance(kind, type) and issubclass(kind, Module) and kind.leaf:
            value = _leaf(kind, f"{prefix}{field}", backend, optional, default, missing)
        elif isinstance(kind, type) and issubclass(kind, Module):
            value = _build(kind, prefix, backend, n_layers, missing)  # inline: same prefix
        else:
            continue  # not a weight (hyper-parameters and the like are set by the model)
        setattr(obj, field, value)
    return obj


def _leaf(kind: type, name: str, backend: Backend, optional: bool, default: Any, missing: list[str]) -> Any:
    weight = backend.get(f"{name}.weight")
    if weight is None and isinstance(default, _Alt):
        weight = backend.get(f"{default.name}.weight")
        if weight is not None and kind is Linear:  # e.g. tied output embeddings: a fast mulmat layout
            weight = backend.matmul_weight(weight)
    if weight is None:
        if not optional:
            missing.append(f"{name}.weight")
        return None
    return kind(weight, backend.get(f"{name}.bias"))


# ---- rope -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rope:
    """Rotary embedding settings, usually read from GGUF ``rope.*`` keys by ``Rope.from_config``."""

    n_dims: int
    base: float = 10000.0
    freq_scale: float = 1.0
    mode: RopeType = RopeType.NORMAL
    n_ctx_orig: int = 0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    @classmethod
    def from_config(cls, config: Any, n_dims: int, mode: RopeType = RopeType.NORMAL) -> Rope:
        kind = config.string("rope.scaling.type", "") or ""
        factor = config.float("rope.scaling.factor", 0.0, min=0.0, max=1e6) or 0.0
        if kind not in ("", "none", "linear", "yarn", "llama3"):  # llama3 scales through rope_freqs.weight
            raise ValueError(f"unsupported rope scaling type {kind!r}")
        freq_scale = 1.0 / factor if factor > 0 and kind in ("linear", "yarn") else 1.0
        if config.float("rope.scale_linear", 0.0, min=0.0, max=1e6):
            freq_scale = 1.0 / config.float("rope.scale_linear")
        yarn = kind == "yarn"
        return cls(
            n_dims=n_dims,
            base=config.float("rope.freq_base", 10000.0, min=1.0, max=1e12),
            freq_scale=freq_scale,
            mode=mode,
            n_ctx_orig=(config.uint("rope.scaling.original_context_length", 0, max=MAX_CONTEXT)
                        or config.uint("context_length", 0, max=MAX_CONTEXT)),
            ext_factor=config.float("rope.scaling.yarn_ext_factor", 1.0 if yarn else 0.0, min=-1e6, max=1e6),
            attn_factor=config.float("rope.scaling.yarn_attn_factor", 1.0, min=-1e6, max=1e6) or 1.0,
            beta_fast=config.float("rope.scaling.yarn_beta_fast", 32.0, min=-1e6, max=1e6) or 32.0,
            beta_slow=config.float("rope.scaling.yarn_beta_slow", 1.0, min=-1e6, max=1e6) or 1.0,
        )

    def __call__(self, x: Tensor, positions: Tensor, freq_factors: Tensor | None = None) -> Tensor:
        """Rotate ``x`` (head_dim, n_heads, n_tokens) by ``positions`` (n_tokens,)."""
        return x.rope(positions, self.n_dims, self.base, self.freq_scale, mode=self.mode,
                      freq_factors=freq_factors, n_ctx_orig=self.n_ctx_orig, ext_factor=self.ext_factor,
                      attn_factor=self.attn_factor, beta_fast=self.beta_fast, beta_slow=self.beta_slow)


# ---- attention --------------------------------------------------------------------------------
def attention(ctx: Context, query: Tensor, key: Tensor, value: Tensor, cache: Cache | None, scale: float, *,
              flash: bool | None = None, mask: Tensor | None = None) -> Tensor:
    """Multi-head attention with GQA. ``query`` is (head_dim, n_heads, n_tokens), ``key`` and
    ``value`` (head_dim, n_kv_heads, n_tokens). With a cache, the new keys/values are stored and
    attention runs over the cached history with the cache's mask; without one, every token sees
    every other (encoders), or those ``mask`` (n_tokens, n_tokens; 0 or -inf) lets it see (several
    sequences in one encoder batch). Returns (head_dim_v * n_heads, n_tokens)."""
    if cache is not None:
        if mask is not None:
            raise ValueError("attention: a mask is only for attention without a cache (the cache has its own)")
        cache.put(ctx, key, value)
        key, value, mask = cache.get(ctx)
    else:
        key, value = key.permute(0, 2, 1, 3), value.permute(0, 2, 1, 3)
    if flash is None:
        flash = ctx.backend.flash_attention
    q = query.permute(0, 2, 1, 3)  # (head_dim, n_tokens, n_heads)
    out = q.scaled_dot_product_attention(key, value, mask, scale, flash=flash)
    d_v, n_heads, n_tokens = out.shape[0], out.shape[1], out.shape[2]
    return out.reshape(d_v * n_heads, n_tokens)


def int32_input(ctx: Context, values: Any, name: str | None = None) -> Tensor:
    """A 1-d I32 graph input (``name``: refillable with ``ctx.set_input`` for graph reuse)."""
    return ctx.from_numpy(np.asarray(values, dtype=np.int32).reshape(-1), DType.I32, name=name)
