"""Training in int8: an MLP trained from scratch with integer forward and backward passes.

scikit-learn's bundled 8x8 digits, split as ``digits`` splits them. The same
64 -> 128 -> 64 -> 10 ReLU MLP, from the same initial weights, is trained twice
with Adam on float32 master weights: once in float32, once with every matmul
in integers. In the int8 run each layer quantizes its input and its weights
(qint8, symmetric, per tensor, scale from the largest magnitude), and
``qarray.matmul`` gives the exact int32 products: the forward ``x @ w.T``, and
in the backward pass ``grad_w = grad.T @ x`` and ``grad_x = grad @ w``, the
gradient quantized with stochastic rounding (``rounding="stochastic"``, a seed
per step and layer: unbiased, so small gradients are not rounded away). Only
the softmax cross-entropy, the ReLU and Adam run in float32.

Training runs on NumPy arrays (``--backend cupy`` evaluates the trained nets
on the GPU). Run: ``python -m qarray.examples.train [--quick] [--backend numpy|cupy]``
"""

from __future__ import annotations

import itertools
import time

import numpy as np

import qarray as qa
from qarray._params import to_host

from . import _common
from .digits import SIZES, forward, init
from .digits import _grads as float_grads

NAME = "train"


def _q(a, **kw):
    """``a`` (float32) as qint8, symmetric per tensor: scale = max |a| / 127 (1 for all zeros)."""
    amax = float(abs(a).max()) if a.size else 0.0
    return qa.quantize(a, np.float32(amax / 127 if amax > 0 else 1.0), 0, "qint8", **kw)


def int8_grads():
    """``grads(params, x, y)``: the gradients of the mean cross-entropy with every
    matmul in integers, ``x @ w.T`` forward, ``grad.T @ x`` and ``grad @ w``
    backward, the gradient quantized with stochastic rounding (seeds from the
    step count: every run the same)."""
    steps = itertools.count(1)
    return lambda params, x, y: _int8_grads(params, x, y, next(steps))


def _int8_grads(params, x, y, step):
    qs, acts = [], [x]
    for i in range(0, len(params), 2):
        qx, qw = _q(acts[-1]), _q(params[i])
        qs.append((qx, qw))
        z = qa.matmul(qx, qw.T).dequantize() + params[i + 1]
        acts.append(z if i + 2 == len(params) else z * (z > 0))
    d = _common.xent_grad(acts[-1], y).astype(np.float32)
    grads = [None] * len(params)
    for i in range(len(params) - 2, -1, -2):
        qx, qw = qs[i // 2]
        qd = _q(d, rounding="stochastic", seed=step * 16 + i)
        grads[i], grads[i + 1] = qa.matmul(qd.T, qx).dequantize(), d.sum(axis=0)
        if i:
            d = qa.matmul(qd, qw).dequantize() * (acts[i // 2] > 0)
    return grads


def run(quick: bool = False, xp=np) -> dict:
    """Train the float32 and the int8 MLP from the same start; returns ``{"epochs",
    "test_size", "variants": {key: {"label", "accuracy" (percent), "s_per_epoch"}}}``
    with keys ``float32`` and ``int8``."""
    x_train, x_test, y_train, y_test = _common.load_digits()
    epochs = 10 if quick else 30
    variants = {}
    for key, label, grads in (("float32", "float32", float_grads),
                              ("int8", "int8 forward and backward, stochastic rounding", int8_grads())):
        params = init()
        t = time.perf_counter()
        _common.fit(params, grads, x_train, y_train, epochs)
        seconds = (time.perf_counter() - t) / epochs
        logits = forward([xp.asarray(p) for p in params], xp.asarray(x_test))[-1]
        accuracy = 100.0 * float(np.mean(to_host(logits).argmax(axis=1) == y_test))
        variants[key] = {"label": label, "accuracy": accuracy, "s_per_epoch": seconds}
    return {"epochs": epochs, "test_size": len(y_test), "variants": variants}


def show(r: dict, backend: str) -> None:
    rows = [(v["label"], f"{v['accuracy']:.2f}", f"{v['s_per_epoch'] * 1e3:.1f}") for v in r["variants"].values()]
    _common.print_table(f"train: MLP {' -> '.join(map(str, SIZES))} from scratch, {r['epochs']} epochs of Adam, "
                        f"{r['test_size']} test images ({backend})", ("training", "accuracy %", "ms / epoch"), rows,
                        caption="int8: qint8 inputs, weights and gradients (per tensor, symmetric), exact int32 "
                                "matmuls forward and backward; float32 master weights, ReLU, loss and Adam")


def main(argv: list[str] | None = None) -> int:
    return _common.main(NAME, __doc__, argv, run, show)


if __name__ == "__main__":
    raise SystemExit(main())
