"""Known improvements of GPTQ, AWQ and HQQ on the lm example's model: held-out perplexity against the plain methods.

Run from the repository root, on one core:

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 NUMBA_NUM_THREADS=1 \\
        PYTHONPATH=. .venv/bin/python benchmarks/lm_improvements.py [OUTDIR] [--quick]

The model, its calibration windows (64 windows of 128 bytes of the training text) and the held-out
text are ``qarray.examples.lm``'s (the cached 600-step model, float32 held-out perplexity 4.303);
every linear layer (``wq wk wv wo w1 w3 w2`` of both layers) is quantized, the rest stays float32.
The plain methods are the example's (``lm.METHODS``: GPTQ with damping 1%, blocks of 128, no act
order, each layer's Hessian of the float model's inputs; AWQ with its scales shared and folded as
AutoAWQ does it, ``lm.awq_folded``; HQQ; ``--imatrix``). What is tried, by family of formats:

- GPTQ's own groups (``uint{4,3}_g128_f16_zp``, ``uint2_g64_f16_zp``): GPTQ's range search
  (``mse=True``); act order (``desc_act``), static groups, both; damping 10%; 256 calibration
  windows in place of 64; sequential calibration (GPTQModel's and AutoGPTQ's default: the decoder
  layers in turn, and within one the groups ``[wq wk wv]``, ``[wo]``, ``[w1 w3]``, ``[w2]``
  (``true_sequential``), each quantized on the inputs that the model with every earlier group
  already quantized gives it); AWQ then GPTQ, see below; and combinations (range search with act
  order; act order with damping 10%; AWQ then GPTQ with act order).
- GGUF's K-quants (``Q4_K``, ``Q3_K``, ``Q2_K``): GPTQ writing the K-quant (each block's scales
  and mins from ggml's own search on the block as GPTQ has updated it) against ``--imatrix``; GPTQ
  whose block search is the importance-weighted one (the same importance matrix: the imatrix
  method's search inside GPTQ's loop); act order with static groups (the one act order that keeps
  GGUF's column order: the groups' parameters come first, from the weight before any update, so
  the blocks hold their own columns); damping 10%; sequential calibration; the two together; AWQ
  then GPTQ.
- MLX's float-bias groups (``uint{4,3,2}_g64_f16_bias``): HQQ then GPTQ, in the one form that is
  well defined: HQQ's solver picks a group's scale and float zero (on the group alone: its stopping
  test reads the group's error, where ``hqq.quantize`` reads the whole weight's), GPTQ then rounds
  each column onto that grid with its error compensation. Static: every group's parameters from the
  weight before any update; dynamic: from the group as GPTQ has updated it when its first column
  comes up (as GPTQ's own parameters are). Also GPTQ with act order and static groups (MLX's format
  has no column permutation either) and sequential calibration.

AWQ then GPTQ (llm-awq's "AWQ + GPTQ"): AWQ's scales searched as AutoAWQ shares them (one for
``wq wk wv``, on the attention norm's output; one for ``wo``; one for ``w1 w3``; one for ``w2``;
``qarray.awq.search_scale`` with the format's quantizer, the layers' outputs as the loss) and
folded into the float model (``fold_rmsnorm`` into the norms, ``fold_linear`` into ``wv``'s and
``w3``'s rows), optionally AWQ's clipping search on the folded weights (not ``wq``, ``wk``, as
AutoAWQ), then the folded model's calibration inputs taken again, so each layer's Hessian is that
of the inputs the scaled layer sees (``x / s``), and GPTQ on the folded weights. The folded model is
the float model up to float32 rounding (and the clipping): the GPTQ or GGUF file of it is an
ordinary one. "AWQ (folded)" is AWQ alone on that model (AutoAWQ's whole-model order), the example's
AWQ; on the K-quants, where the example has no AWQ, it is against round to nearest. (An earlier
version of the example searched each layer alone and divided its scale back out, which no single
norm could hold for ``wq wk wv``: 0.10%, 0.12% and 0.51% better at 4, 3 and 2 bits than the
foldable form, a gain no stored model has.)

Columns: bits a weight (codes, scales and all), held-out perplexity (``exp`` of the mean negative
log-likelihood a byte over the 364 held-out windows of 128 bytes), its change from float32 and from
the row's plain method, with the standard error of that change (paired by window: ``100 *
std(d) / sqrt(364)``, ``d`` each window's difference of mean log-likelihood; windows of one text are
not independent, so read it as a scale for the differences, not as a test), and the seconds the
quantization took (Hessians, searches and calibration passes included). ``--quick``: the 3-bit
rows on the first 96 held-out windows (a check that it runs).

Results go to OUTDIR/lm_improvements.{json,txt} (default benchmarks/results).
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import datetime  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _timing import cpu, options, write  # noqa: E402
import numpy as np  # noqa: E402
import qarray as qa  # noqa: E402
from qarray import _blocks, awq, gptq, hqq  # noqa: E402
from qarray.examples import _llama, lm  # noqa: E402

CFG = lm.CONFIG
LINEARS = _llama.LINEARS
# GPTQModel's true_sequential groups of a decoder layer, in the order they are quantized
STAGES = (("wq", "wk", "wv"), ("wo",), ("w1", "w3"), ("w2",))
LINES: list[str] = []


def say(text=""):
    print(text, flush=True)
    LINES.append(text)


# -- evaluation ---------------------------------------------------------------------------------------------

def window_nll(weights, held, windows=None):
    """Each held-out window's mean negative log-likelihood a byte (``_llama.nll``'s windows, kept apart)."""
    t = CFG["ctx"]
    n = (len(held) - 1) // t
    n = n if windows is None else min(n, windows)
    out = np.empty(n)
    for s in range(0, n, 16):
        idx = np.arange(s, min(s + 16, n))[:, None] * t + np.arange(t + 1)
        w = held[idx].astype(np.int64)
        logits = _llama.forward(weights, CFG, w[:, :-1]).astype(np.float64)
        z = logits - logits.max(axis=-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
        out[s:s + len(idx)] = -np.take_along_axis(logp, w[:, 1:, None], axis=-1)[..., 0].mean(axis=1)
    return out


# -- calibration ----------------------------------------------------------------------------------------------

def inputs(params, names, windows=64):
    """The calibration inputs ``(tokens, in)`` of the linear layers ``names`` (lm.calibration's windows),
    running the model only as far as the deepest of them."""
    return lm.calibration(params, CFG, windows, names)


def hessians(calib):
    return {n: gptq.Hessian(x.shape[-1]).update(x).hessian() for n, x in calib.items()}


def linear_names(params):
    return [n for n in params if n.split(".")[-1] in LINEARS]


# -- quantizers inside GPTQ's loop: the library's grid with another parameter search -------------------------

class _Format:
    """A block format with another ``quantize`` (its block search); every other attribute the format's."""

    def __init__(self, fmt, quantize):
        self._fmt, self.quantize = fmt, quantize

    def __getattr__(self, name):
        return getattr(self._fmt, name)


def importance_grid(fmt, importance):
    """GPTQ's grid for a K-quant whose block search is ggml's importance-weighted one (the imatrix
    method's): ``importance`` (K,) the layer's importance matrix. The blocks come in column order (no
    act order, or act order with static groups), so a counter names the block."""
    f = _blocks.get(fmt)
    per_row = len(importance) // f.block
    imp = np.asarray(importance, np.float32).reshape(per_row, f.block)
    count = [0]

    def search(x32):
        i = count[0] % per_row
        count[0] += 1
        return f.quantize(x32, np.broadcast_to(imp[i], x32.shape).copy())
    return gptq._FormatGrid(_Format(f, search))


def hqq_grid(fmt):
    """GPTQ's grid for a float-bias format whose group parameters are HQQ's (its solver on the group)."""
    f = _blocks.get(fmt)

    def search(x32):
        q = hqq.quantize(x32, dtype=fmt)
        return f.unpack(np.asarray(q.data).reshape(-1, f.nbytes))
    return gptq._FormatGrid(_Format(f, search))


def run_gptq(w, fmt, h, grid=None, **kw):
    """GPTQ of ``w`` into ``fmt`` on Hessian ``h`` (``kw``: GPTQ's settings), ``grid`` a grid of one's own."""
    g = gptq.GPTQ(w, dtype=fmt, **kw)
    if grid is not None:
        g._grid = grid
    return g.quantize(hessian=h)


# -- whole-model quantizations: params -> (float32 weights of the quantized model, bits a weight) -------------

def assemble(params, qs):
    out, nbytes, count = dict(params), 0, 0
    for n, q in qs.items():
        out[n] = np.asarray(q.dequantize(), np.float32)
        nbytes, count = nbytes + q.nbytes, count + params[n].size
    return out, 8 * nbytes / count


def per_layer(params, calib, fmt, quantizer):
    """lm's way: every linear weight by ``quantizer(w, fmt, x)`` on the float model's inputs."""
    qs = {}
    for n in linear_names(params):
        q = quantizer(params[n], fmt, calib[n])
        qs[n] = q
    return assemble(params, qs)


def parallel_gptq(params, fmt, hess, grid=None, **kw):
    """GPTQ on each layer's Hessian of the float model's inputs (the example's GPTQ, with settings)."""
    return assemble(params, {n: run_gptq(params[n], fmt, hess[n], None if grid is None else grid(n), **kw)
                             for n in linear_names(params)})


def sequential_gptq(params, fmt, windows=64, grid=None, **kw):
    """GPTQ group by group (STAGES, layer by layer), each group's Hessian of the inputs that the model with
    every earlier group quantized gives it (GPTQModel's default)."""
    cur, qs = dict(params), {}
    for i in range(CFG["layers"]):
        for stage in STAGES:
            names = [f"{i}.{s}" for s in stage]
            hess = hessians(inputs(cur, names, windows))
            for n in names:
                qs[n] = run_gptq(params[n], fmt, hess[n], None if grid is None else grid(n), **kw)
                cur[n] = np.asarray(qs[n].dequantize(), np.float32)
    return assemble(params, qs)


def awq_fold(params, calib, fmt, clip):
    """AWQ's scales (shared as AutoAWQ shares them: ``lm.awq_folded``) folded into the float model, and
    (``clip``) its clipping search applied to the folded weights: the folded float model."""
    p = lm.awq_folded(params, CFG, fmt, calib)
    if clip:
        folded = inputs(p, linear_names(p))
        for n in linear_names(p):
            if n.split(".")[-1] in ("wq", "wk"):
                continue
            g = _blocks.get(fmt).block
            m = awq.search_clip(folded[n], p[n], fmt)[..., None]
            p[n] = np.clip(p[n].reshape(p[n].shape[0], -1, g), -m, m).reshape(p[n].shape).astype(np.float32)
    return p


_FOLDED = {}


def folded(params, calib, fmt, clip):
    """The folded model and its calibration inputs (kept per format and clip); without clipping, the
    largest difference of its logits from the float model's on 16 held-out windows is reported (the
    folds change the model only by float32 rounding)."""
    key = (fmt, clip)
    if key not in _FOLDED:
        p = awq_fold(params, calib, fmt, clip)
        _FOLDED[key] = (p, inputs(p, linear_names(p)))
        if not clip:
            t = CFG["ctx"]
            tokens = lm.text()[1][np.arange(16)[:, None] * t + np.arange(t)].astype(np.int64)
            a, b = _llama.forward(params, CFG, tokens), _llama.forward(p, CFG, tokens)
            FOLD_CHECK[fmt] = float(np.abs(a - b).max()), float(np.abs(a).max())
    return _FOLDED[key]


FOLD_CHECK = {}  # format -> (max |logits of the folded float model - the float model's|, max |logit|)


# -- the rows -------------------------------------------------------------------------------------------------

def rows_for(fmt, bits, params, calib, hess, ctx):
    """``[(method, plain method's name or None, build() -> (weights, bits a weight))]`` for ``fmt``."""
    zp, kq, bias = fmt.endswith("_zp"), fmt.endswith("_K"), fmt.endswith("_bias")
    rows = [("round to nearest", None, lambda: per_layer(params, calib, fmt, lm.round_to_nearest))]
    G = "GPTQ"
    rows.append((G, "round to nearest", lambda: parallel_gptq(params, fmt, hess)))
    if zp:
        rows += [
            ("AWQ", "round to nearest", lambda: lm.quantized(params, fmt, lm.activation_aware, calib, CFG)),
            ("GPTQ mse", G, lambda: parallel_gptq(params, fmt, hess, mse=True)),
            ("GPTQ act_order", G, lambda: parallel_gptq(params, fmt, hess, act_order=True)),
            ("GPTQ static_groups", G, lambda: parallel_gptq(params, fmt, hess, static_groups=True)),
            ("GPTQ act_order+static_groups", G, lambda: parallel_gptq(params, fmt, hess, act_order=True,
                                                                      static_groups=True)),
            ("GPTQ damp 0.1", G, lambda: parallel_gptq(params, fmt, hess, damp_percent=0.1)),
            ("GPTQ 256 windows", G, lambda: parallel_gptq(params, fmt, ctx["hess256"]())),
            ("GPTQ sequential", G, lambda: sequential_gptq(params, fmt)),
            ("AWQ scales -> GPTQ", G, lambda: awq_gptq(params, calib, fmt, False)),
            ("AWQ scales+clip -> GPTQ", G, lambda: awq_gptq(params, calib, fmt, True)),
            ("GPTQ mse+act_order", G, lambda: parallel_gptq(params, fmt, hess, mse=True, act_order=True)),
            ("GPTQ act_order, damp 0.1", G, lambda: parallel_gptq(params, fmt, hess, act_order=True,
                                                                  damp_percent=0.1)),
            ("AWQ scales -> GPTQ act_order", G, lambda: awq_gptq(params, calib, fmt, False, act_order=True)),
        ]
    if kq:
        imp = ctx["imatrix"]
        rows += [
            ("imatrix", "round to nearest", lambda: per_layer(params, calib, fmt, lm.importance_matrix)),
            ("GPTQ + imatrix search", G, lambda: parallel_gptq(params, fmt, hess,
                                                                grid=lambda n: importance_grid(fmt, imp[n]))),
            ("GPTQ act_order+static_groups", G, lambda: parallel_gptq(params, fmt, hess, act_order=True,
                                                                      static_groups=True)),
            ("GPTQ damp 0.1", G, lambda: parallel_gptq(params, fmt, hess, damp_percent=0.1)),
            ("GPTQ sequential", G, lambda: sequential_gptq(params, fmt)),
            ("AWQ (folded, shared scales, clip)", "round to nearest", lambda: awq_only(params, calib, fmt, True)),
            ("AWQ scales -> GPTQ", G, lambda: awq_gptq(params, calib, fmt, False)),
            ("GPTQ act_order+static_groups, sequential", G,
             lambda: sequential_gptq(params, fmt, act_order=True, static_groups=True)),
        ]
    if bias:
        rows += [
            ("HQQ", "round to nearest", lambda: per_layer(params, calib, fmt, lm.half_quadratic)),
            ("HQQ -> GPTQ static", G, lambda: parallel_gptq(params, fmt, hess, static_groups=True,
                                                            grid=lambda n: hqq_grid(fmt))),
            ("HQQ -> GPTQ dynamic", G, lambda: parallel_gptq(params, fmt, hess, grid=lambda n: hqq_grid(fmt))),
            ("GPTQ act_order+static_groups", G, lambda: parallel_gptq(params, fmt, hess, act_order=True,
                                                                      static_groups=True)),
            ("GPTQ sequential", G, lambda: sequential_gptq(params, fmt)),
        ]
    return rows


def awq_only(params, calib, fmt, clip):
    p, _ = folded(params, calib, fmt, clip)
    return assemble(p, {n: awq.quantize_weight(p[n], fmt) for n in linear_names(p)})


def awq_gptq(params, calib, fmt, clip, **kw):
    p, x = folded(params, calib, fmt, clip)
    return parallel_gptq(p, fmt, hessians(x), **kw)


FORMATS = [("uint4_g128_f16_zp", 4), ("uint3_g128_f16_zp", 3), ("uint2_g64_f16_zp", 2),
           ("Q4_K", 4), ("Q3_K", 3), ("Q2_K", 2),
           ("uint4_g64_f16_bias", 4), ("uint3_g64_f16_bias", 3), ("uint2_g64_f16_bias", 2)]


def main() -> int:
    args = options(__doc__)
    t_all = time.perf_counter()
    params, trained = lm.model(log=say)
    held = lm.text()[1]
    windows = 96 if args.quick else None
    calib = lm.calibration(params, CFG)
    hess = hessians(calib)
    ctx = {"imatrix": {n: qa.observers.ImportanceMatrix().update(x).result() for n, x in calib.items()}}
    h256 = []

    def hess256():
        if not h256:
            h256.append(hessians(lm.calibration(params, CFG, 256)))
        return h256[0]
    ctx["hess256"] = hess256
    base_w = window_nll(params, held, windows)
    base = float(np.exp(base_w.mean()))
    info = cpu()
    command = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
    say(f"lm_improvements {datetime.date.today()}: {info['cpu']}, {os.environ['OMP_NUM_THREADS']} thread(s), "
        f"numpy {np.__version__}, python {platform.python_version()}; load {info['load_avg_1m']:.2f}")
    say(f"command: {command}")
    say(f"model: qarray.examples.lm's cached weights ({lm._cache_path(CFG, lm.STEPS).name}); calibration 64 windows of "
        f"128 bytes; held-out {len(base_w)} windows of 128 bytes; float32 perplexity {base:.4f}")
    say("delta vs plain: the row's change from its plain method's perplexity, +- one standard error paired by window")
    head = f"{'method':36s} {'format':19s} {'bits':>4s} {'b/w':>5s} {'perplexity':>10s} {'vs f32':>7s}  " \
           f"{'vs plain':>20s} {'plain':18s} {'quant s':>7s}"
    say(head)
    say("-" * len(head))
    results = []
    for fmt, bits in FORMATS:
        if args.quick and bits != 3:
            continue
        done = {}
        for method, plain, build in rows_for(fmt, bits, params, calib, hess, ctx):
            t0 = time.perf_counter()
            weights, bpw = build()
            seconds = time.perf_counter() - t0
            nll = window_nll(weights, held, windows)
            ppl = float(np.exp(nll.mean()))
            done[method] = (nll, ppl)
            row = {"method": method, "format": fmt, "bits": bits, "bits_per_weight": bpw, "perplexity": ppl,
                   "delta_float32_pct": 100 * (ppl / base - 1), "plain": plain, "quant_seconds": seconds}
            vs = ""
            if plain is not None:
                d = nll - done[plain][0]
                row["delta_plain_pct"] = 100 * (ppl / done[plain][1] - 1)
                row["delta_plain_se_pct"] = 100 * float(d.std(ddof=1) / np.sqrt(len(d)))
                vs = f"{row['delta_plain_pct']:+.2f}% +- {row['delta_plain_se_pct']:.2f}%"
            results.append(row)
            say(f"{method:36s} {fmt:19s} {bits:4d} {bpw:5.2f} {ppl:10.4f} {row['delta_float32_pct']:+6.2f}%  "
                f"{vs:>20s} {plain or '':18s} {seconds:7.1f}")
        say()
    for fmt, (diff, top) in FOLD_CHECK.items():
        say(f"AWQ's folds ({fmt}'s scales, no clipping): the folded float model's logits within {diff:.2g} of the "
            f"float model's (max |logit| {top:.3g}) on 16 held-out windows")
    total = time.perf_counter() - t_all
    say(f"total {total:.0f} s")
    write(args.outdir, "lm_improvements", LINES, date=str(datetime.date.today()), command=command, **info,
          threads=os.environ["OMP_NUM_THREADS"], numpy=np.__version__, quick=args.quick,
          model=lm._cache_path(CFG, lm.STEPS).name, held_out_windows=len(base_w), calibration_windows=64,
          float32_perplexity=base, total_seconds=total, fold_check=FOLD_CHECK, rows=results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
