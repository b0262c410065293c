"""qarray's own CPU kernels, compiled by Numba, with LLVM IR where Numba's loops
cannot emit the instruction (AMX tiles, VNNI dot products).

- :mod:`.isa`: which instruction sets this process may use, each of which a
  test can force off;
- :mod:`.gemm`: the int8 GEMM (u8 x s8 products in 32 x 32 blocks) with the
  exact epilogue fused into each block's store.
"""
