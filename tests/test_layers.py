"""The layers of the core, read off the source (``ast``): modules import only
downward, module-level imports make no cycle, and the imports inside functions
(each with a reason: optional packages, a lazy backend, unpickling in a worker)
are counted, so that new ones are a decision, not an accident.

Layers, bottom up (docs/architecture.md): formats and dtypes; parameters, fixed point, Philox
and config; backends; the QArray and its API; ops; the file formats' shared meta
and row packing (io._schema, io._rows); the file formats (io.npz,
io.safetensors, io.zarr); everything users call on top (nn, observers, io,
zarr, onnx, the CLI and the examples).
"""

import ast
import collections
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "qarray"

LAYERS = [
    ("qarray._dtypes", "qarray._formats", "qarray._blocks", "qarray._ggml", "qarray._kquants", "qarray._grouped"),
    ("qarray._params", "qarray._fixed_point", "qarray._philox", "qarray._config"),
    ("qarray.backends",),
    ("qarray._qarray", "qarray._api", "qarray._protocols", "qarray.interop"),
    ("qarray.ops",),
    ("qarray.io._schema", "qarray.io._rows"),
    ("qarray.io.npz", "qarray.io.safetensors", "qarray.io.zarr", "qarray.io.gguf"),
    ("qarray.io.hf",),
    ("qarray.io.gptq", "qarray.io.compressed_tensors", "qarray.io.mlx", "qarray.io.bnb", "qarray.io.modelopt"),
    ("qarray.io.checkpoint",),
    ("qarray.nn", "qarray.observers", "qarray.io", "qarray.zarr", "qarray.onnx", "qarray.cli", "qarray.examples",
     "qarray.__main__", "qarray"),
]

# The imports that still run upward, inside functions, with why they are there (none: the
# ops register what NumPy's protocols dispatch to, _protocols.JOIN_OPS)
UPWARD_INSIDE_FUNCTIONS = set()
# Imports inside functions, all modules together (optional packages not counted): the count only goes down.
INSIDE_FUNCTIONS = 20
# Packages whose modules import qarray modules at the top only (inside functions: optional
# packages alone, rich, safetensors, zarr, dask, ...)
NONE_INSIDE = ("qarray.io", "qarray.cli", "qarray.zarr")


def _modules():
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _targets(mods, module, node):
    """The qarray modules an import statement names."""
    package = module if mods[module].name == "__init__.py" else module.rsplit(".", 1)[0]
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
        target = ".".join(base + ([node.module] if node.module else []))
        names = [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names]
    out = set()
    for name in names:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        if name.startswith("qarray") and name != module:
            out.add(name)
    return out


def _graph():
    """``(module-level imports, imports inside functions)``: module -> qarray modules."""
    mods = _modules()
    top, inside = collections.defaultdict(set), collections.defaultdict(list)
    for module, path in mods.items():
        tree = ast.parse(path.read_text())
        outer = {id(n) for n in tree.body}
        outer |= {id(n) for s in tree.body if isinstance(s, (ast.If, ast.Try)) for n in ast.walk(s)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(mods, module, node):
                    (top[module].add(target) if id(node) in outer else inside[module].append(target))
    return mods, top, inside


def _layer(module):
    best = max(((i, len(n)) for i, names in enumerate(LAYERS) for n in names
                if module == n or module.startswith(n + ".")), key=lambda t: t[1])
    return best[0]


def test_module_level_imports_run_downward_and_make_no_cycle():
    mods, top, _ = _graph()
    upward = sorted((m, t) for m in top for t in top[m] if _layer(t) > _layer(m))
    assert upward == []
    state = {}

    def visit(m, path):  # depth-first: a module met again on the current path closes a cycle
        state[m] = "open"
        for t in sorted(top.get(m, ())):
            assert state.get(t) != "open", f"import cycle: {' -> '.join(path + [t])}"
            if t not in state:
                visit(t, path + [t])
        state[m] = "done"

    for m in sorted(mods):
        if m not in state:
            visit(m, [m])


def test_imports_inside_functions_are_few_and_known():
    _, _, inside = _graph()
    upward = {(m, t) for m in inside for t in inside[m] if _layer(t) > _layer(m)}
    assert upward == UPWARD_INSIDE_FUNCTIONS, "an import inside a function runs upward: move the code down, or " \
                                              "the import up"
    late = sorted(m for m in inside if any(m == p or m.startswith(p + ".") for p in NONE_INSIDE))
    assert late == [], "qarray.io and qarray.cli import qarray modules at the top only"
    count = sum(len(v) for v in inside.values())
    assert count <= INSIDE_FUNCTIONS, f"{count} imports of qarray modules inside functions (was {INSIDE_FUNCTIONS})"
