"""Building blocks for model files: weight-holding modules, the weight loader, rope and attention.

Model files declare weights as annotated fields named exactly like the GGUF tensors, each with its
shape (ggml order) in the names of the model's hyper-parameters (its Options)::

    class Layer(nn.Module):
        attn_norm: nn.RMSNorm = nn.shape("hidden_size")                # blk.N.attn_norm.weight
        attn: SelfAttention                    # a non-leaf module: its fields share the layer's prefix
        ffn_up: nn.Linear = nn.shape("hidden_size", "ffn_size")        # (in, out); + .bias when present
        attn_q_norm: nn.RMSNorm | None = nn.shape("head_dim")          # optional: None when absent

    class Weights(nn.Module):
        token_embd: nn.Embedding = nn.shape("hidden_size", "vocab_size")
        blk: list[Layer]                       # blk.0., blk.1., ... up to Options.n_layers
        output: nn.Linear = nn.shape("hidden_size", "vocab_size", alt="token_embd")  # tied when absent

``nn.load(Weights, backend, options)`` fills them in and reports every missing tensor and every
wrong shape at once; ``nn.declared(Weights, options)`` lists them for ``pyggml.synthetic``.
"""

from __future__ import annotations

import ast
import math
import operator
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, ClassVar, Union

import numpy as np

from pyggml.backend.metadata import MAX_CONTEXT
from pyggml.tensor import _NO_TO_FLOAT, _NOT_MATMUL, DType, RopeType, Tensor

if typing.TYPE_CHECKING:
    from pyggml.backend import Backend, Context
    from pyggml.input import Batch
    from pyggml.kvcache import Cache, KVGroup


class ModelError(ValueError):
    """A model file that pyggml cannot run: unknown architecture, bad hyper-parameters, wrong shapes."""


class MissingWeightsError(ModelError):
    """Required tensors are absent from the GGUF file."""


class Module:
    """Base of everything that holds weights. Leaf modules read ``<prefix>.weight`` / ``.bias``."""

    leaf: ClassVar[bool] = False
    suffix: ClassVar[str] = ".weight"  # a leaf's tensor is named ``<prefix><suffix>``
    # a non-leaf's fields are named under ``<prefix><field>.`` (True) or ``<prefix><nested>.`` (a name); else inlined
    nested: ClassVar[bool | str] = False


class Weight(Module):
    """A bare tensor (e.g. ``rope_freqs.weight``)."""

    leaf = True

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        self.weight = weight


class Parameter(Weight):
    """A tensor named without the ``.weight`` suffix (Ollama's ``v.class_embd``, ``blk.N.cross_attn_attn_gate``)."""

    suffix = ""


def _check_type(weight: Tensor | None, ok: bool, use: str) -> None:
    """Refuse at load a weight stored in a type ggml has no kernel for in this use (it would fail, or for
    some types crash, on the first request)."""
    if weight is not None and not ok:
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


class Experts(Module):
    """A mixture of experts' stacked matrices, weight (in, out, n_experts) and optional per-expert
    bias (out, n_experts) (GGUF ``ffn_*_exps``): each token through the experts chosen for it."""

    leaf = True

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        self.weight = weight
        self.bias = bias

    def __call__(self, x: Tensor, chosen: Tensor) -> Tensor:
        """``x`` (in, n_tokens), or (in, n_used, n_tokens) per chosen expert; ``chosen`` I32
        (n_used, n_tokens) expert ids. Returns (out, n_used, n_tokens); unchosen experts cost nothing."""
        if len(x.shape) == 2:
            x = x.reshape(x.shape[0], 1, x.shape[1])
        y = self.weight.mulmat_id(x, chosen)
        return y if self.bias is None else y.add_id(self.bias, chosen)


# ---- shape declarations ----------------------------------------------------------------------
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Mod: operator.mod}
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge}
_NODES = (ast.Name, ast.Attribute, ast.Subscript, ast.Load, ast.BinOp, ast.Compare, ast.BoolOp, ast.And, ast.Or,
          ast.UnaryOp, ast.Not, *_BINARY, *_COMPARE)


@dataclass(frozen=True)
class Expr:
    """An expression over hyper-parameter names: a dimension (``"n_heads * head_dim"``,
    ``"rope.n_dims // 2"``, ``"ffn_size[layer]"``) or a condition (``"layer % 2 == 1"``);
    ``layer`` is the block index. Integers, names, attributes, indexing, + - * // %, comparisons,
    and/or/not; nothing else parses."""

    text: str
    tree: ast.expr

    @classmethod
    def parse(cls, text: str | int) -> Expr:
        text = str(text)
        tree = ast.parse(text, mode="eval").body
        for node in ast.walk(tree):
            if not (isinstance(node, _NODES) or (isinstance(node, ast.Constant) and type(node.value) is int)):
                raise ValueError(f"nn.shape: {text!r} is not an integer expression of hyper-parameter names")
        return cls(text, tree)

    def evaluate(self, lookup: typing.Callable[[str], Any], layer: int | None) -> Any:
        """The value, or None when a hyper-parameter it uses is unknown (None)."""

        def value(node: ast.expr) -> Any:
            if isinstance(node, ast.Constant):
                return node.value
            if isinstance(node, ast.Name):
                return layer if node.id == "layer" else lookup(node.id)
            if isinstance(node, ast.Attribute):
                owner = value(node.value)
                return None if owner is None else getattr(owner, node.attr)
            if isinstance(node, ast.Subscript):
                owner, index = value(node.value), value(node.slice)
                return None if owner is None or index is None else owner[index]
            if isinstance(node, ast.BoolOp):
                values = [value(v) for v in node.values]
                return None if None in values else (all if isinstance(node.op, ast.And) else any)(values)
            if isinstance(node, ast.UnaryOp):
                operand = value(node.operand)
                return None if operand is None else not operand
            if isinstance(node, ast.Compare):
                items = [value(node.left), *(value(c) for c in node.comparators)]
                if None in items:
                    return None
                return all(_COMPARE[type(op)](a, b) for op, a, b in zip(node.ops, items, items[1:], strict=False))
            assert isinstance(node, ast.BinOp)
            left, right = value(node.left), value(node.right)
            return None if left is None or right is None else _BINARY[type(node.op)](left, right)

        return value(self.tree)

    def size(self, lookup: typing.Callable[[str], Any], layer: int | None) -> int | None:
        result = self.evaluate(lookup, layer)
        if result is not None and (not isinstance(result, int) or isinstance(result, bool)):
            raise TypeError(f"nn.shape: {self.text!r} is {result!r}, not an integer")
        return result


@dataclass(frozen=True)
class Spec:
    """What a field's default declares: the weight's ``shape`` (None: undeclared, not checked),
    an ``alt`` tensor to load when the field's own is absent, whether a ``bias`` is part of it, and
    for an optional field ``when`` it is present."""

    shape: tuple[Expr, ...] | None = None
    alt: str | None = None
    bias: bool = False
    when: Expr | None = None


def shape(*dims: str | int, alt: str | None = None, bias: bool = False, when: str | None = None) -> Any:
    """Field default: the shape of the field's ``.weight`` in ggml order (innermost first), each
    dimension an expression of hyper-parameter names read from the model's Options::

        attn_q: nn.Linear = nn.shape("hidden_size", "n_heads * head_dim")   # Linear: (in, out)
        token_embd: nn.Embedding = nn.shape("hidden_size", "vocab_size")     # Embedding: (dim, rows)
        attn_norm: nn.RMSNorm = nn.shape("hidden_size")                      # norms: (dim,)

    ``bias=True``: the architecture has a ``.bias`` too, of the weight's shape without its first
    (input) dimension: (out,) for a Linear, (dim,) for a norm, (out, n_experts) for stacked experts; required and
    written by ``pyggml.synthetic``; without it a bias present in the file is still loaded and checked.
    ``alt``: load that tensor when the field's own is absent (tied output embeddings).
    ``when`` (optional fields): a condition under which the tensor is required (and written by
    ``pyggml.synthetic``), e.g. ``"n_token_types"`` or ``"layer % moe_every == 0"``; otherwise, and
    without ``when``, an optional tensor is loaded when the file has it."""
    return Spec(tuple(Expr.parse(d) for d in dims), alt, bias, None if when is None else Expr.parse(when))


def alt(name: str) -> Any:
    """Field default: load this other tensor when the field's own is absent (tied weights); the
    shape is not declared (``nn.shape(..., alt=name)`` declares both)."""
    return Spec(alt=name)


@dataclass(frozen=True)
class TensorDecl:
    """A tensor as the declarations describe it for given hyper-parameters (``pyggml.synthetic``)."""

    name: str  # GGUF name, e.g. "blk.0.attn_q.weight"
    shape: tuple[int, ...]  # ggml order
    module: type[Module]  # the leaf type that holds it (Linear, RMSNorm, ...)
    required: bool  # the file must have it (optional fields: when their ``when`` holds)


def declared(cls: type, hparams: Any, n_layers: int | None = None) -> list[TensorDecl]:
    """Every tensor of ``cls`` (an nn.Module tree) whose shape is declared, sized from
    ``hparams`` (the model's Options, or a mapping); raises ValueError for a required tensor of
    unknown size (an optional one is left out)."""
    n = _layer_count(hparams, n_layers, None)
    out: list[TensorDecl] = []

    def visit(kind: type, name: str, optional: bool, spec: Spec, layer: int | None) -> None:
        if spec.shape is None:
            return

        def lookup(key: str) -> Any:
            return _hparam(hparams, key, cls)

        required = _required(optional, spec, lookup, layer)
        sizes = tuple(d.size(lookup, layer) for d in spec.shape)
        if any(s is None for s in sizes):
            if not required:
                return
            unknown = [d.text for d, s in zip(spec.shape, sizes, strict=True) if s is None]
            raise ValueError(f"{name}.weight: the size of {', '.join(unknown)} is unknown; set it")
        out.append(TensorDecl(f"{name}{kind.suffix}", sizes, kind, required))
        if spec.bias:
            out.append(TensorDecl(f"{name}.bias", _bias_dims(sizes), kind, required))

    _walk(cls, "", n, None, visit)
    return out


# ---- the loader ---------------------------------------------------------------------------------
def load(cls: type, backend: Backend, hparams: Any = None, n_layers: int | None = None) -> Any:
    """Build ``cls`` with its declared weights taken from ``backend`` by GGUF name, checking each
    declared shape against ``hparams`` (the model's Options). Raises ``MissingWeightsError`` or
    ``ModelError`` listing every missing tensor and every wrong shape at once."""
    layers = _layer_count(hparams, n_layers, backend)
    check = _Check(hparams, cls)
    module = _build(cls, backend, layers, check)
    problems = []
    if check.missing:
        problems.append(f"missing tensors: {', '.join(check.missing)}")
    if check.wrong:
        problems.append("wrong shapes for the file's hyper-parameters: " + "; ".join(check.wrong))
    if problems:
        error = MissingWeightsError if check.missing else ModelError
        raise error(f"{backend.path}: " + ". ".join(problems))
    return module


class Prefixed:
    """A backend whose tensor names are read under a prefix (``v.``, ``mm.``): loads a part of a file."""

    def __init__(self, backend: Any, prefix: str):
        self._backend, self._prefix = backend, prefix
        self.config, self.path = backend.config, backend.path

    def get(self, name: str) -> Tensor | None:
        return self._backend.get(self._prefix + name)

    def matmul_weight(self, weight: Tensor) -> Tensor:
        return self._backend.matmul_weight(weight)


def _layer_count(hparams: Any, n_layers: int | None, backend: Backend | None) -> int:
    if n_layers is not None:
        return n_layers
    if isinstance(hparams, Mapping) and "n_layers" in hparams:
        return int(hparams["n_layers"])
    if hparams is not None and hasattr(hparams, "n_layers"):
        return int(hparams.n_layers)
    return backend.config.uint("block_count", 0) if backend is not None else 0


def _hparam(hparams: Any, key: str, cls: type) -> Any:
    """A hyper-parameter by name; a declaration naming one that does not exist is a bug in the model file."""
    if isinstance(hparams, Mapping):
        if key in hparams:
            return hparams[key]
    elif hparams is not None and hasattr(hparams, key):
        return getattr(hparams, key)
    raise TypeError(f"{cls.__name__}: a declared shape names {key!r}, which "
                    f"{type(hparams).__name__ if hparams is not None else 'no hyper-parameters'} has")


class _Check:
    """Shape checking state of one load: the problems found, and sizes bound from the file for
    hyper-parameters that are unknown (None) in the Options, e.g. a vocabulary size not in the metadata."""

    def __init__(self, hparams: Any, cls: type):
        self.hparams, self.cls = hparams, cls
        self.bound: dict[str, int] = {}
        self.missing: list[str] = []
        self.wrong: list[str] = []

    def lookup(self, key: str) -> Any:
        return self.bound[key] if key in self.bound else _hparam(self.hparams, key, self.cls)

    def shape(self, name: str, tensor: Tensor, dims: tuple[Expr, ...], layer: int | None) -> None:
        if self.hparams is None:
            return
        actual = tuple(tensor.shape) + (1,) * (len(dims) - len(tensor.shape))
        expected = []
        for dim, size in zip(dims, actual, strict=False):
            value = dim.size(self.lookup, layer)
            if value is None and isinstance(dim.tree, ast.Name):  # unknown: the file says
                self.bound[dim.text] = value = size
            expected.append(size if value is None else value)
        if actual != tuple(expected):
            self.wrong.append(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(expected)} = "
                              f"({', '.join(d.text for d in dims)})")


def _bias_dims(dims: tuple) -> tuple:
    """A bias's dimensions from its weight's: all but the input dimension (a 1-d weight: the same;
    stacked experts (in, out, n): (out, n); a 2-d convolution kernel (kw, kh, in, out): (out,))."""
    if len(dims) == 4:
        return dims[3:]
    return dims[1:] if len(dims) > 1 else dims


def _required(optional: bool, spec: Spec, lookup: typing.Callable[[str], Any], layer: int | None) -> bool:
    """Whether a field's tensor must be in the file: not optional, or optional ``when`` its condition holds."""
    return not optional or (spec.when is not None and bool(spec.when.evaluate(lookup, layer)))


def _unwrap(hint: Any) -> tuple[Any, bool]:
    """(type, optional) of an annotation such as ``nn.Linear | None``."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(hint))
    return hint, False


def _walk(cls: type, prefix: str, n_layers: int, layer: int | None,
          leaf: typing.Callable[[type, str, bool, Spec, int | None], Any]) -> Any:
    """Build ``cls``: each leaf field's value is ``leaf(kind, gguf_name, optional, spec, layer)``;
    ``list[X]`` fields repeat X per layer under ``<field>.<i>.``, other modules share the prefix (``nested``
    ones: under ``<field>.`` or their ``nested`` name)."""
    obj = cls.__new__(cls)
    for field, hint in typing.get_type_hints(cls).items():
        if typing.get_origin(hint) is ClassVar:
            continue
        kind, optional = _unwrap(hint)
        spec = getattr(cls, field, None)  # a subclass inherits its bases' declarations
        spec = spec if isinstance(spec, Spec) else Spec()
        if typing.get_origin(kind) is list:
            (item,) = typing.get_args(kind)
            value = [_walk(item, f"{prefix}{field}.{i}.", n_layers, i, leaf) for i in range(n_layers)]
        elif isinstance(kind, type) and issubclass(kind, Module) and kind.leaf:
            value = leaf(kind, f"{prefix}{field}", optional, spec, layer)
        elif isinstance(kind, type) and issubclass(kind, Module):
            name = kind.nested if isinstance(kind.nested, str) else field
            value = _walk(kind, f"{prefix}{name}." if kind.nested else prefix, n_layers, layer, leaf)
        else:
            continue  # not a weight (hyper-parameters and the like are set by the model)
        setattr(obj, field, value)
    return obj


def _build(cls: type, backend: Backend, n_layers: int, check: _Check) -> Any:
    def leaf(kind: type, name: str, optional: bool, spec: Spec, layer: int | None) -> Any:
        optional = not _required(optional, spec, check.lookup, layer) if check.hparams is not None else optional
        source, suffix = name, kind.suffix
        weight = backend.get(f"{name}{suffix}")
        if weight is None and spec.alt is not None:
            source = spec.alt
            weight = backend.get(f"{source}{suffix}")
        if weight is None:
            if not optional:
                check.missing.append(f"{name}{suffix}")
            return None
        bias = backend.get(f"{name}.bias")
        if bias is None and spec.bias:
            check.missing.append(f"{name}.bias")
        if spec.shape is not None:
            check.shape(f"{source}{suffix}", weight, spec.shape, layer)
            if bias is not None:
                check.shape(f"{name}.bias", bias, _bias_dims(spec.shape), layer)
        if source != name and kind is Linear:  # e.g. tied output embeddings: a fast mulmat layout
            weight = backend.matmul_weight(weight)
        return kind(weight, bias)

    return _walk(cls, "", n_layers, None, leaf)


# ---- attention sizes --------------------------------------------------------------------------
def attention_sizes(config: Any) -> tuple[int, int, int, int, int]:
    """(hidden, n_layers, n_heads, n_kv_heads, head_dim) from the usual GGUF keys, range-checked, for
    models whose keys and values have one head size; ModelError naming the key otherwise."""
    from pyggml.backend.metadata import MAX_LAYERS, MAX_WIDTH

    arch = config.architecture
    hidden = config.uint("embedding_length", min=1, max=MAX_WIDTH)
    n_heads = config.uint("attention.head_count", min=1, max=MAX_WIDTH)
    n_layers = config.uint("block_count", min=1, max=MAX_LAYERS)
    head_dim = config.uint("attention.key_length", 0, max=MAX_WIDTH) or hidden // n_heads
    if (config.uint("attention.value_length", 0, max=MAX_WIDTH) or head_dim) != head_dim:
        raise ModelError(f"{arch}: {arch}.attention.value_length must equal {arch}.attention.key_length")
    n_kv_heads = config.uint("attention.head_count_kv", 0, max=n_heads) or n_heads
    if not head_dim or n_heads % n_kv_heads:
        raise ModelError(f"{arch}: {arch}.attention.head_count ({n_heads}) must be a multiple of "
                         f"{arch}.attention.head_count_kv ({n_kv_heads}), with heads of at least one dimension")
    return hidden, n_layers, n_heads, n_kv_heads, head_dim


# ---- layers -------------------------------------------------------------------------------------
SLIDING, GLOBAL = 0, 1  # the kinds of layer where sliding-window and full attention alternate (Wrapper cache index)


def layer_kinds(config: Any, n_layers: int, default_pattern: int) -> tuple[int, ...]:
    """SLIDING or GLOBAL per layer from ``<arch>.attention.sliding_window_pattern``: one bool per layer
    (true: sliding) or a period n (the last layer of every n is global, as llama.cpp reads it;
    ``default_pattern`` when the file has no key; 0: every layer slides)."""
    arch = config.architecture
    pattern = config.get(f"{arch}.attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != n_layers:
            raise ModelError(f"{arch}: attention.sliding_window_pattern has {len(pattern)} entries for {n_layers} "
                             "layers")
        return tuple(SLIDING if bool(p) else GLOBAL for p in pattern)
    if not isinstance(pattern, int) or pattern < 0:
        raise ModelError(f"{arch}: bad attention.sliding_window_pattern {pattern!r}")
    return tuple(SLIDING if pattern == 0 or i % pattern < pattern - 1 else GLOBAL for i in range(n_layers))


def per_layer(config: Any, key: str, n_layers: int, default: int, limit: int | None = None) -> tuple[int, ...]:
    """A count that a file gives as one number for every layer or as a list of one per layer (hybrids:
    ``attention.head_count_kv`` 0 marks a layer of another kind); ModelError when a list's length is not
    ``n_layers``. ``limit``: the largest value allowed."""
    arch = config.architecture
    if isinstance(config.get(f"{arch}.{key}", default), list):
        values = config.uints(key, max=limit)
    else:
        values = [config.uint(key, default, max=limit)] * n_layers
    if len(values) != n_layers:
        raise ModelError(f"{arch}: {arch}.{key} has {len(values)} entries for {n_layers} layers")
    return tuple(values)


def layers(blk: list[Any], cache: Cache | None, outputs: Tensor | None,
           cache_layers: Sequence[int] | None = None) -> Iterator[tuple[int, Any, Tensor | None]]:
    """The decoder-layer loop: ``(i, layer, rows)`` per layer, the cache (if any) set to layer i first
    (to ``cache_layers[i]`` when given: layers that attend over an earlier layer's keys and values, see
    ``shared_kv_layers``); ``rows`` is ``outputs`` for the last layer (only the rows whose logits are
    wanted go on past its attention) and None before it."""
    last = len(blk) - 1
    for i, layer in enumerate(blk):
        if cache is not None:
            cache.set_layer(i if cache_layers is None else cache_layers[i])
        yield i, layer, outputs if i == last else None


def shared_kv_layers(kinds: Sequence[int], n_shared: int) -> tuple[int, ...]:
    """The layer whose cache each layer attends over when the last ``n_shared`` layers store no keys and
    values of their own (Gemma 3n / 4): a sharing layer reads the last storing layer of its kind
    (``kinds``: SLIDING/GLOBAL per layer); the others their own. ModelError when a kind has no such layer."""
    first = len(kinds) - n_shared
    if not 0 <= n_shared < len(kinds):
        raise ModelError(f"{n_shared} layers sharing keys and values leave no layer of {len(kinds)} to store them")
    last_of = {kind: i for i, kind in enumerate(kinds[:first])}
    missing = {kinds[i] for i in range(first, len(kinds))} - set(last_of)
    if missing:
        raise ModelError(f"layers {first}.. share the cache of an earlier layer of their kind, but layers "
                         f"0..{first - 1} have none of kind {sorted(missing)} ({SLIDING}: sliding, {GLOBAL}: global)")
    return tuple(i if i < first else last_of[kinds[i]] for i in range(len(kinds)))


def output_rows(rows: Tensor | None, *tensors: Tensor) -> tuple[Tensor, ...]:
    """``tensors`` (hidden, n_tokens) cut to ``rows`` (``nn.layers`` gives the last layer the output rows:
    from its attention on only the rows whose logits are wanted go on), or as they are when None."""
    return tensors if rows is None else tuple(t.rows(rows) for t in tensors)


def expert_counts(config: Any, required: bool = True) -> tuple[int, int]:
    """(expert_count, expert_used_count) of a mixture-of-experts file, with 0 < used <= count; a file
    without experts gives (0, 0) unless they are ``required``. ModelError naming both keys otherwise."""
    arch = config.architecture
    n_experts, n_used = config.uint("expert_count", 0), config.uint("expert_used_count", 0)
    if (required or n_experts) and not 0 < n_used <= n_experts:
        raise ModelError(f"{arch}: {arch}.expert_count ({n_experts}) and {arch}.expert_used_count ({n_used}) "
                         "must be set, with 0 < expert_used_count <= expert_count")
    return n_experts, n_used


def moe(x: Tensor, router_logits: Tensor, k: int, gate: Experts, up: Experts | None, down: Experts,
        glu: typing.Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """A mixture of experts: each token of ``x`` (hidden, n_tokens) through the ``k`` experts with the
    highest ``router_logits`` (n_experts, n_tokens), weighted by softmax(the k chosen logits) (that is
    also Qwen 3's softmax over all experts renormalised over the chosen): ``mix_experts``. Returns
    (hidden, n_tokens)."""
    n_experts, n_tokens = router_logits.shape[0], router_logits.shape[1]
    chosen = router_logits.top_k(k)  # (k, n_tokens): expert ids
    weights = router_logits.reshape(1, n_experts, n_tokens).rows(chosen)  # the chosen logits (1, k, n_tokens)
    return mix_experts(x, chosen, weights.reshape(k, n_tokens).softmax(), gate, up, down, glu)


def route(logits: Tensor, k: int, *, sigmoid: bool = False, bias: Tensor | None = None, groups: int = 1,
          groups_used: int = 1, normalize: bool = False, scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """Each token's ``k`` experts and their weights from router ``logits`` (n_experts, n_tokens), as DeepSeek's
    routers (and llama.cpp's ``build_moe_ffn``) choose them: probabilities softmax (``sigmoid``: sigmoid) of the
    logits; ``bias`` (n_experts,) shifts them for choosing only (DeepSeek V3's correction bias); with ``groups``
    > 1 only experts of the ``groups_used`` groups scoring best (a group's score: the sum of its two best shifted
    probabilities) can be chosen. The weights are the chosen experts' unshifted probabilities, renormalised to sum
    to 1 when ``normalize``, times ``scale`` (``routed_scaling_factor``). Returns (chosen I32, weights), both
    (k, n_tokens), for ``mix_experts``."""
    n_experts, n_tokens = logits.shape[0], logits.shape[1]
    probs = logits.sigmoid() if sigmoid else logits.softmax()
    select = probs if bias is None else probs + bias
    if groups > 1:
        per_group = n_experts // groups
        grouped = select.reshape(per_group, groups, n_tokens)
        best_two = grouped.reshape(1, per_group, groups, n_tokens).rows(grouped.top_k(2))  # (1, 2, groups, n_tokens)
        kept = best_two.reshape(2, groups, n_tokens).sum_rows().reshape(groups, n_tokens).top_k(groups_used)
        hidden = grouped.scale_bias(0.0, -math.inf)  # every expert out of reach but those of the kept groups
        select = hidden.set_rows(grouped.rows(kept), kept).reshape(n_experts, n_tokens)
    chosen = select.top_k(k)
    weights = probs.reshape(1, n_experts, n_tokens).rows(chosen).reshape(k, n_tokens)
    if normalize:  # a floor keeps an all-zero choice finite, as llama.cpp's
        weights = weights / weights.sum_rows().clamp(6.103515625e-5, math.inf)
    return chosen, weights if scale == 1.0 else weights.scale(scale)


def mix_experts(x: Tensor, chosen: Tensor, weights: Tensor, gate: Experts, up: Experts | None, down: Experts,
                glu: typing.Callable[[Tensor, Tensor], Tensor], weigh_inputs: bool = False) -> Tensor:
    """Each token of ``x`` (hidden, n_tokens) through its ``chosen`` experts (I32 ids, (k, n_tokens)),
    ``down(glu(gate(x), up(x)))`` per expert, the k outputs summed with ``weights`` (k, n_tokens). Only
    the chosen experts' matrices are read. ``up`` None: ``gate`` holds both (``ffn_gate_up_exps``, see
    ``fused_gate_up``). ``weigh_inputs``: scale each expert's input by its weight instead, and sum the
    outputs as they are (Llama 4). Returns (hidden, n_tokens)."""
    if not weigh_inputs:
        return sum_experts(down(_gated(x, chosen, gate, up, glu), chosen), weights)
    k, n_tokens = chosen.shape[0], chosen.shape[1]
    x = x.reshape(x.shape[0], 1, n_tokens).repeat(x.shape[0], k, n_tokens) * weights.reshape(1, k, n_tokens)
    return sum_experts(down(_gated(x, chosen, gate, up, glu), chosen), None)


def _gated(x: Tensor, chosen: Tensor, gate: Experts, up: Experts | None,
           glu: typing.Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """``glu(gate(x), up(x))`` of the chosen experts: (ffn, k, n_tokens); with ``up`` None, from the fused
    experts ``gate`` (each expert's gate rows, then its up rows)."""
    if up is not None:
        return glu(gate(x, chosen), up(x, chosen))
    both = gate(x, chosen)  # (2 ffn, k, n_tokens)
    rows, strides = (both.shape[0] // 2, both.shape[1], both.shape[2]), (both.strides[1], both.strides[2])
    return glu(both.view(0, rows, strides), both.view(rows[0] * both.strides[0], rows, strides))


def fused_gate_up(backend: Backend) -> bool:
    """Whether a file stores its experts' gate and up matrices as one ``ffn_gate_up_exps`` per layer (the gate's
    rows, then the up's: llama.cpp's converter with ``--fuse-gate-up-exps``) instead of two."""
    return any(name.endswith(".ffn_gate_up_exps.weight") for name in backend.tensors())


def sum_experts(out: Tensor, weights: Tensor | None) -> Tensor:
    """The chosen experts' outputs ``out`` (hidden, k, n_tokens) summed with ``weights`` (k, n_tokens),
    or as they are with None: (hidden, n_tokens)."""
    k, n_tokens = out.shape[1], out.shape[2]
    if weights is not None:
        out = out * weights.reshape(1, k, n_tokens)
    rows, per_token = (out.shape[0], n_tokens), (out.strides[2],)
    total = out.view(0, rows, per_token)  # the weighted sum over the k experts: k strided views added up
    for i in range(1, k):
        total = total + out.view(i * out.strides[1], rows, per_token)
    return total


def attention_temperature(ctx: Context, positions: Tensor, scale: float, length: int, max_position: int,
                          offset: int = 0) -> Tensor:
    """Attention temperature tuning (Llama 4's NoPE layers, Mistral 3): (1, 1, n_tokens) holding
    ``scale * ln(1 + floor((p + offset) / length))`` per position p of ``positions`` (I32, all below
    ``max_position``); queries are multiplied by 1 + that. Computed in the graph from the positions, so a
    reused graph stays right: 1 + floor((p + offset) / length) counts the steps j * length - offset - 1/2
    (j = 0, 1, ...) that p has passed."""
    n = positions.shape[0]
    steps = (max(max_position, 1) - 1 + offset) // length + 1
    thresholds = np.arange(steps, dtype=np.float32)[None, :] * length - offset - 0.5
    passed = positions.cast("f32").reshape(1, n).repeat(steps, n) - ctx.from_numpy(
        thresholds, name="attention_temperature.steps")
    count = passed.scale(2.0).clamp(0.0, 1.0).sum_rows()  # (1, n_tokens): 1 + floor((p + offset) / length)
    return count.log().scale(scale).reshape(1, 1, n)


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
            raise ModelError(f"{config.architecture}.rope.scaling.type: unsupported rope scaling type {kind!r} "
                             "(supported: none, linear, yarn, llama3)")
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


@dataclass(frozen=True)
class MRope:
    """Multi-axis rotary embedding (Qwen-VL's mRoPE): each rotated pair of dimensions takes its angle
    from the position on one axis (temporal, height, width). Built of one ``Rope`` per axis, each
    turning only its own pairs: the frequency factors of the other pairs are infinite (angle 0, an exact
    identity), so the result is ggml's ``rope_multi`` without binding it. ``axes``: the axis of each
    pair (``n_dims // 2`` entries); ``scales``: per pair a frequency multiplier (1 for the text model's)."""

    rope: Rope
    axes: tuple[int, ...]
    scales: tuple[float, ...] = ()

    @classmethod
    def sections(cls, rope: Rope, sections: typing.Sequence[int], interleaved: bool = False) -> MRope:
        """Contiguous sections of pairs per axis (Qwen 2/2.5-VL: [16, 24, 24]), or ``interleaved``
        (Qwen3-VL: pair i on axis i % 3 while that axis has pairs left, else on the first)."""
        n_pairs = rope.n_dims // 2
        if interleaved:
            axes = [next((a for a in (1, 2) if i % 3 == a and i < 3 * sections[a]), 0) for i in range(n_pairs)]
        else:
            bounds = np.cumsum(sections)
            axes = [int(np.searchsorted(bounds, i % bounds[-1], side="right")) for i in range(n_pairs)]
        return cls(rope, tuple(axes))

    @property
    def n_axes(self) -> int:
        return max(self.axes) + 1

    @property
    def n_dims(self) -> int:
        return self.rope.n_dims

    def factors(self, ctx: Context, name: str = "rope.axis") -> list[Tensor]:
        """The frequency factors of each axis, graph constants (named, so a refilled graph keeps them)."""
        scales = np.asarray(self.scales or [1.0] * len(self.axes), np.float64)
        out = []
        for a in range(self.n_axes):
            mine = np.asarray(self.axes) == a
            factor = np.where(mine, 1.0 / scales, np.inf).astype(np.float32)
            out.append(ctx.from_numpy(factor, name=f"{name}.{a}"))
        return out

    def __call__(self, x: Tensor, positions: Tensor, factors: list[Tensor] | None = None) -> Tensor:
        """Rotate ``x`` (head_dim, n_heads, n_tokens) by ``positions``: (n_axes * n_tokens,), axis by
        axis, or (n_tokens,), one position for every axis (a context shift: a plain rope then)."""
        n = x.shape[2]
        if positions.shape[0] == n:
            return self.rope(x, positions)
        if positions.shape[0] != self.n_axes * n or factors is None:
            raise ValueError(f"mrope: {positions.shape[0]} positions for {n} tokens on {self.n_axes} axes")
        step = positions.strides[0] * n
        for a, factor in enumerate(factors):
            x = self.rope(x, positions.view(a * step, (n,)), factor)
        return x


# ---- taps -------------------------------------------------------------------------------------
# Named intermediate results ("token_embd", "blk.3", "output_norm") that a layer-by-layer comparison
# (pyggml.porting) reads back. Outside ``capture_taps`` a tap costs one context-variable lookup.
@dataclass
class _Capture:
    taps: dict[str, Tensor]
    counts: dict[str, int]  # how often each name with a ``*`` was tapped


_capture: ContextVar[_Capture | None] = ContextVar("pyggml_taps", default=None)


def tap(name: str, tensor: Tensor) -> Tensor:
    """Name ``tensor`` as an intermediate result and return it unchanged; it is recorded only while
    ``capture_taps`` is active in this thread. Name it after the GGUF tensor whose op produced it
    (``output_norm``; ``blk.N`` for block N's output) so that the comparison finds its reference.
    A ``*`` in the name is replaced by how many times the name was tapped before in the capture:
    code that runs once per block without knowing its index taps ``blk.*.attn_q_norm`` and records
    ``blk.0.attn_q_norm``, ``blk.1.attn_q_norm``, ..."""
    capture = _capture.get()
    if capture is not None:
        if "*" in name:
            count = capture.counts.get(name, 0)
            capture.counts[name] = count + 1
            name = name.replace("*", str(count))
        if name in capture.taps:
            raise ValueError(f"tap: {name!r} was tapped twice in one capture")
        capture.taps[name] = tensor
    return tensor


@contextmanager
def capture_taps() -> Iterator[dict[str, Tensor]]:
    """Record the tensors that ``tap`` names while building a graph in this block, in graph order::

        with nn.capture_taps() as taps:
            logits = model.forward(ctx, batch)
        ctx.compute(logits, *taps.values())   # computed tensors are kept: taps[name].numpy()
    """
    capture = _Capture({}, {})
    token = _capture.set(capture)
    try:
        yield capture.taps
    finally:
        _capture.reset(token)


# ---- attention --------------------------------------------------------------------------------
def attention(ctx: Context, query: Tensor, key: Tensor | None, value: Tensor | None, cache: Cache | None,
              scale: float, *, flash: bool | None = None, mask: Tensor | None = None, softcap: float = 0.0,
              sinks: Tensor | None = None) -> Tensor:
    """Multi-head attention with GQA. ``query`` is (head_dim, n_heads, n_tokens), ``key`` and
    ``value`` (head_dim, n_kv_heads, n_tokens). With a cache, the new keys/values are stored and
    attention runs over the cached history with the cache's mask; without one, every token sees
    every other (encoders), or those ``mask`` (n_tokens, n_tokens; 0 or -inf) lets it see (several
    sequences in one encoder batch). ``softcap``: scores become ``softcap * tanh(score / softcap)``
    before the mask (Gemma 2). ``sinks`` (n_heads,): a learned logit per head joining each softmax
    (gpt-oss's attention sinks). ``value`` None: the cache's values are views of its keys
    (``Causal(value_from_key=...)``). ``key`` and ``value`` None (with a cache): attend over the keys and
    values the cache's current layer already holds, storing none (a layer sharing an earlier layer's
    cache, see ``shared_kv_layers``). Returns (head_dim_v * n_heads, n_tokens)."""
    if flash is None:
        flash = ctx.backend.flash_attention
    if cache is None and (key is None or value is None):
        raise ValueError("attention: without a cache give both key and value (value=None needs a cache whose "
                         "values are views of its keys, value_from_key)")
    if key is None and value is not None:
        raise ValueError("attention: give a key with the value, or neither to attend over what a cache holds")
    if cache is not None:
        if mask is not None:
            raise ValueError("attention: a mask is only for attention without a cache (the cache has its own)")
        if key is not None:
            cache.put(ctx, key, value)
        groups = cache.get_groups(ctx)
        if groups is not None:
            return _grouped_attention(query, groups, scale, flash, softcap, sinks)
        key, value, mask = cache.get(ctx)
    else:
        key, value = key.permute(0, 2, 1, 3), value.permute(0, 2, 1, 3)
    q = query.permute(0, 2, 1, 3)  # (head_dim, n_tokens, n_heads)
    out = q.scaled_dot_product_attention(key, value, mask, scale, flash=flash, softcap=softcap, sinks=sinks)
    d_v, n_heads, n_tokens = out.shape[0], out.shape[1], out.shape[2]
    return out.reshape(d_v * n_heads, n_tokens)


def _grouped_attention(query: Tensor, groups: list[KVGroup], scale: float, flash: bool, softcap: float,
                       sinks: Tensor | None) -> Tensor:
    """Attention of each group's rows over its sequences' own cells (see ``KVGroup``), one 4-d
    attention per group, the outputs joined in batch order: (head_dim_v * n_heads, n_tokens)."""
    d, n_heads, n_tokens = query.shape[0], query.shape[1], query.shape[2]
    if not query.is_contiguous():
        query = query.contiguous()
    out = None
    for g in groups:
        rows = g.n_tokens * g.n_seqs
        q = query if rows == n_tokens else query.view(g.start * query.strides[2], (d, n_heads, rows),
                                                      (query.strides[1], query.strides[2]))
        q = q.reshape(d, n_heads, g.n_tokens, g.n_seqs).permute(0, 2, 1, 3)  # (head_dim, tokens, heads, seqs)
        o = q.scaled_dot_product_attention(g.key, g.value, g.mask, scale, flash=flash, softcap=softcap, sinks=sinks)
        o = o.reshape(o.shape[0] * n_heads, rows)
        out = o if out is None else out.concat(o, 1)
    return out


def latent_attention(ctx: Context, q_nope: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor, cache: Cache,
                     scale: float, k_up: Tensor, v_up: Tensor, *, absorb: bool = True) -> Tensor:
    """DeepSeek's multi-head latent attention over a ``Causal(value_from_key=kv_lora_rank)`` cache, which
    stores per token only ``latent`` (kv_lora_rank, n_tokens) and the shared rotated key ``k_rope``
    (rope_dim, 1, n_tokens). Each head's key is (W_UK latent, k_rope) and its value W_UV latent, with
    ``k_up`` (nope_dim, kv_lora_rank, n_heads) and ``v_up`` (kv_lora_rank, v_dim, n_heads); queries are
    ``q_nope`` (nope_dim, n_heads, n_tokens) and the rotated ``q_rope`` (rope_dim, n_heads, n_tokens).

    ``absorb=True`` (llama.cpp's form): W_UK goes into the queries (q_nope W_UK scores against the latent
    directly) and W_UV is applied to the attention's output, so attention is one-KV-head attention over the
    cache as stored: nothing per head is ever built from the history. ``absorb=False`` decompresses every
    cached token into per-head keys and values first (the textbook form; a reference). Returns
    (v_dim * n_heads, n_tokens)."""
    rank, n_heads, n_tokens = latent.shape[0], q_nope.shape[1], q_nope.shape[2]
    key = latent.reshape(rank, 1, n_tokens).concat(k_rope, 0)  # the cached row: (latent, rope)
    if absorb:
        q_latent = k_up.mulmat(q_nope.permute(0, 2, 1, 3), ctx=ctx)  # (rank, n_tokens, n_heads)
        query = q_latent.permute(0, 2, 1, 3).concat(q_rope, 0)  # (rank + rope_dim, n_heads, n_tokens)
        out = attention(ctx, query, key, None, cache, scale).reshape(rank, n_heads, n_tokens)
        out = v_up.mulmat(out.permute(0, 2, 1, 3), ctx=ctx)  # (v_dim, n_tokens, n_heads)
        return out.permute(0, 2, 1, 3).contiguous().reshape(out.shape[0] * n_heads, n_tokens)
    cache.put(ctx, key, None)
    history, _, mask = cache.get(ctx)  # (rank + rope_dim, n_kv, 1)
    n_kv, rope_dim, row = history.shape[1], k_rope.shape[0], history.strides[1]
    cached = history.view(0, (rank, n_kv), (row,)).cast(DType.F32)
    k_up_t = k_up.cast(DType.F32, ctx=ctx).permute(1, 0, 2, 3).contiguous().reshape(rank, k_up.shape[0] * n_heads)
    v_up = v_up.cast(DType.F32, ctx=ctx).reshape(rank, v_up.shape[1] * n_heads)
    k_nope = cached.mulmat(k_up_t).reshape(n_kv, k_up.shape[0], n_heads).permute(1, 0, 2, 3).contiguous()
    value = cached.mulmat(v_up).reshape(n_kv, v_up.shape[1] // n_heads, n_heads).permute(1, 0, 2, 3)
    rotated = history.view(history.dtype.row_bytes(rank), (rope_dim, n_kv), (row,)).cast(DType.F32)
    k = k_nope.concat(rotated.reshape(rope_dim, n_kv, 1).repeat(rope_dim, n_kv, n_heads), 0)
    q = q_nope.concat(q_rope, 0).permute(0, 2, 1, 3)
    out = q.scaled_dot_product_attention(k, value, mask, scale, flash=ctx.backend.flash_attention)
    return out.reshape(out.shape[0] * n_heads, n_tokens)


def int32_input(ctx: Context, values: Any, name: str | None = None) -> Tensor:
    """A 1-d I32 graph input (``name``: refillable with ``ctx.set_input`` for graph reuse)."""
    return ctx.from_numpy(np.asarray(values, dtype=np.int32).reshape(-1), DType.I32, name=name)


def multimodal_embeddings(ctx: Context, h: Tensor, batch: Batch) -> Tensor:
    """``h`` (hidden, n_tokens), the token embeddings, with each multimodal item's rows written over
    its placeholders: the items at batch index i, whose tensors hold n1, n2, ... rows (numpy
    (n, hidden), as the runner keeps an encoded image), replace rows i, i+1, ... in order."""
    for index in batch.multimodal:
        start = index.index
        for item in index.multimodal:
            rows = np.asarray(item.tensor, dtype=np.float32)
            rows = rows.reshape(-1, rows.shape[-1])
            if rows.shape[1] != h.shape[0] or start + rows.shape[0] > h.shape[1]:
                raise ValueError(f"multimodal_embeddings: {rows.shape[0]} rows of width {rows.shape[1]} at batch "
                                 f"index {start} do not fit hidden states {h.shape}")
            h = h.set_rows(ctx.from_numpy(rows), int32_input(ctx, np.arange(start, start + rows.shape[0])))
            start += rows.shape[0]
    return h


# ---- the per-batch inputs ----------------------------------------------------------------------
# The names under which the engine refills a kept graph for the next batch of the same shape; only
# ``batch_inputs`` and ``refill_batch_inputs`` use them, so a model cannot lose graph reuse by a typo.
_TOKENS, _POSITIONS, _OUTPUTS = "batch.tokens", "batch.positions", "batch.outputs"
_ROPE_POSITIONS = "batch.rope_positions"


@dataclass(frozen=True)
class BatchInputs:
    """The graph inputs of one batch: ``tokens`` and ``positions`` (n_tokens,) and ``outputs``
    (the rows whose logits are wanted, see ``Batch.output_rows``), all I32; for a model with
    multi-axis rope, ``rope_positions`` (n_axes * n_tokens,): every token's position on axis 0, then
    on axis 1, ... (ggml's ``rope_multi`` layout)."""

    tokens: Tensor
    positions: Tensor
    outputs: Tensor
    rope_positions: Tensor | None = None


def batch_inputs(ctx: Context, batch: Batch, rope_axes: int = 0) -> BatchInputs:
    """Create the batch's token, position and output-row inputs (tokens on the input device), and
    with ``rope_axes`` its positions on that many rotary axes. The token array is used in place when
    it already is int32 (the runner fills in late ids)."""
    ropes = int32_input(ctx, _axis_positions(batch, rope_axes), _ROPE_POSITIONS) if rope_axes else None
    return BatchInputs(tokens=int32_input(ctx.input(), batch.tokens, _TOKENS),
                       positions=int32_input(ctx, batch.positions, _POSITIONS),
                       outputs=int32_input(ctx, batch.output_rows, _OUTPUTS), rope_positions=ropes)


def _axis_positions(batch: Batch, axes: int) -> np.ndarray:
    """(axes, n_tokens): ``batch.rope_positions`` by axis, or ``positions`` on every axis."""
    if not len(batch.rope_positions):
        return np.tile(np.asarray(batch.positions, np.int32), (axes, 1))
    ropes = np.asarray(batch.rope_positions, np.int32).reshape(len(batch.positions), -1)
    if ropes.shape[1] < axes:
        raise ValueError(f"batch_inputs: rope positions on {ropes.shape[1]} axes, the model needs {axes}")
    return np.ascontiguousarray(ropes[:, :axes].T)


def refill_batch_inputs(ctx: Context, batch: Batch) -> None:
    """Write ``batch``'s tokens, positions and output rows into a graph built by ``batch_inputs``
    for a batch of the same shape."""
    ctx.set_input(_TOKENS, batch.tokens)
    ctx.set_input(_POSITIONS, _int32_list(batch.positions))
    ctx.set_input(_OUTPUTS, _int32_list(batch.output_rows))
    shape = ctx.input_shape(_ROPE_POSITIONS)
    if shape is not None:
        ctx.set_input(_ROPE_POSITIONS, _axis_positions(batch, shape[0] // len(batch.positions)))


def _int32_list(values: Any) -> Any:
    """A list of ints as int32 at once (numpy raises OverflowError for one out of range): the range
    check ``set_input`` does on an int64 array costs more than the rest of a decode step's refill."""
    return np.asarray(values, dtype=np.int32) if isinstance(values, list) else values
