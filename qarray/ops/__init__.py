"""Quantized ops, one topical module each; all re-exported by ``qarray``."""

from .linear import linear
from .linear import matmul

__all__ = ["linear", "matmul"]
