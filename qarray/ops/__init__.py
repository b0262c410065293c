"""Quantized ops, one topical module each; all re-exported by ``qarray``.

concat: cat, stack. elementwise: add, sub, mul, add_scalar, mul_scalar, prelu,
relu, relu6, clamp, hardtanh. lut: lut and the activations built on it. linear:
matmul, linear. conv: conv2d, conv_transpose2d,
conv2d_weight_grad. pool: max_pool2d, avg_pool2d,
adaptive_avg_pool2d, mean, sum. softmax: softmax, log_softmax.
"""

from .concat import cat
from .concat import stack
from .conv import conv2d
from .conv import conv2d_weight_grad
from .conv import conv_transpose2d
from .elementwise import add
from .elementwise import add_scalar
from .elementwise import clamp
from .elementwise import hardtanh
from .elementwise import mul
from .elementwise import mul_scalar
from .elementwise import prelu
from .elementwise import relu
from .elementwise import relu6
from .elementwise import sub
from .linear import linear
from .linear import matmul
from .lut import elu
from .lut import exp
from .lut import gelu
from .lut import hardswish
from .lut import leaky_relu
from .lut import lut
from .lut import sigmoid
from .lut import silu
from .lut import tanh
from .pool import adaptive_avg_pool2d
from .pool import avg_pool2d
from .pool import max_pool2d
from .pool import mean
from .pool import sum
from .softmax import log_softmax
from .softmax import softmax

__all__ = [
    "adaptive_avg_pool2d",
    "add",
    "add_scalar",
    "avg_pool2d",
    "cat",
    "clamp",
    "conv2d",
    "conv2d_weight_grad",
    "conv_transpose2d",
    "elu",
    "exp",
    "gelu",
    "hardswish",
    "hardtanh",
    "leaky_relu",
    "linear",
    "log_softmax",
    "lut",
    "matmul",
    "max_pool2d",
    "mean",
    "mul",
    "mul_scalar",
    "prelu",
    "relu",
    "relu6",
    "sigmoid",
    "silu",
    "softmax",
    "stack",
    "sub",
    "sum",
    "tanh",
]
