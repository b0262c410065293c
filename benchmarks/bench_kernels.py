"""Micro-benchmark of the kernels of ``qarray/backends/_numba_gemm.py`` against
peers timed in the same run (2 threads for everyone):

- ``gemm_packed4`` (K = N = 4096, M = 1 and 16) vs float32 ``numpy.matmul``
  and, where installed, onnxruntime's MatMulInteger (int8 weights, unpacked);
- ``conv_grouped`` depthwise 1x256x56x56, 3x3, pad 1 (stride 1 and 2) vs
  torch's quantized conv2d (fbgemm) and torch float32 conv2d;
- ``im2col`` vs the NumPy sliding_window_view expression (copy included).

Prints median and min (ms) and each contender's ratio to the reference.
Run: ``PYTHONPATH=. python benchmarks/bench_kernels.py`` from the repository root.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _timing import TensorProto, helper, ort, timeit, torch  # noqa: E402  (peers, after OMP_WAIT_POLICY)
import numba  # noqa: E402

from qarray.backends._numba_gemm import conv_grouped, gemm_packed4, im2col, pack4  # noqa: E402

THREADS = 2
REPEATS = 15


def report(title, res, ref):
    print(f"\n{title}")
    r_med, r_min = res[ref]
    for k, (med, mn) in res.items():
        print(f"  {k:42s} median {med:8.3f} ms  min {mn:8.3f} ms   ratio {med / r_med:6.3f} (min {mn / r_min:6.3f})")


def ort_matmul_integer(a, b):
    g = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "b"], ["y"])], "g",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, a.shape)],
        [helper.make_tensor_value_info("y", TensorProto.INT32, None)],
        [helper.make_tensor("b", TensorProto.INT8, b.shape, b.tobytes(), raw=True)])  # an initializer: prepacked
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = THREADS, 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return lambda: s.run(None, {"a": a})


def bench_gemm(rng, m, k=4096, n=4096):
    a = rng.integers(0, 256, (m, k), dtype=np.uint8)
    w = rng.integers(-8, 8, (n, k)).astype(np.int8)
    wp = pack4(w)
    out = np.empty((m, n), np.int32)
    af, wt = a.astype(np.float32), w.astype(np.float32).T.copy()
    gemm_packed4(a, wp, True, out)
    assert (out == a.astype(np.int64) @ w.astype(np.int64).T).all()
    fns = {"numpy float32 matmul": lambda: np.matmul(af, wt),
           "gemm_packed4 (int4 weights)": lambda: gemm_packed4(a, wp, True, out)}
    if ort is not None:
        fns["onnxruntime MatMulInteger (int8 w)"] = ort_matmul_integer(a, w.T.copy())
    report(f"gemm {m}x{k}x{n}", timeit(REPEATS, **fns), "numpy float32 matmul")


def bench_depthwise(rng, stride, c=256, hw=56):
    x = rng.integers(0, 256, (1, c, hw, hw), dtype=np.uint8)
    za = 128
    w = rng.integers(-127, 128, (c, 1, 3, 3)).astype(np.int8)
    wc = w.astype(np.int16)  # symmetric weights: centred = codes
    xpad = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=za)
    oh = (hw + 2 - 3) // stride + 1
    out = np.empty((1, c, oh, oh), np.int32)

    def ours_pad():
        xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=za)
        conv_grouped(xp, za, wc, c, stride, stride, 1, 1, out)

    fns = {"conv_grouped (kernel, int32 out)": lambda: conv_grouped(xpad, za, wc, c, stride, stride, 1, 1, out),
           "conv_grouped incl. np.pad": ours_pad}
    ref = "conv_grouped (kernel, int32 out)"
    if torch is not None:
        xf = (x.astype(np.float32) - za) * 0.02
        tx = torch.quantize_per_tensor(torch.from_numpy(xf), 0.02, za, torch.quint8)
        tw = torch.quantize_per_tensor(torch.from_numpy(w.astype(np.float32) * 0.01), 0.01, 0, torch.qint8)
        packed = torch.ops.quantized.conv2d_prepack(tw, None, [stride, stride], [1, 1], [1, 1], c)
        fns["torch quantized.conv2d (fbgemm, u8 out)"] = lambda: torch.ops.quantized.conv2d(tx, packed, 0.5, 0)
        tf, twf = torch.from_numpy(xf), torch.from_numpy(w.astype(np.float32))
        fns["torch float32 conv2d"] = lambda: torch.nn.functional.conv2d(tf, twf, stride=stride, padding=1, groups=c)
        ref = "torch quantized.conv2d (fbgemm, u8 out)"
    report(f"depthwise conv 1x{c}x{hw}x{hw}, 3x3, pad 1, stride {stride}", timeit(REPEATS, **fns), ref)


def bench_im2col(rng, c, hw):
    x = rng.integers(0, 256, (1, c, hw, hw), dtype=np.uint8)
    xpad = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    out = np.empty((hw * hw, c * 9), np.uint8)

    def numpy_expr():
        v = np.lib.stride_tricks.sliding_window_view(xpad, (3, 3), axis=(2, 3))
        return v.transpose(0, 2, 3, 1, 4, 5).reshape(hw * hw, c * 9)  # reshape copies

    im2col(xpad, 3, 3, 1, 1, 1, 1, out)
    assert (out == numpy_expr()).all()
    report(f"im2col 1x{c}x{hw}x{hw} u8, 3x3, pad 1",
           timeit(REPEATS, **{"numpy sliding_window_view": numpy_expr,
                              "im2col kernel": lambda: im2col(xpad, 3, 3, 1, 1, 1, 1, out)}),
           "numpy sliding_window_view")


def main():
    numba.set_num_threads(THREADS)
    if torch is not None:
        torch.set_num_threads(THREADS)
        if "fbgemm" in torch.backends.quantized.supported_engines:
            torch.backends.quantized.engine = "fbgemm"
    print(f"numpy {np.__version__}, numba {numba.__version__}, torch {getattr(torch, '__version__', None)}, "
          f"onnxruntime {getattr(ort, '__version__', None)}, threads {THREADS}")
    rng = np.random.default_rng(0)
    for m in (1, 16):
        bench_gemm(rng, m)
    for s in (1, 2):
        bench_depthwise(rng, s)
    bench_im2col(rng, 64, 56)
    bench_im2col(rng, 256, 14)


if __name__ == "__main__":
    main()
