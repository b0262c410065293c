"""The generic backend: every primitive written once against ``self.xp``.

Any array library with a NumPy-like namespace works through this class as it
stands; ``NumpyBackend`` and ``CupyBackend`` override only what they can do
faster. Primitives take arrays of their own backend and parameters in their
stored shape (see ``qarray._params``); ops validate and resolve everything
before they call one.
"""

from __future__ import annotations

import numpy as np

from .._fixed_point import FLOAT, IDENTITY, rescale
from .._params import expand, to_host, view3


def nan_error(x) -> ValueError:
    """The error quantize raises for NaN input: how many, and where the first is."""
    mask = to_host(x != x)
    count = int(mask.sum())
    first = tuple(int(i) for i in np.unravel_index(int(np.argmax(mask)), mask.shape))
    return ValueError(
        f"cannot quantize NaN: the input has {count} NaN value(s), the first at index "
        f"{first}; replace them (e.g. numpy.nan_to_num) before quantizing"
    )


class Backend:
    """Quantization primitives over an array namespace ``xp``.

    ``name`` is what ``qarray.backends.get`` takes; ``module`` is the array
    library's top-level module, looked up in ``sys.modules`` only (the registry
    never imports a framework the user has not imported).
    """

    name = "generic"
    module = "numpy"

    def __init__(self, xp=None):
        self._xp = xp

    @property
    def xp(self):
        """The array namespace the generic primitives use."""
        return self._xp

    def __repr__(self):
        return f"<qarray backend {self.name!r}>"

    def array_types(self) -> tuple:
        return (self.xp.ndarray,)

    def check_together(self, arrays) -> None:
        """Raise TypeError if ``arrays`` (all of this backend) cannot meet in one op."""

    def asarray(self, a, dtype=None):
        return self.xp.asarray(a, dtype=dtype)

    def to_host(self, a) -> np.ndarray:
        return to_host(a)

    # -- elementwise primitives ------------------------------------------
    def quantize(self, x, scale, zero_point, qd, axis, block_size):
        """``clamp(rint(x / scale) + zero_point)`` in ``qd``'s storage dtype."""
        xp = self.xp
        if bool(xp.isnan(x).any()):
            raise nan_error(x)
        ft = xp.float64 if x.dtype == xp.float64 else xp.float32
        s = expand(scale, x.shape, axis, block_size, xp).astype(ft)
        z = expand(zero_point, x.shape, axis, block_size, xp).astype(xp.float64)
        q = xp.rint(x.astype(ft) / s).astype(xp.float64) + z
        return xp.clip(q, qd.qmin, qd.qmax).astype(qd.storage)

    def dequantize(self, q, scale, zero_point, axis, block_size, dtype):
        """``(q - zero_point) * scale`` in float32, or float64 when ``dtype`` is float64."""
        xp = self.xp
        ft = xp.float64 if dtype == np.float64 else xp.float32
        s = expand(scale, q.shape, axis, block_size, xp).astype(ft)
        z = expand(zero_point, q.shape, axis, block_size, xp).astype(xp.int64)
        y = (q.astype(xp.int64) - z).astype(ft) * s
        with np.errstate(over="ignore"):  # float16 beyond 65504 is inf, as IEEE rounds it
            return y.astype(dtype, copy=False)

    def requantize(self, q, rq, out=None):
        """``rq`` (a ``qarray._fixed_point.Requant``) applied to every element of
        ``q``: ``clamp(R((q - zp_in) * M) + zp_out, lo, hi)`` in ``rq``'s output
        dtype, written into ``out`` when given (that dtype, ``q``'s shape)."""
        xp = self.xp

        def ex(p):
            return expand(self.asarray(p), q.shape, rq.axis, rq.block_size, xp)

        zi, zo, m, s, f = (ex(p) for p in rq.params)
        d = q.astype(xp.int64) - zi
        if rq.rounding == FLOAT:  # clamped in float64: a huge product must not overflow int64
            v = xp.clip(xp.rint(d.astype(xp.float64) * f + zo), rq.lo, rq.hi)
        else:
            v = d if rq.rounding == IDENTITY else rescale(d, m, s, rq.rounding, rq.narrow(q.dtype))
            v = xp.clip(v + zo, rq.lo, rq.hi)
        v = v.astype(rq.out_dtype, copy=False)
        if out is None:
            return v
        out[...] = v
        return out

    def clip(self, q, lo, hi):
        """``min(max(q, lo), hi)`` in ``q``'s dtype; ``lo``/``hi`` broadcast against ``q``."""
        return self.xp.clip(q, lo, hi).astype(q.dtype)

    def binary(self, op, a, b, ra, rb, rq=None):
        """``x op y`` with broadcasting, ``op`` being "add", "sub" or "mul": ``x`` and
        ``y`` are the operands taken by the per-tensor Requants ``ra`` and ``rb``
        to int64 (centred, and for add rescaled onto a common scale), exact;
        then ``rq`` applied when given (one pass on the GPU), else the int64
        result. The op makes sure nothing overflows int64.
        """
        x, y = self.requantize(a, ra), self.requantize(b, rb)
        acc = x * y if op == "mul" else (x + y if op == "add" else x - y)
        return acc if rq is None else self.requantize(acc, rq)

    def minmax(self, x, axis, block_size):
        """Minimum and maximum of ``x`` per parameter slot (shapes as the params)."""
        xp = self.xp
        if axis is None:
            return xp.min(x), xp.max(x)
        o, n, i = view3(x.shape, axis)
        x3 = x.reshape(o, n, i)
        if block_size is None:
            return x3.min(axis=(0, 2)), x3.max(axis=(0, 2))
        nb = -(-n // block_size)
        x4 = xp.pad(x3, ((0, 0), (0, nb * block_size - n), (0, 0)), mode="edge")
        x4 = x4.reshape(o, nb, block_size, i)
        want = x.shape[:axis] + (nb,) + x.shape[axis + 1 :]
        return x4.min(axis=2).reshape(want), x4.max(axis=2).reshape(want)

    def lut(self, q, table, axis=None):
        """``table[u]`` for every element, ``u`` being ``q``'s storage seen as unsigned.

        ``table`` covers the storage's whole unsigned range (``T`` = 256 or 65536
        entries): shape ``(T,)``, or ``(C, T)`` with one row per index along
        ``axis`` (per-axis input), looked up at the flat index ``c * T + u``.
        """
        xp = self.xp
        u = q.view(np.dtype(f"u{q.dtype.itemsize}"))
        if axis is None:
            return xp.take(table, u)
        c = xp.arange(q.shape[axis], dtype=xp.int64) * table.shape[1]
        c = c.reshape((1,) * axis + (-1,) + (1,) * (q.ndim - axis - 1))
        return xp.take(table.reshape(-1), c + u)

    # -- integer matmul ------------------------------------------------------
    def int_matmul(self, a, a_shift, za, w, wsum, zw, kc, acc_dtype):
        """Exact ``sum_k (a - za) * (w - zw)`` through float32 matmul.

        ``a`` is integer ``(..., M, K)``; ``w`` is float32 ``(..., K, N)`` holding
        weight integers minus their shift, ``wsum`` their column sums and ``zw``
        the weight zero point minus the shift (a scalar or ``(N,)``);
        ``a_shift`` centres ``a`` the same way. Products of centred values are at
        most ``2**(bits_a - 1) * 2**(bits_w - 1)``, so with ``kc`` such that
        ``kc`` of them stay below ``2**24`` every float32 partial sum is exact;
        the chunks are summed as integers. In ``acc_dtype`` int32 the arithmetic
        may wrap on the way, harmlessly: the caller picks int32 only when the
        result fits, and sums and products are exact modulo ``2**32``.
        """
        xp = self.xp
        k_len = a.shape[-1]
        af = xp.subtract(a, xp.float32(a_shift), dtype=xp.float32)  # one pass
        acc = None
        for k0 in range(0, max(k_len, 1), kc):  # K = 0: one empty product, zeros as in NumPy
            part = xp.matmul(af[..., k0 : k0 + kc], w[..., k0 : k0 + kc, :]).astype(acc_dtype)
            if acc is None:
                acc = part
            else:
                acc += part
        za = int(za) - a_shift
        zw = xp.asarray(zw).astype(xp.int64)
        if za:
            acc -= (za * wsum.astype(xp.int64)).astype(acc_dtype)[..., None, :]
        if bool(xp.any(zw)):
            asum = a.astype(xp.int64).sum(axis=-1) - k_len * a_shift
            acc -= (asum[..., :, None] * zw).astype(acc_dtype)
            acc += (k_len * za * zw).astype(acc_dtype)
        return acc

    # -- sub-byte packing ---------------------------------------------------
    def pack(self, q, bits):
        """Flattened ``q`` packed ``8 // bits`` to a byte, first element in the low bits."""
        xp = self.xp
        per = 8 // bits
        flat = q.reshape(-1).astype(xp.uint8) & ((1 << bits) - 1)
        pad = -flat.size % per
        if pad:
            flat = xp.concatenate([flat, xp.zeros(pad, xp.uint8)])
        lanes = flat.reshape(-1, per)
        out = xp.zeros(lanes.shape[0], xp.uint8)
        for j in range(per):
            out |= lanes[:, j] << (bits * j)
        return out

    def unpack(self, packed, bits, signed, count):
        """The first ``count`` values of ``packed``, sign-extended when ``signed``."""
        xp = self.xp
        shifts = xp.arange(0, 8, bits, dtype=xp.uint8)
        vals = ((packed.reshape(-1, 1) >> shifts) & ((1 << bits) - 1)).reshape(-1)[:count]
        if not signed:
            return vals.astype(xp.uint8)
        sign = 1 << (bits - 1)
        return ((vals.astype(xp.int16) ^ sign) - sign).astype(xp.int8)
