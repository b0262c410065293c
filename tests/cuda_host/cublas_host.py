"""A stand-in for CuPy's ``cupy.cuda.cublas`` module with the one call the CuPy
backend makes: ``gemmEx`` for int8 x int8 -> int32 (``CUBLAS_COMPUTE_32I``), on
host memory, under cuBLAS's rules: column-major operands at the addresses given,
``op(A)`` m x k and ``op(B)`` k x n, C m x n; the alignment rules of the
integer GEMM (pointers 4-byte aligned, m, k, lda, ldb, ldc multiples of 4)
refused as cuBLAS refuses them; int32 sums that wrap as the hardware's do (so a
missing K split shows as a wrong answer, not a kind one).
"""

from __future__ import annotations

import ctypes

import numpy as np

CUDA_R_8I, CUDA_R_32I, CUBLAS_COMPUTE_32I = 3, 10, 72
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
calls = []  # (m, n, k) of every call, for tests that count them


class CUBLASError(RuntimeError):
    pass


def _view(ptr, dtype, count):
    return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(np.ctypeslib.as_ctypes_type(dtype))), (count,))


def _operand(ptr, op, rows, cols, ld, name):
    """``op(X)``, rows x cols, of the column-major int8 matrix X at ``ptr``."""
    stored_rows, stored_cols = (rows, cols) if op == CUBLAS_OP_N else (cols, rows)
    if ld < max(1, stored_rows):
        raise CUBLASError(f"CUBLAS_STATUS_INVALID_VALUE: ld{name} = {ld} < {stored_rows}")
    x = _view(ptr, np.int8, (stored_cols - 1) * ld + stored_rows).astype(np.int64)
    x = np.lib.stride_tricks.as_strided(x, (stored_rows, stored_cols), (8, 8 * ld))
    return x if op == CUBLAS_OP_N else x.T


def gemmEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
           computeType, algo):
    if (Atype, Btype, Ctype, computeType) != (CUDA_R_8I, CUDA_R_8I, CUDA_R_32I, CUBLAS_COMPUTE_32I):
        raise CUBLASError("CUBLAS_STATUS_NOT_SUPPORTED: the stand-in has int8 x int8 -> int32 only")
    if transa not in (CUBLAS_OP_N, CUBLAS_OP_T) or transb not in (CUBLAS_OP_N, CUBLAS_OP_T):
        raise CUBLASError("CUBLAS_STATUS_INVALID_VALUE: transa / transb")
    if any(p % 4 for p in (A, B, C)) or any(v % 4 for v in (m, k, lda, ldb, ldc)):
        raise CUBLASError(f"CUBLAS_STATUS_NOT_SUPPORTED: int8 GEMM needs 4-byte aligned pointers and m, k, lda, "
                          f"ldb, ldc multiples of 4 (m={m} k={k} lda={lda} ldb={ldb} ldc={ldc})")
    if min(m, n, k) < 0 or ldc < max(1, m):
        raise CUBLASError(f"CUBLAS_STATUS_INVALID_VALUE: m={m} n={n} k={k} ldc={ldc}")
    calls.append((m, n, k))
    a, b = _operand(A, transa, m, k, lda, "a"), _operand(B, transb, k, n, ldb, "b")
    al, be = int(_view(alpha, np.int32, 1)[0]), int(_view(beta, np.int32, 1)[0])
    c = _view(C, np.int32, (n - 1) * ldc + m) if n else None
    if c is None or m == 0:
        return
    cm = np.lib.stride_tricks.as_strided(c, (m, n), (4, 4 * ldc))
    acc = al * (a @ b) + (be * cm.astype(np.int64) if be else 0)
    cm[...] = acc.astype(np.int32)  # wraps, as int32 arithmetic on the device
