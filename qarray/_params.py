"""Quantization parameters: validation and the one broadcasting helper.

One affine model in the ONNX form, ``real = (q - zero_point) * scale``:

=============  ========================  ==========================================
granularity    axis / block_size         scale and zero_point shape
=============  ========================  ==========================================
per-tensor     ``None`` / ``None``       ``()``
per-axis       ``k`` / ``None``          ``(shape[k],)``
blocked        ``k`` / ``B``             ``shape`` with ``shape[k]`` -> ``ceil(shape[k] / B)``
=============  ========================  ==========================================

Example: ``x.shape == (2, 5)``, ``axis=1, block_size=2`` gives scale shape
``(2, 3)``; elements ``x[i, 4]`` use ``scale[i, 2]`` (the last block is short).

Also here: ``Quant`` and ``Gemm``, the plan records of quantize and of the
integer GEMM, and :func:`kept`, qarray's one cache of what is worked out from
parameters (plans, and the backends' forms of them). One cache, not one per
layer, because one rule decides every hit: equal values, or the same immutable
object, give the same result; it lives here, at the bottom, so that every
layer above can use it.
"""

from __future__ import annotations

import functools
import math
import operator
import types
from dataclasses import dataclass

import numpy as np

from ._dtypes import QDType


def is_lazy(a) -> bool:
    """Whether ``a`` (an array or QArray) holds Dask data, computed on demand."""
    graph = getattr(a, "__dask_graph__", None)
    return graph is not None and graph() is not None


def to_host(a):
    """A NumPy view of ``a`` (CuPy arrays are copied from the device)."""
    if isinstance(a, np.ndarray):
        return a
    if hasattr(a, "__cuda_array_interface__") and hasattr(a, "get"):
        return a.get()
    return np.asarray(a)


def array_key(a) -> tuple:
    """A hashable key of host array ``a``'s value (dtype, shape, bytes): what the
    caches of plans and device parameters are keyed by."""
    t = type(a)
    if t is int or t is float:  # a Python number: itself
        return t, a
    if t is not np.ndarray:
        a = np.asarray(a)
    return a.dtype, a.shape, a.tobytes()


_AS_IS = (np.dtype, np.generic, type, np.ufunc)  # immutable, keyed with their type


def _array_key(a):
    if a.base is None and not a.flags.writeable:  # check_params' and plan's: the entry holds it
        return id(a)
    return a.dtype, a.shape, a.tobytes()


def _typed_key(a):
    return type(a), a


def _seq_key(a):
    if _INT.issuperset(map(type, a)):  # a shape (2.5x faster than all() of a generator)
        return "ints", *a
    return type(a), *map(_key, a)


_INT = frozenset((int,))


def _function_key(f):
    """A function by what it computes: its code, defaults and closure values
    (a lambda made on each call with the same parameters is the same key).
    Only for functions that read no changing global state."""
    cells = tuple(c.cell_contents for c in f.__closure__ or ())
    return f.__code__, _key(f.__defaults__), _key(cells)


_KEY_OF = {np.ndarray: _array_key, list: _seq_key, tuple: _seq_key, int: _typed_key, float: _typed_key,
           types.FunctionType: _function_key}


_BARE = frozenset((str, bool, type(None), QDType))  # their own keys: no two of them equal across types
# (a QDType equals its name: both mean the same dtype)


def _key(a):
    """``a``'s part of a ``kept`` key, or TypeError where ``a`` is not a value
    that can be keyed (a CuPy array, a torch tensor: keyed by identity, they
    could change underneath)."""
    if type(a) in _BARE:
        return a
    f = _KEY_OF.get(type(a))
    if f is None:
        if not isinstance(a, _AS_IS):
            raise TypeError(f"{type(a).__name__} is not kept")
        f = _KEY_OF[type(a)] = _typed_key
    return f(a)


def kept(fn):
    """``fn`` of host parameters, computed once per value of its arguments and
    kept: parameters repeat call after call, and working them out
    took most of a small call's host time. Arrays are keyed by value (dtype,
    shape, bytes), except read-only arrays that own their data, which are
    keyed by identity, the entry holding them: what ``fn`` returns should be
    read-only for that (``check_params``, ``plan``), so that one op's output
    parameters are the next op's cheap key. Plan records (``Quant``,
    ``Requant``, ...: immutable, :func:`by_identity`) are keyed by identity
    too. Functions are keyed by their code,
    defaults and closure values (``_function_key``: only for functions that
    read no changing state, such as the LUT activations'). Arguments of other
    types (device arrays, objects) are not kept: ``fn`` runs.

    This is qarray's one cache of what is worked out from parameters: the
    ops' plans, and the backends' forms of them (the NumPy backend's parameter
    arrays, layouts' pieces, GEMM columns, binary's kernel arguments, the
    floating formats' kernels). One cache, because one rule decides every
    hit: equal values (or the same immutable object) give the same result,
    whichever layer asks; each function keeps at most 1024 entries, so a
    process that sweeps parameters does not grow without bound."""
    cache: dict = {}

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            key = tuple(map(_key, args))
            if kwargs:
                key += _key(tuple(kwargs.items()))
        except TypeError:
            return fn(*args, **kwargs)
        hit = cache.get(key)
        if hit is None:
            if len(cache) >= 1024:
                cache.clear()
            hit = cache[key] = fn(*args, **kwargs), args, kwargs
        return hit[0]

    call.cache = cache
    return call


def by_identity(cls):
    """Class decorator: :func:`kept` keys instances of ``cls`` (immutable plan
    records, kept themselves call after call) by identity, the entry holding them."""
    _KEY_OF[cls] = id
    return cls


def float_values(x):
    """``x`` as values to quantize: bfloat16 and float8 (ml_dtypes', what
    checkpoints hold) as float32, which holds each of their values, so they are
    rounded once later, as float16 is; other arrays as they are."""
    return x.astype(np.float32) if is_small_float(x.dtype) else x


def is_small_float(dtype) -> bool:
    """Whether ``dtype`` is one of ml_dtypes' floating types (bfloat16, float8,
    float6, float4: what checkpoints hold besides NumPy's floats), whose every
    value float32 holds exactly."""
    dtype = np.dtype(dtype)
    if dtype.type.__module__ != "ml_dtypes":  # kind "V" for most, "f" for some (float8_e5m2)
        return False
    import ml_dtypes

    try:
        ml_dtypes.finfo(dtype)
    except ValueError:  # int2/int4 and the like
        return False
    return dtype.itemsize <= 2


def normalize_axis(axis, ndim: int, what: str = "axis"):
    """``axis`` as a non-negative int (or None), with a clear error."""
    if axis is None:
        return None
    try:
        axis = operator.index(axis)
    except TypeError:
        raise TypeError(f"{what} must be an integer or None, got {type(axis).__name__}") from None
    if not -ndim <= axis < ndim:
        raise ValueError(f"{what}={axis} is out of range for an array with {ndim} dimension(s)")
    return axis % ndim


def normalize_block_size(block_size, axis):
    if block_size is None:
        return None
    if axis is None:
        raise ValueError("block_size needs an axis: pass axis=k to quantize in blocks along axis k")
    return int_in(block_size, "block_size", 1)


def int_in(v, name, lo, hi=None):
    """``v`` as an int in ``[lo, hi)`` (``hi`` None: no top); TypeError or
    ValueError naming ``name`` otherwise."""
    try:
        v = operator.index(v)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(v).__name__}") from None
    if v < lo or (hi is not None and v >= hi):
        raise ValueError(f"{name} must be >= {lo}, got {v}" if hi is None else
                         f"{name} must be in [{lo}, {_bound_text(hi)}), got {v}")
    return v


def _bound_text(n):
    """A large power of 2 as ``2**k``, other ints as they are."""
    return f"2**{n.bit_length() - 1}" if n > 2**16 and n & (n - 1) == 0 else str(n)


def param_shape(shape, axis, block_size) -> tuple:
    """The shape scale and zero_point must have for ``shape``, ``axis``, ``block_size``."""
    if axis is None:
        return ()
    if block_size is None:
        return (shape[axis],)
    return tuple(-(-n // block_size) if i == axis else n for i, n in enumerate(shape))


def _describe(axis, block_size) -> str:
    if axis is None:
        return "per-tensor (a scalar)"
    if block_size is None:
        return f"per-axis along axis {axis}"
    return f"blocked along axis {axis} with block_size={block_size}"


def _fit(a: np.ndarray, want: tuple, name: str, axis, block_size) -> np.ndarray:
    if a.shape == want:
        return a
    if a.size == 1:  # a scalar serves every granularity, as in ONNX
        return np.broadcast_to(a.reshape(()), want).copy()
    raise ValueError(
        f"{name} has shape {a.shape} but {_describe(axis, block_size)} needs shape {want}"
    )


# scale dtypes a floating format keeps (ONNX's float16 / bfloat16 scales; the MX
# and NVFP4 block scales, whose NaN marks a block that held NaN, in MX inf too)
KEPT_SCALES = ("float32", "float16", "bfloat16", "float8_e8m0fnu", "float8_e4m3fn")
_NAN_SCALES = ("float8_e8m0fnu", "float8_e4m3fn")


_F32_MAX = float(np.finfo(np.float32).max)


def refuse_nonfinite(a, what, as_float32=True, tail=""):
    """ValueError naming how many values of host array ``a`` are NaN or infinite and the first one's
    index: ``"{what} holds N NaN or infinite value(s)[ as float32] (the first at (i, j)){tail}"``."""
    bad = ~np.isfinite(a)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{what} holds {int(bad.sum())} NaN or infinite value(s)"
                         f"{' as float32' if as_float32 else ''} (the first at {first}){tail}")


def check_scale(scale, want=(), axis=None, block_size=None, keep=False) -> np.ndarray:
    """``scale`` of shape ``want``, finite and > 0 in float32, else ValueError: as
    float32, or (``keep``, for the floating formats) in its own dtype when that is
    one of ``KEPT_SCALES``, the 8-bit block scales allowed NaN."""
    if type(scale) is float and want == () and 0 < scale <= _F32_MAX:  # the common call: one number
        s32 = np.float32(scale)  # (no overflow below float32's largest; below its smallest, 0)
        if s32 > 0:
            return np.asarray(s32)
    if type(scale) is np.ndarray and want == () and scale.shape == () and scale.dtype == np.float32 and not keep \
            and 0 < scale < np.inf:  # a QArray's or an observer's scale
        return scale.copy()
    s = to_host(scale)
    if (s.dtype.kind not in "fiu" or s.dtype == np.bool_) and s.dtype.name not in KEPT_SCALES:
        raise TypeError(f"scale must be a real number or array, got dtype {s.dtype}")
    s = _fit(s, want, "scale", axis, block_size)
    keep = keep and s.dtype.name in KEPT_SCALES
    with np.errstate(over="ignore"):  # too large for float32: reported below
        s32 = s.astype(np.float32)
    bad = ~(np.isfinite(s32) & (s32 > 0))
    if keep and s.dtype.name in _NAN_SCALES:
        bad &= ~np.isnan(s32)
    if bad.any():
        first = s.reshape(-1)[np.flatnonzero(bad.reshape(-1))[0]]
        raise ValueError(
            f"scale must be finite and > 0 in float32; got {first!r} "
            f"({int(bad.sum())} bad value(s))"
        )
    return s.copy() if keep else s32  # never the caller's array: check_params makes it read-only


def check_zero_point(zero_point, dtype: QDType, want=(), axis=None, block_size=None) -> np.ndarray:
    """``zero_point`` as int32 of shape ``want``, inside ``dtype``'s range."""
    if type(zero_point) is int and want == () and dtype.qmin <= zero_point <= dtype.qmax and (
            zero_point == 0 or dtype.kind != "float"):  # the common call: one Python int
        return np.asarray(zero_point, np.int32)
    if type(zero_point) is np.ndarray and want == () and zero_point.shape == () and zero_point.dtype.kind in "iu" \
            and dtype.kind != "float" and dtype.qmin <= zero_point <= dtype.qmax:
        return zero_point.astype(np.int32)
    z = to_host(zero_point)
    if z.dtype.kind not in "iu":
        raise TypeError(
            f"zero_point must be an integer or integer array, got dtype {z.dtype}; "
            "round it first (e.g. int(round(zp)))"
        )
    z = _fit(z, want, "zero_point", axis, block_size)
    if dtype.kind == "float" and z.any():
        raise ValueError(f"zero_point must be 0 for the floating format {dtype.name}, got {int(z.reshape(-1)[np.flatnonzero(z)[0]])}")
    bad = (z < dtype.qmin) | (z > dtype.qmax)
    if bad.any():
        first = z.reshape(-1)[np.flatnonzero(bad.reshape(-1))[0]]
        raise ValueError(
            f"zero_point {int(first)} is outside the range [{dtype.qmin}, {dtype.qmax}] "
            f"of {dtype.name}"
        )
    return z.astype(np.int32)


@by_identity
@dataclass(frozen=True, eq=False)
class Quant:
    """One quantize, resolved once by an op (``check_params``' parameters and the
    output dtype) and taken whole by a backend:

        q = clamp(rint(x / scale) + zero_point, qd.qmin, qd.qmax)   in qd's storage

    ``scale`` and ``zero_point`` are host arrays of the parameter shape of
    ``axis`` / ``block_size`` (``()`` per tensor)."""

    scale: np.ndarray
    zero_point: np.ndarray
    qd: QDType
    axis: int | None = None
    block_size: int | None = None


@by_identity
@dataclass(frozen=True, eq=False)
class Gemm:
    """One exact integer product, resolved once by ``qarray.ops.linear`` or
    ``qarray.ops.conv`` and taken whole by a backend's ``int_matmul``,
    ``gemm_epilogue`` and ``conv_grouped`` (the arrays multiplied are their
    inputs; what stays the same for the call is here):

        out = sum_k (a - za) * (w - zw) + bias,  then rq

    ``za`` the activations' zero point (an int) and ``qd`` their QDType
    (``int_matmul``'s 8-bit or narrower codes); ``zw`` the weights' zero points
    (host int64, a scalar or ``(N,)``; ``conv_grouped`` takes centred weights
    and no ``zw``); ``bias`` int64 ``(N,)`` (an array of the backend) or None;
    ``rq`` the output's ``qarray._fixed_point.Requant``, or None for the exact
    sums in ``acc_dtype`` (``int_matmul``'s: int32 only where no sum can
    overflow it; None for ``conv_grouped``, whose sums are int64, or int32
    where a backend's kernel knows they fit and there is no bias);
    ``groups``, ``stride``, ``dilation`` and ``padding`` (pairs) a grouped
    conv2d's (its input is padded with ``za``).
    Here beside ``Quant`` rather than in ``_fixed_point``, whose source is
    in the key of every cached Numba kernel that requantizes."""

    za: int
    zw: np.ndarray | int = 0
    bias: object = None
    rq: object = None  # a qarray._fixed_point.Requant, or None
    acc_dtype: type | None = None
    qd: QDType | None = None
    groups: int = 1
    stride: tuple = (1, 1)
    dilation: tuple = (1, 1)
    padding: tuple = (0, 0)


def check_params(scale, zero_point, dtype: QDType, shape, axis, block_size):
    """Validate user parameters for an array of ``shape``.

    A ``block_size`` above ``shape[axis]`` means one block along the axis and
    comes back as ``shape[axis]`` (the same layout, no size taken from it).
    Returns ``(scale, zero_point int32, axis, block_size)`` on the host, with
    axis made non-negative; the scale is float32, or for a floating format its
    own dtype where that is one of ``KEPT_SCALES``. The arrays are read-only,
    the same ones for the same parameters (``kept``).
    """
    if axis is None and block_size is None and type(scale) is float and type(zero_point) is int:
        hit = _PER_TENSOR.get((scale, zero_point, dtype))  # the common call, keyed 6x faster than by kept
        if hit is not None:
            return hit
        hit = _PER_TENSOR[scale, zero_point, dtype] = _checked(scale, zero_point, dtype, (), None, None)
        if len(_PER_TENSOR) > 1024:
            _PER_TENSOR.clear()
        return hit
    return _checked(scale, zero_point, dtype, tuple(shape), axis, block_size)


# per-tensor parameters given as a Python float and int: their checks depend on
# nothing else (not on the shape)
_PER_TENSOR: dict = {}


@kept
def _checked(scale, zero_point, dtype, shape, axis, block_size):
    checked = _check_params(scale, zero_point, dtype, shape, axis, block_size)
    for a in checked[:2]:
        a.setflags(write=False)
    return checked


def _check_params(scale, zero_point, dtype: QDType, shape, axis, block_size):
    axis = normalize_axis(axis, len(shape))
    block_size = normalize_block_size(block_size, axis)
    if block_size is not None:
        # a block longer than the axis is one block (ONNX: ceil(n / B) == 1); recording
        # it as shape[axis] keeps every later size computation bounded by the data
        block_size = min(block_size, max(shape[axis], 1))
    want = param_shape(shape, axis, block_size)
    return (
        check_scale(scale, want, axis, block_size, keep=dtype.kind == "float"),
        check_zero_point(zero_point, dtype, want, axis, block_size),
        axis,
        block_size,
    )


class Layout:
    """Where each element's parameter lies: the one layout of the NumPy, Numba
    and CUDA code.

    The data is seen as ``(outer, n, inner)`` and its parameters (stored in
    ``param_shape``) as ``(pouter, blocks, pinner)``: element ``(o, l, i)`` uses
    parameter ``(o if pouter > 1 else 0, bidx[l], i if pinner > 1 else 0)``
    with ``bidx[l] = l // step``.

    - per-tensor: data ``(1, 1, size)``, parameters ``(1, 1, 1)``, step 1;
    - per-axis along k: data ``(prod(shape[:k]), shape[k], prod(shape[k+1:]))``,
      parameters ``(1, n, 1)``, step 1;
    - blocked along k: the same data, parameters ``(outer, ceil(n / B), inner)``,
      step B.

    Example: shape ``(2, 5)``, ``axis=1, block_size=2``: data ``(2, 5, 1)``,
    parameters ``(2, 3, 1)``, ``bidx = [0, 0, 1, 1, 2]``.
    """

    __slots__ = ("outer", "n", "inner", "pouter", "blocks", "pinner", "step")

    def __init__(self, shape, axis=None, block_size=None):
        shape = tuple(shape)
        if axis is None:
            self._set(1, 1, math.prod(shape), 1, 1, 1, 1)
            return
        o, n, i = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1 :])
        if block_size is None:
            self._set(o, n, i, 1, n, 1, 1)
        else:
            self._set(o, n, i, o, -(-n // block_size), i, block_size)

    @classmethod
    def _of(cls, *fields):
        """A Layout with these fields (``_set``'s order): a re-view for ``pieces``."""
        return object.__new__(cls)._set(*fields)

    def _set(self, outer, n, inner, pouter, blocks, pinner, step):
        self.outer, self.n, self.inner = outer, n, inner
        self.pouter, self.blocks, self.pinner, self.step = pouter, blocks, pinner, step
        return self

    def __repr__(self):
        return f"Layout(data={self.dims}, params={self.pshape}, step={self.step})"

    @property
    def dims(self) -> tuple:
        """The data as ``(outer, n, inner)``."""
        return self.outer, self.n, self.inner

    @property
    def size(self) -> int:
        return self.outer * self.n * self.inner

    @property
    def pshape(self) -> tuple:
        """The parameters as ``(pouter, blocks, pinner)``."""
        return self.pouter, self.blocks, self.pinner

    def compact(self, p):
        """A parameter array (``param_shape``, or a scalar per tensor) as ``pshape``."""
        return p.reshape(self.pshape)

    def bidx(self, xp=np):
        """``bidx[l]``: the parameter block of position ``l`` along ``n`` (int64)."""
        return xp.arange(self.n, dtype=xp.int64) // self.step

    @property
    def ints(self) -> tuple:
        """``(n, inner, blocks, pinner, pouter_on)``: the CUDA ``Layout`` struct
        (``cuda/common.cuh``); ``inner`` at least 1, so it always divides."""
        return self.n, max(self.inner, 1), self.blocks, self.pinner, int(self.pouter > 1)

    def pieces(self, cols=None):
        """``[(flat slice, Layout)]`` covering the data with the same parameters,
        shaped so that inner loops run long with one parameter: data blocked
        along its last axis in whole blocks as ``(outer, blocks, block_size)``;
        with ``cols``, data with one parameter as ``(1, rows, cols)`` plus a
        short tail (rows for the Numba kernels' threads), else as one row."""
        if self.pshape == (1, 1, 1):  # one parameter for all
            if cols is None:
                return [(slice(None), Layout._of(1, 1, self.size, 1, 1, 1, 1))]
            rows, tail = divmod(self.size, cols)
            out = []
            if rows:
                out.append((slice(0, rows * cols), Layout._of(1, rows, cols, 1, 1, 1, rows)))
            if tail:
                out.append((slice(rows * cols, self.size), Layout._of(1, 1, tail, 1, 1, 1, 1)))
            return out
        if self.inner == 1 and self.step > 1 and self.n % self.step == 0:
            return [(slice(None), Layout._of(self.outer, self.blocks, self.step, self.pouter, self.blocks, 1, 1))]
        return [(slice(None), self)]

    def chunks(self, limit):
        """The data seen as ``(outer * n, inner)`` rows, in pieces of about ``limit``
        elements: ``(rows, cols, prow)`` with ``rows``, ``cols`` slices of that
        view and ``prow`` (int64) the row of each of those rows in the
        parameters seen as ``(pouter * blocks, pinner)``. Where the parameters
        repeat every ``n`` rows (or are one row), pieces hold whole periods and
        share one ``prow`` object (a caller may reuse what it gathered with it)."""
        total_rows, inner = self.outer * self.n, self.inner
        nrows = max(1, limit // max(inner, 1))
        periodic = self.pouter == 1 and (self.blocks == 1 or nrows >= self.n)
        if periodic and self.blocks > 1:
            nrows -= nrows % self.n
        width = max(1, min(inner, limit))
        on = self.blocks if self.pouter > 1 else 0
        prow = None
        for r0 in range(0, total_rows, nrows):
            r1 = min(r0 + nrows, total_rows)
            if not (periodic and prow is not None and len(prow) == r1 - r0):
                r = np.arange(r0, r1, dtype=np.int64)
                prow = r // self.n * on + r % self.n // self.step
            for c0 in range(0, inner, width):
                yield slice(r0, r1), slice(c0, c0 + width), prow


def expand(p, shape, axis, block_size):
    """The one broadcasting helper: a parameter array broadcastable against ``shape``.

    Per-tensor parameters are returned as they are; per-axis ones get size-1
    dimensions around ``axis``; blocked ones are repeated ``block_size`` times
    along ``axis`` and cut to ``shape[axis]`` (ONNX's short last block).
    """
    if axis is None:
        return p
    if block_size is None:
        return p.reshape((1,) * axis + (-1,) + (1,) * (len(shape) - axis - 1))
    p3 = Layout(shape, axis, block_size).compact(p)
    if block_size > 1:
        p3 = p3.repeat(block_size, axis=1)[:, : shape[axis]]  # any array library's arrays
    return p3.reshape(shape)
