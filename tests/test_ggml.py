"""qarray._ggml (ggml's block types read by qarray._blocks) against its oracles:
gguf-py's ``dequantize`` for every type and its ``quantize`` where it has one
(the ``gguf`` package, llama.cpp's own Python), and ggml's ``ggml_quantize_chunk``
for the K-quants and IQ4_NL/IQ4_XS: the bytes it wrote for hard inputs are
committed in tests/data/ggml/kquants.npz (tests/data/ggml/make_vectors.py says
how they were made)."""

import numpy as np
import pytest

import qarray as qa
from qarray import _blocks

gguf = pytest.importorskip("gguf")

TYPES = sorted(k for k, f in _blocks.FORMATS.items() if f.ggml is not None)  # (grouped formats register on use)
GGUF_PY_QUANTIZERS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0", "MXFP4"]
GGML_QUANTIZERS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]


def same_floats(got, want):
    """Bit for bit, NaN where NaN (gguf-py's NaN may carry another payload)."""
    assert got.dtype == want.dtype == np.float32
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_every_quantized_ggml_type_of_gguf_py_is_here():
    """Every type gguf-py dequantizes, with its block size and bytes (Q8_1 and Q8_K are activation
    types, never in files; Q1_0 has no codec in gguf-py)."""
    theirs = {t.name for t in gguf.GGMLQuantizationType if t.name not in ("F32", "F16", "BF16", "F64", "I8", "I16",
                                                                            "I32", "I64", "Q8_1", "Q8_K", "Q1_0")}
    theirs = {t for t in theirs if (t.startswith(("Q", "I", "T", "M", "N")) and "_" in t or t in ("MXFP4", "NVFP4"))}
    assert theirs <= set(TYPES), theirs - set(TYPES)
    for name in TYPES:
        f = _blocks.FORMATS[name]
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]] == (f.block, f.nbytes)
        assert gguf.GGMLQuantizationType[name].value == f.ggml


@pytest.mark.parametrize("name", [t for t in TYPES if t != "Q8_K"])  # (gguf-py has no Q8_K: test_kquants has
def test_dequantize_is_gguf_py_bit_for_bit(name, rng):                  # ggml's own dequantize_row_q8_K)
    """Random bytes (every code, float16 scales of every kind: subnormal, inf, NaN), all-zero and
    all-one blocks: the float32 values gguf-py gives."""
    f = _blocks.FORMATS[name]
    raw = np.concatenate([rng.integers(0, 256, (200, f.nbytes), dtype=np.uint8),
                          np.zeros((1, f.nbytes), np.uint8), np.full((1, f.nbytes), 255, np.uint8)])
    with np.errstate(all="ignore"):
        want = gguf.dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(-1, f.block)
    same_floats(f.decode(raw), want)
    q = qa.QArray.from_blocks(raw.reshape(2, -1), name)
    same_floats(q.dequantize(), want.reshape(2, -1))
    assert q.shape == (2, 101 * f.block) and q.nbytes == raw.nbytes


@pytest.mark.parametrize("name", TYPES)
def test_every_bit_of_a_block_is_in_one_field(name, rng):
    """The description covers each bit of a block once; unpack then pack is the identity on any bytes,
    and each field alone packs into its own bits only."""
    f = _blocks.FORMATS[name]
    assert (f.covered() == 1).all()
    raw = rng.integers(0, 256, (64, f.nbytes), dtype=np.uint8)
    fields = f.unpack(raw)
    np.testing.assert_array_equal(f.pack(fields), raw)
    bits = np.unpackbits(raw, axis=1, bitorder="little")
    for field in f.fields.values():
        mine = np.zeros(8 * f.nbytes, bool)
        mine[field.bits_used] = True
        alone = np.unpackbits(f.pack({k: (v if k == field.name else np.zeros_like(v)) for k, v in fields.items()}),
                              axis=1, bitorder="little")
        assert not alone[:, ~mine].any()
        np.testing.assert_array_equal(alone[:, mine], bits[:, mine])


def hard_rows(rng, block):
    """Rows of float32 that exercise a block quantizer: scales from 1e-6 to 1e4, ties, zeros, constants,
    one nonzero, signs of one kind, outliers."""
    n = 4 * block
    rows = [rng.standard_normal(n), rng.standard_normal(n) * 1e-6, rng.standard_normal(n) * 1e4,
            np.round(rng.standard_normal(n) * 4) / 2, np.zeros(n), np.full(n, 3.0), np.full(n, -2.5),
            np.abs(rng.standard_normal(n)), -np.abs(rng.standard_normal(n)), rng.uniform(-1, 1, n)]
    one = np.zeros(n)
    one[block + 3] = -7.0
    heavy = rng.standard_normal(n)
    heavy[rng.integers(0, n, 6)] = 300.0
    return np.stack(rows + [one, heavy]).astype(np.float32)


@pytest.mark.parametrize("name", GGUF_PY_QUANTIZERS)
def test_quantize_gives_gguf_py_bytes(name, rng):
    f = _blocks.FORMATS[name]
    x = hard_rows(rng, f.block)
    with np.errstate(all="ignore"):
        want = gguf.quantize(x, gguf.GGMLQuantizationType[name])
    q = qa.quantize(x, dtype=name.lower())
    np.testing.assert_array_equal(q.data, want)
    codes = f.unpack(want.reshape(-1, f.nbytes))
    if "q" in codes:  # the inputs reach the codes' ends
        assert codes["q"].min() == 0 and codes["q"].max() >= f.values.size // 2


@pytest.mark.parametrize("name", GGML_QUANTIZERS)
def test_quantize_gives_ggml_bytes(name, ggml_vectors):
    """ggml_quantize_chunk's bytes (a build without floating-point contraction, as x86's default)."""
    x, want = ggml_vectors[f"{name.lower()}_x"], ggml_vectors[f"{name.lower()}_bytes"]
    got = qa.quantize(x, dtype=name).data
    bad = np.flatnonzero((got.reshape(-1, _blocks.FORMATS[name].nbytes) !=
                          want.reshape(-1, _blocks.FORMATS[name].nbytes)).any(axis=1))
    assert bad.size == 0, f"{bad.size} blocks differ, the first {bad[:5]}"
    with np.errstate(all="ignore"):  # and the values ggml's bytes hold are gguf-py's
        same_floats(qa.QArray.from_blocks(want, name).dequantize(),
                    gguf.dequantize(want, gguf.GGMLQuantizationType[name]))


@pytest.mark.parametrize("name", [n for n in TYPES if _blocks.FORMATS[n].values is not None])
def test_the_value_formula(name, rng):
    """dequantize is scale * value + offset with one rounding each, for the formats with a code table
    (the IQ lattices' codes index vectors: gguf-py's decode above checks them)."""
    f = _blocks.FORMATS[name]
    raw = rng.integers(0, 256, (16, f.nbytes), dtype=np.uint8)
    raw[:, :] &= 0x3F  # float16 fields stay finite
    q = qa.QArray.from_blocks(raw, name)
    v = f.values[q.int_repr()].reshape(16, -1, f.sub)
    y = q.scale.reshape(16, -1, 1) * v
    if q.offset is not None:
        y = y + q.offset.reshape(16, -1, 1)
    same_floats(q.dequantize(), y.reshape(16, -1))
