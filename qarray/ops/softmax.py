"""softmax and log_softmax along an axis of a <= 16-bit per-tensor input.

The arithmetic (the contract; ``tests/test_softmax.py`` pins it against an
independent Python reference). With ``s`` the input scale (float32, taken
exactly as float64), ``R = qmax - qmin`` of the input dtype and, along the
axis, ``j = rowmax(q) - q`` (an integer in ``[0, R]``; the zero point cancels):

1. A host table of integers ``T[j] = round(2**30 * exp(s * -j))`` for
   ``j = 0 .. R``, computed once per call with NumPy in float64 (``s * -j``,
   ``exp``, times ``2**30``, round half to even). Every backend indexes the same
   integers, so all later steps see identical inputs. ``T[0] = 2**30``.
2. The row sum ``S = sum T[j]``, exact in int64 (rows of up to ``2**33 - 1``
   elements; longer ones raise ValueError).
3. softmax: ``out = clamp(rint(float64(T[j]) / (float64(S) * float64(s_out))) + z_out)``,
   one IEEE multiply and one IEEE divide (both correctly rounded, so NumPy,
   Numba and CuPy agree bit for bit), ``rint`` half to even.
   log_softmax: ``out = clamp(rint((float64(j) * -s - log(float64(S) / 2**30)) / s_out) + z_out)``,
   with ``log`` NumPy's float64 log on the host, one per row (``S / 2**30`` is
   exact: ``log`` of a row with one nonzero term is exactly 0), so every backend
   uses the same value.

So the result is softmax of the real input values, with exp rounded to 30
fractional bits before the sum (an error below ``2**-31`` per term, relative to
the row maximum's term), then rounded once to the output grid.

Default outputs follow TFLite (when none of ``scale``, ``zero_point``,
``dtype`` is given): softmax quint8 -> quint8 1/256 zero point 0, qint8 ->
qint8 1/256 zero point -128, qint16 -> qint16 1/32768 zero point 0, any other
dtype -> itself with scale ``1 / (R + 1)`` and zero point ``qmin``;
log_softmax quint8 -> quint8 16/256 zero point 255, qint8 -> qint8 16/256
zero point 127, others -> themselves with scale ``16 / (R + 1)`` and zero
point ``qmax``. Otherwise ``scale`` is needed, ``zero_point`` defaults to 0
and ``dtype`` to the input's.
"""

from __future__ import annotations

import numpy as np

from ..backends import on_data_device
from .._dtypes import qint8, qint16, quint8
from .._fixed_point import Softmax
from .._params import to_host
from .._qarray import QArray
from ._output import output_params
from .lut import _check_input

__all__ = ["softmax", "log_softmax"]

_ONE = 2**30  # T[0]: exp(0) with 30 fractional bits
_MAX_ROW = 2**63 // _ONE  # S <= n * 2**30 must stay below 2**63


def _check(op, q, axis):
    _check_input(op, q)
    if q.axis is not None:
        raise ValueError(f"{op}: the input has per-axis parameters; {op} takes a per-tensor input "
                         "(requantize it per-tensor first)")
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{op}: axis must be an integer, got {type(axis).__name__}")
    if not -q.ndim <= axis < q.ndim or q.ndim == 0:
        raise ValueError(f"{op}: axis {axis} is out of range for an input of {q.ndim} dimension(s)")
    axis = int(axis) % q.ndim
    if q.shape[axis] >= _MAX_ROW:
        raise ValueError(
            f"{op}: rows of {q.shape[axis]} elements along axis {axis} could overflow the exact int64 "
            f"sum (at most {_MAX_ROW - 1}); split the axis"
        )
    return axis


def _default(op, d):
    """TFLite's output ``(dtype, scale, zero_point)`` for input dtype ``d``."""
    span = d.qmax - d.qmin + 1
    if op == "softmax":
        known = {quint8: (quint8, 1 / 256, 0), qint8: (qint8, 1 / 256, -128), qint16: (qint16, 1 / 32768, 0)}
        return known.get(d, (d, 1 / span, d.qmin))
    known = {quint8: (quint8, 16 / 256, 255), qint8: (qint8, 16 / 256, 127)}
    return known.get(d, (d, 16 / span, d.qmax))


def table(scale, dtype) -> np.ndarray:
    """``T[j] = round(2**30 * exp(float64(scale) * -j))`` for ``j = 0 .. qmax - qmin``, int64."""
    j = np.arange(dtype.qmax - dtype.qmin + 1, dtype=np.float64)
    with np.errstate(under="ignore"):  # far terms underflow to 0, as they should
        return np.rint(_ONE * np.exp(np.float64(scale) * -j)).astype(np.int64)


def _softmax(op, q, axis, scale, zero_point, dtype, log):
    axis = _check(op, q, axis)
    d, s_out, z_out = output_params(op, scale, zero_point, dtype, q.dtype, _default(op, q.dtype))
    s_in = np.float32(to_host(q.scale))
    b = q._backend
    xp = b.xp
    moved = xp.moveaxis(q.data, axis, -1)
    rows = moved.reshape(-1, q.shape[axis]) if q.size else moved.reshape(0, max(q.shape[axis], 1))
    out = b.softmax(rows, Softmax(table(s_in, q.dtype), float(s_in), float(s_out), int(z_out), d, log))
    data = xp.moveaxis(out.reshape(moved.shape), -1, axis)
    data = data if axis == q.ndim - 1 else data.copy()  # C-contiguous codes
    return QArray._new(data, s_out, z_out, d, None, None, b)


@on_data_device(integer_only=True)
def softmax(q: QArray, axis: int = -1, *, scale=None, zero_point=None, dtype=None) -> QArray:
    """Quantized ``softmax`` along ``axis``: ``exp(x) / sum(exp(x))`` of the real values.

    Parameters
    ----------
    q : QArray
        Per-tensor input of 16 bits or less (qint2 ... quint16).
    axis : int
        The axis the softmax normalises over (default the last).
    scale, zero_point, dtype
        Output parameters. Default (none given): TFLite's, quint8 -> quint8
        1/256 zero point 0, qint8 -> qint8 1/256 zero point -128, qint16 ->
        qint16 1/32768 (see the module docstring for the others and the exact
        arithmetic: an int64 row sum of a 30-bit exp table, one float64 divide).

    Examples
    --------
    >>> q = QArray.from_int(numpy.array([[10, 0, -10], [5, 5, 5]]), 0.1, 0, "qint8")
    >>> softmax(q).int_repr()
    array([[  42,  -65, -105],
           [ -43,  -43,  -43]], dtype=int8)
    """
    return _softmax("softmax", q, axis, scale, zero_point, dtype, False)


@on_data_device(integer_only=True)
def log_softmax(q: QArray, axis: int = -1, *, scale=None, zero_point=None, dtype=None) -> QArray:
    """Quantized ``log_softmax`` along ``axis``: ``x - log(sum(exp(x)))`` of the real values.

    As :func:`softmax`, with TFLite's LOG_SOFTMAX outputs by default: quint8 ->
    quint8 16/256 zero point 255, qint8 -> qint8 16/256 zero point 127 (the
    results are <= 0: the top code is 0.0). One float64 ``log`` per row, NumPy's,
    on the host (module docstring).

    Examples
    --------
    >>> q = QArray.from_int(numpy.array([[10, 0, -10], [5, 5, 5]]), 0.1, 0, "qint8")
    >>> log_softmax(q).int_repr()
    array([[120, 104,  88],
           [109, 109, 109]], dtype=int8)
    """
    return _softmax("log_softmax", q, axis, scale, zero_point, dtype, True)
