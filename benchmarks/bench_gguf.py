"""GGUF benchmark: open, dequantize, quantize and convert, against gguf-py and ggml.

Run from the repository root:

    PYTHONPATH=. python benchmarks/bench_gguf.py [OUTDIR] [--quick] [--ggml PATH]

PATH (or the environment variable QARRAY_GGML_LIB): a ``libggml-base`` shared library, built as
tests/data/ggml/make_vectors.py says, called through ctypes (llama.cpp 0c1e570's ggml.h and
gguf.h); without one, ggml's rows are skipped. The rows:

- open a ~1 GB llama-like GGUF (291 Q4_K/Q6_K/F32 tensors of random bytes, 32000-string
  vocabulary): ``qarray.io.gguf.read``, ``gguf.GGUFReader``, ggml's ``gguf_init_from_file``
  (no_alloc) + ``gguf_free``; all read the header only;
- dequantize Q4_K, Q6_K, IQ4_XS 4096x14336: ``qarray.dequantize`` (all threads, and 1),
  ``gguf.dequantize``, ggml's type traits' ``to_float`` (1 thread, one call, into a new array);
- quantize 4096x4096 normal float32 to Q4_K (``ggml_quantize_chunk``; gguf-py has no Q4_K
  quantizer), Q8_0 and Q4_0 (and ``gguf.quantize``);
- convert a ~1 GB F16 GGUF to Q8_0, file to file: qarray's read + quantize + save, gguf-py's
  GGUFReader + quantize + GGUFWriter;
- convert a ~1 GB GPTQ checkpoint (4-bit, symmetric, groups of 32: TinyLlama-1.1B's shapes, the
  embeddings float16) to a Q4_0 GGUF:
  ``qarray convert``'s path (``qarray.load`` + ``io.checkpoint``'s exact carry-over + ``qarray.save``:
  the same codes and float16 scales), against what llama.cpp's converter does (its
  ``dequant_gptq``, in NumPy, then ``gguf.quantize`` to Q4_0 and ``GGUFWriter``: a lossy
  requantization, not the same bytes; the table gives the share of its codes that differ);
- ggml's C reader accepts qarray's files (every type, every metadata value type): PASS/FAIL.

Each contender's first result is checked (identical float32 bits, identical bytes), then they
take turns as in _timing.timeit: 5 turns (3 for Q4_K quantize and the conversion), a fast one
timed 3 calls a turn. Medians with min-max; ratios qarray / peer of medians. Results go to
OUTDIR/bench_gguf.{json,txt} (default benchmarks/results). ``--quick``: a few MB, small shapes.
``--only convert_gptq``: that row alone, to OUTDIR/bench_gguf_convert_gptq.{json,txt}.
"""

from __future__ import annotations

import argparse
import ctypes as c
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _timing import RESULTS, cpu, write  # noqa: E402  (OMP_WAIT_POLICY and OpenBLAS's settings, before NumPy)
import numpy as np  # noqa: E402
import gguf  # noqa: E402
import numba  # noqa: E402
import qarray  # noqa: E402
import qarray.io.gguf as qgguf  # noqa: E402
import qarray.io.hf  # noqa: E402
from qarray.cli.convert import carry_over  # noqa: E402
from qarray._config import THREADS  # noqa: E402

T = gguf.GGMLQuantizationType
LINES, ROWS = [], []


def say(text=""):
    print(text, flush=True)
    LINES.append(text)


class Ggml:
    """The C functions of libggml-base used here."""

    class Traits(c.Structure):  # ggml.h struct ggml_type_traits
        _fields_ = [("type_name", c.c_char_p), ("blck_size", c.c_int64), ("blck_size_interleave", c.c_int64),
                    ("type_size", c.c_size_t), ("is_quantized", c.c_bool), ("to_float", c.c_void_p),
                    ("from_float_ref", c.c_void_p)]

    class Params(c.Structure):  # gguf.h struct gguf_init_params
        _fields_ = [("no_alloc", c.c_bool), ("ctx", c.POINTER(c.c_void_p))]

    TO_FLOAT = c.CFUNCTYPE(None, c.c_void_p, c.c_void_p, c.c_int64)
    P, I64, SZ = c.c_void_p, c.c_int64, c.c_size_t
    SIGNATURES = {"ggml_get_type_traits": (c.POINTER(Traits), c.c_int),
                  "ggml_quantize_chunk": (SZ, c.c_int, P, P, I64, I64, I64, P), "ggml_free": (None, P),
                  "gguf_init_from_file": (P, c.c_char_p, Params), "gguf_free": (None, P),
                  "gguf_get_n_tensors": (I64, P), "gguf_get_n_kv": (I64, P), "gguf_find_key": (I64, P, c.c_char_p),
                  "gguf_get_kv_type": (c.c_int, P, I64), "gguf_get_data_offset": (SZ, P),
                  "gguf_get_tensor_name": (c.c_char_p, P, I64), "gguf_get_tensor_type": (c.c_int, P, I64),
                  "gguf_get_tensor_offset": (SZ, P, I64), "ggml_version": (c.c_char_p,), "ggml_commit": (c.c_char_p,),
                  "ggml_get_tensor": (P, P, c.c_char_p), "ggml_get_data": (P, P), "ggml_nbytes": (SZ, P)}

    def __init__(self, path):
        self.lib = c.CDLL(str(path))
        for name, (res, *args) in self.SIGNATURES.items():
            f = getattr(self.lib, name)
            f.restype, f.argtypes = res, args

    def __getattr__(self, name):  # ggml.gguf_free(...) is the C function
        return getattr(self.lib, name)

    def open(self, path, ctx=None):
        """gguf_init_from_file: header only (ctx None), else the data too, into a new ggml context."""
        g = self.gguf_init_from_file(os.fsencode(path), self.Params(ctx is None, None if ctx is None else c.pointer(ctx)))
        if not g:
            raise RuntimeError(f"ggml's gguf_init_from_file refused {path}")
        return g

    def to_float(self, raw, type_id, shape):
        y = np.empty(shape, np.float32)
        self.TO_FLOAT(self.ggml_get_type_traits(type_id).contents.to_float)(raw.ctypes.data, y.ctypes.data, y.size)
        return y

    def quantize(self, x, type_id):
        out = np.empty(gguf.quant_shape_to_byte_shape(x.shape, type_id), np.uint8)
        self.ggml_quantize_chunk(type_id, x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1], None)
        return out


def turns(rounds, fns):
    """``({name: [ms]}, {name: first result})``: a first call each (its result is what gets checked), then
    the functions take turns, ``rounds`` times; a fast one (first call under 0.1 s) runs untimed for 30 ms
    before its turn and is timed 3 calls a turn (_timing.timeit's reasons); a slow one once a turn."""
    first, slow, times = {}, {}, {k: [] for k in fns}
    for k, f in fns.items():
        t0 = time.perf_counter()
        first[k] = f()
        slow[k] = time.perf_counter() - t0 > 0.1
    for _ in range(rounds):
        for k, f in fns.items():
            settle = time.perf_counter() + 0.03
            while not slow[k] and time.perf_counter() < settle:
                f()
            for _ in range(1 if slow[k] else 3):
                t0 = time.perf_counter()
                f()
                times[k].append((time.perf_counter() - t0) * 1e3)
    return times, first


def table(task, times):
    """Print and record ``times`` of ``task``: each contender's median (min-max), the peers' with
    qarray / peer of the medians."""
    ours = [k for k in times if k.startswith("qarray")]
    say(f"{task}")
    for who, v in times.items():
        med = statistics.median(v)
        ratios = {o: statistics.median(times[o]) / med for o in ours if who not in ours}
        text = "  ".join(f"{r:.3f}" + (f" ({o.split('(')[-1]}" if len(ours) > 1 else "") for o, r in ratios.items())
        say(f"  {who:<40} {med:10.2f} ms ({min(v):9.2f} - {max(v):9.2f}), n={len(v):<2} "
            + (f"qarray/this {text}" if ratios else ""))
        ROWS.append(dict(task=task, who=who, median_ms=round(med, 3), min_ms=round(min(v), 3), max_ms=round(max(v), 3),
                         runs=len(v), qarray_over_this={o: round(r, 4) for o, r in ratios.items()}))


def metadata(vocab):
    words = [f"\u2581w{i:x}" + "abcdefgh"[: i % 9] for i in range(vocab)]
    return {"general.architecture": "llama", "general.name": "bench", "general.file_type": np.uint32(15),
            "llama.block_count": np.uint32(32), "llama.context_length": np.uint32(4096),
            "llama.attention.layer_norm_rms_epsilon": np.float32(1e-5), "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": words, "tokenizer.ggml.scores": -np.arange(vocab, dtype=np.float32),
            "tokenizer.ggml.token_type": np.ones(vocab, np.int32), "tokenizer.ggml.bos_token_id": np.uint32(1)}


def llama(layers, embd, ff, vocab):
    """``[(name, shape, kind)]`` of a llama-like model: kind "w", "down" (Q6_K in Q4_K_M) or "norm"."""
    out = [("token_embd.weight", (vocab, embd), "w")]
    for i in range(layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (embd,), "norm"), (b + "ffn_norm.weight", (embd,), "norm")]
        out += [(b + f"attn_{n}.weight", (embd, embd), "w") for n in ("q", "k", "v", "output")]
        out += [(b + "ffn_gate.weight", (ff, embd), "w"), (b + "ffn_up.weight", (ff, embd), "w"),
                (b + "ffn_down.weight", (embd, ff), "down")]
    return out + [("output_norm.weight", (embd,), "norm"), ("output.weight", (vocab, embd), "down")]


def bench_open(tmp, ggml, quick, rng):
    shapes = llama(*((2, 256, 512, 2000) if quick else (32, 2048, 5632, 32000)))
    pool = np.frombuffer(rng.bytes(max(s[0] * s[1] for _, s, _ in shapes if len(s) == 2)), np.uint8)
    tensors = {}
    for name, shape, kind in shapes:
        if kind == "norm":
            tensors[name] = np.ones(shape, np.float32)
            continue
        qt = T.Q6_K if kind == "down" else T.Q4_K
        rows = gguf.quant_shape_to_byte_shape(shape, qt)[1]
        tensors[name] = qarray.QArray.from_blocks(pool[:shape[0] * rows].reshape(shape[0], rows), qt.name)
    path = tmp / "model.gguf"
    qarray.save(path, tensors, metadata=metadata(2000 if quick else 32000))
    fns = {"qarray io.gguf.read": lambda: qgguf.read(path), "gguf-py GGUFReader": lambda: gguf.GGUFReader(path)}
    if ggml:
        fns["ggml gguf_init_from_file + gguf_free"] = lambda: ggml.gguf_free(ggml.open(path))
    times, first = turns(5, fns)
    assert len(first["qarray io.gguf.read"][0]) == len(first["gguf-py GGUFReader"].tensors) == len(shapes)
    table(f"open GGUF {path.stat().st_size / 1e6:.0f} MB, {len(shapes)} tensors, header only", times)
    path.unlink()


F16_AT = {"Q4_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)}  # the float16 scales' bytes (ggml-common.h)


def random_blocks(name, rows, cols, rng):
    """Random bytes of ``name``'s blocks, their float16 scales finite (as a quantizer writes them)."""
    block, nbytes = gguf.GGML_QUANT_SIZES[T[name]]
    raw = np.frombuffer(rng.bytes(rows * cols // block * nbytes), np.uint8).reshape(-1, nbytes).copy()
    for at in F16_AT[name]:
        raw[:, at:at + 2] = (rng.standard_normal((len(raw), 1)) * 0.01).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def bench_dequantize(ggml, quick, rng):
    rows, cols = (256, 2048) if quick else (4096, 14336)
    for name in ("Q4_K", "Q6_K", "IQ4_XS"):
        raw = random_blocks(name, rows, cols, rng)
        q = qarray.QArray.from_blocks(raw, name)

        def one_thread(q=q, n=THREADS[0]):
            qarray.set_num_threads(1)
            try:
                return qarray.dequantize(q)
            finally:
                qarray.set_num_threads(n)
        fns = {f"qarray dequantize ({THREADS[0]} threads)": lambda q=q: qarray.dequantize(q),
               "qarray dequantize (1 thread)": one_thread,
               "gguf-py dequantize": lambda raw=raw, name=name: gguf.dequantize(raw, T[name])}
        if ggml:
            fns["ggml to_float (1 thread)"] = lambda raw=raw, name=name: ggml.to_float(raw, T[name], (rows, cols))
        times, first = turns(5, fns)
        bits = [v.view(np.uint32) for v in first.values()]
        assert all(b.shape == (rows, cols) and np.array_equal(b, bits[0]) for b in bits), f"{name}: results differ"
        table(f"dequantize {name} {rows}x{cols} (float32 bits identical)", times)


def bench_quantize(ggml, quick, rng):
    n = 512 if quick else 4096
    x = rng.standard_normal((n, n), dtype=np.float32)
    for name in ("Q4_K", "Q8_0", "Q4_0"):
        fns = {"qarray quantize": lambda name=name: qarray.quantize(x, dtype=name).data}
        if name != "Q4_K":  # gguf-py has no K-quant quantizers
            fns["gguf-py quantize"] = lambda name=name: gguf.quantize(x, T[name])
        if ggml:
            fns["ggml ggml_quantize_chunk (1 thread)"] = lambda name=name: ggml.quantize(x, T[name])
        if len(fns) == 1:
            say(f"quantize {name}: no peer (gguf-py has no {name} quantizer; no ggml library given)")
            continue
        times, first = turns(3 if name == "Q4_K" else 5, fns)
        out = list(first.values())
        assert all(np.array_equal(o, out[0]) for o in out), f"{name}: bytes differ"
        table(f"quantize {name} {n}x{n} float32 (bytes identical)", times)


def raw_bytes(t):
    """The bytes a GGUF file holds of ``t`` (a QArray or an ndarray), as uint8."""
    return np.ascontiguousarray(t.data if isinstance(t, qarray.QArray) else t).view(np.uint8)


def convert_qarray(src, dst):
    tensors, meta = qgguf.read(src)
    qarray.save(dst, {k: qarray.quantize(t, dtype="Q8_0") if t.ndim == 2 else t for k, t in tensors.items()},
                metadata=meta)


def convert_ggufpy(src, dst):
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, arch=str(r.fields["general.architecture"].contents()))
    for key, f in r.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            w.add_key_value(key, f.contents(), f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    for t in r.tensors:
        if t.tensor_type == T.F16:
            w.add_tensor(t.name, gguf.quantize(t.data.astype(np.float32), T.Q8_0), raw_dtype=T.Q8_0)
        else:
            w.add_tensor(t.name, t.data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def bench_convert(tmp, quick, rng):
    shapes = llama(*((1, 256, 512, 2000) if quick else (8, 2048, 5632, 32000)))
    pool = rng.standard_normal(max(np.prod(s) for _, s, _ in shapes), np.float32).astype(np.float16)
    tensors = {name: np.ones(s, np.float32) if kind == "norm" else pool[:np.prod(s)].reshape(s)
               for name, s, kind in shapes}
    src = tmp / "f16.gguf"
    qarray.save(src, tensors, metadata=metadata(2000 if quick else 32000))
    del pool, tensors
    outs = {"qarray read + quantize + save": tmp / "q8_qarray.gguf", "gguf-py GGUFReader + quantize + GGUFWriter":
            tmp / "q8_ggufpy.gguf"}
    convert = dict(zip(outs, (convert_qarray, convert_ggufpy)))
    times, _ = turns(3, {k: lambda k=k: convert[k](src, outs[k]) for k in outs})
    a, b = (qgguf.read(p)[0] for p in outs.values())
    data = [[raw_bytes(t) for t in d.values()] for d in (a, b)]
    assert list(a) == list(b) and all(map(np.array_equal, *data)), "the Q8_0 files' tensors differ"
    table(f"convert F16 GGUF {src.stat().st_size / 1e6:.0f} MB to Q8_0, file to file (tensor bytes identical)",
          times)


def gptq_checkpoint(tmp, quick, rng):
    """A GPTQ checkpoint directory (v1, 4-bit, symmetric, groups of 32) of llama shapes: random codes,
    positive float16 scales; and its float tensors (norms)."""
    shapes = llama(*((1, 256, 512, 2000) if quick else (22, 2048, 5632, 32000)))  # TinyLlama-1.1B's shapes
    arrays = {}
    for name, s, kind in shapes:
        if kind == "norm" or name.startswith(("token_embd", "output.")):
            arrays[name] = np.ones(s, np.float16)
            continue
        n, k = s
        p = name[: -len(".weight")]
        arrays[f"{p}.qweight"] = rng.integers(-2**31, 2**31, (k // 8, n), dtype=np.int64).astype(np.int32)
        arrays[f"{p}.qzeros"] = np.full((k // 32, n // 8), 0x77777777, np.int32)  # v1: 8 - 1 in every field
        arrays[f"{p}.scales"] = (rng.random((k // 32, n), np.float32) * 0.01 + 1e-3).astype(np.float16)
        arrays[f"{p}.g_idx"] = np.arange(k, dtype=np.int32) // 32
    path = tmp / "gptq"
    qarray.io.hf.write(path, arrays, {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True,
                                      "desc_act": False, "checkpoint_format": "gptq"})
    return path


def dequant_gptq(qweight, qzeros, scales, g_idx, bits=4):
    """llama.cpp's ``dequant_gptq`` (convert_hf_to_gguf), in NumPy: the float32 weight [N, K]."""
    wf = np.arange(0, 32, bits, dtype=np.int32)[None, :, None]
    mask = (1 << bits) - 1
    weight = ((qweight[:, None, :] >> wf) & mask).reshape(-1, qweight.shape[1])
    zeros = ((qzeros[:, :, None] >> wf[0].T[None]) & mask).reshape(qzeros.shape[0], -1) + 1
    return (scales[g_idx].astype(np.float32) * (weight - zeros[g_idx]).astype(np.float32)).T


def convert_gptq_qarray(src, dst):
    tensors = qarray.load(src)
    qarray.save(dst, {k: carry_over(t, "gguf") if isinstance(t, qarray.QArray) else t for k, t in tensors.items()},
                metadata={"general.architecture": "llama"})


def convert_gptq_llamacpp(src, dst):
    st = qarray.io.hf.Tensors(src)
    w = gguf.GGUFWriter(dst, arch="llama")
    for name in st.names():
        if name.endswith((".qzeros", ".scales", ".g_idx")):
            continue
        if name.endswith(".qweight"):
            p = name[: -len(".qweight")]
            x = dequant_gptq(st[name], st[f"{p}.qzeros"], st[f"{p}.scales"], st[f"{p}.g_idx"])
            w.add_tensor(f"{p}.weight", gguf.quantize(x, T.Q4_0), raw_dtype=T.Q4_0)
        else:
            w.add_tensor(name, st[name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def bench_convert_gptq(tmp, quick, rng):
    src = gptq_checkpoint(tmp, quick, rng)
    size = sum(f.stat().st_size for f in src.iterdir())
    outs = {"qarray load + exact carry-over + save": tmp / "q40_qarray.gguf",
            "llama.cpp's dequant_gptq (NumPy) + gguf-py quantize + GGUFWriter": tmp / "q40_llamacpp.gguf"}
    convert = dict(zip(outs, (convert_gptq_qarray, convert_gptq_llamacpp)))
    times, _ = turns(3, {k: lambda k=k: convert[k](src, outs[k]) for k in outs})
    a, b = (qgguf.read(p)[0] for p in outs.values())
    ours = qarray.load(src)
    differ = []
    for name, q in ours.items():
        if isinstance(q, qarray.QArray):
            g = qarray.io.hf.from_qarray(q)
            assert np.array_equal(a[name].int_repr(), g.codes) and \
                np.array_equal(a[name].fields["d"].reshape(g.scale.shape), g.scale), f"{name}: not carried over"
            differ.append(np.mean(b[name].int_repr() != g.codes))
    table(f"convert a GPTQ checkpoint of {size / 1e6:.0f} MB to Q4_0 GGUF (qarray: the same codes and scales; "
          f"llama.cpp's way requantizes: {100 * np.mean(differ):.1f}% of its codes differ)", times)


def check_ggml_reads_qarray(tmp, ggml, rng):
    """ggml's C reader opens a qarray-written GGUF of every type qarray writes and metadata of every value
    type, alignment 64; its counts, keys, value types, tensor names, types and offsets agree."""
    tensors, types, read_only = {}, [], []  # ggml type ids as gguf-py has them; GGUF value type ids spelled out
    for qt, (block, _) in gguf.GGML_QUANT_SIZES.items():
        if block > 1:  # the block types: those qarray quantizes (the others, read only, refuse with TypeError)
            try:
                tensors[qt.name.lower()] = qarray.quantize(rng.standard_normal((3, 512), np.float32), dtype=qt.name)
                types.append(qt.value)
            except TypeError:
                read_only.append(qt.name)
    plain = {"f32": (0, "f4"), "f16": (1, "f2"), "f64": (28, "f8"), "i8": (24, "i1"), "i16": (25, "i2"),
             "i32": (26, "i4"), "i64": (27, "i8"), "bf16": (30, "bfloat16")}
    for name, (tid, code) in plain.items():
        try:
            dt = np.dtype(__import__("ml_dtypes").bfloat16) if code == "bfloat16" else np.dtype("<" + code)
        except ImportError:  # BF16 without ml_dtypes
            continue
        tensors[name] = (rng.standard_normal((2, 3, 5 + 7 * len(types))) * 100).astype(dt)
        types.append(tid)
    values = dict(zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), ("u1", "i1", "u2", "i2", "u4", "i4", "f4", "?", "u8",
                                                              "i8", "f8")))
    meta, kinds = {"general.alignment": np.uint32(64), "v.str": "h\u00e9llo", "a.str": ["a", "", "\u2581b"]}, [4, 8, 9]
    for tid, code in values.items():
        meta[f"v.{code}"], meta[f"a.{code}"] = np.dtype(code).type(1), np.arange(5).astype(code)
        kinds += [tid, 9]
    path = tmp / "every_type.gguf"
    qarray.save(path, tensors, metadata=meta)
    offsets = np.cumsum([0] + [-(-t.nbytes // 64) * 64 for t in tensors.values()])
    g, bad = ggml.open(path), []
    try:
        if ggml.gguf_get_n_tensors(g) != len(tensors) or ggml.gguf_get_n_kv(g) != len(meta):
            bad.append("counts")
        if ggml.gguf_get_data_offset(g) != path.stat().st_size - offsets[-1]:
            bad.append("data offset")
        bad += [k for i, k in enumerate(meta) if ggml.gguf_find_key(g, k.encode()) != i
                or ggml.gguf_get_kv_type(g, i) != kinds[i]]
        bad += [k for i, k in enumerate(tensors) if ggml.gguf_get_tensor_name(g, i).decode() != k
                or ggml.gguf_get_tensor_type(g, i) != types[i] or ggml.gguf_get_tensor_offset(g, i) != offsets[i]]
    finally:
        ggml.gguf_free(g)
    ctx = c.c_void_p()
    ggml.gguf_free(ggml.open(path, ctx))  # and with every tensor's data read into a ggml context
    for name, t in tensors.items():  # the bytes ggml read are those qarray wrote
        g = ggml.ggml_get_tensor(ctx, name.encode())
        if not g or c.string_at(ggml.ggml_get_data(g), ggml.ggml_nbytes(g)) != raw_bytes(t).tobytes():
            bad.append(f"{name} data")
    ggml.ggml_free(ctx)
    say(f"ggml's C reader accepts qarray's files ({len(tensors)} tensors: {', '.join(tensors)}; {len(meta)} keys of "
        f"every GGUF value type, alignment 64; the data ggml reads is qarray's): {'FAIL: ' + ', '.join(bad) if bad else 'PASS'}")
    ROWS.append(dict(task="ggml's C reader accepts qarray's files", ggml_types=types, not_quantized=read_only,
                     keys=len(meta), passed=not bad, mismatches=bad))
    return not bad


def _git(*args):
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()


def machine(ggml, ggml_path, quick):
    return dict(platform=platform.platform(), **cpu(), cpu_count=os.cpu_count(),
                date=datetime.datetime.now().isoformat(timespec="seconds"),
                python=platform.python_version(), numpy=np.__version__, numba=numba.__version__,
                qarray=_git("rev-parse", "--short", "HEAD") + (" + edits" if _git("status", "-s", "qarray") else ""),
                gguf_py=version("gguf"), ggml=ggml and f"{ggml.ggml_version().decode()} "
                f"({ggml.ggml_commit().decode()}) {ggml_path}", qarray_threads=THREADS[0],
                numba_threads=numba.config.NUMBA_NUM_THREADS, quick=quick)


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("outdir", nargs="?", type=Path, default=RESULTS, help="where the .json and .txt go")
    p.add_argument("--quick", action="store_true", help="small sizes: seconds, not a measurement")
    p.add_argument("--ggml", default=os.environ.get("QARRAY_GGML_LIB"), help="libggml-base shared library")
    p.add_argument("--only", choices=["convert_gptq"], help="one row alone, to bench_gguf_ROW.{json,txt}")
    args = p.parse_args()
    ggml = Ggml(args.ggml) if args.ggml else None
    info = machine(ggml, args.ggml, args.quick)
    say("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    say(f"threads: qarray {THREADS[0]} (Numba kernels; its block quantizers are NumPy, 1 thread), gguf-py NumPy "
        "(1 thread), ggml's to_float and ggml_quantize_chunk 1 thread (libggml-base: the reference C code, -O3)")
    say("times: median (min - max) ms over n runs after a first, checked call; ratios qarray / this of medians")
    if not ggml:
        say("ggml: no library given (--ggml PATH or QARRAY_GGML_LIB): its rows, and the check that ggml's C "
            "reader accepts qarray's files, are skipped")
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ok = None
        if args.only is None:
            ok = check_ggml_reads_qarray(tmp, ggml, rng) if ggml else None
            bench_open(tmp, ggml, args.quick, rng)
            bench_dequantize(ggml, args.quick, rng)
            bench_quantize(ggml, args.quick, rng)
            bench_convert(tmp, args.quick, rng)
        bench_convert_gptq(tmp, args.quick, rng)
    info["load_avg_1m_end"] = os.getloadavg()[0]
    say(f"total {time.perf_counter() - start:.0f} s; load average (1 min) {info['load_avg_1m']:.2f} at the start, "
        f"{info['load_avg_1m_end']:.2f} at the end")
    write(args.outdir, "bench_gguf" + (f"_{args.only}" if args.only else ""), LINES, machine=info, rows=ROWS)
    sys.exit(0 if ok in (None, True) else 1)


if __name__ == "__main__":
    main()
