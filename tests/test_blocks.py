"""QArrays of block formats (qarray._blocks; GGUF's types): what a QArray does,
on the format's bytes: quantize, dequantize, indexing, reshape, moves,
pickling, and clear errors for what a block format cannot do."""

import pickle

import numpy as np
import pytest

import qarray as qa
from qarray import QArray, _blocks


@pytest.fixture
def w(rng):
    return rng.standard_normal((3, 4, 512)).astype(np.float32)


def test_dtype_names_any_case():
    assert qa.qdtype("q4_k") is qa.qdtype("Q4_K") is qa.qdtype("Q4_k")
    d = qa.qdtype("iq4_xs")
    assert d.kind == "block" and d.layout is _blocks.FORMATS["IQ4_XS"] and d.bits == 4
    with pytest.raises(TypeError, match="block format.*Q4_K"):
        qa.qdtype("q4_9")


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS", "TQ1_0"])
def test_a_block_qarray_holds_the_format_bytes(name, w):
    q = qa.quantize(w, dtype=name)
    f = _blocks.FORMATS[name]
    assert q.shape == w.shape and q.ndim == 3 and q.size == w.size and q.dtype == name
    assert q.nbytes == w.size // f.block * f.nbytes == q.data.nbytes  # what the format stores
    assert q.data.dtype == np.uint8 and q.data.shape == (3, 4, 512 // f.block * f.nbytes)
    assert (q.axis, q.block_size) == (2, f.block)
    x = q.dequantize()
    assert x.dtype == np.float32 and x.shape == w.shape
    assert np.abs(x - w).max() < 0.6 * np.abs(w).max()  # a 2-bit format's error at most
    np.testing.assert_array_equal(q.dequantize("float16"), x.astype(np.float16))
    np.testing.assert_array_equal(q.dequantize("float64"), x.astype(np.float64))
    np.testing.assert_array_equal(np.asarray(q), x)
    np.testing.assert_array_equal(q.pack(), q.data.reshape(-1))


def test_indexing_keeps_whole_blocks(w):
    q = qa.quantize(w, dtype="Q4_K")
    x = q.dequantize()
    for key in [1, (slice(None), 2), (..., slice(256, 512)), (1, slice(0, 4, 2), slice(0, 256)), (None, 0),
                (-1, ..., slice(-256, None))]:
        np.testing.assert_array_equal(q[key].dequantize(), x[key], err_msg=str(key))
    np.testing.assert_array_equal(q[0, 0, 256:256].dequantize(), x[0, 0, 256:256])
    with pytest.raises(ValueError, match=r"the slice 0:100:1 cuts the blocks of 256 values of Q4_K"):
        q[..., :100]
    with pytest.raises(ValueError, match="slice at multiples of 256 with step 1"):
        q[..., ::2]
    with pytest.raises(IndexError, match="a slice of whole blocks"):
        q[0, 0, 3]
    with pytest.raises(IndexError, match="a slice of whole blocks"):
        q[..., None]
    assert [r.shape for r in q] == [(4, 512)] * 3 and len(q) == 3


def test_reshape_and_transpose_keep_the_last_axis(w):
    q = qa.quantize(w, dtype="q8_0")
    x = q.dequantize()
    np.testing.assert_array_equal(q.reshape(12, 512).dequantize(), x.reshape(12, 512))
    np.testing.assert_array_equal(q.reshape(-1, 512).dequantize(), x.reshape(-1, 512))
    np.testing.assert_array_equal(q.reshape(2, 6, -1).dequantize(), x.reshape(2, 6, -1))
    np.testing.assert_array_equal(q.transpose(1, 0, 2).dequantize(), x.transpose(1, 0, 2))
    with pytest.raises(ValueError, match="keeps its blocks along the last axis"):
        q.reshape(3, 2048)
    with pytest.raises(ValueError, match="keeps its blocks along the last axis"):
        q.reshape(-1)
    with pytest.raises(ValueError, match="which must stay last"):
        q.T


def test_fields_scale_and_offset(rng):
    x = rng.standard_normal((2, 256)).astype(np.float32)
    q = qa.quantize(x, dtype="Q4_K")
    fields = q.fields
    assert {k: v.shape for k, v in fields.items()} == {"d": (2, 1, 1), "dmin": (2, 1, 1), "scales": (2, 1, 8),
                                                       "mins": (2, 1, 8), "q": (2, 1, 256)}
    assert fields["d"].dtype == np.float16 and fields["q"].max() <= 15
    np.testing.assert_array_equal(q.int_repr(), fields["q"].reshape(2, 256))
    d = fields["d"].astype(np.float32).reshape(2, 1)
    np.testing.assert_array_equal(q.scale, d * fields["scales"].reshape(2, 8))
    np.testing.assert_array_equal(q.offset, -(fields["dmin"].astype(np.float32).reshape(2, 1)
                                              * fields["mins"].reshape(2, 8)))
    assert q.zero_point is None and qa.quantize(x, dtype="Q8_0").offset is None
    with pytest.raises(TypeError, match="codebook"):
        QArray.from_blocks(np.zeros((1, 66), np.uint8), "IQ2_XXS").int_repr()
    with pytest.raises(AttributeError, match="not a block format"):
        qa.quantize(x, 0.1).fields


def test_copy_pickle_repr(w):
    q = qa.quantize(w, dtype="Q5_K")
    c = q.copy()
    assert not np.shares_memory(c.data, q.data)
    r = pickle.loads(pickle.dumps(q))
    np.testing.assert_array_equal(r.data, q.data)
    assert r.dtype is q.dtype
    text = repr(q)
    assert "dtype=Q5_K, shape=(3, 4, 512), bits_per_weight=5.5, backend=numpy" in text
    big = qa.quantize(np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024) / 1e4, dtype="q8_0")
    text = repr(big)
    assert "..." in text and "6.5538635e+00]]" in text  # the last value, from the last block


def test_from_blocks(rng):
    raw = qa.quantize(rng.standard_normal((2, 64)).astype(np.float32), dtype="Q4_0").data
    q = QArray.from_blocks(raw, "q4_0")
    assert q.shape == (2, 64) and np.shares_memory(q.data, raw)
    with pytest.raises(ValueError, match="not a whole number of Q4_0 blocks"):
        QArray.from_blocks(raw[:, :20], "Q4_0")
    with pytest.raises(TypeError, match="uint8"):
        QArray.from_blocks(raw.view(np.int8), "Q4_0")
    with pytest.raises(TypeError, match="use from_int"):
        QArray.from_blocks(raw, "qint8")


def test_quantize_errors(rng):
    x = rng.standard_normal((2, 64)).astype(np.float32)
    with pytest.raises(ValueError, match="blocks of 256 values along the last axis, whose length 64 is not"):
        qa.quantize(x, dtype="Q4_K")
    with pytest.raises(TypeError, match="chooses its own parameters, block by block; drop scale, axis"):
        qa.quantize(x, 0.1, dtype="Q4_0", axis=0)
    with pytest.raises(TypeError, match="read only"):
        qa.quantize(np.zeros((1, 256), np.float32), dtype="IQ2_XXS")
    for name, width in (("Q8_0", 64), ("Q8_K", 256)):  # (their kernels' scales say it: every block's kind)
        for v in (np.nan, np.inf, -np.inf, np.float32(-np.nan)):
            bad = rng.standard_normal((2, width)).astype(np.float32)
            bad[1, 5] = v
            bad[0, :32] = 0  # an all-zero block
            with pytest.raises(ValueError, match=rf"1 value\(s\) are NaN or infinite \(the first at flat index "
                                                 rf"{width + 5}\); {name} holds finite values only"):
                qa.quantize(bad, dtype=name)
    with pytest.raises(TypeError, match="qint8 needs a scale"):
        qa.quantize(x)
    np.testing.assert_array_equal(qa.quantize(x.astype(np.float16), dtype="Q8_0").data,
                                  qa.quantize(x.astype(np.float16).astype(np.float32), dtype="Q8_0").data)


IMPORTANCE_TAKERS = "Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS"


@pytest.mark.parametrize("dtype", ["Q8_0", "Q4_0", "TQ2_0", "int4_g128_f16", "qint8", "float8_e4m3fn"])
def test_importance_is_for_the_k_quants_and_iq4(dtype, rng):
    x = rng.standard_normal((2, 256)).astype(np.float32)
    with pytest.raises(TypeError, match=rf"^quantize: importance= \(llama.cpp's imatrix\) is taken by "
                                        rf"{IMPORTANCE_TAKERS}, whose ggml quantizers weight by it; {dtype} has no "
                                        "such quantizer: drop importance, or pick one of those$"):
        qa.quantize(x, 0.1 if "_" not in dtype else None, dtype=dtype, importance=np.ones(256))


def _column(v, at, n=512):
    w = np.ones(n)
    w[at] = v
    return w


@pytest.mark.parametrize("importance,exc,match", [
    (np.ones(256), ValueError, r"importance holds one value per column of x, shape \(512,\) here \(llama.cpp's imatrix "
                               r"of the tensor: one entry per input column\), got shape \(256,\)$"),
    (np.ones((2, 512)), ValueError, r"shape \(512,\) here .*got shape \(2, 512\)$"),
    (1.0, ValueError, r"got shape \(\)$"),
    (_column(-0.5, 7), ValueError, r"^quantize: importance holds 1 negative value\(s\) \(the first, -0.5, at column "
                                   r"7\); an importance matrix is a mean of squares, finite float32 values >= 0: "
                                   r"collect it again \(observers.ImportanceMatrix\) or set those columns to 0$"),
    (_column(np.nan, [3, 300]), ValueError, r"holds 2 NaN or infinite value\(s\) \(the first, nan, at column 3\)"),
    (_column(-np.inf, 511), ValueError, r"holds 1 NaN or infinite value\(s\) \(the first, -inf, at column 511\)"),
    (_column(1e39, 9), ValueError, r"holds 1 value\(s\) beyond float32's range \(the first, 1e\+39, at column 9\)"),
    (np.full(512, "a"), TypeError,
     r"^quantize: importance takes real numbers \(an importance matrix\), got dtype <U1$"),
    (np.ones(512, complex), TypeError, "got dtype complex128"),
])
def test_importance_errors(importance, exc, match, rng):
    with pytest.raises(exc, match=match):
        qa.quantize(rng.standard_normal((3, 512)).astype(np.float32), dtype="Q4_K", importance=importance)


@pytest.mark.parametrize("dtype", ["Q3_K", "IQ4_NL"])
def test_importance_of_any_real_dtype(dtype, rng):
    """Integers, float16 and float64 (to float32, exactly here), lists: the same bytes; zeros are valid."""
    x = rng.standard_normal((3, 512)).astype(np.float32)
    w = rng.integers(0, 5, 512)
    want = qa.quantize(x, dtype=dtype, importance=w.astype(np.float32)).data
    for v in (w, w.astype(np.float16), w.astype(np.float64), w.tolist()):
        np.testing.assert_array_equal(qa.quantize(x, dtype=dtype, importance=v).data, want)


def test_ops_refuse_block_formats(rng):
    q = qa.quantize(rng.standard_normal((2, 32)).astype(np.float32), dtype="Q4_0")
    p = qa.quantize(rng.standard_normal((2, 32)).astype(np.float32), 0.1)
    for op in [lambda: qa.add(q, q, scale=1.0), lambda: qa.relu(q), lambda: qa.cat([q, q]),
               lambda: q.requantize(0.1), lambda: qa.matmul(p, q)]:
        with pytest.raises(TypeError, match="does not take block formats yet; Q4_0 is one: dequantize it"):
            op()


def test_dask(w, rng):
    da = pytest.importorskip("dask.array")
    x = da.from_array(w, chunks=(1, 2, 256))
    q = qa.quantize(x, dtype="Q6_K")
    assert isinstance(q.data, da.Array)
    want = qa.quantize(w, dtype="Q6_K")
    np.testing.assert_array_equal(q.data.compute(), want.data)
    importance = rng.uniform(0, 3, 512).astype(np.float32)  # (whole rows a chunk: each block its columns')
    for imp in (importance, da.from_array(importance, chunks=100)):
        weighted = qa.quantize(x, dtype="Q6_K", importance=imp)
        assert isinstance(weighted.data, da.Array)
        np.testing.assert_array_equal(weighted.data.compute(), qa.quantize(w, dtype="Q6_K", importance=importance).data)
    np.testing.assert_array_equal(q.dequantize().compute(), want.dequantize())
    moved = want.to("dask")
    np.testing.assert_array_equal(moved.dequantize().compute(), want.dequantize())
    np.testing.assert_array_equal(moved[1:, :, 256:].compute().data, want[1:, :, 256:].data)


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_saved_and_loaded_as_the_format_bytes(tmp_path, w, suffix):
    """A block QArray in qarray's own files: its bytes and a version-5 meta, nothing else."""
    if suffix == ".safetensors":
        pytest.importorskip("safetensors")
    arrays = {"k": qa.quantize(w, dtype="Q4_K"), "lattice": QArray.from_blocks(np.arange(2 * 66, dtype=np.uint8)
                                                                                .reshape(2, 66), "IQ2_XXS"),
              "plain": w[0], "int": qa.quantize(w, 0.1)}
    qa.save(tmp_path / f"m{suffix}", arrays)
    back = qa.load(tmp_path / f"m{suffix}")
    for name in ("k", "lattice"):
        assert back[name].dtype is arrays[name].dtype and back[name].shape == arrays[name].shape
        np.testing.assert_array_equal(back[name].data, arrays[name].data)
    np.testing.assert_array_equal(back["int"].int_repr(), arrays["int"].int_repr())
    if suffix == ".npz":
        import zipfile
        with zipfile.ZipFile(tmp_path / "m.npz") as z:
            assert sorted(n for n in z.namelist() if n.startswith("k.")) == ["k.data.npy", "k.meta.npy"]


def test_a_damaged_block_entry_is_named(tmp_path, w):
    import json
    import zipfile
    path = tmp_path / "m.npz"
    qa.save(path, {"k": qa.quantize(w, dtype="Q8_0")})
    with zipfile.ZipFile(path) as z:
        files = {n: np.load(z.open(n)) for n in z.namelist()}
    for change, message in [
        (lambda f: f.update({"k.meta.npy": np.array(json.dumps({"format": "qarray", "version": 5, "dtype": "qint8",
                                                                 "shape": [3, 4, 512]}))}),
         "field k.meta is invalid: dtype qint8 is not a block format, in a version 5 meta"),
        (lambda f: f.update({"k.meta.npy": np.array(json.dumps({"format": "qarray", "version": 5, "dtype": "Q8_0",
                                                                 "shape": [3, 4, 500]}))}),
         r"shape \[3, 4, 500\] is not rows of whole Q8_0 blocks"),
        (lambda f: f.update({"k.data.npy": f["k.data.npy"][..., :-34]}),
         r"field k.data is invalid: holds uint8 of shape \(3, 4, 510\), expected uint8 of shape \(3, 4, 544\)"),
    ]:
        bad = dict(files)
        change(bad)
        np.savez(tmp_path / "bad.npz", **{n[:-4]: v for n, v in bad.items()})
        with pytest.raises(ValueError, match=message):
            qa.load(tmp_path / "bad.npz")


def test_zarr_stores_the_format_bytes(tmp_path, w):
    pytest.importorskip("zarr")
    da = pytest.importorskip("dask.array")
    q = qa.quantize(w, dtype="Q6_K")
    qa.to_zarr(q, tmp_path / "q.zarr")
    back = qa.from_zarr(tmp_path / "q.zarr")
    assert isinstance(back.data, da.Array) and back.dtype is q.dtype and back.shape == q.shape
    np.testing.assert_array_equal(back.data.compute(), q.data)
    np.testing.assert_array_equal(back.dequantize().compute(), q.dequantize())
    lazy = qa.quantize(da.from_array(w, chunks=(1, 2, 512)), dtype="Q6_K")
    qa.to_zarr(lazy, tmp_path / "lazy.zarr", chunks=(1, 4, 210))
    np.testing.assert_array_equal(qa.load(tmp_path / "lazy.zarr")[""].data.compute(), q.data)
