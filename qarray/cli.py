"""The ``qarray`` command: ``info``, ``quantize``, ``inspect``, ``examples``, ``run``
and ``bench``.

    qarray info
    qarray quantize model.safetensors -o model-q.npz --dtype qint8 --per-channel 0 --symmetric
    qarray quantize model.npz -o model-q4.npz --dtype qint4 --block-size 32
    qarray inspect model-q.npz
    qarray examples
    qarray run digits --quick
    qarray bench --quick

Tables and progress bars come from rich (``pip install 'qarray[cli]'``), imported
when a command runs: ``import qarray`` imports neither rich nor this module.
Every error is one line on stderr, ``qarray: error: ...``: exit status 2 for a
usage error; 1 for a file that cannot be read or written, a missing optional
package, or an example or benchmark that fails.

``quantize`` takes parameters from ``qarray.observers`` (``--observer``, default
minmax), per tensor or per channel (``--per-channel AXIS``), or from each block's
own range with ``--block-size B`` (``quantize_dynamic``; minmax only): blocks run
along ``--per-channel AXIS`` when given, else along axis 1 (a weight's input
channels: the axis its dot products sum over, not a conv kernel's width), and the last
block of an axis that ``B`` does not divide is shorter. ``--per-channel`` leaves
1-d tensors (biases, norms) per tensor, and an array without that axis (a 0-d
scalar) too: the table says why, and stderr names those that lack the axis; an
axis that no tensor has is a usage error. Integer and bool arrays, empty ones,
and those whose name matches a ``--skip PATTERN``, are written unchanged.

``quantize`` writes OUT (.npz, .safetensors or a .zarr store) under a temporary
name beside it and renames it into place only when every tensor is written: a
run that fails or is interrupted leaves no partial output and an existing OUT
as it was; an existing OUT is replaced by a run that succeeds; OUT may be IN
itself, or a link to it (IN is read from its own file to the end).
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import importlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import qarray
from . import io
from ._params import is_lazy, is_small_float, to_host

__all__ = ["main"]

OBSERVERS = ("minmax", "moving_average", "percentile", "mse", "entropy")
BENCHMARKS = {"core": "bench_core.py", "ops": "bench_ops.py", "gpu": "bench_gpu.py"}
_MAGIC = {".npz": (b"PK\x03\x04", b"PK\x05\x06"), ".npy": (b"\x93NUMPY",)}


class CliError(Exception):
    """An error to report in one line, with the exit status to return."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors as :class:`CliError` (one line, status 2)."""

    def error(self, message):
        raise CliError(f"{message} (see '{self.prog} --help')", 2)


def main(argv: list[str] | None = None) -> int:
    """Run the ``qarray`` command line on ``argv`` (default ``sys.argv[1:]``) and
    return the exit status."""
    try:
        args = _parser().parse_args(argv)
        return args.func(args)
    except CliError as e:
        print(f"qarray: error: {e}", file=sys.stderr)
        return e.status
    except SystemExit as e:  # --help, and an example's own argparse
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except KeyboardInterrupt:
        print("qarray: error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a failing example, or a bug: still one line
        print(f"qarray: error: {_one_line(e)}", file=sys.stderr)
        return 1


def _parser() -> _Parser:
    p = _Parser(prog="qarray", description="Quantized arrays for NumPy and CuPy: inspect, quantize, "
                "run the examples and the benchmarks.")
    p.add_argument("--version", action="version", version=f"qarray {qarray.__version__}")
    sub = p.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("info", help="versions, backends, the CPU GEMM engine, GPUs, CUDA kernels",
                       description="What qarray finds here: versions of qarray and its optional peers, the "
                       "backends available, the CPU int8 GEMM engine, the GPUs CuPy sees and whether the "
                       "CUDA kernels compile (with CuPy's NVRTC; no GPU needed: --compile).")
    s.add_argument("--compile", action="store_true",
                   help="also compile every CUDA kernel file with CuPy's NVRTC (tens of seconds), to show they do")
    s.set_defaults(func=_info)

    s = sub.add_parser("quantize", help="quantize the float arrays of a .npz, .npy or .safetensors file",
                       description="Quantize every float array of IN (.npz, .npy or .safetensors) and write "
                       "them, with the integer and bool arrays unchanged, to OUT with qarray.save; then show "
                       "each array's scheme, SQNR, largest error and size.",
                       epilog="--block-size B: blocks along --per-channel AXIS when given, else along the "
                       "last axis; the last block is shorter where B does not divide the axis. Arrays "
                       "without the axis asked for are quantized per tensor (the table says so).")
    s.add_argument("input", metavar="IN", type=Path, help="a .npz, .npy or .safetensors file of arrays")
    s.add_argument("-o", "--output", metavar="OUT.npz|OUT.safetensors|OUT.zarr", type=Path, required=True,
                   help="the qarray file to write; a .safetensors file or .zarr store is written tensor by tensor "
                   "and chunk by chunk with Dask (IN read lazily, memory-mapped: memory stays bounded whatever its "
                   "size)")
    s.add_argument("--scheduler", metavar="threads|processes|ADDRESS",
                   help="the Dask scheduler of a .zarr or .safetensors output: threads (default), processes, or a "
                   "dask.distributed scheduler's address")
    s.add_argument("--dtype", type=_qdtype, default="qint8", help="quantized dtype (default qint8)")
    s.add_argument("--per-channel", metavar="AXIS", type=int,
                   help="one scale and zero point per index of AXIS, for tensors of 2 or more dimensions (1-d ones, "
                        "biases and norms, stay per tensor: one scale per element would outweigh their values)")
    s.add_argument("--skip", metavar="PATTERN", action="append", default=[],
                   help="write the tensors whose name matches PATTERN (fnmatch: 'bn*', '*.bias', 'embed*') "
                        "unchanged; repeatable")
    s.add_argument("--block-size", metavar="B", type=_positive,
                   help="one scale and zero point per block of B along --per-channel AXIS, else along axis 1 (a "
                        "weight's input channels, (out, in) or (out, in, kh, kw); the only axis of a 1-d tensor)")
    s.add_argument("--symmetric", action="store_true", help="symmetric ranges (zero point 0, or the middle code)")
    s.add_argument("--reciprocal", action="store_true",
                   help="PyTorch's codes: multiply by float32(1 / scale) as PyTorch does, not divide as ONNX does "
                        "(float32 tensors, integer dtypes; they differ at ties such as a symmetric range's ends)")
    s.add_argument("--observer", choices=OBSERVERS, default="minmax",
                   help="how the range is chosen (default minmax; --block-size takes minmax only)")
    s.add_argument("--plot", metavar="FILE.png", type=Path, help="also draw the SQNR per array (needs matplotlib)")
    s.set_defaults(func=_quantize)

    s = sub.add_parser("inspect", help="what a .npz, .npy or .safetensors file holds",
                       description="The arrays of FILE: for a qarray file, each one's dtype, scheme, scales, "
                       "zero points and stored bytes; for other files, name, shape and dtype.")
    s.add_argument("file", metavar="FILE", type=Path)
    s.set_defaults(func=_inspect)

    s = sub.add_parser("examples", help="list the examples", description="The examples that 'qarray run' runs.")
    s.set_defaults(func=_examples)

    s = sub.add_parser("run", help="run an example", description="Run example NAME (see 'qarray examples'), "
                       "as python -m qarray.examples.NAME does.")
    s.add_argument("name", metavar="NAME", nargs="?", help="which example")
    s.add_argument("--quick", action="store_true", help="a smaller run, a few seconds")
    s.add_argument("--backend", choices=("numpy", "cupy"), default="numpy", help="the array library to run on")
    s.set_defaults(func=_run)

    s = sub.add_parser("bench", help="run the benchmarks of a source checkout",
                       description="Run the benchmarks in the source tree's benchmarks/ directory (each in "
                       "its own process; gpu only where CuPy sees a GPU) and show their ratios to the peers "
                       "timed in the same run. Results go to FILE.json, never to benchmarks/results.")
    s.add_argument("names", metavar="NAME", nargs="*", help=f"which ones: {', '.join(BENCHMARKS)} (default: all "
                   "that can run here)")
    s.add_argument("--quick", action="store_true", help="small sizes, few repeats: seconds, not a measurement")
    s.add_argument("-o", "--output", metavar="FILE.json", type=Path, default=Path("qarray-bench.json"),
                   help="where the combined results go (default qarray-bench.json)")
    s.set_defaults(func=_bench)
    return p


def _qdtype(text):
    try:
        return qarray.qdtype(text)
    except TypeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(text):
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _need(module: str, install: str):
    """``module`` imported, or CliError naming what to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise CliError(f"this needs {module.split('.')[0]}: {install}") from None


def _table(title, columns, rows, caption=None, left=1):
    """A rich table (``left`` text columns, then numbers); no text is read as rich markup."""
    _need("rich", "pip install 'qarray[cli]'")
    from rich.markup import escape

    from .examples._common import print_table

    print_table(escape(title), [escape(c) for c in columns], [[escape(str(v)) for v in r] for r in rows],
                caption and escape(caption), left)


# -- files ---------------------------------------------------------------------


def _read(path: Path) -> tuple[bool, dict]:
    """``(written by qarray.save, {name: array or QArray})`` from a .npz, .npy or
    .safetensors file; CliError (status 1) when it cannot be read."""
    suffix = path.suffix.lower()
    if suffix not in (".npz", ".npy", ".safetensors", ".zarr"):
        raise CliError(f"{path}: expected a .npz, .npy or .safetensors file or a .zarr store", 2)
    if suffix == ".zarr":  # a store as quantize writes it: lazy QArrays and arrays
        if not path.is_dir():
            raise CliError(f"{path}: {'a file, not a Zarr store' if path.exists() else 'no such store'}")
        _need("zarr", "pip install 'qarray[dask]'")
        try:
            arrays = qarray.load(path)
        except ValueError as e:
            raise CliError(f"{path}: cannot read it: {_one_line(e)}") from None
        return any(isinstance(a, qarray.QArray) for a in arrays.values()), arrays
    if not path.is_file():
        raise CliError(f"{path}: {'a directory, not a file' if path.is_dir() else 'no such file'}")
    if suffix == ".safetensors":
        _need("safetensors", "pip install safetensors")
    try:
        if suffix == ".safetensors":  # bfloat16 and float8 tensors too, which the safetensors package cannot read
            return (True, qarray.load(path)) if _written_by_qarray(path) else (False, io.st_read(path))
        with open(path, "rb") as fh:  # not numpy's own: it leaves it open when the zip is damaged
            if not fh.read(6).startswith(_MAGIC[suffix]):
                raise CliError(f"{path} is not a {suffix} file: it does not start as one")
            fh.seek(0)
            if suffix == ".npy":
                return False, {path.stem: np.load(fh, allow_pickle=False)}
            with np.load(fh, allow_pickle=False) as f:
                names = f.files
                if not (names and all(io._MEMBER.fullmatch(n + ".npy") for n in names)
                        and any(n.endswith(".meta") for n in names)):
                    arrays = {}
                    for name in names:
                        try:
                            arrays[name] = f[name]
                        except Exception as e:
                            raise CliError(f"{path}: cannot read array {name!r}: {_one_line(e)}") from None
                    return False, arrays
        return True, qarray.load(path)  # its ValueErrors name the file
    except CliError:
        raise
    except ValueError as e:
        raise CliError(str(e) if str(e).startswith(str(path)) else f"{path}: cannot read it: {_one_line(e)}") from None
    except Exception as e:  # numpy, zipfile and safetensors raise many types
        raise CliError(f"{path}: cannot read it: {_one_line(e)}") from None


def _already(path: Path) -> CliError:
    return CliError(f"{path} is already quantized (written by qarray.save); see what it holds with 'qarray inspect'")


def _written_by_qarray(path: Path) -> bool:
    """Whether the .safetensors file ``path`` holds QArrays (qarray.save's metadata)."""
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        return any(io._is_qarray_meta(text) for text in (f.metadata() or {}).values())


def _scheme(q) -> str:
    if q.axis is None:
        return "per-tensor"
    if q.block_size is None:
        return f"per-channel axis {q.axis}"
    short = q.shape[q.axis] % q.block_size
    return f"blocks of {q.block_size} along axis {q.axis}" + (f" (last {short})" if short else "")


def _stored_bytes(q, path: Path) -> int:
    """What the file or store ``path`` holds of ``q``: packed data (all of it in a
    .npz; row by row in a .safetensors file or a .zarr store), scale and zero point."""
    from ._api import packed_layout

    if path.suffix.lower() in (".safetensors", ".zarr"):
        dtype, shape = io.packed_rows_layout(q.dtype, q.shape)
        data = dtype.itemsize * math.prod(shape)
    else:
        dtype, items = packed_layout(q.dtype, q.size)
        data = dtype.itemsize * items
    return data + int(q.scale.nbytes) + int(q.zero_point.nbytes)


def _disk_bytes(path: Path) -> int:
    """The size of a file, or of every file in a store."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def _shape(a) -> str:
    return "x".join(map(str, a.shape)) or "scalar"


# -- info ----------------------------------------------------------------------


def _info(args) -> int:
    _need("rich", "pip install 'qarray[cli]'")
    from rich.console import Console

    rows = [("qarray", qarray.__version__), ("NumPy", np.__version__)]
    status = "probing" + (" (compiling the CUDA kernels takes tens of seconds)" if args.compile else "")
    with Console(stderr=True).status(status):
        rows += [(label, _version(module)) for label, module in
                 (("Numba", "numba"), ("onnxruntime", "onnxruntime"), ("CuPy", "cupy"))]
        rows.append(("backends", _probe(lambda: ", ".join(qarray.backends.available()))))
        rows.append(("CPU int8 GEMM", _probe(qarray.backends.gemm_engine)))
        gpus = _gpus()
        rows += gpus
        rows.append(("CUDA kernels", _probe(lambda: _kernels(gpus[0][2] or "90")) if args.compile else
                     "not compiled here ('qarray info --compile' compiles them with CuPy's NVRTC)"))
    _table("qarray info", ["", "found"], [r[:2] for r in rows], left=2)
    return 0


def _probe(fn) -> str:
    try:
        return fn()
    except Exception as e:
        return f"not available: {_one_line(e)}"


def _version(module: str) -> str:
    try:
        return importlib.import_module(module).__version__
    except ModuleNotFoundError as e:
        if e.name == module:
            return "not installed"
        return f"broken: {_one_line(e)}"
    except Exception as e:
        return f"broken: {_one_line(e)}"


def _gpus() -> list:
    """``[(label, text, compute capability as "90" or None)]``: each GPU CuPy sees,
    or one row saying why there is none."""
    try:
        cupy = qarray.backends.get("cupy").check()
        rows = []
        for i in range(cupy.cuda.runtime.getDeviceCount()):
            p = cupy.cuda.runtime.getDeviceProperties(i)
            name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
            rows.append((f"GPU {i}", f"{name}, compute capability {p['major']}.{p['minor']}",
                         f"{p['major']}{p['minor']}"))
        return rows
    except (ImportError, RuntimeError) as e:  # CupyBackend.check says what is missing
        return [("GPU", f"none: {e}", None)]
    except Exception as e:
        return [("GPU", f"none: {_one_line(e)}", None)]


def _kernels(arch: str) -> str:
    """Compile every kernel file with CuPy's NVRTC for ``compute_<arch>``."""
    from .backends import _cuda

    names = sorted(p.name for p in _cuda.CUDA_DIR.glob("*.cu"))
    for name in names:
        _cuda.compile_ptx(name, arch)
    import cupy

    major, minor = cupy.cuda.nvrtc.getVersion()
    return f"compile: {len(names)} files ({', '.join(names)}), NVRTC {major}.{minor}, compute_{arch}"


# -- quantize ------------------------------------------------------------------


def _quantize(args) -> int:
    if args.block_size is not None and args.observer != "minmax":
        raise CliError(f"--block-size takes --observer minmax only, got {args.observer} (the other observers "
                       "give per-tensor or per-channel parameters)", 2)
    if args.reciprocal and args.dtype.kind == "float":
        raise CliError(f"--reciprocal is PyTorch's rule for integer dtypes; {args.dtype.name} is a floating format", 2)
    lazy = args.output.suffix.lower() in (".zarr", ".safetensors")
    if not lazy and args.output.suffix.lower() != ".npz":
        raise CliError(f"the output must be a .npz or .safetensors file or a .zarr store, got {args.output}", 2)
    if args.scheduler is not None and not lazy:
        raise CliError("--scheduler runs the Dask graphs of a .zarr or .safetensors output; the output here is "
                       ".npz", 2)
    if args.plot is not None and args.plot.suffix.lower() != ".png":
        raise CliError(f"--plot writes a .png file, got {args.plot}", 2)
    _need("rich", "pip install 'qarray[cli]'")
    if args.plot is not None:
        _need("matplotlib", "pip install matplotlib")
    with _staged(args.output) as staging:
        if lazy:
            rows = _quantize_lazily(args, staging)
        else:
            quantized, arrays = _read(args.input)
            if quantized:
                raise _already(args.input)
            _check_axis(arrays, args)
            out, rows = {}, []
            for name, x in _progress(arrays.items(), "quantizing"):
                out[name], row = _quantize_one(name, x, args)
                rows.append(row)
            try:
                qarray.save(staging, out)
            except OSError as e:
                raise CliError(f"cannot write {args.output}: {e.strerror or e}") from None
    before, after = sum(r[-2] for r in rows), sum(r[-1] for r in rows)
    _table(f"{args.input} -> {args.output}", ["name", "shape", "dtype", "scheme", "SQNR dB", "max abs error",
                                                "bytes before", "bytes after"],
           [(*r[:4], "" if r[4] is None else f"{r[4]:.2f}", "" if r[5] is None else f"{r[5]:.4g}", r[6], r[7])
            for r in rows],
           caption=f"{before} -> {after} bytes" + (f" ({after / before:.1%})" if before else "")
           + f" of packed data, scales and zero points; {args.output.name} is {_disk_bytes(args.output)} bytes",
           left=4)
    if args.plot is not None:
        _plot(args.plot, [(r[0], r[4]) for r in rows if r[4] is not None], args)
    return 0


def _progress(items, description):
    """``items``, with rich's progress bar on a terminal (elsewhere the bar is no
    use, and rich leaves a blank line on stdout when it stops)."""
    from rich.console import Console
    from rich.progress import track

    return track(items, description=description, transient=True) if Console().is_terminal else items


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def _staged(out: Path):
    """A path beside ``out``, with its suffix, to write the output to: renamed
    onto ``out`` when the block succeeds (an existing ``out`` replaced only then:
    a link to the input is replaced, not written through), removed when it fails."""
    if not out.parent.is_dir():
        raise CliError(f"cannot write {out}: No such file or directory")
    if out.is_dir() != (out.suffix.lower() == ".zarr") and out.exists():
        raise CliError(f"cannot write {out}: it is a {'directory' if out.is_dir() else 'file'}; remove it first")
    staging = out.with_name(f".{out.stem}.qarray-{os.getpid()}{out.suffix}")
    _remove(staging)
    try:
        yield staging
        if out.is_dir() and not out.is_symlink():  # a store: the old one aside, the new one in, the old one gone
            old = out.with_name(f".{out.stem}.qarray-old-{os.getpid()}{out.suffix}")
            os.replace(out, old)
            os.replace(staging, out)
            _remove(old)
        else:
            os.replace(staging, out)
    except OSError as e:
        raise CliError(f"cannot write {out}: {e.strerror or e}") from None
    finally:
        _remove(staging)


def _lazy_arrays(path: Path):
    """``{name: dask array}`` of IN, read chunk by chunk (a .safetensors tensor slice
    by slice from its memory map, a .npy memory-mapped; a .npz member in memory)."""
    da = _need("dask.array", "pip install 'qarray[dask]'")
    suffix = path.suffix.lower()
    if suffix == ".safetensors" and path.is_file():
        _need("safetensors", "pip install safetensors")
        try:
            if _written_by_qarray(path):
                raise _already(path)
            return io.st_lazy(path)
        except CliError:
            raise
        except Exception as e:
            raise CliError(f"{path}: cannot read it: {_one_line(e)}") from None
    if suffix == ".npy" and path.is_file():
        try:
            return {path.stem: da.from_array(np.load(path, mmap_mode="r", allow_pickle=False), chunks="auto")}
        except Exception as e:
            raise CliError(f"{path}: cannot read it: {_one_line(e)}") from None
    quantized, arrays = _read(path)
    if quantized:
        raise _already(path)
    return {name: da.from_array(x, chunks="auto") for name, x in arrays.items()}


def _quantize_lazily(args, target: Path) -> list:
    """Quantize IN into ``target`` (OUT's staging path) tensor by tensor, each
    computed chunk by chunk as it is written: a Zarr store (``qarray.zarr``: a
    group per quantized tensor, an array per tensor passed through) or a
    .safetensors file (``qarray.save``, which streams Dask data into its place in
    the file); the table's rows."""
    import contextlib

    dask = _need("dask", "pip install 'qarray[dask]'")
    zarr = _need("zarr", "pip install 'qarray[dask]'")
    from .zarr import to_zarr

    with dask.config.set({"array.chunk-size": "4MiB"}):  # a few such chunks in flight per thread: bounded memory
        arrays = _lazy_arrays(args.input)
    if args.scheduler in (None, "threads", "processes"):
        ctx = dask.config.set(scheduler=args.scheduler or "threads")
    else:
        distributed = _need("distributed", "pip install 'qarray[dask]'")
        try:
            ctx = distributed.Client(args.scheduler, timeout=30)
        except (OSError, ValueError) as e:
            raise CliError(f"--scheduler {args.scheduler}: cannot reach it: {_one_line(e)}") from None
    _check_axis(arrays, args)
    rows, out = [], {}
    to_file = args.output.suffix.lower() == ".safetensors"
    with ctx if isinstance(ctx, contextlib.AbstractContextManager) else contextlib.closing(ctx):
        try:
            root = None if to_file else zarr.open_group(target, mode="w-")
        except Exception as e:
            raise CliError(f"cannot write {args.output}: {_one_line(e)}") from None
        for name, x in _progress(arrays.items(), "quantizing"):
            q, row = _quantize_one(name, x, args)
            if to_file:
                out[name] = q  # written at the end, each tensor chunk by chunk into its place in the file
            elif isinstance(q, qarray.QArray):
                to_zarr(q, target / name)
            else:
                dask.array.store(q, root.create_array(name, shape=q.shape, chunks=q.chunksize, dtype=q.dtype), lock=False)
            rows.append(row)
        if to_file:
            try:
                qarray.save(target, out)
            except OSError as e:
                raise CliError(f"cannot write {args.output}: {e.strerror or e}") from None
    return rows


def _quantize_one(name, x, args):
    """``(what to save, (name, shape, dtype, scheme, sqnr, max error, bytes before, bytes after))``."""
    floating = _floating(x)
    skip = next((p for p in args.skip if fnmatch.fnmatchcase(name, p)), None)
    if x.dtype.kind in "biu" or (floating and x.size == 0) or skip is not None:
        why = f"skipped (--skip {skip})" if skip is not None else "passed through" + (" (empty)" if floating else "")
        return x, (name, _shape(x), str(x.dtype), why, None, None, x.nbytes, x.nbytes)
    before = x.nbytes
    if is_small_float(x.dtype):
        x = x.astype(np.float32)
    if x.dtype.kind != "f":
        raise CliError(f"{args.input}: {name!r} has dtype {x.dtype}: quantize takes float arrays "
                       "(and passes integer and bool arrays through)")
    # blocks run along --per-channel AXIS, else along axis 1: a weight's input channels ((out, in) or
    # (out, in, kh, kw)), the axis its dot products sum over (the last axis of a conv weight is its kernel's width)
    axis, note = _axis(x.ndim, (1 if x.ndim >= 2 else -1) if args.per_channel is None and args.block_size
                       else args.per_channel)
    if x.ndim == 1 and args.per_channel is not None and args.block_size is None:
        axis, note = None, " (1-d)"  # a scale per element of a bias: more bytes than the floats
    try:
        if args.block_size is not None and axis is not None:
            q = qarray.quantize_dynamic(x, args.dtype, symmetric=args.symmetric, axis=axis,
                                        block_size=args.block_size, reciprocal=args.reciprocal)
        else:
            from .observers import observer

            obs = observer(args.observer, args.dtype, symmetric=args.symmetric, axis=axis).update(x)
            q = obs.quantize(x, reciprocal=args.reciprocal)
    except (TypeError, ValueError) as e:
        raise CliError(f"{args.input}: cannot quantize {name!r}: {_one_line(e)}") from None
    sqnr, err = _errors(x, q)
    return q, (name, _shape(x), q.dtype.name, _scheme(q) + note, sqnr, err, before, _stored_bytes(q, args.output))


def _floating(x) -> bool:
    """Whether ``x`` holds floats to quantize: NumPy's, or ml_dtypes' bfloat16 and
    float8 (their float32 values, exactly)."""
    return x.dtype.kind == "f" or is_small_float(x.dtype)


def _check_axis(arrays, args) -> None:
    """``--per-channel AXIS``: an axis that no float tensor has is an error (it
    would quantize every one per tensor); the tensors that lack it are named on
    stderr (they are quantized per tensor, as the table says)."""
    if args.per_channel is None:
        return
    floats = {name: x.ndim for name, x in arrays.items() if _floating(x)
              and x.ndim != 1 and not any(fnmatch.fnmatchcase(name, p) for p in args.skip)}
    lacking = [f"{name} ({ndim}-d)" for name, ndim in floats.items() if _axis(ndim, args.per_channel)[0] is None]
    if floats and len(lacking) == len(floats):
        raise CliError(f"--per-channel {args.per_channel}: no float tensor of {args.input} has that axis (they have "
                       f"{min(floats.values())} to {max(floats.values())} dimensions)", 2)
    if lacking:
        print(f"qarray: note: --per-channel {args.per_channel}: per tensor for {len(lacking)} tensor(s) without that "
              f"axis: {', '.join(lacking[:5])}{', ...' if len(lacking) > 5 else ''}", file=sys.stderr)


def _axis(ndim: int, axis):
    """``(axis as a non-negative int or None, note for the table)``."""
    if axis is None:
        return None, ""
    if -ndim <= axis < ndim:
        return axis % ndim, ""
    return None, f" ({'scalar' if ndim == 0 else f'{ndim}-d'}: no axis {axis})"


def _error_sums(x, d):
    """``[sum x^2, sum (x - d)^2, max |x - d|]`` in float64 (one chunk's, or all)."""
    x = x.astype(np.float64)
    e = x - d.astype(np.float64)
    return np.array([np.sum(x * x), np.sum(e * e), np.max(np.abs(e), initial=0.0)])


def _errors(x, q):
    """SQNR in dB, ``10 log10(sum x^2 / sum (x - q.dequantize())^2)`` (inf when
    exact), and the largest absolute error, both in float64; of dask arrays chunk
    by chunk (each chunk's three numbers, then their sums and maximum)."""
    if is_lazy(x):
        parts = x.map_blocks(lambda a, b: _error_sums(a, b).reshape((1,) * a.ndim + (3,)), q.dequantize(),
                             new_axis=x.ndim, chunks=(1,) * x.ndim + (3,), dtype=np.float64).reshape(-1, 3)
        import dask

        both, most = dask.compute(parts[:, :2].sum(axis=0), parts[:, 2].max())
        sums = (both[0], both[1], most)
    else:
        sums = _error_sums(x, q.dequantize())
    signal, noise, most = (float(v) for v in sums)
    if noise == 0:
        return math.inf, 0.0
    return (10 * math.log10(signal / noise) if signal else -math.inf), most


def _plot(path: Path, sqnr, args) -> None:
    """A bar per quantized array: its SQNR (an exact one is drawn at 0, labelled inf)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(4.0, 0.5 * len(sqnr) + 2), 4), layout="constrained")
    ax = fig.subplots()
    names = [n for n, _ in sqnr]
    bars = ax.bar(range(len(names)), [v if math.isfinite(v) else 0 for _, v in sqnr])
    ax.bar_label(bars, labels=[f"{v:.1f}" for _, v in sqnr])
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right")
    ax.set_ylabel("SQNR (dB)")
    ax.set_title(f"{args.input.name}: {args.dtype.name}, {args.observer}"
                 + (" symmetric" if args.symmetric else ""))
    try:
        fig.savefig(path)
    except OSError as e:
        raise CliError(f"cannot write {path}: {e.strerror or e}") from None


# -- inspect -------------------------------------------------------------------


def _inspect(args) -> int:
    _need("rich", "pip install 'qarray[cli]'")
    quantized, arrays = _read(args.file)
    if not quantized:
        _table(str(args.file), ["name", "shape", "dtype", "bytes"],
               [(n, _shape(a), str(a.dtype), a.nbytes) for n, a in arrays.items()], left=3)
        return 0
    rows = []
    for name, q in arrays.items():
        if not isinstance(q, qarray.QArray):  # a NumPy array, or a Zarr store's dask array
            rows.append((name, _shape(q), str(q.dtype), "plain array", "", "", q.nbytes))
            continue
        s, z = to_host(q.scale), to_host(q.zero_point)
        rows.append((name, _shape(q), q.dtype.name, _scheme(q), _span(s, "{:.6g}"), _span(z, "{}"), _stored_bytes(q, args.file)))
    _table(f"{args.file} (qarray file)", ["name", "shape", "dtype", "scheme", "scale", "zero point", "stored bytes"],
           rows, left=4)
    return 0


def _span(a, fmt) -> str:
    lo, hi = a.min(), a.max()
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)} .. {fmt.format(hi)}"


# -- examples, run -------------------------------------------------------------


def _examples(args) -> int:
    from . import examples

    rows = [(name, importlib.import_module(f"qarray.examples.{name}").__doc__.strip().splitlines()[0])
            for name in examples.NAMES]
    _table("qarray examples", ["name", "description"], rows,
           caption="run one: qarray run NAME [--quick] [--backend numpy|cupy]", left=2)
    return 0


def _run(args) -> int:
    from . import examples

    if args.name not in examples.NAMES:
        which = f"unknown example {args.name!r}" if args.name else "run needs the NAME of an example"
        raise CliError(f"{which}; the examples are {', '.join(examples.NAMES)}", 2)
    argv = ["--backend", args.backend] + ["--quick"] * args.quick
    from .examples import _common

    token = _common.FROM_CLI.set(True)  # what the example lacks comes back as this command's error
    try:
        return importlib.import_module(f"qarray.examples.{args.name}").main(argv)
    except _common.Unavailable as e:
        raise CliError(str(e)) from None
    finally:
        _common.FROM_CLI.reset(token)


# -- bench ---------------------------------------------------------------------


def _benchmarks_dir() -> Path:
    return Path(qarray.__file__).resolve().parents[1] / "benchmarks"


def _bench(args) -> int:
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        raise CliError(f"unknown benchmark {unknown[0]!r}; the benchmarks are {', '.join(BENCHMARKS)}", 2)
    if args.output.suffix.lower() != ".json":
        raise CliError(f"the output must be a .json file, got {args.output}", 2)
    root = _benchmarks_dir()
    if not (root / BENCHMARKS["core"]).is_file():
        raise CliError(f"no benchmarks at {root}: 'qarray bench' runs from a source checkout "
                       "(git clone, then pip install -e .), not from an installed wheel")
    _need("rich", "pip install 'qarray[cli]'")
    names = args.names or list(BENCHMARKS)
    if "gpu" in names:
        _, why, arch = _gpus()[0]
        if arch is None and args.names:
            raise CliError(f"the gpu benchmark needs a GPU ({why})")
        if arch is None:
            names.remove("gpu")
    from rich.console import Console

    results = {}
    with tempfile.TemporaryDirectory() as out:
        for name in names:
            script = root / BENCHMARKS[name]
            with Console(stderr=True).status(f"running {script.name}{' --quick' if args.quick else ''}"):
                r = subprocess.run([sys.executable, str(script), out] + ["--quick"] * args.quick,
                                   capture_output=True, text=True)
            if r.returncode:
                last = (r.stderr.strip() or r.stdout.strip() or "no output").splitlines()[-1]
                raise CliError(f"{script.name} failed (exit status {r.returncode}): {last}")
            results[script.stem] = json.loads((Path(out) / f"{script.stem}.json").read_text())
    try:
        args.output.write_text(json.dumps({"quick": args.quick, "results": results}, indent=1) + "\n")
    except OSError as e:
        raise CliError(f"cannot write {args.output}: {e.strerror or e}") from None
    rows = [row for stem, result in results.items() for row in _ratios(stem, result["rows"])]
    _table("qarray bench" + (" --quick" if args.quick else ""), ["op", "shape", "qarray vs peer", "ratio", "target",
                                                                 "met"], rows,
           caption=f"ratio: time / the peer's time (gpu: bandwidth / a device copy's); all results in {args.output}"
           + ("; --quick: small sizes, not a measurement" if args.quick else ""), left=3)
    return 0


def _ratios(stem: str, rows):
    """The table rows of one benchmark's JSON rows: ``(op, shape, who vs whom,
    ratio, target, met)``, for the rows that have a ratio."""
    met = {True: "yes", False: "no", None: "", "yes": "yes", "no": "no"}
    for r in rows:
        if stem == "bench_gpu":
            who, ratio, target = "qarray vs device copy", r["fraction_of_copy"], r["target"] and f">= {r['target']}"
        elif stem == "bench_ops":
            who, ratio, target = f"{r['who']} vs {r['ref']}", r["ratio"], r["target"] and f"<= {r['target']}"
        else:
            who, ratio, target = f"qarray vs {r['peer']}", r["ratio"], r["target"] and f"<= {r['target']}"
        if ratio is not None:
            yield r["op"], r["shape"], who, f"{ratio:.3f}", target or "", met[r["met"]]
