"""Numba's on-disk cache must hit in a fresh process: every kernel the second
process uses is loaded, none compiled or written again (read from Numba's own
NUMBA_DEBUG_CACHE report, not from timing)."""

import contextlib
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("numba")

SCRIPT = r"""
import numpy as np
import qarray as qa

x = np.linspace(-3, 3, 1 << 15, dtype=np.float32).reshape(128, 256)
q = qa.quantize(x, 0.05, 3, "qint8")
q.dequantize()
qa.quantize(np.ones((64, 256), np.float32), dtype="Q4_K").dequantize()  # the block formats' decoder
qa.quantize(np.zeros(1 << 22, np.float32), 0.05, 3, "qint8")  # large: the streaming kernels
qa.QArray.from_int(np.zeros(1 << 22, np.int32), 0.5, 0, "qint32").requantize(3.0, 1, "qint8")
qa.fake_quantize(x, 0.05, 3, "qint8", return_mask=True)
qa.quantize(x, 0.05, 3, "qint8", rounding="stochastic", seed=1)
qa.fake_quantize(x, 0.05, 3, "qint8", return_mask=True, rounding="stochastic", seed=1, out=np.empty_like(x))
qa.quantize(x, np.full(256, 0.05, np.float32), 0, "quint8", axis=1)
acc = qa.QArray.from_int(np.arange(1 << 15, dtype=np.int32), 0.5, 0, "qint32")
for rounding in ("half_even", "half_away", "half_up", "tflite"):
    qa.requantize(acc, 3.0, 1, "qint8", rounding=rounding)
qa.requantize(acc, 3.0, 1, "qint8", rounding="stochastic", seed=1)
qa.requantize(acc, 3.0, 1, "qint8", mode="float")
qa.add(q, q, scale=0.1, zero_point=0, dtype="qint8")
qa.mul(q, q, scale=0.1, zero_point=0, dtype="qint8", relu=True)
qa.sigmoid(q)
rng = np.random.default_rng(0)
xs = qa.QArray.from_int(rng.integers(0, 256, (64, 128)), 0.02, 128, "quint8")
for wdt in ("qint8", "qint4"):  # the engine's epilogue; M = 1 on 4-bit weights: the packed kernel
    lin = qa.nn.Linear.from_float(rng.standard_normal((256, 128)).astype(np.float32), weight_dtype=wdt)
    lin(xs, scale=0.5, zero_point=0, dtype="qint8")
    lin(xs[:1])
big = qa.nn.Linear.from_float(rng.standard_normal((512, 256)).astype(np.float32))  # rows split among threads
big(qa.QArray.from_int(rng.integers(0, 256, (256, 256)), 0.02, 128, "quint8"), scale=0.5, zero_point=0, dtype="qint8")
xc = qa.QArray.from_int(rng.integers(0, 256, (1, 64, 20, 20)), 0.02, 128, "quint8")
for groups in (1, 64):  # im2col; direct depthwise
    w = qa.QArray.from_int(rng.integers(-128, 128, (64, 64 // groups, 3, 3)), 0.01, 0, "qint8")
    qa.conv2d(xc, w, padding=1, groups=groups)
qa.softmax(q)
qa.log_softmax(q)
"""

_EVENT = re.compile(r"\[cache\] (index|data) (saved to|loaded from) (\S+)")


def _seed(cache: Path):
    """``cache`` starts as a copy of what this test session has cached so far
    (NUMBA_CACHE_DIR, or Numba's ``__pycache__`` folders beside qarray's sources),
    laid out as NUMBA_CACHE_DIR lays it out: the first process compiles only the
    kernels no other test has, instead of all of them again (minutes on 2 cores)."""
    from numba.core.caching import UserProvidedCacheLocator

    import qarray

    if os.environ.get("NUMBA_CACHE_DIR"):
        pairs = [(f, cache / f.relative_to(os.environ["NUMBA_CACHE_DIR"]))
                 for f in Path(os.environ["NUMBA_CACHE_DIR"]).rglob("*")]
    else:
        pairs = [(f, cache / UserProvidedCacheLocator.get_suitable_cache_subpath(str(f.parent.parent / "x.py")) / f.name)
                 for f in Path(qarray.__file__).parent.rglob("__pycache__/*")]
    for src, dest in pairs:
        if src.suffix in (".nbi", ".nbc"):  # not the .tmp.* files Numba is writing
            dest.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                shutil.copyfile(src, dest)


def _run(cache: Path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), NUMBA_DEBUG_CACHE="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parent.parent).stdout
    events = [(kind, what, p.strip("'")) for kind, what, p in _EVENT.findall(out)]
    saved = {p for kind, what, p in events if what == "saved to"}  # index and data files
    loaded = {p for kind, what, p in events if kind == "data" and what == "loaded from"}
    return saved, loaded, sorted(p.relative_to(cache) for p in cache.rglob("*") if p.is_file())


def test_second_process_loads_every_kernel_and_writes_nothing(tmp_path):
    """The first process starts from the kernels the session has cached (``_seed``):
    it loads those, compiles and writes the rest; the second loads every kernel the
    first used, from either, and compiles and writes nothing."""
    _seed(tmp_path)
    saved, loaded, files = _run(tmp_path)
    used = {p for p in saved | loaded if p.endswith(".nbc")}
    assert used  # the script's kernels are cached ...
    saved2, loaded2, files2 = _run(tmp_path)
    assert saved2 == set()  # ... nothing compiled again ...
    assert loaded2 == used  # ... every kernel from the cache ...
    assert files2 == files  # ... and no new file


def test_small_calls_take_the_kernels_once_a_process_keeps_calling():
    """A one-off small call runs NumPy code and never imports Numba (half a
    second); from the _WARM-th small call on, small calls run the kernels."""
    code = textwrap.dedent("""
        import sys
        import numpy as np
        import qarray
        from qarray.backends import numpy as nb
        x = np.ones(8, np.float32)
        qarray.quantize(x, 0.1, 0, "qint8")
        print("numba" in sys.modules, end=" ")
        for _ in range(nb._WARM):
            qarray.quantize(x, 0.1, 0, "qint8")
        print("numba" in sys.modules, nb._kernels is not False)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True", "True"]
