"""The CPU int8 GEMM engines: qarray's own kernels, and onnxruntime's MLAS
kernels, used only where exact.

``NumpyBackend.int_matmul`` runs ``A @ W`` for 8-bit (and narrower) codes.
Every operand pair is first mapped onto one unsigned-times-X pair exactly:
signed activations become unsigned by flipping the sign bit (``a + 128``, zero
point ``+ 128``); the weight side is ``s8`` (``qarray``, ``u8s8``) or ``u8``
(``u8u8``), moved the same way. The zero-point terms are the caller's (its
epilogue).

- ``qarray`` (first where Numba is installed): ``qarray.backends.cpu.gemm``,
  on AMX tiles, AVX-512 VNNI, AVX-VNNI or portable loops by the CPU
  (``cpu.isa``), the epilogue fused into each block's store.
- ``u8s8``, ``u8u8``: onnxruntime's ``MatMulInteger`` (one-node sessions,
  cached; weights that an ``nn`` layer keeps are session initializers, which
  MLAS packs once), computing raw products of codes only.

Exactness: raw ``u8 * s8`` products sum in int32, exact for ``K <= 65793``
(``u8 * u8``: ``K <= 33025``); longer ``K`` is split and the parts are summed
in int64. x86 kernels that use ``vpmaddubsw`` (AVX2 ``u8s8`` without VNNI)
saturate pairs of products at int16, so ``u8s8`` runs only where the CPU has
VNNI or AMX-INT8 (or is not x86), and every MLAS candidate passes a self-check
on extreme values (255 x -128, 255 x 127, 255 x 255) at first use; one that
fails to load or fails the check is logged once (logger ``"qarray"``) and
bypassed: ``u8s8``, then ``u8u8``, then ``"blas"``, the float32 BLAS path of
the generic backend, which is always exact. ``qarray.config.gemm`` forces one.
"""
from __future__ import annotations

import logging
import math
import platform
import uuid
from collections import OrderedDict

import numpy as np

from .._config import THREADS
from .._fixed_point import IDENTITY

log = logging.getLogger("qarray")

ENGINES = ("qarray", "u8s8", "u8u8", "blas")
_KMAX = {"u8s8": (2**31 - 1) // (255 * 128), "u8u8": (2**31 - 1) // (255 * 255)}
_state: dict = {}  # engine name -> (usable, reason); filled at first use
_sessions: dict = {}  # (weight type, threads) -> session taking the weights as an input


def _cpu_flags() -> set:
    try:
        from llvmlite import binding

        return {k for k, v in binding.get_host_cpu_features().items() if v}
    except Exception:  # no llvmlite (Numba is optional): Linux's own list
        try:
            with open("/proc/cpuinfo") as f:
                line = next(ln for ln in f if ln.startswith("flags"))
            return {t.replace("_", "") for t in line.split(":")[1].split()}
        except (OSError, StopIteration):
            return set()


def jit_flags() -> set:
    """The CPU features the Numba kernels written in LLVM IR may use: the host's,
    or none where ``NUMBA_CPU_NAME`` or ``NUMBA_CPU_FEATURES`` sets another
    target (for "generic" LLVM cannot lower their 512-bit x86 intrinsics and
    aborts the process)."""
    import numba

    if numba.config.CPU_NAME is not None or numba.config.CPU_FEATURES is not None:
        return set()
    return {f.replace("_", "") for f in _cpu_flags()}


def _vnni_or_not_x86() -> tuple[bool, str]:
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True, f"{platform.machine()} (no vpmaddubsw)"
    flags = {f.replace("_", "").replace("-", "") for f in _cpu_flags()}
    found = sorted(flags & {"avx512vnni", "avxvnni", "amxint8"})
    return bool(found), ("CPU has " + ", ".join(found)) if found else "CPU has no VNNI: u8s8 may saturate"


def _ort():
    import onnxruntime
    from onnx import TensorProto, helper, numpy_helper

    return onnxruntime, TensorProto, helper, numpy_helper


def _session(w_type, k, weight=None, threads=None):
    """A one-node ``MatMulInteger`` session: ``a`` (uint8, ``(..., M, k)``) times
    the weights, an input of ``w_type`` or the initializer ``weight``, on
    ``threads`` threads (default ``qarray.set_num_threads``')."""
    ort, tp, helper, numpy_helper = _ort()
    etype = tp.INT8 if w_type == np.int8 else tp.UINT8
    inputs = [helper.make_tensor_value_info("a", tp.UINT8, None)]
    inits = []
    if weight is None:
        inputs.append(helper.make_tensor_value_info("w", etype, None))
    else:
        inits.append(numpy_helper.from_array(np.ascontiguousarray(weight), "w"))
    graph = helper.make_graph([helper.make_node("MatMulInteger", ["a", "w"], ["y"])], "qarray_gemm", inputs,
                              [helper.make_tensor_value_info("y", tp.INT32, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads or THREADS[0], 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")  # leave the cores to Numba after a call
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _self_check(name) -> tuple[bool, str]:
    """Whether ``name``'s kernels give int64's answer on extreme codes, both as
    an input and as a packed initializer."""
    rng = np.random.default_rng(0)
    k = 96
    a = np.stack([np.full(k, 255), rng.choice([0, 1, 254, 255], k), rng.integers(0, 256, k)]).astype(np.uint8)
    if name == "u8s8":
        cols = [np.full(k, -128), np.full(k, 127), rng.choice([-128, -127, 126, 127], k), rng.integers(-128, 128, k)]
        w = np.stack(cols, axis=1).astype(np.int8)
    else:
        w = np.stack([np.full(k, 255), rng.choice([0, 255], k), rng.integers(0, 256, k)], axis=1).astype(np.uint8)
    want = a.astype(np.int64) @ w.astype(np.int64)
    for got in (_session(w.dtype.type, k).run(None, {"a": a, "w": w})[0],
                _session(w.dtype.type, k, w).run(None, {"a": a})[0]):
        if not np.array_equal(got, want):
            return False, f"self-check failed: {int(np.abs(got.astype(np.int64) - want).max())} off on extreme codes"
    return True, "self-check passed"


def status(name) -> tuple[bool, str]:
    """``(usable, why)`` for engine ``name``, decided once per process."""
    if name == "blas":
        return True, "float32 BLAS in exact chunks"
    if name == "qarray":
        return _own_status()
    if name not in _state:
        try:
            ort = _ort()[0]
        except ImportError as e:
            _state[name] = (False, f"onnxruntime/onnx not installed ({e.name}); pip install 'qarray[fast]'")
        else:
            ok, why = _vnni_or_not_x86() if name == "u8s8" else (True, "")
            try:
                if ok:
                    ok, check = _self_check(name)
                    why = f"{why}; {check}" if why else check
            except Exception as e:  # a broken install must not break matmul
                ok, why = False, f"onnxruntime {ort.__version__} failed to run: {type(e).__name__}: {e}"
            _state[name] = (ok, f"onnxruntime {ort.__version__} MLAS {name}: {why}")
        if not _state[name][0]:
            log.warning("qarray: int8 GEMM engine %s not used: %s", name, _state[name][1])
    return _state[name]


def own():
    """``qarray.backends.cpu.gemm``, qarray's own kernels (it imports Numba: loaded on first use)."""
    from .cpu import gemm

    return gemm


def _own_status() -> tuple[bool, str]:
    """qarray's own kernels: where Numba is installed, on the best
    instruction set not turned off."""
    try:
        kernels = own()
    except ImportError as e:
        return False, f"Numba not installed ({e.name}); pip install 'qarray[fast]'"
    best = kernels.best()
    return True, f"qarray's own kernels on {best}: {kernels.usable(best)[1]}"


def engine(choice: str = "auto") -> str:
    """The engine to run: ``choice`` (``qarray.config.gemm``) or, for "auto",
    the first usable of ``u8s8``, ``u8u8``, ``blas``. A forced engine that is
    not usable here raises ValueError saying why."""
    if choice != "auto":
        ok, why = status(choice)
        if not ok:
            raise ValueError(f"qarray.config.gemm = {choice!r} can not run here: {why}; use 'auto'")
        return choice
    return next(e for e in ENGINES if status(e)[0])


def packed4_kernel():
    """``cpu.gemm``, for its ``gemm_packed4``, where that runs exactly (Numba,
    AVX-512 VNNI, a self-check on extreme codes at first use), else None
    (logged once)."""
    if "packed4" not in _state:
        try:
            if not {"avx512vnni", "avx512bw"} <= jit_flags():
                raise RuntimeError("the CPU has no AVX-512 VNNI, or NUMBA_CPU_NAME / NUMBA_CPU_FEATURES is set")
            k = own()
            ok, why = True, "self-check passed"
            for signed, w_end in ((True, -8), (True, 7), (False, 15)):
                w = np.full((3, 128), w_end, np.int8)
                w[1, ::3] = 0 if signed else 7
                a = np.full((5, 128), 255, np.uint8)
                a[2, 1::2] = 0
                out = np.empty((5, 3), np.int32)
                k.parallel(k.gemm_packed4, 3, np.ascontiguousarray(a[:, 0::2]), np.ascontiguousarray(a[:, 1::2]),
                           k.pack4(w), signed, out)
                if not np.array_equal(out, a.astype(np.int64) @ w.T.astype(np.int64)):
                    ok, why = False, "self-check failed on extreme codes"
        except Exception as e:  # no Numba, no VNNI, or LLVM could not compile it
            ok, why = False, f"{type(e).__name__}: {e}"
        _state["packed4"] = (ok, why)
        if not ok:
            log.warning("qarray: the packed 4-bit small-M kernel is not used: %s", why)
    return own() if _state["packed4"][0] else None


# at most this many activation rows read packed 4-bit weights directly: one row
# reads half the bytes of the int8 codes, which bounds a decoder's step; from two
# rows on the engine on the int8 codes is faster
# (M = 16 x 4096 x 4096: 0.42 ms against 1.14, bench_ops)
SMALL_M = 1
# products (M * K * N) below which a session runs on one thread: waking the pool
# costs ~7 us a run; 256x64x128 takes 8.6 us on one thread, 15.4 on two; the
# two break even near 2**24 (256x256x256: 37 against 38 us)
SMALL_WORK = 1 << 24
# rows a thread and columns from which Packed.by_rows splits the rows among
# threads. nn.Linear int8 out on 2 threads, M x K x N, two-thread sessions ->
# rows split: 1024x1024x1024 1.42 -> 1.32 ms, 2048x512x512 0.90 -> 0.75,
# 512x1024x1024 0.83 -> 0.72, 1024x1024x512 0.69 -> 0.70; narrower outputs
# lose (MLAS on one thread: 1024x1024x256 0.37 -> 0.42, conv2d's 3136x576x64
# 0.23 -> 0.28), as do 64 rows a thread (each thread reads all the weights)
BY_ROWS, BY_ROWS_N = 128, 512
_REPACKED: OrderedDict = OrderedDict()  # Packed.token -> this process's packing of those weights


def _repack(token, codes, qd, keep):
    """An unpickled :class:`Packed`: the codes packed the way this process packs
    them (``NumpyBackend.pack_weight``: its engine, its sessions), once per
    token; the 16 latest are kept, so a Dask worker that gets the same weights
    graph after graph packs them once."""
    if token not in _REPACKED:
        from . import get

        _REPACKED[token] = get("numpy").pack_weight(codes, qd, keep)
        while len(_REPACKED) > 16:
            _REPACKED.popitem(last=False)
    _REPACKED.move_to_end(token)
    return _REPACKED[token]


class Packed:
    """Weight codes ``(..., K, N)`` mapped for engine ``name``: ``w`` (int8 for
    qarray and u8s8, uint8 for u8u8) equals the codes minus ``shift``;
    ``colsum`` is its int64 column sums; ``panels`` (qarray) each 2-D weight
    as ``cpu.gemm.pack`` lays it out; ``sessions`` (MLAS, ``keep``: 2-D weights
    only) one packed session per K chunk. 4-bit weights also keep
    ``nibbles``, two codes to a byte, for small M (``packed4_kernel``).
    Pickled as its codes (:func:`_repack`)."""

    __slots__ = ("name", "w", "shift", "colsum", "sessions", "one_thread", "nibbles", "signed", "qd", "keep", "token",
                 "panels")

    def __init__(self, name, codes, qd, keep, numba=True):
        self.name, self.signed, self.qd, self.keep, self.token = name, qd.signed, qd, keep, uuid.uuid4().hex
        to_signed = name in ("u8s8", "qarray")
        if qd.signed == to_signed or (to_signed and qd.bits < 8):  # in range: qint8 or quint4 as s8, quint8 as u8
            self.shift, self.w = 0, codes.astype(np.int8 if to_signed else np.uint8, copy=False)
        elif codes.dtype.itemsize == 1 and codes.dtype.kind in "iu":  # flip the sign bit: +-128, exactly
            self.shift = 128 if to_signed else -128
            self.w = (codes.view(np.uint8) ^ np.uint8(0x80)).view(np.int8 if to_signed else np.uint8)
        else:
            raise TypeError(f"the int8 GEMM engine takes 8-bit codes, got {codes.dtype}")
        # qarray's packing reads an array as it lies (a layer's (N, K) weights, transposed); a
        # store's (Zarr's) is read here
        self.w = np.asarray(self.w) if name == "qarray" else np.ascontiguousarray(self.w)
        k = codes.shape[-2]
        self.nibbles = self.panels = self.sessions = self.one_thread = None
        if name == "qarray":  # one packing for every instruction set, a 2-D weight at a time, with its column sums
            flat = self.w.reshape(-1, *self.w.shape[-2:])
            self.colsum = np.empty((len(flat), self.w.shape[-1]), np.int64)
            self.panels = [own().pack(w, sums) for w, sums in zip(flat, self.colsum)]
            self.colsum = self.colsum.reshape(*self.w.shape[:-2], self.w.shape[-1])
        else:
            self.colsum = self.w.sum(axis=-2, dtype=np.int64)
        self.colsum.setflags(write=False)  # a kept key (int_matmul's column terms)
        if qd.bits == 4 and self.shift == 0 and codes.ndim == 2 and numba and packed4_kernel() is not None:
            kp = -(-k // 128) * 128  # the kernel takes 64 bytes (128 codes) a step
            self.nibbles = packed4_kernel().pack4(np.pad(self.w.T, ((0, 0), (0, kp - k))))
        if name != "qarray" and keep and codes.ndim == 2:
            step = _KMAX[name]
            self.sessions = [_session(self.w.dtype.type, k, self.w[k0:k0 + step]) for k0 in range(0, k, step)]

    def __reduce__(self):
        """Pickled as the codes (``w + shift``): onnxruntime sessions do not pickle,
        and the process that loads them (a Dask worker) may have another engine."""
        return _repack, (self.token, (self.w.astype(np.int16) + self.shift).astype(self.qd.storage), self.qd, self.keep)

    def by_rows(self, a):
        """Whether ``a @ w`` should run as one share of ``a``'s rows a thread, each on
        a one-thread session (``NumpyBackend.int_matmul``, which follows each
        share's products with its epilogue): 2-D ``a`` and kept weights with K
        in one session, and rows enough that each thread's share is a GEMM of
        its own (from ``BY_ROWS`` rows a thread: each reads all the weights),
        ``BY_ROWS_N`` columns and work enough to wake the threads (``SMALL_WORK``)."""
        return not (a.ndim != 2 or a.shape[0] < BY_ROWS * max(THREADS[0], 2) or self.w.shape[-1] < BY_ROWS_N
                    or self.sessions is None or len(self.sessions) != 1 or a.size * self.w.shape[1] < SMALL_WORK)

    def fused(self, a):
        """Whether ``a @ w`` runs on qarray's own kernels with the epilogue in each
        block's store (``NumpyBackend.int_matmul``): 2-D 8-bit ``a``, 2-D weights
        packed as panels, and not :meth:`packed4`'s small M."""
        return (self.panels is not None and a.ndim == 2 and len(self.panels) == 1 and a.dtype.itemsize == 1
                and not self.packed4(a))

    def single(self):
        """The kept sessions on one thread each, made on first use: for small
        products, and for the shares of :meth:`by_rows`."""
        if self.one_thread is None:
            k, step = self.w.shape[0], _KMAX[self.name]
            self.one_thread = [_session(self.w.dtype.type, k, self.w[k0:k0 + step], 1) for k0 in range(0, k, step)]
        return self.one_thread

    def raw(self, a, threads=None):
        """``a @ w`` exactly for unsigned 8-bit ``a`` ``(..., M, K)``: int32, or
        int64 when K is split; on ``threads`` threads (default: one for small
        products, else ``qarray.set_num_threads``')."""
        k = a.shape[-1]
        if self.packed4(a):
            halves = np.zeros((2, a.shape[0], self.nibbles.shape[1]), np.uint8)  # even k, odd k; zero-padded
            halves[0, :, : (k + 1) // 2], halves[1, :, : k // 2] = a[:, 0::2], a[:, 1::2]
            out = np.empty((a.shape[0], self.w.shape[1]), np.int32)
            k4 = packed4_kernel()
            k4.parallel(k4.gemm_packed4, len(self.nibbles), halves[0], halves[1], self.nibbles, self.signed, out)
            return out
        if self.panels is not None:
            return self._own(a, threads)
        step = _KMAX[self.name]
        if threads is None:
            threads = 1 if math.prod(a.shape[:-1]) * k * self.w.shape[-1] < SMALL_WORK else THREADS[0]
        sessions = self.sessions
        if sessions is not None and threads == 1 and THREADS[0] > 1:
            sessions = self.single()
        out = None
        for i, k0 in enumerate(range(0, max(k, 1), step)):
            ak = a[..., k0:k0 + step]
            if sessions is not None:
                part = sessions[i].run(None, {"a": ak})[0]
            else:
                key = (self.w.dtype.type, threads)
                if key not in _sessions:
                    _sessions[key] = _session(self.w.dtype.type, None, threads=threads)
                part = _sessions[key].run(None, {"a": ak, "w": self.w[..., k0:k0 + step, :]})[0]
            if k <= step:
                return part
            out = part.astype(np.int64) if out is None else out + part
        return out


    def packed4(self, a):
        """Whether ``a @ w`` runs on the 4-bit codes two to a byte (``nibbles``):
        for at most ``SMALL_M`` rows, which read half the bytes of the int8 codes."""
        return (self.nibbles is not None and a.ndim == 2 and a.shape[0] <= SMALL_M
                and a.shape[-1] * 255 * 15 < 2**31)

    def _own(self, a, threads):
        """:meth:`raw` on qarray's own kernels: each pair of the broadcast batch
        in turn (``qarray.backends.cpu.gemm``, with no epilogue)."""
        gemm = own()
        (k, n), m = self.w.shape[-2:], a.shape[-2]
        batch = np.broadcast_shapes(a.shape[:-2], self.w.shape[:-2])
        a = np.broadcast_to(a, batch + (m, k)).reshape(-1, m, k)
        which = np.broadcast_to(np.arange(len(self.panels)).reshape(self.w.shape[:-2]), batch).ravel()
        out = np.empty((len(a), m, n), np.int32 if k <= gemm.KMAX else np.int64)
        zero, ends = np.zeros(n, np.int64), np.iinfo(out.dtype)
        for ai, pi, oi in zip(a, which, out):
            gemm.run(gemm.best(), IDENTITY, False, ai, False, self.panels[pi], None, (zero,) * 5 + (np.zeros(n),),
                     ends.min, ends.max, oi, threads)
        return out.reshape(batch + (m, n))


def to_unsigned(a, signed):
    """Activation codes as uint8 (``a + 128`` for signed, by flipping the sign
    bit) and what was added."""
    if not signed:
        return a.astype(np.uint8, copy=False), 0
    return a.view(np.uint8) ^ np.uint8(0x80), 128
