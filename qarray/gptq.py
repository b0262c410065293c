"""GPTQ (Frantar et al., 2022): weights quantized column by column, each column's
rounding error spread over the columns not yet quantized through the inverse
Hessian of the layer's calibration inputs, as IST-DASLab's ``fasterquant``
does it and AutoGPTQ and GPTQModel run it.

>>> rng = numpy.random.default_rng(0)
>>> w = rng.standard_normal((64, 256)).astype(numpy.float32)        # (out_features, in_features)
>>> x = rng.standard_normal((512, 256)).astype(numpy.float32)       # calibration inputs (tokens, in_features)
>>> q = quantize(w, x, bits=4, group_size=128)
>>> q.dtype, q.shape
(int4_g128_f16, (64, 256))

Two parts:

- :class:`Hessian` keeps ``sum X^T X`` over the calibration inputs and their
  count, ``H = 2 / n * sum X^T X`` (GPTQModel's: ``n`` counts rows, tokens;
  AutoGPTQ counts sequences, a constant factor that GPTQ's result does not
  depend on). The sum is **exact**: each batch is cut into integer slices of
  ``b`` bits below its largest power of two (``x = sum_k C_k 2^e_k``, exact for
  float16, bfloat16, float32 and float64 values alike), ``b`` the most bits for
  which a float64 product over the batch's rows sums integers below 2^53 (22 bits
  for 512 rows, 20 for 8192, at most 8192 rows a product), so every product of
  two slices is exact; those go, at their power of two, into integers of 60-bit
  digits. The sum does not depend on how the rows were split into batches, in
  what order they came, or how partial sums were merged
  (:meth:`Hessian.merge`, Dask chunks): the same state and the same ``H`` bits
  every way, as the observers' histograms. The cost: one float64 product per
  pair of slices where GPTQ takes one float32 product (float32 activations
  typically fill two slices, so three products; the slices that only small
  values reach are taken over the few rows and columns that hold them), and two
  to four int64 ``(K, K)`` arrays of digits.
- :class:`GPTQ` takes the float weight ``(out_features, in_features)``, the
  Hessian's statistics and the settings, and :meth:`GPTQ.quantize` returns a
  QArray: GPTQ's own grouped formats (``int{bits}_g{group}_f16``, symmetric;
  ``uint{bits}_g{group}_f16_zp``, asymmetric: what ``qarray.load`` reads from
  GPTQ checkpoints and ``qarray.save(..., format="gptq")`` writes, act-order
  in ``q.columns``), or any block format with a quantizer (``dtype="Q4_0"``,
  ``"Q4_K"``, ...).

The algorithm, step by step as ``fasterquant`` (AutoGPTQ's ``gptq.py``,
GPTQModel's ``GPTQ.quantize``): per channel (``group_size=-1``) the parameters
come from the whole weight, as given; dead inputs (``H[i, i] == 0``) get ``H[i, i] = 1``
and a zero weight column; with ``static_groups`` every group's parameters come
from the weight before any update; with ``act_order`` the columns go in order
of decreasing ``H[i, i]`` (ties in column order); ``damp_percent`` times the
mean of the diagonal is added to it; then the upper Cholesky factor ``U`` of
``H^-1``. Columns go in blocks of ``block_size``: each column is rounded, its
error divided by ``U[i, i]`` is taken off the block's later columns at once
(``W1[:, i:] -= err * U[i, i:]``) and, at the end of the block, off all later
columns in one product (the lazy batch). A group's parameters come from the
weight as it stands at the start of the current block (the original's ``W``,
not its in-block copy ``W1``), when its first column comes up.

GPTQ's quantizer (``Quantizer.find_params``): per row of a group, ``min`` and
``max`` widened to hold 0; symmetric: ``max = max(|min|, max)`` and ``min =
-max`` where ``min < 0`` (a group with no negative value keeps ``min = 0``:
GPTQ's own quirk, which halves its range); a group of zeros ``[-1, 1]``;
``scale = (max - min) / (2^bits - 1)``, zero point ``2^(bits - 1)`` or
``round(-min / scale)``; a value's code ``clamp(round(w / scale) + zero, 0,
2^bits - 1)``, round half to even. ``mse=True``: the scale shrunk by up to 80%
in 100 steps, keeping the least ``sum |error|^2.4`` per row (``grid=100``,
``norm=2.4``, ``maxshrink=0.8``).

Where qarray differs from AutoGPTQ and GPTQModel, on purpose:

- It computes in float64 (they do in float32), so its codes differ from theirs
  on a share of weights (float32 rounding, carried on by the error
  compensation), not in method; tests hold it to a float64 port of
  ``fasterquant`` code for code.
- Scales are rounded to the format's scale type (float16 for GPTQ's formats)
  *before* the codes are chosen, so the compensation sees the scale that is
  stored; they compute with float32 scales and recompute the codes from the
  float16 scales when packing. (A zero point that this pushes past the code
  range, possible with bfloat16 scales at 8 bits, is clamped.) A scale that
  rounds to 0 (weights below float16's smallest step) leaves its group's
  values 0; one that overflows is a ValueError.
- The upper Cholesky factor of ``H^-1`` is computed as the reversed inverse of
  the Cholesky factor of ``H`` reversed (the same factor, as the factor is
  unique), factor and inverse together by halves in matrix products (no full
  inverse).
- The same updates in another order of sums: a block's share of the lazy
  batch updates is taken when the block comes up, in one product over all
  earlier columns (not one pass over all later columns per block), and inside
  a block the columns' updates go one by one within 16 columns, then one
  product for the rest of the block. Only float64 roundings differ (a last bit
  here and there), which the tests show leaves the codes as the original's.
- A Cholesky that fails (``H`` not positive definite after damping) is a
  ValueError that says to raise ``damp_percent``; GPTQModel raises the damping
  in steps by itself.

Block formats (``dtype="Q4_0"``, ``"Q4_K"``, ``"IQ4_NL"``, ``"nf4_g64_f32"``,
...): the groups are the format's blocks; when a block's first column comes
up, the format's own quantizer picks the block's parameters (scales, minimums,
sub-block scales) from the weight as it stands, and each column is then
rounded to the nearest value that the block can hold (the format's values,
with its float rounding), so the compensation sees exactly what
``dequantize`` gives. Formats whose codes index vectors (the IQ lattices,
TQ1_0), NVFP4 with a tensor scale and Q8_K (activations only) are refused.

Backends: the Hessian's sums run on the inputs' backend (NumPy, CuPy; Dask
chunk by chunk, merged exactly); the quantization runs on NumPy (the weight
is brought to the host) and returns a NumPy QArray.
"""

from __future__ import annotations

import numpy as np

from . import _blocks
from ._dtypes import qdtype
from ._grouped import _GROUPED
from ._params import float_values, is_lazy, refuse_nonfinite, to_host
from ._qarray import QArray
from . import backends
from .backends import for_array

__all__ = ["GPTQ", "Hessian", "quantize"]

DIGIT = 60  # bits of the sum's digits
ROWS = 8192  # rows in one float64 product at most
_HALF = 1 << (DIGIT - 1)
_LIMIT_BOUND = (1 << 63) - (1 << 61)  # carry a digit before an add could take it past int64
_PRODUCT = 1 << 53  # a bound on a product of two slices (float64 integers)
_PENDING = 1 << 8  # products summed at a power before they go into the digits (|sum + sum^T| < 2^62)


def _width(rows):
    """The slice width for products over ``rows`` rows: the most bits ``b`` with ``rows * (2^b - 1)^2 <
    2^53``, so that every partial sum of the float64 product is an integer float64 holds (22 bits for
    512 rows, 20 for 8192)."""
    return min(26, (53 - (rows - 1).bit_length()) // 2)


def _slices(x, xp, bits):
    """``[(e, C, rows)]``: float64 integer arrays ``C`` with ``|C| < 2^bits`` and ``x = sum C 2^e``
    exactly, ``e`` descending from the top of ``x``'s largest value; ``rows`` says which rows of ``C``
    hold a nonzero (products skip the others: low slices are mostly zero)."""
    r = x.copy()
    amax = float(to_host(xp.abs(r).max()))
    out = []
    if amax == 0:
        return out
    e = int(np.frexp(amax)[1])  # |x| < 2^e
    while True:
        e -= bits
        c = xp.trunc(xp.ldexp(r, -e))  # exact: r times a power of two (|r| < 2^(e + bits)), its integer part
        rows = xp.any(c != 0, axis=1)
        if bool(to_host(rows.any())):
            out.append((e, c, rows))
            r -= xp.ldexp(c, e)  # exact: what is left is r's bits below 2^e
        if not bool(to_host(xp.any(r != 0))):
            return out


def _add_transpose(p, tile=256):
    """``p += p.T`` in place, tile by tile (a whole transposed copy of a large ``p`` crawls through the
    cache)."""
    k = len(p)
    for i in range(0, k, tile):
        d = p[i:i + tile, i:i + tile]
        d += d.T.copy()
        for j in range(i + tile, k, tile):
            t = p[i:i + tile, j:j + tile] + p[j:j + tile, i:i + tile].T
            p[i:i + tile, j:j + tile] = t
            p[j:j + tile, i:i + tile] = t.T


class Hessian:
    """The exact ``sum X^T X`` of calibration inputs ``X`` (rows: tokens, columns: the layer's
    ``in_features``) and their count; ``hessian()`` is GPTQ's ``H = 2 / n * sum X^T X``.

    ``update(x)`` (alias ``add_batch``) takes an array ``(..., in_features)`` (NumPy, CuPy or Dask;
    float16, bfloat16, float32, float64 or integers of up to 32 bits), its leading axes flattened to
    rows; ``merge(other)`` adds another's sums (from other batches, processes, machines: the same
    bits in any order); ``state_dict()`` / :meth:`from_state` keep it as plain arrays. The sum is held
    as ``sum_j digits[j] * 2^(60 j)``, int64 digits (one ``(K, K)`` array per ``j``), which
    ``state_dict`` gives in their unique form (every digit in ``[-2^59, 2^59)``, no array of zeros): two
    Hessians of the same sum give the same arrays.

    ``exact=False``: GPTQModel's arithmetic instead, for speed: one product ``x^T x`` a batch, in
    float32 for float16, bfloat16 and float32 inputs (float64 for float64 and integers), added into a
    float64 sum. It costs one product where the exact sum takes about three float64 ones (and their
    bookkeeping: 4-10 times as long on a CPU), and its sums merge as floats do, close but not bit for
    bit across splits and orders. Exact and inexact Hessians do not merge."""

    def __init__(self, in_features, exact=True):
        if isinstance(in_features, (bool, np.bool_)) or not isinstance(in_features, (int, np.integer)):
            raise TypeError(f"Hessian: in_features must be an integer, got {type(in_features).__name__}")
        if in_features < 1:
            raise ValueError(f"Hessian: in_features must be positive, got {in_features}")
        if not isinstance(exact, (bool, np.bool_)):
            raise TypeError(f"Hessian: exact must be True or False, got {exact!r}")
        self.in_features, self.exact = int(in_features), bool(exact)
        self.reset()

    def reset(self) -> "Hessian":
        """Forget every batch."""
        self.count = 0
        self._digits = {}  # j -> int64 (K, K)
        self._bound = {}  # j -> a bound on |digits[j]| (Python int), to carry before int64 could overflow
        self._pending = {}  # (power, cross) -> [int64 (K, K) sum of products at 2^power, how many]
        self._float = None  # exact=False: the float64 (K, K) sum
        self._on_backend = None  # the name of the backend holding the digits (a name: Hessians pickle)
        return self

    @property
    def _xp(self):
        return backends.get(self._on_backend).xp

    def __repr__(self):
        return f"Hessian(in_features={self.in_features}{'' if self.exact else ', exact=False'}; {self.count} rows)"

    # updates
    def update(self, x) -> "Hessian":
        """Add the rows of ``x`` (``(..., in_features)``). Returns ``self``."""
        if not hasattr(x, "dtype") or not hasattr(x, "shape"):
            x = np.asarray(x)
        if getattr(x, "ndim", 0) < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"Hessian.update: inputs of shape (..., {self.in_features}) are needed (in_features "
                             f"{self.in_features}), got shape {tuple(x.shape)}")
        x = float_values(x)
        kind, size = np.dtype(x.dtype).kind, np.dtype(x.dtype).itemsize
        if kind not in "fiu" or (kind in "iu" and size > 4) or (kind == "f" and size > 8):
            raise TypeError(f"Hessian.update: takes float16, bfloat16, float32, float64 or integers of up to "
                            f"32 bits (exact in float64), got {x.dtype}")
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 0:
            return self
        if is_lazy(rows):
            return self._update_lazy(rows)
        backend = for_array(rows)
        xp = backend.xp
        rows = rows.astype(np.float32 if not self.exact and kind == "f" and size <= 4 else np.float64)
        bad = ~xp.isfinite(rows)
        if bool(to_host(bad.any())):
            n, first = int(to_host(bad.sum())), int(to_host(xp.flatnonzero(bad.ravel())[0]))
            raise ValueError(f"Hessian.update: the inputs hold {n} NaN or infinite value(s) (the first at flat index "
                             f"{first}); GPTQ needs finite activations")
        self._on(backend.name)
        if self.exact:
            self._take(rows, xp)
        else:
            p = (rows.T @ rows).astype(np.float64)
            self._float = p if self._float is None else self._float + p
        self.count += int(rows.shape[0])
        return self

    add_batch = update

    def _update_lazy(self, rows):
        """A Dask array: one Hessian per chunk of rows, merged in a tree, computed now."""
        import dask

        rows = rows.rechunk({1: -1}) if rows.numblocks[1] > 1 else rows
        k, exact = self.in_features, self.exact

        def part(block):
            return Hessian(k, exact).update(block)

        def both(a, b):
            return a.merge(b)

        parts = [dask.delayed(part)(b) for b in rows.to_delayed().ravel()]
        while len(parts) > 1:
            parts = [dask.delayed(both)(*parts[i:i + 2]) if i + 1 < len(parts) else parts[i]
                     for i in range(0, len(parts), 2)]
        (total,) = dask.compute(parts[0])
        return self.merge(total)

    def _take(self, x, xp):
        """Add ``x^T x`` (float64 rows on ``xp``): per block of rows, the products of its slices two by
        two, each exact, kept as int64 at their power of two (:meth:`_pend`); a product of slices that
        few rows hold is taken over those rows and the columns they touch, into the digits at once."""
        k = self.in_features
        for r in range(0, x.shape[0], ROWS):
            block = x[r:r + ROWS]
            parts = _slices(block, xp, _width(block.shape[0]))
            for a in range(len(parts)):
                for b in range(a, len(parts)):
                    (ea, ca, ra), (eb, cb, rb) = parts[a], parts[b]
                    rows = ra & rb
                    n = int(to_host(rows.sum()))
                    if n == 0:
                        continue
                    if n < len(rows):
                        ca, cb = ca[rows], cb[rows]
                    if 8 * n < len(rows):
                        ia = xp.flatnonzero(xp.any(ca != 0, axis=0))
                        ib = ia if a == b else xp.flatnonzero(xp.any(cb != 0, axis=0))
                        if 4 * len(ia) * len(ib) < k * k:  # a small corner of the sum
                            p = (ca[:, ia].T @ cb[:, ib]).astype(np.int64)  # exact: integers below 2^53
                            if a != b:
                                self._add(p.T.copy(), ea + eb, _PRODUCT, (ib, ia))  # the (b, a) product
                            self._add(p, ea + eb, _PRODUCT, (ia, ib))
                            continue
                    self._pend((ca.T @ cb).astype(np.int64), ea + eb, a != b)  # exact: integers below 2^53

    def _pend(self, p, at, cross):
        """Add the product ``p`` (int64, ``|p| < 2^53``) of power ``2^at`` to the pending sum of that
        power (a plain int64 add: most batches' slices fall at the same powers, so the shifts and
        carries into digits are paid once a power, not once a product). ``cross``: ``p`` stands for
        ``p + p^T`` (a product of two different slices and its mirror), made at the flush."""
        key = (at, cross)
        if key in self._pending and self._pending[key][1] >= _PENDING:
            self._flush_one(key)
        if key not in self._pending:
            self._pending[key] = [p, 1]
        else:
            self._pending[key][0] += p
            self._pending[key][1] += 1

    def _flush_one(self, key):
        (at, cross), (p, count) = key, self._pending.pop(key)
        if cross:
            _add_transpose(p)  # |p + p^T| < 2 * count * 2^53 <= 2^62
        self._add(p, at, (2 if cross else 1) * count * _PRODUCT)

    def _flush(self):
        """Every pending sum into the digits."""
        for key in list(self._pending):
            self._flush_one(key)

    def _on(self, name):
        if self._on_backend is None:
            self._on_backend = name
        elif self._on_backend != name:
            raise TypeError(f"Hessian: sums held on {self._on_backend}, inputs on {name}; keep one backend "
                            "(or merge Hessians: merge brings the other's sums over)")

    def _digit(self, j):
        if j not in self._digits:
            self._digits[j] = self._xp.zeros((self.in_features, self.in_features), np.int64)
            self._bound[j] = 0
        return self._digits[j]

    def _add(self, p, at, bound, at_index=None):
        """Add int64 ``p`` (``|p| < bound <= 2^63``; used as scratch) times ``2^at`` to the digits, at
        the entries ``numpy.ix_(*at_index)`` (default: all): ``p``'s bits that fall in a digit go into
        it, from the lowest, until the rest fits one add."""
        j, s = divmod(at, DIGIT)

        def into(i, v):
            if at_index is None:
                self._digits[i] += v
            else:
                ix = self._xp.ix_(*at_index)
                self._digits[i][ix] = self._digits[i][ix] + v
        while bound << s > 1 << 61:
            width = DIGIT - s  # p's bits below 2^width go into digit j (shifted up by s), the rest up
            high = p >> np.int64(width)
            p -= high << np.int64(width)  # in [0, 2^width)
            p <<= np.int64(s)
            self._room(j, 1 << DIGIT)
            into(j, p)
            p, bound, j, s = high, (bound >> width) + 1, j + 1, 0
        p <<= np.int64(s)
        self._room(j, bound << s)
        into(j, p)

    def _room(self, j, add):
        """Make room in digit ``j`` for an add of magnitude up to ``add``: carry it up first where the
        sum could pass int64's range."""
        self._digit(j)
        if self._bound[j] + add > _LIMIT_BOUND:
            self._carry_one(j)
        self._bound[j] += add

    def _carry_one(self, j):
        """Digit ``j`` into ``[-2^59, 2^59)``, its carry added to digit ``j + 1`` (exact)."""
        d = self._digits[j]
        c = d + np.int64(_HALF)
        self._xp.bitwise_and(c, np.int64((1 << DIGIT) - 1), out=d)  # d - (c << 60), in place
        d -= np.int64(_HALF)
        c >>= np.int64(DIGIT)
        self._bound[j] = _HALF
        if bool(to_host(c.any())):
            self._room(j + 1, 16)
            self._digits[j + 1] += c

    def _carry(self):
        """Every digit into ``[-2^59, 2^59)``, carrying up from the lowest (exact, in int64)."""
        j = min(self._digits, default=None)
        while j is not None:
            self._carry_one(j)
            higher = [i for i in self._digits if i > j]
            j = min(higher) if higher else None

    def _normalize(self):
        """The unique form: digits in ``[-2^59, 2^59)``, and only the arrays that hold a nonzero one."""
        self._flush()
        self._carry()
        for j in sorted(self._digits):
            if not bool(to_host(self._digits[j].any())):
                del self._digits[j], self._bound[j]

    def merge(self, other) -> "Hessian":
        """Add the sums and count of ``other`` (a Hessian of the same ``in_features``, or a
        :class:`GPTQ`'s). Returns ``self``."""
        if isinstance(other, GPTQ):
            other = other.hessian_sums
        if not isinstance(other, Hessian):
            raise TypeError(f"Hessian.merge: takes a Hessian or a GPTQ, got {type(other).__name__}")
        if other.in_features != self.in_features:
            raise ValueError(f"Hessian.merge: in_features differ ({self.in_features} here, {other.in_features} in the "
                             "other)")
        if other.exact != self.exact:
            raise ValueError(f"Hessian.merge: an {'exact' if self.exact else 'inexact'} Hessian cannot take an "
                             f"{'exact' if other.exact else 'inexact'} one's sums (exact={other.exact}); collect "
                             "both with the same exact setting")
        if not self.exact:
            if other._float is not None:
                theirs = self._here(other, other._float)
                self._float = theirs.copy() if self._float is None else self._float + theirs
            self.count += other.count
            return self
        if other is self:
            other = Hessian.from_state(self.state_dict())
        other._normalize()
        for j, d in other._digits.items():
            d = self._here(other, d)  # (first: _room makes the digit on this Hessian's backend)
            self._room(j, _HALF)
            self._digits[j] += d
        self.count += other.count
        return self

    def _here(self, other, a):
        """``a``, an array of ``other``'s sums, on this Hessian's backend (``other``'s, where this one
        holds nothing yet)."""
        if self._on_backend is None:
            self._on_backend = other._on_backend
        return a if other._on_backend == self._on_backend else self._xp.asarray(to_host(a))

    # results
    def sum(self) -> np.ndarray:
        """``sum X^T X`` as float64 ``(K, K)`` on the host: the digits converted and added from the
        lowest (the same bits for the same exact sum); ``exact=False``: the float sum."""
        if not self.exact:
            k = self.in_features
            return np.zeros((k, k)) if self._float is None else np.array(to_host(self._float), np.float64)
        self._normalize()
        total = np.zeros((self.in_features, self.in_features))
        for j in sorted(self._digits):
            total += np.ldexp(to_host(self._digits[j]).astype(np.float64), DIGIT * j)
        return total

    def hessian(self) -> np.ndarray:
        """GPTQ's ``H = 2 / n * sum X^T X``, float64 ``(K, K)`` on the host. ValueError before any
        row was added."""
        if self.count == 0:
            raise ValueError("Hessian: no calibration inputs yet; call update(x) with the layer's inputs first")
        return self.sum() * (2.0 / self.count)

    # state
    def state_dict(self) -> dict:
        """``{"kind", "in_features", "count", "exponents", "digits"}`` as NumPy arrays (no pickle):
        ``digits[i]`` is the int64 ``(K, K)`` digit array at ``2^(60 exponents[i])``. ``exact=False``:
        ``{"kind": "gptq_hessian_float", "in_features", "count", "sum"}``, ``sum`` float64 ``(K, K)``."""
        if not self.exact:
            return {"kind": np.array("gptq_hessian_float"), "in_features": np.array(self.in_features),
                    "count": np.array(self.count), "sum": self.sum()}
        self._normalize()
        keys = sorted(self._digits)
        k = self.in_features
        return {"kind": np.array("gptq_hessian"), "in_features": np.array(k), "count": np.array(self.count),
                "exponents": np.array(keys, np.int64),
                "digits": np.stack([to_host(self._digits[j]) for j in keys]) if keys else np.zeros((0, k, k), np.int64)}

    @classmethod
    def from_state(cls, state) -> "Hessian":
        """The Hessian that :meth:`state_dict` described (on the host). ValueError for a damaged one."""
        try:
            kind, k, count = (np.asarray(state[key]) for key in ("kind", "in_features", "count"))
            kind = str(kind)
            if kind == "gptq_hessian_float":
                return cls._from_float_state(k, count, np.asarray(state["sum"]))
            exponents, digits = np.asarray(state["exponents"]), np.asarray(state["digits"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"Hessian.from_state: a dict of arrays with kind, in_features, count, exponents and "
                             f"digits (or sum, for exact=False) is needed ({e!r})") from None
        if kind != "gptq_hessian" or k.shape or k.dtype.kind not in "iu" or count.shape \
                or count.dtype.kind not in "iu" or int(k) < 1 or int(count) < 0:
            raise ValueError("Hessian.from_state: fields 'kind', 'in_features' and 'count' are not a Hessian's "
                             "(kind 'gptq_hessian', in_features >= 1, count >= 0)")
        k = int(k)
        if exponents.ndim != 1 or exponents.dtype.kind not in "iu" or digits.dtype != np.int64 \
                or digits.shape != (len(exponents), k, k) or len(set(exponents.tolist())) != len(exponents):
            raise ValueError(f"Hessian.from_state: 'exponents' must be distinct integers and 'digits' int64 of "
                             f"shape ({len(exponents)}, {k}, {k}); got {exponents.dtype} {exponents.shape} and "
                             f"{digits.dtype} {digits.shape}")
        if digits.size and (digits.min() < -_HALF or digits.max() >= _HALF):
            raise ValueError("Hessian.from_state: 'digits' must lie in [-2^59, 2^59)")
        h = cls(k)
        h.count = int(count)
        if len(exponents):
            h._on_backend = "numpy"
            for j, d in zip(exponents.tolist(), digits):
                h._digits[int(j)], h._bound[int(j)] = d.copy(), _HALF
            h._normalize()
        return h

    @classmethod
    def _from_float_state(cls, k, count, total):
        if k.shape or k.dtype.kind not in "iu" or count.shape or count.dtype.kind not in "iu" or int(k) < 1 \
                or int(count) < 0:
            raise ValueError("Hessian.from_state: fields 'in_features' and 'count' are not a Hessian's "
                             "(in_features >= 1, count >= 0)")
        k = int(k)
        if total.dtype != np.float64 or total.shape != (k, k) or not np.isfinite(total).all():
            raise ValueError(f"Hessian.from_state: 'sum' must be finite float64 of shape ({k}, {k}); got "
                             f"{total.dtype} {total.shape}")
        h = cls(k, exact=False)
        h.count = int(count)
        if h.count:
            h._on_backend, h._float = "numpy", total.copy()
        return h


# -- quantizers inside the loop ----------------------------------------------------------------------

def _rounded_to(stype):
    """float64 scales rounded to scale type ``stype`` (``"f16"``, ``"bf16"``, ``"f32"``) through float32,
    as AutoGPTQ's float32 scales are stored and ``qarray._grouped``'s quantizers round theirs, as
    float64; None: kept."""
    if stype is None:
        return lambda s: s

    precision = {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}[stype]

    def store(s):
        with np.errstate(over="ignore"):
            return _blocks.rounded(s.astype(np.float32), precision).astype(np.float64)
    return store


_LIMIT = {"f16": 65504.0, "bf16": 3.3895313892515355e38, "f32": 3.4028234663852886e38}


class _GPTQGrid:
    """GPTQ's quantizer (``Quantizer.find_params`` / ``quantize``) in float64, its scales rounded to
    ``stype`` (None: not rounded, GPTQ's own arithmetic) before anything uses them."""

    def __init__(self, bits, sym, mse=False, stype="f16", grid=100, norm=2.4, maxshrink=0.8):
        self.bits, self.sym, self.mse, self.stype = bits, sym, mse, stype
        self.maxq = float((1 << bits) - 1)
        self.grid, self.norm, self.maxshrink = grid, norm, maxshrink
        self.store = _rounded_to(stype)

    def _scale(self, lo, hi):
        raw = (hi - lo) / self.maxq
        s = self.store(raw)
        if self.stype is not None and np.isinf(s).any():
            raise ValueError(f"GPTQ: a group spans {float(np.max(hi - lo)):.6g}, which needs a scale above "
                             f"{_LIMIT[self.stype]:.6g}, the largest {self.stype} scale; pick a format with float32 or "
                             "bfloat16 scales (e.g. 'int4_g128_f32')")
        return s, raw

    def _zero(self, lo, s, raw):
        if self.sym:
            return np.full_like(s, (self.maxq + 1) / 2)
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.where(s > 0, np.rint(-lo / np.where(s > 0, s, 1)), np.rint(-lo / raw))
        return np.clip(z, 0, self.maxq)

    def _fake(self, x, s, z):
        """GPTQ's ``quantize``: ``scale * (clamp(round(x / scale) + zero, 0, maxq) - zero)``; codes too."""
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(s > 0, np.clip(np.rint(x / s) + z, 0, self.maxq), z)
        return q, s * (q - z)

    def params(self, x, slots=None):
        """``(scale, zero)`` (float64 ``(rows,)`` each) of the group ``x`` (float64 ``(rows, n)``)."""
        lo = np.minimum(x.min(axis=1), 0)
        hi = np.maximum(x.max(axis=1), 0)
        if self.sym:
            hi = np.maximum(np.abs(lo), hi)
            lo = np.where(lo < 0, -hi, lo)
        both = (lo == 0) & (hi == 0)
        lo, hi = np.where(both, -1.0, lo), np.where(both, 1.0, hi)
        s, raw = self._scale(lo, hi)
        z = self._zero(lo, s, raw)
        if self.mse:
            best = np.full(len(x), np.inf)
            for i in range(int(self.maxshrink * self.grid)):
                p = 1 - i / self.grid
                lo1, hi1 = p * lo, p * hi
                s1, raw1 = self._scale(lo1, hi1)
                z1 = self._zero(lo1, s1, raw1) if not self.sym else z
                _, y = self._fake(x, s1[:, None], z1[:, None])
                err = (np.abs(y - x) ** self.norm).sum(axis=1)
                better = err < best
                best = np.where(better, err, best)
                s, z = np.where(better, s1, s), np.where(better, z1, z)
        return s, z

    def round(self, w, p, slot=None):
        """Codes and values of column ``w`` under parameters ``p``."""
        s, z = p
        return self._fake(w, s, z)


class _FormatGrid:
    """A block format's own quantizer for a block's parameters; each column then rounded to the nearest
    value the block holds (the format's values and float rounding)."""

    def __init__(self, fmt):
        self.fmt = fmt
        order = np.argsort(fmt.values, kind="stable")
        self.order, self.sorted = order, fmt.values[order].astype(np.float64)

    def params(self, x, slots):
        """The fields (all but the codes), sub-block scales, offsets and zero points of a block whose
        columns ``x`` (float64 ``(rows, block)``, in the order they are quantized) stand at ``slots``."""
        f = self.fmt
        block = np.empty_like(x)
        block[:, slots] = x
        with np.errstate(over="ignore"):
            x32 = block.astype(np.float32)
        if not np.isfinite(x32).all():
            raise ValueError(f"GPTQ: {f.name} takes values within float32's range; the weights reach "
                             f"{float(np.abs(x).max()):.6g}")
        fields = f.quantize(x32)
        fields = {k: np.asarray(v).reshape(len(x), -1) for k, v in fields.items()}  # (rows, count), as unpacked
        with np.errstate(over="ignore", invalid="ignore"):
            scale = f.scales(fields).astype(np.float32)
            off = f.offsets(fields)
        zero = None if f.zero is None else fields[f.zero].astype(np.float32).reshape(len(x), -1)
        return fields, scale.reshape(len(x), -1), None if off is None else off.reshape(len(x), -1), zero

    def _value(self, v, s, off, z):
        """The format's float32 value of table values ``v`` under a sub-block's parameters
        (``BlockFormat.decode``'s arithmetic)."""
        f = self.fmt
        if z is not None:
            v = v - z
        with np.errstate(over="ignore", invalid="ignore"):
            y = _blocks.rounded((s * v).astype(np.float32), f.precision)
            if f.factor is not None:
                y = _blocks.rounded(y * f.factor, f.precision)
            if off is not None:
                y = _blocks.rounded(y + off, f.precision)
        return y.astype(np.float64)

    def round(self, w, p, slot):
        fields, scale, off, zero = p
        sub = slot // self.fmt.sub
        s = scale[:, sub]
        o = None if off is None else off[:, sub]
        z = None if zero is None else zero[:, sub]
        # the table value the column's value would have, then the nearer of the two around it
        with np.errstate(divide="ignore", invalid="ignore"):
            t = (w - (0 if o is None else o)) / s + (0 if z is None else z)
        t = np.where(np.isfinite(t), t, 0)
        hi = np.clip(np.searchsorted(self.sorted, t), 0, len(self.sorted) - 1)
        lo = np.clip(hi - 1, 0, len(self.sorted) - 1)
        v = self.sorted.astype(np.float32)
        ya = self._value(v[lo], s, o, z)
        yb = self._value(v[hi], s, o, z)
        take_b = np.abs(yb - w) < np.abs(ya - w)
        idx = np.where(take_b, hi, lo)
        return self.order[idx], np.where(take_b, yb, ya)


# -- the algorithm -----------------------------------------------------------------------------------

def _cholesky_inverse(a):
    """``L^-1`` for the lower Cholesky factor ``L`` of ``a`` (``a = L L^T``), by halves: with
    ``L11^-1`` of the top left, ``L21 = A21 L11^-T``, the bottom right's factor is that of ``A22 - L21
    L21^T`` and the inverse's bottom left ``-L22^-1 L21 L11^-1``; five products a level, which run at
    the matrix product's rate (LAPACK's factorization, then a triangular inverse, ran at a third of it).
    ``numpy.linalg.LinAlgError`` where ``a`` is not positive definite."""
    n = len(a)
    if n <= 128:
        return np.linalg.inv(np.linalg.cholesky(a))
    h = n // 2
    i11 = _cholesky_inverse(a[:h, :h])
    l21 = a[h:, :h] @ i11.T
    i22 = _cholesky_inverse(a[h:, h:] - l21 @ l21.T)
    out = np.zeros_like(a)
    out[:h, :h], out[h:, h:] = i11, i22
    out[h:, :h] = -(i22 @ (l21 @ i11))
    return out


def inverse_cholesky(h):
    """The upper Cholesky factor ``U`` of ``h^-1`` (``U^T U = h^-1``; torch's ``cholesky(
    cholesky_inverse(cholesky(h)), upper=True)``): with ``J`` the reversal, ``J h J = L L^T`` gives
    ``h^-1 = (J L^-1 J)^T (J L^-1 J)``, and ``J L^-1 J`` is upper triangular with a positive diagonal,
    so it is that factor. ``numpy.linalg.LinAlgError`` where ``h`` is not positive definite."""
    return np.ascontiguousarray(_cholesky_inverse(np.ascontiguousarray(h[::-1, ::-1]))[::-1, ::-1])


_SUB = 16  # columns of a block whose updates reach each other one by one; the rest as products


def fasterquant(w, h, grid, group, *, block_size=128, damp_percent=0.01, act_order=False, static_groups=False,
                per_channel=False, values=False):
    """GPTQ on float64 ``w`` ``(rows, K)`` and ``h`` ``(K, K)`` with quantizer ``grid`` (``params`` of a
    group, ``round`` of a column): ``(codes (rows, K) uint8 in column order, params per group (in group
    order: g_idx's), g_idx (K,), values)``, ``values`` float64 ``(rows, K)``, what the codes stand for,
    where asked for (else None). ``group`` columns a group (``K`` per channel: ``per_channel`` takes
    the parameters from the whole weight first, as ``group_size=-1`` does)."""
    rows, k = w.shape
    w, h = np.array(w, np.float64), np.array(h, np.float64)
    first = grid.params(w, np.arange(k)) if per_channel else None  # (before the dead columns are zeroed)
    dead = np.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    static = static_groups and not per_channel
    perm = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)
    if static:
        fixed = [grid.params(w[:, i:i + group], np.arange(group)) for i in range(0, k, group)]
    if act_order:
        h = h[np.ix_(perm, perm)]  # (one gather: h[perm][:, perm] takes 3.5x as long at 4096)
    # where each processed column is stored in its group: groups hold their columns in column order
    # (static groups and no act-order: the column's own place; act-order: its rank in its group)
    if static or per_channel:
        g_of = perm // group
        slot = perm % group
    else:
        g_of = np.arange(k) // group
        slot = np.empty(k, np.int64)
        for g in range(0, k, group):
            slot[g:g + group] = np.argsort(np.argsort(perm[g:g + group], kind="stable"), kind="stable")
    h[np.arange(k), np.arange(k)] += damp_percent * np.mean(np.diag(h))
    try:
        u = inverse_cholesky(h)
    except np.linalg.LinAlgError:
        raise ValueError(f"GPTQ: the damped Hessian is not positive definite (damp_percent {damp_percent}); raise "
                         "damp_percent or give more calibration inputs") from None
    wt = w.T[perm]  # (K, rows): a column a row, in the order they are quantized, as before any update
    err = np.empty_like(wt)  # each column's scaled error, (w - q) / U[c, c]
    codes = np.empty((k, rows), np.uint8)
    chosen = np.empty((k, rows)) if values else None
    params = list(fixed) if static else [first] if per_channel else []
    p = first

    def current(c1, c2, i1):
        """Columns c1..c2 as they stand at the start of the block at i1: every earlier block's updates
        (the lazy batch updates, taken here when a block needs them: one product over all earlier
        columns, not a pass over all later columns per block)."""
        out = wt[c1:c2].copy()
        if i1:
            out -= u[:i1, c1:c2].T @ err[:i1]
        return out

    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1 = current(i1, i2, i1)
        start = w1.copy()
        u1 = u[i1:i2, i1:i2]
        for j1 in range(0, i2 - i1, _SUB):  # the block's own updates, lazy in sub-blocks too
            j2 = min(j1 + _SUB, i2 - i1)
            if j1:  # the sub-block's share of the block's earlier columns' updates
                w1[j1:j2] -= u1[:j1, j1:j2].T @ err[i1:i1 + j1]
            for i in range(j1, j2):
                c = i1 + i
                if static:
                    p = params[g_of[c]]
                elif not per_channel and c % group == 0:  # the group's columns at the block's start
                    cols = start[i:i + group] if c + group <= i2 else \
                        np.concatenate([start[i:], current(i2, c + group, i1)])
                    p = grid.params(cols.T, slot[c:c + group])
                    params.append(p)
                col, val = grid.round(w1[i], p, slot[c])
                codes[c] = col
                if values:
                    chosen[c] = val
                e = (w1[i] - val) / u1[i, i]
                w1[i + 1:j2] -= np.multiply.outer(u1[i, i + 1:j2], e)
                err[c] = e
    g_idx = np.empty(k, np.int64)
    g_idx[perm] = g_of
    out_codes = np.empty((rows, k), np.uint8)
    out_codes[:, perm] = codes.T
    if values:
        out_values = np.empty((rows, k))
        out_values[:, perm] = chosen.T
    return out_codes, params, g_idx, out_values if values else None


# -- the public class --------------------------------------------------------------------------------

def _int_in(v, name, lo, hi=None):
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"GPTQ: {name} must be an integer, got {type(v).__name__}")
    if v < lo or (hi is not None and v > hi):
        raise ValueError(f"GPTQ: {name} must be " + (f"in [{lo}, {hi}]" if hi is not None else f">= {lo}")
                         + f", got {v}")
    return int(v)


class GPTQ:
    """GPTQ for one linear layer's weight ``w`` ``(out_features, in_features)``.

    Settings (AutoGPTQ's and GPTQModel's names): ``bits`` (2-8, default 4), ``group_size`` (columns
    sharing a scale, dividing ``in_features``, a multiple of 8; -1 per channel; default 128), ``sym``
    (default True), ``act_order`` (``desc_act``), ``static_groups``, ``damp_percent`` (0.01),
    ``block_size`` (128), ``mse`` (GPTQ's range search). ``dtype``: the QArray's format; None gives
    GPTQ's own, ``int{bits}_g{group}_f16`` (symmetric) or ``uint{bits}_g{group}_f16_zp``; a grouped
    integer format's name sets bits, group and symmetry (and the scale type: ``_bf16``, ``_f32``);
    another block format (``"Q4_0"``, ``"Q4_K"``, ...) quantizes its own blocks, and then ``bits``,
    ``group_size``, ``sym`` and ``mse`` stay unset.

    ``update(x)`` / ``add_batch(x)`` take the layer's inputs ``(..., in_features)`` (see
    :class:`Hessian`; ``exact=False``: its float sum, GPTQModel's arithmetic, for speed);
    ``merge(other)`` adds another GPTQ's or Hessian's; ``quantize()`` runs the algorithm and returns
    the QArray (``hessian=``: a ``(K, K)`` Hessian of your own instead)."""

    def __init__(self, w, bits=None, group_size=None, sym=None, act_order=False, static_groups=False,
                 damp_percent=0.01, block_size=128, dtype=None, mse=False, exact=True):
        w = self._weight(w)
        self.out_features, self.in_features = w.shape
        self.weight = w
        self.act_order, self.static_groups, self.mse = bool(act_order), bool(static_groups), bool(mse)
        if isinstance(damp_percent, (bool, np.bool_)) or not isinstance(damp_percent, (int, float, np.floating,
                                                                                         np.integer)):
            raise TypeError(f"GPTQ: damp_percent must be a number, got {type(damp_percent).__name__}")
        if not 0 <= damp_percent < 1:
            raise ValueError(f"GPTQ: damp_percent must be in [0, 1), got {damp_percent}")
        self.damp_percent = float(damp_percent)
        self.block_size = _int_in(block_size, "block_size", 1)
        self._format(bits, group_size, sym, dtype)
        self.hessian_sums = Hessian(self.in_features, exact)

    @staticmethod
    def _weight(w):
        if not hasattr(w, "dtype") or not hasattr(w, "shape"):
            w = np.asarray(w)
        w = float_values(w)
        if np.dtype(w.dtype).kind != "f":
            raise TypeError(f"GPTQ: w must be a float array (float16, bfloat16, float32, float64), got {w.dtype}")
        if w.ndim != 2 or 0 in w.shape:
            raise ValueError(f"GPTQ: w must be a 2-d weight (out_features, in_features), got shape {tuple(w.shape)}")
        w = np.asarray(to_host(w), np.float64)
        refuse_nonfinite(w, "GPTQ: w", as_float32=False)
        return w

    def _format(self, bits, group_size, sym, dtype):
        k = self.in_features
        if dtype is None:
            bits = 4 if bits is None else _int_in(bits, "bits", 2, 8)
            group_size = 128 if group_size is None else group_size
            sym = True if sym is None else bool(sym)
            stype, fmt = "f16", None
        else:
            name = qdtype(dtype).name if not isinstance(dtype, str) else dtype
            fmt = _blocks.get(name)
            if fmt is None:
                raise ValueError(f"GPTQ: dtype {name!r} is not a block format; GPTQ makes grouped ones "
                                 "(int4_g128_f16, uint4_g128_f16_zp) or GGUF's (Q4_0, Q4_K, ...)")
            m = _GROUPED.fullmatch(fmt.name.lower())
            if m is not None and m.group(1)[0] in "iu" and m.group(2) and (m.group(5) in (None, "_zp")) \
                    and m.group(4) in ("f16", "bf16", "f32") and (m.group(1)[0] == "i") == (m.group(5) is None):
                fb, fg, fs = int(m.group(2)), int(m.group(3)), m.group(5) is None
                given = {"bits": (bits, fb), "group_size": (group_size, fg), "sym": (sym, fs)}
                for key, (got, want) in given.items():
                    if got is not None and got != want and not (key == "group_size" and got == -1 and fg == k):
                        raise ValueError(f"GPTQ: {key}={got!r} disagrees with dtype {fmt.name} ({key} {want})")
                bits, sym, stype = fb, fs, m.group(4)
                group_size = -1 if group_size == -1 else fg
                fmt = None
            else:
                given = [n for n, v in (("bits", bits), ("group_size", group_size), ("sym", sym)) if v is not None]
                if self.mse:
                    given.append("mse")
                if given:
                    raise ValueError(f"GPTQ: {fmt.name} picks its own parameters; drop {', '.join(given)}")
                if fmt.quantize is None or fmt.elements is not None or fmt.values is None or fmt.tensor_scale \
                        is not None or set(fmt.fields) - {"q"} - set(_parameter_fields(fmt)):
                    raise ValueError(f"GPTQ: {fmt.name} is not one GPTQ can fill: it needs a quantizer, a table of "
                                     "values and no fields besides the codes and the block's parameters (not the "
                                     "IQ lattices, TQ1_0, Q8_K or NVFP4 with a tensor scale)")
                bits, sym, stype, group_size = fmt.bits, None, None, fmt.block
        if not isinstance(group_size, (int, np.integer)) or isinstance(group_size, (bool, np.bool_)):
            raise TypeError(f"GPTQ: group_size must be an integer, got {type(group_size).__name__}")
        group_size = int(group_size)
        group = k if group_size == -1 else group_size
        if group < 1 or k % group:
            raise ValueError(f"GPTQ: group_size {group_size} does not divide in_features {k}"
                             + ("" if fmt is None else f" ({fmt.name}'s blocks of {fmt.block} values)"))
        if fmt is None and group % 8:
            raise ValueError(f"GPTQ: groups of {group} columns" + (" (per channel)" if group_size == -1 else "")
                             + ": GPTQ's formats hold groups of a multiple of 8 columns")
        self.bits, self.group_size, self.sym, self._group, self._stype = bits, group_size, sym, group, stype
        self.static_groups = self.static_groups and group_size != -1
        if fmt is None:
            self.dtype = qdtype(f"{'int' if sym else 'uint'}{bits}_g{group}_{stype}{'' if sym else '_zp'}")
            self._grid = _GPTQGrid(bits, sym, self.mse, stype)
        else:
            self.dtype = qdtype(fmt.name)
            self._grid = _FormatGrid(fmt)

    def __repr__(self):
        return (f"GPTQ({self.out_features}x{self.in_features} -> {self.dtype.name}, act_order={self.act_order}, "
                f"static_groups={self.static_groups}; {self.hessian_sums.count} rows)")

    @property
    def nsamples(self) -> int:
        """The calibration rows (tokens) taken so far."""
        return self.hessian_sums.count

    def update(self, x) -> "GPTQ":
        """Take calibration inputs ``x`` ``(..., in_features)``. Returns ``self``."""
        self.hessian_sums.update(x)
        return self

    add_batch = update

    def merge(self, other) -> "GPTQ":
        """Add the calibration sums of another GPTQ (or a :class:`Hessian`) of the same ``in_features``."""
        self.hessian_sums.merge(other)
        return self

    def quantize(self, hessian=None) -> QArray:
        """Run GPTQ; the QArray of ``dtype`` (act-order: ``q.columns``). ``hessian``: a float ``(K, K)``
        matrix to use instead of the inputs' (symmetric, finite)."""
        if hessian is None:
            h = self.hessian_sums.hessian()
        else:
            h = np.asarray(to_host(hessian), np.float64)
            k = self.in_features
            if h.shape != (k, k):
                raise ValueError(f"GPTQ.quantize: hessian must be ({k}, {k}), got shape {h.shape}")
            if not np.isfinite(h).all():
                raise ValueError("GPTQ.quantize: hessian holds NaN or infinite values")
        codes, params, g_idx, _ = self._run(h)
        return self._qarray(codes, params, g_idx)

    def _run(self, h, values=False):
        return fasterquant(self.weight, h, self._grid, self._group, block_size=self.block_size,
                           damp_percent=self.damp_percent, act_order=self.act_order,
                           static_groups=self.static_groups, per_channel=self.group_size == -1, values=values)

    def _qarray(self, codes, params, g_idx):
        n, k = codes.shape
        group = self._group
        columns = np.argsort(g_idx, kind="stable")
        stored = codes[:, columns]
        f = self.dtype.layout
        if isinstance(self._grid, _GPTQGrid):
            scale = np.stack([p[0] for p in params], axis=1)  # (n, groups)
            fields = {"d": scale.astype(f.fields["d"].view).reshape(-1, 1),
                      "q": stored.reshape(n * (k // group), group).astype(np.uint8)}
            if not self.sym:
                fields["z"] = np.stack([p[1] for p in params], axis=1).astype(np.uint8).reshape(-1, 1)
        else:
            fields = {}
            for name in f.fields:
                if name != "q":
                    fields[name] = np.stack([p[0][name] for p in params], axis=1).reshape(n * (k // group), -1)
            fields["q"] = stored.reshape(n * (k // group), group).astype(f.fields["q"].store)
        raw = f.pack(fields).reshape(n, (k // group) * f.nbytes)
        return QArray._blocks(raw, self.dtype, None, None if np.array_equal(columns, np.arange(k)) else columns)


def _parameter_fields(fmt):
    """The fields a block's parameters are read from (not its codes)."""
    names = set()
    for spec in (fmt.scale, fmt.offset and fmt.offset[0]):
        if spec and not callable(spec):
            names.update(n for n in (spec[0], spec[1] and spec[1][0]) if n is not None)
    if fmt.zero is not None:
        names.add(fmt.zero)
    return names


def quantize(w, x=None, *, hessian=None, bits=None, group_size=None, sym=None, act_order=False, static_groups=False,
             damp_percent=0.01, block_size=128, dtype=None, mse=False, exact=True) -> QArray:
    """GPTQ in one call: ``GPTQ(w, ...).update(x).quantize()``; ``x`` the calibration inputs
    ``(..., in_features)``, or ``hessian`` a ``(K, K)`` Hessian of your own (one of the two)."""
    g = GPTQ(w, bits=bits, group_size=group_size, sym=sym, act_order=act_order, static_groups=static_groups,
             damp_percent=damp_percent, block_size=block_size, dtype=dtype, mse=mse, exact=exact)
    if (x is None) == (hessian is None):
        raise TypeError("gptq.quantize: give the calibration inputs x or a hessian (one of them)")
    if x is not None:
        g.update(x)
    return g.quantize(hessian=hessian)
