#!/usr/bin/env python3
"""Regenerate the Hugging Face quantized-checkpoint test vectors in this folder.

Each case is a folder ``<case>/`` holding

* ``config.json``        -- ``quantization_config`` as the writing library produces it
* ``model.safetensors``  -- the packed tensors of two quantized linear layers
* ``expected.safetensors`` -- for each layer ``<prefix>.weight``: the reading library's
  OWN dequantized weight, in the dtype that library returns (float16 or bfloat16,
  stored raw, not widened), in the float weight's ``[N, K]`` orientation.
* a few cases also carry ``expected_<oracle>.safetensors`` where two oracles disagree
  (see README.md).

Oracles (one venv, CPU only; nothing here runs at test time)::

    python3 -m venv /tmp/hfvec
    /tmp/hfvec/bin/pip install torch==2.13.0 numpy safetensors   # the CPU wheel on disk
    /tmp/hfvec/bin/pip install compressed-tensors==0.17.1        # legacy 32//b packing
    /tmp/hfvec/bin/pip install --no-deps gptqmodel==7.7.0 auto-gptq==0.7.1 autoawq==0.2.9
    /tmp/hfvec/bin/pip install psutil accelerate pypcre logbar device-smi threadpoolctl \
        pillow requests
    /tmp/hfvec/bin/pip install --no-deps tokenicer==0.0.14 defuser==0.0.28
    /tmp/hfvec/bin/python tests/data/hf/make_vectors.py all      # writes every case
    /tmp/hfvec/bin/python tests/data/hf/make_vectors.py verify   # recompute, compare

Versions seen: torch 2.13.0+cpu, numpy 2.4.6, safetensors 0.8.0, transformers 5.25.0
(pulled by compressed-tensors), gptqmodel 7.7.0 (declares torch>=2.14.1: installed with
--no-deps; the modules used here run on 2.13), auto-gptq 0.7.1, autoawq 0.2.9,
compressed-tensors 0.17.1.

Stubs (only to get the pure-torch modules imported; no numerical code is replaced):

* auto_gptq: its package ``__init__`` (modeling, perplexity utils) is not run
  (``stub_pkg``); ``datasets`` is a placeholder module; transformers 5 lacks
  ``modeling_utils.no_init_weights`` and ``utils.hub.{create_commit, create_repo,
  CommitOperationAdd}``, which are filled in (nullcontext / huggingface_hub's) so that
  ``auto_gptq.modeling._base.BaseQuantizeConfig`` imports.  The CUDA extension is
  absent, so ``QuantLinear.forward`` takes its torch fallback.
* awq: the package ``__init__`` files of ``awq``, ``awq.modules``,
  ``awq.modules.linear`` and ``awq.models`` are not run (they import every model and
  kernel); ``gemm.py``, ``gemv.py``, ``utils/packing_utils.py`` and
  ``models/_config.py`` are imported as they are.
* gptqmodel, compressed_tensors: imported normally.

Test data: codes, zero points and scales are chosen first (see ``make_params``): a
round-to-nearest quantization of random normal rows, then rows forced to hold codes 0
and qmax, a constant row, an all-zero row, tiny (float16 subnormal / bfloat16 near
2**-126) and large (near float16 max) scales, and zero points 0 and qmax.  The float
weight handed to each library's packer is ``(q - z) * s`` computed exactly in float32,
so the packer's own ``round((W + z*s) / s)`` reproduces the chosen codes.
"""
import argparse
import contextlib
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent
torch.set_num_threads(1)


# --------------------------------------------------------------------------- stubs
def stub_pkg(name):
    """Register package `name` without running its __init__.py; submodules load normally."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    m = types.ModuleType(name)
    m.__path__ = list(spec.submodule_search_locations)
    m.__spec__ = spec
    m.__file__ = spec.origin
    sys.modules[name] = m
    return m


class _Dummy:
    def __init__(self, *a, **k):
        pass

    def __call__(self, *a, **k):
        return _Dummy()

    def __getattr__(self, n):
        return _Dummy()


def stub_module(name):
    """A placeholder module whose every attribute is a do-nothing object."""
    if name in sys.modules:
        return sys.modules[name]
    m = types.ModuleType(name)
    m.__getattr__ = lambda n: _Dummy if n[:1].isupper() else _Dummy()
    m.__path__ = []
    sys.modules[name] = m
    return m


def import_autogptq():
    import transformers.modeling_utils as mu
    import transformers.utils.hub as th
    import huggingface_hub as hh
    if not hasattr(mu, "no_init_weights"):
        mu.no_init_weights = contextlib.nullcontext
    for n in ("CommitOperationAdd", "create_commit", "create_repo"):
        if not hasattr(th, n):
            setattr(th, n, getattr(hh, n))
    if "datasets" not in sys.modules and importlib.util.find_spec("datasets") is None:
        stub_module("datasets")
    stub_pkg("auto_gptq")
    from auto_gptq.nn_modules.qlinear import qlinear_cuda, qlinear_cuda_old
    from auto_gptq.modeling._base import BaseQuantizeConfig
    return qlinear_cuda.QuantLinear, qlinear_cuda_old.QuantLinear, BaseQuantizeConfig


def import_awq():
    for p in ("awq", "awq.modules", "awq.modules.linear", "awq.models"):
        stub_pkg(p)
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.modules.linear.gemv import WQLinear_GEMV
    from awq.utils import packing_utils
    from awq.models._config import AwqConfig
    return WQLinear_GEMM, WQLinear_GEMV, packing_utils, AwqConfig


def import_gptqmodel():
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.quantization.config import QuantizeConfig
    from gptqmodel.utils import model as gm
    from gptqmodel.utils import model_dequant as gmd
    return TorchLinear, QuantizeConfig, gm, gmd


# --------------------------------------------------------------------- test data
def to_dtype_exact(x, dtype):
    """float64 array -> nearest value of `dtype` (RNE), returned as float64."""
    return torch.tensor(np.asarray(x, np.float64)).to(dtype).to(torch.float64).numpy()


def act_order_g_idx(rng, K, group_size):
    """GPTQ act-order g_idx: columns quantized in a random order `perm`, group i//gs."""
    perm = rng.permutation(K)
    g = np.empty(K, np.int64)
    g[perm] = np.arange(K) // group_size
    return g


def make_params(seed, N, K, bits, group_size, sym, scale_dtype, *, g_idx=None,
                zero_min=0, sym_zero=None):
    """Codes q [N,K] in [0, 2^bits-1], zeros z [N,G] (unsigned), scales s [N,G]
    (float64 holding exact `scale_dtype` values), g_idx [K].

    Rows: 0 codes alternate 0/qmax; 1 constant (one scale, zero, code for the row);
    2 all codes equal the zero point (an exact-zero row); 3 tiny scales; 4 large scales;
    5 zero points all `zero_min` (0 unless a v1 file must avoid 0); 6 zero points all
    qmax (5 and 6 asym only); the rest: RTN of N(0, sigma_row) weights.
    """
    rng = np.random.default_rng(seed)
    maxq = (1 << bits) - 1
    gs = K if group_size == -1 else group_size
    G = math.ceil(K / gs)
    if g_idx is None:
        g_idx = np.arange(K) // gs
    g_idx = np.asarray(g_idx, np.int64)
    mid = (maxq + 1) // 2 if sym_zero is None else sym_zero

    w = rng.standard_normal((N, K)) * np.exp(rng.uniform(-5, 0, (N, 1)))
    q = np.zeros((N, K), np.int64)
    z = np.zeros((N, G), np.int64)
    s = np.zeros((N, G), np.float64)
    for g in range(G):
        cols = g_idx == g
        x = w[:, cols]
        xmin = np.minimum(x.min(1), 0)
        xmax = np.maximum(x.max(1), 0)
        if sym:
            xmax = np.maximum(-xmin, xmax)
            xmin = -xmax
            sc = to_dtype_exact((xmax - xmin) / maxq, scale_dtype)
            zz = np.full(N, mid)
        else:
            sc = to_dtype_exact((xmax - xmin) / maxq, scale_dtype)
            zz = np.clip(np.round(-xmin / sc), zero_min, maxq).astype(np.int64)
        s[:, g] = sc
        z[:, g] = zz
        q[:, cols] = np.clip(np.round(x / sc[:, None]) + zz[:, None], 0, maxq)

    # random zero points over the whole range for the asym bulk rows
    if not sym:
        bulk = slice(9, N, 2)                   # every other bulk row: random zeros
        z[bulk] = rng.integers(zero_min, maxq + 1, z[bulk].shape)
        z[7, :] = zero_min
        z[8, :] = maxq
    q[0] = np.where(np.arange(K) % 2 == 0, 0, maxq)
    q[0, 1::4] = 0                              # both extremes, not a pure pattern
    s[1, :] = s[1, 0]
    z[1, :] = z[1, 0]
    q[1, :] = maxq if z[1, 0] != maxq else 0    # constant, nonzero row
    q[2, :] = z[2, g_idx]                       # exactly zero row
    if scale_dtype == torch.float16:
        s[3] = rng.integers(1, 1024, G) * 2.0 ** -24        # subnormal float16
        s[3, 0] = 2.0 ** -24                                # smallest subnormal
        s[4] = to_dtype_exact(60000.0 / maxq * rng.uniform(0.6, 1.0, G), scale_dtype)
    else:
        s[3] = to_dtype_exact(2.0 ** -126 * rng.uniform(0.5, 4.0, G), scale_dtype)
        s[4] = to_dtype_exact(2.0 ** 100 * rng.uniform(1.0, 2.0, G), scale_dtype)
    q[3] = rng.integers(0, maxq + 1, K)
    q[4] = rng.integers(0, maxq + 1, K)
    q[4, :4] = [0, maxq, 0, maxq]
    if not sym:
        z[5, :] = zero_min
        z[6, :] = maxq
        z[4, 0] = zero_min
        if G > 1:
            z[4, 1] = maxq
    return dict(q=q, z=z, s=s, g_idx=g_idx, G=G, gs=gs, maxq=maxq)


def float_weight(p):
    """(q - z) * s per element, [N, K], exact in float32."""
    zf = p["z"][:, p["g_idx"]]
    sf = p["s"][:, p["g_idx"]]
    w = (p["q"] - zf) * sf
    w32 = w.astype(np.float32)
    assert np.array_equal(w32.astype(np.float64), w), "weight not exact in float32"
    return torch.from_numpy(w32)


def reference(p, dtype):
    """Independent check only: round((q - z) * s) once to `dtype`, [N, K]."""
    zf = p["z"][:, p["g_idx"]]
    sf = p["s"][:, p["g_idx"]]
    return torch.tensor((p["q"] - zf) * sf, dtype=torch.float64).to(dtype)


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.view(torch.int16) if a.element_size() == 2 else a,
        b.view(torch.int16) if b.element_size() == 2 else b)


def write_case(name, config, tensors, expected, extra_files=None, extra_expected=None):
    d = HERE / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    with open(d / "config.json", "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    save_file({k: v.contiguous() for k, v in expected.items()}, str(d / "expected.safetensors"))
    for fname, content in (extra_files or {}).items():
        with open(d / fname, "w") as f:
            json.dump(content, f, indent=2, sort_keys=True)
            f.write("\n")
    for oracle, exp in (extra_expected or {}).items():
        save_file({k: v.contiguous() for k, v in exp.items()}, str(d / f"expected_{oracle}.safetensors"))
    print(f"wrote {name}")


def base_config(dtype):
    return {"model_type": "qarray-test", "torch_dtype": str(dtype).replace("torch.", "")}


# ------------------------------------------------------------------------- GPTQ
GPTQ_LAYERS = [("model.layers.0.mlp.down_proj", 32, 256), ("model.layers.0.mlp.up_proj", 32, 128)]

# name, bits, sym, checkpoint_format, group_size, desc_act, zero0 writer
GPTQ_CASES = [
    ("gptq_v2_b4_asym_g32", 4, False, "gptq_v2", 32, False, None),
    ("gptq_v1_b4_sym_g128", 4, True, "gptq", 128, False, None),
    ("gptq_v1_b4_asym_g32", 4, False, "gptq", 32, False, None),
    ("gptq_v2_b2_asym_g32", 2, False, "gptq_v2", 32, False, None),
    ("gptq_v1_b2_sym_gm1", 2, True, "gptq", -1, False, None),
    ("gptq_v1_b2_asym_g128", 2, False, "gptq", 128, False, None),
    ("gptq_v2_b8_asym_gm1", 8, False, "gptq_v2", -1, False, None),
    ("gptq_v1_b8_sym_g32", 8, True, "gptq", 32, False, None),
    ("gptq_v1_b8_asym_g128", 8, False, "gptq", 128, False, None),
    ("gptq_v2_b3_asym_g32", 3, False, "gptq_v2", 32, False, None),
    ("gptq_v1_b3_sym_g128", 3, True, "gptq", 128, False, None),
    ("gptq_v1_b3_asym_gm1", 3, False, "gptq", -1, False, None),
    ("gptq_v1_b4_asym_g32_descact", 4, False, "gptq", 32, True, None),
    ("gptq_v2_b4_sym_g32_descact", 4, True, "gptq_v2", 32, True, None),
    ("gptq_v2_b3_sym_g32_descact", 3, True, "gptq_v2", 32, True, None),
    ("gptq_v1_b3_asym_g32_descact", 3, False, "gptq", 32, True, None),
    ("gptq_v1_b4_asym_g32_zero0", 4, False, "gptq", 32, False, "gptqmodel"),
    ("gptq_v1_b4_asym_g32_zero0_autogptq", 4, False, "gptq", 32, False, "autogptq"),
    ("gptq_v1_b3_asym_g32_zero0", 3, False, "gptq", 32, False, "gptqmodel"),
]


def gptq_params(case, li, N, K):
    name, bits, sym, fmt, gs, desc_act, zero0 = case
    seed = sum(map(ord, name)) * 7 + li
    rng = np.random.default_rng(seed + 1000)
    g_idx = act_order_g_idx(rng, K, gs) if desc_act else None
    # v1 stores zero-1: a true zero of 0 is only made in the *_zero0 cases
    zero_min = 1 if (fmt == "gptq" and not sym and zero0 is None) else 0
    return make_params(seed, N, K, bits, gs, sym, torch.float16, g_idx=g_idx, zero_min=zero_min)


def gptqmodel_config(QuantizeConfig, bits, gs, desc_act, sym, fmt):
    """QuantizeConfig as GPTQModel's writer (models/writer.py save_quantized) fills it."""
    from gptqmodel.version import __version__
    from gptqmodel.quantization import config as qc
    cfg = QuantizeConfig(bits=bits, group_size=gs, desc_act=desc_act, sym=sym, format=fmt,
                         offload_to_disk=False)
    cfg.meta_set_versionable(key=qc.META_FIELD_QUANTIZER, value=[f"{qc.META_QUANTIZER_GPTQMODEL}:{__version__}"])
    cfg.meta_set(key=qc.META_FIELD_URI, value=qc.META_VALUE_URI)
    cfg.meta_set(key=qc.META_FIELD_DAMP_PERCENT, value=getattr(cfg, "damp_percent", None))
    cfg.meta_set(key=qc.META_FIELD_DAMP_AUTO_INCREMENT, value=getattr(cfg, "damp_auto_increment", None))
    cfg.meta_set(key=qc.META_FIELD_STATIC_GROUPS, value=getattr(cfg, "static_groups", None))
    cfg.meta_set(key=qc.META_FIELD_TRUE_SEQUENTIAL, value=cfg.true_sequential)
    cfg.meta_set(key=qc.META_FIELD_MSE, value=getattr(cfg, "mse", None))
    cfg.meta_set(key=qc.META_FIELD_GPTAQ_ENABLED, value=None)
    cfg.meta_set(key=qc.META_FIELD_FOEM_ENABLED, value=None)
    cfg.meta_set(key=qc.META_FIELD_ACT_GROUP_AWARE, value=getattr(cfg, "act_group_aware", None))
    return cfg


def gptqmodel_module(TorchLinear, bits, gs, sym, desc_act, K, N, fmt):
    return TorchLinear(bits=bits, group_size=gs, sym=sym, desc_act=desc_act, in_features=K,
                       out_features=N, bias=False, pack_dtype=torch.int32, format=fmt)


def gptqmodel_dequant(qc, tensors, prefix, K, N):
    """GPTQModel 7.7.0 module path: TorchLinear buffers from the file; v1 files go through
    convert_gptq_v1_to_v2_format_module (what its loader does: TorchLinear REQUIRES_FORMAT_V2);
    eval(); dequantize_weight() -> [K, N] float16 (scales[g_idx] * (q - z[g_idx]), f16)."""
    TorchLinear, _, gm, _ = import_gptqmodel()
    m = gptqmodel_module(TorchLinear, qc["bits"], qc["group_size"], qc["sym"], qc["desc_act"],
                         K, N, qc["checkpoint_format"])
    sd = {k: tensors[f"{prefix}.{k}"].clone() for k in ("qweight", "qzeros", "scales", "g_idx")}
    m.load_state_dict(sd, strict=True)
    if qc["checkpoint_format"] == "gptq":
        gm.convert_gptq_v1_to_v2_format_module(m, bits=qc["bits"], pack_dtype=torch.int32)
    m.eval()
    with torch.no_grad():
        return m.dequantize_weight().T.contiguous()


def gptqmodel_file_dequant(qc, path, prefix):
    """GPTQModel 7.7.0 file converter utils/model_dequant.convert_gptq_file: v1 zeros are
    corrected field by field ((z+1) & maxq); (q - z) * s in float32, then .to(float16)."""
    _, _, _, gmd = import_gptqmodel()
    out = gmd.convert_gptq_file(Path(path), torch.float16, qc, "cpu")
    return out[f"{prefix}.weight"]


def autogptq_dequant(qc, tensors, prefix, K, N, old):
    """AutoGPTQ 0.7.1 QuantLinear (qlinear_cuda or qlinear_cuda_old) torch fallback forward of
    the identity I_K (float16): out = I @ W = W exactly, [K, N] -> [N, K]."""
    QL, QLold, _ = import_autogptq()
    cls = QLold if old else QL
    m = cls(qc["bits"], qc["group_size"], K, N, False)
    m.qweight = tensors[f"{prefix}.qweight"].clone()
    m.qzeros = tensors[f"{prefix}.qzeros"].clone()
    m.scales = tensors[f"{prefix}.scales"].clone()
    m.g_idx = tensors[f"{prefix}.g_idx"].clone()
    with torch.no_grad():
        out = m(torch.eye(K, dtype=torch.float16))
    return out.T.contiguous()


def autogptq_selected(qc):
    """qlinear AutoGPTQ 0.7.1 picks on a machine without exllama kernels
    (utils/import_utils.dynamically_import_QuantLinear): cuda_old unless desc_act and gs != -1."""
    return "cuda_old" if (not qc["desc_act"] or qc["group_size"] == -1) else "cuda"


def gen_gptq(only=None):
    TorchLinear, QuantizeConfig, gm, _ = import_gptqmodel()
    report = {}
    for case in GPTQ_CASES:
        name, bits, sym, fmt, gs, desc_act, zero0 = case
        if only and name not in only:
            continue
        tensors, expected, refs = {}, {}, {}
        layers = GPTQ_LAYERS[:1] if zero0 else GPTQ_LAYERS      # (size: they carry 4 expected files)
        for li, (prefix, N, K) in enumerate(layers):
            p = gptq_params(case, li, N, K)
            if zero0:                                   # true zero points of 0 (v1 stores -1)
                p["z"][5:, 0] = 0
                p["z"][7:, 1::2] = 0
            W = float_weight(p)
            lin = torch.nn.Linear(K, N, bias=False)
            lin.weight.data = W
            scales = torch.from_numpy(p["s"].astype(np.float32))          # [N, G]
            zeros = torch.from_numpy(p["z"].astype(np.int32))            # [N, G]
            g_idx = torch.from_numpy(p["g_idx"].astype(np.int32))
            if zero0 == "autogptq":
                QL, _, _ = import_autogptq()
                m = QL(bits, gs, K, N, False)
                m.pack(lin, scales, zeros.clone(), g_idx)
                m.scales = m.scales.to(torch.float16)   # packed from a float32 Linear
                sd = dict(qweight=m.qweight, qzeros=m.qzeros, scales=m.scales, g_idx=m.g_idx.to(torch.int32))
            else:
                m = gptqmodel_module(TorchLinear, bits, gs, sym, desc_act, K, N, fmt)
                m.pack_original(lin, scales, zeros, g_idx)
                if fmt == "gptq":       # what pack_module does for FORMAT.GPTQ
                    gm.convert_gptq_v2_to_v1_format_module(m, quantize_config=QuantizeConfig(bits=bits))
                sd = {k: getattr(m, k) for k in ("qweight", "qzeros", "scales", "g_idx")}
            for k, v in sd.items():
                tensors[f"{prefix}.{k}"] = v.detach().clone().contiguous()
            refs[prefix] = reference(p, torch.float16)
        if zero0 == "autogptq":
            _, _, BaseQuantizeConfig = import_autogptq()
            acfg = BaseQuantizeConfig(bits=bits, group_size=gs, desc_act=desc_act, sym=sym)
            acfg.model_name_or_path = name
            acfg.model_file_base_name = "model"
            qcfg = acfg.to_dict()
            qcfg_obj = None
        else:
            qcfg_obj = gptqmodel_config(QuantizeConfig, bits, gs, desc_act, sym, fmt)
            qcfg = qcfg_obj.to_dict()
        qcfg = json.loads(json.dumps(qcfg))          # as read back from config.json (enums -> str)
        qc = qcfg if "checkpoint_format" in qcfg else dict(qcfg, checkpoint_format="gptq")
        extra_exp, notes = {}, {}
        for prefix, N, K in layers:
            expected[f"{prefix}.weight"] = gptqmodel_dequant(qc, tensors, prefix, K, N)
        # other oracles
        tmp = HERE / f".{name}.tmp.safetensors"
        save_file(tensors, str(tmp))
        others = {"gptqmodel_convert": {}, "autogptq_cuda": {}, "autogptq_cuda_old": {}}
        for prefix, N, K in layers:
            others["gptqmodel_convert"][f"{prefix}.weight"] = gptqmodel_file_dequant(qc, tmp, prefix)
            if fmt == "gptq":
                others["autogptq_cuda"][f"{prefix}.weight"] = autogptq_dequant(qc, tensors, prefix, K, N, False)
                if not desc_act:
                    others["autogptq_cuda_old"][f"{prefix}.weight"] = autogptq_dequant(qc, tensors, prefix, K, N, True)
        tmp.unlink()
        for o, d in others.items():
            if not d:
                continue
            agree = all(same(d[k], expected[k]) for k in d)
            notes[o] = agree
            if not agree:
                extra_exp[o] = d
        ref_ok = all(same(refs[pf], expected[f"{pf}.weight"]) for pf, _, _ in layers)
        notes["reference_round_once"] = ref_ok
        if zero0 is None:
            assert ref_ok and all(notes.values()), (name, notes)
        report[name] = notes
        config = base_config(torch.float16)
        config["quantization_config"] = qcfg
        extra_files = {"quantize_config.json": qcfg}
        write_case(name, config, tensors, expected, extra_files, extra_exp)
    return report


# -------------------------------------------------------------------------- AWQ
AWQ_LAYERS = [("model.layers.0.mlp.down_proj", 32, 256), ("model.layers.0.mlp.up_proj", 32, 128)]
# (N % 32 == 0: WQLinear_GEMM.from_linear sizes qweight as N // 32 * w_bit columns)
AWQ_CASES = [(f"awq_{v}_g{g}", v, g) for v in ("gemm", "gemv") for g in (32, 64, 128)]


def awq_params(name, li, N, K, g):
    seed = sum(map(ord, name.replace("gemv", "gemm"))) * 7 + li   # GEMM and GEMV share codes
    return make_params(seed, N, K, 4, g, False, torch.float16)


def awq_gemm_dequant(tensors, prefix, g):
    """AutoAWQ 0.2.9 awq.utils.packing_utils.dequantize_gemm(qweight, qzeros, scales, 4, G):
    unpack_awq + reverse_awq_order, (q - z) int8, * scales in float16 -> [K, N]."""
    _, _, pu, _ = import_awq()
    w = pu.dequantize_gemm(tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"],
                           tensors[f"{prefix}.scales"], 4, g)
    return w.T.contiguous()


def awq_gemv_unpack(tensors, prefix, g, N, K):
    """GEMV: AutoAWQ has no CPU dequantization (forward is awq_ext.gemv_forward_cuda).
    Unpack its natural-order nibbles and compute (q - z) * s the way dequantize_gemm does
    (int8 difference times float16 scale) -> [N, K].  Cross-checked against the GEMM
    module packed from the same Linear, whose dequantize_gemm is the stored oracle."""
    qw = tensors[f"{prefix}.qweight"]
    qz = tensors[f"{prefix}.qzeros"]
    sc = tensors[f"{prefix}.scales"]
    sh = torch.arange(0, 32, 4, dtype=torch.int32)
    q = ((qw[:, :, None] >> sh) & 15).reshape(N, -1).to(torch.int8)
    z = ((qz[:, :, None] >> sh) & 15).reshape(N, -1).to(torch.int8)
    G = K // g
    zf = z[:, :G].repeat_interleave(g, dim=1)
    sf = sc[:, :G].repeat_interleave(g, dim=1)
    return (q - zf) * sf


def gen_awq(only=None):
    WQLinear_GEMM, WQLinear_GEMV, pu, AwqConfig = import_awq()
    report = {}
    for name, version, g in AWQ_CASES:
        if only and name not in only:
            continue
        tensors, expected = {}, {}
        notes = {}
        for li, (prefix, N, K) in enumerate(AWQ_LAYERS):
            p = awq_params(name, li, N, K, g)
            lin = torch.nn.Linear(K, N, bias=False)
            lin.weight.data = float_weight(p)
            s_ng = torch.from_numpy(p["s"].astype(np.float32))   # [N, G]
            z_ng = torch.from_numpy(p["z"].astype(np.int32))
            ref = reference(p, torch.float16)
            gemm = WQLinear_GEMM.from_linear(lin, 4, g, scales=s_ng.t().contiguous(), zeros=z_ng.t().contiguous())
            gsd = {f"{prefix}.{k}": getattr(gemm, k) for k in ("qweight", "qzeros", "scales")}
            w_gemm = awq_gemm_dequant(gsd, prefix, g)
            assert same(w_gemm, ref), name
            if version == "gemm":
                for k, v in gsd.items():
                    tensors[k] = v.detach().clone()
                expected[f"{prefix}.weight"] = w_gemm
            else:
                gemv = WQLinear_GEMV.from_linear(lin, 4, g, scales=s_ng, zeros=z_ng)
                for k in ("qweight", "qzeros", "scales"):
                    tensors[f"{prefix}.{k}"] = getattr(gemv, k).detach().clone()
                w_gemv = awq_gemv_unpack(tensors, prefix, g, N, K)
                assert same(w_gemv, w_gemm), name
                expected[f"{prefix}.weight"] = w_gemm
        qcfg = AwqConfig(zero_point=True, q_group_size=g, w_bit=4, version=version).to_transformers_dict()
        config = base_config(torch.float16)
        config["quantization_config"] = qcfg
        write_case(name, config, tensors, expected)
        report[name] = notes
    return report


# ------------------------------------------------------------ compressed-tensors
CT_LAYERS = [("model.layers.0.mlp.down_proj", 32, 256), ("model.layers.0.mlp.up_proj", 48, 128)]
# name, bits, sym, strategy, group_size, scale dtype
CT_CASES = [
    ("ct_b3_sym_g32", 3, True, "group", 32, torch.bfloat16),
    ("ct_b3_asym_g128", 3, False, "group", 128, torch.bfloat16),
    ("ct_b3_asym_channel", 3, False, "channel", None, torch.float16),
    ("ct_b5_asym_g32", 5, False, "group", 32, torch.bfloat16),
    ("ct_b5_sym_channel", 5, True, "channel", None, torch.float16),
    ("ct_b6_sym_g128", 6, True, "group", 128, torch.bfloat16),
    ("ct_b6_asym_g32", 6, False, "group", 32, torch.float16),
    ("ct_b7_asym_g128", 7, False, "group", 128, torch.bfloat16),
    ("ct_b7_sym_g32", 7, True, "group", 32, torch.bfloat16),
    ("ct_b4_asym_g32", 4, False, "group", 32, torch.bfloat16),
    ("ct_b4_sym_channel", 4, True, "channel", None, torch.bfloat16),
    ("ct_b8_asym_channel", 8, False, "channel", None, torch.bfloat16),
]


def _tree(layers):
    root = torch.nn.Module()
    for prefix, N, K in layers:
        parts = prefix.split(".")
        cur = root
        for part in parts[:-1]:
            if not hasattr(cur, part):
                cur.add_module(part, torch.nn.Module())
            cur = getattr(cur, part)
        cur.add_module(parts[-1], torch.nn.Linear(K, N, bias=False))
    return root


def ct_qconfig(bits, sym, strategy, gs):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    wargs = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy=strategy, group_size=gs)
    scheme = QuantizationScheme(targets=["Linear"], weights=wargs)
    return QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized")


def ct_decompress(config, tensors, layers):
    """compressed-tensors 0.17.1 PackedQuantizationCompressor.decompress (unpack_from_int32,
    then lifecycle.forward.dequantize: (q.to(scale dtype) - zp.to(scale dtype)) * scale,
    in the scale's dtype), scheme parsed from config.json's quantization_config."""
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    qd = dict(config["quantization_config"])
    for k in ("version", "quant_method", "sparsity_config", "transform_config"):
        qd.pop(k, None)
    qconf = QuantizationConfig.model_validate(qd)
    scheme = qconf.config_groups["group_0"]
    out = {}
    for prefix, N, K in layers:
        sd = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
        out[f"{prefix}.weight"] = PackedQuantizationCompressor.decompress(sd, scheme)["weight"]
    return out


def ct_decompress_model(config, tensors, layers, dtype):
    """Second path, as transformers loads: apply_quantization_config on a skeleton in the
    model dtype, compress_model (makes the packed parameters), load the file, decompress_model."""
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.compressors import ModelCompressor
    qd = dict(config["quantization_config"])
    for k in ("version", "quant_method", "sparsity_config", "transform_config"):
        qd.pop(k, None)
    qconf = QuantizationConfig.model_validate(qd)
    root = _tree(layers).to(dtype)
    apply_quantization_config(root, qconf)
    mc = ModelCompressor(quantization_config=qconf)
    mc.compress_model(root)
    missing, unexpected = root.load_state_dict(tensors, strict=False)
    assert not unexpected, unexpected
    mc.decompress_model(root)
    sd = root.state_dict()
    return {f"{p}.weight": sd[f"{p}.weight"] for p, _, _ in layers}


def gen_ct(only=None):
    from compressed_tensors.quantization import apply_quantization_config
    from compressed_tensors.compressors import ModelCompressor
    report = {}
    for name, bits, sym, strategy, gs, sdt in CT_CASES:
        if only and name not in only:
            continue
        root = _tree(CT_LAYERS)
        qconf = ct_qconfig(bits, sym, strategy, gs)
        apply_quantization_config(root, qconf)
        off = 1 << (bits - 1)
        refs = {}
        for li, (prefix, N, K) in enumerate(CT_LAYERS):
            seed = sum(map(ord, name)) * 7 + li
            p = make_params(seed, N, K, bits, gs if strategy == "group" else -1, sym, sdt, sym_zero=off)
            mod = root.get_submodule(prefix)
            mod.weight.data = float_weight(p)
            mod.weight_scale = torch.nn.Parameter(torch.from_numpy(p["s"]).to(sdt), requires_grad=False)
            zp = torch.from_numpy(p["z"] - off).to(torch.int8)
            if hasattr(mod, "weight_zero_point"):
                mod.weight_zero_point = torch.nn.Parameter(zp, requires_grad=False)
            refs[prefix] = reference(p, sdt)
        mc = ModelCompressor.from_pretrained_model(root, quantization_format="pack-quantized")
        mc.compress_model(root)
        tensors = {k: v.detach().clone() for k, v in root.state_dict().items()}
        d = HERE / name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        with open(d / "config.json", "w") as f:
            json.dump(base_config(sdt), f)
        mc.update_config(str(d))
        with open(d / "config.json") as f:
            config = json.load(f)
        expected = ct_decompress(config, tensors, CT_LAYERS)
        notes = {}
        notes["reference_round_once"] = all(same(refs[p], expected[f"{p}.weight"]) for p, _, _ in CT_LAYERS)
        alt = ct_decompress_model(config, tensors, CT_LAYERS, sdt)
        notes["decompress_model"] = all(same(alt[k], expected[k]) for k in expected)
        assert all(notes.values()), (name, notes)
        write_case(name, config, tensors, expected)
        report[name] = notes
    return report


# ----------------------------------------------------------------------- verify
def verify_case(d):
    """Recompute each expected file from config.json + model.safetensors with the oracle."""
    name = d.name
    config = json.loads((d / "config.json").read_text())
    tensors = load_file(str(d / "model.safetensors"))
    qc = config["quantization_config"]
    got = {}
    if name.startswith("gptq"):
        GL = [(p, N, K) for p, N, K in GPTQ_LAYERS if f"{p}.qweight" in tensors]
        qc = qc if "checkpoint_format" in qc else dict(qc, checkpoint_format="gptq")
        got["expected"] = {f"{p}.weight": gptqmodel_dequant(qc, tensors, p, K, N) for p, N, K in GL}
        got["expected_gptqmodel_convert"] = {f"{p}.weight": gptqmodel_file_dequant(qc, d / "model.safetensors", p)
                                             for p, N, K in GL}
        if qc["checkpoint_format"] == "gptq":       # AutoGPTQ reads v1 only
            got["expected_autogptq_cuda"] = {f"{p}.weight": autogptq_dequant(qc, tensors, p, K, N, False)
                                             for p, N, K in GL}
        if qc["checkpoint_format"] == "gptq" and not qc["desc_act"]:
            got["expected_autogptq_cuda_old"] = {f"{p}.weight": autogptq_dequant(qc, tensors, p, K, N, True)
                                                 for p, N, K in GL}
    elif name.startswith("awq_gemm"):
        got["expected"] = {f"{p}.weight": awq_gemm_dequant(tensors, p, qc["group_size"]) for p, N, K in AWQ_LAYERS}
    elif name.startswith("awq_gemv"):
        got["expected"] = {f"{p}.weight": awq_gemv_unpack(tensors, p, qc["group_size"], N, K) for p, N, K in AWQ_LAYERS}
    elif name.startswith("ct_"):
        got["expected"] = ct_decompress(config, tensors, CT_LAYERS)
    ok = True
    for f in sorted(d.glob("expected*.safetensors")):
        exp = load_file(str(f))
        mine = got.get(f.stem)
        if mine is None:
            print(f"  {name}/{f.name}: no recomputation"); ok = False; continue
        for k, v in exp.items():
            if not same(v, mine[k]):
                print(f"  {name}/{f.name}: {k} differs"); ok = False
    # oracles with no file of their own must agree with expected.safetensors
    exp = load_file(str(d / "expected.safetensors"))
    for stem, mine in got.items():
        if not (d / f"{stem}.safetensors").exists():
            if not all(same(exp[k], mine[k]) for k in exp):
                print(f"  {name}: {stem} differs from expected but has no file"); ok = False
    print(f"{'ok  ' if ok else 'FAIL'} {name}")
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["gptq", "awq", "ct", "all", "verify"])
    ap.add_argument("cases", nargs="*")
    a = ap.parse_args()
    if a.what == "verify":
        dirs = [p for p in sorted(HERE.iterdir()) if p.is_dir() and (p / "config.json").exists()]
        if a.cases:
            dirs = [p for p in dirs if p.name in a.cases]
        ok = all([verify_case(p) for p in dirs])
        sys.exit(0 if ok else 1)
    report = {}
    if a.what in ("gptq", "all"):
        report.update(gen_gptq(a.cases))
    if a.what in ("awq", "all"):
        report.update(gen_awq(a.cases))
    if a.what in ("ct", "all"):
        report.update(gen_ct(a.cases))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
