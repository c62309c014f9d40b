"""Tensor and DType: the ops of one ggml graph, validated in Python before they reach ggml.

Shapes are in **ggml order**: ``t.shape[0]`` is the innermost, contiguous dimension, so
``t.numpy().shape == tuple(reversed(t.shape))``. ``w.mulmat(x)`` with ``w.shape == (K, M)`` and
``x.shape == (K, N)`` gives ``(M, N)``.

ggml aborts the whole process on a failed assertion, so every op checks what ggml would assert
(and what it would silently read out of bounds) and raises ``ValueError``/``TypeError`` naming the
op and the shapes instead. The checks mirror the list in GGML-NOTES.md.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

# the only import of the compiled binding: the backend package takes ``ffi``/``lib`` from here
from pyggml._ggml import ffi, lib  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from pyggml.backend import Context

NULL = ffi.NULL


class DType(enum.IntEnum):
    """Every ggml tensor type (values are ggml's ``enum ggml_type``)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41
    Q2_0 = 42

    @property
    def block_size(self) -> int:
        """Elements per block (1 for plain types)."""
        return _BLOCK[self]

    @property
    def type_size(self) -> int:
        """Bytes per block."""
        return _TYPE_SIZE[self]

    @property
    def is_quantized(self) -> bool:
        return self not in _NUMPY_OF and self is not DType.BF16

    @property
    def numpy_dtype(self) -> np.dtype | None:
        """The numpy dtype holding this type's values as stored, or None (quantized, BF16)."""
        return _NUMPY_OF.get(self)

    def row_bytes(self, n: int) -> int:
        """Bytes taken by ``n`` elements (``n`` must be a multiple of ``block_size``)."""
        return n // self.block_size * self.type_size

    @classmethod
    def parse(cls, value: DType | str | int) -> DType:
        """DType from a DType, its name (case-insensitive, e.g. "q4_0") or ggml's integer."""
        if isinstance(value, DType):
            return value
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                raise ValueError(f"unknown dtype {value!r}; known: {', '.join(d.name for d in cls)}") from None
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown ggml type {value!r}") from None


_BLOCK = {d: int(lib.ggml_blck_size(d)) for d in DType}
_TYPE_SIZE = {d: int(lib.ggml_type_size(d)) for d in DType}
_NUMPY_OF = {
    DType.F32: np.dtype(np.float32),
    DType.F16: np.dtype(np.float16),
    DType.F64: np.dtype(np.float64),
    DType.I8: np.dtype(np.int8),
    DType.I16: np.dtype(np.int16),
    DType.I32: np.dtype(np.int32),
    DType.I64: np.dtype(np.int64),
}
_DTYPE_OF_NUMPY = {v: k for k, v in _NUMPY_OF.items()}
_FLOAT = frozenset({DType.F32, DType.F16, DType.BF16})
_F32, _F16, _BF16 = int(DType.F32), int(DType.F16), int(DType.BF16)  # plain ints: the cheapest comparisons
_PERMUTE_TAIL = ((0, 1, 2, 3), (1, 2, 3), (2, 3), (3,), ())
_ONES = ((1, 1, 1, 1), (1, 1, 1), (1, 1), (1,), ())  # pads an n-d shape to ggml's 4 dims
_DTYPES = {int(d): d for d in DType}
# types ggml's CPU matrix product cannot take as the left operand (no vec_dot kernel)
_NOT_MATMUL = frozenset({DType.I8, DType.I16, DType.I32, DType.I64, DType.F64, DType.Q8_1, DType.Q8_K})
# the intermediate types of ggml's matrix kernels (what activations are quantized to for a dot product):
# ggml cannot dequantize them, gather their rows or quantize to them outside a matrix product
_INTERMEDIATE = frozenset({DType.Q8_1, DType.Q8_K})
# quantized types ggml cannot convert back to float (its type traits have no to_float)
_NO_TO_FLOAT = frozenset(d for d in DType if d.is_quantized and lib.ggml_get_type_traits(d).to_float == NULL)
# quantized types without a CPU quantizer: nothing can be converted to them in a graph
_NO_FROM_FLOAT = frozenset({DType.IQ2_XXS, DType.IQ2_XS, DType.IQ2_S, DType.IQ3_XXS, DType.IQ3_S, DType.IQ1_S,
                            DType.IQ1_M}) | _INTERMEDIATE
# the largest tensor pyggml makes (csrc/pyggml_ops.c: PYG_MAX_BYTES): far beyond any memory, far below where
# ggml's size arithmetic (int64 element counts, size_t bytes) overflows
_MAX_BYTES = 1 << 56
_C_INT_MAX = 2**31 - 1  # ggml's int parameters (kernel sizes, strides, paddings, context lengths)


def _check_size(op: str, dtype: DType, shape: Sequence[int]) -> None:
    """Refuse a result too large for ggml's size arithmetic (it would wrap around and under-allocate)."""
    n = _TYPE_SIZE[dtype]
    for i, d in enumerate(shape):
        n *= (d // _BLOCK[dtype]) if i == 0 else d
    if n > _MAX_BYTES:
        raise ValueError(f"{op}: a {dtype.name} tensor of shape {tuple(shape)} would take {n} bytes, more than "
                         f"the {_MAX_BYTES} pyggml allows")


def _check_c_int(op: str, **values: Any) -> None:
    """Integer parameters that ggml takes as a C int (cffi would raise a bare OverflowError)."""
    for name, v in values.items():
        if isinstance(v, (int, np.integer)) and not -_C_INT_MAX - 1 <= v <= _C_INT_MAX:
            raise ValueError(f"{op}: {name}={v} is out of range for ggml (at most {_C_INT_MAX})")


def _check_eps(op: str, eps: Any) -> None:
    """ggml's norm kernels assert ``eps >= 0`` (NaN fails it and aborts the process)."""
    if not isinstance(eps, (int, float, np.floating, np.integer)) or not 0 <= eps < math.inf:
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {eps!r}")


# ---- value ranges of index tensors -----------------------------------------------------------------
# rows / set_rows / mulmat_id read at the indices they are given, and ggml does not check them (an index out of
# range aborts or reads out of bounds inside a compute). Every I32 tensor's values are therefore traced to their
# source: a graph input (its data is checked when the graph computes), an op whose results lie in a known range
# (argmax / argsort / top_k over n entries: 0..n-1), or something pyggml cannot bound (refused).
_OP = {name: int(getattr(lib, "GGML_OP_" + name)) for name in (
    "NONE", "DUP", "CPY", "CONT", "RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE", "GET_ROWS", "ARGMAX", "ARGSORT",
    "TOP_K")}
_SAME_VALUES = frozenset(_OP[n] for n in ("RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE"))  # the source's values
_COPIES = frozenset(_OP[n] for n in ("DUP", "CPY", "CONT"))  # the source's values, converted
_RANGED = frozenset(_OP[n] for n in ("ARGMAX", "ARGSORT", "TOP_K"))  # 0 .. src.ne[0] - 1
_INT_TYPES = (int(DType.I32), int(DType.I64))


def index_source(p: Any) -> tuple[str, Any]:
    """Where the values of index tensor ``p`` come from: ``("input", leaf)`` (a graph input: checked at
    compute), ``("range", n)`` (computed, within 0..n-1) or ``("unknown", what)``."""
    for _ in range(64):
        op = p.op
        if op in _SAME_VALUES:
            p = p.src[0]
        elif op in _COPIES:
            p = p.src[0]
            if p.type not in _INT_TYPES:
                return "unknown", f"a conversion from {_DTYPES[p.type].name}"
        elif op in _RANGED:
            return "range", int(p.src[0].ne[0])
        elif op == _OP["GET_ROWS"] and p.src[0].type in _INT_TYPES:
            p = p.src[0]  # rows gathered from an integer table: the table's values
        elif op == _OP["NONE"]:
            if p.flags & lib.GGML_TENSOR_FLAG_INPUT:
                return "input", p
            return "unknown", "a weight or cache tensor"
        else:
            return "unknown", f"ggml op {ffi.string(lib.ggml_op_name(op)).decode()}"
    return "unknown", "a long chain of ops"


def dtype_of_numpy(dtype: np.dtype) -> DType:
    """The DType that stores a numpy dtype unchanged (float32 -> F32, int32 -> I32, ...)."""
    try:
        return _DTYPE_OF_NUMPY[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"numpy dtype {np.dtype(dtype)} has no ggml equivalent "
                        f"(use one of {', '.join(str(k) for k in _DTYPE_OF_NUMPY)})") from None


class RopeType(enum.IntEnum):
    NORMAL = 0  # rotate adjacent pairs (x0, x1), (x2, x3), ...   (GGUF llama)
    NEOX = 2  # rotate halves (x0, x_{d/2}), ...                  (GPT-NeoX, HF rotate_half)


# ggml functions the checked C ops (csrc/pyggml_ops.h) call, by pyggml op name
_FN = {op: ffi.addressof(lib, "ggml_" + fn) for op, fn in {
    "add": "add", "sub": "sub", "mul": "mul", "div": "div", "neg": "neg", "sqr": "sqr", "sqrt": "sqrt",
    "exp": "exp", "log": "log", "sin": "sin", "cos": "cos", "abs": "abs", "tanh": "tanh", "relu": "relu",
    "sigmoid": "sigmoid", "silu": "silu", "gelu": "gelu", "gelu_erf": "gelu_erf", "gelu_quick": "gelu_quick",
    "silu_glu": "swiglu_split", "gelu_glu": "geglu_split", "rms_norm": "rms_norm", "norm": "norm",
    "l2_norm": "l2_norm", "softplus": "softplus"}.items()}


def _elementwise_method(op: str) -> Any:
    """Tensor.add/sub/mul/div: the checked C op in one Python frame (the hot path), else
    ``Tensor._binary`` (scalars, and the error when the C op declines)."""
    checked = _FN[op]

    def method(self: Tensor, other: Tensor | float) -> Tensor:
        if other.__class__ is Tensor:
            ctx = self.ctx or other.ctx
            if ctx is not None:
                out = lib.pyg_binary(ctx._g, checked, self._p, other._p)
                if out:
                    return _node(out, ctx, self._nd if self._nd > other._nd else other._nd)
        return self._binary(other, op)

    method.__name__ = method.__qualname__ = op
    method.__doc__ = f"Elementwise {op}; ``other`` is a scalar or a tensor whose dims divide this one's (tiled)."
    return method


def _shape_str(*tensors: Tensor) -> str:
    return ", ".join(str(t.shape) for t in tensors)


def _fail(op: str, message: str, *tensors: Tensor) -> ValueError:
    shapes = f" (shapes {_shape_str(*tensors)})" if tensors else ""
    return ValueError(f"{op}: {message}{shapes}")


class Tensor:
    """One ggml tensor: a weight, a cache buffer, or a node of the graph being built.

    Graph tensors remember their ``Context`` (``ctx``); weights and cache tensors have none and
    take the context of the other operand, or need an explicit ``ctx=``.
    """

    __slots__ = ("_p", "ctx", "_ne", "_nd", "_keep")

    def __init__(self, ptr: Any, ctx: Context | None, nd: int, keep: Any = None, ne: tuple | None = None):
        self._p = ptr
        self.ctx = ctx
        self._ne = tuple(ptr.ne) if ne is None else ne  # ops that keep the shape pass it (saves a C read)
        self._nd = nd if 0 < nd <= 4 else max(1, min(nd, 4))
        self._keep = keep  # whatever must outlive the pointer (a Backend, a mapped file)

    def __getattr__(self, name: str) -> Any:
        # nodes made by the checked C ops (``_node``) read their shape from ggml on first use only
        if name == "_ne":
            ne = self._ne = tuple(self._p.ne)
            return ne
        raise AttributeError(f"'Tensor' object has no attribute {name!r}")

    # ---- properties ---------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        """Dimensions in ggml order (innermost first)."""
        return self._ne[: self._nd]

    @property
    def ndim(self) -> int:
        return self._nd

    @property
    def dtype(self) -> DType:
        return _DTYPES[self._p.type]

    @property
    def strides(self) -> tuple[int, ...]:
        """Byte strides ``nb`` in ggml order."""
        return tuple(self._p.nb)[: self._nd]

    @property
    def nbytes(self) -> int:
        return int(lib.ggml_nbytes(self._p))

    @property
    def nelements(self) -> int:
        return math.prod(self._ne)

    @property
    def name(self) -> str:
        return ffi.string(lib.ggml_get_name(self._p)).decode()

    @name.setter
    def name(self, value: str) -> None:
        lib.ggml_set_name(self._p, value.encode()[:63])

    def is_contiguous(self) -> bool:
        return bool(lib.ggml_is_contiguous(self._p))

    def __repr__(self) -> str:
        name = self.name
        return f"Tensor({name + ', ' if name else ''}shape={self.shape}, dtype={self.dtype.name})"

    # ---- data ------------------------------------------------------------------------------
    def numpy(self) -> np.ndarray:
        """A copy of the data, shaped ``tuple(reversed(self.shape))``; quantized and BF16 data
        is dequantized to float32."""
        if self.ctx is None:
            return self._read()
        with self.ctx.backend._lock:  # no other thread's compute between the check and the copy
            return self._read()

    def _read(self) -> np.ndarray:
        self._check_readable()
        dtype = self.dtype
        p = self._p
        shape = tuple(reversed(self.shape))
        np_dtype = dtype.numpy_dtype
        if np_dtype is not None:
            if lib.ggml_is_contiguous(p):
                out = np.empty(shape, dtype=np_dtype)
                if out.size:
                    lib.ggml_backend_tensor_get(p, ffi.from_buffer(out), 0, out.nbytes)
                return out
            # a strided view: read its whole extent, then pick the elements with numpy strides
            nbytes = int(lib.ggml_nbytes(p))
            raw = np.empty(-(-nbytes // np_dtype.itemsize), dtype=np_dtype)  # never fewer bytes than nbytes
            lib.ggml_backend_tensor_get(p, ffi.from_buffer(raw), 0, nbytes)
            full = np.lib.stride_tricks.as_strided(raw, shape=tuple(reversed(self._ne)),
                                                   strides=tuple(reversed(tuple(p.nb))))
            return np.array(full).reshape(shape)
        if not lib.ggml_is_contiguous(p):
            raise ValueError(f"numpy: cannot read a non-contiguous {dtype.name} view; make it contiguous first")
        nbytes = int(lib.ggml_nbytes(p))
        raw = np.empty(nbytes, dtype=np.uint8)
        lib.ggml_backend_tensor_get(p, ffi.from_buffer(raw), 0, nbytes)
        out = np.empty(self.nelements, dtype=np.float32)
        traits = lib.ggml_get_type_traits(dtype)
        if traits.to_float == NULL:
            raise TypeError(f"numpy: ggml cannot convert {dtype.name} to float")
        traits.to_float(ffi.from_buffer(raw), ffi.from_buffer("float[]", out), out.size)
        return out.reshape(shape)

    def set(self, array: np.ndarray) -> None:
        """Write data: immediately for weight/cache tensors, at the next compute for graph inputs."""
        array = _prepare_host_array(array, self.dtype, self.shape, "set")
        if self.ctx is None:
            _check_alive(self, "set")
            _check_writable(self, "set")
            if self._p.buffer == NULL:
                raise ValueError("set: tensor has no storage")
            lib.ggml_backend_tensor_set(self._p, ffi.from_buffer(array), 0, array.nbytes)
        else:
            self.ctx._set_input(self, array)

    def _check_readable(self) -> None:
        if self.ctx is not None:
            self.ctx._check_results(self)
        elif self._keep is not None and getattr(self._keep, "_closed", False):
            raise ValueError("numpy: the tensor's backend is closed")
        elif self._p.buffer == NULL:
            raise ValueError("numpy: tensor has no storage")
        if self._keep is not None and getattr(self._keep, "_repacked", None) and self.name in self._keep._repacked:
            raise ValueError(f"numpy: weight {self.name} was repacked for the CPU kernels and cannot be read back")

    # ---- plumbing --------------------------------------------------------------------------
    def _ctx_with(self, other: Tensor | None, op: str, ctx: Context | None = None) -> Context:
        if ctx is None:
            ctx = self.ctx
            if ctx is None and other is not None:
                ctx = other.ctx
            if ctx is None:
                raise ValueError(f"{op}: all operands are weights; pass ctx= to say which graph to build in")
        state = ctx._state
        if state.closed:
            raise ValueError(f"{op}: the context is closed")
        n = state.n_tensors
        if n >= state.max_tensors:
            raise ValueError(f"{op}: graph is full ({state.max_tensors} tensors); create the context with a "
                             "larger max_nodes")
        # a node must not point into another graph's memory or a closed backend's weights
        c = self.ctx
        if c is not ctx:
            if c is None:
                _check_alive(self, op, op != ("mulmat" if self._p.ne[2] == 1 else "mulmat_id"))
            elif c._state is not state:
                raise ValueError(f"{op}: operands belong to different contexts; build one graph per context")
        if other is not None:
            c = other.ctx
            if c is not ctx:
                if c is None:
                    _check_alive(other, op, True)
                elif c._state is not state:
                    raise ValueError(f"{op}: operands belong to different contexts; build one graph per context")
        state.n_tensors = n + 1  # the node the op is about to make
        return ctx

    @staticmethod
    def _same_graph(ctx: Context, op: str, *tensors: Tensor | None) -> None:
        """The checks of ``_ctx_with`` for the third and later operands of an op."""
        for t in tensors:
            if t is not None:
                if t.ctx is None:
                    _check_alive(t, op, True)
                elif t.ctx._state is not ctx._state:
                    raise ValueError(f"{op}: operands belong to different contexts; build one graph per context")

    def _wrap(self, ctx: Context, ptr: Any, nd: int) -> Tensor:
        return Tensor(ptr, ctx, nd)

    # ---- elementwise -----------------------------------------------------------------------
    def _binary(self, other: Tensor | float, op: str) -> Tensor:
        """add/sub/mul/div with a scalar, or when the checked C op declined (explains why)."""
        if not isinstance(other, Tensor):
            if not isinstance(other, (int, float)):
                raise TypeError(f"{op}: unsupported operand {other!r}")
            if op == "add":
                return self._float_param_op(lib.ggml_scale_bias, op, 1.0, float(other))
            if op == "sub":
                return self._float_param_op(lib.ggml_scale_bias, op, 1.0, -float(other))
            if op == "mul":
                return self._float_param_op(lib.ggml_scale, op, float(other))
            return self._float_param_op(lib.ggml_scale, op, 1.0 / float(other))
        a, b = self._ne, other._ne
        if a[0] % b[0] or a[1] % b[1] or a[2] % b[2] or a[3] % b[3]:
            raise _fail(op, "the right operand must tile the left one (each of its dims divides the left's)",
                        self, other)
        p, q = self._p, other._p
        ta, tb = p.type, q.type
        if ta not in _FLOAT or (tb != ta and tb != _F32):
            raise TypeError(f"{op}: operands must be F32/F16/BF16 with the right one of the same type or F32, "
                            f"got {self.dtype.name} and {other.dtype.name}")
        if p.nb[0] != _TYPE_SIZE[ta]:
            raise _fail(op, "the left operand needs contiguous rows (call .contiguous())", self, other)
        ctx = self._ctx_with(other, op)
        out = getattr(lib, "ggml_" + op)(ctx._state.ptr, p, q)
        return Tensor(out, ctx, self._nd if self._nd > other._nd else other._nd, None, a)

    add = _elementwise_method("add")
    sub = _elementwise_method("sub")
    mul = _elementwise_method("mul")
    div = _elementwise_method("div")

    __add__ = add
    __sub__ = sub
    __mul__ = mul
    __truediv__ = div

    def __radd__(self, other: float) -> Tensor:
        return self.add(other)

    def __rmul__(self, other: float) -> Tensor:
        return self.mul(other)

    def __neg__(self) -> Tensor:
        return self.neg()

    def _unary(self, fn: Any, op: str, float_only: bool = True, same_shape: bool = True) -> Tensor:
        ctx = self.ctx
        if float_only and same_shape and ctx is not None:
            out = lib.pyg_unary(ctx._g, _FN[op], self._p)
            if out:
                return _node(out, ctx, self._nd)
        p = self._p
        t = p.type
        if float_only and t not in _FLOAT:
            raise TypeError(f"{op}: needs an F32/F16/BF16 tensor, got {self.dtype.name}")
        if p.nb[0] != _TYPE_SIZE[t]:
            raise _fail(op, "rows must be contiguous (call .contiguous())", self)
        ctx = self._ctx_with(None, op)
        return Tensor(fn(ctx._state.ptr, p), ctx, self._nd, None, self._ne if same_shape else None)

    def neg(self) -> Tensor:
        return self._unary(lib.ggml_neg, "neg")

    def sqr(self) -> Tensor:
        return self._unary(lib.ggml_sqr, "sqr")

    def sqrt(self) -> Tensor:
        return self._unary(lib.ggml_sqrt, "sqrt")

    def exp(self) -> Tensor:
        return self._unary(lib.ggml_exp, "exp")

    def log(self) -> Tensor:
        return self._unary(lib.ggml_log, "log")

    def sin(self) -> Tensor:
        return self._unary(lib.ggml_sin, "sin")

    def cos(self) -> Tensor:
        return self._unary(lib.ggml_cos, "cos")

    def abs(self) -> Tensor:
        return self._unary(lib.ggml_abs, "abs")

    def tanh(self) -> Tensor:
        return self._unary(lib.ggml_tanh, "tanh")

    def relu(self) -> Tensor:
        return self._unary(lib.ggml_relu, "relu")

    def sigmoid(self) -> Tensor:
        return self._unary(lib.ggml_sigmoid, "sigmoid")

    def softplus(self) -> Tensor:
        """log(1 + exp(x)) (ggml returns x itself past 20, where they agree in F32)."""
        return self._unary(lib.ggml_softplus, "softplus")

    def silu(self, up: Tensor | None = None) -> Tensor:
        """SiLU; with ``up``, the fused SwiGLU ``silu(self) * up``."""
        if up is None:
            return self._unary(lib.ggml_silu, "silu")
        return self._glu(up, lib.ggml_swiglu_split, "silu")

    def gelu(self, up: Tensor | None = None) -> Tensor:
        """GELU (tanh approximation); with ``up``, the fused GeGLU ``gelu(self) * up``."""
        if up is None:
            return self._unary(lib.ggml_gelu, "gelu")
        return self._glu(up, lib.ggml_geglu_split, "gelu")

    def swiglu_oai(self, up: Tensor, alpha: float, limit: float) -> Tensor:
        """gpt-oss's clamped SwiGLU of gate ``self`` and ``up`` (same shape, F32):
        ``g * sigmoid(alpha * g) * (u + 1)`` with ``g = min(self, limit)``, ``u = clamp(up, -limit, limit)``."""
        ctx = self._ctx_with(up, "swiglu_oai")
        if self._ne != up._ne:
            raise _fail("swiglu_oai", "gate and up must have the same shape", self, up)
        if self._p.type != DType.F32 or up._p.type != DType.F32:
            raise TypeError(f"swiglu_oai: gate and up must both be F32, got {self.dtype.name} and {up.dtype.name}")
        if not _contiguous_1(self._p) or not _contiguous_1(up._p):
            raise _fail("swiglu_oai", "gate and up need contiguous rows packed in dims 2 and 3 (call .contiguous())",
                        self, up)
        out = lib.ggml_swiglu_oai(ctx._state.ptr, self._p, up._p, float(alpha), float(limit))
        return Tensor(out, ctx, self._nd, None, self._ne)

    def gelu_erf(self) -> Tensor:
        return self._unary(lib.ggml_gelu_erf, "gelu_erf")

    def gelu_quick(self) -> Tensor:
        return self._unary(lib.ggml_gelu_quick, "gelu_quick")

    def _glu(self, up: Tensor, fn: Any, op: str) -> Tensor:
        ctx = self.ctx or up.ctx
        if ctx is not None:
            out = lib.pyg_glu(ctx._g, _FN[op + "_glu"], self._p, up._p)
            if out:
                return _node(out, ctx, self._nd)
        ctx = self._ctx_with(up, op)
        if self._ne != up._ne:
            raise _fail(op, "gate and up must have the same shape", self, up)
        if self._p.type not in _FLOAT or up._p.type != self._p.type:
            raise TypeError(f"{op}: gate and up must both be F32/F16, got {self.dtype.name} and {up.dtype.name}")
        if not _contiguous_1(self._p) or not _contiguous_1(up._p):
            raise _fail(op, "gate and up need contiguous rows packed in dims 2 and 3 (call .contiguous())",
                        self, up)
        return Tensor(fn(ctx._state.ptr, self._p, up._p), ctx, self._nd, None, self._ne)

    def scale(self, s: float) -> Tensor:
        ctx = self.ctx
        if ctx is not None and type(s) is float:
            out = lib.pyg_scale(ctx._g, self._p, s)
            if out:
                return _node(out, ctx, self._nd)
        return self._float_param_op(lib.ggml_scale, "scale", float(s))

    def scale_bias(self, s: float, b: float) -> Tensor:
        """``self * s + b``."""
        return self._float_param_op(lib.ggml_scale_bias, "scale_bias", float(s), float(b))

    def clamp(self, min_value: float, max_value: float) -> Tensor:
        if min_value > max_value:
            raise ValueError(f"clamp: min {min_value} > max {max_value}")
        return self._float_param_op(lib.ggml_clamp, "clamp", float(min_value), float(max_value))

    def _float_param_op(self, fn: Any, op: str, *params: float) -> Tensor:
        # ggml's CPU scale is F32 only and needs a contiguous tensor; clamp takes F32/F16 with packed rows
        p = self._p
        t = p.type
        clamp = fn is lib.ggml_clamp
        if t != _F32 and (not clamp or t != _F16):
            raise TypeError(f"{op}: needs an F32 tensor{' (or F16)' if clamp else ''}, got {self.dtype.name}")
        nb, ne = tuple(p.nb), self._ne
        # both need ggml_is_padded_1d (packed rows, evenly spaced: the kernels walk row i at i * nb[1]);
        # scale also ggml_is_contiguous
        if nb[0] != _TYPE_SIZE[t] or nb[2] != nb[1] * ne[1] or nb[3] != nb[2] * ne[2] or not clamp and not (
                (ne[1] == 1 or nb[1] == nb[0] * ne[0]) and (ne[2] == 1 or nb[2] == nb[0] * ne[0] * ne[1]) and
                (ne[3] == 1 or nb[3] == nb[0] * ne[0] * ne[1] * ne[2])):
            raise _fail(op, "the tensor must be contiguous (call .contiguous())", self)
        ctx = self._ctx_with(None, op)
        return Tensor(fn(ctx._state.ptr, self._p, *params), ctx, self._nd, None, self._ne)

    # ---- reductions and normalisation ------------------------------------------------------
    def sum_rows(self) -> Tensor:
        """Sum along dim 0 (result has ``shape[0] == 1``)."""
        if self._p.type != DType.F32:
            raise TypeError(f"sum_rows: needs an F32 tensor, got {self.dtype.name}")
        return self._unary(lib.ggml_sum_rows, "sum_rows", same_shape=False)

    def mean(self) -> Tensor:
        """Mean along dim 0 (result has ``shape[0] == 1``)."""
        if self._p.type != DType.F32:
            raise TypeError(f"mean: needs an F32 tensor, got {self.dtype.name}")
        return self._unary(lib.ggml_mean, "mean", same_shape=False)

    def sum(self) -> Tensor:
        """Sum of all elements (a one-element tensor)."""
        ctx = self._ctx_with(None, "sum")
        if self._p.type not in _FLOAT:
            raise TypeError(f"sum: needs an F32/F16/BF16 tensor, got {self.dtype.name}")
        return Tensor(lib.ggml_sum(ctx._state.ptr, self._p), ctx, 1)

    def argmax(self) -> Tensor:
        """Index of the largest value of each row (I32, shape ``(rows,)``)."""
        if self._p.type != DType.F32 or self._nd > 2:
            raise _fail("argmax", f"needs an F32 matrix, got {self.dtype.name}", self)
        if not _rows_packed(self._p):
            raise _fail("argmax", "rows must be contiguous (call .contiguous())", self)
        ctx = self._ctx_with(None, "argmax")
        return Tensor(lib.ggml_argmax(ctx._state.ptr, self._p), ctx, 1)

    def _norm(self, fn: Any, op: str, eps: float) -> Tensor:
        ctx = self.ctx
        if ctx is not None and type(eps) is float:
            out = lib.pyg_norm(ctx._g, _FN[op], self._p, eps)
            if out:
                return _node(out, ctx, self._nd)
        _check_eps(op, eps)
        ctx = self._ctx_with(None, op)
        if self._p.type != DType.F32:
            raise TypeError(f"{op}: needs an F32 tensor, got {self.dtype.name}")
        if not _rows_packed(self._p):
            raise _fail(op, "rows must be contiguous", self)
        return Tensor(fn(ctx._state.ptr, self._p, float(eps)), ctx, self._nd, None, self._ne)

    def rms_norm(self, eps: float, weight: Tensor | None = None) -> Tensor:
        """Normalise each row by its root mean square; multiply by ``weight`` when given."""
        out = self._norm(lib.ggml_rms_norm, "rms_norm", eps)
        return out if weight is None else out.mul(weight)

    def norm(self, eps: float, weight: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
        """Layer norm of each row (mean 0, variance 1), then ``* weight + bias`` when given."""
        out = self._norm(lib.ggml_norm, "norm", eps)
        if weight is not None:
            out = out.mul(weight)
        return out if bias is None else out.add(bias)

    layer_norm = norm

    def l2_norm(self, eps: float) -> Tensor:
        return self._norm(lib.ggml_l2_norm, "l2_norm", eps)

    def group_norm(self, n_groups: int, eps: float) -> Tensor:
        if n_groups <= 0 or self._ne[2] % n_groups:
            raise _fail("group_norm", f"n_groups={n_groups} must divide dim 2", self)
        _check_eps("group_norm", eps)
        if self._p.type != DType.F32:
            raise TypeError(f"group_norm: needs an F32 tensor, got {self.dtype.name}")
        if not _rows_packed(self._p):
            raise _fail("group_norm", "rows must be contiguous (call .contiguous())", self)
        ctx = self._ctx_with(None, "group_norm")
        return Tensor(lib.ggml_group_norm(ctx._state.ptr, self._p, int(n_groups), float(eps)), ctx, self._nd)

    def softmax(self, mask: Tensor | None = None, scale: float = 1.0, max_bias: float = 0.0) -> Tensor:
        """Softmax along dim 0 of ``self * scale + mask`` (mask broadcast over dims 2 and 3)."""
        ctx = self.ctx
        if ctx is not None and type(scale) is float and type(max_bias) is float:
            out = lib.pyg_soft_max(ctx._g, self._p, NULL if mask is None else mask._p, scale, max_bias)
            if out:
                return _node(out, ctx, self._nd)
        if mask is None and max_bias > 0:
            raise _fail("softmax", f"max_bias={max_bias} (ALiBi) needs a mask: ggml adds the slopes through it", self)
        ctx = self._ctx_with(mask, "softmax")
        a = self._ne
        if self._p.type != DType.F32:
            raise TypeError(f"softmax: needs an F32 tensor, got {self.dtype.name}")
        if not lib.ggml_is_contiguous(self._p):
            raise _fail("softmax", "input must be contiguous (call .contiguous())", self)
        mp = NULL
        if mask is not None:
            m = mask._ne
            if mask._p.type not in (DType.F32, DType.F16):
                raise TypeError(f"softmax: mask must be F32 or F16, got {mask.dtype.name}")
            if not lib.ggml_is_contiguous(mask._p):
                raise _fail("softmax", "mask must be contiguous", self, mask)
            if m[0] != a[0] or m[1] < a[1] or a[2] % m[2] or a[3] % m[3]:
                raise _fail("softmax", "mask must be (n_kv, >= n_tokens[, heads dividing, ...]) for the scores",
                            self, mask)
            mp = mask._p
        return Tensor(lib.ggml_soft_max_ext(ctx._state.ptr, self._p, mp, float(scale), float(max_bias)), ctx, self._nd,
                      None, self._ne)

    # ---- matrix products -------------------------------------------------------------------
    def mulmat(self, other: Tensor, *, ctx: Context | None = None) -> Tensor:
        """ggml's matrix product: ``(K, M, ...) x (K, N, ...) -> (M, N, ...)``, broadcasting dims 2, 3."""
        c = ctx or self.ctx or other.ctx
        nd = self._nd if self._nd > other._nd else other._nd
        # the C side takes a repacked left operand as a matrix; a repacked stack of experts is mulmat_id's only
        if c is not None and (self._nd < 3 or self._p not in getattr(self._keep, "_repacked_ptrs", ())):
            out = lib.pyg_mul_mat(c._g, self._p, other._p)
            if out:
                return _node(out, c, nd if nd > 2 else 2)
        ctx = self._ctx_with(other, "mulmat", ctx)
        a, b = self._ne, other._ne
        if a[0] != b[0]:
            raise _fail("mulmat", f"inner dimensions differ ({a[0]} vs {b[0]})", self, other)
        if b[2] % a[2] or b[3] % a[3]:
            raise _fail("mulmat", "dims 2 and 3 of the left operand must divide the right's", self, other)
        pa, pb = self._p, other._p
        ta, tb = pa.type, pb.type
        nb = pa.nb
        if nb[0] != _TYPE_SIZE[ta] or nb[0] > nb[1]:
            raise _fail("mulmat", "the left operand must not be transposed (call .contiguous())", self, other)
        # what ggml's CPU kernels take: F32 on the right always, F16/BF16 only with a matching left
        if ta in _NOT_MATMUL or (tb != _F32 and not ((tb == _F16 and ta == _F16) or
                                                      (tb == _BF16 and (ta == _BF16 or ta == _F32)))):
            raise TypeError(f"mulmat: unsupported types {self.dtype.name} x {other.dtype.name} (the right operand "
                            "must be F32, or F16/BF16 like a float left operand)")
        if pb.nb[0] != _TYPE_SIZE[tb]:
            raise _fail("mulmat", "the right operand needs contiguous rows (call .contiguous())", self, other)
        _check_size("mulmat", DType.F32, (a[1], b[1], b[2], b[3]))
        out = lib.ggml_mul_mat(ctx._state.ptr, pa, pb)
        return Tensor(out, ctx, nd if nd > 2 else 2, None, (a[1], b[1], b[2], b[3]))

    def mulmat_full_prec(self, other: Tensor) -> Tensor:
        """``mulmat`` accumulating in F32 on backends that would otherwise use F16."""
        out = self.mulmat(other)
        lib.ggml_prec_set_acc(out._p, lib.GGML_PREC_F32)
        return out

    def mulmat_id(self, other: Tensor, ids: Tensor) -> Tensor:
        """Mixture-of-experts product: ``self`` is (K, M, n_experts), ``other`` (K, n_used or 1, N),
        ``ids`` I32 (n_used, N) selects the expert per column. Result (M, n_used, N)."""
        a, b, i = self._ne, other._ne, ids._ne
        if ids._p.type != DType.I32:
            raise TypeError(f"mulmat_id: ids must be I32, got {ids.dtype.name}")
        if a[0] != b[0] or a[3] != 1 or b[3] != 1 or i[2] != 1 or i[3] != 1 or b[2] != i[1] or \
                i[0] % b[1] or (b[1] != 1 and b[1] != i[0]):
            raise _fail("mulmat_id", "expects (K, M, E) x (K, U|1, N) with ids (U, N)", self, other, ids)
        if self._p.type in _NOT_MATMUL or other._p.type != DType.F32:
            raise TypeError(f"mulmat_id: needs float or quantized experts and an F32 right operand, got "
                            f"{self.dtype.name} and {other.dtype.name}")
        if self._p.nb[0] > self._p.nb[1] or not _rows_packed(self._p) or not _rows_packed(other._p):
            raise _fail("mulmat_id", "operands must not be transposed (call .contiguous())", self, other)
        _check_size("mulmat_id", DType.F32, (a[1], i[0], i[1], 1))
        ctx = self._ctx_with(other, "mulmat_id")
        self._same_graph(ctx, "mulmat_id", ids)
        ctx._index_bound(ids, a[2], "mulmat_id")
        return Tensor(lib.ggml_mul_mat_id(ctx._state.ptr, self._p, other._p, ids._p), ctx, 3)

    def add_id(self, bias: Tensor, ids: Tensor) -> Tensor:
        """Per-expert biases of a ``mulmat_id`` result: ``self`` (M, n_used, N) F32 gets row
        ``ids[u, n]`` of ``bias`` (M, n_experts) F32 added at (:, u, n); ``ids`` I32 (n_used, N)."""
        a, b, i = self._ne, bias._ne, ids._ne
        if ids._p.type != DType.I32:
            raise TypeError(f"add_id: ids must be I32, got {ids.dtype.name}")
        if self._p.type != DType.F32 or bias._p.type != DType.F32:
            raise TypeError(f"add_id: needs F32 operands, got {self.dtype.name} and {bias.dtype.name}")
        if a[0] != b[0] or a[1] != i[0] or a[2] != i[1] or a[3] != 1 or b[2] != 1 or b[3] != 1 or i[2] != 1 \
                or i[3] != 1:
            raise _fail("add_id", "expects (M, U, N) + bias (M, E) with ids (U, N)", self, bias, ids)
        if not _rows_packed(self._p) or not _rows_packed(bias._p):
            raise _fail("add_id", "operands need contiguous rows (call .contiguous())", self, bias)
        ctx = self._ctx_with(bias, "add_id")
        self._same_graph(ctx, "add_id", ids)
        ctx._index_bound(ids, b[1], "add_id")
        return Tensor(lib.ggml_add_id(ctx._state.ptr, self._p, bias._p, ids._p), ctx, self._nd, None, self._ne)

    # ---- shape and layout ------------------------------------------------------------------
    def reshape(self, *shape: int, ctx: Context | None = None) -> Tensor:
        """Same data, new shape (ggml order); the tensor must be contiguous."""
        n = len(shape)
        c = ctx or self.ctx
        if 0 < n <= 4 and c is not None:
            try:
                out = lib.pyg_reshape(c._g, self._p, n, *shape, *_ONES[n])
            except (TypeError, OverflowError):  # not ints, or a shape given as one tuple
                out = NULL
            if out:
                return _node(out, c, n)
        shape = _shape_arg(shape)
        if min(shape) <= 0:
            raise ValueError(f"reshape: bad shape {shape}")
        if math.prod(shape) != math.prod(self._ne):
            raise _fail("reshape", f"cannot reshape {self.nelements} elements into {shape}", self)
        p = self._p
        if not lib.ggml_is_contiguous(p):
            raise _fail("reshape", "tensor must be contiguous (call .contiguous())", self)
        if shape[0] % _BLOCK[p.type]:
            raise _fail("reshape", f"dim 0 must stay a multiple of the {self.dtype.name} block size", self)
        ctx = self._ctx_with(None, "reshape", ctx)
        c, n = ctx._state.ptr, len(shape)
        if n == 1:
            out = lib.ggml_reshape_1d(c, p, shape[0])
        elif n == 2:
            out = lib.ggml_reshape_2d(c, p, shape[0], shape[1])
        elif n == 3:
            out = lib.ggml_reshape_3d(c, p, shape[0], shape[1], shape[2])
        else:
            out = lib.ggml_reshape_4d(c, p, shape[0], shape[1], shape[2], shape[3])
        return Tensor(out, ctx, n, None, shape + _ONES[n])

    def view(self, offset: int, shape: Sequence[int], strides: Sequence[int] | None = None, *,
             ctx: Context | None = None) -> Tensor:
        """A view of ``shape`` starting ``offset`` bytes in; ``strides`` are the byte strides of
        dims 1.. (dim 0 stays contiguous). Defaults to the contiguous strides of ``shape``."""
        n = len(shape) if type(shape) is tuple else 0
        c = ctx or self.ctx
        if 0 < n <= 4 and (strides is None or len(strides) == n - 1) and c is not None:
            try:
                nb = (0, 0, 0) if strides is None else (*strides, *_ONES[n])
                out = lib.pyg_view(c._g, self._p, n, *shape, *_ONES[n], strides is None, *nb, offset)
            except (TypeError, OverflowError):
                out = NULL
            if out:
                return _node(out, c, n)
        shape = _shape_arg(tuple(shape))
        n = len(shape)
        p = self._p
        t = p.type
        block, size = _BLOCK[t], _TYPE_SIZE[t]
        if min(shape) <= 0 or offset < 0:
            raise _fail("view", f"bad shape {shape} or offset {offset}", self)
        if shape[0] % block:
            raise _fail("view", f"dim 0 must be a multiple of the {self.dtype.name} block size", self)
        row = shape[0] // block * size
        if strides is None:  # packed
            nb = [row]
            for s in shape[1:-1]:
                nb.append(nb[-1] * s)
            nb = nb[: n - 1]  # a 1-d view has no strides
        else:
            nb = [int(s) for s in strides]
        if len(nb) != n - 1 or (nb and min(nb) < 0):
            raise _fail("view", f"need {n - 1} non-negative strides for a {n}-d view, got {nb}", self)
        if offset % size or any(s % size for s in nb):
            raise _fail("view", f"offset {offset} and strides {nb} must be multiples of the {self.dtype.name} "
                        f"element size {size}", self)
        # ggml checks only a contiguous-size bound: check the strided extent ourselves.
        extent = offset + row
        for i in range(n - 1):
            extent += (shape[i + 1] - 1) * nb[i]
        nbytes = lib.ggml_nbytes(p)
        if extent > nbytes:
            raise _fail("view", f"view of {shape} at offset {offset} with strides {nb} reads {extent} bytes "
                        f"of a {nbytes}-byte tensor", self)
        # ...and ggml asserts that bound (row * rows after the offset, within the viewed base tensor),
        # which overlapping views with strides smaller than a packed layout can exceed
        packed = row * math.prod(shape[1:])
        base = p.view_src
        if base == NULL:
            too_big = offset + packed > nbytes
        else:
            too_big = offset + p.view_offs + packed > lib.ggml_nbytes(base)
        if too_big:
            raise _fail("view", f"ggml needs the packed size of {shape} ({packed} bytes) to fit after offset "
                        f"{offset}; use fewer rows or repeat() instead of overlapping strides", self)
        ctx = self._ctx_with(None, "view", ctx)
        c, p = ctx._state.ptr, self._p
        if n == 1:
            out = lib.ggml_view_1d(c, p, shape[0], offset)
        elif n == 2:
            out = lib.ggml_view_2d(c, p, shape[0], shape[1], nb[0], offset)
        elif n == 3:
            out = lib.ggml_view_3d(c, p, shape[0], shape[1], shape[2], nb[0], nb[1], offset)
        else:
            out = lib.ggml_view_4d(c, p, shape[0], shape[1], shape[2], shape[3], nb[0], nb[1], nb[2], offset)
        return Tensor(out, ctx, n, None, shape + _ONES[n])

    def permute(self, *axes: int, ctx: Context | None = None) -> Tensor:
        """Move dim i to position ``axes[i]`` (ggml's convention); e.g. ``permute(0, 2, 1, 3)``."""
        full = axes + _PERMUTE_TAIL[len(axes)] if len(axes) <= 4 else axes
        c = ctx or self.ctx
        if len(full) == 4 and c is not None:
            try:
                out = lib.pyg_permute(c._g, self._p, *full)
            except (TypeError, OverflowError):
                out = NULL
            if out:
                nd = self._nd
                top = 1 + max(full[:nd])
                return _node(out, c, top if top > nd else nd)
        if len(full) != 4 or sorted(full) != [0, 1, 2, 3]:
            raise _fail("permute", f"axes {axes} must be a permutation of 0..{max(len(axes), 1) - 1}", self)
        ctx = self._ctx_with(None, "permute", ctx)
        # as many dims as the highest one a real dim moves to (permute(0, 2, 1, 3) keeps a 3-d tensor 3-d)
        nd = max(self._nd, 1 + max(full[: self._nd]))
        a, ne = self._ne, [0, 0, 0, 0]
        for i in range(4):
            ne[full[i]] = a[i]
        return Tensor(lib.ggml_permute(ctx._state.ptr, self._p, *full), ctx, nd, None, tuple(ne))

    def transpose(self) -> Tensor:
        """Swap dims 0 and 1 (a view)."""
        ctx = self._ctx_with(None, "transpose")
        a = self._ne
        out = lib.ggml_transpose(ctx._state.ptr, self._p)
        return Tensor(out, ctx, max(self._nd, 2), None, (a[1], a[0], a[2], a[3]))

    def contiguous(self, *shape: int, ctx: Context | None = None) -> Tensor:
        """A contiguous copy (optionally reshaped to ``shape``)."""
        c = ctx or self.ctx
        if c is not None:
            out = lib.pyg_cont(c._g, self._p)
            if out:
                out = _node(out, c, self._nd)
                return out.reshape(*shape) if shape else out
        if self._ne[0] % _BLOCK[self._p.type]:
            raise _fail("contiguous", f"a {self.dtype.name} copy needs dim 0 to be a multiple of the block size "
                        f"{_BLOCK[self._p.type]} (cast to F32 first)", self)
        ctx = self._ctx_with(None, "contiguous", ctx)
        out = Tensor(lib.ggml_cont(ctx._state.ptr, self._p), ctx, self._nd, None, self._ne)
        return out.reshape(*shape) if shape else out

    def concat(self, other: Tensor, dim: int) -> Tensor:
        if not 0 <= dim < 4:
            raise ValueError(f"concat: dim {dim} not in 0..3")
        if self._p.type != other._p.type:
            raise TypeError(f"concat: types differ ({self.dtype.name} vs {other.dtype.name})")
        if any(self._ne[i] != other._ne[i] for i in range(4) if i != dim):
            raise _fail("concat", f"all dims but {dim} must be equal", self, other)
        _check_size("concat", self.dtype, [n + (other._ne[i] if i == dim else 0) for i, n in enumerate(self._ne)])
        ctx = self._ctx_with(other, "concat")
        return Tensor(lib.ggml_concat(ctx._state.ptr, self._p, other._p, dim), ctx, max(self._nd, other._nd, dim + 1))

    def pad(self, *padding: int) -> Tensor:
        """Append ``padding[i]`` zeros at the end of dim i."""
        p = tuple(padding) + (0,) * (4 - len(padding))
        if len(p) != 4 or any(x < 0 for x in p):
            raise ValueError(f"pad: need up to 4 non-negative amounts, got {padding}")
        if self._p.type != DType.F32:
            raise TypeError(f"pad: needs an F32 tensor, got {self.dtype.name}")
        _check_c_int("pad", padding=max(p))
        _check_size("pad", DType.F32, [n + x for n, x in zip(self._ne, p, strict=True)])
        ctx = self._ctx_with(None, "pad")
        return Tensor(lib.ggml_pad(ctx._state.ptr, self._p, *p), ctx, max(self._nd, len(padding)))

    def repeat(self, *shape: int) -> Tensor:
        """Tile to ``shape`` (each dim of ``shape`` a multiple of this tensor's)."""
        shape = _shape_arg(shape)
        full = shape + (1,) * (4 - len(shape))
        if any(full[i] <= 0 or full[i] % self._ne[i] for i in range(4)):
            raise _fail("repeat", f"target {shape} must be a multiple of the shape in every dim", self)
        if self._p.type not in _FLOAT:
            raise TypeError(f"repeat: needs F32/F16/BF16, got {self.dtype.name}")
        _check_size("repeat", self.dtype, full)
        if not _rows_packed(self._p):
            raise _fail("repeat", "rows must be contiguous (call .contiguous())", self)
        ctx = self._ctx_with(None, "repeat")
        return Tensor(lib.ggml_repeat_4d(ctx._state.ptr, self._p, *full), ctx, max(self._nd, len(shape)))

    def copy(self, dst: Tensor) -> Tensor:
        """Copy (converting type) into ``dst``; returns the node that performs the copy."""
        if self.nelements != dst.nelements:
            raise _fail("copy", "element counts differ", self, dst)
        _check_convert("copy", self.dtype, dst.dtype)
        # conversions through a per-row F32 scratch: ggml sizes it by the destination's rows but fills it
        # with the source's (a longer source row overflows the heap)
        pair = {self._p.type, dst._p.type}
        if self._ne[0] != dst._ne[0] and (dst.dtype.is_quantized or pair in ({DType.F16, DType.BF16},
                                                                              {DType.F32, DType.I32})):
            raise _fail("copy", f"converting {self.dtype.name} to {dst.dtype.name} needs rows of equal length "
                        "(reshape the source to the destination's dim 0)", self, dst)
        if dst._ne[0] % dst.dtype.block_size:
            raise _fail("copy", f"destination rows must be a multiple of the {dst.dtype.name} block size", self, dst)
        if dst.dtype.is_quantized and (self._ne[0] % dst.dtype.block_size or not lib.ggml_is_contiguous(dst._p)
                                       or not _rows_packed(self._p)):
            raise _fail("copy", f"quantizing to {dst.dtype.name} needs a contiguous destination and source rows "
                        "of whole blocks (call .contiguous())", self, dst)
        if self.dtype.is_quantized and (self._ne[0] % self.dtype.block_size or not _rows_packed(dst._p) or (
                dst._ne[0] % self.dtype.block_size and not lib.ggml_is_contiguous(dst._p))):
            raise _fail("copy", f"dequantizing {self.dtype.name} needs whole blocks per source row and a "
                        "destination with packed rows of whole blocks (or contiguous)", self, dst)
        _check_writable(dst, "copy")
        ctx = self._ctx_with(dst, "copy")
        return Tensor(lib.ggml_cpy(ctx._state.ptr, self._p, dst._p), ctx, dst._nd, None, dst._ne)

    def cast(self, dtype: DType | str, *, ctx: Context | None = None) -> Tensor:
        dtype = DType.parse(dtype)
        _check_convert("cast", self.dtype, dtype)
        if self._ne[0] % dtype.block_size:
            raise _fail("cast", f"dim 0 must be a multiple of the {dtype.name} block size", self)
        if dtype.is_quantized and not _rows_packed(self._p):
            raise _fail("cast", f"quantizing to {dtype.name} needs contiguous rows (call .contiguous())", self)
        ctx = self._ctx_with(None, "cast", ctx)
        return Tensor(lib.ggml_cast(ctx._state.ptr, self._p, dtype), ctx, self._nd, None, self._ne)

    # ---- indexing --------------------------------------------------------------------------
    def rows(self, indices: Tensor, *, ctx: Context | None = None) -> Tensor:
        """Gather rows: ``self`` (K, R[, B]) and I32 ``indices`` (N[, B]) give (K, N[, B]) in F32."""
        c = ctx or self.ctx or indices.ctx
        if c is not None:
            out = lib.pyg_get_rows(c._g, self._p, indices._p)
            if out:
                c._index_bound(indices, self._ne[1], "rows")
                nd = indices._nd + 1
                return _node(out, c, nd if nd > self._nd else self._nd)
        a, i = self._ne, indices._ne
        if indices._p.type != DType.I32:
            raise TypeError(f"rows: indices must be I32, got {indices.dtype.name}")
        t = self._p.type
        if t in (DType.I8, DType.I16, DType.I64, DType.F64) or t in _NO_TO_FLOAT or t in _INTERMEDIATE:
            raise TypeError(f"rows: ggml cannot gather rows of a {self.dtype.name} table")
        if a[2] != i[1] or a[3] != i[2] or i[3] != 1:
            raise _fail("rows", "indices must be (n, dim2, dim3) matching the table's dims 2 and 3", self, indices)
        _check_size("rows", DType.F32, (a[0], i[0], i[1], i[2]))
        ctx = self._ctx_with(indices, "rows", ctx)
        ctx._index_bound(indices, a[1], "rows")
        return Tensor(lib.ggml_get_rows(ctx._state.ptr, self._p, indices._p), ctx, max(self._nd, indices._nd + 1))

    def set_rows(self, src: Tensor, indices: Tensor, *, ctx: Context | None = None) -> Tensor:
        """Scatter: row ``indices[j]`` of ``self`` becomes row j of ``src`` (converting type).
        Returns a view of ``self`` to add to the graph."""
        c = ctx or self.ctx or src.ctx
        if c is not None:
            out = lib.pyg_set_rows(c._g, self._p, src._p, indices._p)
            if out:
                c._index_bound(indices, self._ne[1], "set_rows")
                return _node(out, c, self._nd)
        a, b, i = self._ne, src._ne, indices._ne
        if src._p.type not in (DType.F32, DType.F16):
            raise TypeError(f"set_rows: src must be F32 or F16, got {src.dtype.name}")
        if indices._p.type not in (DType.I32, DType.I64):
            raise TypeError(f"set_rows: indices must be I32 or I64, got {indices.dtype.name}")
        if a[0] != b[0] or b[1] != i[0] or b[2] % a[2] or b[3] % a[3] or i[1] != b[2] or i[2] != b[3]:
            raise _fail("set_rows", "need dst (K, R, ...), src (K, N, ...), indices (N, ...)", self, src, indices)
        _check_convert("set_rows", DType.F32, self.dtype)
        if not _rows_packed(src._p):
            raise _fail("set_rows", "src rows must be contiguous (call .contiguous())", self, src)
        _check_writable(self, "set_rows")
        ctx = self._ctx_with(src, "set_rows", ctx)
        self._same_graph(ctx, "set_rows", indices)
        ctx._index_bound(indices, a[1], "set_rows")
        return Tensor(lib.ggml_set_rows(ctx._state.ptr, self._p, src._p, indices._p), ctx, self._nd)

    def top_k(self, k: int) -> Tensor:
        """Indices (I32) of the ``k`` largest values of each row, in no particular order."""
        if not 0 < k <= self._ne[0]:
            raise _fail("top_k", f"k={k} must be in 1..{self._ne[0]}", self)
        if self._p.type != DType.F32:
            raise TypeError(f"top_k: needs F32, got {self.dtype.name}")
        if not _rows_uniform(self._p, self._ne):
            raise _fail("top_k", "rows must be contiguous and evenly spaced (call .contiguous())", self)
        ctx = self._ctx_with(None, "top_k")
        return Tensor(lib.ggml_top_k(ctx._state.ptr, self._p, int(k)), ctx, self._nd)

    def argsort(self, descending: bool = False) -> Tensor:
        """Indices (I32) that sort each row."""
        if self._p.type != DType.F32:
            raise TypeError(f"argsort: needs F32, got {self.dtype.name}")
        if not _rows_uniform(self._p, self._ne):
            raise _fail("argsort", "rows must be contiguous and evenly spaced (call .contiguous())", self)
        ctx = self._ctx_with(None, "argsort")
        order = lib.GGML_SORT_ORDER_DESC if descending else lib.GGML_SORT_ORDER_ASC
        return Tensor(lib.ggml_argsort(ctx._state.ptr, self._p, order), ctx, self._nd)

    # ---- position encodings and attention --------------------------------------------------
    def rope(self, positions: Tensor, n_dims: int, base: float, scale: float = 1.0, *,
             mode: RopeType | int = RopeType.NORMAL, freq_factors: Tensor | None = None, n_ctx_orig: int = 0,
             ext_factor: float = 0.0, attn_factor: float = 1.0, beta_fast: float = 32.0,
             beta_slow: float = 1.0) -> Tensor:
        """Rotary position embedding of ``self`` (head_dim, n_heads, n_tokens) by I32 ``positions``
        (n_tokens,). ``scale`` is the frequency scale (1/linear factor); YaRN via ext_factor etc."""
        c = self.ctx or positions.ctx
        if c is not None:
            try:
                out = lib.pyg_rope(c._g, self._p, positions._p, NULL if freq_factors is None else freq_factors._p,
                                   n_dims, mode, n_ctx_orig, base, scale, ext_factor, attn_factor, beta_fast,
                                   beta_slow)
            except (TypeError, OverflowError):
                out = NULL
            if out:
                return _node(out, c, self._nd)
        a = self._ne
        if positions._p.type != DType.I32:
            raise TypeError(f"rope: positions must be I32, got {positions.dtype.name}")
        if positions._nd != 1 or positions._ne[0] != a[2]:
            raise _fail("rope", f"positions must be 1-d with one entry per token (dim 2 = {a[2]})", self, positions)
        if n_dims <= 0 or n_dims % 2 or n_dims > a[0]:
            raise _fail("rope", f"n_dims={n_dims} must be even and at most dim 0", self)
        if self._p.type not in (DType.F32, DType.F16):
            raise TypeError(f"rope: needs F32 or F16, got {self.dtype.name}")
        if not _rows_packed(self._p):
            raise _fail("rope", "rows must be contiguous (call .contiguous())", self)
        if int(mode) not in (RopeType.NORMAL, RopeType.NEOX):
            raise ValueError(f"rope: mode must be RopeType.NORMAL or RopeType.NEOX, got {mode}")
        _check_c_int("rope", n_dims=n_dims, n_ctx_orig=n_ctx_orig)
        fp = NULL
        if freq_factors is not None:
            if freq_factors._p.type != DType.F32 or freq_factors._ne[0] < n_dims // 2:
                raise _fail("rope", f"freq_factors must be F32 with at least n_dims/2 = {n_dims // 2} entries",
                            self, freq_factors)
            fp = freq_factors._p
        ctx = self._ctx_with(positions, "rope")
        self._same_graph(ctx, "rope", freq_factors)
        out = lib.ggml_rope_ext(ctx._state.ptr, self._p, positions._p, fp, int(n_dims), int(mode), int(n_ctx_orig),
                                float(base), float(scale), float(ext_factor), float(attn_factor),
                                float(beta_fast), float(beta_slow))
        return Tensor(out, ctx, self._nd, None, self._ne)

    def scaled_dot_product_attention(self, key: Tensor, value: Tensor, mask: Tensor | None, scale: float, *,
                                     flash: bool = False, softcap: float = 0.0, sinks: Tensor | None = None) -> Tensor:
        """Attention of queries ``self`` (head_dim, n_tokens, n_heads) over ``key``
        (head_dim, n_kv, n_kv_heads) and ``value`` (head_dim_v, n_kv, n_kv_heads), with an additive
        ``mask`` (n_kv, >= n_tokens). Returns (head_dim_v, n_heads, n_tokens).

        ``flash=True`` uses ggml_flash_attn_ext (the mask is converted to F16); otherwise
        softmax(K^T Q * scale + mask) V with plain ops. ``sinks`` (n_heads,) F32: one learned logit
        per head that joins every row's softmax and takes probability mass without a value (gpt-oss).
        """
        ctx = self.ctx or key.ctx
        if ctx is not None and not softcap and sinks is None and type(scale) is float:
            out = lib.pyg_attention(ctx._g, self._p, key._p, value._p, NULL if mask is None else mask._p, scale,
                                    flash)
            if out:
                if flash:  # the result is reshaped to (Dv, H, T[, B])
                    return _node(out, ctx, 4 if self._ne[3] > 1 else 3)
                nd = max(self._nd, key._nd, value._nd)
                return _node(out, ctx, nd if nd > 3 else 3)
        q, k, v = self._ne, key._ne, value._ne
        if q[0] != k[0] or k[1] != v[1] or k[2] != v[2] or q[2] % k[2] or q[3] != k[3] or k[3] != v[3]:
            raise _fail("scaled_dot_product_attention",
                        "need q (D, T, H), k (D, KV, Hkv), v (Dv, KV, Hkv) with H a multiple of Hkv",
                        self, key, value)
        if mask is not None:
            m = mask._ne
            if m[0] != k[1] or m[1] < q[1] or q[2] % m[2] or q[3] % m[3]:
                raise _fail("scaled_dot_product_attention", "mask must be (n_kv, >= n_tokens)",
                            self, key, mask)
        if sinks is not None and (sinks._p.type != DType.F32 or sinks._nd != 1 or sinks._ne[0] != q[2]):
            raise _fail("scaled_dot_product_attention", f"sinks must be F32 of shape ({q[2]},): one per head",
                        self, sinks)
        ctx = self._ctx_with(key, "scaled_dot_product_attention")
        self._same_graph(ctx, "scaled_dot_product_attention", value, mask, sinks)
        if flash:
            # ggml's CPU kernel reads q as F32 and needs packed rows, a K with a dot product and a V it can
            # convert to float
            if self._p.type != DType.F32 or key._p.type in _NOT_MATMUL or value._p.type in _NOT_MATMUL:
                raise TypeError(f"scaled_dot_product_attention: flash needs F32 queries and float or quantized "
                                f"K/V, got {self.dtype.name}, {key.dtype.name}, {value.dtype.name}")
            if not (_rows_packed(self._p) and _rows_packed(key._p) and _rows_packed(value._p)):
                raise _fail("scaled_dot_product_attention", "flash needs q, k and v with contiguous rows",
                            self, key, value)
            mp = NULL
            if mask is not None:
                if mask._p.type != DType.F16:
                    mask = mask.cast(DType.F16)
                elif not lib.ggml_is_contiguous(mask._p):
                    mask = mask.contiguous()
                mp = mask._p
            out = lib.ggml_flash_attn_ext(ctx._state.ptr, self._p, key._p, value._p, mp, float(scale), 0.0,
                                          float(softcap))
            lib.ggml_prec_set_acc(out, lib.GGML_PREC_F32)
            if sinks is not None:
                lib.ggml_flash_attn_ext_add_sinks(out, sinks._p)
            return Tensor(out, ctx, 4).reshape(v[0], q[2], q[1], *((q[3],) if q[3] > 1 else ()))
        scores = key.mulmat(self)  # (KV, T, H)
        if softcap:
            scores = scores.scale(scale / softcap).tanh().scale(softcap)
            scale = 1.0
        if mask is not None and not lib.ggml_is_contiguous(mask._p):
            mask = mask.contiguous()
        probs = scores.softmax(mask, scale)
        if sinks is not None:
            lib.ggml_soft_max_add_sinks(probs._p, sinks._p)
        if value.dtype.is_quantized:  # a quantized V cannot be transposed block-wise: dequantize it
            value = value.cast(DType.F32, ctx=ctx)
        v_t = value.permute(1, 0, 2, 3)  # (KV, Dv, Hkv): a copy unless the cache stores V transposed
        if not _rows_packed(v_t._p):
            v_t = v_t.contiguous()
        out = v_t.mulmat(probs)  # (Dv, T, H)
        return out.permute(0, 2, 1, 3).contiguous()  # (Dv, H, T)

    # ---- recurrent layers ------------------------------------------------------------------
    def gated_delta_net(self, key: Tensor, value: Tensor, gate: Tensor, beta: Tensor,
                        state: Tensor) -> tuple[Tensor, Tensor]:
        """The gated delta rule (Gated DeltaNet's linear attention) over ``n_tokens`` steps of
        ``n_seqs`` sequences: per value head, the state S (S_v, S_v) decays by ``exp(gate)``, learns
        ``beta * (v - S k)`` along ``k``, and answers ``S q / sqrt(S_k)``. ``self`` (the query) and
        ``key`` are (S_k, H_k, n_tokens, n_seqs) with S_k == S_v; ``value`` (S_v, H_v, n_tokens,
        n_seqs), value head h reading key head ``h % H_k``; ``gate`` (1, H_v, n_tokens, n_seqs) in log
        space; ``beta`` (1, H_v, n_tokens, n_seqs); ``state`` (S_v, S_v, H_v, n_seqs), each sequence's
        initial state (stored transposed). All F32. Returns (output (S_v, H_v, n_tokens, n_seqs), final
        state shaped like ``state``), views of one result."""
        q, k, v, g, b, s = (t._ne for t in (self, key, value, gate, beta, state))
        sv, h, n, seqs = v
        if q != k or q[0] != sv or h % q[1] or q[2] != n or seqs % q[3] or g != (1, h, n, seqs) or \
                b != (1, h, n, seqs) or s != (sv, sv, h, seqs):
            raise _fail("gated_delta_net", "expects q, k (S, H_k, T, N), v (S, H_v, T, N) with H_k | H_v, gate and "
                        "beta (1, H_v, T, N), state (S, S, H_v, N)", self, key, value, gate, beta, state)
        operands = (self, key, value, gate, beta, state)
        if any(t._p.type != DType.F32 for t in operands):
            raise TypeError("gated_delta_net: needs F32 operands, got " + ", ".join(t.dtype.name for t in operands))
        if not all(_rows_packed(t._p) for t in (self, key, value)) or \
                not all(lib.ggml_is_contiguous(t._p) for t in (gate, beta, state)):
            raise _fail("gated_delta_net", "q, k, v need contiguous rows and gate, beta, state must be contiguous "
                        "(call .contiguous())", *operands)
        _check_size("gated_delta_net", DType.F32, (sv * h, n * seqs + sv * seqs, 1, 1))
        ctx = self._ctx_with(key, "gated_delta_net")
        self._same_graph(ctx, "gated_delta_net", value, gate, beta, state)
        packed = Tensor(lib.ggml_gated_delta_net(ctx._state.ptr, self._p, key._p, value._p, gate._p, beta._p,
                                                 state._p, 1), ctx, 2)
        out = packed.view(0, (sv, h, n, seqs))
        return out, packed.view(4 * sv * h * n * seqs, (sv, sv, h, seqs))

    # ---- convolution and pooling (vision encoders) -----------------------------------------
    def im2col(self, kernel: Tensor, s0: int, s1: int, p0: int, p1: int, d0: int, d1: int, *,
               is_2d: bool = True, dtype: DType = DType.F32) -> Tensor:
        """Unfold ``self`` (W, H, C, N) into patches for the kernel (KW, KH, C, OC)."""
        if any(x <= 0 for x in (s0, s1, d0, d1)) or p0 < 0 or p1 < 0:
            raise ValueError("im2col: strides and dilations must be positive, paddings non-negative")
        _check_c_int("im2col", s0=s0, s1=s1, p0=p0, p1=p1, d0=d0, d1=d1)
        k, x = kernel._ne, self._ne
        if (is_2d and k[2] != x[2]) or (not is_2d and (k[1] != x[1] or x[3] != 1)):
            raise _fail("im2col", "kernel channels (dim 2, or dim 1 for 1-d) must equal input channels",
                        kernel, self)
        w_out = (x[0] + 2 * p0 - d0 * (k[0] - 1) - 1) // s0 + 1
        h_out = (x[1] + 2 * p1 - d1 * (k[1] - 1) - 1) // s1 + 1 if is_2d else 1
        if w_out <= 0 or h_out <= 0:
            raise _fail("im2col", "kernel larger than the padded input", kernel, self)
        _check_size("im2col", DType.F32, (k[0] * k[1] * k[2], w_out, h_out, x[3]))
        dtype = DType.parse(dtype)
        if dtype not in (DType.F32, DType.F16) or self._p.type not in (DType.F32, dtype):
            raise TypeError(f"im2col: needs an F32 output from an F32 input, or F16 from F32/F16; got "
                            f"{dtype.name} from {self.dtype.name}")
        if not _rows_packed(self._p):
            raise _fail("im2col", "the input needs contiguous rows (call .contiguous())", kernel, self)
        ctx = self._ctx_with(kernel, "im2col")
        return Tensor(lib.ggml_im2col(ctx._state.ptr, kernel._p, self._p, s0, s1, p0, p1, d0, d1, is_2d, dtype), ctx, 4)

    def conv_2d(self, kernel: Tensor, s0: int = 1, s1: int = 1, p0: int = 0, p1: int = 0, d0: int = 1,
                d1: int = 1) -> Tensor:
        """2-D convolution of ``self`` (W, H, C, N) with ``kernel`` (KW, KH, C, OC) -> (OW, OH, OC, N)."""
        if any(x <= 0 for x in (s0, s1, d0, d1)) or p0 < 0 or p1 < 0:
            raise ValueError("conv_2d: strides and dilations must be positive, paddings non-negative")
        _check_c_int("conv_2d", s0=s0, s1=s1, p0=p0, p1=p1, d0=d0, d1=d1)
        if kernel._ne[2] != self._ne[2]:
            raise _fail("conv_2d", "kernel channels (dim 2) must equal input channels", kernel, self)
        w_out = (self._ne[0] + 2 * p0 - d0 * (kernel._ne[0] - 1) - 1) // s0 + 1
        h_out = (self._ne[1] + 2 * p1 - d1 * (kernel._ne[1] - 1) - 1) // s1 + 1
        if w_out <= 0 or h_out <= 0:
            raise _fail("conv_2d", "kernel larger than the padded input", kernel, self)
        k = kernel._ne
        _check_size("conv_2d", DType.F32, (k[0] * k[1] * k[2], w_out, h_out, self._ne[3]))
        # ggml unfolds the input to F16 (to F32 for a BF16 kernel) and multiplies by the reshaped kernel
        tk, tx = kernel._p.type, self._p.type
        if tk not in _FLOAT or tx not in (DType.F32, DType.F16) or (tk == DType.BF16 and tx != DType.F32):
            raise TypeError(f"conv_2d: needs an F32/F16/BF16 kernel and an F32/F16 input (F32 with BF16), got "
                            f"{kernel.dtype.name} and {self.dtype.name}")
        if not lib.ggml_is_contiguous(kernel._p):
            raise _fail("conv_2d", "the kernel must be contiguous (call .contiguous())", kernel, self)
        if not _rows_packed(self._p):
            raise _fail("conv_2d", "the input needs contiguous rows (call .contiguous())", kernel, self)
        ctx = self._ctx_with(kernel, "conv_2d")
        return Tensor(lib.ggml_conv_2d(ctx._state.ptr, kernel._p, self._p, s0, s1, p0, p1, d0, d1), ctx, 4)

    def avg_pool_2d(self, kernel: int, stride: int, padding: float = 0.0) -> Tensor:
        if not isinstance(kernel, (int, np.integer)) or not isinstance(stride, (int, np.integer)) or kernel <= 0 \
                or stride <= 0:
            raise ValueError(f"avg_pool_2d: kernel and stride must be positive integers, got {kernel!r}, {stride!r}")
        _check_c_int("avg_pool_2d", kernel=kernel, stride=stride)
        # ggml computes the output size with the float padding (NaN/inf make it garbage and abort) and the
        # kernel with it truncated to an int
        if not isinstance(padding, (int, float, np.integer, np.floating)) or not 0 <= padding <= kernel / 2:
            raise ValueError(f"avg_pool_2d: padding must be a number from 0 to kernel/2 = {kernel / 2}, "
                             f"got {padding!r}")
        if kernel > self._ne[0] + 2 * padding or kernel > self._ne[1] + 2 * padding:
            raise _fail("avg_pool_2d", f"kernel {kernel} larger than the input", self)
        if self._p.type not in (DType.F32, DType.F16):
            raise TypeError(f"avg_pool_2d: needs F32 or F16, got {self.dtype.name}")
        if not lib.ggml_is_contiguous(self._p):
            raise _fail("avg_pool_2d", "input must be contiguous (call .contiguous())", self)
        ctx = self._ctx_with(None, "avg_pool_2d")
        out = lib.ggml_pool_2d(ctx._state.ptr, self._p, lib.GGML_OP_POOL_AVG, kernel, kernel, stride, stride,
                               float(padding), float(padding))
        return Tensor(out, ctx, max(self._nd, 2))

    # ---- state-space scans -------------------------------------------------------------------
    def ssm_scan(self, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, states: Tensor,
                 ids: Tensor) -> tuple[Tensor, Tensor]:
        """Mamba's selective scan over T steps of N sequences (``ggml_ssm_scan``). ``self`` (x) is
        (head_dim, n_head, T, N); ``dt`` (n_head, T, N), before the softplus the op applies; ``a``
        (1, n_head) (Mamba-2: one decay per head) or (d_state, n_head) (Mamba-1); ``b`` and ``c``
        (d_state, n_group, T, N), head h reading group ``h // (n_head / n_group)``; ``states``
        (d_state, head_dim, n_head, units), sequence i starting from unit ``ids[i]`` (I32 (N,), bounded
        as ``rows``' indices: a graph input is checked at each compute). Per head and step:
        ``s = s * exp(softplus(dt) * a) + softplus(dt) * x b^T``, ``y = s c``. All F32; rows of x, b, c
        packed, the rest contiguous. Returns (y (head_dim, n_head, T, N), the final states (d_state,
        head_dim, n_head, N)), views of one result."""
        x, n_state = self._ne, states._ne[0]
        hd, nh, t, n = x
        ng = b._ne[1]
        if dt._ne != (nh, t, n, 1) or b._ne != c._ne or b._ne != (n_state, ng, t, n) or nh % ng or \
                states._ne[1:3] != (hd, nh) or ids._ne != (n, 1, 1, 1) or a._ne[1:] != (nh, 1, 1) or \
                a._ne[0] not in (1, n_state):
            raise _fail("ssm_scan", "expects x (head_dim, n_head, T, N), dt (n_head, T, N), a (1 or d_state, "
                        "n_head), b and c (d_state, n_group, T, N) with n_group | n_head, states (d_state, "
                        "head_dim, n_head, units), ids (N,)", self, dt, a, b, c, states, ids)
        operands = (self, dt, a, b, c, states)
        if any(o._p.type != DType.F32 for o in operands) or ids._p.type != DType.I32:
            raise TypeError("ssm_scan: needs F32 operands and I32 ids, got " +
                            ", ".join(o.dtype.name for o in (*operands, ids)))
        if not all(_rows_packed(o._p) and o._p.nb[1] == o._ne[0] * o._p.nb[0] for o in (self, b, c)) or \
                not all(lib.ggml_is_contiguous(o._p) for o in (dt, a, states)):
            raise _fail("ssm_scan", "x, b and c need packed rows of packed heads; dt, a and states must be "
                        "contiguous (call .contiguous())", *operands)
        _check_size("ssm_scan", DType.F32, (hd * nh, t * n + n_state * n, 1, 1))
        ctx = self._ctx_with(dt, "ssm_scan")
        self._same_graph(ctx, "ssm_scan", a, b, c, states, ids)
        ctx._index_bound(ids, states._ne[3], "ssm_scan")  # ggml reads the units at ids unchecked
        packed = Tensor(lib.ggml_ssm_scan(ctx._state.ptr, states._p, self._p, dt._p, a._p, b._p, c._p, ids._p, 1),
                        ctx, 1)
        y = packed.view(0, (hd, nh, t, n))
        return y, packed.view(4 * hd * nh * t * n, (n_state, hd, nh, n))


def _check_convert(op: str, src: DType, dst: DType) -> None:
    """The conversions ggml's CPU copy implements (others abort inside a compute)."""
    if src in _FLOAT:
        ok = dst in _FLOAT or (dst == DType.I32 and src == DType.F32) or (
            dst.is_quantized and dst not in _NO_FROM_FLOAT)
    elif src == DType.I32:
        ok = dst in (DType.F32, DType.I32)
    elif src.is_quantized:
        ok = dst == DType.F32 and src not in _NO_TO_FLOAT and src not in _INTERMEDIATE
    else:
        ok = False
    if not ok:
        raise TypeError(f"{op}: ggml cannot convert {src.name} to {dst.name}")


def _rows_packed(p: Any) -> bool:
    """dim 0 is packed (``nb[0]`` is the type size). ggml_is_contiguous_rows also accepts any
    ``nb[0]`` when ``ne[0]`` is 1, but the CPU kernels assert the stricter form."""
    return p.nb[0] == _TYPE_SIZE[p.type]


def _rows_uniform(p: Any, ne: tuple[int, ...]) -> bool:
    """ggml_is_padded_1d: packed rows, row i at ``i * nb[1]`` (kernels that walk ``nrows`` need it)."""
    nb = tuple(p.nb)
    return nb[0] == _TYPE_SIZE[p.type] and nb[2] == nb[1] * ne[1] and nb[3] == nb[2] * ne[2]


def _contiguous_1(p: Any) -> bool:
    """ggml_is_contiguous_1 (rows contiguous, dims 2 and 3 packed after dim 1, which may be
    strided), with dim 0 packed as the kernels assert."""
    ne, nb = p.ne, p.nb
    if nb[0] != _TYPE_SIZE[p.type]:
        return False
    next_nb = ne[1] * nb[1]
    for i in (2, 3):
        if ne[i] != 1 and nb[i] != next_nb:
            return False
        next_nb *= ne[i]
    return True


def _check_writable(t: Tensor, op: str) -> None:
    # an integer graph input may be an index tensor whose data is range-checked at compute: a write into it
    # in the graph would change the values after the check
    root = t._p.view_src if t._p.view_src != NULL else t._p
    if root.type in _INT_TYPES and root.op == _OP["NONE"] and root.flags & lib.GGML_TENSOR_FLAG_INPUT:
        raise ValueError(f"{op}: cannot write into an integer graph input (it may be an index checked at compute); "
                         "write into a new tensor, or give the input its data with set()/set_input()")
    keep = t._keep
    if t.ctx is None and keep is not None:
        if t._p in getattr(keep, "_weight_ptrs", ()):
            raise ValueError(f"{op}: cannot write into model weight {t.name!r} (it may be a read-only file mapping)")


_new_object = object.__new__


def _node(ptr: Any, ctx: Context, nd: int) -> Tensor:
    """A graph node made by a checked C op (its shape is read from ggml when first asked for)."""
    t = _new_object(Tensor)
    t._p = ptr
    t.ctx = ctx
    t._nd = nd
    t._keep = None
    return t


def _check_alive(t: Tensor, op: str, no_repacked: bool = False) -> None:
    """A weight or cache tensor must belong to an open backend; a weight the CPU backend repacked
    can only be the left operand of mulmat (a matrix) or mulmat_id (a stack of experts): ggml has no
    other kernel for it and would abort."""
    keep = t._keep
    if keep is not None:
        if getattr(keep, "_closed", False):
            raise ValueError(f"{op}: the tensor belongs to a closed backend")
        if no_repacked and t._p in getattr(keep, "_repacked_ptrs", ()):
            only = "mulmat_id(x, ids)" if t._p.ne[2] != 1 else "mulmat(x)"
            raise ValueError(f"{op}: weight {t.name!r} was repacked for the CPU matrix kernels; only "
                             f"{t.name}.{only} can use it (load with BackendParams(repack=False) otherwise)")


def _shape_arg(shape: tuple) -> tuple[int, ...]:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    if not 1 <= len(shape) <= 4:
        raise ValueError(f"shape must have 1 to 4 dims, got {shape}")
    return tuple(map(int, shape))


_INT_LIMITS: dict[np.dtype, tuple[int, int]] = {}


def _int_limits(np_dtype: np.dtype) -> tuple[int, int]:
    """(min, max) of an integer dtype; cached: ``np.iinfo`` costs more than a decode step's inputs."""
    limits = _INT_LIMITS.get(np_dtype)
    if limits is None:
        info = np.iinfo(np_dtype)
        limits = _INT_LIMITS[np_dtype] = (int(info.min), int(info.max))
    return limits


def _prepare_host_array(array: Any, dtype: DType, shape: tuple[int, ...], op: str) -> np.ndarray:
    """A C-contiguous array holding exactly the bytes ggml expects for (dtype, shape)."""
    if type(array) is not np.ndarray:  # (a decode step refills a graph's inputs with arrays: no numpy call for them)
        array = np.asarray(array)
    expected = tuple(reversed(shape))
    np_dtype = dtype.numpy_dtype
    if np_dtype is None:  # quantized/BF16: raw blocks, so the byte count is what must match
        if array.dtype != np.uint8 or array.nbytes != dtype.row_bytes(shape[0]) * math.prod(shape[1:]):
            raise TypeError(f"{op}: {dtype.name} data must be given as raw uint8 blocks "
                            f"({dtype.row_bytes(shape[0]) * math.prod(shape[1:])} bytes)")
        return np.ascontiguousarray(array)
    if math.prod(array.shape) != math.prod(expected):
        raise ValueError(f"{op}: data of shape {array.shape} does not fit a tensor of shape {shape} "
                         f"(numpy shape {expected})")
    if array.dtype != np_dtype:
        if array.dtype.kind == "f" and np_dtype.kind in "iu":
            raise TypeError(f"{op}: refusing to truncate {array.dtype} data into a {dtype.name} tensor")
        if array.dtype.kind in "iu" and np_dtype.kind in "iu" and array.size and not np.can_cast(array.dtype, np_dtype):
            (low, high), lo, hi = _int_limits(np_dtype), int(array.min()), int(array.max())
            if lo < low or hi > high:  # astype would wrap them around silently
                raise ValueError(f"{op}: {array.dtype} values in {lo}..{hi} do not fit a {dtype.name} tensor "
                                 f"({low}..{high})")
        array = array.astype(np_dtype)
    return array if array.ndim and array.flags.c_contiguous else np.ascontiguousarray(array)  # (0-d: 1-d)


def quantize(data: np.ndarray, dtype: DType | str) -> np.ndarray:
    """Quantize float rows (numpy layout: the last axis is ggml's dim 0) with ggml's own code.

    Returns the raw blocks as uint8, shaped like ``data`` with the last axis in bytes. Types
    that need an importance matrix (some IQ types) are refused.
    """
    dtype = DType.parse(dtype)
    data = np.ascontiguousarray(data, dtype=np.float32)
    if data.ndim == 0 or data.size == 0:
        raise ValueError("quantize: need a non-empty array")
    n_per_row = data.shape[-1]
    if n_per_row % dtype.block_size:
        raise ValueError(f"quantize: rows of {n_per_row} are not a multiple of the {dtype.name} block size "
                         f"{dtype.block_size}")
    if dtype in (DType.F32, DType.F16):
        return data.astype(dtype.numpy_dtype).view(np.uint8)
    if dtype in _INTERMEDIATE or not dtype.is_quantized:
        raise ValueError(f"quantize: ggml has no quantizer for {dtype.name}")
    if lib.ggml_quantize_requires_imatrix(dtype):
        raise ValueError(f"quantize: cannot quantize to {dtype.name} without an importance matrix")
    n_rows = data.size // n_per_row
    out = np.empty(data.shape[:-1] + (dtype.row_bytes(n_per_row),), dtype=np.uint8)
    lib.ggml_quantize_chunk(dtype, ffi.cast("float *", ffi.from_buffer(data)), ffi.from_buffer(out), 0, n_rows,
                            n_per_row, NULL)
    return out


def dequantize(raw: np.ndarray, dtype: DType | str, shape: Sequence[int]) -> np.ndarray:
    """Raw ``dtype`` data (as stored in a GGUF: uint8 blocks, or F32/F16/BF16 values) as float32,
    shaped ``tuple(reversed(shape))`` (``shape`` in ggml order), with ggml's own conversion."""
    dtype = DType.parse(dtype)
    shape = tuple(int(n) for n in shape)
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if not shape or min(shape) < 1 or shape[0] % dtype.block_size:
        raise ValueError(f"dequantize: shape {shape} is not whole {dtype.name} blocks")
    if raw.nbytes != dtype.row_bytes(shape[0]) * math.prod(shape[1:]):
        raise ValueError(f"dequantize: {raw.nbytes} bytes do not hold a {dtype.name} tensor of shape {shape}")
    out = np.empty(math.prod(shape), dtype=np.float32)
    if dtype == DType.F32:
        out[:] = raw.view(np.float32)
    elif dtype == DType.F16:
        out[:] = raw.view(np.float16)
    else:
        to_float = lib.ggml_get_type_traits(dtype).to_float
        if to_float == NULL or dtype in _NO_TO_FLOAT:
            raise ValueError(f"dequantize: ggml cannot convert {dtype.name} to float")
        to_float(ffi.from_buffer(raw), ffi.from_buffer("float[]", out), out.size)
    return out.reshape(tuple(reversed(shape)))
