"""The ``qarray`` command (qarray/cli.py), in process through ``main([...])``:
exit statuses, the one-line errors, and the numbers in its tables."""

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import qarray
from qarray import cli

from _reference import assert_same, write_safetensors

pytest.importorskip("rich")
ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ["info", "quantize", "inspect", "examples", "run", "bench"]


@pytest.fixture(autouse=True)
def wide_tables(monkeypatch):
    """rich wraps tables at COLUMNS when output is not a terminal: one row a line here."""
    monkeypatch.setenv("COLUMNS", "400")


@pytest.fixture
def observer():
    """``qarray.observers.observer`` (built on branch ``observers``)."""
    return pytest.importorskip("qarray.observers").observer


def run(capsys, *argv):
    """``(exit status, stdout, stderr)`` of ``main(argv)``."""
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


def fails(capsys, status, message, *argv):
    """``main(argv)`` returns ``status`` after exactly one line on stderr, ``qarray: error: message``
    (``message`` a string, or a compiled pattern for text that varies with the Python version)."""
    rc, out, err = run(capsys, *argv)
    if isinstance(message, re.Pattern):
        assert rc == status and re.fullmatch(f"qarray: error: {message.pattern}\n", err), err
    else:
        assert (rc, err) == (status, f"qarray: error: {message}\n")
    return out


def choices(*names):
    """argparse's list of choices, as a pattern: quoted or bare, as Python versions differ."""
    return ", ".join(f"'?{n}'?" for n in names)


def rows(out):
    """The body rows of the rich tables in ``out``, as lists of cell texts."""
    return [[c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines() if line.startswith("│")]


def sqnr(x, q):
    """10 log10(sum x^2 / sum (x - dequantized)^2), computed here apart from the CLI."""
    x = np.asarray(x, np.float64)
    e = x - np.asarray(q.dequantize(), np.float64)
    return np.inf if not e.any() else 10 * np.log10(np.sum(x**2) / np.sum(e**2))


@pytest.fixture
def weights(rng, tmp_path):
    """A .npz of float and integer arrays, and its path."""
    arrays = {
        "w": (rng.standard_normal((8, 40)) * 0.1).astype(np.float32),
        "b": rng.standard_normal(8).astype(np.float64),
        "steps": np.array([3, -7, 2**40], np.int64),
        "mask": np.array([True, False, True]),
        "codes": np.arange(6, dtype=np.uint8).reshape(2, 3),
    }
    path = tmp_path / "model.npz"
    np.savez(path, **arrays)
    return arrays, path


# -- the parser ----------------------------------------------------------------


@pytest.mark.parametrize("command", [[]] + [[c] for c in COMMANDS])
def test_help(capsys, command):
    rc, out, err = run(capsys, *command, "--help")
    assert (rc, err) == (0, "")
    assert out.startswith(f"usage: qarray{' ' + command[0] if command else ''}")


def test_version(capsys):
    assert run(capsys, "--version") == (0, f"qarray {qarray.__version__}\n", "")


@pytest.mark.parametrize(
    "argv,message",
    [
        ([], "the following arguments are required: COMMAND (see 'qarray --help')"),
        (["frobnicate"], re.compile(r"argument COMMAND: invalid choice: 'frobnicate' \(choose from "
                                    + choices(*COMMANDS) + r"\) \(see 'qarray --help'\)")),
        (["quantize", "m.npz"], "the following arguments are required: -o/--output (see 'qarray quantize --help')"),
        (["quantize", "m.npz", "-o", "q.npz", "--dtype", "int3"],
         "argument --dtype: unknown quantized dtype 'int3'; use one of qint2, quint2, qint4, quint4, qint8, quint8, "
         "qint16, quint16, qint32 (or int8, uint4, quint4x2, ...), or a floating format: float8_e4m3fn, "
         "float8_e4m3fnuz, float8_e5m2, float8_e5m2fnuz, float6_e2m3fn, float6_e3m2fn, float4_e2m1fn, mxint8 "
         "(see 'qarray quantize --help')"),
        (["quantize", "m.npz", "-o", "q.npz", "--block-size", "0"],
         "argument --block-size: expected a positive integer, got '0' (see 'qarray quantize --help')"),
        (["quantize", "m.npz", "-o", "q.npz", "--per-channel", "x"],
         "argument --per-channel: invalid int value: 'x' (see 'qarray quantize --help')"),
        (["quantize", "m.npz", "-o", "q.npz", "--observer", "median"],
         re.compile(r"argument --observer: invalid choice: 'median' \(choose from " + choices(*cli.OBSERVERS)
                    + r"\) \(see 'qarray quantize --help'\)")),
        (["quantize", "m.npz", "-o", "q.npz", "--block-size", "32", "--observer", "mse"],
         "--block-size takes --observer minmax only, got mse (the other observers give per-tensor or per-channel "
         "parameters)"),
        (["quantize", "m.npz", "-o", "q.npy"], "the output must be a .npz or .safetensors file or a .zarr store, got q.npy"),
        (["quantize", "m.npz", "-o", "q.npz", "--plot", "p.svg"], "--plot writes a .png file, got p.svg"),
        (["quantize", "m.txt", "-o", "q.npz"], "m.txt: expected a .npz, .npy or .safetensors file or a .zarr store"),
        (["inspect"], "the following arguments are required: FILE (see 'qarray inspect --help')"),
        (["inspect", "m.pt"], "m.pt: expected a .npz, .npy or .safetensors file or a .zarr store"),
        (["examples", "extra"], "unrecognized arguments: extra (see 'qarray --help')"),
        (["run"], "run needs the NAME of an example; the examples are " + ", ".join(
            importlib.import_module("qarray.examples").NAMES)),
        (["run", "digits", "--bogus"], "unrecognized arguments: --bogus (see 'qarray --help')"),
        (["run", "digits", "--backend", "torch"], re.compile(
            r"argument --backend: invalid choice: 'torch' \(choose from " + choices("numpy", "cupy")
            + r"\) \(see 'qarray run --help'\)")),
        (["run", "nope", "--quick"], "unknown example 'nope'; the examples are " + ", ".join(
            importlib.import_module("qarray.examples").NAMES)),
        (["bench", "core", "fast"], "unknown benchmark 'fast'; the benchmarks are core, ops, gpu"),
        (["bench", "-o", "b.txt"], "the output must be a .json file, got b.txt"),
    ],
)
def test_usage_errors(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    assert fails(capsys, 2, message, *argv) == ""
    assert os.listdir(tmp_path) == []


# -- files that cannot be read or written ----------------------------------------


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

    monkeypatch.setattr(cli, "_progress", progress)
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


def test_missing_optional_packages(capsys, tmp_path, monkeypatch, weights):
    _, path = weights
    out = tmp_path / "q.npz"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    fails(capsys, 1, "this needs matplotlib: pip install matplotlib", "quantize", path, "-o", out, "--plot",
          tmp_path / "p.png")
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    (tmp_path / "m.safetensors").write_bytes(b"")
    fails(capsys, 1, "this needs safetensors: pip install safetensors", "inspect", tmp_path / "m.safetensors")
    monkeypatch.setitem(sys.modules, "rich", None)
    for argv in (["info"], ["quantize", path, "-o", out], ["inspect", path], ["examples"], ["bench", "core"]):
        fails(capsys, 1, "this needs rich: pip install 'qarray[cli]'", *argv)
    assert not out.exists()


# -- quantize --------------------------------------------------------------------


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


# -- inspect ---------------------------------------------------------------------


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


# -- examples, run ---------------------------------------------------------------


def test_examples(capsys):
    from qarray.examples import NAMES

    rc, text, err = run(capsys, "examples")
    assert (rc, err) == (0, "")
    got = rows(text)
    assert [r[0] for r in got if r[0]] == list(NAMES)
    first = importlib.import_module(f"qarray.examples.{NAMES[0]}").__doc__.strip().splitlines()[0]
    assert got[0][1] == first


def test_run(capsys):
    rc, text, err = run(capsys, "run", "quickstart", "--quick")
    assert (rc, err) == (0, "")
    assert "saved and loaded" in text


def test_run_reports_what_an_example_lacks_as_its_own_error(capsys, monkeypatch):
    """`qarray run NAME` says what the example lacks as every command says its
    errors, `qarray: error: ...` (it printed `qarray.examples.NAME: ...`)."""
    from qarray.examples import _common

    monkeypatch.setattr(_common, "gpu_problem", lambda: "the cupy backend found no CUDA device")
    fails(capsys, 1, "--backend cupy: the cupy backend found no CUDA device", "run", "digits", "--backend", "cupy")
    monkeypatch.setattr(_common, "_PACKAGES", {**_common._PACKAGES, "rich": "rich"})
    monkeypatch.setattr(_common.importlib.util, "find_spec", lambda m: None if m == "sklearn" else object())
    fails(capsys, 1, "the digits example needs scikit-learn: pip install 'qarray[examples]'", "run", "digits")
    assert not _common.FROM_CLI.get()


def test_run_passes_the_options_and_the_exit_status(capsys, monkeypatch):
    import qarray.examples.quickstart as example

    seen = []
    monkeypatch.setattr(example, "main", lambda argv: seen.append(argv) or 3)
    assert run(capsys, "run", "--quick", "quickstart", "--backend", "cupy")[0] == 3
    assert run(capsys, "run", "quickstart")[0] == 3
    assert seen == [["--backend", "cupy", "--quick"], ["--backend", "numpy"]]

    def boom(argv):
        raise RuntimeError("device fell over\nsecond line")
    monkeypatch.setattr(example, "main", boom)
    fails(capsys, 1, "RuntimeError: device fell over", "run", "quickstart")


# -- info ------------------------------------------------------------------------


def test_info(capsys, monkeypatch):
    from qarray.backends import _cuda

    compiled = []
    monkeypatch.setattr(_cuda, "compile_ptx", lambda name, arch: compiled.append((name, arch)))
    rc, text, err = run(capsys, "info")  # compiles nothing unless asked: it took 27 s with NVRTC installed
    assert (rc, err, compiled) == (0, "", [])
    assert {r[0]: r[1] for r in rows(text)}["CUDA kernels"] == ("not compiled here ('qarray info --compile' "
                                                                 "compiles them with CuPy's NVRTC)")
    rc, text, err = run(capsys, "info", "--compile")
    assert (rc, err) == (0, "")
    table = {r[0]: r[1] for r in rows(text)}
    assert table["qarray"] == qarray.__version__ and table["NumPy"] == np.__version__
    assert table["backends"] == ", ".join(qarray.backends.available())
    assert table["CPU int8 GEMM"] == qarray.backends.gemm_engine()
    for label, module in (("Numba", "numba"), ("onnxruntime", "onnxruntime"), ("CuPy", "cupy")):
        try:
            assert table[label] == importlib.import_module(module).__version__
        except ImportError:
            assert table[label] == "not installed"
    if "cupy" not in qarray.backends.available():
        assert table["GPU"].startswith("none: ")
    names = sorted(p.name for p in _cuda.CUDA_DIR.glob("*.cu"))
    assert compiled == [(n, "90" if "cupy" not in qarray.backends.available() else compiled[0][1]) for n in names]
    if importlib.util.find_spec("cupy"):  # the NVRTC version comes from CuPy
        assert table["CUDA kernels"].startswith(f"compile: {len(names)} files ({', '.join(names)}), NVRTC ")
    else:
        assert table["CUDA kernels"] == "not available: ModuleNotFoundError: No module named 'cupy'"


def test_info_never_crashes(capsys, monkeypatch):
    from qarray.backends import _cuda

    def broken(*args):
        raise RuntimeError("probe failed\nwith a long log")
    monkeypatch.setattr(qarray.backends, "gemm_engine", broken)
    monkeypatch.setattr(qarray.backends, "available", broken)
    monkeypatch.setattr(_cuda, "compile_ptx", broken)
    monkeypatch.setitem(sys.modules, "numba", None)
    monkeypatch.setitem(sys.modules, "cupy", None)
    rc, text, err = run(capsys, "info", "--compile")
    assert (rc, err) == (0, "")
    table = {r[0]: r[1] for r in rows(text)}
    assert table["CPU int8 GEMM"] == table["backends"] == "not available: RuntimeError: probe failed"
    assert table["Numba"] == table["CuPy"] == "not installed"
    assert table["GPU"] == "none: the cupy backend needs CuPy: pip install 'qarray[cuda12]' or 'qarray[cuda13]'"
    assert table["CUDA kernels"] == "not available: RuntimeError: probe failed"


# -- bench -----------------------------------------------------------------------


def test_bench_without_benchmarks(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "_benchmarks_dir", lambda: tmp_path / "benchmarks")
    fails(capsys, 1, f"no benchmarks at {tmp_path / 'benchmarks'}: 'qarray bench' runs from a source checkout "
          "(git clone, then pip install -e .), not from an installed wheel", "bench", "--quick")


FAKE = """
import json, sys
from pathlib import Path
out, quick = Path(sys.argv[1]), sys.argv[2:] == ["--quick"]
if {fail}:
    print("partial output")
    print("Traceback ...\\nValueError: boom", file=sys.stderr)
    sys.exit(3)
(out / "bench_core.json").write_text(json.dumps(dict(machine=dict(quick=quick), rows=[
    dict(op="quantize per-tensor", shape="1048576", peer="torch", ratio=0.5, target=0.7, met="yes"),
    dict(op="cold: import qarray", shape="", peer=None, ratio=None, target=None, met=None),
    dict(op="quantize axis=0", shape="1024x1024", peer="torch quantize_per_channel", ratio=2.25, target=None, met=None),
])))
"""


def test_bench_table_and_json(capsys, tmp_path, monkeypatch):
    """A stand-in bench_core.py: the arguments it gets, the table and the combined JSON."""
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "bench_core.py").write_text(FAKE.format(fail=False))
    monkeypatch.setattr(cli, "_benchmarks_dir", lambda: tmp_path / "benchmarks")
    monkeypatch.chdir(tmp_path)
    rc, text, err = run(capsys, "bench", "--quick", "core")
    assert (rc, err) == (0, "")
    assert rows(text) == [["quantize per-tensor", "1048576", "qarray vs torch", "0.500", "<= 0.7", "yes"],
                          ["quantize axis=0", "1024x1024", "qarray vs torch quantize_per_channel", "2.250", "", ""]]
    combined = json.loads((tmp_path / "qarray-bench.json").read_text())
    assert combined["quick"] is True and combined["results"]["bench_core"]["machine"] == {"quick": True}
    (tmp_path / "benchmarks" / "bench_core.py").write_text(FAKE.format(fail=True))
    fails(capsys, 1, "bench_core.py failed (exit status 3): ValueError: boom", "bench", "core", "-o", "other.json")
    assert not (tmp_path / "other.json").exists()


def test_bench_rows_of_each_benchmark():
    ops = [dict(op="linear", shape="8x8x8", who="qarray nn.Linear", ref="numpy float32 matmul", ratio=0.25,
                target=0.35, met=True)]
    gpu = [dict(op="quantize float32 -> qint8", shape="16777216", fraction_of_copy=0.912, target=0.8, met=True),
           dict(op="add", shape="8388608", fraction_of_copy=0.5, target=None, met=None)]
    assert list(cli._ratios("bench_ops", ops)) == [
        ("linear", "8x8x8", "qarray nn.Linear vs numpy float32 matmul", "0.250", "<= 0.35", "yes")]
    assert list(cli._ratios("bench_gpu", gpu)) == [
        ("quantize float32 -> qint8", "16777216", "qarray vs device copy", "0.912", ">= 0.8", "yes"),
        ("add", "8388608", "qarray vs device copy", "0.500", "", "")]


def test_bench_quick_core_real_run(capsys, tmp_path):
    """SLOW (5-25 s, the benchmark's own subprocesses): a real `qarray bench --quick core`."""
    out = tmp_path / "bench.json"
    committed = {p.name: p.read_bytes() for p in (ROOT / "benchmarks" / "results").iterdir()}
    rc, text, err = run(capsys, "bench", "--quick", "core", "-o", out)
    assert (rc, err) == (0, "")
    result = json.loads(out.read_text())["results"]["bench_core"]
    assert result["machine"]["quick"] is True and result["machine"]["elements"] == 1 << 20
    got = rows(text)
    assert got[0][:3] == ["quantize per-tensor", str(1 << 20), "qarray vs " + result["rows"][0]["peer"]]
    assert len(got) == sum(r["ratio"] is not None for r in result["rows"])
    assert {p.name: p.read_bytes() for p in (ROOT / "benchmarks" / "results").iterdir()} == committed


# -- python -m qarray, and import qarray -------------------------------------------


def _python(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300)


def test_python_m_qarray():
    r = _python("-m", "qarray", "--help")
    assert (r.returncode, r.stderr) == (0, "") and r.stdout.startswith("usage: qarray")
    r = _python("-m", "qarray", "info", "--compile")
    assert (r.returncode, r.stderr) == (0, ""), r.stderr
    table = {row[0]: row[1] for row in rows(r.stdout)}
    assert table["qarray"] == qarray.__version__
    try:  # what compile_ptx needs: CuPy and its NVRTC
        importlib.import_module("cupy.cuda.compiler")._get_nvrtc_version()
        compiles = "compile: "
    except Exception:
        compiles = "not available: RuntimeError: "
    assert table["CUDA kernels"].startswith(compiles), table["CUDA kernels"]
    r = _python("-m", "qarray", "inspect", "nothing.npz")
    assert (r.returncode, r.stdout, r.stderr) == (1, "", "qarray: error: nothing.npz: no such file\n")


def test_import_qarray_imports_no_cli():
    r = _python("-c", "import sys, qarray; print(sorted(m for m in ('rich', 'qarray.cli', 'matplotlib', "
                "'safetensors', 'qarray.examples') if m in sys.modules))")
    assert (r.returncode, r.stdout) == (0, "[]\n"), r.stderr
