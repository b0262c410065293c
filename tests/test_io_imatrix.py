"""qarray.io.imatrix: llama.cpp's importance-matrix files, GGUF and legacy .dat.

tests/data/imatrix/lm.imatrix.{gguf,dat} were written by llama.cpp's own ``llama-imatrix``
(llama-cpp-python 0.3.36's vendored llama.cpp, commit 0c1e57098bba), on the lm example's float32
GGUF (``qarray.examples.lm.write_gguf``) and the first 5120 bytes of its training text:

    llama-imatrix -m lm-F32.gguf -f train.txt -o lm.imatrix.gguf --output-format gguf -c 128 -b 128 \\
        --chunks 4 -t 1 --process-output --no-ppl
    (the same with -o lm.imatrix.dat --output-format dat)

15 entries (the 14 linear layers and output.weight), 512 tokens each (4 chunks of 128).
tests/data/imatrix/make_files.py writes them again (the same bytes).
"""

import doctest
import struct
from pathlib import Path

import numpy as np
import pytest

import qarray as qa
from qarray.io import gguf as G
from qarray.io import imatrix
from qarray.observers import ImportanceMatrix

DATA = Path(__file__).parent / "data"
FILES = {"gguf": DATA / "imatrix" / "lm.imatrix.gguf", "dat": DATA / "imatrix" / "lm.imatrix.dat"}
NAMES = sorted([f"blk.{i}.{t}.weight" for i in range(2) for t in
                ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")] + ["output.weight"])


def _dat_bytes(entries, trailer=(3, b"data.txt")):
    """A legacy .dat file, field by field as llama-imatrix writes it: ``entries`` [(name, ncall, values)]."""
    out = [struct.pack("<i", len(entries))]
    for name, ncall, values in entries:
        raw = name.encode()
        out += [struct.pack("<i", len(raw)), raw, struct.pack("<ii", ncall, len(values)),
                np.asarray(values, "<f4").tobytes()]
    if trailer is not None:
        out += [struct.pack("<ii", trailer[0], len(trailer[1])), trailer[1]]
    return b"".join(out)


def test_llama_imatrix_gguf_read():
    """llama-imatrix's GGUF: every entry, its F32 sums and counts (gguf-py, the oracle, reads the raw
    tensors), llama-quantize's in_sum2 / counts in float32, and collectors that hold the sums exactly."""
    gguf = pytest.importorskip("gguf")
    raw = {t.name: np.array(t.data) for t in gguf.GGUFReader(FILES["gguf"]).tensors}
    ms, meta = imatrix.read(FILES["gguf"])
    values = imatrix.load(FILES["gguf"])
    assert meta == {"general.type": "imatrix", "imatrix.datasets": ["train.txt"], "imatrix.chunk_count": 4,
                    "imatrix.chunk_size": 128}
    assert sorted(ms) == sorted(values) == NAMES
    for name in NAMES:
        sums, counts = raw[name + ".in_sum2"], raw[name + ".counts"]
        assert counts.tolist() == [512.0] and sums.dtype == np.float32
        assert sums.shape == ((512,) if name.endswith("ffn_down.weight") else (256,))
        assert values[name].dtype == np.float32
        np.testing.assert_array_equal(values[name], sums / np.float32(512))
        assert ms[name].count == 512
        np.testing.assert_array_equal(ms[name].totals(), sums)
        np.testing.assert_array_equal(ms[name].result(), values[name])


def test_llama_imatrix_dat_read():
    """The same run's legacy file: values mean * ncall (4 chunks), llama-quantize's values / ncall equal
    the GGUF's (ncall a power of two), sums and counts of tokens by chunk_size."""
    ms, meta = imatrix.read(FILES["dat"], chunk_size=128)
    values = imatrix.load(FILES["dat"])
    assert meta == {"imatrix.chunk_count": 4, "imatrix.datasets": ["train.txt"]}
    data = FILES["dat"].read_bytes()
    at = 4
    assert struct.unpack_from("<i", data)[0] == len(NAMES)
    want = imatrix.load(FILES["gguf"])
    for name in NAMES:  # the layout, read here field by field
        n = struct.unpack_from("<i", data, at)[0]
        assert data[at + 4:at + 4 + n].decode() == name
        ncall, nval = struct.unpack_from("<ii", data, at + 4 + n)
        v = np.frombuffer(data, "<f4", nval, at + 12 + n)
        at += 12 + n + 4 * nval
        assert ncall == 4
        np.testing.assert_array_equal(values[name], v / np.float32(4))
        np.testing.assert_array_equal(values[name], want[name])
        assert ms[name].count == 4 * 128
        np.testing.assert_array_equal(ms[name].result(), values[name])
    assert ms[NAMES[0]].columns == 256 and len(data) == at + 8 + len("train.txt")


@pytest.mark.parametrize("fmt", ["gguf", "dat"])
def test_llama_imatrix_rewritten_same_bytes(fmt, tmp_path):
    ms, meta = imatrix.read(FILES[fmt], chunk_size=128)
    out = tmp_path / f"again.{fmt}"
    imatrix.save(out, ms, datasets=meta["imatrix.datasets"], chunk_size=128, format=fmt)
    assert out.read_bytes() == FILES[fmt].read_bytes()


def _collectors(rng, tokens):
    """A dense weight's collector and three experts' (the last without tokens), out of name order."""
    experts = [ImportanceMatrix().update(3 * rng.standard_normal((tokens + i, 32), np.float32)) for i in range(2)]
    return {"blk.0.ffn_down_exps.weight": experts + [ImportanceMatrix()],
            "blk.0.attn_q.weight": ImportanceMatrix().update(rng.standard_normal((tokens, 64), np.float32))}


@pytest.mark.parametrize("tokens", [100, 256])
def test_gguf_round_trip(tokens, tmp_path):
    """qarray's collectors out and back: float32 sums exact, counts, experts (an expert of no tokens:
    zeros and count 0 in the file, ones from load, as llama-quantize); load is llama-quantize's float32
    division, which equals the collector's result() where the count is a power of two."""
    ms = _collectors(np.random.default_rng(tokens), tokens)
    path = tmp_path / "m.gguf"
    imatrix.save(path, ms, datasets=["a.txt", "b.txt"], chunk_size=50)
    tensors, meta = G.read(path)
    assert list(tensors) == ["blk.0.attn_q.weight.in_sum2", "blk.0.attn_q.weight.counts",
                             "blk.0.ffn_down_exps.weight.in_sum2", "blk.0.ffn_down_exps.weight.counts"]
    assert tensors["blk.0.ffn_down_exps.weight.in_sum2"].shape == (3, 32)
    assert tensors["blk.0.ffn_down_exps.weight.counts"].ravel().tolist() == [tokens, tokens + 1, 0]
    assert meta["imatrix.chunk_count"] == (tokens + 1) // 50 and type(meta["imatrix.chunk_size"]) is np.uint32
    back, _ = imatrix.read(path)
    values = imatrix.load(path)
    q = ms["blk.0.attn_q.weight"]
    np.testing.assert_array_equal(back["blk.0.attn_q.weight"].totals(), q.totals())
    np.testing.assert_array_equal(values["blk.0.attn_q.weight"], q.totals() / np.float32(tokens))
    assert (values["blk.0.attn_q.weight"] == q.result()).all() == (tokens == 256)
    experts = back["blk.0.ffn_down_exps.weight"]
    assert [e.count for e in experts] == [tokens, tokens + 1, 0] and experts[2].columns is None
    e = values["blk.0.ffn_down_exps.weight"]
    assert e.shape == (3, 32) and (e[2] == 1).all()
    for i in range(2):
        np.testing.assert_array_equal(e[i], experts[i].result())
        np.testing.assert_array_equal(experts[i].totals(), ms["blk.0.ffn_down_exps.weight"][i].totals())


def test_dat_round_trip(tmp_path):
    ms = _collectors(np.random.default_rng(5), 200)
    path = tmp_path / "m.dat"
    imatrix.save(path, ms, datasets=["first.txt", "last.txt"], chunk_size=64, format="dat")
    values = imatrix.load(path)
    back, meta = imatrix.read(path, chunk_size=64)
    assert meta == {"imatrix.chunk_count": 201 // 64, "imatrix.datasets": ["last.txt"]}
    q = ms["blk.0.attn_q.weight"]
    ncall = np.float32(4)  # 200 tokens in chunks of 64, rounded up
    np.testing.assert_array_equal(values["blk.0.attn_q.weight"],
                                  (q.totals() / np.float32(200) * ncall).astype(np.float32) / ncall)
    np.testing.assert_array_equal(back["blk.0.attn_q.weight"].result(), values["blk.0.attn_q.weight"])
    assert back["blk.0.attn_q.weight"].count == 4 * 64
    e = values["blk.0.ffn_down_exps.weight"]  # experts in a row; the one without tokens: 1 * ncall / ncall
    assert e.shape == (96,) and (e[64:] == 1).all()


def test_dat_layout(tmp_path):
    """A .dat built field by field: values / ncall in float32, ncall 0 kept as is (llama-quantize), the
    trailer optional."""
    v = np.array([3.0, 1.0, 0.5, 7.0], np.float32)
    path = tmp_path / "x.dat"
    for trailer, meta in [((3, b"data.txt"), {"imatrix.chunk_count": 3, "imatrix.datasets": ["data.txt"]}),
                          (None, {}), ((2, b""), {"imatrix.chunk_count": 2})]:
        path.write_bytes(_dat_bytes([("a.weight", 3, v), ("b.weight", 0, v)], trailer))
        values = imatrix.load(path)
        np.testing.assert_array_equal(values["a.weight"], v / np.float32(3))
        np.testing.assert_array_equal(values["b.weight"], v)
        with pytest.raises(ValueError, match="'b.weight' has ncall 0"):
            imatrix.read(path)
        path.write_bytes(_dat_bytes([("a.weight", 3, v)], trailer))
        ms, got = imatrix.read(path, chunk_size=10)
        assert got == meta and ms["a.weight"].count == 30
        np.testing.assert_array_equal(ms["a.weight"].totals(), v * np.float32(10))


def test_quantize_takes_loaded(tmp_path):
    """load's values are quantize's importance: the bytes of the collector's result() where they agree."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((256, 256), np.float32)
    w = rng.standard_normal((8, 256), np.float32)
    m = ImportanceMatrix().update(x)
    imatrix.save(tmp_path / "m.gguf", {"w": m})
    importance = imatrix.load(tmp_path / "m.gguf")["w"]
    np.testing.assert_array_equal(importance, m.result())
    assert qa.quantize(w, dtype="Q4_K", importance=importance).data.tobytes() == m.quantize(w).data.tobytes()


def test_from_sums_and_totals():
    x = np.random.default_rng(2).standard_normal((300, 40)).astype(np.float32)
    m = ImportanceMatrix().update(x)
    exact = (x.astype(np.float64) ** 2).sum(0)  # within float64's error of the exact sums
    np.testing.assert_allclose(m.totals(), exact, rtol=1e-7)
    again = ImportanceMatrix.from_sums(m.totals(), 300)
    np.testing.assert_array_equal(again.totals(), m.totals())
    np.testing.assert_array_equal(again.result(), m.totals() / np.float32(300))
    tiny = ImportanceMatrix.from_sums(np.array([2.0**-149, 0.0, 3.0e38], np.float32), 1)
    assert tiny.totals().tolist() == [2.0**-149, 0.0, np.float32(3.0e38)]
    for bad, match in [(np.array([1.0, -1.0]), "column 1 is -1.0"), (np.array([np.inf]), "finite"),
                       (np.array([1, 2]), "1-d float array"), (np.array([2.0**-400]), "multiple of 2\\*\\*-298")]:
        with pytest.raises(ValueError, match=match):
            ImportanceMatrix.from_sums(bad, 2)
    with pytest.raises(ValueError, match="integer > 0"):
        ImportanceMatrix.from_sums(np.ones(2), 0)


def _gguf(path, tensors, meta=None):
    G.save(path, tensors, {"general.type": "imatrix", **(meta or {})})
    return path


def test_errors(tmp_path):
    f32 = np.ones(4, np.float32)
    cases = [({"a.in_sum2": f32}, "'a' has a .in_sum2 and no .counts"),
             ({"a.counts": np.ones(1, np.float32)}, "'a' has no .in_sum2 and a .counts"),
             ({"a.in_sum2": f32.astype(np.float16), "a.counts": np.ones(1, np.float32)}, "is F16"),
             ({"a.in_sum2": f32, "a.counts": np.array([1.5], np.float32)}, "whole numbers of tokens"),
             ({"a.in_sum2": f32, "a.counts": np.ones(3, np.float32)}, "4 sums for 3 counts"),
             ({"other": f32}, "has none")]
    for tensors, match in cases:
        path = _gguf(tmp_path / "bad.gguf", tensors)
        with pytest.raises(ValueError, match=match):
            imatrix.load(path)
    path = _gguf(tmp_path / "neg.gguf", {"a.in_sum2": -f32, "a.counts": np.ones(1, np.float32)})
    with pytest.raises(ValueError, match="'a': ImportanceMatrix.from_sums: .* column 0 is -1.0"):
        imatrix.read(path)
    path = _gguf(tmp_path / "inf.gguf", {"a.in_sum2": f32 * np.inf, "a.counts": np.ones(1, np.float32)})
    with pytest.raises(ValueError, match="non-finite"):
        imatrix.load(path)
    dat = tmp_path / "bad.dat"
    good = _dat_bytes([("a.weight", 3, f32)])
    for raw, match in [(good[:30], "imatrix .dat entry 'a.weight' values: truncated"),
                       (struct.pack("<i", 0), "entry count: 0"), (b"", "entry count: truncated"),
                       (good[:4] + struct.pack("<i", -2), "name length: -2 is negative")]:
        dat.write_bytes(raw)
        with pytest.raises(ValueError, match=match):
            imatrix.load(dat)
    m = ImportanceMatrix().update(np.ones((2, 4), np.float32))
    for args, kw, err, match in [
            ({"a": ImportanceMatrix()}, {}, ValueError, "no activations observed"),
            ({"a": [m, ImportanceMatrix().update(np.ones((2, 8), np.float32))]}, {}, ValueError, r"\[4, 8\] columns"),
            ({"a": m.result()}, {}, TypeError, "is a ndarray"),
            ({}, {}, TypeError, "non-empty dict"),
            ({"a": m}, {"format": "npz"}, ValueError, "one of gguf, dat"),
            ({"a": m}, {"datasets": "x.txt"}, TypeError, "datasets"),
            ({"a": m}, {"chunk_size": 0}, ValueError, "chunk_size")]:
        with pytest.raises(err, match=match):
            imatrix.save(tmp_path / "out.gguf", args, **kw)


def test_doctest(tmp_path):
    result = doctest.testmod(imatrix, extraglobs={"numpy": np, "qa": qa, "path": str(tmp_path / "m.gguf")})
    assert result.attempted == 3 and result.failed == 0
