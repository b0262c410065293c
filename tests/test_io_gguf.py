"""GGUF files (qarray.io.gguf): read lazily, written so that gguf-py (llama.cpp's
Python package, the oracle here) reads them, the same bytes back after a round
trip, and a clear ValueError naming the file and the field for every kind of
damaged header."""

import struct

import numpy as np
import pytest

import qarray as qa
from qarray.io import gguf as G

gguf = pytest.importorskip("gguf")


def write_with_gguf_py(path, rng, alignment=None):
    """A small model file as llama.cpp's converter writes one: metadata of every type, quantized and
    plain tensors."""
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("x.flag", True)
    w.add_string("general.name", "tiny — test")
    w.add_int64("x.i64", -5)
    w.add_uint64("x.u64", 2**60)
    w.add_float64("x.f64", 0.1)
    w.add_int8("x.i8", -3)
    w.add_uint16("x.u16", 65535)
    w.add_array("tokenizer.ggml.tokens", ["<s>", "a", "b"])
    w.add_array("tokenizer.ggml.scores", [0.0, -1.5, 2.25])
    w.add_array("tokenizer.ggml.token_type", [3, 1, 1])
    x = rng.standard_normal((4, 512)).astype(np.float32)
    for t in ["Q4_0", "Q8_0", "Q5_1", "TQ1_0", "MXFP4"]:
        qt = gguf.GGMLQuantizationType[t]
        w.add_tensor(f"blk.0.{t.lower()}.weight", gguf.quantize(x, qt), raw_dtype=qt)
    w.add_tensor("output_norm.weight", x[0])
    w.add_tensor("token_embd.weight", x.astype(np.float16))
    w.add_tensor("x.i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return x


@pytest.mark.parametrize("alignment", [None, 64])
def test_a_file_read_and_written_again_is_the_same_bytes(tmp_path, rng, alignment):
    x = write_with_gguf_py(tmp_path / "a.gguf", rng, alignment)
    tensors, meta = G.read(tmp_path / "a.gguf")
    assert meta["llama.block_count"] == 2 and type(meta["llama.block_count"]) is np.uint32
    assert type(meta["x.f64"]) is np.float64 and type(meta["x.flag"]) is np.bool_ and meta["x.i8"] == -3
    assert meta["tokenizer.ggml.tokens"] == ["<s>", "a", "b"] and meta["general.name"] == "tiny — test"
    assert meta["tokenizer.ggml.scores"].dtype == np.float32 and meta["tokenizer.ggml.token_type"].dtype == np.int32
    q = tensors["blk.0.q4_0.weight"]
    assert isinstance(q, qa.QArray) and q.dtype == "Q4_0" and q.shape == (4, 512)
    np.testing.assert_array_equal(q.dequantize(), gguf.dequantize(gguf.quantize(x, gguf.GGMLQuantizationType.Q4_0),
                                                                   gguf.GGMLQuantizationType.Q4_0))
    assert isinstance(q.data.base, np.memmap) or isinstance(q.data.base.base, np.memmap)  # a view of the map
    np.testing.assert_array_equal(tensors["output_norm.weight"], x[0])
    assert tensors["token_embd.weight"].dtype == np.float16 and tensors["x.i32"].shape == (2, 3)
    G.save(tmp_path / "b.gguf", tensors, meta)
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    assert qa.load(tmp_path / "a.gguf").keys() == tensors.keys()


def test_gguf_py_reads_what_qarray_writes(tmp_path, rng):
    x = rng.standard_normal((8, 256)).astype(np.float32)
    tensors = {name: qa.quantize(x, dtype=name) for name in ["Q4_K", "Q6_K", "IQ4_XS", "Q8_0", "TQ2_0"]}
    tensors["norm"] = x[0]
    tensors["embd"] = x.astype(np.float16)
    qa.save(tmp_path / "m.gguf", tensors, metadata={"general.architecture": "llama", "n": 3, "f": 0.5,
                                                    "flags": [True, False], "names": ["a", "b"],
                                                    "ids": np.array([1, 2], np.uint64), "general.alignment": 64})
    r = gguf.GGUFReader(tmp_path / "m.gguf")
    assert {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("GGUF.")} == {
        "general.architecture": "llama", "n": 3, "f": 0.5, "flags": [True, False], "names": ["a", "b"],
        "ids": [1, 2], "general.alignment": 64}
    assert r.fields["n"].types == [gguf.GGUFValueType.INT32]
    assert r.fields["ids"].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT64]
    assert r.alignment == 64
    for t in r.tensors:
        got = tensors[t.name]
        assert [int(n) for n in t.shape] == list(reversed(got.shape))
        if isinstance(got, qa.QArray):
            assert t.tensor_type.name == got.dtype.name
            np.testing.assert_array_equal(gguf.dequantize(t.data, t.tensor_type), got.dequantize())
        else:
            np.testing.assert_array_equal(t.data, got)


def test_save_refuses_what_gguf_cannot_hold(tmp_path, rng):
    x = rng.standard_normal((2, 32)).astype(np.float32)
    with pytest.raises(TypeError, match="qint8 QArray; GGUF holds ggml's types"):
        qa.save(tmp_path / "a.gguf", {"w": qa.quantize(x, 0.1)})
    with pytest.raises(TypeError, match="dtype uint32"):
        qa.save(tmp_path / "a.gguf", {"w": x.astype(np.uint32)})
    with pytest.raises(ValueError, match="under 64 bytes"):
        qa.save(tmp_path / "a.gguf", {"w" * 64: x})
    with pytest.raises(ValueError, match="1 to 4"):
        qa.save(tmp_path / "a.gguf", {"w": np.zeros((1,) * 5, np.float32)})
    with pytest.raises(TypeError, match="GGUF metadata 'k'"):
        qa.save(tmp_path / "a.gguf", {"w": x}, metadata={"k": {"a": 1}})
    with pytest.raises(ValueError, match="power of two"):
        qa.save(tmp_path / "a.gguf", {"w": x}, metadata={"general.alignment": 48})
    with pytest.raises(TypeError, match="metadata is for GGUF files"):
        qa.save(tmp_path / "a.npz", {"w": x}, metadata={"k": 1})
    assert not list(tmp_path.iterdir())  # nothing left behind, staged or not


def _header(kv=(), tensors=(), version=3, n_kv=None, n_tensors=None, magic=b"GGUF"):
    """A GGUF header from raw parts: kv as (key, type, value bytes), tensors as (name, ne, type, offset)."""
    def s(t):
        return struct.pack("<Q", len(t)) + t

    out = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                              len(kv) if n_kv is None else n_kv)
    for key, t, v in kv:
        out += s(key) + struct.pack("<I", t) + v
    for name, ne, t, off in tensors:
        out += s(name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, t, off)
    return out + b"\0" * (-len(out) % 32)


ONE = [(b"t", [32], 0, 0)]  # a float32 tensor of 32 values: 128 bytes
BAD = {
    "bad magic": (_header(magic=b"GGUX"), "magic: the file does not start with 'GGUF'"),
    "version 1": (_header(version=1), "version: 1 is not read"),
    "byte-swapped": (_header(version=0x03000000), "byte-swapped"),
    "too many tensors": (_header(n_tensors=2**63 - 1), "tensor count: 9223372036854775807 would need"),
    "too many keys": (_header(n_kv=2**62), "key-value count: "),
    "string too long": (_header(kv=[(b"k", 8, struct.pack("<Q", 2**63))]), "value of 'k' length: "),
    "array too long": (_header(kv=[(b"k", 9, struct.pack("<IQ", 6, 2**61))]), "value of 'k' count: "),
    "nested array": (_header(kv=[(b"k", 9, struct.pack("<IQ", 9, 1))]), "nested arrays are refused"),
    "unknown value type": (_header(kv=[(b"k", 13, b"")]), "value type 13 is not one of GGUF's"),
    "duplicate key": (_header(kv=[(b"k", 4, b"\1\0\0\0")] * 2), "key 'k': appears twice"),
    "alignment not u32": (_header(kv=[(b"general.alignment", 5, struct.pack("<i", 32))]), "general.alignment"),
    "alignment not a power of two": (_header(kv=[(b"general.alignment", 4, struct.pack("<I", 48))]),
                                     "power of two"),
    "five dimensions": (_header(tensors=[(b"t", [1] * 5, 0, 0)]), "n_dims: 5 dimensions"),
    "row not whole blocks": (_header(tensors=[(b"t", [40], 2, 0)]), "a row of 40 values is not a whole number of "
                                                                    "Q4_0 blocks"),
    "unknown type id": (_header(tensors=[(b"t", [32], 99, 0)]), "type: 99 is no ggml type"),
    "removed type id": (_header(tensors=[(b"t", [32], 4, 0)]), "type: 4 is no ggml type"),
    "duplicate tensor": (_header(tensors=ONE * 2) + b"\0" * 256, "tensor 't': appears twice"),
    "offset out of order": (_header(tensors=ONE + [(b"u", [32], 0, 0)]) + b"\0" * 256, "tensor 'u' offset: 0, where"),
    "offset with a gap": (_header(tensors=[(b"t", [32], 0, 32)]) + b"\0" * 256, "offset: 32, where"),
    "offset past the end": (_header(tensors=ONE) + b"\0" * 100, "run past the end of the file"),
    "counts near 2^63": (_header(tensors=[(b"t", [2**62, 4], 0, 0)]), "is too large"),
    "name too long": (_header(tensors=[(b"t" * 64, [32], 0, 0)]), "ggml's limit is 63"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_damaged_headers_say_what_is_wrong(tmp_path, case):
    data, message = BAD[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=f"^{path}: GGUF .*" + message.replace("(", r"\(").replace(")", r"\)")):
        qa.load(path)


def test_every_truncation_of_a_file_is_refused(tmp_path, rng):
    """Each prefix of a real file's header and data: a ValueError, never another error or a hang."""
    write_with_gguf_py(tmp_path / "a.gguf", rng)
    data = (tmp_path / "a.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    for n in sorted(set(range(0, 1200)) | set(range(1200, len(data), 997))):
        path.write_bytes(data[:n])
        with pytest.raises(ValueError, match=f"{path}: GGUF "):
            G.read(path)


def test_chunks_give_lazy_dask_tensors_over_the_map(tmp_path, rng):
    da = pytest.importorskip("dask.array")
    x = rng.standard_normal((6, 512)).astype(np.float32)
    q = qa.quantize(x, dtype="Q4_K")
    qa.save(tmp_path / "m.gguf", {"w": q, "norm": x[0], "e": x.astype(np.float16)})
    for chunks in ("auto", 2):
        t = qa.load(tmp_path / "m.gguf", chunks=chunks)
        assert isinstance(t["w"].data, da.Array) and isinstance(t["e"], da.Array) and t["w"].backend == "dask"
        if chunks == 2:
            assert t["w"].data.chunks == ((2, 2, 2), (288,))  # whole rows of 2 Q4_K blocks
        np.testing.assert_array_equal(t["w"].dequantize().compute(), q.dequantize())
        np.testing.assert_array_equal(t["norm"].compute(), x[0])
        np.testing.assert_array_equal(t["e"].compute(), x.astype(np.float16))
    with pytest.raises(TypeError, match="chunks= is for GGUF files and checkpoint directories"):
        qa.load(tmp_path / "m.npz", chunks=2)
