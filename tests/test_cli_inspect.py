"""``qarray inspect`` (qarray/cli/inspect.py) and the files it reads
(qarray/cli/_files.py), in process through ``main([...])``: its table, and a
file that cannot be read as one line."""

import os
import re

import numpy as np
import pytest

import qarray

from _reference import fails, rows, run

pytest.importorskip("rich")
pytestmark = pytest.mark.usefixtures("wide_tables")


# -- files that cannot be read -------------------------------------------------


def test_file_errors(capsys, tmp_path, weights):
    _, good = weights
    missing = tmp_path / "missing.npz"
    fails(capsys, 1, f"{missing}: no such file", "quantize", missing, "-o", tmp_path / "q.npz")
    (tmp_path / "dir.npy").mkdir()
    fails(capsys, 1, f"{tmp_path / 'dir.npy'}: a directory, not a file", "inspect", tmp_path / "dir.npy")
    text = tmp_path / "text.npz"
    text.write_text("not numpy")
    fails(capsys, 1, f"{text} is not a .npz file: it does not start as one", "inspect", text)
    npy = tmp_path / "text.npy"
    npy.write_text("not numpy")
    fails(capsys, 1, f"{npy} is not a .npy file: it does not start as one", "quantize", npy, "-o", tmp_path / "q.npz")
    cut = tmp_path / "cut.npz"
    cut.write_bytes(good.read_bytes()[:300])
    fails(capsys, 1, f"{cut}: cannot read it: BadZipFile: File is not a zip file", "inspect", cut)
    objects = tmp_path / "objects.npy"
    np.save(objects, np.array([{}, None]), allow_pickle=True)
    fails(capsys, 1, f"{objects}: cannot read it: ValueError: Object arrays cannot be loaded when allow_pickle=False",
          "quantize", objects, "-o", tmp_path / "q.npz")
    member = tmp_path / "member.npz"
    np.savez(member, ok=np.zeros(2), bad=np.array([{}, None]))
    fails(capsys, 1, f"{member}: cannot read array 'bad': ValueError: Object arrays cannot be loaded when "
          "allow_pickle=False", "inspect", member)
    st = tmp_path / "garbage.safetensors"
    st.write_bytes(b"\xff" * 20)
    fails(capsys, 1, f"{st}: cannot read it: SafetensorError: Error while deserializing header: header too large",
          "inspect", st)
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["model.npz", "dir.npy", "text.npz", "text.npy", "cut.npz", "objects.npy", "member.npz", "garbage.safetensors"])


def test_damaged_qarray_file(capsys, tmp_path):
    path = tmp_path / "q.npz"
    qarray.save(path, {"w": qarray.quantize(np.ones(4, np.float32), 0.1, 0, "qint8")})
    with np.load(path) as f:
        fields = {k: f[k] for k in f.files}
    fields["w.scale"] = np.float32(-1)
    np.savez(path, **fields)
    with pytest.raises(ValueError, match=re.escape(f"{path}: field w.scale/zero_point/meta is invalid: ")) as e:
        qarray.load(path)
    fails(capsys, 1, str(e.value), "inspect", path)


# -- inspect -------------------------------------------------------------------


def test_inspect_what_quantize_wrote(capsys, tmp_path, rng):
    arrays = {"w": rng.standard_normal((4, 16)).astype(np.float32), "n": np.arange(3, dtype=np.int32)}
    path = tmp_path / "m.npz"
    np.savez(path, **arrays)
    out = tmp_path / "q.npz"
    assert run(capsys, "quantize", path, "-o", out, "--block-size", "8", "--symmetric")[0] == 0
    rc, text, err = run(capsys, "inspect", out)
    assert (rc, err) == (0, "")
    q = qarray.load(out)["w"]
    s, z = q.scale, q.zero_point
    assert rows(text) == [
        ["w", "4x16", "qint8", "blocks of 8 along axis 1", f"{s.min():.6g} .. {s.max():.6g}", "0",
         str(64 + 8 * 4 + 8 * 4)],
        ["n", "3", "int32", "plain array", "", "", "12"],
    ]
    assert f"{out} (qarray file)" in text
    assert np.all(z == 0)


def test_inspect_per_tensor_and_per_channel(capsys, tmp_path):
    path = tmp_path / "q.npz"
    qarray.save(path, {"t": qarray.quantize(np.ones(5, np.float32), 0.5, 3, "quint8"),
                       "c": qarray.quantize(np.ones((2, 3), np.float32), [0.25, 0.5], [-1, 4], "qint8", axis=0)})
    rc, text, _ = run(capsys, "inspect", path)
    assert rc == 0 and rows(text) == [
        ["t", "5", "quint8", "per-tensor", "0.5", "3", str(5 + 4 + 4)],
        ["c", "2x3", "qint8", "per-channel axis 0", "0.25 .. 0.5", "-1 .. 4", str(6 + 8 + 8)],
    ]


def test_inspect_plain_files(capsys, tmp_path, weights):
    arrays, path = weights
    rc, text, _ = run(capsys, "inspect", path)
    assert rc == 0
    assert rows(text) == [[n, "x".join(map(str, a.shape)), str(a.dtype), str(a.nbytes)] for n, a in arrays.items()]
    npy = tmp_path / "x.npy"
    np.save(npy, np.float16(1.5))
    assert rows(run(capsys, "inspect", npy)[1]) == [["x", "scalar", "float16", "2"]]
    st = pytest.importorskip("safetensors.numpy")
    st.save_file({"a.b": np.zeros((2, 3), np.float32)}, str(tmp_path / "m.safetensors"))
    assert rows(run(capsys, "inspect", tmp_path / "m.safetensors")[1]) == [["a.b", "2x3", "float32", "24"]]


# -- GGUF files ----------------------------------------------------------------


def test_a_gguf_file(capsys, tmp_path, rng):
    x = rng.standard_normal((4, 256)).astype(np.float32)
    path = tmp_path / "m.gguf"
    qarray.save(path, {"blk.0.w": qarray.quantize(x, dtype="Q4_K"), "norm": x[0], "e": x.astype(np.float16)},
                metadata={"general.architecture": "llama", "tokenizer.ggml.tokens": [f"t{i}" for i in range(9)],
                          "llama.block_count": np.uint32(1), "ids": np.arange(7, dtype=np.int32)})
    rc, out, _ = run(capsys, "inspect", path)
    assert rc == 0
    assert rows(out) == [
        ["general.architecture", "string", "llama"],
        ["tokenizer.ggml.tokens", "string[9]", "t0, t1, t2, t3, t4, ..."],
        ["llama.block_count", "uint32", "1"],
        ["ids", "int32[7]", "0, 1, 2, 3, 4, ..."],
        ["blk.0.w", "4x256", "Q4_K", "4.5", "576"],
        ["norm", "256", "F32", "32", "1024"],
        ["e", "4x256", "F16", "16", "2048"],
    ]
    assert "3 tensors, 2304 values in 3648 bytes (12.7 bits per value)" in " ".join(out.split())
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(path.read_bytes()[:40])
    fails(capsys, 1, re.compile(re.escape(f"{bad}: GGUF tensor count: 3 would need at least 96 bytes, ") + ".*"),
          "inspect", bad)
