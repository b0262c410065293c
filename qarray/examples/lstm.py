"""Quantized LSTM: digits read row by row, integer gates and a qint32 cell state.

Each 8x8 digit is read as 8 steps of 8 pixels by an LSTM cell (hidden size
32) with a linear classifier on its last state, trained in float32 with
backpropagation through time and Adam, then run on qarray ops with every
activation's parameters from an observer fed the float net's activations:

- input pixels quint8; the gate pre-activations ``x @ Wx.T + b + h @ Wh.T`` as
  two exact qint32 accumulators (``nn.Linear`` with int8 weights per tensor, no
  output parameters) summed by ``qarray.add`` straight into qint8;
- gates ``i, f, o = qarray.sigmoid(...)`` in quint8 (scale 1/256) and
  ``g = qarray.tanh(...)`` in qint8 (scale 1/128);
- the cell state ``c = f * c + i * g`` in qint32 (scale 2**-20) from
  ``qarray.mul`` and ``qarray.add``; ``tanh(c)`` on ``c`` requantized to qint16;
- ``h = o * tanh(c)`` requantized by ``qarray.mul`` to qint8, the logits by the
  classifier's ``nn.Linear``.

Run: ``python -m qarray.examples.lstm [--quick] [--backend numpy|cupy]``
"""

from __future__ import annotations

import numpy as np

import qarray as qa
from qarray._params import to_host

from . import _common

NAME = "lstm"
STEPS, WIDTH, HIDDEN, CLASSES = 8, 8, 32, 10
CELL_SCALE = 2.0**-20  # qint32 cell state: steps of 1e-6, room up to 2048


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))  # NumPy's ufuncs run CuPy's on CuPy arrays


def forward(params, x):
    """The float LSTM on ``x`` (``(batch, 64)``): the logits and, per step, a
    dict of its activations (``x, h0, c0`` in, ``z, i, f, g, o, c, tc, h``)."""
    wx, wh, b, wy, by = params
    xp = qa.backends.for_array(x).xp
    h = c = xp.zeros((len(x), HIDDEN), xp.float32)
    tape = []
    for t in range(STEPS):
        s = {"x": x[:, t * WIDTH:(t + 1) * WIDTH], "h0": h, "c0": c}
        s["z"] = z = s["x"] @ wx.T + h @ wh.T + b
        s["i"], s["f"], s["g"], s["o"] = (_sigmoid(z[:, :HIDDEN]), _sigmoid(z[:, HIDDEN:2 * HIDDEN]),
                                          np.tanh(z[:, 2 * HIDDEN:3 * HIDDEN]), _sigmoid(z[:, 3 * HIDDEN:]))
        s["c"] = c = s["f"] * c + s["i"] * s["g"]
        s["tc"] = np.tanh(c)
        s["h"] = h = s["o"] * s["tc"]
        tape.append(s)
    return h @ wy.T + by, tape


def _grads(params, x, y):
    """Backpropagation through time of the mean cross-entropy."""
    wx, wh, b, wy, by = params
    logits, tape = forward(params, x)
    d = _common.xent_grad(logits, y)
    g_wx, g_wh, g_b = np.zeros_like(wx), np.zeros_like(wh), np.zeros_like(b)
    dh, dc = d @ wy, 0.0
    for s in reversed(tape):
        dc = dc + dh * s["o"] * (1 - s["tc"] ** 2)
        i, f, g, o = s["i"], s["f"], s["g"], s["o"]
        dz = np.concatenate([dc * g * i * (1 - i), dc * s["c0"] * f * (1 - f), dc * i * (1 - g * g),
                             dh * s["tc"] * o * (1 - o)], axis=1)
        g_wx += dz.T @ s["x"]
        g_wh += dz.T @ s["h0"]
        g_b += dz.sum(axis=0)
        dh, dc = dz @ wh, dc * f
    return [g_wx, g_wh, g_b, d.T @ tape[-1]["h"], d.sum(axis=0)]


def train(x, y, epochs: int, seed: int = 0) -> list:
    """``[Wx, Wh, b, Wy, by]`` trained on ``x``, ``y`` (fixed seed; forget-gate bias 1)."""
    rng = np.random.default_rng(seed)

    def init(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)

    b = np.zeros(4 * HIDDEN, np.float32)
    b[HIDDEN:2 * HIDDEN] = 1.0
    params = [init(4 * HIDDEN, WIDTH), init(4 * HIDDEN, HIDDEN), b, init(CLASSES, HIDDEN), np.zeros(CLASSES, np.float32)]
    _common.fit(params, _grads, x, y, epochs, lr=1e-2, seed=seed)
    return params


def calibrate(params, x) -> dict:
    """Observers fed the float LSTM's activations on ``x``: the pixels (quint8),
    the gate pre-activations ``z`` and the state ``h`` (qint8), the cell state
    as tanh's qint16 input, and the logits (qint8)."""
    from qarray import observers

    obs = {"x": observers.MinMax("quint8"), "z": observers.MinMax("qint8"),
           "c": observers.MinMax("qint16", symmetric=True), "h": observers.MinMax("qint8", symmetric=True),
           "logits": observers.MinMax("qint8")}
    for xb in np.array_split(x, 4):
        logits, tape = forward(params, xb)
        obs["x"].update(xb)
        obs["logits"].update(logits)
        for s in tape:
            for key in ("z", "c", "h"):
                obs[key].update(s[key])
    return obs


class QuantizedLSTM:
    """The trained LSTM on qarray ops; ``predict(x)`` gives the labels."""

    def __init__(self, params, obs, xp):
        wx, wh, b, wy, by = (xp.asarray(p) for p in params)
        self.lx = qa.nn.Linear.from_float(wx, params[2], per_channel=False)  # add takes per-tensor inputs
        self.lh = qa.nn.Linear.from_float(wh, per_channel=False)
        self.head = qa.nn.Linear.from_float(wy, params[4])
        self.p = {k: (*o.qparams(), o.dtype) for k, o in obs.items()}
        self.xp = xp

    def predict(self, x):
        xp, p, n = self.xp, self.p, len(x)
        qx = qa.quantize(x, *p["x"]).reshape(n, STEPS, WIDTH)
        h = qa.quantize(xp.zeros((n, HIDDEN), xp.float32), *p["h"])
        c = qa.QArray.from_int(xp.zeros((n, HIDDEN), xp.int32), CELL_SCALE, 0, "qint32")
        for t in range(STEPS):
            z = qa.add(self.lx(qx[:, t]), self.lh(h), scale=p["z"][0], zero_point=p["z"][1], dtype=p["z"][2])
            i, f, o = (qa.sigmoid(z[:, k * HIDDEN:(k + 1) * HIDDEN]) for k in (0, 1, 3))
            g = qa.tanh(z[:, 2 * HIDDEN:3 * HIDDEN])
            cell = {"scale": CELL_SCALE, "zero_point": 0, "dtype": "qint32"}
            c = qa.add(qa.mul(f, c, **cell), qa.mul(i, g, **cell), **cell)
            tc = qa.tanh(c.requantize(*p["c"]))
            h = qa.mul(o, tc, scale=p["h"][0], zero_point=p["h"][1], dtype=p["h"][2])
        logits = self.head(h, *p["logits"])
        return logits.int_repr().argmax(axis=1)  # codes grow with the values


def run(quick: bool = False, xp=np) -> dict:
    """Train, calibrate and evaluate: ``{"epochs", "test_size", "float_accuracy",
    "quantized_accuracy" (percent), "float_ms", "quantized_ms" (the test set, median)}``."""
    x_train, x_test, y_train, y_test = _common.load_digits()
    epochs = 10 if quick else 30
    params = train(x_train, y_train, epochs)
    obs = calibrate(params, x_train)
    net = QuantizedLSTM(params, obs, xp)
    x_dev = xp.asarray(x_test)
    float_params = [xp.asarray(p) for p in params]
    r = {"epochs": epochs, "test_size": len(y_test)}
    r["float_accuracy"] = 100.0 * float(np.mean(forward(params, x_test)[0].argmax(axis=1) == y_test))
    r["quantized_accuracy"] = 100.0 * float(np.mean(to_host(net.predict(x_dev)) == y_test))
    repeats = 2 if quick else 5
    r["float_ms"] = _common.median_ms(lambda: forward(float_params, x_dev), repeats, xp)
    r["quantized_ms"] = _common.median_ms(lambda: net.predict(x_dev), repeats, xp)
    return r


def show(r: dict, backend: str) -> None:
    """Print ``run``'s result as rich tables."""
    _common.print_table(
        f"lstm: digits row by row, hidden {HIDDEN}, {r['epochs']} epochs, {r['test_size']} test images ({backend})",
        ("model", "accuracy %", "ms, all test images"),
        [("float32", f"{r['float_accuracy']:.2f}", f"{r['float_ms']:.1f}"),
         ("quantized", f"{r['quantized_accuracy']:.2f}", f"{r['quantized_ms']:.1f}")],
        caption="quantized: int8 weights, qint8 gate inputs, quint8 sigmoid and qint8 tanh gates, qint32 cell "
                "state, qint8 h; ms: median of repeats")


def main(argv: list[str] | None = None) -> int:
    return _common.main(NAME, __doc__, argv, run, show)


if __name__ == "__main__":
    raise SystemExit(main())
