"""qarray's CPU kernels, compiled by Numba, with LLVM IR where Numba's loops
cannot emit the instruction. ``NumpyBackend`` (``qarray/backends/numpy.py``)
calls them; this package (which imports Numba) is imported when a primitive
first runs on Numba, with the elementwise families; ``gemm`` and ``blocks``
when theirs first run.

- :mod:`.pool`: the threads (:func:`.pool.parallel` splits a kernel's tasks
  among them) and how a kernel is compiled (:data:`.pool.kernel`);
- :mod:`.isa`: which instruction sets this process may use, each of which a
  test can force off;
- :mod:`.llvm`: every LLVM IR helper of the kernel modules below but the
  GEMM's blocks, each gated by :mod:`.isa` and with a portable twin;
- one module a kernel family: :mod:`.quantize` (and dequantize, floating
  formats), :mod:`.requantize` (and the integer arithmetic the others
  inline), :mod:`.elementwise` (binary ops, lut), :mod:`.softmax`,
  :mod:`.gemm` (the int8 GEMM with the exact epilogue fused into each block's
  store, the epilogue alone, packed 4-bit small M, conv2d) and :mod:`.blocks`
  (block formats: dequantize and linear).
"""

from . import elementwise, isa, pool, quantize, requantize, softmax  # noqa: F401 (cpu.pool ...)
