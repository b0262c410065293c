"""A language model quantized: held-out perplexity of a small llama, float32 against block formats.

The data is the English text every Python installation ships (``pydoc_data.topics``, about
466,000 bytes), read byte by byte; the last 10% is held out. The model is a decoder-only
transformer of the llama architecture (``qarray.examples._llama``: RMSNorm, rotary positions,
SwiGLU; 2 layers, width 256, 4 heads, feed-forward 512, 128 bytes of context, 1.4M weights),
trained here with Adam in NumPy (600 steps of 16 windows, a few minutes on 2 cores). The
weights are cached after the first run (``$QARRAY_CACHE`` or ``~/.cache/qarray``).

The table: held-out perplexity (``exp`` of the mean negative log-likelihood a byte) with float32
weights, then with every linear layer's weights (``wq wk wv wo w1 w3 w2``; the embedding, the
output head and the norms stay float32) in a format at 8, 4, 3 and 2 bits: GGUF's Q8_0, Q4_0,
Q4_K, IQ4_XS, Q3_K, Q2_K and the grouped formats of GPTQ / AWQ (``uint4_g128_f16_zp``), MLX
(``uint4_g64_f16_bias``) and bitsandbytes (``nf4_g64_f32``). The columns are the methods: round to
nearest (``qarray.quantize``); llama.cpp's importance matrix (``observers.ImportanceMatrix`` on 64
windows of the training text, then ``quantize(..., importance=)``: ggml's own weighted search, for the
K-quants and IQ4); HQQ (``qarray.hqq``, no calibration data, the float-bias formats); GPTQ
(``qarray.gptq``, every format) and AWQ (``qarray.awq``, its zero-point groups; its scales shared
and folded into the layers before, as AutoAWQ does it) on the same
calibration windows.

The W8A8 rows quantize the activations too: every linear layer's weights qint8 per output channel
(``max |row| / 127``) and its input qint8 on the fly, per token or per tensor (``max |x| / 127``),
multiplied exactly in int32 by ``qa.linear`` (SmoothQuant's ``W8A8Linear``, on the integers): round
to nearest, and SmoothQuant (``qarray.smoothquant``, alpha 0.5: each norm's output maxima over the
calibration windows, the scales folded into the norm and the layers that read it, q/k/v and gate/up).
``--quick``: the 4- and 3-bit rows and the W8A8 rows, on part of the held-out text, from the cached
model or a shorter training run.

It then writes the model for llama.cpp beside the cached weights: ``lm-KEY.gguf`` (float32),
``lm-KEY.imatrix.gguf`` (llama.cpp's importance-matrix file of the calibration inputs) and
``lm-KEY-Q4_K.gguf`` (the linear layers in Q4_K with that matrix: the bytes ``llama-quantize
--imatrix`` writes for them; it also quantizes the embedding and the output head, which stay
float32 here, as in the table).

Run: ``python -m qarray.examples.lm [--quick]`` (or ``qarray run lm``)
"""

from __future__ import annotations

import hashlib
import inspect
import os
import time
from pathlib import Path

import numpy as np

import qarray as qa

from .. import awq, gptq, hqq, smoothquant
from ..io import gguf, imatrix
from . import _common, _llama

NAME = "lm"
CONFIG = _llama.config(dim=256, layers=2, heads=4, hidden=512, ctx=128)
STEPS, QUICK_STEPS, BATCH, SEED = 600, 150, 16, 0
# (name, bits): the rows; --quick keeps the 4- and 3-bit ones
FORMATS = [("Q8_0", 8), ("Q4_0", 4), ("Q4_K", 4), ("IQ4_XS", 4), ("uint4_g128_f16_zp", 4), ("uint4_g64_f16_bias", 4),
           ("nf4_g64_f32", 4), ("Q3_K", 3), ("uint3_g128_f16_zp", 3), ("uint3_g64_f16_bias", 3), ("Q2_K", 2),
           ("uint2_g64_f16_zp", 2), ("uint2_g64_f16_bias", 2)]


def text():
    """``pydoc_data.topics``' texts in key order, as uint8 bytes (UTF-8): ``(train, held_out)``, the
    last 10% held out."""
    from pydoc_data.topics import topics

    data = np.frombuffer("".join(topics[k] for k in sorted(topics)).encode(), np.uint8)
    cut = len(data) * 9 // 10
    return data[:cut], data[cut:]


def _cache_path(cfg, steps):
    """The cached weights' file: a key of the model's shape, the steps, the seed, the data's length and
    the model's code (a change to any retrains)."""
    key = repr((sorted(cfg.items()), steps, BATCH, SEED, len(text()[0]), inspect.getsource(_llama)))
    root = Path(os.environ.get("QARRAY_CACHE") or Path.home() / ".cache" / "qarray")
    return root / f"lm-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npz"


def model(cfg=CONFIG, steps=STEPS, log=print):
    """The trained weights: from the cache, else trained (and cached; an unwritable cache is skipped)."""
    path = _cache_path(cfg, steps)
    if path.exists():
        with np.load(path) as f:
            return {k: f[k] for k in f.files}, 0.0
    params = _llama.init(cfg, SEED)
    t = time.perf_counter()
    _llama.train(params, cfg, text()[0], steps, BATCH, seed=SEED,
                 log=lambda step, loss: log(f"  step {step}/{steps}: training loss {loss:.3f} nats a byte"))
    seconds = time.perf_counter() - t
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, **params)
    except OSError:
        pass
    return params, seconds


# llama.cpp's names: the model's weight -> the GGUF tensor (``{i}``: the layer)
GGUF_NAMES = {"emb": "token_embd.weight", "norm": "output_norm.weight", "out": "output.weight",
              "attn_norm": "blk.{i}.attn_norm.weight", "ffn_norm": "blk.{i}.ffn_norm.weight",
              "wq": "blk.{i}.attn_q.weight", "wk": "blk.{i}.attn_k.weight", "wv": "blk.{i}.attn_v.weight",
              "wo": "blk.{i}.attn_output.weight", "w1": "blk.{i}.ffn_gate.weight", "w3": "blk.{i}.ffn_up.weight",
              "w2": "blk.{i}.ffn_down.weight"}


def write_gguf(path, params, cfg, dtype=None, importance=None):
    """The model as a GGUF file llama.cpp loads (architecture ``llama``): its hyperparameters, a
    vocabulary of the 256 bytes (``<0x00>`` .. ``<0xFF>``, SentencePiece byte tokens) and the weights,
    the linear layers' in ``dtype`` (a ggml type: ``"Q4_K"``, ...; None: float32), the rest float32;
    ``importance``: ``{layer: each input column's importance}`` for ``quantize(..., importance=)``
    (what ``llama-quantize --imatrix`` does).
    The rotary positions turn adjacent pairs, llama.cpp's own order for this architecture: no
    permutation of ``wq`` / ``wk``."""
    u32 = np.uint32
    d, heads = cfg["dim"], cfg["heads"]
    meta = {"general.architecture": "llama", "general.name": "qarray lm example",
            "llama.context_length": u32(cfg["ctx"]), "llama.embedding_length": u32(d),
            "llama.block_count": u32(cfg["layers"]), "llama.feed_forward_length": u32(cfg["hidden"]),
            "llama.attention.head_count": u32(heads), "llama.attention.head_count_kv": u32(heads),
            "llama.rope.dimension_count": u32(d // heads), "llama.rope.freq_base": np.float32(_llama.THETA),
            "llama.attention.layer_norm_rms_epsilon": np.float32(_llama.EPS), "llama.vocab_size": u32(cfg["vocab"]),
            "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [f"<0x{b:02X}>" for b in range(cfg["vocab"])],
            "tokenizer.ggml.scores": np.zeros(cfg["vocab"], np.float32),
            "tokenizer.ggml.token_type": np.full(cfg["vocab"], 6, np.int32),  # LLAMA_TOKEN_TYPE_BYTE
            "tokenizer.ggml.bos_token_id": u32(1), "tokenizer.ggml.eos_token_id": u32(2),
            "tokenizer.ggml.unknown_token_id": u32(0), "tokenizer.ggml.add_bos_token": False}
    tensors = {}
    for name, w in params.items():
        short = name.rpartition(".")[2]
        w = np.ascontiguousarray(w, np.float32)
        if dtype is not None and short in _llama.LINEARS:
            w = qa.quantize(w, dtype=dtype, importance=None if importance is None else importance[name])
        tensors[_gguf_name(name)] = w
    gguf.save(path, tensors, meta)


def calibration(params, cfg, windows=64, names=None):
    """Each linear layer's input activations ``(tokens, in)`` on ``windows`` windows of the training text,
    spread evenly over it: what the methods that look at activations calibrate on. ``names``: only
    those layers' (the model runs only as deep as the deepest of them)."""
    data, t = text()[0], cfg["ctx"]
    if names is None:
        names = [n for n in params if n.split(".")[-1] in _llama.LINEARS]
    else:
        cfg = dict(cfg, layers=1 + max(int(n.split(".")[0]) for n in names))
    ids = {id(params[n]): n for n in names}
    seen = {n: [] for n in names}

    def linear(x, w):
        if id(w) in ids:
            seen[ids[id(w)]].append(x.reshape(-1, x.shape[-1]))
        return x @ w.T

    starts = np.linspace(0, len(data) - t - 1, windows).astype(np.int64)
    for i in range(0, windows, 16):
        _llama.forward(params, cfg, data[starts[i:i + 16, None] + np.arange(t)].astype(np.int64), linear)
    return {n: np.concatenate(v) for n, v in seen.items()}


def round_to_nearest(w, fmt, x):
    return qa.quantize(w, dtype=fmt)


def importance_matrix(w, fmt, x):
    """llama.cpp's ``--imatrix``: the mean square of each input column's activations weights the
    K-quants' and IQ4's own search (``qarray.observers.ImportanceMatrix``); None for other formats."""
    if not qa.qdtype(fmt).layout.takes_importance:
        return None
    return qa.observers.ImportanceMatrix().update(x).quantize(w, fmt)


def half_quadratic(w, fmt, x):
    """HQQ (``qarray.hqq``): no calibration data, each group's float zero and scale optimized; its
    formats are the grouped ones with a float bias (MLX's layout); None for others."""
    return hqq.quantize(w, dtype=fmt) if fmt.endswith("_bias") else None


# AutoAWQ's scaled groups of a llama layer: (what the scales fold into, the layers that share them)
AWQ_SCALED = (("attn_norm", ("wq", "wk", "wv")), ("wv", ("wo",)), ("ffn_norm", ("w1", "w3")), ("w3", ("w2",)))


def awq_folded(params, cfg, fmt, calib):
    """AWQ's scales searched and folded as AutoAWQ does it for a llama: in each layer one search for
    q, k and v together (its scales fold into ``attn_norm``), one for o (into v's rows), one for gate
    and up (``ffn_norm``), one for down (up's rows), each on the float model's inputs (``calib``); the
    float params with the folds, the same function up to float32 rounding."""
    out = dict(params)
    for i in range(cfg["layers"]):
        for before, names in AWQ_SCALED:
            s = awq.search_scale(calib[f"{i}.{names[0]}"], [params[f"{i}.{n}"] for n in names], fmt).scales
            key = f"{i}.{before}"
            out[key] = awq.fold_rmsnorm(out[key], s) if before.endswith("norm") else awq.fold_linear(out[key], s)
            out.update({f"{i}.{n}": out[f"{i}.{n}"] * s for n in names})
    return out


def activation_aware(params, fmt, calib, cfg):
    """AWQ (``qarray.awq``) on the whole model, as AutoAWQ runs it: the scales folded
    (:func:`awq_folded`), then the clipping search of each folded layer on its inputs in the folded
    model (``x / s``; not for q and k, as AutoAWQ), in AWQ's own formats (the ``_zp`` groups): ``(the
    folded params, {layer: QArray})``; None for other formats."""
    if not fmt.endswith("_zp"):
        return None
    folded = awq_folded(params, cfg, fmt, calib)
    x = calibration(folded, cfg, len(next(iter(calib.values()))) // cfg["ctx"])
    return folded, {n: awq.quantize_weight(w, fmt, clip=None if n.endswith((".wq", ".wk")) else
                                           awq.search_clip(x[n], w, fmt))
                    for n, w in folded.items() if n.split(".")[-1] in _llama.LINEARS}


_HESSIANS = {}  # id of a layer's calibration inputs -> (inputs, their exact GPTQ Hessian), one a layer


def error_compensated(w, fmt, x):
    """GPTQ (``qarray.gptq``): each layer's exact Hessian of its calibration inputs (computed once, kept
    for every format), then ``fasterquant``'s column-by-column error compensation into the format
    (damping 1%, blocks of 128, no act order), every format here."""
    if id(x) not in _HESSIANS or _HESSIANS[id(x)][0] is not x:
        _HESSIANS[id(x)] = (x, gptq.Hessian(x.shape[-1]).update(x).hessian())
    return gptq.quantize(w, hessian=_HESSIANS[id(x)][1], dtype=fmt)


# the table's columns: name -> quantizer(w (out, in), format, its input activations) -> QArray, or
# None where the method does not apply to the format; AWQ's takes the whole model (see quantized)
METHODS = {"round to nearest": round_to_nearest, "GPTQ": error_compensated, "AWQ": activation_aware, "HQQ": half_quadratic,
           "imatrix": importance_matrix}

# the W8A8 rows (int8 weights and int8 activations): (name, activations per token or per tensor); their
# columns are round to nearest and SmoothQuant (alpha SMOOTH_ALPHA), the last column
W8A8 = [("W8A8 per-token", "token"), ("W8A8 per-tensor", "tensor")]
SMOOTHQUANT, SMOOTH_ALPHA = "SmoothQuant", 0.5
SMOOTHED = (("attn_norm", ("wq", "wk", "wv")), ("ffn_norm", ("w1", "w3")))  # smooth_lm's llama pairs: norm -> layers


def _absmax_scale(a, axis=None):
    """SmoothQuant's int8 absmax scale, ``max(max |a|, 1e-5) / 127`` over ``axis`` (all: None), float32."""
    return np.maximum(np.abs(a).max(axis=axis), np.float32(1e-5)) / np.float32(127)


def int8_weight(w):
    """``w`` (out, in) as qint8 per output channel: SmoothQuant's ``quantize_weight_per_channel_absmax``."""
    return qa.quantize(w, _absmax_scale(w, 1), 0, "qint8", axis=0)


def w8a8_linear(x, wq, per_token=True):
    """``x @ w.T`` as int8 x int8 through qarray: float ``x`` ``(..., in)`` quantized to qint8 on the fly,
    per token (each row's absmax scale; the codes go to ``qa.linear`` as a QArray of scale 1, and each
    row's scale multiplies its int32 sums after) or per tensor (``qa.linear`` of the two QArrays); the
    products summed exactly in int32 against ``wq`` (:func:`int8_weight`). SmoothQuant's
    ``W8A8Linear`` (``quantize_activation_per_token_absmax`` / ``_per_tensor_absmax``), on the integers."""
    x2 = x.reshape(-1, x.shape[-1])
    if per_token:
        s = _absmax_scale(x2, 1)
        codes = qa.quantize(x2, s, 0, "qint8", axis=0).int_repr()
        y = np.asarray(qa.linear(qa.QArray.from_int(codes, 1.0, 0, "qint8"), wq).dequantize()) * s[:, None]
    else:
        y = np.asarray(qa.linear(qa.quantize(x2, _absmax_scale(x2), 0, "qint8"), wq).dequantize())
    return y.reshape(*x.shape[:-1], wq.shape[0])


def smoothed(params, cfg, calib, alpha=SMOOTH_ALPHA):
    """``params`` after SmoothQuant's ``smooth_lm`` (its llama pairs): each norm's weight divided by the
    scales of the layers that read it, their columns multiplied (``qarray.smoothquant.smooth``; the
    norm's output maxima, ``smoothquant.AbsMax``, of ``calib``'s inputs of the first of them)."""
    out = dict(params)
    for i in range(cfg["layers"]):
        for norm, names in SMOOTHED:
            act = smoothquant.AbsMax().update(calib[f"{i}.{names[0]}"])
            r = smoothquant.smooth(params[f"{i}.{norm}"], [params[f"{i}.{n}"] for n in names], act, alpha)
            out[f"{i}.{norm}"] = r.norm
            out.update({f"{i}.{n}": w for n, w in zip(names, r.weights)})
    return out


def w8a8(params, cfg, data, per_token=True, windows=None):
    """``(nll, bits a weight)``: ``_llama.nll`` of ``data`` with every linear layer int8 x int8
    (:func:`w8a8_linear`; the output head stays float32), and the weights' bits a value (codes and
    float32 scales). Per tensor, the tensor is a batch of 16 windows of the evaluation."""
    q = {id(w): int8_weight(w) for name, w in params.items() if name.split(".")[-1] in _llama.LINEARS}

    def linear(x, w):
        return w8a8_linear(x, q[id(w)], per_token) if id(w) in q else x @ w.T

    bits = 8 * sum(w.nbytes + 4 * w.shape[0] for w in q.values()) / sum(w.size for w in q.values())
    return _llama.nll(params, cfg, data, linear, windows), bits


def quantized(params, fmt, method=round_to_nearest, calib=None, cfg=CONFIG):
    """``params`` with each linear weight replaced by its ``fmt`` quantization's float32 values (by
    ``method``, given ``calib``'s activations), and the weights' bits a value (codes, scales and all);
    ``(None, None)`` where the method does not apply. AWQ folds its scales into the layers before:
    its params are the folded model's."""
    if method is activation_aware:
        done = activation_aware(params, fmt, calib, cfg)
        if done is None:
            return None, None
        params, qs = done
    else:
        qs = {}
        for name, w in params.items():
            if name.split(".")[-1] in _llama.LINEARS:
                qs[name] = method(w, fmt, None if calib is None else calib[name])
                if qs[name] is None:
                    return None, None
    out = dict(params)
    out.update({name: np.asarray(q.dequantize(), np.float32) for name, q in qs.items()})
    return out, 8 * sum(q.nbytes for q in qs.values()) / sum(params[name].size for name in qs)


def run(quick=False, xp=np, cfg=CONFIG, steps=None, windows=None, calib_windows=64, formats=FORMATS, w8a8_rows=W8A8,
        log=print):
    """``{"steps", "trained_s", "float32": ppl, "methods": [...], "rows": [(format, bits, bits a weight,
    {method: ppl or None})]}``; the W8A8 rows last."""
    steps = steps or (STEPS if not quick or _cache_path(cfg, STEPS).exists() else QUICK_STEPS)
    params, seconds = model(cfg, steps, log)
    held = text()[1]
    windows = windows or (96 if quick else None)
    calib = calibration(params, cfg, calib_windows)
    rows = []
    for fmt, bits in formats:
        if quick and bits not in (4, 3):
            continue
        ppl, bpw = {SMOOTHQUANT: None}, None
        for name, method in METHODS.items():
            weights, b = quantized(params, fmt, method, calib, cfg)
            ppl[name] = None if weights is None else float(np.exp(_llama.nll(weights, cfg, held, windows=windows)))
            bpw = bpw or b
        rows.append((fmt, bits, bpw, ppl))
    smooth = smoothed(params, cfg, calib) if w8a8_rows else None
    for name, per in w8a8_rows:
        ppl = dict.fromkeys(METHODS)
        for method, p in (("round to nearest", params), (SMOOTHQUANT, smooth)):
            nll, bpw = w8a8(p, cfg, held, per == "token", windows)
            ppl[method] = float(np.exp(nll))
        rows.append((name, 8, bpw, ppl))
    return {"steps": steps, "trained_s": seconds, "methods": [*METHODS, SMOOTHQUANT],
            "float32": float(np.exp(_llama.nll(params, cfg, held, windows=windows))), "rows": rows,
            "files": write_files(params, cfg, calib, _cache_path(cfg, steps).with_suffix(""))}


GGUF_TYPE = "Q4_K"  # the quantized GGUF the example writes, with its importance matrix


def write_files(params, cfg, calib, stem):
    """The model for llama.cpp, beside its cached weights: ``STEM.gguf`` (float32),
    ``STEM.imatrix.gguf`` (the importance matrix of ``calib``, llama.cpp's file) and
    ``STEM-Q4_K.gguf`` (the linear layers quantized with it: the bytes ``llama-quantize --imatrix``
    writes from the other two). Their paths; none where the directory is not writable."""
    collectors = {n: qa.observers.ImportanceMatrix().update(x) for n, x in calib.items()}
    files = [Path(f"{stem}.gguf"), Path(f"{stem}.imatrix.gguf"), Path(f"{stem}-{GGUF_TYPE}.gguf")]
    try:
        stem.parent.mkdir(parents=True, exist_ok=True)
        write_gguf(files[0], params, cfg)
        imatrix.save(files[1], {_gguf_name(n): m for n, m in collectors.items()},
                     datasets=[f"pydoc_data.topics: {len(next(iter(calib.values())))} tokens of the training text"],
                     chunk_size=cfg["ctx"])
        write_gguf(files[2], params, cfg, GGUF_TYPE, {n: m.result() for n, m in collectors.items()})
    except OSError:
        return []
    return files


def _gguf_name(name):
    layer, _, short = name.rpartition(".")
    return GGUF_NAMES[short].format(i=layer)


def show(res, backend):
    base = res["float32"]
    rows = [("float32", 32, "32.00", f"{base:.3f}", *[""] * (len(res["methods"]) - 1))]
    rows += [(fmt, bits, f"{bpw:.2f}", *("-" if ppl[m] is None else f"{ppl[m]:.3f} ({100 * (ppl[m] / base - 1):+.1f}%)"
                                          for m in res["methods"])) for fmt, bits, bpw, ppl in res["rows"]]
    trained = f"trained {res['steps']} steps in {res['trained_s']:.0f} s" if res["trained_s"] else "cached weights"
    _common.print_table("held-out perplexity of a byte-level llama (pydoc_data.topics)",
                        ["weights", "bits", "bits a weight", *res["methods"]], rows,
                        caption=f"every linear layer quantized (vs float32 in brackets); {trained}")
    for path in res["files"]:
        print(f"wrote {path}")


def main(argv=None) -> int:
    return _common.main(NAME, __doc__, argv, run, show, needs=("rich",))


if __name__ == "__main__":
    raise SystemExit(main())
