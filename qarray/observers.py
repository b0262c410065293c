"""Calibration observers: quantization parameters from data seen in batches.

>>> obs = MinMax("qint8", symmetric=True)
>>> for batch in (numpy.array([0.5, -1.0], numpy.float32), numpy.array([2.54], numpy.float32)):
...     _ = obs.update(batch)
>>> obs.qparams()
(array(0.01992157, dtype=float32), array(0, dtype=int32))

Every observer takes ``dtype``, ``symmetric`` and ``axis`` (None: per tensor;
an int: one range per index along that axis of each batch, all other axes
reduced; batches may differ in every other axis). ``update(x)`` takes NumPy or
CuPy float arrays; ``qparams()`` maps the chosen range through
:func:`qarray.choose_qparams` (so the range is widened to hold 0, as ONNX does)
and returns ``(scale, zero_point)`` as :func:`qarray.quantize` takes them.

- :class:`MinMax`: the range seen.
- :class:`MovingAverageMinMax`: PyTorch's ``MovingAverageMinMaxObserver``: the
  first batch sets the range, then ``r += c * (batch_r - r)`` in float32.
- :class:`Histogram`: counts in ``bins`` equal bins over ``[-R, R)``, ``R`` the
  smallest power of two above every ``|x|`` seen. When a batch needs a larger
  ``R``, each doubling sums adjacent pairs of bins into the middle half: counts
  stay exact integers, so merging the histograms of several workers gives the
  histogram of all their data, bit for bit. The clipping range is then chosen
  by ``method``:

  - ``"percentile"``: symmetric, ``[-t, t]`` with ``t`` the bin edge where the
    ``percentile``-th percentile of ``|x|`` is reached; otherwise ``lo`` and
    ``hi`` at the ``100 - percentile`` and ``percentile`` percentiles of ``x``
    (each tail keeps its share), bin edges, never beyond the values seen.
  - ``"mse"``: the range with the least expected squared error over the
    histogram, each bin's count at its centre ``c``: ``step**2 / 12`` inside
    the range (rounding), ``(c - edge)**2`` outside (clipping), ``step`` the
    scale that range gives; ``lo`` and ``hi`` searched over all bin edges
    (``lo = -hi`` when symmetric).
  - ``"entropy"``: the range with the least KL divergence between the
    reference histogram and its quantized version, exactly as ONNX Runtime's
    ``HistogramCollector.get_entropy_threshold`` (TensorRT's method) computes
    it, with ``(qmax - qmin + 1) // 2`` quantized bins (:func:`entropy_threshold`,
    all channels at once), on two views of ``ENTROPY_VIEW`` (2048) bins of a
    histogram 8 times finer (``bins`` 16384 by default): all of ``[-R, R)``, and
    the groups of bins that just hold the values seen, as ONNX Runtime's own
    histogram spans ``[-max|x|, max|x|]`` (``R`` may be up to twice that, and a
    search on bins twice as wide falls up to 1 dB short of ONNX Runtime's on
    heavy tails). Of the two ranges, the one with the smaller expected squared
    error over the histogram. With fewer bins than quantized bins: the whole range.

State: ``state_dict()`` is a dict of NumPy arrays (``numpy.savez`` /
``numpy.load(allow_pickle=False)`` keep it, no pickle) and
:meth:`Observer.from_state` rebuilds the observer from it.

:class:`ImportanceMatrix` collects llama.cpp's importance matrix of a weight
tensor (the mean square of each input column's activations), which the GGUF
K-quants and IQ4 formats take as :func:`qarray.quantize`'s ``importance``; its
sums are exact integers too, merged across workers bit for bit.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import numpy as np

from ._api import choose_qparams, quantize
from ._dtypes import qdtype
from ._params import float_values, is_lazy, normalize_axis, to_host
from .backends import for_array

__all__ = ["Observer", "MinMax", "MovingAverageMinMax", "Histogram", "ColumnSums", "ImportanceMatrix", "observer",
           "entropy_threshold"]

METHODS = ("percentile", "mse", "entropy")
ENTROPY_VIEW = 2048  # bins of the histograms the entropy search runs on (ONNX Runtime's 2048)


def _bin_counts(rows, scale, bins):
    """The histogram counts ``(channels, bins)`` of ``rows``: ``x * bins / (2 R)``
    (``scale`` per channel, a power of two: exact), floored, from bin ``-R``;
    counted on the host (device rows, a device chunk of a dask array, are copied)."""
    rows = to_host(rows)
    idx = np.floor(rows * scale[:, None]).astype(np.int64)
    idx += bins // 2 + bins * np.arange(rows.shape[0], dtype=np.int64)[:, None]
    return np.bincount(idx.ravel(), minlength=rows.shape[0] * bins).reshape(rows.shape[0], bins)


class Observer:
    """The common part: settings, batch checks, qparams, quantize, state."""

    kind = ""
    _fields: tuple = ()  # state arrays beyond the settings
    _kinds: dict = {}  # kind -> the class that names it (here or elsewhere: smoothquant.AbsMax): from_state's table

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "kind" in vars(cls):
            Observer._kinds[cls.kind] = cls

    def __init__(self, dtype="quint8", *, symmetric=False, axis=None):
        self.dtype = qdtype(dtype)
        self.symmetric = bool(symmetric)
        if axis is not None and (isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer))):
            raise TypeError(f"{type(self).__name__}: axis must be an integer or None, got {type(axis).__name__}")
        self.axis = None if axis is None else int(axis)
        self.reset()

    def reset(self) -> "Observer":
        """Forget every batch seen."""
        self.lo = self.hi = None
        return self

    def _rows(self, x):
        """``x`` as ``(channels, values)`` float rows on its device, checked."""
        name = type(self).__name__
        if not hasattr(x, "dtype") or not hasattr(x, "shape"):
            x = np.asarray(x)
        x = float_values(x)  # bfloat16, float8: their values as float32, exactly
        if x.dtype.kind not in "fiu":
            raise TypeError(f"{name}.update: takes a real (float or integer) array, got dtype {x.dtype}")
        if self.axis is None:
            rows = x.reshape(1, -1)
        else:
            axis = normalize_axis(self.axis, x.ndim, f"{name}.update: axis")
            rows = for_array(x).xp.moveaxis(x, axis, 0).reshape(x.shape[axis], -1)
        if rows.shape[1] == 0:
            raise ValueError(f"{name}.update: the batch has no values to observe (shape {x.shape})")
        if self.lo is not None and rows.shape[0] != self.lo.shape[0]:
            raise ValueError(f"{name}.update: the batch has {rows.shape[0]} channels along axis {self.axis}, "
                             f"earlier batches had {self.lo.shape[0]}")
        # per row; the Dask backend takes both in one pass, each a tree over the chunks
        lo, hi = (to_host(v).astype(np.float64) for v in for_array(rows).minmax(rows, 0, None))
        if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
            raise ValueError(f"{name}.update: the batch holds NaN or inf; observe finite values only")
        return rows, lo, hi

    def update(self, x) -> "Observer":
        """Take one batch into the statistics. Returns ``self``."""
        _, lo, hi = self._rows(x)
        self._take(lo, hi)
        return self

    def _take(self, lo, hi):
        self.lo = lo if self.lo is None else np.minimum(self.lo, lo)
        self.hi = hi if self.hi is None else np.maximum(self.hi, hi)

    def _range(self):
        return self.lo, self.hi

    def qparams(self):
        """``(scale, zero_point)`` for the range chosen so far: float32 and int32
        arrays, 0-d per tensor, one per channel with ``axis``."""
        if self.lo is None:
            raise ValueError(f"{type(self).__name__}: no data observed yet; call update(x) first")
        lo, hi = self._range()
        scale, zero_point = choose_qparams(lo, hi, self.dtype, symmetric=self.symmetric)
        if self.axis is None:
            return scale.reshape(()), zero_point.reshape(())
        return scale, zero_point

    def quantize(self, x, reciprocal=False):
        """``x`` quantized with :meth:`qparams` (``axis`` as the observer's);
        ``reciprocal=True``: PyTorch's codes, as :func:`qarray.quantize` gives them."""
        scale, zero_point = self.qparams()
        return quantize(x, scale, zero_point, self.dtype, axis=self.axis, reciprocal=reciprocal)

    def merge(self, other) -> "Observer":
        """Add the statistics of ``other`` (same class and settings) to these."""
        self._check_same(other)
        if other.lo is not None:
            if self.lo is not None and self.lo.shape != other.lo.shape:
                raise ValueError(f"{type(self).__name__}.merge: {self.lo.shape[0]} channels here, "
                                 f"{other.lo.shape[0]} in the other")
            self._merge(other)
        return self

    def _merge(self, other):
        self._take(other.lo, other.hi)

    def _settings(self) -> dict:
        return dict(dtype=self.dtype.name, symmetric=self.symmetric, axis=self.axis)

    def _check_same(self, other):
        if type(other) is not type(self):
            raise ValueError(f"{type(self).__name__}.merge: the other observer is a {type(other).__name__}")
        mine, theirs = self._settings(), other._settings()
        for key in mine:
            if mine[key] != theirs[key]:
                raise ValueError(f"{type(self).__name__}.merge: {key} differs ({mine[key]!r} here, "
                                 f"{theirs[key]!r} in the other)")

    def state_dict(self) -> dict:
        """Settings and statistics as ``{name: numpy array}`` (no objects)."""
        s = {"kind": np.array(self.kind)}
        for key, v in self._settings().items():
            if v is not None:  # axis None: no 'axis' entry
                s[key] = np.array(v)
        if self.lo is not None:
            for key in ("lo", "hi", *self._fields):
                s[key] = np.array(getattr(self, key))
        return s

    @classmethod
    def from_state(cls, state) -> "Observer":
        """The observer that :meth:`state_dict` described (any subclass)."""
        kinds = Observer._kinds
        kind = str(_field(state, "kind", "U", ()))
        if kind not in kinds:
            raise ValueError(f"Observer.from_state: field 'kind' is {kind!r}, not one of {sorted(kinds)}")
        sub = kinds[kind]
        if cls is not Observer and cls is not sub:
            raise ValueError(f"{cls.__name__}.from_state: the state is a {sub.__name__}'s")
        settings = {}
        for key, default in sub._defaults().items():
            if key == "axis" and key not in state:
                continue
            kinds_ok = "U" if isinstance(default, str) else "b" if isinstance(default, bool) else \
                "iu" if isinstance(default, int) else "f"
            settings[key] = _field(state, key, kinds_ok, ()).item()
        try:
            obs = sub(**settings)
        except (TypeError, ValueError) as e:
            raise ValueError(f"Observer.from_state: a setting is invalid: {e}") from None
        if "lo" in state:
            obs._load(state)
        return obs

    @classmethod
    def _defaults(cls) -> dict:
        return dict(dtype="", symmetric=False, axis=0)

    def _load(self, state):
        lo = _field(state, "lo", "f", None).astype(np.float64)
        hi = _field(state, "hi", "f", lo.shape).astype(np.float64)
        if lo.ndim != 1 or (self.axis is None and lo.shape != (1,)) or not (lo <= hi).all() \
                or not (np.isfinite(lo).all() and np.isfinite(hi).all()):
            raise ValueError("Observer.from_state: fields 'lo' and 'hi' must be finite 1-d ranges, lo <= hi "
                             "(one per channel, one per tensor)")
        self.lo, self.hi = lo, hi

    def __repr__(self):
        settings = ", ".join(f"{k}={v!r}" for k, v in self._settings().items())
        seen = "no data" if self.lo is None else f"{self.lo.shape[0]} range(s)"
        return f"{type(self).__name__}({settings}; {seen})"


def _field(state, key, kinds, shape):
    """``state[key]`` as an array of a dtype kind in ``kinds`` and ``shape`` (None: any)."""
    try:
        v = np.asarray(state[key])
    except KeyError:
        raise ValueError(f"Observer.from_state: field {key!r} is missing") from None
    except TypeError:
        raise ValueError(f"Observer.from_state: takes a dict of arrays, got {type(state).__name__}") from None
    if v.dtype.kind not in kinds or (shape is not None and v.shape != shape):
        raise ValueError(f"Observer.from_state: field {key!r} has dtype {v.dtype} and shape {v.shape}; "
                         f"expected kind {kinds!r}" + (f" and shape {shape}" if shape is not None else ""))
    return v


class MinMax(Observer):
    """The smallest and largest values seen (per channel with ``axis``)."""

    kind = "minmax"


class MovingAverageMinMax(Observer):
    """PyTorch's ``MovingAverageMinMaxObserver``: the first batch sets ``lo``,
    ``hi``; each later one moves them by ``averaging_constant`` times the
    difference, in float32 as PyTorch does. ``merge`` raises: the average
    depends on the order of the batches, so partial averages do not combine."""

    kind = "moving_average"

    def __init__(self, dtype="quint8", *, averaging_constant=0.01, symmetric=False, axis=None):
        c = float(averaging_constant)
        if not 0.0 < c <= 1.0:
            raise ValueError(f"MovingAverageMinMax: averaging_constant must be in (0, 1], got {averaging_constant}")
        self.averaging_constant = c
        super().__init__(dtype, symmetric=symmetric, axis=axis)

    def _take(self, lo, hi):
        lo, hi = lo.astype(np.float32), hi.astype(np.float32)
        if self.lo is None:
            self.lo, self.hi = lo.astype(np.float64), hi.astype(np.float64)
            return
        c = np.float32(self.averaging_constant)
        old_lo, old_hi = self.lo.astype(np.float32), self.hi.astype(np.float32)
        self.lo = (old_lo + c * (lo - old_lo)).astype(np.float64)
        self.hi = (old_hi + c * (hi - old_hi)).astype(np.float64)

    def merge(self, other):
        raise ValueError("MovingAverageMinMax.merge: a moving average depends on the order of its batches, "
                         "so partial averages do not combine; merge MinMax or Histogram observers instead")

    def _settings(self):
        return dict(super()._settings(), averaging_constant=self.averaging_constant)

    @classmethod
    def _defaults(cls):
        return dict(super()._defaults(), averaging_constant=0.0)


class Histogram(Observer):
    """Exact streaming histogram; the range by ``method`` (module docstring)."""

    kind = "histogram"
    _fields = ("exponent", "counts")

    def __init__(self, dtype="quint8", *, method="percentile", bins=None, percentile=99.99,
                 symmetric=False, axis=None):
        if method not in METHODS:
            raise ValueError(f"Histogram: method must be one of {', '.join(METHODS)}; got {method!r}")
        if bins is None:  # entropy: finer, for the views its search runs on
            bins = 8 * ENTROPY_VIEW if method == "entropy" else 2048
        if isinstance(bins, (bool, np.bool_)) or not isinstance(bins, (int, np.integer)) \
                or bins < 4 or bins & (bins - 1):
            raise ValueError(f"Histogram: bins must be a power of two, 4 or more (the range doubles by "
                             f"merging pairs of bins), got {bins!r}")
        p = float(percentile)
        if not 50.0 < p <= 100.0:
            raise ValueError(f"Histogram: percentile must be in (50, 100], got {percentile}")
        self.method, self.bins, self.percentile = method, int(bins), p
        super().__init__(dtype, symmetric=symmetric, axis=axis)

    def reset(self):
        super().reset()
        self.exponent = self.counts = None  # R = 2**exponent per channel; counts (channels, bins) int64
        return self

    def update(self, x):
        """Take one batch (a CuPy batch is copied to the host for the counts; a Dask
        batch is counted chunk by chunk, the counts added in a tree: the same
        counts as for the batch in memory)."""
        rows, lo, hi = self._rows(x)
        need = np.frexp(np.maximum(np.abs(lo), np.abs(hi)))[1].astype(np.int64)  # |x| < 2**need
        if self.counts is None:
            self.counts = np.zeros((rows.shape[0], self.bins), np.int64)
            self.exponent = need
        self._grow(need)
        self._take(lo, hi)
        half = self.bins // 2
        # x * bins / (2 R): a power of two, exact; floor gives the bin from -R
        scale = np.ldexp(1.0, int(np.log2(half)) - self.exponent).astype(rows.dtype if rows.dtype.kind == "f"
                                                                          else np.float64)
        if is_lazy(rows):
            import dask.array as da

            rows = rows.rechunk({0: -1})  # every channel in each chunk; the chunks' counts summed in a tree
            shape = ((rows.shape[0],), (self.bins,))
            parts = [rows.blocks[:, i].map_blocks(_bin_counts, scale, self.bins, chunks=shape, dtype=np.int64,
                                                  meta=np.empty((0, 0), np.int64))
                     for i in range(rows.numblocks[1])]
            self.counts += da.stack(parts).sum(axis=0).compute()
        else:
            self.counts += _bin_counts(rows, scale, self.bins)
        return self

    def _grow(self, need):
        """Double ``R`` (per channel) until it reaches ``2**need``: bin ``i``
        moves to ``(half * (2**k - 1) + i) >> k`` for ``k`` doublings."""
        k = np.minimum(np.maximum(need - self.exponent, 0), int(np.log2(self.bins)) + 1)[:, None]
        rows = np.flatnonzero(k)  # beyond log2(bins) + 1 doublings every bin lands on the middle two
        if rows.size:
            k = k[rows]
            to = ((self.bins // 2) * ((1 << k) - 1) + np.arange(self.bins)) >> k
            grown = np.zeros((rows.size, self.bins), np.int64)
            np.add.at(grown, (np.arange(rows.size)[:, None], to), self.counts[rows])
            self.counts[rows] = grown
        self.exponent = np.maximum(self.exponent, need)

    def _merge(self, other):
        if self.counts is None:
            self.counts, self.exponent = other.counts.copy(), other.exponent.copy()
            self.lo, self.hi = other.lo.copy(), other.hi.copy()
            return
        self._grow(other.exponent)
        o = Histogram.__new__(Histogram)
        o.bins, o.counts, o.exponent = self.bins, other.counts.copy(), other.exponent.copy()
        o._grow(self.exponent)
        self.counts += o.counts
        self._take(other.lo, other.hi)

    def edges(self):
        """The bin edges per channel, ``(channels, bins + 1)`` float64 (exact)."""
        r = np.ldexp(1.0, self.exponent)[:, None]
        return -r + (2 * r / self.bins) * np.arange(self.bins + 1)

    def _range(self):
        edges = self.edges()
        if self.method == "entropy":
            return self._entropy(edges)
        pick = self._percentile if self.method == "percentile" else self._mse
        lo, hi = np.empty(len(edges)), np.empty(len(edges))
        for c in range(len(edges)):
            lo[c], hi[c] = pick(self.counts[c], edges[c])
        return self._seen(lo, hi)

    def _seen(self, lo, hi):
        """``lo``, ``hi`` within the observed range: a channel of one value can pick bin
        edges wholly below it (lo > hi after a one-sided clamp, which choose_qparams refused)."""
        return np.clip(lo, self.lo, self.hi), np.clip(hi, self.lo, self.hi)

    def _entropy(self, edges):
        """ONNX Runtime's KL search (:func:`entropy_threshold`) on two views of
        ``ENTROPY_VIEW`` bins (at most) of each channel's histogram: all of it,
        ``[-R, R)``, and the part that just holds the values seen, as ONNX
        Runtime's histogram spans ``[-max|x|, max|x|]`` (``R`` can be up to twice
        that: its bins twice as wide); of the two ranges, the one with the smaller
        expected squared error on the histogram (:meth:`_squared_error`)."""
        nq = (self.dtype.qmax - self.dtype.qmin + 1) // 2
        view = min(self.bins, ENTROPY_VIEW)
        if view < nq:  # too few bins for a search: the whole range
            return self._seen(edges[:, 0], edges[:, -1])
        width = edges[:, 1] - edges[:, 0]
        reach = np.ceil(np.maximum(-self.lo, self.hi) / width).astype(np.int64)  # bins from 0 to the farthest value
        whole = self.bins // view  # bins of the histogram per bin of the view
        held = np.clip(-(-reach // (view // 2)), 1, whole)
        # the searches: (view, bins per view bin, channels); where both views are one, the first only
        searches = [(0, whole, np.arange(len(edges)))]
        searches += [(1, k, np.flatnonzero((held == k) & (held != whole))) for k in np.unique(held[held != whole])]

        def search(task):
            _, k, rows = task
            start, stop = self.bins // 2 - view // 2 * k, self.bins // 2 + view // 2 * k
            counts = self.counts[rows, start:stop].reshape(len(rows), view, k).sum(axis=2)
            return entropy_threshold(counts, edges[rows, start:stop + 1:k], nq)

        with ThreadPoolExecutor(min(len(searches), os.cpu_count() or 1)) as pool:  # NumPy runs them side by side
            found = list(pool.map(search, searches))
        lo, hi = np.empty((2, len(edges))), np.empty((2, len(edges)))  # per view, per channel
        for (v, _, rows), found_lo_hi in zip(searches, found):
            lo[v, rows], hi[v, rows] = found_lo_hi
        same = held == whole
        lo[1, same], hi[1, same] = lo[0, same], hi[0, same]
        lo, hi = self._seen(lo, hi)
        first = self._squared_error(lo[0], hi[0], edges) <= self._squared_error(lo[1], hi[1], edges)
        return np.where(first, lo[0], lo[1]), np.where(first, hi[0], hi[1])

    def _squared_error(self, lo, hi, edges, block=64):
        """The expected squared error of quantizing with the parameters that
        ``choose_qparams`` gives ``[lo, hi]``, per channel, over the histogram, each
        bin's count at its centre: ``scale**2 / 12`` inside the representable range,
        the squared distance to it outside."""
        scale, zero = (a.astype(np.float64) for a in choose_qparams(lo, hi, self.dtype, symmetric=self.symmetric))
        a, b = ((q - zero) * scale for q in (self.dtype.qmin, self.dtype.qmax))
        out = np.empty(len(edges))
        for r in range(0, len(edges), block):  # (block, bins) float64 temporaries at a time
            c, n = (edges[r:r + block, :-1] + edges[r:r + block, 1:]) / 2, self.counts[r:r + block]
            ar, br = a[r:r + block, None], b[r:r + block, None]
            off = np.where(c > br, c - br, np.where(c < ar, ar - c, 0.0))
            out[r:r + block] = (n * (off**2 + np.where(off == 0, scale[r:r + block, None] ** 2 / 12, 0.0))).sum(axis=1)
        return out

    def _percentile(self, counts, edges):
        half, total = self.bins // 2, int(counts.sum())
        keep = Fraction(repr(self.percentile)) / 100 * total  # 99.9 as the user wrote it, exactly
        if self.symmetric:
            folded = counts[half:] + counts[:half][::-1]  # |x| in [j w, (j + 1) w)
            j = np.searchsorted(np.cumsum(folded), math.ceil(keep))
            t = edges[half + min(j, half - 1) + 1]
            return -t, t
        cum = np.cumsum(counts)
        hi = edges[min(np.searchsorted(cum, math.ceil(keep)), self.bins - 1) + 1]
        lo = edges[np.searchsorted(cum, math.floor(total - keep), side="right")]
        return lo, hi

    def _mse(self, counts, edges):
        """Least ``n_in * step**2 / 12 + sum over outside bins of n (c - edge)**2``."""
        centres = (edges[:-1] + edges[1:]) / 2
        n, nc, ncc = (np.concatenate([[0.0], np.cumsum(counts * centres**p)]) for p in (0, 1, 2))
        half, levels = self.bins // 2, self.dtype.qmax - self.dtype.qmin
        i_hi = np.arange(half, self.bins + 1)  # hi = edges[i_hi] >= 0: bins at i >= i_hi lie above it
        i_lo = np.arange(0, half + 1)  # lo = edges[i_lo] <= 0: bins below i_lo lie under it
        hi, lo = edges[i_hi], edges[i_lo]
        above = (ncc[-1] - ncc[i_hi]) - 2 * hi * (nc[-1] - nc[i_hi]) + hi**2 * (n[-1] - n[i_hi])
        below = ncc[i_lo] - 2 * lo * nc[i_lo] + lo**2 * n[i_lo]
        if self.symmetric:  # lo = -hi: i_lo = bins - i_hi
            inside = n[i_hi] - n[self.bins - i_hi]
            cost = inside * (2 * hi / levels) ** 2 / 12 + above + below[::-1]
            best = int(np.argmin(cost))
            return -hi[best], hi[best]
        inside = n[i_hi][None, :] - n[i_lo][:, None]
        cost = inside * ((hi[None, :] - lo[:, None]) / levels) ** 2 / 12 + above[None, :] + below[:, None]
        a, b = np.unravel_index(int(np.argmin(cost)), cost.shape)
        return lo[a], hi[b]

    def _settings(self):
        return dict(super()._settings(), method=self.method, bins=self.bins, percentile=self.percentile)

    @classmethod
    def _defaults(cls):
        return dict(super()._defaults(), method="", bins=0, percentile=0.0)

    def _load(self, state):
        super()._load(state)
        c = len(self.lo)
        self.exponent = _field(state, "exponent", "iu", (c,)).astype(np.int64)
        self.counts = _field(state, "counts", "iu", (c, self.bins)).astype(np.int64)
        if (self.counts < 0).any() or (np.abs(self.lo) >= np.ldexp(1.0, self.exponent)).any() \
                or (np.abs(self.hi) >= np.ldexp(1.0, self.exponent)).any():
            raise ValueError("Observer.from_state: fields 'counts' and 'exponent' do not fit 'lo' and 'hi' "
                             "(negative counts, or a range beyond 2**exponent)")


def entropy_threshold(counts, edges, num_quantized_bins):
    """ONNX Runtime's ``HistogramCollector.get_entropy_threshold`` (TensorRT's KL
    search) on each histogram, bit for bit: ``(lo, hi)``, the edges
    ``edges[..., zero - i]`` and ``edges[..., zero + i + 1]`` (``zero = bins // 2``)
    of the candidate ``i`` (``num_quantized_bins // 2 <= i <= zero``) with the
    least divergence, before ORT's clamp to the observed minimum and maximum.

    ``counts`` is ``(..., bins)`` integers, one histogram per row; ``edges`` is
    ``(..., bins + 1)`` floats (or one ``(bins + 1,)`` row for all). Each
    candidate is scored as ORT scores it: the reference ``p`` (the slice, the
    counts outside it added to its end bins) and ``q`` (``p``'s slice summed into
    ``num_quantized_bins`` groups, the last taking the remainder, each spread
    over its group's nonzero bins and truncated to an integer), both smoothed by
    ``smooth_distribution``, then ORT's float32 ``entropy``, stored in the
    edges' dtype; the first least wins. A row whose ``p`` or ``q`` is all
    zeros scores inf (ORT's ``None``).
    """
    counts, edges = np.asarray(counts), np.asarray(edges)
    nq = num_quantized_bins
    if counts.ndim < 1 or counts.dtype.kind not in "iu" or (counts < 0).any():
        raise ValueError(f"entropy_threshold: counts must be a histogram of nonnegative integers (..., bins), "
                         f"got dtype {counts.dtype} and shape {counts.shape}")
    bins = counts.shape[-1]
    if edges.dtype.kind != "f" or edges.shape not in ((bins + 1,), counts.shape[:-1] + (bins + 1,)):
        raise ValueError(f"entropy_threshold: edges must be floats of shape {counts.shape[:-1] + (bins + 1,)} "
                         f"(or ({bins + 1},)) for counts of shape {counts.shape}, got {edges.dtype} {edges.shape}")
    if isinstance(nq, (bool, np.bool_)) or not isinstance(nq, (int, np.integer)) or not 1 <= nq // 2 <= bins // 2:
        raise ValueError(f"entropy_threshold: num_quantized_bins must be an integer with "
                         f"1 <= num_quantized_bins // 2 <= bins // 2 = {bins // 2}, got {nq!r}")
    rows = counts.reshape(-1, bins).astype(np.int64)
    zero, candidates = bins // 2, np.arange(nq // 2, bins // 2 + 1)
    block = max(1, (1 << 18) // bins)  # rows scored together: a few (block, bins) float32 arrays in cache
    with np.errstate(divide="ignore", invalid="ignore"):
        kl = np.concatenate([_kl_divergences(rows[r:r + block], int(nq), candidates)
                             for r in range(0, len(rows), block)], axis=1)
    # ORT keeps each divergence as np.array(kl, dtype=edges.dtype); then np.argmin
    i = candidates[np.argmin(np.where(np.isfinite(kl), kl, np.inf).astype(edges.dtype), axis=0)]
    edges = np.broadcast_to(edges, counts.shape[:-1] + (bins + 1,)).reshape(-1, bins + 1)
    lo = edges[np.arange(len(rows)), zero - i].reshape(counts.shape[:-1])
    hi = edges[np.arange(len(rows)), np.minimum(zero + i + 1, bins)].reshape(counts.shape[:-1])
    return lo, hi


_EPS = np.float32(0.0001)  # smooth_distribution's eps, as its float32 arithmetic uses it


def _minus_eps1(zeros, n):
    """``smooth_distribution``'s ``-eps1`` (taken off each nonzero entry of a
    distribution of ``n`` entries, ``zeros`` of them 0), as float32."""
    return (-(0.0001 * zeros / (n - zeros))).astype(np.float32)


def _kl_divergences(counts, nq, candidates):
    """ORT's divergence (float32) for each candidate and row: ``(candidates, rows)``.
    The per-candidate sums come from cumulative sums (exact integers in float64);
    the float32 part runs on ``(rows, n)`` arrays, NumPy summing each row as it
    sums ORT's 1-D arrays (pairwise), so the results are ORT's bit for bit."""
    rows, bins = counts.shape
    zero = bins // 2
    cum = np.concatenate([np.zeros((rows, 1)), np.cumsum(counts, axis=1, dtype=np.float64)], axis=1)
    nonzero = (counts != 0).astype(np.float64)
    cum_nonzero = np.concatenate([np.zeros((rows, 1)), np.cumsum(nonzero, axis=1)], axis=1)
    smoothed = np.where(counts != 0, counts.astype(np.float32), _EPS)  # float32(p) + eps * is_zeros
    nonzero32 = nonzero.astype(np.float32)  # times -eps1 gives the rest of the smoothing
    kl = np.empty((len(candidates), rows), np.float32)
    buffers = np.empty((2, rows * bins), np.float32)
    reps = np.empty(nq + 1, np.int64)
    chunk = max(1, (1 << 20) // (rows * (nq + 1)))  # candidates whose q are built together
    for c0 in range(0, len(candidates), chunk):
        i = candidates[c0:c0 + chunk]
        start, end = zero - i, np.minimum(zero + i + 1, bins)
        n = end - start
        merged = n // nq
        body = nq * merged
        # p: the slice; its first and last bins take the counts left and right of it
        first = counts[:, start] + cum[:, start]
        last = counts[:, end - 1] + cum[:, -1:] - cum[:, end]
        first_nz, last_nz = first != 0, last != 0
        p_nonzero = (cum_nonzero[:, end] - cum_nonzero[:, start] - nonzero[:, start] - nonzero[:, end - 1]
                     + first_nz + last_nz)
        p_eps1 = _minus_eps1(n - p_nonzero, n)
        first = np.where(first_nz, first.astype(np.float32) + p_eps1, _EPS)
        last = np.where(last_nz, last.astype(np.float32) + p_eps1, _EPS)
        # q: the slice in nq groups of `merged` bins (the last group also takes the rest of
        # the slice), each group's sum spread over its nonzero p bins, truncated (ORT's int64 q)
        at = start[:, None] + merged[:, None] * np.arange(nq + 1)
        sums, norm = np.diff(cum[:, at], axis=2), np.diff(cum_nonzero[:, at], axis=2)  # (rows, chunk, nq)
        norm[:, :, 0] += first_nz - nonzero[:, start]
        norm[:, :, -1] += (last_nz - nonzero[:, end - 1]) * (body == n)
        sums[:, :, -1] = np.where(norm[:, :, -1] != 0, sums[:, :, -1] + cum[:, end] - cum[:, start + body], 0)
        q = np.trunc(sums / np.maximum(norm, 1))  # a group with no nonzero p bin has sum 0 (the last: set so)
        q_nonzero = merged * (q != 0).sum(axis=2)  # the tail n - body stays 0
        q = np.where(q != 0, q.astype(np.float32) + _minus_eps1(n - q_nonzero, n)[:, :, None], _EPS)
        q = np.concatenate([q, np.full(q.shape[:2] + (1,), _EPS)], axis=2)  # the tail's value
        valid = (p_nonzero != 0) & (q_nonzero != 0)
        for k in range(len(i)):
            s, e, size = start[k], end[k], n[k]
            p, r = (b[:rows * size].reshape(rows, size) for b in buffers)
            np.multiply(nonzero32[:, s:e], p_eps1[:, k:k + 1], out=p)
            np.add(smoothed[:, s:e], p, out=p)
            p[:, 0], p[:, -1] = first[:, k], last[:, k]
            reps[:] = merged[k]
            reps[-1] = size - body[k]
            qk = np.repeat(q[:, k], reps, axis=1)
            qk /= qk.sum(axis=1, keepdims=True)  # ORT's q / q.sum(), the sum over the repeated values
            np.divide(p, p.sum(axis=1, keepdims=True), out=p)  # ORT's entropy(p, q), float32
            np.divide(p, qk, out=r)
            np.log(r, out=r)
            np.multiply(p, r, out=r)
            kl[c0 + k] = np.where(valid[:, k], r.sum(axis=1), np.inf)
    return kl


_LIMBS = 20  # 32-bit limbs of each column's sum of squares times 2^298: squares reach 2^554, counts 2^63 more
_SHIFT = 298  # the square of the smallest float32 subnormal is 2^-298
_ROWS = 1 << 18  # values squared at a time; the float64 counts of a pass stay below 2^53 (rows < 2^21)


def _square_sums(rows):
    """Each column's sum of the squares of float32 ``rows`` (n, K), exactly: int64 ``(K, _LIMBS)``,
    limb ``i`` holding bits ``32 i ..`` of ``sum x^2 * 2^298``, each below ``2^32`` (read on the host:
    a device chunk is copied). A float32 ``x`` is ``m * 2^(e - 150)`` (``e`` its exponent field, 1 for
    subnormals, ``m`` its 24-bit significand), so ``x^2 * 2^298 = m^2 * 2^(2 e - 2)``: ``m^2 * 2^off``
    (< 2^79, 48 significant bits: exact in float64) at limb ``(e - 1) // 16``, split into its three
    32-bit pieces exactly in float64 and counted by ``bincount`` (exact integers below 2^53)."""
    rows = to_host(rows)
    with np.errstate(over="ignore"):  # (float64 beyond float32's range becomes inf, refused below)
        rows = np.ascontiguousarray(rows, dtype=np.float32)
    n, k = rows.shape
    acc = np.zeros(k * _LIMBS, np.int64)
    base = np.arange(k, dtype=np.int64) * _LIMBS
    step = max(1, _ROWS // max(k, 1))
    for i in range(0, n, step):
        part = rows[i:i + step]
        e = (part.view(np.uint32) >> np.uint32(23)).astype(np.uint8)  # the sign bit falls off the uint8
        if (e == 255).any():
            raise ValueError("ImportanceMatrix.update: the batch holds NaN or inf (as float32); observe finite "
                             "activations only")
        limb = (np.maximum(e, 1) - np.uint8(1)) >> np.uint8(4)
        v = part.astype(np.float64)
        v *= v
        v *= _LIMB_SCALE[limb]  # m^2 * 2^off
        mid = np.floor(v * 2.0**-32)
        v -= mid * 2.0**32
        high = np.floor(mid * 2.0**-32)
        mid -= high * 2.0**32
        index = (base + limb).ravel()
        for j, piece in enumerate((v, mid, high)):
            acc += np.bincount(index + j, piece.ravel(), minlength=k * _LIMBS).astype(np.int64)
    return _carried(acc.reshape(k, _LIMBS))


_LIMB_SCALE = np.ldexp(1.0, _SHIFT - 32 * np.arange(16))  # x^2 * 2^298 over limb i's 2^(32 i)


def _carried(limbs):
    """Non-negative int64 limbs ``(K, limbs)`` with each carry moved up: every limb below 2^32."""
    for i in range(limbs.shape[1] - 1):
        limbs[:, i + 1] += limbs[:, i] >> 32
        limbs[:, i] &= 0xFFFFFFFF
    return limbs


def _nearest_float32(num: int, den: int) -> np.float32:
    """The float32 nearest ``num / den`` (integers, ``num >= 0``, ``den > 0``), ties to even, inf past
    float32's range: the quotient cut to 53 bits with a sticky last bit (rounded to odd), which float64
    holds exactly and which rounds to float32 as the exact quotient does."""
    if num == 0:
        return np.float32(0)
    k = 52 - (num.bit_length() - den.bit_length())
    q, r = divmod(num << k, den) if k >= 0 else divmod(num, den << -k)
    with np.errstate(over="ignore"):
        return np.float32(math.ldexp(q | (r != 0), -k))


class ColumnSums:
    """Exact sums, column by column, of a function of float32 activations ``(..., K)``, and a token
    count: streamed (``update``), merged bit for bit across chunks, processes and Dask (``merge``),
    saved as plain arrays (``state_dict`` / ``from_state``); ``result()`` the float32 nearest each
    column's exact mean. A subclass sets ``kind``, ``_sums`` (float32 rows ``(n, K)`` -> int64
    ``(K, _LIMBS)`` 32-bit limbs of each column's sum times ``2**_SHIFT``), ``_LIMBS`` and ``_SHIFT``:
    :class:`ImportanceMatrix` (squares) and ``awq.MeanAbs`` (magnitudes)."""

    def __init__(self):
        self.reset()

    def reset(self):
        """Forget every token seen."""
        self.sums, self.count = None, 0
        return self

    @property
    def columns(self):
        """K, the activations' last axis (None before the first batch)."""
        return None if self.sums is None else self.sums.shape[0]

    def update(self, x):
        """Take one batch of activations ``(..., K)``. Returns ``self``."""
        name = type(self).__name__
        if not hasattr(x, "dtype") or not hasattr(x, "shape"):
            x = np.asarray(x)
        x = float_values(x)
        if x.dtype.kind not in "fiu":
            raise TypeError(f"{name}.update: takes real (float or integer) activations, got dtype {x.dtype}")
        if x.ndim == 0 or x.size == 0:
            raise ValueError(f"{name}.update: takes activations of shape (..., K), one row of K per token; "
                             f"got shape {x.shape}")
        k = x.shape[-1]
        if self.sums is not None and k != self.columns:
            raise ValueError(f"{name}.update: the batch has {k} columns (its last axis), earlier batches had "
                             f"{self.columns}")
        if is_lazy(x):
            import dask.array as da

            rows = x.rechunk({x.ndim - 1: -1}).reshape(-1, k)
            parts = [rows.blocks[i, 0].map_blocks(self._sums, chunks=((k,), (self._LIMBS,)), dtype=np.int64,
                                                  meta=np.empty((0, 0), np.int64)) for i in range(rows.numblocks[0])]
            sums = _carried(da.stack(parts).sum(axis=0).compute())  # (each part's limbs < 2^32: no overflow)
        else:
            rows = x.reshape(-1, k)
            sums = self._sums(rows)
        self._add(sums, rows.shape[0])
        return self

    def _add(self, sums, count):
        self.sums = sums.copy() if self.sums is None else _carried(self.sums + sums)
        self.count += int(count)

    def merge(self, other):
        """Add the sums and tokens of ``other`` (of the same class) to these. Returns ``self``."""
        name = type(self).__name__
        if type(other) is not type(self):
            raise ValueError(f"{name}.merge: the other is a {type(other).__name__}")
        if other.sums is not None:
            if self.sums is not None and self.columns != other.columns:
                raise ValueError(f"{name}.merge: {self.columns} columns here, {other.columns} in the other")
            self._add(other.sums, other.count)
        return self

    def result(self) -> np.ndarray:
        """Each column's mean, float32 ``(K,)``: the float32 nearest the exact ``sum / count`` (inf
        where that passes float32's range)."""
        return self._float32(self.count)

    def totals(self) -> np.ndarray:
        """Each column's sum, float32 ``(K,)``: the float32 nearest the exact sum (inf past float32's
        range), as llama.cpp's imatrix files hold it (:mod:`qarray.io.imatrix`)."""
        return self._float32(1)

    def _float32(self, count):
        if self.sums is None:
            raise ValueError(f"{type(self).__name__}: no activations observed yet; call update(x) first")
        den = count << self._SHIFT
        return np.array([_nearest_float32(int.from_bytes(limbs.astype("<u4").tobytes(), "little"), den)
                         for limbs in self.sums], np.float32)

    @classmethod
    def from_sums(cls, sums, count):
        """The collector of ``count`` tokens (> 0) whose column sums are ``sums`` (``(K,)`` float32 or
        float64 values >= 0, each taken exactly): sums read from a file, as :mod:`qarray.io.imatrix`
        reads llama.cpp's. ``result()`` is then the float32 nearest ``sums / count``, as float32
        division of a float32 sum by a count below 2**24 gives it.

        >>> ImportanceMatrix.from_sums(numpy.array([14.0, 9.0], numpy.float32), 3).result()
        array([4.6666665, 3.       ], dtype=float32)
        """
        name = f"{cls.__name__}.from_sums"
        sums = np.asarray(sums)
        if sums.dtype.kind != "f" or sums.ndim != 1 or sums.size == 0:
            raise ValueError(f"{name}: takes a 1-d float array of column sums, got dtype {sums.dtype} and shape "
                             f"{sums.shape}")
        if isinstance(count, (bool, np.bool_)) or not isinstance(count, (int, np.integer)) or count <= 0:
            raise ValueError(f"{name}: count is the number of tokens, an integer > 0; got {count!r}")
        bad = ~(np.isfinite(sums) & (sums >= 0))
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{name}: the sums must be finite and >= 0; column {i} is {sums[i].item()!r}")
        limbs = np.empty((sums.size, cls._LIMBS), np.int64)
        for i, v in enumerate(sums.astype(np.float64).tolist()):
            num, den = v.as_integer_ratio()  # den a power of two
            scaled, rest = divmod(num << cls._SHIFT, den)
            if rest or scaled >= 1 << 32 * cls._LIMBS:
                raise ValueError(f"{name}: column {i}'s sum {v!r} is not a multiple of 2**-{cls._SHIFT} below "
                                 f"2**{32 * cls._LIMBS - cls._SHIFT}, which the exact sums hold")
            limbs[i] = np.frombuffer(scaled.to_bytes(4 * cls._LIMBS, "little"), "<u4")
        m = cls()
        m.sums, m.count = limbs, int(count)
        return m

    def state_dict(self) -> dict:
        """The sums and the token count as ``{name: numpy array}`` (no objects)."""
        s = {"kind": np.array(self.kind)}
        if self.sums is not None:
            s["sums"], s["count"] = self.sums.copy(), np.array(self.count, np.int64)
        return s

    @classmethod
    def from_state(cls, state):
        """The collector that :meth:`state_dict` described."""
        kind = str(_field(state, "kind", "U", ()))
        if kind != cls.kind:
            raise ValueError(f"{cls.__name__}.from_state: field 'kind' is {kind!r}, not {cls.kind!r}")
        m = cls()
        if "sums" in state:
            sums = _field(state, "sums", "iu", None)
            count = int(_field(state, "count", "iu", ()))
            if sums.ndim != 2 or sums.shape[1] != cls._LIMBS or sums.shape[0] == 0 or sums.min() < 0 \
                    or sums.max() >= 1 << 32 or count <= 0:
                raise ValueError(f"{cls.__name__}.from_state: fields 'sums' (K, {cls._LIMBS}) limbs in [0, 2**32) "
                                 "and 'count' (tokens, > 0) are not what state_dict writes")
            m.sums, m.count = sums.astype(np.int64), count
        return m

    def __repr__(self):
        seen = "no data" if self.sums is None else f"{self.columns} columns, {self.count} tokens"
        return f"{type(self).__name__}({seen})"


class ImportanceMatrix(ColumnSums):
    """llama.cpp's importance matrix (``llama-imatrix``) of one weight tensor, collected exactly.

    ``update(x)`` takes the tensor's input activations, ``x`` of shape ``(..., K)``:
    each index of the leading axes is one token, a row of ``K`` values, one per input
    column of the weight. It adds each column's squares and counts the tokens.
    ``result()`` is the mean square of each column, ``sum / count`` as llama.cpp's
    imatrix holds it, rounded once to float32 (the nearest float32 of the exact
    mean): what ``qarray.quantize(w, dtype="Q4_K", importance=...)`` takes, and
    ``quantize(w, dtype)`` passes.

    The sums are exact: the square of a float32 is an integer times ``2**-298``,
    added as an integer in 32-bit limbs. So ``merge`` of collectors that saw any
    split of the tokens (chunks, processes, in any order) gives the bits of one
    collector that saw them all. (llama.cpp sums in float32 as tokens come,
    so its last bits depend on their order and grow apart from the exact mean
    over many tokens.) Activations are read as float32, as llama.cpp reads them:
    float16, bfloat16 and integers up to 2**24 exactly, float64 rounded; NaN
    and inf raise ValueError. NumPy, CuPy (copied to the host for the sums) and
    Dask arrays (summed chunk by chunk, the sums added in a tree). State:
    ``state_dict()`` / ``ImportanceMatrix.from_state``, plain arrays.

    >>> m = ImportanceMatrix().update(numpy.array([[1.0, 0.0], [2.0, 3.0]], numpy.float32))
    >>> m.merge(ImportanceMatrix().update(numpy.array([[3.0, 0.0]], numpy.float32))).result()
    array([4.6666665, 3.       ], dtype=float32)
    """

    kind, _LIMBS, _SHIFT = "importance", _LIMBS, _SHIFT
    _sums = staticmethod(_square_sums)

    def quantize(self, w, dtype="Q4_K"):
        """``qarray.quantize(w, dtype=dtype, importance=self.result())``: ``w`` the weight, ``(..., K)``."""
        return quantize(w, dtype=dtype, importance=self.result())


def observer(name, dtype="quint8", *, symmetric=False, axis=None) -> Observer:
    """The observer the CLI's ``--observer`` names: ``"minmax"``,
    ``"moving_average"``, ``"percentile"``, ``"mse"`` or ``"entropy"`` (a
    :class:`Histogram` with that method and its defaults)."""
    if name == "minmax":
        return MinMax(dtype, symmetric=symmetric, axis=axis)
    if name == "moving_average":
        return MovingAverageMinMax(dtype, symmetric=symmetric, axis=axis)
    if name in METHODS:
        return Histogram(dtype, method=name, symmetric=symmetric, axis=axis)
    raise ValueError(f"observer: unknown observer {name!r}; choose one of minmax, moving_average, "
                     f"{', '.join(METHODS)}")
