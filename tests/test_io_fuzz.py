"""qarray.load on damaged files: a ValueError naming the file, or exactly the arrays saved."""

import collections
import io
import json
import random
import re
import struct
import warnings
import zipfile

import numpy as np
import pytest

import qarray
from qarray import QArray

from _reference import assert_same


def _files():
    """Valid files as ``{file: {name: QArray}}``. Within a file no two members but the
    metas share a dtype and shape, so swapping two members is always a visible change."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 10)).astype(np.float32)
    return {
        "mixed": {  # data / params: u1 (30,) / (); i1 (30,) / (3,); u1 (15,) / (3, 3); u1 (3,) / (5,)
            "t": qarray.quantize(x, 0.05, 3, "quint8"),
            "a": qarray.quantize(x, np.linspace(0.01, 0.03, 3, dtype=np.float32), [0, 1, -1], "qint8", axis=0),
            "b": qarray.quantize_dynamic(x, "qint4", axis=1, block_size=4),
            "u2": QArray.from_int(np.array([[0, 3, 2, 1, 3], [1, 1, 0, 2, 3]]),
                                  np.array([0.5, 0.25, 1, 2, 4], np.float32), [0, 1, 2, 3, 0], "quint2", axis=1),
        },
        "wide": {  # i4 (6,) / (2,); i2 (1,) / (); i1 (0,) / (4,); plain i8 (7,), f2 (2, 2)
            "i32": QArray.from_int(np.array([[-(2**31), 0, 7], [1, 2**31 - 1, -5]]),
                                   np.array([1e-3, 2e-3], np.float32), [5, -6], "qint32", axis=0),
            "s": qarray.quantize(np.float32(0.5), 0.1, 0, "qint16"),
            "e": QArray.from_int(np.zeros((0, 4), np.int8), np.ones(4, np.float32), [0, 1, 2, 3], "qint8", axis=1),
            "plain.ints": np.arange(-3, 4, dtype=np.int64),
            "plain.halfs": np.array([[0.5, -1], [np.inf, 2]], np.float16),
        },
        "transposed": {  # blocked, its params Fortran-ordered in the file: u1 (15,) / (5, 2)
            "bt": qarray.quantize_dynamic(rng.standard_normal((6, 5)).astype(np.float32), "quint4",
                                          axis=0, block_size=4).T,
        },
    }


def _members(data: bytes) -> list:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return [(info.filename, z.read(info)) for info in z.infolist()]


def _zip(members) -> bytes:
    """A fresh archive (valid CRCs) of ``[(name, content)]``, names possibly repeated."""
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Duplicate name", UserWarning)
        with zipfile.ZipFile(buf, "w") as z:
            for name, content in members:
                z.writestr(name, content)
    return buf.getvalue()


def _npy(header: str, payload: bytes = b"", version=(1, 0)) -> bytes:
    """An npy member with a header as given (padded as numpy pads it)."""
    header += " " * (-(len(header) + 11) % 64) + "\n"
    size = struct.pack("<H" if version == (1, 0) else "<I", len(header))
    return b"\x93NUMPY" + bytes(version) + size + header.encode("latin1") + payload


def _header_len(content: bytes) -> int:
    return 10 + struct.unpack("<H", content[8:10])[0]


def _flip(data: bytes, rng, count: int) -> bytes:
    d = bytearray(data)
    for _ in range(count):
        d[rng.randrange(len(d))] ^= rng.randrange(1, 256)
    return bytes(d)


def _damaged(data: bytes, rng):
    """``(what, bytes)``: damaged versions of the archive ``data``."""
    members = _members(data)
    for _ in range(80):
        yield "one byte flipped", _flip(data, rng, 1)
    for _ in range(40):
        yield "bytes flipped", _flip(data, rng, rng.randrange(2, 9))
    for _ in range(15):
        yield "truncated", data[: rng.randrange(len(data))]
    for _ in range(10):
        yield "junk appended", data + rng.randbytes(rng.randrange(1, 65))
    for _ in range(20):
        i, j = rng.sample(range(len(members)), 2)
        m = list(members)
        m[i], m[j] = (m[i][0], m[j][1]), (m[j][0], m[i][1])
        yield f"{m[i][0]} and {m[j][0]} swapped", _zip(m)
    for _ in range(10):
        i, j = rng.randrange(len(members)), rng.randrange(len(members))
        m = list(members)
        m.insert(rng.randrange(len(m) + 1), (members[i][0], members[j][1]))
        yield f"{members[i][0]} twice", _zip(m)
    for _ in range(50):  # inside an npy header, the CRC made to match: reaches numpy's parser
        i = rng.randrange(len(members))
        name, content = members[i]
        m = list(members)
        m[i] = (name, _flip(content[: _header_len(content)], rng, 1) + content[_header_len(content):])
        yield f"{name}'s npy header flipped", _zip(m)
    for offset in (len(data) - 2, len(data) - 1):
        d = bytearray(data)
        d[offset] ^= rng.randrange(1, 256)
        yield "end record's comment length flipped", bytes(d)


def test_fuzz(tmp_path):
    rng = random.Random(20240607)
    outcomes = collections.Counter()
    for file, arrays in _files().items():
        good = tmp_path / f"{file}.npz"
        qarray.save(good, arrays)
        data = good.read_bytes()
        layouts = [c[: _header_len(c)].replace(b" ", b"") for n, c in _members(data) if not n.endswith(".meta.npy")]
        assert len(set(layouts)) == len(layouts), "two members alike: a swap could go unseen"
        assert_same(qarray.load(good), arrays, plain=True)
        for what, damaged in _damaged(data, rng):
            path = tmp_path / "damaged.npz"
            path.write_bytes(damaged)
            try:
                back = qarray.load(path)
            except ValueError as e:
                assert str(path) in str(e), f"{file}, {what}: {e}"
                outcomes["ValueError"] += 1
                continue
            except Exception as e:  # anything else is the failure this test looks for
                pytest.fail(f"{file}, {what}: {type(e).__name__}: {e}")
            try:
                assert_same(back, arrays, plain=True)
            except AssertionError:
                pytest.fail(f"{file}, {what}: loaded, but not the arrays saved")
            outcomes["loaded exactly"] += 1
    assert sum(outcomes.values()) == 3 * 227 and outcomes["ValueError"] > 600, outcomes


# -- each named failure ----------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "w.npz"
    qarray.save(path, {k: v for k, v in _files()["mixed"].items() if k in ("t", "b")})
    return path


def _replace(path, **contents):
    """Rewrite ``path`` with members replaced (keyword ``b_data`` is member ``b.data.npy``)."""
    named = {k.replace("_", ".", 1) + ".npy": v for k, v in contents.items()}
    path.write_bytes(_zip([(n, named.get(n, c)) for n, c in _members(path.read_bytes())]))


def _meta(path, name, **changes):
    with np.load(path) as f:
        meta = json.loads(str(f[f"{name}.meta"]))
    meta.update(changes)
    meta = {k: v for k, v in meta.items() if v is not ...}
    buf = io.BytesIO()
    np.save(buf, np.array(json.dumps(meta)))
    _replace(path, **{f"{name}_meta": buf.getvalue()})


def test_header_claiming_2_40_elements(saved):
    _replace(saved, b_data=_npy("{'descr': '|u1', 'fortran_order': False, 'shape': (1099511627776,), }", bytes(15)))
    with pytest.raises(ValueError, match=re.escape(
            "field b.data is invalid: holds uint8 of shape (1099511627776,), expected uint8 of shape (15,)")):
        qarray.load(saved)


def test_header_and_meta_agreeing_on_2_40_elements(saved):
    _meta(saved, "t", shape=[2**40])
    _replace(saved, t_data=_npy("{'descr': '|u1', 'fortran_order': False, 'shape': (1099511627776,), }", bytes(30)))
    with pytest.raises(ValueError, match=re.escape(
            "field t.data is invalid: holds 30 bytes of data, its header (uint8, shape (1099511627776,)) "
            "says 1099511627776")):
        qarray.load(saved)


def test_blocked_shape_2_20_by_2_20(saved):
    _meta(saved, "b", shape=[2**20, 2**20])
    with pytest.raises(ValueError, match=re.escape(
            "field b.scale is invalid: holds float32 of shape (3, 3), expected float32 of shape (1048576, 262144)")):
        qarray.load(saved)


def test_duplicated_member(saved):
    members = _members(saved.read_bytes())
    saved.write_bytes(_zip(members + [m for m in members if m[0] == "b.scale.npy"]))
    with pytest.raises(ValueError, match=r"member 'b\.scale\.npy' appears twice"):
        qarray.load(saved)


@pytest.mark.parametrize("offset", [-2, -1])
def test_end_record_comment_length_flipped(saved, offset):
    data = bytearray(saved.read_bytes())
    data[offset] ^= 0x01
    saved.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="is not a readable qarray file: no zip end record"):
        qarray.load(saved)


def test_members_hidden_from_the_directory(saved):
    """The end record shrunk to skip t's four directory entries: zipfile lists b alone."""
    data = saved.read_bytes()
    size_cd, offset_cd = struct.unpack("<II", data[-10:-2])
    skip = offset_cd
    for _ in range(4):
        n, m, k = struct.unpack("<HHH", data[skip + 28 : skip + 34])
        skip += 46 + n + m + k
    hidden = data[:-10] + struct.pack("<II", size_cd - (skip - offset_cd), skip) + data[-2:]
    saved.write_bytes(hidden)
    with zipfile.ZipFile(saved) as z:
        assert sorted(z.namelist()) == ["b.data.npy", "b.meta.npy", "b.scale.npy", "b.zero_point.npy"]
    with pytest.raises(ValueError, match=r"its zip directory does not match the members in it \(at byte 0\)"):
        qarray.load(saved)


def test_archive_after_another(saved, tmp_path):
    other = tmp_path / "other.npz"
    qarray.save(other, {"x": _files()["mixed"]["a"]})
    saved.write_bytes(other.read_bytes() + saved.read_bytes())
    with pytest.raises(ValueError, match=r"its zip directory does not match the members in it \(at byte 0\)"):
        qarray.load(saved)


def test_compressed_member(saved):
    with np.load(saved) as f:
        fields = {k: f[k] for k in f.files}
    np.savez_compressed(saved, **fields)
    with pytest.raises(ValueError, match=r"member 't\.data\.npy' is compressed, encrypted, streamed"):
        qarray.load(saved)


_U1 = "{'descr': '|u1', 'fortran_order': False, 'shape': "


@pytest.mark.parametrize(
    "header,version,message",
    [
        (_U1 + "(15L,), }", (1, 0), "unreadable: UserWarning: Reading `.npy`"),  # numpy repairs it, and warns
        ("{'descr': '''|u1", (1, 0), "unreadable: TokenError: .*EOF in multi-line string"),
        (_U1 + "(" * 3000 + ")" * 3000 + "}", (1, 0), "unreadable: ValueError: Cannot parse header"),
        (_U1 + "(15,), }", (3, 0), re.escape("unreadable: ValueError: npy format version (3, 0) is not one qarray reads")),
        ("{'descr': 'O', 'fortran_order': False, 'shape': (15,), }", (1, 0), "invalid: holds object of shape"),
    ],
)
def test_npy_header_damage(saved, header, version, message):
    _replace(saved, b_data=_npy(header, bytes(15), version))
    with pytest.raises(ValueError, match="field b.data is " + message):
        qarray.load(saved)


def test_missing_version(saved):
    _meta(saved, "b", version=...)
    with pytest.raises(ValueError, match="field b.meta is invalid: version is missing; this qarray reads version 1, 2"):
        qarray.load(saved)


@pytest.mark.parametrize("version", [6, 0, "1", True, 1.0, None])
def test_unknown_version(saved, version):
    _meta(saved, "b", version=version)
    with pytest.raises(ValueError, match=re.escape(f"field b.meta is invalid: version {version!r} is unknown; "
                                                   "this qarray reads version 1, 2, 3, 4, 5")):
        qarray.load(saved)


def test_save_writes_the_version(saved):
    with np.load(saved) as f:
        meta = json.loads(str(f["b.meta"]))
    assert (meta["format"], meta["version"]) == ("qarray", 2)


def test_files_from_before_the_version_field(saved):
    """``{"format": "qarray-1"}`` without a version: read as version 1."""
    for name in ("t", "b"):
        _meta(saved, name, format="qarray-1", version=...)
    want = _files()["mixed"]
    assert_same(qarray.load(saved), {"t": want["t"], "b": want["b"]}, plain=True)


@pytest.mark.parametrize(
    "text,message",
    [
        ("[" * 100000, "not JSON"),
        ('{"format": "qarray", "format": "qarray"}', "not JSON \\(key 'format' appears twice\\)"),
        ('{"format": "qarray-1", "version": 1}', "format is not 'qarray'"),
        ("[]", "expected a JSON object"),
        ('{"format": "qarray", "version": 1, "dtype": "qint4", "shape": [3, 10], "axis": 1, "block_size": 4, "x": 0}',
         re.escape("keys are ['axis', 'block_size', 'dtype', 'format', 'shape', 'version', 'x'], expected")),
        ('{"format": "qarray", "version": 1, "dtype": 4, "shape": [3, 10], "axis": 1, "block_size": 4}',
         "dtype must be a string, got 4"),
        ('{"format": "qarray", "version": 1, "dtype": "qint4", "shape": [3, true], "axis": 1, "block_size": 4}',
         "shape must be a list of non-negative integers"),
        ('{"format": "qarray", "version": 1, "dtype": "qint4", "shape": [3, 10], "axis": 2, "block_size": 4}',
         "axis=2 is out of range"),
        ('{"format": "qarray", "version": 1, "dtype": "qint4", "shape": [3, 10], "axis": 1, "block_size": 0}',
         "block_size must be >= 1, got 0"),
        ('{"format": "qarray", "version": 1, "dtype": "qint4", "shape": [3, 10], "axis": null, "block_size": 4}',
         "block_size needs an axis"),
    ],
)
def test_damaged_meta(saved, text, message):
    buf = io.BytesIO()
    np.save(buf, np.array(text))
    _replace(saved, b_meta=buf.getvalue())
    with pytest.raises(ValueError, match="field b.meta is invalid: " + message):
        qarray.load(saved)
