"""The instruction sets the CPU kernels may use, decided once a process.

Each is what the CPU reports (``_gemm.jit_flags``: none where
``NUMBA_CPU_NAME`` or ``NUMBA_CPU_FEATURES`` points Numba at another target)
and, for AMX, what Linux grants: the tile data is 8 KB of thread state that a
process must ask for (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``,
Linux 5.16 and newer); a refusal is logged once and the next instruction set
runs. ``OFF`` holds the ones a test or a user turned off
(``qarray.backends.cpu.isa.OFF.add("amx")``), so that each path runs on any
machine that has the ones below it.
"""

from __future__ import annotations

import functools
import logging
import platform

from .._gemm import jit_flags

log = logging.getLogger("qarray")

# the int8 GEMM's, fastest first; "portable" (plain Numba loops) runs anywhere
ORDER = ("amx", "avx512vnni", "avxvnni", "avx2", "portable")
# and those of llvm.py's other helpers: softmax's byte lookups, quantize's lines, the streamed stores
_NEEDS = {"amx": {"amx-int8", "amx-tile"}, "avx512vnni": {"avx512vnni", "avx512bw"}, "avxvnni": {"avxvnni", "avx2"},
          "avx2": {"avx2"}, "portable": set(), "avx512vbmi": {"avx512vbmi", "avx512bw"},
          "avx512bw": {"avx512f", "avx512bw"}, "sse2": set()}  # sse2: every x86-64
OFF: set = set()
_granted: list = []  # [(ok, why)] once asked

_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA, _SYS_ARCH_PRCTL = 0x1023, 18, 158


def _libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _amx_permission() -> tuple[bool, str]:
    """Ask Linux, once, for the AMX tile state of this process."""
    if not _granted:
        import ctypes

        try:
            ok = _libc().syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, ctypes.c_ulong(_XFEATURE_XTILEDATA)) == 0
            why = "granted" if ok else f"arch_prctl(ARCH_REQ_XCOMP_PERM) refused (errno {ctypes.get_errno()})"
        except (OSError, AttributeError) as e:  # no C library to ask
            ok, why = False, f"no arch_prctl: {e}"
        _granted.append((ok, why))
        if not ok:
            log.warning("qarray: AMX tiles not used: %s", why)
    return _granted[0]


def usable(name: str) -> tuple[bool, str]:
    """``(usable, why)`` for instruction set ``name`` in this process."""
    if name not in _NEEDS:
        raise ValueError(f"unknown instruction set {name!r}; one of {tuple(_NEEDS)}")
    if name in OFF:
        return False, "turned off (qarray.backends.cpu.isa.OFF)"
    return _probe(name)


@functools.cache
def _probe(name):
    if name == "portable":
        return True, "plain Numba loops"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False, f"not x86-64 ({platform.machine()})"
    missing = sorted(_NEEDS[name] - jit_flags())
    if missing:
        return False, "the CPU (or Numba's target) lacks " + ", ".join(missing)
    return _amx_permission() if name == "amx" else (True, "CPU has " + ", ".join(sorted(_NEEDS[name])))


def best() -> str:
    """The first usable instruction set of :data:`ORDER`."""
    return next(n for n in ORDER if usable(n)[0])
