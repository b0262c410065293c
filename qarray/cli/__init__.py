"""The ``qarray`` command: ``info``, ``quantize``, ``convert``, ``inspect``,
``examples``, ``run`` and ``bench``; the parser is here, each command in its module (``examples`` and
``run`` in one).

    qarray info
    qarray quantize model.safetensors -o model-q.npz --dtype qint8 --per-channel 0 --symmetric
    qarray quantize model.npz -o model-q4.npz --dtype qint4 --block-size 32
    qarray inspect model-q.npz
    qarray quantize model-f16.gguf -o model-q4_k.gguf --dtype Q4_K
    qarray convert Llama-GPTQ/ -o llama-q4_0.gguf
    qarray convert model.gguf -o model-mlx/ --to mlx
    qarray examples
    qarray run digits --quick
    qarray bench --quick

Tables and progress bars come from rich (``pip install 'qarray[cli]'``), imported
when a command runs: ``import qarray`` imports neither rich nor this package.
Every error is one line on stderr, ``qarray: error: ...``: exit status 2 for a
usage error; 1 for a file that cannot be read or written, a missing optional
package, or an example or benchmark that fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import qarray
from . import bench, convert, examples, info, inspect, quantize
from ._shared import CliError, _one_line
from .bench import BENCHMARKS

__all__ = ["main"]

OBSERVERS = ("minmax", "moving_average", "percentile", "mse", "entropy")


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
    s.set_defaults(func=info.info)

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
    s.add_argument("--dtype", type=_qdtype, default="qint8",
                   help="quantized dtype (default qint8); a GGUF type (Q8_0, Q4_K, IQ4_XS, ...) writes a .gguf file")
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
    s.add_argument("--imatrix", metavar="FILE", type=Path,
                   help="llama.cpp's importance matrix (llama-imatrix's .gguf or .dat file) for a GGUF --dtype that "
                        "takes one (Q2_K .. Q6_K, IQ4_NL, IQ4_XS, ...): the tensors it names are quantized with it, as "
                        "llama-quantize --imatrix does (ggml's weighted search, the same bytes); the others without")
    s.add_argument("--plot", metavar="FILE.png", type=Path, help="also draw the SQNR per array (needs matplotlib)")
    s.set_defaults(func=quantize.quantize)

    s = sub.add_parser("convert", help="a quantized checkpoint in another format (GGUF, compressed-tensors, MLX, "
                       "GPTQ), code for code", description="Write the quantized checkpoint IN (a .gguf file or a "
                       "Hugging Face checkpoint directory: GPTQ, AWQ, bitsandbytes, compressed-tensors, MLX, ModelOpt) "
                       "as OUT: a .gguf file, or a directory in the convention --to names. Each quantized tensor "
                       "goes into the first of OUT's formats that holds its codes and parameters exactly; one that "
                       "none holds is an error naming it, unless --requantize DTYPE quantizes it again (the table "
                       "shows its SQNR). Other tensors, names and metadata are kept.")
    s.add_argument("input", metavar="IN", type=Path, help="a .gguf file or a Hugging Face checkpoint directory")
    s.add_argument("-o", "--output", metavar="OUT", type=Path, required=True,
                   help="a .gguf file, or a directory (with --to); written beside its place and renamed into it")
    s.add_argument("--to", choices=convert.TARGETS, help="the convention of a directory output")
    s.add_argument("--requantize", metavar="DTYPE",
                   help="quantize the tensors that do not carry over exactly again, to DTYPE (a GGUF type for a "
                        ".gguf output, else a format of --to's: int4_g128_f16, uint4_g64_bf16_bias, ...)")
    s.set_defaults(func=convert.convert)
    s = sub.add_parser("inspect", help="what a .npz, .npy, .safetensors or .gguf file or a checkpoint directory "
                       "holds", description="The arrays of FILE: for a qarray file, each one's dtype, scheme, "
                       "scales, zero points and stored bytes; for a GGUF file, its metadata and each tensor's ggml "
                       "type, shape and bits per weight; for a Hugging Face checkpoint directory (GPTQ, AWQ, "
                       "bitsandbytes, compressed-tensors, MLX, ModelOpt), each quantized weight's format, shape and "
                       "bits per weight; for other files, name, shape and dtype.")
    s.add_argument("file", metavar="FILE", type=Path)
    s.set_defaults(func=inspect.inspect)

    s = sub.add_parser("examples", help="list the examples", description="The examples that 'qarray run' runs.")
    s.set_defaults(func=examples.examples)

    s = sub.add_parser("run", help="run an example", description="Run example NAME (see 'qarray examples'), "
                       "as python -m qarray.examples.NAME does.")
    s.add_argument("name", metavar="NAME", nargs="?", help="which example")
    s.add_argument("--quick", action="store_true", help="a smaller run, a few seconds")
    s.add_argument("--backend", choices=("numpy", "cupy"), default="numpy", help="the array library to run on")
    s.set_defaults(func=examples.run)

    s = sub.add_parser("bench", help="run the benchmarks of a source checkout",
                       description="Run the benchmarks in the source tree's benchmarks/ directory (each in "
                       "its own process; gpu only where CuPy sees a GPU) and show their ratios to the peers "
                       "timed in the same run. Results go to FILE.json, never to benchmarks/results.")
    s.add_argument("names", metavar="NAME", nargs="*", help=f"which ones: {', '.join(BENCHMARKS)} (default: all "
                   "that can run here)")
    s.add_argument("--quick", action="store_true", help="small sizes, few repeats: seconds, not a measurement")
    s.add_argument("-o", "--output", metavar="FILE.json", type=Path, default=Path("qarray-bench.json"),
                   help="where the combined results go (default qarray-bench.json)")
    s.set_defaults(func=bench.bench)
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
