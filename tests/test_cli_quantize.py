"""``qarray quantize`` (qarray/cli/quantize.py), in process through ``main([...])``:
what it writes in each output format, the numbers in its table, the files it
refuses, and an output replaced only by a run that succeeds."""

import json
import os
import zipfile

import numpy as np
import pytest

import qarray

from _reference import assert_same, fails, rows, run, write_safetensors

pytest.importorskip("rich")
pytestmark = pytest.mark.usefixtures("wide_tables")


@pytest.fixture
def observer():
    """``qarray.observers.observer`` (built on branch ``observers``)."""
    return pytest.importorskip("qarray.observers").observer


def sqnr(x, q):
    """10 log10(sum x^2 / sum (x - dequantized)^2), computed here apart from the CLI."""
    x = np.asarray(x, np.float64)
    e = x - np.asarray(q.dequantize(), np.float64)
    return np.inf if not e.any() else 10 * np.log10(np.sum(x**2) / np.sum(e**2))


# -- files that cannot be read or written --------------------------------------


def test_quantized_input_is_refused(capsys, tmp_path):
    path = tmp_path / "q.npz"
    qarray.save(path, {"w": qarray.quantize(np.ones(4, np.float32), 0.1, 0, "qint8")})
    fails(capsys, 1, f"{path} is already quantized (written by qarray.save); see what it holds with 'qarray inspect'",
          "quantize", path, "-o", tmp_path / "again.npz")


def test_arrays_that_cannot_be_quantized(capsys, tmp_path):
    path = tmp_path / "c.npz"
    np.savez(path, z=np.ones(3, np.complex64))
    fails(capsys, 1, f"{path}: 'z' has dtype complex64: quantize takes float arrays (and passes integer and bool "
          "arrays through)", "quantize", path, "-o", tmp_path / "q.npz", "--block-size", "4")
    x = np.array([1.0, np.nan, 2.0], np.float32)
    np.savez(path, x=x)
    with pytest.raises(ValueError, match="NaN") as e:
        qarray.quantize_dynamic(x, "qint8", axis=0, block_size=4)
    out = fails(capsys, 1, f"{path}: cannot quantize 'x': ValueError: {e.value}",
                "quantize", path, "-o", tmp_path / "q.npz", "--block-size", "4")
    assert out == ""  # nothing on stdout, not even the blank line rich's progress bar left
    assert not (tmp_path / "q.npz").exists()


def test_unwritable_output(capsys, tmp_path, weights):
    _, path = weights
    out = tmp_path / "no" / "such" / "dir" / "q.npz"
    fails(capsys, 1, f"cannot write {out}: No such file or directory", "quantize", path, "-o", out, "--block-size", "8")


def _checkpoint(tmp_path, suffix, arrays):
    path = tmp_path / f"m{suffix}"
    if suffix == ".safetensors":
        pytest.importorskip("safetensors.numpy").save_file(arrays, path)
    else:
        np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_quantize_over_its_own_input_or_a_link_to_it(capsys, tmp_path, rng, suffix):
    """OUT is IN itself, a symlink to it or a hard link to it: the quantized file
    takes OUT's name, read from IN's own data to the end (the streaming
    .safetensors writer once mapped its output over the input it was reading:
    every tensor one constant code), and IN, where it has another name, is as it was."""
    arrays = {"w": rng.standard_normal((64, 40)).astype(np.float32), "b": rng.standard_normal(64).astype(np.float32)}
    src = _checkpoint(tmp_path, suffix, arrays)
    original = src.read_bytes()
    want = tmp_path / f"want{suffix}"
    assert run(capsys, "quantize", src, "-o", want, "--per-channel", "0")[0] == 0
    for link in ("symlink", "hardlink"):
        out = tmp_path / f"{link}{suffix}"
        os.symlink(src, out) if link == "symlink" else os.link(src, out)
        assert run(capsys, "quantize", src, "-o", out, "--per-channel", "0")[0] == 0
        assert src.read_bytes() == original and not out.is_symlink()
        assert_same(qarray.load(out), qarray.load(want))
    assert run(capsys, "quantize", src, "-o", src, "--per-channel", "0")[0] == 0
    assert_same(qarray.load(src), qarray.load(want))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{n}{suffix}" for n in ("m", "want", "symlink", "hardlink"))


@pytest.mark.parametrize("suffix", [".npz", ".safetensors", ".zarr"])
def test_a_failed_run_leaves_the_output_as_it_was(capsys, tmp_path, rng, suffix):
    """One rule for every output format: OUT is written under a temporary name
    beside it and renamed into place only when every tensor is written, so a run
    that fails halfway leaves an existing OUT as it was and nothing else behind; a
    run that succeeds replaces it; a directory that does not exist is an error."""
    if suffix == ".zarr":
        pytest.importorskip("zarr")
        pytest.importorskip("dask")
    good = _checkpoint(tmp_path, ".safetensors" if suffix != ".npz" else ".npz",
                       {"a": rng.standard_normal((8, 16)).astype(np.float32)})
    bad_arrays = {"a": rng.standard_normal((8, 16)).astype(np.float32), "z": np.full((4, 16), np.nan, np.float32)}
    bad = good.with_name(f"bad{good.suffix}")
    if good.suffix == ".npz":
        np.savez(bad, **bad_arrays)
    else:
        pytest.importorskip("safetensors.numpy").save_file(bad_arrays, bad)
    out = tmp_path / f"out{suffix}"
    assert run(capsys, "quantize", good, "-o", out, "--block-size", "4")[0] == 0

    def snapshot():
        files = [out] if out.is_file() else sorted(p for p in out.rglob("*") if p.is_file())
        return {str(p): p.read_bytes() for p in files}

    before = snapshot()
    rc, _, err = run(capsys, "quantize", bad, "-o", out, "--block-size", "4")
    assert rc == 1 and err.startswith("qarray: error: ") and "NaN" in err, err
    assert snapshot() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([good.name, bad.name, out.name])
    assert run(capsys, "quantize", good, "-o", out, "--block-size", "8")[0] == 0  # success replaces it
    assert snapshot() != before
    missing = tmp_path / "no" / "such" / "dir" / f"q{suffix}"
    fails(capsys, 1, f"cannot write {missing}: No such file or directory", "quantize", good, "-o", missing)
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("suffix", [".npz", ".safetensors", ".zarr"])
def test_bfloat16_and_float8_checkpoints(capsys, tmp_path, rng, suffix):
    """A checkpoint as PyTorch writes it (bfloat16 weights, a float8_e4m3fn tensor,
    int64 steps): inspect lists it; quantize writes what it writes for the same
    values in float32 (one rounding from each value), every output format; the
    table's "bytes before" are the checkpoint's."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    pytest.importorskip("safetensors")
    if suffix == ".zarr":
        pytest.importorskip("zarr")
        pytest.importorskip("dask")
    small = {"w": ("BF16", rng.standard_normal((16, 40)).astype(ml_dtypes.bfloat16)),
             "b": ("BF16", rng.standard_normal(16).astype(ml_dtypes.bfloat16)),
             "f8": ("F8_E4M3", rng.standard_normal((8, 8)).astype(ml_dtypes.float8_e4m3fn)),
             "steps": ("I64", np.arange(3))}
    wide = {k: ("F32", a.astype(np.float32)) if code != "I64" else (code, a) for k, (code, a) in small.items()}
    write_safetensors(tmp_path / "small.safetensors", small)
    write_safetensors(tmp_path / "wide.safetensors", wide)
    rc, out, _ = run(capsys, "inspect", tmp_path / "small.safetensors")
    assert rc == 0 and {r[0]: r[2] for r in rows(out)} == {"w": "bfloat16", "b": "bfloat16", "f8": "float8_e4m3fn",
                                                          "steps": "int64"}
    tables = []
    for name in ("small", "wide"):
        rc, out, err = run(capsys, "quantize", tmp_path / f"{name}.safetensors", "-o", tmp_path / f"{name}-q{suffix}",
                           "--per-channel", "0")
        assert rc == 0, err
        tables.append({r[0]: r for r in rows(out)})
    for name in ("w", "b", "f8"):
        assert tables[0][name][:6] == tables[1][name][:6]  # scheme, SQNR, error: the same
        assert int(tables[0][name][6]) * (2 if name != "f8" else 4) == int(tables[1][name][6])  # bytes before
    if suffix == ".zarr":
        from qarray.zarr import from_zarr

        for name in ("w", "b", "f8"):
            a, b = (from_zarr(tmp_path / f"{n}-q.zarr" / name).compute() for n in ("small", "wide"))
            assert_same(b, a)
    else:
        assert_same(qarray.load(tmp_path / f"wide-q{suffix}"), qarray.load(tmp_path / f"small-q{suffix}"))


@pytest.mark.parametrize("suffix", [".npz", ".safetensors", ".zarr"])
def test_bytes_after_are_what_the_file_holds(capsys, tmp_path, rng, suffix):
    """4-bit codes take half a byte in every output format (a .safetensors file
    packs them by rows, as a .zarr store does): each row's "bytes after" is what
    the output holds of that tensor (counted here from the file's own layout),
    and the caption gives the output's true size on disk."""
    pytest.importorskip("safetensors")
    if suffix == ".zarr":
        pytest.importorskip("zarr")
        pytest.importorskip("dask")
    from safetensors.numpy import save_file

    arrays = {"conv.weight": rng.standard_normal((8, 3, 3, 5)).astype(np.float32),  # rows of 5: padded to 3 bytes
              "fc.weight": rng.standard_normal((10, 64)).astype(np.float32), "fc.bias": np.ones(10, np.float32)}
    save_file(arrays, str(tmp_path / "m.safetensors"))
    out = tmp_path / f"q{suffix}"
    rc, text, err = run(capsys, "quantize", tmp_path / "m.safetensors", "-o", out, "--dtype", "qint4",
                        "--per-channel", "0")
    assert rc == 0, err
    table = {r[0]: int(r[7]) for r in rows(text)}
    params = {"conv.weight": 8 * 8, "fc.weight": 10 * 8, "fc.bias": 8}  # float32 scales and int32 zero points
    if suffix == ".npz":
        with zipfile.ZipFile(out) as z:
            data = {n: z.getinfo(f"{n}.data.npy").file_size - 128 for n in arrays}  # the .npy header: 128 bytes
        assert data == {"conv.weight": 180, "fc.weight": 320, "fc.bias": 5}  # all of it packed: 360 / 2, ...
    elif suffix == ".safetensors":
        with open(out, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        data = {n: header[n]["data_offsets"][1] - header[n]["data_offsets"][0] for n in arrays}
        assert data == {"conv.weight": 8 * 3 * 3 * 3, "fc.weight": 320, "fc.bias": 5}  # rows of 5 codes: 3 bytes
    else:
        import zarr

        data = {n: zarr.open_array(out / n / "codes").nbytes for n in arrays}
        assert data == {"conv.weight": 8 * 3 * 3 * 3, "fc.weight": 320, "fc.bias": 5}
    assert table == {n: data[n] + params[n] for n in arrays}
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) if out.is_dir() else out.stat().st_size
    assert f" of packed data, scales and zero points; {out.name} is {size} bytes" in text


def test_reciprocal_gives_pytorchs_codes(capsys, tmp_path):
    """--reciprocal writes the codes of quantize(..., reciprocal=True): on a
    symmetric per-channel range each row's extreme sits near -127.5, a tie that
    the division and PyTorch's reciprocal multiply round apart (these two rows
    found by a search over multiples of 1/8: one each way)."""
    w = np.array([[-0.875, 0.25, 0.5], [-0.625, 0.25, 0.5]], np.float32)
    np.save(tmp_path / "w.npy", w)
    codes = {}
    for flag in ([], ["--reciprocal"]):
        out = tmp_path / f"q{len(flag)}.npz"
        rc, _, err = run(capsys, "quantize", tmp_path / "w.npy", "-o", out, "--per-channel", "0", "--symmetric", *flag)
        assert (rc, err) == (0, "")
        q = qarray.load(out)["w"]
        want = qarray.quantize(w, q.scale, 0, "qint8", axis=0, reciprocal=bool(flag))
        np.testing.assert_array_equal(q.int_repr(), want.int_repr())
        codes[bool(flag)] = q.int_repr()
    assert codes[False][:, 0].tolist() == [-128, -127] and codes[True][:, 0].tolist() == [-127, -128]
    fails(capsys, 2, "--reciprocal is PyTorch's rule for integer dtypes; float8_e4m3fn is a floating format",
          "quantize", tmp_path / "w.npy", "-o", tmp_path / "f.npz", "--dtype", "float8_e4m3fn", "--reciprocal")


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_quantize_shows_progress_tensor_by_tensor(capsys, tmp_path, monkeypatch, rng, suffix):
    """Every output format goes through the progress bar tensor by tensor (a
    long per-channel entropy run printed nothing for minutes); off a terminal
    the bar is not drawn (test_tables_are_whole_when_piped)."""
    pytest.importorskip("safetensors")
    if suffix == ".safetensors":
        pytest.importorskip("dask")
    from safetensors.numpy import save_file

    save_file({"a": rng.standard_normal((4, 8)).astype(np.float32), "b": np.ones(3, np.float32)},
              str(tmp_path / "m.safetensors"))
    seen = []

    def progress(items, description):
        for item in items:
            seen.append((description, item[0]))
            yield item

    monkeypatch.setattr("qarray.cli.quantize._progress", progress)
    rc, _, err = run(capsys, "quantize", tmp_path / "m.safetensors", "-o", tmp_path / f"q{suffix}",
                     "--observer", "entropy")
    assert (rc, err) == (0, "") and seen == [("quantizing", "a"), ("quantizing", "b")]


def test_floating_formats_are_symmetric_without_asking(capsys, tmp_path, weights):
    """--dtype float8_e4m3fn without --symmetric: a floating format has no zero
    point to choose (it failed on the first bias: "zero_point must be 0 ... got
    -448"); the same file as with --symmetric."""
    pytest.importorskip("ml_dtypes")
    _, path = weights
    for flags, out in (([], "a.npz"), (["--symmetric"], "b.npz")):
        assert run(capsys, "quantize", path, "-o", tmp_path / out, "--dtype", "float8_e4m3fn", *flags)[0] == 0
    assert_same(qarray.load(tmp_path / "b.npz"), qarray.load(tmp_path / "a.npz"))
    assert all(not np.any(q.zero_point) for q in qarray.load(tmp_path / "a.npz").values() if isinstance(q, qarray.QArray))


def test_tables_are_whole_when_piped(capsys, tmp_path, monkeypatch, rng):
    """stdout not a terminal (``| cat``, a file) and no COLUMNS: the table at its
    own width, not cut to 80 columns ("layer4…", "per-te…")."""
    monkeypatch.delenv("COLUMNS")
    name = "layer4.1.downsample.0.very_long_parameter_name.weight"
    np.savez(tmp_path / "m.npz", **{name: rng.standard_normal((8, 12)).astype(np.float32)})
    rc, out, _ = run(capsys, "quantize", tmp_path / "m.npz", "-o", tmp_path / "q.npz", "--per-channel", "0")
    assert rc == 0 and "…" not in out
    assert rows(out)[0][:4] == [name, "8x12", "qint8", "per-channel axis 0"]
    assert max(len(line) for line in out.splitlines()) > 80


def test_a_quantized_safetensors_file_is_inspected_and_not_quantized_again(capsys, tmp_path, weights):
    """What `quantize -o OUT.safetensors` wrote: inspect shows its QArrays with their
    schemes (it listed the raw X, X.scale, X.zero_point tensors), and quantize
    refuses it whatever the output (the lazy path quantized its codes again)."""
    pytest.importorskip("safetensors")
    _, path = weights
    st = tmp_path / "q.safetensors"
    assert run(capsys, "quantize", path, "-o", st, "--per-channel", "0")[0] == 0
    rc, out, _ = run(capsys, "inspect", st)
    assert rc == 0 and "(qarray file)" in out
    table = {r[0]: r for r in rows(out)}
    assert table["w"][2:4] == ["qint8", "per-channel axis 0"] and table["steps"][3] == "plain array"
    for out_file in ("again.npz", "again.safetensors", "again.zarr"):
        fails(capsys, 1, f"{st} is already quantized (written by qarray.save); see what it holds with 'qarray inspect'",
              "quantize", st, "-o", tmp_path / out_file)
        assert not (tmp_path / out_file).exists()


def test_per_channel_leaves_1d_tensors_per_tensor_and_skip_leaves_them_alone(capsys, tmp_path, rng):
    """--per-channel 0 on a model's 1-d BN and bias tensors gave one scale per
    element (more bytes than the floats): they stay per tensor; --skip PATTERN
    writes matching tensors unchanged (repeatable, fnmatch)."""
    arrays = {"conv.weight": rng.standard_normal((8, 3, 3, 3)).astype(np.float32),
              "bn.weight": rng.standard_normal(8).astype(np.float32), "fc.bias": rng.standard_normal(10).astype(np.float32),
              "embed.weight": rng.standard_normal((20, 4)).astype(np.float32)}
    np.savez(tmp_path / "m.npz", **arrays)
    rc, out, err = run(capsys, "quantize", tmp_path / "m.npz", "-o", tmp_path / "q.npz", "--per-channel", "0",
                       "--skip", "bn.*", "--skip", "embed*")
    assert (rc, err) == (0, "")
    table = {r[0]: r for r in rows(out)}
    assert table["conv.weight"][3] == "per-channel axis 0" and table["fc.bias"][3] == "per-tensor (1-d)"
    assert table["bn.weight"][2:4] == ["float32", "skipped (--skip bn.*)"]
    assert table["embed.weight"][3] == "skipped (--skip embed*)"
    back = qarray.load(tmp_path / "q.npz")
    assert back["fc.bias"].axis is None and back["fc.bias"].scale.shape == ()
    for name in ("bn.weight", "embed.weight"):
        assert isinstance(back[name], np.ndarray) and np.array_equal(back[name], arrays[name])
    fails(capsys, 2, f"--per-channel 4: no float tensor of {tmp_path / 'm.npz'} has that axis (they have 4 to 4 "
          "dimensions)", "quantize", tmp_path / "m.npz", "-o", tmp_path / "r.npz", "--per-channel", "4",
          "--skip", "embed*")


def test_blocks_run_along_the_input_channels(capsys, tmp_path, rng):
    """--block-size without an axis blocks a weight along axis 1, its input
    channels: for a conv weight (out, in, kh, kw) not the kernel's width (blocks
    of 3, 78% of the float size); a 1-d tensor along its one axis."""
    arrays = {"conv.weight": rng.standard_normal((8, 16, 3, 3)).astype(np.float32),
              "fc.weight": rng.standard_normal((10, 24)).astype(np.float32),
              "fc.bias": rng.standard_normal(10).astype(np.float32)}
    np.savez(tmp_path / "m.npz", **arrays)
    rc, out, _ = run(capsys, "quantize", tmp_path / "m.npz", "-o", tmp_path / "q.npz", "--block-size", "8",
                     "--dtype", "qint4")
    assert rc == 0
    back = qarray.load(tmp_path / "q.npz")
    for name, axis in (("conv.weight", 1), ("fc.weight", 1), ("fc.bias", 0)):
        q = back[name]
        assert (q.axis, q.block_size) == (axis, 8), name
        want = qarray.quantize_dynamic(arrays[name], "qint4", axis=axis, block_size=8)
        np.testing.assert_array_equal(q.int_repr(), want.int_repr())
    assert {r[0]: r[3] for r in rows(out)}["conv.weight"] == "blocks of 8 along axis 1"


# -- quantize ------------------------------------------------------------------


def test_quantize_npz(capsys, tmp_path, weights, observer):
    arrays, path = weights
    out = tmp_path / "q.npz"
    rc, text, err = run(capsys, "quantize", path, "-o", out, "--dtype", "quint8")
    assert (rc, err) == (0, "")
    back = qarray.load(out)
    assert list(back) == list(arrays)
    for name in ("steps", "mask", "codes"):  # bit for bit, dtype and all
        assert type(back[name]) is np.ndarray and back[name].dtype == arrays[name].dtype
        assert back[name].tobytes() == arrays[name].tobytes()
    table = {r[0]: r for r in rows(text)}
    for name in ("w", "b"):
        x, q = arrays[name], back[name]
        want = observer("minmax", "quint8", symmetric=False, axis=None).update(x).quantize(x)
        assert (q.dtype, q.axis, q.block_size) == (want.dtype, None, None)
        for got, exp in ((q.int_repr(), want.int_repr()), (q.scale, want.scale), (q.zero_point, want.zero_point)):
            assert got.dtype == exp.dtype and np.array_equal(got, exp)
        err = np.abs(x.astype(np.float64) - q.dequantize().astype(np.float64)).max()
        stored = q.pack().nbytes + q.scale.nbytes + q.zero_point.nbytes
        assert table[name] == [name, "x".join(map(str, x.shape)), "quint8", "per-tensor", f"{sqnr(x, q):.2f}",
                               f"{err:.4g}", str(x.nbytes), str(stored)]
    for name in ("steps", "mask", "codes"):
        a = arrays[name]
        assert table[name] == [name, "x".join(map(str, a.shape)), str(a.dtype), "passed through", "", "",
                               str(a.nbytes), str(a.nbytes)]
    before = sum(a.nbytes for a in arrays.values())
    after = sum(int(r[7]) for r in table.values())
    assert (f"{before} -> {after} bytes ({after / before:.1%}) of packed data, scales and zero points; q.npz is "
            f"{out.stat().st_size} bytes") in text


def test_quantize_npy_per_channel(capsys, tmp_path, rng, observer):
    x = rng.standard_normal((6, 5, 4)).astype(np.float32)
    path = tmp_path / "conv.weight.npy"
    np.save(path, x)
    out = tmp_path / "q.npz"
    rc, text, _ = run(capsys, "quantize", path, "-o", out, "--dtype", "qint8", "--per-channel", "-3", "--symmetric",
                      "--observer", "percentile")
    assert rc == 0
    q = qarray.load(out)["conv.weight"]  # the name is the file's stem
    want = observer("percentile", "qint8", symmetric=True, axis=0).update(x).quantize(x)
    assert (q.axis, q.block_size) == (0, None)
    assert np.array_equal(q.int_repr(), want.int_repr()) and np.array_equal(q.scale, want.scale)
    assert rows(text)[0][3:5] == ["per-channel axis 0", f"{sqnr(x, q):.2f}"]


def test_quantize_safetensors_per_channel_fallback(capsys, tmp_path, rng, observer):
    st = pytest.importorskip("safetensors.numpy")
    arrays = {"layer.0.weight": rng.standard_normal((4, 6)).astype(np.float16),
              "layer.0.bias": rng.standard_normal(4).astype(np.float32),
              "scale": np.array(2.5, np.float32),
              "layer.0.steps": np.array([1, 2], np.int32)}
    path = tmp_path / "model.safetensors"
    st.save_file(arrays, str(path))
    out = tmp_path / "q.npz"
    rc, text, err = run(capsys, "quantize", path, "-o", out, "--dtype", "qint4", "--per-channel", "1")
    assert rc == 0
    assert err == "qarray: note: --per-channel 1: per tensor for 1 tensor(s) without that axis: scale (0-d)\n"
    fails(capsys, 2, f"--per-channel 5: no float tensor of {path} has that axis (they have 0 to 2 dimensions)",
          "quantize", path, "-o", tmp_path / "five.npz", "--per-channel", "5")
    assert not (tmp_path / "five.npz").exists()
    back = qarray.load(out)
    assert sorted(back) == sorted(arrays)
    assert back["layer.0.steps"].dtype == np.int32 and np.array_equal(back["layer.0.steps"], [1, 2])
    table = {r[0]: r for r in rows(text)}
    for name, axis, scheme in (("layer.0.weight", 1, "per-channel axis 1"),
                               ("layer.0.bias", None, "per-tensor (1-d)"),  # 1-d tensors stay per tensor
                               ("scale", None, "per-tensor (scalar: no axis 1)")):
        x, q = arrays[name], back[name]
        want = observer("minmax", "qint4", symmetric=False, axis=axis).update(x).quantize(x)
        assert q.axis == axis and np.array_equal(q.int_repr(), want.int_repr())
        assert table[name][2:6] == ["qint4", scheme, f"{sqnr(x, q):.2f}" if sqnr(x, q) != np.inf else "inf",
                                    f"{np.abs(x.astype(np.float64) - q.dequantize()).max():.4g}"]
    assert table["layer.0.weight"][7] == str(12 + 6 * 4 + 6 * 4)  # 24 codes in 12 bytes, 6 scales, 6 zero points


@pytest.mark.parametrize("per_channel,axis", [(None, 1), ("0", 0)])
def test_quantize_blocks(capsys, tmp_path, rng, per_channel, axis):
    arrays = {"w": rng.standard_normal((10, 12)).astype(np.float32),
              "row": rng.standard_normal(12).astype(np.float32),
              "ids": np.arange(3, dtype=np.int16)}
    path = tmp_path / "m.npz"
    np.savez(path, **arrays)
    out = tmp_path / "q.npz"
    argv = ["quantize", path, "-o", out, "--dtype", "qint4", "--block-size", "8"]
    rc, text, _ = run(capsys, *argv, *(["--per-channel", per_channel] if per_channel else []))
    assert rc == 0
    back, table = qarray.load(out), {r[0]: r for r in rows(text)}
    x, q = arrays["w"], back["w"]
    want = qarray.quantize_dynamic(x, "qint4", symmetric=False, axis=axis, block_size=8)
    assert (q.axis, q.block_size) == (axis, 8) and np.array_equal(q.int_repr(), want.int_repr())
    assert np.array_equal(q.scale, want.scale) and np.array_equal(q.zero_point, want.zero_point)
    short = " (last 2)" if axis == 0 else " (last 4)"  # 10 rows or 12 columns in blocks of 8
    assert table["w"][3:5] == [f"blocks of 8 along axis {axis}{short}", f"{sqnr(x, q):.2f}"]
    assert table["row"][3] == "blocks of 8 along axis 0 (last 4)"  # axis 0 or -1 of a 1-d array
    assert back["ids"].dtype == np.int16 and np.array_equal(back["ids"], arrays["ids"])


def test_quantize_blocks_of_a_scalar(capsys, tmp_path, observer):
    """A 0-d array has no axis for blocks: per tensor, from the minmax observer."""
    x = np.array(-0.25, np.float32)
    np.save(tmp_path / "one.npy", x)
    rc, text, _ = run(capsys, "quantize", tmp_path / "one.npy", "-o", tmp_path / "q.npz", "--block-size", "8")
    assert rc == 0 and rows(text)[0][3:5] == ["per-tensor (scalar: no axis -1)", "inf"]
    q = qarray.load(tmp_path / "q.npz")["one"]
    assert np.array_equal(q.int_repr(), observer("minmax", "qint8", axis=None).update(x).quantize(x).int_repr())


def test_quantize_plot(capsys, tmp_path, weights):
    pytest.importorskip("matplotlib")
    _, path = weights
    png = tmp_path / "sqnr.png"
    rc, _, err = run(capsys, "quantize", path, "-o", tmp_path / "q.npz", "--block-size", "16", "--plot", png)
    assert (rc, err) == (0, "")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_empty_and_zero_arrays(capsys, tmp_path):
    path = tmp_path / "m.npz"
    np.savez(path, empty=np.zeros((0, 3), np.float32), zeros=np.zeros(4, np.float32))
    rc, text, _ = run(capsys, "quantize", path, "-o", tmp_path / "q.npz", "--block-size", "2")
    assert rc == 0
    table = {r[0]: r for r in rows(text)}
    assert table["empty"][2:] == ["float32", "passed through (empty)", "", "", "0", "0"]
    assert table["zeros"][3:6] == ["blocks of 2 along axis 0", "inf", "0"]
    back = qarray.load(tmp_path / "q.npz")
    assert back["empty"].dtype == np.float32 and back["empty"].shape == (0, 3)


# -- to GGUF ---------------------------------------------------------------------


def test_quantize_to_gguf_keeps_the_metadata(capsys, tmp_path, rng):
    """A GGUF in, a GGUF out: 2-d float tensors and those of other GGUF types quantized (the latter from
    their dequantized values), those already of the type asked for kept byte for byte, 1-d ones and rows
    that are not whole blocks written as they are, and every metadata key and value kept."""
    x = rng.standard_normal((8, 512)).astype(np.float32)
    meta = {"general.architecture": "llama", "tokenizer.ggml.tokens": ["<s>", "a"], "llama.block_count": np.uint32(1),
            "tokenizer.ggml.scores": np.array([0.5, -1.0], np.float32)}
    src = tmp_path / "m.gguf"
    keep = qarray.quantize(x[:, :256], dtype="Q4_K")
    qarray.save(src, {"w": x.astype(np.float16), "q8": qarray.quantize(x, dtype="Q8_0"), "same": keep,
                      "norm": x[0], "odd": x[:, :96], "ids": np.arange(3, dtype=np.int32)}, metadata=meta)
    out = tmp_path / "q.gguf"
    rc, text, _ = run(capsys, "quantize", src, "-o", out, "--dtype", "q4_k", "--skip", "ids")
    assert rc == 0
    assert [r[:4] for r in rows(text)] == [
        ["w", "8x512", "Q4_K", "blocks of 256 along the last axis"],
        ["q8", "8x512", "Q4_K", "blocks of 256 along the last axis (from Q8_0)"],
        ["same", "8x256", "Q4_K", "kept (Q4_K)"],
        ["norm", "512", "float32", "kept (1-d)"],
        ["odd", "8x96", "float32", "kept (rows of 96, not whole blocks of 256)"],
        ["ids", "3", "int32", "skipped (--skip ids)"],
    ]
    tensors, got = qarray.io.gguf.read(out)
    assert got.keys() == meta.keys() and got["tokenizer.ggml.tokens"] == ["<s>", "a"]
    np.testing.assert_array_equal(tensors["w"].data, qarray.quantize(x.astype(np.float16), dtype="Q4_K").data)
    np.testing.assert_array_equal(tensors["q8"].data,
                                  qarray.quantize(qarray.quantize(x, dtype="Q8_0").dequantize(), dtype="Q4_K").data)
    np.testing.assert_array_equal(tensors["same"].data, keep.data)
    np.testing.assert_array_equal(tensors["odd"], x[:, :96])
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing staged is left


def test_quantize_to_gguf_with_an_imatrix(capsys, tmp_path, rng):
    """``--imatrix``: the tensors llama.cpp's importance-matrix file names are quantized with its
    importance (what llama-quantize --imatrix passes to ggml: ``imatrix.load``), a 3-d tensor of experts
    with each expert's row, the others without; the table says which. (Against llama-quantize itself:
    benchmarks/check_lm_imatrix.py and the README.)"""
    from qarray.io import imatrix
    from qarray.observers import ImportanceMatrix

    w = rng.standard_normal((8, 512)).astype(np.float32)
    experts = rng.standard_normal((3, 4, 256)).astype(np.float32)
    plain = rng.standard_normal((4, 256)).astype(np.float32)
    src, mat, out = tmp_path / "m.gguf", tmp_path / "m.imatrix.gguf", tmp_path / "q.gguf"
    qarray.save(src, {"w": w, "experts": experts, "plain": plain}, metadata={"general.architecture": "llama"})
    acts = np.exp(rng.standard_normal((64, 512))).astype(np.float32)  # columns of very different weight
    imatrix.save(mat, {"w": ImportanceMatrix().update(acts),
                       "experts": [ImportanceMatrix().update(acts[:16 * (e + 1), :256]) for e in range(3)]})
    rc, text, _ = run(capsys, "quantize", src, "-o", out, "--dtype", "Q4_K", "--imatrix", mat)
    assert rc == 0
    assert [r[:4] for r in rows(text)] == [
        ["w", "8x512", "Q4_K", "blocks of 256 along the last axis, imatrix"],
        ["experts", "3x4x256", "Q4_K", "blocks of 256 along the last axis, imatrix"],
        ["plain", "4x256", "Q4_K", "blocks of 256 along the last axis"]]
    tensors, _ = qarray.io.gguf.read(out)
    imp = imatrix.load(mat)
    np.testing.assert_array_equal(tensors["w"].data, qarray.quantize(w, dtype="Q4_K", importance=imp["w"]).data)
    assert not np.array_equal(tensors["w"].data, qarray.quantize(w, dtype="Q4_K").data)
    for e in range(3):
        np.testing.assert_array_equal(tensors["experts"].data[e], qarray.quantize(
            experts[e], dtype="Q4_K", importance=imp["experts"][e]).data)
    np.testing.assert_array_equal(tensors["plain"].data, qarray.quantize(plain, dtype="Q4_K").data)

    fails(capsys, 2, "--imatrix weights the search of GGUF types that take an importance matrix (Q2_K .. Q6_K, "
          "IQ4_NL, IQ4_XS, ...); --dtype Q8_0 does not", "quantize", src, "-o", out, "--dtype", "Q8_0", "--imatrix", mat)
    fails(capsys, 2, "--imatrix weights the search of GGUF types that take an importance matrix (Q2_K .. Q6_K, "
          "IQ4_NL, IQ4_XS, ...); --dtype qint8 does not", "quantize", src, "-o", tmp_path / "q.npz", "--imatrix", mat)
    fails(capsys, 1, f"cannot read --imatrix {tmp_path / 'none.gguf'}: No such file or directory",
          "quantize", src, "-o", out, "--dtype", "Q4_K", "--imatrix", tmp_path / "none.gguf")
    imatrix.save(mat, {"plain": ImportanceMatrix().update(acts[:, :128])})
    fails(capsys, 1, f"{src}: cannot quantize 'plain': ValueError: --imatrix {mat} holds 128 values for it, where "
          "its shape 4x256 takes 256", "quantize", src, "-o", out, "--dtype", "Q4_K", "--imatrix", mat)


def test_quantize_to_gguf_usage_errors(capsys, tmp_path, weights):
    _, path = weights
    fails(capsys, 2, "--dtype Q4_K is a GGUF type: the output must be a .gguf file",
          "quantize", path, "-o", tmp_path / "q.npz", "--dtype", "Q4_K")
    fails(capsys, 2, "a .gguf output holds GGUF's types: --dtype Q8_0, Q4_K, ... (got qint4)",
          "quantize", path, "-o", tmp_path / "q.gguf", "--dtype", "qint4")
    fails(capsys, 2, "Q8_0 chooses its own parameters, block by block: drop --per-channel, --symmetric",
          "quantize", path, "-o", tmp_path / "q.gguf", "--dtype", "Q8_0", "--per-channel", "0", "--symmetric")
    fails(capsys, 2, "Q8_0 chooses its own parameters, block by block: drop --observer",
          "quantize", path, "-o", tmp_path / "q.gguf", "--dtype", "Q8_0", "--observer", "mse")
    assert not list(tmp_path.glob("q.*"))
