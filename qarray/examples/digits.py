"""Handwritten digits: a float MLP trained in NumPy, then run with int8 and int4 weights.

scikit-learn's bundled 8x8 digits (no download), split 75 / 25 with fixed
seeds. A 64 -> 128 -> 64 -> 10 ReLU MLP is trained in float32 with Adam, then
calibrated: one observer (``qarray.observers``) per activation sees the float
net's activations on the training images. The quantized nets run on
``qarray.quantize`` and ``qarray.nn.Linear`` layers (ReLU fused, output
parameters from the observers), with int8 weights per tensor or per output
channel. A third variant stores the weights as 4-bit blocks
(``quantize_dynamic(w, "qint4", axis=1, block_size=16, symmetric=True)``) and
dequantizes them for a float matmul: weight-only quantization, since
``qarray.linear`` takes per-tensor or per-channel weights, not blocked ones.

Run: ``python -m qarray.examples.digits [--quick] [--backend numpy|cupy]``
"""

from __future__ import annotations

import numpy as np

import qarray as qa
from qarray._params import to_host

from . import _common

NAME = "digits"
SIZES = (64, 128, 64, 10)
BATCH = 256  # rows per timed batch


def forward(params, x):
    """The float net's activations: the input, each hidden layer after its
    ReLU, and the logits. ``params`` is ``[w1, b1, w2, b2, w3, b3]``, ``w`` as
    ``(out, in)``; ``x`` may be a NumPy or a CuPy array."""
    acts = [x]
    for i in range(0, len(params), 2):
        z = acts[-1] @ params[i].T + params[i + 1]
        acts.append(z if i + 2 == len(params) else z * (z > 0))
    return acts


def _grads(params, x, y):
    acts = forward(params, x)
    d = _common.xent_grad(acts[-1], y)
    grads = [None] * len(params)
    for i in range(len(params) - 2, -1, -2):
        grads[i], grads[i + 1] = d.T @ acts[i // 2], d.sum(axis=0)
        d = (d @ params[i]) * (acts[i // 2] > 0)
    return grads


def init(seed: int = 0) -> list:
    """The MLP's starting ``[w1, b1, w2, b2, w3, b3]``: He-initialised weights
    (fixed seed), zero biases, float32."""
    rng = np.random.default_rng(seed)
    params = []
    for n_in, n_out in zip(SIZES[:-1], SIZES[1:]):
        params += [(rng.standard_normal((n_out, n_in)) * np.sqrt(2 / n_in)).astype(np.float32),
                   np.zeros(n_out, np.float32)]
    return params


def train(x, y, epochs: int, seed: int = 0) -> list:
    """The float MLP (``init(seed)``) trained on ``x``, ``y``."""
    params = init(seed)
    _common.fit(params, _grads, x, y, epochs, seed=seed)
    return params


def calibrate(params, x) -> list:
    """One quint8 observer per activation (input, hidden layers, logits), fed
    the float net's activations on ``x`` in batches."""
    from qarray import observers

    obs = [observers.MinMax("quint8") for _ in range(len(params) // 2 + 1)]
    for xb in np.array_split(x, 4):
        for o, a in zip(obs, forward(params, xb)):
            o.update(a)
    return obs


def _weight_bytes(q) -> int:
    """Bytes of the stored weights: the codes (packed two per byte for 4 bits)
    and the float32 scales; the zero points are 0 (symmetric)."""
    return int(q.pack().nbytes + q.scale.nbytes)


def int8_net(params, obs, per_channel: bool, xp):
    """``predict(x) -> labels`` on quantized layers with int8 weights, and the weights' bytes."""
    layers = []
    for i, o in zip(range(0, len(params), 2), obs[1:]):
        layer = qa.nn.Linear.from_float(xp.asarray(params[i]), params[i + 1], per_channel=per_channel)
        (layer.scale, layer.zero_point), layer.dtype = o.qparams(), o.dtype
        layers.append(layer)
    (s, z), d = obs[0].qparams(), obs[0].dtype

    def predict(x):
        h = qa.quantize(x, s, z, d)
        for k, layer in enumerate(layers):
            h = layer(h, relu=k + 1 < len(layers))
        return h.int_repr().argmax(axis=1)  # codes grow with the values: no dequantize

    return predict, sum(_weight_bytes(layer.weight) for layer in layers)


def int4_net(params, xp):
    """``predict(x) -> labels`` with 4-bit blocked weights dequantized per call
    for a float32 matmul (weight-only), and the weights' bytes."""
    ws = [qa.quantize_dynamic(xp.asarray(params[i]), "qint4", axis=1, block_size=16, symmetric=True)
          for i in range(0, len(params), 2)]
    bs = [xp.asarray(b) for b in params[1::2]]

    def predict(x):
        floats = [p for w, b in zip(ws, bs) for p in (w.dequantize(), b)]
        return forward(floats, x)[-1].argmax(axis=1)

    return predict, sum(_weight_bytes(w) for w in ws)


def float_net(params, xp):
    """``predict(x) -> labels`` of the float32 net, and its weights' bytes."""
    on_xp = [xp.asarray(p) for p in params]
    return (lambda x: forward(on_xp, x)[-1].argmax(axis=1)), sum(w.nbytes for w in params[::2])


def run(quick: bool = False, xp=np) -> dict:
    """Train, calibrate and evaluate every variant.

    Returns ``{"epochs": int, "test_size": int, "batch": int, "variants":
    {key: {"label", "accuracy" (percent), "ms" (median per batch), "bytes"}}}``
    with keys ``float32``, ``int8_per_tensor``, ``int8_per_channel``, ``int4_blocked``.
    """
    x_train, x_test, y_train, y_test = _common.load_digits()
    epochs = 15 if quick else 40
    params = train(x_train, y_train, epochs)
    obs = calibrate(params, x_train)
    nets = {
        "float32": ("float32", float_net(params, xp)),
        "int8_per_tensor": ("int8 per tensor", int8_net(params, obs, False, xp)),
        "int8_per_channel": ("int8 per channel", int8_net(params, obs, True, xp)),
        "int4_blocked": ("int4 blocks of 16, weight-only", int4_net(params, xp)),
    }
    x_dev, batch = xp.asarray(x_test), xp.asarray(x_test[:BATCH])
    variants = {}
    for key, (label, (predict, nbytes)) in nets.items():
        accuracy = 100.0 * float(np.mean(to_host(predict(x_dev)) == y_test))
        ms = _common.median_ms(lambda: predict(batch), 5 if quick else 30, xp)
        variants[key] = {"label": label, "accuracy": accuracy, "ms": ms, "bytes": nbytes}
    return {"epochs": epochs, "test_size": len(y_test), "batch": BATCH, "variants": variants}


def show(r: dict, backend: str) -> None:
    """Print ``run``'s result as rich tables."""
    rows = [(v["label"], f"{v['accuracy']:.2f}", f"{v['ms']:.3f}", f"{v['bytes']:,}") for v in r["variants"].values()]
    _common.print_table(
        f"digits: MLP {' -> '.join(map(str, SIZES))}, {r['epochs']} epochs, {r['test_size']} test images, "
        f"batches of {r['batch']} ({backend})",
        ("weights", "accuracy %", "ms / batch", "weight bytes"), rows,
        caption="int8: quint8 activations (MinMax observers), integer matmuls; weight-only: the int4 weights "
                "dequantized for a float32 matmul. ms: median of repeats; bytes: codes + float32 scales")


def main(argv: list[str] | None = None) -> int:
    return _common.main(NAME, __doc__, argv, run, show)


if __name__ == "__main__":
    raise SystemExit(main())
