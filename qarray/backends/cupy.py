"""CuPy backend: the generic primitives on the GPU. CuPy is imported on first use."""

from __future__ import annotations

from ._base import Backend


class CupyBackend(Backend):
    name = "cupy"
    module = "cupy"

    @property
    def xp(self):
        if self._xp is None:
            self._xp = self.check()
        return self._xp

    def check(self):
        """CuPy itself, or a clear error when it is missing or sees no GPU."""
        try:
            import cupy
        except ImportError:
            raise ImportError(
                "the cupy backend needs CuPy: pip install 'qarray[cuda12]' or 'qarray[cuda13]'"
            ) from None
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # CUDA driver missing or broken
            raise RuntimeError(f"the cupy backend found no usable CUDA device: {e}") from None
        if count < 1:
            raise RuntimeError("the cupy backend found no CUDA device")
        return cupy
