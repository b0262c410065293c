"""qarray/_kquants.py (ggml's K-quant and IQ4 quantizers in NumPy) against ggml itself: the fields of
every block equal those of the bytes ggml_quantize_chunk wrote (tests/data/ggml/kquants.npz, made by
tests/data/ggml/make_vectors.py), read by the library's block description, without an importance
matrix and with each of the vectors' importance matrices; and those bytes hold the values ggml's own
to_float gives."""

import numpy as np
import pytest

from qarray import _blocks, _kquants

TYPES = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs"]


def _same_fields(f, t, got, raw, what=""):
    want = f.unpack(raw.reshape(-1, f.nbytes))
    assert set(got) == set(want)
    for name, w in want.items():
        field = f.fields[name]
        g = field.check(t, got[name])  # the field's bits, as ggml stores them
        bad = np.flatnonzero((g != w.view(field.store)).any(axis=1))
        assert bad.size == 0, f"{t}.{name}{what}: blocks {bad.tolist()} differ"


@pytest.mark.parametrize("t", TYPES)
def test_port_gives_ggml_fields(ggml_vectors, t):
    f = _blocks.FORMATS[t.upper()]
    x = ggml_vectors[f"{t}_x"].reshape(-1, f.block)
    _same_fields(f, t, getattr(_kquants, f"quantize_{t}")(x), ggml_vectors[f"{t}_bytes"])


@pytest.mark.parametrize("t", TYPES)
def test_port_gives_ggml_fields_with_an_importance_matrix(ggml_vectors, t):
    """ggml's quantize_row_*_impl paths (ggml_quantize_chunk with an imatrix), every row under every
    importance matrix of the vectors; the port takes each value's entry, the imatrix laid over the blocks."""
    f = _blocks.FORMATS[t.upper()]
    x = ggml_vectors[f"{t}_imatrix_x"]
    per_row = x.shape[1] // f.block
    for case, w in enumerate(ggml_vectors["imatrix"]):
        got = getattr(_kquants, f"quantize_{t}")(x.reshape(-1, f.block), np.tile(w.reshape(per_row, f.block),
                                                                                 (len(x), 1)))
        _same_fields(f, t, got, ggml_vectors[f"{t}_imatrix_bytes"][case], f" (imatrix {case})")


def _same_values(got, want):
    """Bit for bit, NaN where NaN: ggml's ``d * q - dmin * m`` keeps the sign of a negative NaN dmin,
    which qarray's decoder (``scale * v + offset``, the offset negated) turns positive."""
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.mark.parametrize("t", TYPES)
def test_quantize_with_importance_is_ggml_bit_for_bit(ggml_vectors, t):
    """``qarray.quantize(x, dtype, importance=imatrix)``: the bytes of ggml_quantize_chunk with the
    imatrix (rows of 1024: each block takes its own columns' entries) and the values of ggml's to_float;
    ``importance=None`` is the plain path's bytes."""
    import qarray as qa

    x = ggml_vectors[f"{t}_imatrix_x"]
    for case, w in enumerate(ggml_vectors["imatrix"]):
        q = qa.quantize(x, dtype=t, importance=w)
        np.testing.assert_array_equal(q.data, ggml_vectors[f"{t}_imatrix_bytes"][case], err_msg=f"imatrix {case}")
        with np.errstate(all="ignore"):
            _same_values(q.dequantize(), ggml_vectors[f"{t}_imatrix_deq"][case])
    plain = ggml_vectors[f"{t}_x"].reshape(-1, 256)
    np.testing.assert_array_equal(qa.quantize(plain, dtype=t, importance=None).data,
                                  ggml_vectors[f"{t}_bytes"].reshape(len(plain), -1))


@pytest.mark.parametrize("t", TYPES)
def test_ggml_bytes_hold_ggml_values(ggml_vectors, t):
    f = _blocks.FORMATS[t.upper()]
    with np.errstate(all="ignore"):
        y = f.decode(ggml_vectors[f"{t}_bytes"].reshape(-1, f.nbytes)).reshape(ggml_vectors[f"{t}_deq"].shape)
    np.testing.assert_array_equal(y.view(np.uint32), ggml_vectors[f"{t}_deq"].view(np.uint32))


@pytest.mark.parametrize("t", TYPES)
def test_importance_vectors_not_trivial(ggml_vectors, t):
    """Each importance matrix changes most rows' bytes from the plain path's and from the other
    matrices' (all zero and all equal excepted: both are ggml's weighting too, not the plain path)."""
    x = ggml_vectors[f"{t}_imatrix_x"]
    f = _blocks.FORMATS[t.upper()]
    raw = ggml_vectors[f"{t}_imatrix_bytes"].reshape(len(ggml_vectors["imatrix"]), -1, f.nbytes)
    plain = getattr(_kquants, f"quantize_{t}")(x.reshape(-1, f.block))
    differ = (raw != f.pack(plain)).any(axis=2).mean(axis=1)
    assert (differ > 0.3).sum() >= len(raw) - 2, differ
    assert len({r.tobytes() for r in raw}) == len(raw)


@pytest.mark.parametrize("t", TYPES)
def test_vectors_not_trivial(ggml_vectors, t):
    f = _blocks.FORMATS[t.upper()]
    fields = f.unpack(ggml_vectors[f"{t}_bytes"].reshape(-1, f.nbytes))
    assert set(np.unique(fields["q"])) == set(range(1 << f.fields["q"].bits))
    d = fields["d"]
    assert (d == 0).any() and (np.isfinite(d) & (d != 0)).sum() > len(d) // 2
    if "scales" in fields:
        s = fields["scales"]
        assert len(np.unique(s)) > (1 << f.fields["scales"].bits) // 2


def test_q8_k_is_ggml_bit_for_bit(ggml_vectors, kernels):
    """Q8_K (the K-quants' activations) by ``qarray.quantize`` (the Numba kernel, and the generic
    ``_ggml._q8_k``): the bytes of ggml's quantize_row_q8_K_ref, bsums included, on the hard rows
    (ties, zero blocks, float16 and float32 extremes, float32 subnormals whose iscale overflows), and
    the values of ggml's dequantize_row_q8_K."""
    import qarray as qa

    x, raw = ggml_vectors["q8_k_x"], ggml_vectors["q8_k_bytes"]
    got = qa.quantize(x, dtype="Q8_K")
    np.testing.assert_array_equal(got.data, raw)
    np.testing.assert_array_equal(got.dequantize().view(np.uint32), ggml_vectors["q8_k_deq"].view(np.uint32))
    fields = _blocks.FORMATS["Q8_K"].unpack(raw)
    q = fields["q"].view(np.int8)
    assert q.min() == -127 and q.max() == 127 and (fields["d"] == 0).any()  # (ggml's codes never reach -128)
    assert (np.abs(x).max(axis=1) < 2.0**-126).any()  # a block whose iscale overflows
