"""What the examples share: the command line, the array module, rich tables,
the digits data, a small Adam trainer and a timer."""

from __future__ import annotations

import argparse
import contextvars
import importlib.util
import sys
import time

import numpy as np

# import name -> the package pip installs it from (both in the ``examples`` extra)
_PACKAGES = {"rich": "rich", "sklearn": "scikit-learn"}


def parse_args(name: str, doc: str, argv) -> argparse.Namespace:
    """``--quick`` and ``--backend numpy|cupy`` (default numpy); ``doc``'s first
    line is the description."""
    p = argparse.ArgumentParser(prog=f"python -m qarray.examples.{name}", description=doc.strip().splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smaller run, a few seconds")
    p.add_argument("--backend", choices=("numpy", "cupy"), default="numpy", help="the array library to run on")
    return p.parse_args(argv)


# Set by ``qarray run``: what an example cannot do is raised as Unavailable, for
# the command to report as its own one-line error ("qarray: error: ...").
FROM_CLI = contextvars.ContextVar("qarray_examples_from_cli", default=False)


class Unavailable(Exception):
    """What an example needs and does not have (a package, CuPy or a GPU)."""


def _report(standalone: str, message: str) -> None:
    """One line on stderr (``standalone``, run as ``python -m``), or Unavailable
    with ``message`` under ``qarray run``."""
    if FROM_CLI.get():
        raise Unavailable(message)
    print(standalone, file=sys.stderr)


def missing(name: str, needs) -> bool:
    """True, after one line on stderr naming what to install, when a package of
    ``needs`` (import names) is not installed."""
    absent = [_PACKAGES[m] for m in needs if importlib.util.find_spec(m) is None]
    if absent:
        install = f"needs {' and '.join(absent)}: pip install 'qarray[examples]'"
        _report(f"qarray.examples.{name} {install}", f"the {name} example {install}")
    return bool(absent)


def gpu_problem() -> str | None:
    """None when CuPy imports and sees a CUDA device, else why not, in one line."""
    from .. import backends

    try:
        backends.get("cupy").check()
    except (ImportError, RuntimeError) as e:
        return str(e)
    return None


def setup(name: str, doc: str, argv, needs):
    """Parse the flags and check the packages and the backend: ``(args, xp)``
    with ``xp`` NumPy or CuPy, or None after one line on stderr saying what is
    missing (a package, CuPy or a GPU)."""
    args = parse_args(name, doc, argv)
    if missing(name, needs):
        return None
    if args.backend == "numpy":
        return args, np
    problem = gpu_problem()
    if problem is not None:
        _report(f"qarray.examples.{name}: --backend cupy: {problem}", f"--backend cupy: {problem}")
        return None
    import cupy

    return args, cupy


def main(name: str, doc: str, argv, run, show, needs=("rich", "sklearn")) -> int:
    """An example's ``main``: ``show(run(quick, xp), backend)`` and 0, or 1
    when :func:`setup` finds something missing."""
    ready = setup(name, doc, argv, needs)
    if ready is None:
        return 1
    args, xp = ready
    show(run(args.quick, xp), args.backend)
    return 0


def print_table(title: str, columns, rows, caption: str | None = None, left: int = 1) -> None:
    """A rich table: the first ``left`` columns left-aligned, the others right-aligned."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, caption=caption)
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i < left else "right")
    for row in rows:
        table.add_row(*(str(v) for v in row))
    console = Console()
    if not console.is_terminal:  # piped or redirected: the whole table (rich would cut it to 80 columns)
        wide = console.options.update_width(1 << 16)
        console = Console(width=max(console.width, console.measure(table, options=wide).maximum))
    console.print(table)


def load_digits(seed: int = 0):
    """scikit-learn's bundled 8x8 handwritten digits (1797 images, no download)
    as float32 in [0, 1], split 75 / 25, stratified, with a fixed seed:
    ``x_train, x_test, y_train, y_test``."""
    from sklearn import datasets
    from sklearn.model_selection import train_test_split

    d = datasets.load_digits()
    x = (d.data / 16.0).astype(np.float32)
    return train_test_split(x, d.target, test_size=0.25, random_state=seed, stratify=d.target)


def xent_grad(logits, y):
    """Gradient of the mean softmax cross-entropy with respect to ``logits``."""
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    return p / len(y)


def fit(params, grads, x, y, epochs: int, batch: int = 32, lr: float = 3e-3, seed: int = 0) -> None:
    """Train ``params`` (float32 arrays, updated in place) with Adam on shuffled
    mini-batches; ``grads(params, xb, yb)`` returns one gradient per param."""
    rng = np.random.default_rng(seed)
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    step = 0
    for _ in range(epochs):
        for idx in np.array_split(rng.permutation(len(x)), -(-len(x) // batch)):
            step += 1
            c1, c2 = 1 - 0.9**step, 1 - 0.999**step
            for p, g, mp, vp in zip(params, grads(params, x[idx], y[idx]), m, v):
                mp += 0.1 * (g - mp)
                vp += 0.001 * (g * g - vp)
                p -= (lr / c1) * mp / (np.sqrt(vp / c2) + 1e-8)


def median_ms(fn, repeats: int, xp=np) -> float:
    """Median wall time of ``fn()`` in milliseconds over ``repeats`` calls after
    one warm-up call (on CuPy, each call waits for the device)."""

    def call():
        fn()
        if xp is not np:
            xp.cuda.Device().synchronize()

    call()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))

