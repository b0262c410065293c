"""Writes tests/data/ggml/kquants.npz: ggml's own quantized bytes for the K-quants and IQ4
types, the independent reference of tests/test_kquants.py (qarray/_kquants.py).

Source: llama-cpp-python 0.3.36 (sdist from PyPI), vendored llama.cpp at commit
0c1e57098bba43ac29e6e3b677cdceebdd22334f (ggml 0.25.3). Only the ``ggml-base`` shared library
is built (it holds ggml.c's ``ggml_quantize_chunk`` and ggml-quants.c), x86-64, GCC 12.2, with
floating-point contraction off, so that no FMA can change a rounding:

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/lcp
    tar xzf /tmp/lcp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcp
    L=/tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -S $L -B /tmp/ggml-build -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \\
        -DCMAKE_C_FLAGS=-ffp-contract=off -DCMAKE_CXX_FLAGS=-ffp-contract=off \\
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \\
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_CURL=OFF
    cmake --build /tmp/ggml-build --config Release --target ggml-base -j2

(configured from the llama.cpp top level: the sdist's ggml/ lacks the tests/, examples/ and
ggml.pc.in that a standalone ggml configure wants). Then rerun with

    python tests/data/ggml/make_vectors.py /tmp/ggml-build/bin/libggml-base.so

(only NumPy is needed; written with NumPy 2.4.6, and a rerun gives the same arrays).

Without an importance matrix the bytes are ``ggml_quantize_chunk(type, x, dst, 0, nrows, 256,
NULL)``: the K-types run ``quantize_row_q*_K_ref`` and IQ4_NL/IQ4_XS run ``quantize_iq4_nl`` /
``quantize_iq4_xs`` (ntry=7). Stored per type T (q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl, iq4_xs, and
q8_k: quantize_row_q8_K_ref's bytes, the activations of the K-quants' dot products), 53 rows each:
  T_x      float32 (rows, 256): the input rows (IQ4_NL: 8 blocks of 32 per row)
  T_bytes  uint8 (rows, row_size): ggml's quantized rows
  T_deq    float32 (rows, 256): ggml's dequantization of T_bytes (the type traits' to_float),
           to check a decoder of the bytes
The rows (fixed seed) are hard cases: normal data at many magnitudes, uniform, heavy tails and
outliers, zero / constant / one-value blocks and sub-blocks, all-positive and all-negative
blocks, float16 extremes, tiny and sub-GROUP_MAX_EPS values, exact ties, and a few rows past the
float16 range and at the float32 extremes, whose scales and sums overflow to inf and NaN (so
that this arithmetic is pinned too), and integer rows picked (fixed indices into fixed pools)
because a port that got one detail wrong (5 make_q3_quants passes, ties in best_index_int8,
id*x vs x/d) differs on them.

With an importance matrix (llama.cpp's ``--imatrix``: one float32 per column of the weight
tensor, shared by all its rows) the bytes are ``ggml_quantize_chunk(type, x, dst, 0, nrows,
1024, imatrix)``, whose ``quantize_*`` then take ggml-quants.c's weighted paths:
  Q2_K    quantize_q2_K -> quantize_row_q2_K_impl: weights quant_weights * sqrtf(sigma2 + x^2),
          sigma2 = sum x^2 / 256; make_qkx3_quants per 16 values, then make_qp_quants (nmax
          15) for the sub-scales and for the mins, weighted by each sub-block's summed weights
  Q3_K    quantize_q3_K -> quantize_row_q3_K_impl: sigma2 = 2 sum x^2 / 256; make_qx_quants
          (nmax 4) with the weights, then make_qx_quants (nmax 32) for the sub-scales
  Q4_K    quantize_q4_K -> quantize_row_q4_K_impl, quantize_q5_K -> quantize_row_q5_K_impl:
  Q5_K    sigma2 = 2 sum x^2 / 256; make_qkx3_quants per 32, make_qp_quants (nmax 63) for the
          sub-scales and mins (Q5_K clamps their codes to 63, Q4_K does not)
  Q6_K    quantize_q6_K -> quantize_row_q6_K_impl: make_qx_quants (nmax 32) weighted by
          quant_weights alone
  IQ4_NL  quantize_iq4_nl / quantize_iq4_xs -> quantize_row_iq4_nl_impl with quant_weights:
  IQ4_XS  weights quant_weights * sqrtf(sigma2 + x^2), sigma2 = sum x^2 * 2 / super-block (32
          for IQ4_NL, 256 for IQ4_XS)
Stored:
  imatrix          float32 (cases, 1024): the importance matrices, one per case (:func:`imatrices`:
                   typical means of squared activations, very uneven columns, zeros scattered and
                   over whole sub-blocks and a block, all equal, all zero, one to three nonzero
                   entries per 16 columns, tiny, float32-subnormal and huge values, 16 decades)
  T_imatrix_x      float32 (rows, 1024): the input rows (:func:`imatrix_rows`: T_x four to a row,
                   then rows picked for make_qp_quants' rare paths)
  T_imatrix_bytes  uint8 (cases, rows, row_size): ggml's rows with imatrix[case]
  T_imatrix_deq    float32 (cases, rows, 1024): ggml's to_float of T_imatrix_bytes
"""

import ctypes
import sys
from pathlib import Path

import numpy as np

F = np.float32
TYPES = {"q2_k": 10, "q3_k": 11, "q4_k": 12, "q5_k": 13, "q6_k": 14, "iq4_nl": 20, "iq4_xs": 23}
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])


def rows(rng):
    """One list of 256-element rows; each row is one K super-block (8 IQ4_NL blocks)."""
    n = 256
    out = []
    normal = rng.standard_normal
    for mag in (1e-3, 0.05, 1.0, 30.0, 1e3):  # plain normal rows at several magnitudes
        out.append(normal(n) * mag)
    # sub-blocks of very different magnitudes in one super-block (small sub-scales round to 0)
    out.append(normal(n) * np.repeat(10.0 ** rng.uniform(-5, 2, 16), 16))
    out.append(normal(n) * np.repeat(10.0 ** rng.uniform(-3, 1, 8), 32))
    out.append(rng.uniform(-1, 1, n))
    out.append(rng.uniform(0.1, 2, n))  # all positive
    out.append(-rng.uniform(0.1, 2, n))  # all negative
    out.append(100 + rng.uniform(-1, 1, n))  # all positive, large offset
    out.append(rng.standard_t(1.5, n))  # heavy tail
    r = normal(n)  # a few huge outliers per block
    r[rng.choice(n, 6, replace=False)] *= 1e4
    out.append(r)
    r = normal(n) * 0.1  # one outlier in each 16-sub-block, alternating sign
    r[np.arange(16) * 16 + rng.integers(0, 16, 16)] = np.resize([50.0, -50.0], 16)
    out.append(r)
    out.append(np.zeros(n))
    out.append(np.full(n, 0.75))
    out.append(np.full(n, -3.5))
    r = np.zeros(n)
    r[37] = 2.5
    out.append(r)
    r = np.zeros(n)
    r[200] = -7.0
    out.append(r)
    r = np.zeros(n)  # one nonzero value per 32-sub-block, both signs, several magnitudes
    r[np.arange(8) * 32 + rng.integers(0, 32, 8)] = rng.choice([-1.0, 1.0], 8) * 10.0 ** rng.uniform(-3, 3, 8)
    out.append(r)
    r = normal(n)  # zero sub-blocks (16 and 32 wide) inside a nonzero super-block
    r[16:32] = 0
    r[64:128] = 0
    r[240:] = 0
    out.append(r)
    r = normal(n)  # constant sub-blocks (both signs) and a single-value sub-block
    r[0:32] = 1.25
    r[96:112] = -0.5
    r[160:192] = 0
    r[170] = 3.0
    out.append(r)
    out.append(np.resize([65504.0, -65504.0, 60000.0, -1.0], n) * rng.uniform(0.5, 1, n))  # f16 extremes
    out.append(rng.uniform(-65504, 65504, n))
    out.append(normal(n) * 1e-6)  # f16-subnormal range
    out.append(normal(n) * 3e-8)
    r = normal(n) * 1e-16  # below GROUP_MAX_EPS (1e-15) in places
    r[128:] *= 1e9
    out.append(r)
    out.append((rng.integers(-8, 8, n) + 0.5) * 2.0**-3)  # exact ties
    out.append((rng.integers(-16, 16, n) + 0.5) * 2.0**5)
    out.append(rng.integers(0, 16, n) * 2.0**-4 - 0.5)  # on a 4-bit affine grid
    out.append(rng.integers(-4, 4, n) * 0.25)  # on the Q3_K grid
    out.append(rng.choice(KVALUES_IQ4NL, n) * 2.0**-7)  # on the IQ4_NL grid
    out.append(rng.choice([-1.0, 0.0, 1.0], n))  # ternary
    r = rng.choice(normal(5), n)
    r[::7] = -0.0
    out.append(r)
    for mag in (0.3, 0.1, 0.03, 0.01, 1e-3):  # one dominant value per 16-sub-block over small noise
        r = normal(n) * mag
        r[::16] = rng.choice([-1.0, 1.0], 16)
        out.append(r)
    out.append(normal(n) * 1e-14)  # sub-scales under GROUP_MAX_EPS though the values are not (Q6_K)
    out.append(normal(n) * 10.0 ** rng.uniform(-15, -13, n))
    r = rng.choice([-101.0, -79, -61, -19, -7, 16, 42, 57, 74, 7, 19, 61, 79, 101, -16, -42, -57, -74], n)
    r[::32] = 127 * rng.choice([-1.0, 1.0], 8)  # IQ4: x*id exactly halfway between two kvalues
    out.append(r)
    out.append(normal(n) * 1e8)  # past the f16 range: sub-scales and d overflow
    out.append(normal(n) * 1e12)
    out.append(normal(n) * 1e37)  # float32 extremes: sums overflow to inf, NaN scales
    out.append(rng.uniform(-3.4e38, 3.4e38, n))
    out.append(normal(n) * 1e-40)  # float32 subnormals
    # integer rows (fixed pools) picked for make_q3_quants needing all 5 passes (Q3_K), exact
    # best_index_int8 ties (IQ4) and id*x differing from x/d (IQ4_NL)
    pool = np.random.default_rng(7).integers(-33, 33, (600, n)).astype(F)
    pool[:, ::16] = -32
    out.extend(pool[[234, 505, 74]])
    pool = np.random.default_rng(8).integers(-64, 64, (800, n)).astype(F)
    pool[:, ::16] = 64
    out.extend(pool[[83, 102]])
    return np.array(out, dtype=F)


IMATRIX_COLUMNS = 1024  # n_per_row of the importance-matrix vectors: 4 K super-blocks, 32 IQ4_NL blocks


def imatrices(rng):
    """The importance matrices (float32, IMATRIX_COLUMNS each) the imatrix vectors use, one per case."""
    n = IMATRIX_COLUMNS
    acts = rng.standard_normal((512, n)) * 10.0 ** rng.uniform(-1, 1, n)  # columns of different scales
    typical = np.mean(acts.astype(F) ** 2, axis=0)  # llama.cpp's imatrix: mean of squared activations
    uneven = rng.uniform(0.5, 1.5, n)
    uneven[rng.choice(n, 8, replace=False)] *= 1e4  # a few columns dominate
    uneven[272:288] *= 1e4  # and a whole 16-sub-block
    zeros = typical.copy()
    zeros[rng.random(n) < 0.3] = 0  # zero weights scattered, and whole sub-blocks and a block
    zeros[16:32] = 0
    zeros[64:96] = 0
    zeros[512:768] = 0
    sparse = np.zeros(n)  # one to three nonzero weights per 16-sub-block: make_qkx3_quants' fits over
    for j in range(0, n, 16):  # so few points give negative sub-scales, whose 6-bit codes wrap in Q4_K
        keep = j + rng.choice(16, rng.integers(1, 4), replace=False)
        sparse[keep] = typical[keep]
    return {
        "typical": typical,
        "uneven": uneven,
        "zeros": zeros,
        "equal": np.ones(n),
        "all_zero": np.zeros(n),
        "sparse": sparse,
        "tiny": typical * 1e-30,  # weighted sums near the bottom of float32
        "subnormal": typical * 1e-42,  # float32 subnormal weights
        "huge": typical * 1e30,  # weighted sums overflow
        "decades": 10.0 ** rng.uniform(-8, 8, n),
    }


def imatrix_rows(x, rng):
    """The rows of the imatrix vectors, IMATRIX_COLUMNS wide: the 256-element hard rows of
    :func:`rows` four to a row (normal rows complete the last), then rows picked (fixed indices
    into fixed pools) because make_qp_quants reaches its rare paths on them: a negative sub-scale
    under the 'sparse' imatrix whose code wraps in C's uint8 (Q2_K: 291; Q4_K: 15, 323, which
    get_scale_min_k4 then reads back altered; Q5_K: 213), and the 5-pass limit of its search
    under 'uneven' (Q4_K: 77, 110; Q5_K: 110); and a row whose blocks' sums of squares lie where
    ``2 * sumx2 / 256`` overflows but ``sumx2 / 256`` does not, and in the float32 subnormals
    (sigma2's order of operations)."""
    x = np.concatenate([x, rng.standard_normal((-len(x) % 4, x.shape[1]))]).reshape(-1, IMATRIX_COLUMNS)
    pool = np.random.default_rng(31)
    pool = pool.standard_normal((600, IMATRIX_COLUMNS)) * 10.0 ** pool.uniform(-2, 2, (600, 1))
    ints = np.random.default_rng(32).integers(0, 9, (600, IMATRIX_COLUMNS))
    sums = rng.standard_normal(IMATRIX_COLUMNS) * np.repeat([1.1e18, 1e18, 3e-21, 1e-21], 256)
    return np.concatenate([x, pool[[291, 15, 323, 213]], ints[[77, 110]], sums[None]]).astype(F)


class Ggml:
    def __init__(self, path):
        lib = self.lib = ctypes.CDLL(str(path))
        lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        lib.ggml_quantize_chunk.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                            ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p)
        lib.ggml_quantize_init.argtypes = (ctypes.c_int,)
        lib.ggml_quantize_init.restype = None
        lib.ggml_row_size.argtypes = (ctypes.c_int, ctypes.c_int64)
        lib.ggml_row_size.restype = ctypes.c_size_t
        lib.ggml_get_type_traits.argtypes = (ctypes.c_int,)
        lib.ggml_get_type_traits.restype = ctypes.POINTER(TypeTraits)
        lib.quantize_row_q8_K_ref.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
        lib.quantize_row_q8_K_ref.restype = None
        lib.dequantize_row_q8_K.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
        lib.dequantize_row_q8_K.restype = None

    def quantize_q8_k(self, x):
        """ggml-quants.c's quantize_row_q8_K_ref (Q8_K is the K-quants' activation type, not one of
        ggml_quantize_chunk's), into zeroed bytes: it leaves an all-zero block's bsums unwritten."""
        x = np.ascontiguousarray(x, dtype=F)
        out = np.zeros((x.shape[0], x.shape[1] // 256 * 292), dtype=np.uint8)
        self.lib.quantize_row_q8_K_ref(x.ctypes.data, out.ctypes.data, x.size)
        return out

    def quantize(self, type_id, x, imatrix=None):
        """ggml_quantize_chunk's rows for float32 rows ``x``; ``imatrix``: float32, one entry a column."""
        x = np.ascontiguousarray(x, dtype=F)
        nrows, n_per_row = x.shape
        if imatrix is not None:
            imatrix = np.ascontiguousarray(imatrix, dtype=F)
            assert imatrix.shape == (n_per_row,)
        self.lib.ggml_quantize_init(type_id)
        out = np.zeros((nrows, self.lib.ggml_row_size(type_id, n_per_row)), dtype=np.uint8)
        size = self.lib.ggml_quantize_chunk(type_id, x.ctypes.data, out.ctypes.data, 0, nrows, n_per_row,
                                            None if imatrix is None else imatrix.ctypes.data)
        assert size == out.size
        return out

    def dequantize(self, type_id, raw, n):
        to_float = TO_FLOAT(self.lib.ggml_get_type_traits(type_id).contents.to_float)
        raw = np.ascontiguousarray(raw)
        y = np.empty((raw.shape[0], n), dtype=F)
        to_float(raw.ctypes.data, y.ctypes.data, y.size)
        return y


class TypeTraits(ctypes.Structure):  # ggml.h struct ggml_type_traits
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p), ("from_float_ref", ctypes.c_void_p)]


TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


def main(lib_path):
    ggml = Ggml(lib_path)
    out = {}
    for k, (name, type_id) in enumerate(TYPES.items()):
        x = rows(np.random.default_rng(20240611 + k))
        raw = ggml.quantize(type_id, x)
        out[f"{name}_x"] = x
        out[f"{name}_bytes"] = raw
        with np.errstate(all="ignore"):
            out[f"{name}_deq"] = ggml.dequantize(type_id, raw, x.shape[1])
    x = rows(np.random.default_rng(20240611 + len(TYPES)))
    out["q8_k_x"] = x
    out["q8_k_bytes"] = raw = ggml.quantize_q8_k(x)
    y = np.empty_like(x)  # (its type traits have no to_float: ggml-quants.c's dequantize_row_q8_K)
    ggml.lib.dequantize_row_q8_K(raw.ctypes.data, y.ctypes.data, y.size)
    out["q8_k_deq"] = y
    out["imatrix"] = w = np.array(list(imatrices(np.random.default_rng(20251206)).values()), dtype=F)
    for k, (name, type_id) in enumerate(TYPES.items()):
        x = imatrix_rows(rows(np.random.default_rng(20240611 + k)), np.random.default_rng(20251207 + k))
        out[f"{name}_imatrix_x"] = x
        out[f"{name}_imatrix_bytes"] = raw = np.array([ggml.quantize(type_id, x, wi) for wi in w])
        with np.errstate(all="ignore"):
            out[f"{name}_imatrix_deq"] = np.array([ggml.dequantize(type_id, r, x.shape[1]) for r in raw])
    path = Path(__file__).with_name("kquants.npz")
    np.savez_compressed(path, **out)
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/ggml-build/bin/libggml-base.so")
