"""``qarray quantize IN -o OUT``: quantize the float arrays of a file.

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

With ``--dtype`` a GGUF type (``Q4_K``, ``Q8_0``, ...: blocks along the last
axis, parameters of their own) OUT is a .gguf file: every float tensor of two
or more dimensions whose rows are whole blocks is quantized, as llama.cpp's
``llama-quantize`` does (the others, 1-d norms and biases among them, are
written as they are); IN may be a GGUF file too, whose metadata (the
tokenizer, everything) is kept and whose tensors of other GGUF types are
dequantized and quantized again (those of the type asked for are kept byte
for byte). ``--imatrix FILE`` (llama.cpp's importance matrix, llama-imatrix's
.gguf or .dat) quantizes the tensors it names with their importance, a 3-d
tensor of experts each expert with its own row, as ``llama-quantize
--imatrix`` does: the same bytes (benchmarks/check_lm_imatrix.py).

``quantize`` writes OUT (.npz, .safetensors, .gguf or a .zarr store) under a temporary
name beside it and renames it into place only when every tensor is written: a
run that fails or is interrupted leaves no partial output and an existing OUT
as it was; an existing OUT is replaced by a run that succeeds; OUT may be IN
itself, or a link to it (IN is read from its own file to the end).
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import os
import shutil
import sys
from pathlib import Path

import numpy as np

import qarray
from .. import io
from .._params import is_lazy, is_small_float
from ..io.zarr import to_zarr
from ..observers import observer
from ._files import _already, _read, _read_gguf, _scheme, _stored_bytes, _written_by_qarray
from ._shared import CliError, _need, _one_line, _shape, _table


def quantize(args) -> int:
    if args.block_size is not None and args.observer != "minmax":
        raise CliError(f"--block-size takes --observer minmax only, got {args.observer} (the other observers "
                       "give per-tensor or per-channel parameters)", 2)
    if args.reciprocal and args.dtype.kind == "float":
        raise CliError(f"--reciprocal is PyTorch's rule for integer dtypes; {args.dtype.name} is a floating format", 2)
    lazy = args.output.suffix.lower() in (".zarr", ".safetensors")
    to_gguf = args.output.suffix.lower() == ".gguf"
    if args.imatrix is not None and not (args.dtype.kind == "block" and args.dtype.layout.takes_importance):
        raise CliError(f"--imatrix weights the search of GGUF types that take an importance matrix (Q2_K .. Q6_K, "
                       f"IQ4_NL, IQ4_XS, ...); --dtype {args.dtype.name} does not", 2)
    if (args.dtype.kind == "block") != to_gguf:
        raise CliError(f"--dtype {args.dtype.name} is a GGUF type: the output must be a .gguf file" if not to_gguf
                       else f"a .gguf output holds GGUF's types: --dtype Q8_0, Q4_K, ... (got {args.dtype.name})", 2)
    if not lazy and not to_gguf and args.output.suffix.lower() != ".npz":
        raise CliError(f"the output must be a .npz, .safetensors or .gguf file or a .zarr store, got {args.output}", 2)
    given = [o for o, v in (("--per-channel", args.per_channel), ("--block-size", args.block_size),
                            ("--symmetric", args.symmetric or None), ("--reciprocal", args.reciprocal or None),
                            ("--scheduler", args.scheduler)) if v is not None]
    if to_gguf and (given or args.observer != "minmax"):
        raise CliError(f"{args.dtype.name} chooses its own parameters, block by block: drop "
                       f"{', '.join(given) or '--observer'}", 2)
    if args.scheduler is not None and not lazy:
        raise CliError("--scheduler runs the Dask graphs of a .zarr or .safetensors output; the output here is "
                       ".npz", 2)
    if args.plot is not None and args.plot.suffix.lower() != ".png":
        raise CliError(f"--plot writes a .png file, got {args.plot}", 2)
    _need("rich", "pip install 'qarray[cli]'")
    if args.plot is not None:
        _need("matplotlib", "pip install matplotlib")
    with _staged(args.output) as staging:
        if to_gguf:
            rows = _quantize_to_gguf(args, staging)
        elif lazy:
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


def _process_pool(dask):
    """The processes of ``--scheduler processes``, started once for the whole run: Dask's
    scheduler, given no pool, starts one for each compute, so every tensor's graphs spawned
    new processes, each importing qarray again. Set up as Dask sets up its own (its context,
    a fixed str hash seed, a fresh NumPy random state in each process)."""
    import concurrent.futures

    import dask.multiprocessing

    if os.environ.get("PYTHONHASHSEED") in (None, "0"):
        os.environ["PYTHONHASHSEED"] = "6640"  # as dask.multiprocessing.get does
    return concurrent.futures.ProcessPoolExecutor(dask.config.get("num_workers", None) or dask.system.CPU_COUNT,
                                                  mp_context=dask.multiprocessing.get_context(),
                                                  initializer=dask.multiprocessing.initialize_worker_process)


def _quantize_lazily(args, target: Path) -> list:
    """Quantize IN into ``target`` (OUT's staging path) tensor by tensor, each
    computed chunk by chunk as it is written: a Zarr store (``qarray.zarr``: a
    group per quantized tensor, an array per tensor passed through) or a
    .safetensors file (``qarray.save``, which streams Dask data into its place in
    the file); the table's rows."""
    dask = _need("dask", "pip install 'qarray[dask]'")
    zarr = _need("zarr", "pip install 'qarray[dask]'")

    with dask.config.set({"array.chunk-size": "4MiB"}):  # a few such chunks in flight per thread: bounded memory
        arrays = _lazy_arrays(args.input)
    if args.scheduler == "processes":
        ctx = contextlib.ExitStack()
        pool = ctx.enter_context(_process_pool(dask))
        ctx.enter_context(dask.config.set(scheduler="processes", pool=pool))
    elif args.scheduler in (None, "threads"):
        ctx = dask.config.set(scheduler="threads")
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


def _quantize_to_gguf(args, target: Path) -> list:
    """Quantize IN's tensors to ``--dtype`` (a GGUF type) into the GGUF file ``target``; the table's rows."""
    f = args.dtype.layout
    if args.input.suffix.lower() == ".gguf":
        tensors, meta = _read_gguf(args.input)
    else:
        quantized, tensors = _read(args.input)
        if quantized:
            raise _already(args.input)
        meta = {}
    importance = _importance(args.imatrix) if args.imatrix is not None else {}
    out, rows = {}, []
    for name, x in _progress(tensors.items(), "quantizing"):
        skip = next((p for p in args.skip if fnmatch.fnmatchcase(name, p)), None)
        block = isinstance(x, qarray.QArray)
        why = (f"skipped (--skip {skip})" if skip is not None else
               f"kept ({x.dtype.name})" if block and x.dtype is args.dtype else
               "passed through" if not block and not _floating(x) else
               "kept (1-d)" if x.ndim < 2 else
               f"kept (rows of {x.shape[-1]}, not whole blocks of {f.block})" if x.shape[-1] % f.block else None)
        dtype = x.dtype.name if block else str(x.dtype)
        if why is not None:
            out[name] = x
            rows.append((name, _shape(x), dtype, why, None, None, x.nbytes, x.nbytes))
            continue
        xf = x.dequantize() if block else x.astype(np.float32, copy=False)
        try:
            out[name] = _weighted(xf, args.dtype, importance.get(name), name, args.imatrix)
        except ValueError as e:
            raise CliError(f"{args.input}: cannot quantize {name!r}: {_one_line(e)}") from None
        sqnr, err = _errors(xf, out[name])
        rows.append((name, _shape(x), args.dtype.name, f"blocks of {f.block} along the last axis"
                     + (f" (from {dtype})" if block else "") + (", imatrix" if name in importance else ""),
                     sqnr, err, x.nbytes, out[name].nbytes))
    try:
        qarray.save(target, out, metadata=meta)
    except OSError as e:
        raise CliError(f"cannot write {args.output}: {e.strerror or e}") from None
    except (TypeError, ValueError) as e:
        raise CliError(f"cannot write {args.output}: {_one_line(e)}") from None
    return rows


def _importance(path: Path) -> dict:
    """``{tensor: importance}`` of llama.cpp's imatrix file ``path``, as llama-quantize reads it."""
    try:
        return io.imatrix.load(path)
    except OSError as e:
        raise CliError(f"cannot read --imatrix {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise CliError(f"--imatrix {path}: {_one_line(e)}") from None


def _weighted(x, dtype, importance, name, path):
    """``x`` quantized to GGUF type ``dtype`` with ``importance`` (None: without): one vector for the
    rows of a 2-d weight, one an expert (a row of ``importance``) for a 3-d one, as llama-quantize
    applies them."""
    if importance is None:
        return qarray.quantize(x, dtype=dtype)
    k, experts = x.shape[-1], x.shape[0] if x.ndim == 3 else 1
    if x.ndim > 3 or importance.size != experts * k:
        raise ValueError(f"--imatrix {path} holds {importance.size} values for it, where its shape "
                         f"{_shape(x)} takes {experts * k}" + (f" ({experts} experts of {k})" if experts > 1 else ""))
    if x.ndim < 3:
        return qarray.quantize(x, dtype=dtype, importance=importance.reshape(k))
    per = importance.reshape(experts, k)
    raw = np.stack([qarray.quantize(x[e], dtype=dtype, importance=per[e]).data for e in range(experts)])
    return qarray.QArray._blocks(raw, dtype)


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


def _disk_bytes(path: Path) -> int:
    """The size of a file, or of every file in a store."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
