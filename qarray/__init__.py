"""qarray: quantized arrays for NumPy and CuPy.

>>> import numpy, qarray
>>> q = qarray.quantize(numpy.array([0.5, -1.0], numpy.float32), 0.01, 0, qarray.qint8)
>>> q.int_repr()
array([  50, -100], dtype=int8)
"""

from importlib.metadata import PackageNotFoundError, version

from . import awq
from . import backends
from . import hqq
from . import nn
from . import observers
from . import gptq
from . import ops
from . import smoothquant
from ._api import choose_qparams
from ._api import dequantize, fake_quantize
from ._api import quantize
from ._api import quantize_dynamic, quantize_mx, quantize_nvfp4
from ._api import requantize
from ._api import unpack
from ._config import config
from ._config import set_num_threads
from ._formats import finfo
from ._dtypes import QDType
from ._dtypes import iinfo
from ._dtypes import qdtype
from ._dtypes import qint2, qint4, qint8, qint16, qint32
from ._dtypes import quint2, quint4, quint8, quint16
from ._qarray import QArray
from .interop import from_torch
from .io import load
from .io import save
from .zarr import from_zarr
from .zarr import to_zarr
from .ops import *  # noqa: F403  (the ops, re-exported; names in ops.__all__)

try:
    __version__ = version("qarray")  # defined once, in setup.cfg
except PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
    __version__ = "0+unknown"

__all__ = [
    "QArray",
    "gptq",
    "nn",
    "observers",
    "ops",
    *ops.__all__,
    "QDType",
    "awq",
    "backends",
    "hqq",
    "smoothquant",
    "choose_qparams",
    "config",
    "dequantize",
    "fake_quantize",
    "finfo",
    "from_torch",
    "from_zarr",
    "iinfo",
    "load",
    "to_zarr",
    "qdtype",
    "qint2",
    "qint4",
    "qint8",
    "qint16",
    "qint32",
    "quantize",
    "quantize_dynamic",
    "quantize_mx",
    "quantize_nvfp4",
    "quint2",
    "quint4",
    "quint8",
    "quint16",
    "requantize",
    "save",
    "set_num_threads",
    "unpack",
]
