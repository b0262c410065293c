"""Lookup-table activations: any real function of a <= 16-bit input, exactly.

An input of 16 bits or less has at most 65536 codes, so ``fn`` is evaluated
once per code in float64 (``real = (code - zero_point) * float64(scale)``),
the results are quantized with :func:`qarray.quantize`'s numerics (float64
division, round half to even, clamp) and the input is looked up in that table
with one ``take`` (:meth:`Backend.lut`). The result is the correctly quantized
``fn`` of each real input value, for any output parameters.
"""

from __future__ import annotations

import math

import numpy as np

from ..backends import on_data_device
from .._api import quantize
from .._dtypes import qdtype, qint8, quint8
from .._params import check_scale, check_zero_point, kept, to_host
from .._qarray import QArray
from ._output import output_params_of

__all__ = ["lut", "sigmoid", "tanh", "hardswish", "gelu", "silu", "exp", "elu", "leaky_relu"]


def _check_input(op, q):
    if not isinstance(q, QArray):
        raise TypeError(f"{op}: the input must be a QArray, got {type(q).__name__}; quantize it first")
    if q.dtype.bits > 16:
        raise TypeError(
            f"{op}: needs an input of 16 bits or less (a table entry per code), got {q.dtype.name}; "
            "requantize it to qint16/qint8 first"
        )
    if q.block_size is not None:
        raise ValueError(f"{op}: blocked parameters are not supported; requantize per-tensor or per-axis first")


@on_data_device(integer_only=True)
def lut(q: QArray, fn, *, scale, zero_point=0, dtype=None) -> QArray:
    """``fn`` applied to the real values of ``q``, quantized to the output parameters.

    Parameters
    ----------
    q : QArray
        Input of 16 bits or less (qint2 ... quint16), per-tensor or per-axis
        (one table per channel); blocked parameters raise ValueError.
    fn : callable
        Takes a float64 array of real input values and returns real values of
        the same shape (NaN raises ValueError; +-inf saturate).
    scale, zero_point, dtype
        Per-tensor output parameters; ``dtype`` defaults to ``q.dtype``.

    Examples
    --------
    >>> q = QArray.from_int(numpy.array([-2, 0, 3]), 0.5, 0, "qint8")
    >>> lut(q, numpy.abs, scale=0.25).int_repr()
    array([4, 0, 6], dtype=int8)
    """
    _check_input("lut", q)
    if not callable(fn):
        raise TypeError(f"lut: fn must be callable (a function of a float64 array), got {type(fn).__name__}")
    d = qdtype(q.dtype if dtype is None else dtype)
    s_out, z_out = check_scale(scale), check_zero_point(zero_point, d)
    return _looked_up(q, _table(fn, q.dtype, to_host(q.scale), to_host(q.zero_point), q.axis, s_out, z_out, d),
                      s_out, z_out, d)


def _table(fn, sd, s_in, z_in, axis, s_out, z_out, d):
    """``fn``'s quantized value for every code of ``sd`` at ``(s_in, z_in)``
    (a row per channel along ``axis``), indexed by the code's unsigned bits."""
    n_table = 1 << (8 * sd.storage.itemsize)
    codes = np.arange(sd.qmin, sd.qmax + 1, dtype=np.int64)
    s_in, z_in = s_in.astype(np.float64), z_in.astype(np.int64)
    if axis is not None:  # one row of codes per channel
        s_in, z_in = s_in[:, None], z_in[:, None]
    real = (codes - z_in).astype(np.float64) * s_in
    name = getattr(fn, "__name__", repr(fn))
    y = np.asarray(fn(real))
    if y.shape != real.shape or y.dtype.kind not in "fiu" or y.dtype == np.bool_:
        raise ValueError(
            f"lut: fn {name} must return real numbers shaped like its input {real.shape}, "
            f"got {y.dtype} of shape {y.shape}"
        )
    y = y.astype(np.float64)
    if np.isnan(y).any():
        bad = real[np.isnan(y)].reshape(-1)[0]
        raise ValueError(f"lut: fn {name} returned NaN (first at input {bad!r}); it must give real numbers")
    table = np.full(real.shape[:-1] + (n_table,), z_out, d.storage)
    table[..., codes & (n_table - 1)] = quantize(y, s_out, z_out, d).data
    return table


# The activations' functions are pure (their closures hold only their
# parameters): their tables are kept, keyed by the function's code and
# closure (qarray._params.kept). A user's fn in lut() may read state that
# changes between calls, so its table is made each call.
_activation_table = kept(_table)


def _looked_up(q, table, s_out, z_out, d):
    b = q._backend
    return QArray._new(b.lut(q.data, b.param(table), q.axis), s_out, z_out, d, None, None, b)


def _activation(op, fn, q, scale, zero_point, dtype, default=None) -> QArray:
    _check_input(op, q)
    d, s, z = output_params_of(op, q, scale, zero_point, dtype, default)
    return _looked_up(q, _activation_table(fn, q.dtype, q.scale, q.zero_point, q.axis, s, z, d), s, z, d)


def _sigmoid(x):
    with np.errstate(over="ignore"):  # exp(-x) = inf gives 1 / inf = 0, as it should
        return 1.0 / (1.0 + np.exp(-x))


_SIGMOID_OUT = (quint8, np.float32(1 / 256), 0)
_TANH_OUT = (qint8, np.float32(1 / 128), 0)
_erf = np.frompyfunc(math.erf, 1, 1)


@on_data_device(integer_only=True)
def sigmoid(q: QArray, *, scale=None, zero_point=None, dtype=None) -> QArray:
    """Quantized logistic sigmoid ``1 / (1 + exp(-x))``.

    With no output parameters the output is quint8 with scale 1/256 and zero
    point 0 (PyTorch's fixed choice); any others may be given (``zero_point``
    then defaults to 0 and ``dtype`` to quint8).

    >>> q = QArray.from_int(numpy.array([0, 100]), 0.1, 0, "qint8")
    >>> sigmoid(q).int_repr()
    array([128, 255], dtype=uint8)
    """
    return _activation("sigmoid", _sigmoid, q, scale, zero_point, dtype, _SIGMOID_OUT)


@on_data_device(integer_only=True)
def tanh(q: QArray, *, scale=None, zero_point=None, dtype=None) -> QArray:
    """Quantized ``tanh``; default output qint8, scale 1/128, zero point 0
    (``dtype`` defaults to qint8 when other parameters are given).

    >>> q = QArray.from_int(numpy.array([0, 100]), 0.1, 0, "qint8")
    >>> tanh(q).int_repr()
    array([  0, 127], dtype=int8)
    """
    return _activation("tanh", np.tanh, q, scale, zero_point, dtype, _TANH_OUT)


_SAME = """

    With no output parameters the output has the input's scale, zero point
    and dtype (per-tensor input only: per-axis input needs output parameters).
    Otherwise ``scale`` is needed, ``zero_point`` defaults to 0 and ``dtype``
    to the input's.
"""


@on_data_device(integer_only=True)
def hardswish(q: QArray, *, scale=None, zero_point=None, dtype=None) -> QArray:
    return _activation("hardswish", lambda x: x * np.clip(x + 3.0, 0.0, 6.0) / 6.0, q, scale, zero_point, dtype)


@on_data_device(integer_only=True)
def gelu(q: QArray, *, scale=None, zero_point=None, dtype=None) -> QArray:
    return _activation(
        "gelu", lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float64)), q, scale, zero_point, dtype
    )


@on_data_device(integer_only=True)
def silu(q: QArray, *, scale=None, zero_point=None, dtype=None) -> QArray:
    return _activation("silu", lambda x: x * _sigmoid(x), q, scale, zero_point, dtype)


@on_data_device(integer_only=True)
def exp(q: QArray, *, scale=None, zero_point=None, dtype=None) -> QArray:
    def _exp(x):
        with np.errstate(over="ignore"):  # inf saturates at qmax
            return np.exp(x)

    return _activation("exp", _exp, q, scale, zero_point, dtype)


@on_data_device(integer_only=True)
def elu(q: QArray, alpha=1.0, *, scale=None, zero_point=None, dtype=None) -> QArray:
    alpha = float(alpha)
    return _activation("elu", lambda x: np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0.0))),
                       q, scale, zero_point, dtype)


@on_data_device(integer_only=True)
def leaky_relu(q: QArray, negative_slope=0.01, *, scale=None, zero_point=None, dtype=None) -> QArray:
    slope = float(negative_slope)
    return _activation("leaky_relu", lambda x: np.where(x >= 0, x, x * slope), q, scale, zero_point, dtype)


hardswish.__doc__ = "Quantized hardswish ``x * clamp(x + 3, 0, 6) / 6`` (PyTorch's)." + _SAME + """
    >>> q = QArray.from_int(numpy.array([-40, 10, 40]), 0.1, 0, "qint8")
    >>> hardswish(q).int_repr()
    array([ 0,  7, 40], dtype=int8)
"""
gelu.__doc__ = "Quantized GELU, exact (erf) form ``x * (1 + erf(x / sqrt(2))) / 2``." + _SAME + """
    >>> q = QArray.from_int(numpy.array([-30, 0, 30]), 0.1, 0, "qint8")
    >>> gelu(q).int_repr()
    array([ 0,  0, 30], dtype=int8)
"""
silu.__doc__ = "Quantized SiLU (swish) ``x * sigmoid(x)``." + _SAME + """
    >>> q = QArray.from_int(numpy.array([-30, 0, 30]), 0.1, 0, "qint8")
    >>> silu(q).int_repr()
    array([-1,  0, 29], dtype=int8)
"""
exp.__doc__ = "Quantized ``exp``; values beyond the output range saturate." + _SAME + """
    >>> q = QArray.from_int(numpy.array([-10, 0, 10]), 0.1, 0, "qint8")
    >>> exp(q, scale=0.01, dtype="quint8").int_repr()
    array([ 37, 100, 255], dtype=uint8)
"""
elu.__doc__ = "Quantized ELU: ``x`` for ``x > 0``, else ``alpha * (exp(x) - 1)``." + _SAME + """
    >>> q = QArray.from_int(numpy.array([-10, 0, 10]), 0.1, 0, "qint8")
    >>> elu(q).int_repr()
    array([-6,  0, 10], dtype=int8)
"""
leaky_relu.__doc__ = "Quantized leaky ReLU: ``x`` for ``x >= 0``, else ``negative_slope * x``." + _SAME + """
    >>> q = QArray.from_int(numpy.array([-100, 0, 10]), 0.1, 0, "qint8")
    >>> leaky_relu(q, 0.1).int_repr()
    array([-10,   0,  10], dtype=int8)
"""
