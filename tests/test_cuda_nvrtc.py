"""The kernels as CuPy itself compiles them, without a GPU: every ``.cu`` file, as
``CupyBackend`` hands it to ``RawModule`` (headers inlined), goes through
``cupy.cuda.compiler`` (NVRTC) with the backend's options, plus whatever CuPy
adds, up to the point where CuPy would load the module onto a device.

This catches what nvcc and the host harness can not: a source NVRTC rejects, a
kernel name missing from the module, and CuPy's ``-ftz=true``, which would flush
float32 subnormals where NumPy keeps them (see ``common.cuh``).
"""

import re
import shutil

import pytest

from cuda_host.harness import SOURCES, kernel_names
from qarray.backends import _cuda

cupy = pytest.importorskip("cupy")

ARCH = "90"
# PTX instructions that may flush float32 subnormals, by file: NaN tests never
# care; in elementwise.cu the adds, compares and conversions of quantize, and
# fake_quantize's code - zero point, see only integer values (rint results,
# zero points, bounds).
FLUSH_HARMLESS = {"setp.nan", "setp.num"}
FLUSH_HARMLESS_IN = {"elementwise.cu": {"add", "sub", "cvt", "setp"}}
_OPCODE = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)\s", re.M)


@pytest.fixture(scope="module")
def ptx():
    """``{file name: (options CuPy passed to NVRTC, PTX text)}``, compiled once."""
    compiled = {}
    for source in SOURCES:
        try:
            compiled[source.name] = _cuda.compile_ptx(source.name, ARCH)
        except RuntimeError as e:  # CuPy without NVRTC, or one that compiles differently
            pytest.skip(str(e))
    return compiled


def test_cupy_passes_the_backend_options(ptx):
    for options, _ in ptx.values():
        assert tuple(options[: len(_cuda.NVRTC_OPTIONS)]) == _cuda.NVRTC_OPTIONS


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_every_kernel_is_in_the_module(ptx, source):
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    entries = re.findall(r"\.entry\s+(\w+)\s*\(", ptx[source.name][1])
    assert sorted(entries) == kernel_names(source)


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_no_float32_subnormal_is_flushed(ptx, source):
    options, text = ptx[source.name]
    flushing = {op for op in _OPCODE.findall(text) if ".ftz" in op}
    allowed = FLUSH_HARMLESS | FLUSH_HARMLESS_IN.get(source.name, set())
    bad = {op for op in flushing if op.split(".")[0] not in allowed and ".".join(op.split(".")[:2]) not in allowed}
    assert not bad, f"{source.name} flushes float32 subnormals in {sorted(bad)} (options {options})"
