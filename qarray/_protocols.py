"""How a QArray behaves inside NumPy code: the one dispatch table.

A QArray is integer codes plus the parameters that give them real values. In
NumPy code it follows three rules (the README's table lists every entry):

1. **Moving or selecting elements keeps it a QArray** (``STRUCTURAL``):
   reshape, transpose, concatenate, take, sort, min, where, ... act on the
   codes, and the parameters follow. Where they cannot follow (two inputs
   with different parameters, a per-channel axis cut across) the function
   raises TypeError naming the qarray op that takes output parameters.
2. **Questions about the real values get exact answers** (``EXACT`` and the
   comparison operators): ``==``, ``<``, ``array_equal``, ``isclose``,
   ``argmax``, ... compare the codes where the parameters agree, else the real
   values ``(q - zero_point) * scale`` computed exactly (float64, or Python
   fractions for 32-bit codes too wide for it). ``np.asarray(q)``,
   ``float(q)``, ``bool(q)``, ``format(q)`` give the dequantized values.
3. **Arithmetic raises TypeError** naming the qarray op (``ARITHMETIC`` for
   operators, any other NumPy function or ufunc): a quantized result needs
   output parameters (``qarray.add(a, b, scale=..., zero_point=..., dtype=...)``),
   and float math on the real values is ``np.f(q.dequantize())``, said out loud.

``install(QArray)`` puts the operators on the class from these tables.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from ._params import expand, normalize_axis, to_host

# -- conversions ------------------------------------------------------------------


def _values(q) -> np.ndarray:
    """The dequantized values as a NumPy array (0-d included); a device QArray
    must be brought over explicitly."""
    if q._backend.name != "numpy":
        raise TypeError(
            f"implicit conversion of a {q._backend.name} QArray to NumPy is not allowed; use .get() first"
        )
    return np.asarray(q.dequantize())


def array(q, dtype=None, copy=None):
    """``__array__``: the dequantized values, float32 (float64 when asked)."""
    if copy is False:
        raise ValueError("a QArray's values are computed from its codes: numpy cannot view them without a copy "
                         "(copy=False); use q.dequantize() or q.int_repr()")
    out = _values(q)
    if dtype is not None:
        d = np.dtype(dtype)
        if d.kind not in "fc":
            raise TypeError(
                f"numpy.asarray(q, {d.name}) would convert the dequantized values to {d.name}, not give the "
                f"codes; use q.int_repr() for the integer codes, or a float dtype for the values"
            )
        out = out.astype(d, copy=False)
    return out


def _scalar(q, what):
    if q.size != 1:
        raise TypeError(f"only length-1 arrays can be converted to Python scalars ({what} of a QArray of shape {q.shape})")
    return float(to_host(q.dequantize()).reshape(()))


def to_bool(q) -> bool:
    if q.size == 0:
        raise ValueError("The truth value of an empty array is ambiguous. Use `array.size > 0` to check that an "
                         "array is not empty.")
    if q.size > 1:
        raise ValueError("The truth value of an array with more than one element is ambiguous. Use a.any() or a.all()")
    return _scalar(q, "bool()") != 0


def to_format(q, spec: str) -> str:
    if q.ndim == 0:
        return format(_scalar(q, "format()"), spec)
    if spec:
        raise TypeError(f"unsupported format string {spec!r} for a QArray of shape {q.shape}; format its items")
    return str(q)


# -- exact real values and comparisons ------------------------------------------------


def _same_params(a, b) -> bool:
    """Both QArrays map codes to values the same way, element for element."""
    if a.dtype is not b.dtype or a.axis != b.axis or a.block_size != b.block_size:
        return False
    if a.axis is not None and a.shape != b.shape:
        return False
    return bool(np.array_equal(a.scale, b.scale) and np.array_equal(a.zero_point, b.zero_point)
                and np.array_equal(np.asarray(a.global_scale, object), np.asarray(b.global_scale, object)))


def _real(q):
    """The exact real values of ``q``: float64 where ``(q - z) * scale`` is exact
    in it (``|q - z| < 2**29``: a float32 scale has 24 significant bits), else
    an object array of Fractions (host)."""
    xp = q._backend.xp
    if q.dtype.kind == "float":  # element * scale (* NVFP4's tensor scale): exact in float64 (<= 4 + 4 + 24 bits)
        return q.dequantize(np.float64)
    d = q.data.astype(xp.int64) - q._backend.param(expand(q.zero_point.astype(np.int64), q.shape, q.axis,
                                                          q.block_size))
    s = q._backend.param(expand(q.scale.astype(np.float64), q.shape, q.axis, q.block_size))
    if q.dtype.bits <= 16 or int(to_host(abs(d).max(initial=0))) < 2**29:
        return d.astype(xp.float64) * s
    d, s = np.broadcast_arrays(to_host(d), to_host(s))
    return np.vectorize(lambda i, f: Fraction(int(i)) * Fraction(float(f)), otypes=[object])(d, s)


def _operand(v):
    """Another operand of a comparison: a QArray's exact values, else as it is."""
    from ._qarray import QArray

    return _real(v) if isinstance(v, QArray) else v


def compare(ufunc, a, b):
    """Elementwise ``ufunc`` (equal, less, ...) on real values: on the codes when
    both are QArrays with the same parameters, else on the exact values."""
    from ._qarray import QArray

    if isinstance(a, QArray) and isinstance(b, QArray) and _same_params(a, b):
        return ufunc(a.data, b.data)
    x, y = _operand(a), _operand(b)
    if isinstance(x, np.ndarray) and x.dtype == object or isinstance(y, np.ndarray) and y.dtype == object:
        x, y = (np.asarray(to_host(v), dtype=object) if hasattr(v, "shape") else v for v in (x, y))
        return np.asarray(ufunc(x, y), dtype=bool)
    return ufunc(x, y)


COMPARISONS = {"__eq__": np.equal, "__ne__": np.not_equal, "__lt__": np.less, "__le__": np.less_equal,
               "__gt__": np.greater, "__ge__": np.greater_equal}


# -- arithmetic: TypeError naming the op --------------------------------------------------
_OPS = {"+": "qarray.add(a, b, scale=..., zero_point=..., dtype=...)",
        "-": "qarray.sub(a, b, scale=..., zero_point=..., dtype=...)",
        "*": "qarray.mul(a, b, scale=..., zero_point=..., dtype=...) (or qarray.mul_scalar)",
        "@": "qarray.matmul(a, b, scale=..., zero_point=..., dtype=...) or qarray.linear",
        "unary -": "qarray.mul_scalar(q, -1, scale=..., zero_point=..., dtype=...)",
        "abs": "qarray.relu / qarray.clamp, or abs(q.dequantize())"}
ARITHMETIC = {"__add__": "+", "__radd__": "+", "__sub__": "-", "__rsub__": "-", "__mul__": "*", "__rmul__": "*",
              "__matmul__": "@", "__rmatmul__": "@", "__truediv__": "/", "__rtruediv__": "/",
              "__floordiv__": "//", "__rfloordiv__": "//", "__mod__": "%", "__rmod__": "%", "__pow__": "**",
              "__rpow__": "**", "__neg__": "unary -", "__abs__": "abs", "__invert__": "~", "__and__": "&",
              "__rand__": "&", "__or__": "|", "__ror__": "|", "__xor__": "^", "__rxor__": "^",
              "__lshift__": "<<", "__rlshift__": "<<", "__rshift__": ">>", "__rrshift__": ">>"}


def arithmetic_error(symbol: str) -> TypeError:
    use = _OPS.get(symbol)
    how = f"use {use}" if use else "there is no quantized op for it"
    return TypeError(f"QArray does not support {symbol}: a quantized result needs output parameters; {how}; "
                     f"for float math on the real values, dequantize first (q.dequantize() {symbol.split()[-1]} ...)")


_UFUNC_OPS = {"add": "+", "subtract": "-", "multiply": "*", "matmul": "@", "negative": "unary -",
              "absolute": "abs"}
_FUNCTION_OPS = {"dot": "qarray.matmul", "matmul": "qarray.matmul", "inner": "qarray.matmul",
                 "mean": "qarray.mean", "sum": "qarray.sum", "clip": "qarray.clamp", "maximum": "qarray.relu",
                 "exp": "qarray.exp", "tanh": "qarray.tanh"}


def _refuse(name: str) -> TypeError:
    op = _FUNCTION_OPS.get(name)
    hint = f"; for a quantized result use {op}" if op else ""
    return TypeError(f"numpy.{name} does not take QArrays: NumPy math on the real values is "
                     f"numpy.{name}(q.dequantize(), ...){hint}")


def ufunc(q, uf, method, *inputs, **kwargs):
    """``__array_ufunc__``: comparisons and ``positive``; everything else TypeError."""
    if method == "__call__" and not kwargs and len(inputs) == 2 and uf in COMPARISONS.values():
        return compare(uf, *inputs)
    if method == "__call__" and not kwargs and uf is np.positive:
        return inputs[0].copy()
    if method == "__call__" and uf.__name__ in _UFUNC_OPS:
        raise arithmetic_error(_UFUNC_OPS[uf.__name__])
    raise _refuse(uf.__name__ if method == "__call__" else f"{uf.__name__}.{method}")


# -- the NumPy functions that move or select elements ---------------------------------------------


def _per_tensor_or(q, axis, what):
    """The axis a per-axis QArray's reduction/sort may take: not its channel axis
    (codes of two channels are not comparable), never for blocked parameters."""
    if q.axis is None:
        return
    if q.block_size is not None or axis is None or normalize_axis(axis, q.ndim) == q.axis:
        raise TypeError(f"numpy.{what} of a QArray with per-channel or blocked parameters compares codes of "
                        f"different scales; use an axis other than its parameter axis {q.axis}, or requantize it "
                        "per-tensor first")


def _reduced_axis(q, axis, keepdims):
    """Where the parameter axis lands after reducing ``axis``."""
    if q.axis is None or keepdims:
        return q.axis
    return q.axis - (normalize_axis(axis, q.ndim) < q.axis)


def _codes_reduction(name):
    def run(q, axis=None, out=None, keepdims=False, **kwargs):
        if out is not None or kwargs:
            raise TypeError(f"numpy.{name} of a QArray takes axis= and keepdims= only")
        _per_tensor_or(q, axis, name)
        data = getattr(q._backend.xp, name)(q.data, axis=axis, keepdims=keepdims)
        if name.startswith("arg"):
            return data
        return q._with(data, axis=_reduced_axis(q, axis, keepdims), block_size=None)

    return run


def _sort(q, axis=-1, kind=None, order=None, **kwargs):
    _per_tensor_or(q, axis, "sort")
    return q._with(q._backend.xp.sort(q.data, axis=axis, kind=kind), axis=q.axis)


def _argsort(q, axis=-1, kind=None, order=None, **kwargs):
    _per_tensor_or(q, axis, "argsort")
    return q._backend.xp.argsort(q.data, axis=axis, kind=kind)


def _moveaxis(q, source, destination):
    src = [normalize_axis(a, q.ndim) for a in np.atleast_1d(source)]
    dst = [normalize_axis(a, q.ndim) for a in np.atleast_1d(destination)]
    order = [n for n in range(q.ndim) if n not in src]
    for d, s in sorted(zip(dst, src)):
        order.insert(d, s)
    return q.transpose(order)


def _swapaxes(q, axis1, axis2):
    order = list(range(q.ndim))
    a, b = normalize_axis(axis1, q.ndim), normalize_axis(axis2, q.ndim)
    order[a], order[b] = order[b], order[a]
    return q.transpose(order)


def squeeze(q, axis=None):
    axes = [n for n in range(q.ndim) if q.shape[n] == 1] if axis is None else \
        [normalize_axis(a, q.ndim) for a in np.atleast_1d(axis)]
    if any(q.shape[a] != 1 for a in axes):
        raise ValueError(f"cannot select an axis to squeeze out which has size not equal to one: {q.shape}")
    return q[tuple(0 if n in axes else slice(None) for n in range(q.ndim))]


def _expand_dims(q, axis):
    ndim = q.ndim + len(np.atleast_1d(axis))
    new = {normalize_axis(a, ndim) for a in np.atleast_1d(axis)}
    return q[tuple(None if n in new else slice(None) for n in range(ndim))]


def _flip(q, axis=None):
    axes = range(q.ndim) if axis is None else [normalize_axis(a, q.ndim) for a in np.atleast_1d(axis)]
    return q[tuple(slice(None, None, -1) if n in axes else slice(None) for n in range(q.ndim))]


def _take(q, indices, axis=None, out=None, mode="raise"):
    if out is not None or mode != "raise":
        raise TypeError("numpy.take of a QArray takes indices and axis only")
    xp = q._backend.xp
    if q.axis is None:
        return q._with(xp.take(q.data, indices, axis=axis))
    idx = np.asarray(to_host(indices))
    if q.block_size is not None or axis is None or idx.ndim != 1:
        raise TypeError("numpy.take of a QArray with per-channel or blocked parameters takes a 1-D index along an "
                        "axis; requantize it per-tensor first")
    axis = normalize_axis(axis, q.ndim)
    data = xp.take(q.data, q._backend.asarray(idx), axis=axis)
    if axis != q.axis:
        return q._with(data, axis=q.axis)
    return q._with(data, q.scale[idx], q.zero_point[idx], axis=q.axis)


def _broadcast_to(q, shape, subok=False):
    shape = tuple(np.atleast_1d(shape).tolist())
    data = q._backend.xp.broadcast_to(q.data, shape)
    if q.axis is None:
        return q._with(data)
    axis = q.axis + len(shape) - q.ndim
    if q.block_size is not None or shape[axis] != q.shape[q.axis]:
        raise TypeError("numpy.broadcast_to would stretch the parameter axis of a per-channel or blocked QArray; "
                        "requantize it per-tensor first")
    return q._with(data, axis=axis)


# numpy.concatenate's and numpy.stack's qarray ops, which register themselves here
# (qarray.ops.concat: the ops sit above this module)
JOIN_OPS: dict = {}


def _join(name):
    def run(qs, axis=0, out=None, **kwargs):
        qs = list(qs)
        if out is not None or kwargs:
            raise TypeError(f"numpy.{name} of QArrays takes axis= only; qarray.{'cat' if name == 'concatenate' else 'stack'}"
                            " also takes output parameters")
        op = JOIN_OPS[name]
        try:
            return op(qs, axis)
        except ValueError as e:
            if "different scales or zero points" not in str(e):
                raise
            raise TypeError(f"numpy.{name}: the QArrays have different scales or zero points; use "
                            f"qarray.{op.__name__}(qs, axis, scale=..., zero_point=..., dtype=...), which requantizes "
                            "each to the output parameters") from None

    return run


def _where(condition, x=None, y=None):
    from ._qarray import QArray

    if not (isinstance(x, QArray) and isinstance(y, QArray) and _same_params(x, y)):
        raise TypeError("numpy.where with QArrays takes two QArray branches with the same parameters; requantize "
                        "one to the other's (q.requantize(...)) or dequantize both")
    cond = condition != 0 if isinstance(condition, QArray) else condition
    return x._with(x._backend.xp.where(cond, x.data, y.data), axis=x.axis, block_size=x.block_size)


def _array_equal(a1, a2, equal_nan=False):
    from ._qarray import QArray

    shape = lambda v: v.shape if isinstance(v, QArray) else np.shape(v)  # noqa: E731
    if shape(a1) != shape(a2):
        return False
    return bool(to_host(compare(np.equal, a1, a2)).all())


def _isclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False):
    x, y = (to_host(_operand(v)).astype(np.float64) for v in (a, b))
    return np.isclose(x, y, rtol=rtol, atol=atol, equal_nan=equal_nan)


def _allclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False):
    return bool(_isclose(a, b, rtol, atol, equal_nan).all())


STRUCTURAL = {
    np.reshape: lambda q, *shape, **kw: q.reshape(*(kw.get("shape", kw.get("newshape")) or shape)),
    np.transpose: lambda q, axes=None: q.transpose() if axes is None else q.transpose(axes),
    np.moveaxis: _moveaxis, np.swapaxes: _swapaxes, np.squeeze: squeeze, np.expand_dims: _expand_dims,
    np.ravel: lambda q, order="C": q.reshape(-1), np.flip: _flip, np.take: _take, np.broadcast_to: _broadcast_to,
    np.copy: lambda q, *a, **kw: q.copy(), np.concatenate: _join("concatenate"), np.stack: _join("stack"),
    np.where: _where, np.sort: _sort, np.min: _codes_reduction("min"), np.max: _codes_reduction("max"),
    np.amin: _codes_reduction("min"), np.amax: _codes_reduction("max"),
}
EXACT = {
    np.argmin: _codes_reduction("argmin"), np.argmax: _codes_reduction("argmax"), np.argsort: _argsort,
    np.array_equal: _array_equal, np.isclose: _isclose, np.allclose: _allclose,
    np.shape: lambda q: q.shape, np.ndim: lambda q: q.ndim, np.size: lambda q, axis=None: q.size if axis is None
    else q.shape[axis],
}


def function(func, types, args, kwargs):
    """``__array_function__``: the tables above; any other function TypeError."""
    impl = STRUCTURAL.get(func) or EXACT.get(func)
    if impl is None:
        raise _refuse(func.__name__)
    return impl(*args, **kwargs)


def install(cls) -> None:
    """The operators of ``cls`` (QArray) from the tables."""
    for name, uf in COMPARISONS.items():
        setattr(cls, name, lambda self, other, uf=uf: compare(uf, self, other))
    for name, symbol in ARITHMETIC.items():
        def refuse(self, *other, symbol=symbol):
            raise arithmetic_error(symbol)
        setattr(cls, name, refuse)
    cls.__pos__ = lambda self: self.copy()
    cls.__hash__ = None
    cls.__array__ = array
    cls.__array_ufunc__ = ufunc
    cls.__array_function__ = lambda self, func, types, args, kwargs: function(func, types, args, kwargs)
    cls.__bool__ = to_bool
    cls.__float__ = lambda self: _scalar(self, "float()")
    cls.__int__ = lambda self: int(_scalar(self, "int()"))
    cls.__format__ = to_format
    cls.__dlpack__ = cls.__dlpack_device__ = property(no_dlpack)


class NotDLPack(TypeError, AttributeError):
    """A QArray is not one DLPack tensor. Also an AttributeError, so that
    ``hasattr(q, "__dlpack__")`` is False: code that probes for DLPack goes on
    to the other protocols rather than fail on this one."""


def no_dlpack(self):
    raise NotDLPack("a QArray is integer codes plus parameters, not one DLPack tensor: pass q.data (no copy, e.g. "
                    "torch.from_dlpack(q.data)) with q.scale and q.zero_point, or q.to_torch() for a PyTorch "
                    "quantized tensor")
