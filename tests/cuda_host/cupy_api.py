"""The part of CuPy's API that qarray and its stand-in (``fake_cupy/``) use, read off
real CuPy: every name, and the parameters of each callable.

``cupy_api.json`` holds it for each CuPy release qarray supports (the oldest and
the newest: 13.x and 14.x). The stand-in offers exactly the names present in all
of them, each callable taking only the keywords all of them take, so a test that
passes on the stand-in uses nothing a supported CuPy lacks (a ``RawKernel.ptr``
once broke every launch on a real GPU while the stand-in had one).
``tests/test_cupy_api.py`` checks the file against the CuPy installed (CI has
real CuPy, no GPU) and the stand-in against the file. To add a name, add it to
``NAMES`` and record it under each supported CuPy, in a virtual environment that
has that CuPy installed (``pip install cupy-cuda12x==13.6.0``; no GPU needed)::

    python tests/cuda_host/cupy_api.py record
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
import types
from pathlib import Path

FILE = Path(__file__).with_name("cupy_api.json")

# Device plumbing the backend calls (cuda.cupy's launch, occupancy, cuBLAS, compiler)
PLUMBING = [
    "cupy.__version__", "cupy.ndarray", "cupy.RawModule", "cupy.RawModule.get_function", "cupy.RawKernel",
    "cupy.RawKernel.__call__", "cupy.RawKernel.kernel", "cupy.cuda.function.Function", "cupy.cuda.function.Function.ptr",
    "cupy.cuda.Device", "cupy.cuda.Device.id", "cupy.cuda.Device.synchronize", "cupy.cuda.Device.__enter__",
    "cupy.cuda.Device.__exit__", "cupy.cuda.Event", "cupy.cuda.Event.record", "cupy.cuda.Event.synchronize",
    "cupy.cuda.get_elapsed_time", "cupy.cuda.runtime.getDeviceCount", "cupy.cuda.runtime.getDeviceProperties",
    "cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor", "cupy.cuda.device.get_cublas_handle",
    "cupy.cuda.cublas.gemmEx", "cupy.cuda.compiler", "cupy.cuda.nvrtc.getVersion", "cupy.from_dlpack",
    "cupy.ndarray.device", "cupy.ndarray.__cuda_array_interface__", "cupy.ndarray.get", "cupy.ndarray.__array__",
    "cupy.random.rand", "cupy.random.standard_normal", "cupy.random.randint", "cupy.lib.stride_tricks.as_strided",
    "cupy.lib.stride_tricks.sliding_window_view", "cupy.asnumpy", "cupy.asarray", "cupy.array",
    "cupy.cuda", "cupy.cuda.runtime", "cupy.cuda.driver", "cupy.cuda.device", "cupy.cuda.cublas", "cupy.cuda.function",
    "cupy.lib", "cupy.lib.stride_tricks", "cupy.random", "cupy.ndarray.copy", "cupy.ndarray.item", "cupy.ndarray.tolist",
]


def _load() -> dict:
    return json.loads(FILE.read_text()) if FILE.exists() else {"names": [], "releases": {}}


def _save(data):
    FILE.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def _split(params: str) -> list:
    out, depth, cur = [], 0, ""
    for ch in params:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [p.strip() for p in out + [cur] if p.strip()]


def _param_names(params: str) -> list:
    """``a, int b=1, \\*, c=None, **kw`` -> ``["a", "b", "c", "**"]`` (Cython's
    typed parameters by their last word; ``*args`` as ``"*"``, ``**kwargs`` as ``"**"``)."""
    names = []
    for p in _split(params.replace("\\*", "*")):
        p = p.split("=")[0].split(":")[0].strip()
        if p.startswith("**"):
            names.append("**")
        elif p.startswith("*"):
            names += ["*"] if p != "*" else []
        elif p not in ("self", "/"):
            names.append(p.split()[-1])
    return names


def _doc_params(obj, name: str):
    """Parameters from the signature lines that open a Cython docstring
    (``RawKernel.__call__(self, grid, block, args, **kwargs)``), all of them."""
    lines = [ln.strip() for ln in (obj.__doc__ or "").splitlines()[:6]]
    sigs = [m.group(1) for ln in lines if (m := re.match(rf"^(?:[\w.]+\.)?{re.escape(name)}\((.*)\)", ln))]
    if not sigs:
        return None
    found = [_param_names(s) for s in sigs]
    explicit = [f for f in found if "**" not in f] or found  # a line that spells the keywords beats **kwargs
    return list(dict.fromkeys(p for f in explicit for p in f))  # in order, the first line's first


def _binary_params(module: str, name: str):
    """Parameters of a function of a Cython extension that cannot load here
    (cuBLAS without its library), from the signature Cython embeds in it."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    m = re.search(rb"(?<![\w.])" + name.encode() + rb"\(([^)\x00\n]*)\)", Path(spec.origin).read_bytes())
    return None if m is None else _param_names(m.group(1).decode())


EXTENSIONS = {"cupy.cuda.cublas": "cupy_backends.cuda.libs.cublas"}


def describe(root, dotted: str):
    """``(found, params)`` of ``dotted`` in CuPy ``root``: params the list of
    parameter names, in order, of a callable whose signature is known, else None."""
    parts = dotted.split(".")[1:]
    obj = root
    for i, part in enumerate(parts):
        try:
            obj = getattr(obj, part)
        except ImportError:  # a library module that needs its shared library (cuBLAS)
            module = ".".join(["cupy", *parts[: i + 1]])
            if module not in EXTENSIONS:
                raise
            if i == len(parts) - 1:
                return True, None
            if i != len(parts) - 2:
                return False, None
            params = _binary_params(EXTENSIONS[module], parts[-1])
            return params is not None, params
        except AttributeError:
            return False, None
    if inspect.ismodule(obj) or not callable(obj) or isinstance(obj, type) and obj.__module__.startswith("numpy"):
        return True, None
    params = _own_params(obj)  # None where inspect finds no signature (Cython): the docstring's
    return True, params if params is not None else _doc_params(obj, parts[-1])


def surface(root, names) -> dict:
    """``{name: params}`` of the ``names`` that CuPy ``root`` has."""
    out = {}
    for n in names:
        found, params = describe(root, n)
        if found:
            out[n] = params
    return out


def allowed() -> dict:
    """``{name: params}`` present in every recorded CuPy: params the parameters all
    of them take, in the first release's order (``"**"`` only where all take any),
    None where none is known."""
    recorded = list(_load()["releases"].values())
    out = {}
    for n in set(recorded[0]).intersection(*recorded[1:]):
        ps = [r[n] for r in recorded]
        known = [p for p in ps if p is not None]
        out[n] = None if not known else [p for p in known[0] if all(p in k for k in known[1:])]
    return out


def record():
    """The names' surface in the CuPy installed, under its release."""
    import cupy

    data = _load()
    data["names"] = sorted(set(data["names"]) | set(PLUMBING))
    data["releases"][f"cupy {cupy.__version__}"] = surface(cupy, data["names"])
    _save(data)


def add_names(log: str):
    """The names a stand-in run asked for (``QA_FAKE_CUPY_LOG=file``), added to the list."""
    data = _load()
    data["names"] = sorted(set(data["names"]) | set(Path(log).read_text().split()))
    _save(data)


# The stand-in's own instruments, which no CuPy has and qarray never reads: the
# tests' counters of copies and allocations, and CuPy's error text
STAND_IN_ONLY = {"cupy.transfers", "cupy.allocations", "cupy.IMPLICIT"}


def _own_params(f):
    """``f``'s parameter names in order (``*args`` as ``"*"``, ``**kwargs`` as ``"**"``)."""
    try:
        sig = inspect.signature(f)
    except (TypeError, ValueError):
        return None
    return ["*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else p.name
            for p in sig.parameters.values() if p.name != "self"]


def _walk(obj, dotted, out, seen):
    """``out[name] = params`` for each public name of the stand-in's ``obj``."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    names = vars(obj) if isinstance(obj, type) else {**(vars(type(obj)) if type(obj).__module__ == "cupy" else {}),
                                                      **getattr(obj, "__dict__", {})}
    for n, v in list(names.items()):
        dunder = n.startswith("__") and n.endswith("__")
        if n.startswith("_") and not (dunder and isinstance(obj, type) and n in (
                "__call__", "__enter__", "__exit__", "__array__", "__cuda_array_interface__")):
            continue
        if inspect.ismodule(v) or isinstance(v, type) and v.__module__ not in ("cupy", __name__, "cuda_host.gpu_dryrun"):
            continue  # the stand-in's own imports (numpy, pathlib, ...)
        name = f"{dotted}.{n}"
        f = v.fget if isinstance(v, property) else v
        out[name] = _own_params(f) if callable(f) and not isinstance(f, type) and not isinstance(v, property) else None
        if isinstance(v, type) or isinstance(v, types.SimpleNamespace) or type(v).__module__ == "cupy":
            _walk(v, name, out, seen)


def stand_in_surface() -> dict:
    """``{name: params}`` the stand-in offers besides what it forwards to NumPy
    (which ``_has`` checks as it is asked): its module's and classes' own names,
    and what ``gpu_dryrun.py`` puts in (``RawModule``'s module and kernels, cuBLAS).
    Run where ``cupy`` is the stand-in."""
    import cupy

    from cuda_host import cublas_host, gpu_dryrun

    out = {}
    _walk(cupy, "cupy", out, set())
    for cls, name in ((gpu_dryrun.HostModule, "cupy.RawModule"), (gpu_dryrun.HostKernel, "cupy.RawKernel"),
                      (gpu_dryrun.HostFunction, "cupy.cuda.function.Function")):
        _walk(cls, name, out, set())
    out["cupy.cuda.cublas.gemmEx"] = _own_params(cublas_host.gemmEx)
    return {k: v for k, v in out.items() if k not in STAND_IN_ONLY}


if __name__ == "__main__":
    if sys.argv[1:2] == ["record"]:
        record()
    elif sys.argv[1:2] == ["names"] and len(sys.argv) == 3:
        add_names(sys.argv[2])
    else:
        sys.exit(__doc__)
