"""Quantized ops, one topical module each; all re-exported by ``qarray``."""

from .concat import cat
from .concat import stack
from .elementwise import add
from .elementwise import add_scalar
from .elementwise import clamp
from .elementwise import hardtanh
from .elementwise import mul
from .elementwise import mul_scalar
from .elementwise import relu
from .elementwise import relu6
from .elementwise import sub
from .linear import linear
from .linear import matmul

__all__ = [
    "add",
    "add_scalar",
    "cat",
    "clamp",
    "hardtanh",
    "linear",
    "matmul",
    "mul",
    "mul_scalar",
    "relu",
    "relu6",
    "stack",
    "sub",
]
