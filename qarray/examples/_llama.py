"""A small decoder-only transformer of the llama architecture in NumPy, with its gradients.

RMSNorm, rotary positions on adjacent pairs (llama.cpp's ``LLAMA_ROPE_TYPE_NORM``, so a GGUF of
these weights needs no permutation of ``wq``/``wk``), causal multi-head attention, a SwiGLU
feed-forward and an untied output head; byte-level (256 tokens). Weights are ``(out, in)`` as a
``Linear``'s, so a format's blocks run along the input features, as GGUF keeps them.

``loss_and_grads`` is the forward pass and its backward, written out (``tests/test_lm.py``
checks them against finite differences in float64); ``train`` fits the model with Adam on
random windows of a byte string. ``forward`` returns the logits, and takes a ``linear``
hook: evaluation with quantized weights swaps the float matmul for one on their codes.
"""

from __future__ import annotations

import numpy as np

LINEARS = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")  # a layer's weights of (out, in)
EPS = 1e-5
THETA = 10000.0


def config(vocab=256, dim=256, layers=2, heads=4, hidden=512, ctx=128):
    """The model's shape: ``dim`` and ``hidden`` multiples of 256 take every GGUF block format."""
    if dim % heads or (dim // heads) % 2:
        raise ValueError(f"dim {dim} must split into {heads} heads of an even size")
    return dict(vocab=vocab, dim=dim, layers=layers, heads=heads, hidden=hidden, ctx=ctx)


def init(cfg, seed=0, dtype=np.float32):
    """Weights ``N(0, 0.02)``, the output projections scaled by ``1 / sqrt(2 * layers)`` (GPT-2's),
    norms at 1."""
    rng = np.random.default_rng(seed)
    d, h, v = cfg["dim"], cfg["hidden"], cfg["vocab"]
    out_scale = 0.02 / np.sqrt(2 * cfg["layers"])

    def w(shape, s=0.02):
        return (rng.standard_normal(shape) * s).astype(dtype)

    p = {"emb": w((v, d)), "norm": np.ones(d, dtype), "out": w((v, d))}
    for i in range(cfg["layers"]):
        p.update({f"{i}.attn_norm": np.ones(d, dtype), f"{i}.ffn_norm": np.ones(d, dtype),
                  f"{i}.wq": w((d, d)), f"{i}.wk": w((d, d)), f"{i}.wv": w((d, d)),
                  f"{i}.wo": w((d, d), out_scale), f"{i}.w1": w((h, d)), f"{i}.w3": w((h, d)),
                  f"{i}.w2": w((d, h), out_scale)})
    return p


def rope_tables(ctx, head_dim, dtype=np.float32):
    """``cos``, ``sin`` of ``(ctx, head_dim / 2)``: position ``t`` turns pair ``i`` by ``t * THETA **
    (-2 i / head_dim)``."""
    freq = THETA ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angle = np.arange(ctx, dtype=np.float64)[:, None] * freq[None, :]
    return np.cos(angle).astype(dtype), np.sin(angle).astype(dtype)


def _rope(x, cos, sin, sign=1):
    """Adjacent pairs ``(x[2i], x[2i+1])`` of ``x`` (..., T, head_dim) turned by the angle (``sign``
    -1: back, the gradient's rotation)."""
    c, s = cos, sign * sin
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def _rms(x, g):
    r = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + EPS)
    return x * r * g, r


def _rms_back(dy, x, r, g):
    u = dy * g
    dx = r * u - x * (r ** 3) * (u * x).mean(axis=-1, keepdims=True)
    return dx, (dy * x * r).reshape(-1, x.shape[-1]).sum(axis=0)


def _dense(x, w):
    return x @ w.T


def forward(p, cfg, tokens, linear=_dense, keep=None):
    """Logits ``(B, T, vocab)`` of ``tokens`` ``(B, T)``; ``linear(x, name)``-style hook:
    ``linear(x, w)`` with ``w`` the weight (or the name's quantized stand-in); ``keep``: a dict that
    receives what the backward pass needs."""
    b, t = tokens.shape
    d, nh = cfg["dim"], cfg["heads"]
    hd = d // nh
    cos, sin = rope_tables(t, hd, p["emb"].dtype)
    mask = np.triu(np.full((t, t), -np.inf, p["emb"].dtype), 1)
    x = p["emb"][tokens]
    for i in range(cfg["layers"]):
        n1, r1 = _rms(x, p[f"{i}.attn_norm"])
        q, k, v = (linear(n1, p[f"{i}.{w}"]).reshape(b, t, nh, hd).transpose(0, 2, 1, 3) for w in ("wq", "wk", "wv"))
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)  # (b, heads, t, head_dim)
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd).astype(x.dtype) + mask
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        att = s / s.sum(axis=-1, keepdims=True)
        o = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
        h = x + linear(o, p[f"{i}.wo"])
        n2, r2 = _rms(h, p[f"{i}.ffn_norm"])
        a, c = linear(n2, p[f"{i}.w1"]), linear(n2, p[f"{i}.w3"])
        sig = 1.0 / (1.0 + np.exp(-a))
        g = a * sig * c
        x_next = h + linear(g, p[f"{i}.w2"])
        if keep is not None:
            keep[i] = (x, n1, r1, q, k, v, att, o, h, n2, r2, a, c, sig, g)
        x = x_next
    nf, rf = _rms(x, p["norm"])
    if keep is not None:
        keep["final"] = (x, nf, rf, cos, sin)
    return linear(nf, p["out"])


def loss_and_grads(p, cfg, tokens, targets):
    """Mean cross-entropy of ``targets`` given ``tokens`` (both ``(B, T)``), and its gradient for
    every weight."""
    b, t = tokens.shape
    d, nh = cfg["dim"], cfg["heads"]
    hd = d // nh
    keep = {}
    logits = forward(p, cfg, tokens, keep=keep)
    z = logits - logits.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    bi, ti = np.meshgrid(np.arange(b), np.arange(t), indexing="ij")
    loss = -logp[bi, ti, targets].mean()
    dlogits = np.exp(logp)
    dlogits[bi, ti, targets] -= 1
    dlogits /= b * t
    grads = {}
    x, nf, rf, cos, sin = keep["final"]
    grads["out"] = dlogits.reshape(-1, cfg["vocab"]).T @ nf.reshape(-1, d)
    dx, grads["norm"] = _rms_back(dlogits @ p["out"], x, rf, p["norm"])
    for i in reversed(range(cfg["layers"])):
        x0, n1, r1, q, k, v, att, o, h, n2, r2, a, c, sig, g = keep[i]
        dg = dx @ p[f"{i}.w2"]
        grads[f"{i}.w2"] = dx.reshape(-1, d).T @ g.reshape(-1, cfg["hidden"])
        silu = a * sig
        da = dg * c * sig * (1 + a * (1 - sig))
        dc = dg * silu
        grads[f"{i}.w1"] = da.reshape(-1, cfg["hidden"]).T @ n2.reshape(-1, d)
        grads[f"{i}.w3"] = dc.reshape(-1, cfg["hidden"]).T @ n2.reshape(-1, d)
        dn2 = da @ p[f"{i}.w1"] + dc @ p[f"{i}.w3"]
        dh_norm, grads[f"{i}.ffn_norm"] = _rms_back(dn2, h, r2, p[f"{i}.ffn_norm"])
        dh = dx + dh_norm
        do = (dh @ p[f"{i}.wo"]).reshape(b, t, nh, hd).transpose(0, 2, 1, 3)
        grads[f"{i}.wo"] = dh.reshape(-1, d).T @ o.reshape(-1, d)
        datt = do @ v.transpose(0, 1, 3, 2)
        dv = att.transpose(0, 1, 3, 2) @ do
        ds = att * (datt - (datt * att).sum(axis=-1, keepdims=True)) / np.sqrt(hd).astype(x0.dtype)
        dq, dk = _rope(ds @ k, cos, sin, -1), _rope(ds.transpose(0, 1, 3, 2) @ q, cos, sin, -1)
        dq, dk, dv = (g_.transpose(0, 2, 1, 3).reshape(b, t, d) for g_ in (dq, dk, dv))
        n1f = n1.reshape(-1, d)
        grads[f"{i}.wq"], grads[f"{i}.wk"], grads[f"{i}.wv"] = (g_.reshape(-1, d).T @ n1f for g_ in (dq, dk, dv))
        dn1 = dq @ p[f"{i}.wq"] + dk @ p[f"{i}.wk"] + dv @ p[f"{i}.wv"]
        dx_norm, grads[f"{i}.attn_norm"] = _rms_back(dn1, x0, r1, p[f"{i}.attn_norm"])
        dx = dh + dx_norm
    grads["emb"] = np.zeros_like(p["emb"])
    np.add.at(grads["emb"], tokens.reshape(-1), dx.reshape(-1, d))
    return float(loss), grads


def batches(data, cfg, batch, seed):
    """Endless ``(tokens, targets)`` of ``batch`` random windows of ``data`` (uint8)."""
    rng = np.random.default_rng(seed)
    t = cfg["ctx"]
    while True:
        start = rng.integers(0, len(data) - t - 1, batch)
        w = data[start[:, None] + np.arange(t + 1)].astype(np.int64)
        yield w[:, :-1], w[:, 1:]


def train(p, cfg, data, steps, batch=16, lr=3e-3, seed=0, log=None):
    """Adam (0.9, 0.95, weight decay 0.1 on the matrices) with a linear warm-up over the first 5% of
    ``steps`` and a cosine decay to 10%; returns the losses."""
    m = {k: np.zeros_like(v) for k, v in p.items()}
    s = {k: np.zeros_like(v) for k, v in p.items()}
    losses = []
    warm = max(1, steps // 20)
    for step, (x, y) in zip(range(1, steps + 1), batches(data, cfg, batch, seed)):
        loss, g = loss_and_grads(p, cfg, x, y)
        losses.append(loss)
        rate = lr * min(1.0, step / warm) * (0.1 + 0.45 * (1 + np.cos(np.pi * min(1.0, step / steps))))
        c1, c2 = 1 - 0.9 ** step, 1 - 0.95 ** step
        for k, w in p.items():
            m[k] += 0.1 * (g[k] - m[k])
            s[k] += 0.05 * (g[k] * g[k] - s[k])
            decay = 0.1 * rate * w if w.ndim == 2 and k != "emb" else 0.0
            w -= (rate / c1) * m[k] / (np.sqrt(s[k] / c2) + 1e-8) + decay
        if log is not None and (step % 50 == 0 or step == steps):
            log(step, float(np.mean(losses[-50:])))
    return losses


def nll(p, cfg, data, linear=_dense, windows=None):
    """Mean negative log-likelihood (nats a byte) of ``data`` read as consecutive windows of
    ``ctx`` bytes, each predicting its next bytes (the first ``windows`` windows, or all)."""
    t = cfg["ctx"]
    n = (len(data) - 1) // t
    n = n if windows is None else min(n, windows)
    total, count = 0.0, 0
    for s in range(0, n, 16):
        idx = np.arange(s, min(s + 16, n))[:, None] * t + np.arange(t + 1)
        w = data[idx].astype(np.int64)
        logits = forward(p, cfg, w[:, :-1], linear).astype(np.float64)
        z = logits - logits.max(axis=-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
        total -= np.take_along_axis(logp, w[:, 1:, None], axis=-1).sum()
        count += w[:, 1:].size
    return total / count
